"""reshard_stale_unsharded: a unit still unsharded when ``optimizer.step()`` runs is resharded, so
the next forward all-gathers the stepped weights instead of reusing the copy gathered before.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/reshard_stale_unsharded.md.

The mechanism
    ``FSDPParamGroup.unshard()`` returns at once when the group is already unsharded. The optimizer
    steps the sharded parameters; the unsharded copy, gathered before, is not touched. A unit still
    unsharded at ``step()`` (``set_reshard_after_backward(False)`` left on, the root's
    ``reshard_after_forward=False`` plus a ``no_grad`` forward before the step, a unit unsharded by
    hand) computes its next forward with the weights of before the step, and meanwhile exposes its
    plain unsharded parameters, without gradients, to ``model.parameters()``.

Needed here?
    ``FSDPParamGroup.unshard`` returns early on ``is_unsharded``, ``FSDPParamGroup.post_backward``
    keeps the group unsharded unless ``reshard_after_backward``, ``FSDPParamGroup.reshard`` goes to
    ``_to_sharded``, ``FSDPState._root_post_backward_final_callback`` reads ``_state_ctx`` /
    ``is_last_backward``, ``FSDPState._post_forward(module, input, output)`` exists, and
    ``torch.optim.optimizer`` offers ``register_optimizer_step_pre_hook`` -> needed. Anything else
    -> unsupported (torch untouched).

The replacement
    * ``FSDPParamGroup.post_backward``: before torch's method, whether this call reduces gradients
      (``reduce_grads`` on, the group keeps its copy, a local gradient or
      ``reduce_scatter_unused_params``): two attribute reads in the default configuration. After
      it, a group that reduced, has no HSDP partial output waiting (an accumulation window that
      reduce-scatters but does not all-reduce yet) and is still unsharded is remembered (a
      ``WeakSet``); any other call forgets it. Micro-batches with the sync off are never
      remembered: they keep their copy, as ``set_reshard_after_backward(False)`` intends.
    * ``FSDPState._root_post_backward_final_callback`` (the end of a backward) and, on torch 2.15,
      ``FSDPState._end_backward_iteration`` (where automatic and manual finalization both end):
      after torch's method, when the backward is finalized (``is_last_backward``, not manual
      finalization), each remembered group of this root that is still unsharded and idle is
      resharded (``FSDPParamGroup.reshard()``, what ``model.reshard()`` calls): the module exposes
      the sharded parameters with their gradients again (``clip_grad_norm_(model.parameters())``).
      The callback also records the root's shared state context and, the first time a unit of it
      is still unsharded then, installs ONE global optimizer step pre-hook, kept for the process;
      so does ``FSDPState._post_forward`` of a forward without autograd (an evaluation) that leaves
      its unit unsharded (the root, by default): [Note: a step hook only where needed] in
      ``_isolation`` (on Python 3.13 any step pre-hook changes a compiled step).
    * the step pre-hook (``_isolation.aside_while_compiling``: nothing of ours in a compiled step)
      looks at every group of the recorded roots: one that is unsharded and idle (its root is not
      in a forward or a backward, the group's training state is IDLE, no all-gather waits for its
      copy-out) and holds a sharded parameter this optimizer steps is resharded before the step.
      A run where every unit is sharded at each step (the defaults) only pays that look-up.
    Resharding runs on the caller's current stream, as ``model.reshard()`` and torch's own
    post-backward reshard do: it frees the all-gather output after the work already queued on that
    stream. It changes which tensors the module holds, never a value: the next forward all-gathers
    the current shards (the CPU-offloaded ones too) over the unit's shard group (HSDP included).
    Left to torch: a unit whose all-gather was issued before the step and is waited on after it
    (its output holds the old shards), and a post-forward shard of ``reshard_after_forward=<int>``.

Call-time isolation
    The wrappers' code before torch's method falls back to torch's method as it came; after it,
    torch's result is kept. The hook runs inside ``_isolation.isolated`` and lets nothing out. A
    global hook is not a target: it does nothing once this patch is reverted, disabled or failed.
    Nothing here is collective: every rank of a unit reshards it alike, as its state is the same.
"""

from __future__ import annotations

import weakref
from typing import Any

from .. import _compat, _events, _isolation, _patching
from .._spec import Patch, Verdict, Wrap, needed, unsupported

NAME = "reshard_stale_unsharded"
_GROUP = f"{_compat.FSDP2_PACKAGE}._fsdp_param_group"
_STATE = f"{_compat.FSDP2_PACKAGE}._fsdp_state"
_CALLBACK = "_root_post_backward_final_callback"
_END_ITERATION = "_end_backward_iteration"  # torch 2.15: where every finalization path ends
_WITHOUT_STEP = "the next forward would reuse the unsharded copy gathered before optimizer.step()"
_WITHOUT_BACKWARD = ("the unit would stay unsharded after the reduction: model.parameters() shows its "
                     "unsharded copy without gradients, and the next forward after the step reuses it")
_reduced: Any = weakref.WeakSet()  # groups whose last post-backward reduced and left them unsharded
_contexts: Any = weakref.WeakSet()  # the shared FSDPStateContext of each root seen at a backward's end
_hook: dict[str, Any] = {"handle": None}


def _structural_check() -> Verdict:
    group = _compat.fsdp_class("_fsdp_param_group", "FSDPParamGroup")
    state = _compat.fsdp_class("_fsdp_state", "FSDPState")
    unshard = _compat.class_attr(group, "unshard")
    post_backward = _compat.class_attr(group, "post_backward")
    reshard = _compat.class_attr(group, "reshard")
    callback = _compat.class_attr(state, _CALLBACK)
    if unshard is None or not _compat.reads_names(unshard, "is_unsharded"):
        return unsupported("FSDPParamGroup.unshard does not return early on is_unsharded")
    if post_backward is None or not _compat.reads_names(post_backward, "reshard_after_backward", "reduce_grads"):
        return unsupported("FSDPParamGroup.post_backward does not read reshard_after_backward / reduce_grads")
    if reshard is None or not _compat.reads_names(reshard, "_to_sharded"):
        return unsupported("FSDPParamGroup.reshard does not go to _to_sharded")
    if callback is None or not _compat.reads_names(callback, "_state_ctx", "is_last_backward", "all_states"):
        return unsupported(f"FSDPState.{_CALLBACK} does not read _state_ctx.is_last_backward / all_states")
    if not _compat.has_parameters(_compat.class_attr(state, "_post_forward"), "module", "input", "output"):
        return unsupported("FSDPState._post_forward(module, input, output) not found")
    import torch.optim.optimizer as optimizer_module

    if not callable(getattr(optimizer_module, "register_optimizer_step_pre_hook", None)):
        return unsupported("torch.optim.optimizer has no register_optimizer_step_pre_hook")
    return needed(
        "FSDPParamGroup.unshard returns at once on an unsharded group: a unit still unsharded at "
        "optimizer.step() computes its next forward with the copy gathered before the step"
    )


def _has_end_iteration() -> bool:
    return _compat.class_attr(_compat.fsdp_class("_fsdp_state", "FSDPState"), _END_ITERATION) is not None


def _forget() -> None:
    _reduced.clear()
    _contexts.clear()


_patching.on_revert(NAME, _forget)


# --- which groups are idle ---------------------------------------------------------------------


def _is_idle(group: Any) -> bool:
    """Unsharded, not in a forward or backward of its own, no all-gather waiting for its copy-out."""
    return (
        group.is_unsharded
        and getattr(group._training_state, "name", None) == "IDLE"
        and getattr(group, "_all_gather_result", None) is None
    )


def _iteration_active(context: Any) -> bool:
    """A forward or a backward of this root is running (an optimizer stepping inside backward)."""
    return (getattr(context, "iter_forward_root", None) is not None
            or bool(getattr(context, "post_backward_final_callback_queued", False)))


def _groups(context: Any) -> list[Any]:
    return [group for state in context.all_states for group in _compat.state_param_groups(state)]


def _reshard(group: Any, without: str) -> None:
    group.reshard()
    _events.fired(NAME, without, str(getattr(group, "_module_fqn", None) or "<root>"))


# --- (1) a reduction that leaves the unit unsharded ---------------------------------------------


def _remember_reduced(wrapped, group, args, kwargs):
    """``FSDPParamGroup.post_backward``: remember a group it reduces and leaves unsharded."""
    reduces = (
        group.reduce_grads
        and not group.reshard_after_backward
        and (getattr(group, "reduce_scatter_unused_params", False)
             or any(_compat.has_local_grad(fsdp_param) for fsdp_param in group.fsdp_params))
    )
    result = wrapped(*args, **kwargs)
    if reduces and group.is_unsharded and getattr(group, "_partial_reduce_output", None) is None:
        _reduced.add(group)
    elif _reduced:
        _reduced.discard(group)
    return result


def _reshard_reduced(context: Any) -> None:
    """At the end of a finalized backward: reshard this root's remembered groups."""
    if not _reduced:
        return
    for group in _groups(context):
        if group in _reduced:
            _reduced.discard(group)
            if _is_idle(group) and not group.reshard_after_backward:
                _reshard(group, _WITHOUT_BACKWARD)


def _after_final_callback(wrapped, state, args, kwargs):
    context = state._state_ctx
    manual = getattr(context, "manual_backward_finalization_active", None)  # 2.15; reset by the call
    result = wrapped(*args, **kwargs)
    if context.is_last_backward and not manual:
        _reshard_reduced(context)
    _arm_if_kept(context, _groups(context))
    return result


def _after_end_of_iteration(wrapped, state, args, kwargs):
    result = wrapped(*args, **kwargs)  # torch 2.15: the reductions were waited on first
    _reshard_reduced(state._state_ctx)
    return result


def _after_forward(wrapped, state, args, kwargs):
    """``FSDPState._post_forward``: a forward without autograd (an evaluation) has no backward to
    reshard its units; one it leaves unsharded (the root, by default) arms the step hook."""
    result = wrapped(*args, **kwargs)
    if _hook["handle"] is None and not _grad_enabled():
        _arm_if_kept(state._state_ctx, _compat.state_param_groups(state))
    return result


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


# --- (2) the optimizer step pre-hook ------------------------------------------------------------


def _arm_if_kept(context: Any, groups: list[Any]) -> None:
    """Record the root; install the step hook the first time one of ``groups`` stays unsharded
    ([Note: a step hook only where needed] in ``_isolation``: a run whose units are all sharded at
    the end of each backward and each evaluation gets none)."""
    _contexts.add(context)
    if _hook["handle"] is None and any(group.is_unsharded for group in groups):
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook["handle"] = register_optimizer_step_pre_hook(_isolation.aside_while_compiling(before_step))


def is_active() -> bool:
    return _patching.in_force(NAME)


def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The global optimizer step pre-hook: torch calls it before every ``step()``."""
    if _contexts and is_active():
        _isolation.isolated(NAME, reshard_for, optimizer)
    return None


def reshard_for(optimizer: Any) -> None:
    """Reshard every idle unsharded group with a sharded parameter that ``optimizer`` steps."""
    kept = [group for context in list(_contexts) if not _iteration_active(context)
            for group in _groups(context) if _is_idle(group)]
    if not kept:
        return
    stepped = {id(param) for param_group in optimizer.param_groups for param in param_group["params"]}
    for group in kept:
        if any(id(fsdp_param.sharded_param) in stepped for fsdp_param in group.fsdp_params):
            _reduced.discard(group)
            _reshard(group, _WITHOUT_STEP)


PATCH = Patch(
    name=NAME,
    summary="a unit left unsharded across `optimizer.step()` is resharded, so the next forward uses the "
            "stepped weights",
    symptom="silent: the forward after optimizer.step() reuses the unsharded weights gathered before it, and "
            "clip_grad_norm_(model.parameters()) sees a norm of 0.0 (the unsharded copies have no gradients)",
    trigger="a unit still unsharded at optimizer.step(): set_reshard_after_backward(False) left on, the root's "
            "reshard_after_forward=False plus a no_grad forward before the step, a unit unsharded by hand",
    upstream=("PyTorch PR 137348 (the same mechanism for prefetches)", "Robbyant/lingbot-vla PR 50"),
    # measured 2.13, 2.15; read, not run, 2.14 (the same early return in unshard); 2.6 - 2.12 inferred.
    # <2.16 means "measured up to 2.15", not "fixed in 2.16": on a later release the check decides.
    affected=">=2.6,<2.16",
    check=_structural_check,
    targets=(
        Wrap(f"{_GROUP}:FSDPParamGroup.post_backward", _remember_reduced),
        Wrap(f"{_STATE}:FSDPState.{_CALLBACK}", _after_final_callback),
        Wrap(f"{_STATE}:FSDPState.{_END_ITERATION}", _after_end_of_iteration, when=_has_end_iteration),
        Wrap(f"{_STATE}:FSDPState._post_forward", _after_forward),
    ),
    changes="units still unsharded after a reducing backward or at optimizer.step() are resharded",
)
