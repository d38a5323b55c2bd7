"""grouped_module_reuse: a grouped unit's repeat call inside the root's forward gets a pre-backward hook.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/grouped_module_reuse.md.

Needed here?
    ``_fsdp_state._register_group_forward_hooks(modules, pre_hook, post_hook, modules_to_run,
    cast_output_dtype)`` exists (or its 5th parameter is ``post_partial_forward``: PyTorch's
    pending-gradient rewrite, commit acf70b43, whose partial path also publishes CPU gradient
    owners; the same partial path otherwise, wrapped by that name), ``FSDPState._post_forward`` calls
    ``_force_complete_incomplete_states``, and the group post-hook's partial path reads nothing
    but ``remove`` / ``len`` -> needed. No ``_force_complete_incomplete_states`` (2.6 - 2.12)
    -> not needed, conclusively. A partial path that does more -> not needed (torch changed it).
    Anything else -> unsupported.

The replacement
    ``_register_group_forward_hooks`` is wrapped: torch registers its own hooks, around three small
    functions in place of the ``pre_hook`` / ``post_hook`` / partial path's hook it receives. On
    the partial path, inside another state's root forward, the autograd nodes of the output are
    remembered; a call that completes the group forgets them (torch hooks the completing output);
    a new pass forgets stale ones. ``FSDPState._force_complete_incomplete_states`` is wrapped: after
    torch's body, each remembered node of a force-completed state that is not the node of a root
    output gets a node pre-hook running the state's ``_pre_backward`` (what the tensor hook a
    single-module unit puts on every call's output does). Nothing else changes: single-module
    units, groups that complete in the forward and calls outside a root forward (chunked loss)
    are never hooked.

Call-time isolation
    ``_register_group_forward_hooks`` gets three hooks of ours around torch's; in each, our part
    (forgetting or remembering nodes) runs isolated and torch's hook runs unguarded, so torch's
    errors stay torch's. The force-complete wrapper's work runs after torch's; should it raise,
    torch's output is returned without the extra hooks (the bug's behaviour, as without the
    patch). All of it is local to the rank: no collective.
"""

from __future__ import annotations

import weakref

import torch

from .. import _compat, _events, _isolation
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

NAME = "grouped_module_reuse"
_STATE = f"{_compat.FSDP2_PACKAGE}._fsdp_state"
_FORCE_COMPLETE = "_force_complete_incomplete_states"
# the partial path's hook, the group hook's 5th parameter: 2.13 - 2.15 / the pending-gradient rewrite
_PARTIAL_HOOKS = ("cast_output_dtype", "post_partial_forward")
_HOOKS = ("pre_hook", "post_hook")  # what the wrapper replaces, by name, with the partial path's hook
# torch's partial path removes the module from the set and compares its length, nothing else
_PARTIAL_PATH_NAMES = {"remove", "len"}
# the FSDPState methods the root's _post_forward of 2.6 - 2.12 calls (read in the 2.8 and 2.12 wheels)
_POST_FORWARD_CALLS = {"_register_pre_backward_hook", "_cast_output_dtype"}
_PARTIAL_PATH_FREEVARS = {"module", "modules_to_run", "post_hook"}  # and the partial path's hook
_WITHOUT = "RuntimeError: setStorage: ... out of bounds for storage of size 0 in backward"

# FSDPState -> autograd nodes of partial-path outputs made inside another state's root forward.
# Keyed by state, so ranks sharing a process (threaded process groups) never see each other's;
# emptied when the group completes, when the root force-completes it, or at the group's next pass.
_remembered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _structural_check() -> Verdict:
    state_module = _compat.fsdp_module("_fsdp_state")
    state_class = state_module.FSDPState
    force = _compat.class_attr(state_class, _FORCE_COMPLETE)
    if force is None:
        return _without_force_complete(state_class)
    # pre_hook / post_hook / the partial path's hook are checked by name from the target's ``reads``;
    # every other argument is forwarded as it came.
    group_hooks = getattr(state_module, "_register_group_forward_hooks", None)
    if group_hooks is None:
        return unsupported("_fsdp_state._register_group_forward_hooks not found")
    if not _compat.reads_names(force, "_modules_to_run_forward", "post_forward"):
        return unsupported(f"FSDPState.{_FORCE_COMPLETE} differs from the measured releases")
    if not _compat.reads_names(_compat.class_attr(state_class, "_post_forward"), _FORCE_COMPLETE):
        return unsupported("FSDPState._post_forward does not force-complete incomplete groups")
    partial = _compat.nested_code(group_hooks, "wrapped_post_hook")
    hook = partial_hook_name()
    if partial is None or hook is None or set(partial.co_freevars) != _PARTIAL_PATH_FREEVARS | {hook}:
        return unsupported("the group post-hook differs from the measured releases")
    if not set(partial.co_names) <= _PARTIAL_PATH_NAMES:
        return not_needed("the group post-hook's partial path does more than cast the output")
    return needed("a grouped unit's partial post-forward registers no pre-backward hook; the root force-completes it")


def partial_hook_name() -> str | None:
    """The name of the partial path's hook in this torch's ``_register_group_forward_hooks``."""
    group_hooks = getattr(_compat.fsdp_module("_fsdp_state"), "_register_group_forward_hooks", None)
    return next((name for name in _PARTIAL_HOOKS if _compat.has_parameters(group_hooks, name)), None)


def _without_force_complete(state_class: type) -> Verdict:
    """No force-complete: not needed only if the root's post-forward is the one of 2.6 - 2.12,
    which calls no FSDPState method that could complete (reshard) another unit's group. A missing
    method alone proves nothing: torch may have renamed it."""
    post_forward = _compat.class_attr(state_class, "_post_forward")
    code = _compat.code_of(post_forward)
    if code is None:
        return unsupported("FSDPState._post_forward not found")
    calls = {name for name in code.co_names if callable(_compat.class_attr(state_class, name))}
    unknown = sorted(calls - _POST_FORWARD_CALLS)
    if unknown:
        return unsupported(
            f"no FSDPState.{_FORCE_COMPLETE}, but _post_forward calls {', '.join(unknown)}: "
            "cannot tell whether it completes other groups, torch left untouched"
        )
    return not_needed(
        f"no FSDPState.{_FORCE_COMPLETE} and _post_forward completes no other group: "
        "a partial group stays unsharded until backward",
        conclusive=True,
    )


def _grad_nodes(output) -> list:
    """The autograd nodes of the grad-requiring tensors in ``output``, found the way torch finds
    the tensors it hooks (``collect_grad_tensors``: dict, list, tuple, NamedTuple, dataclass)."""
    collect = getattr(_compat.fsdp_module("_fsdp_state"), "collect_grad_tensors", None)
    if collect is not None:
        tensors = collect(output)
    else:
        tensors = torch.utils._pytree.tree_leaves(output)
    return [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _remember(state, output) -> None:
    # Only inside another state's root forward does a force-complete follow; a call outside it
    # (chunked loss) claims iter_forward_root itself or finds none.
    root = state._state_ctx.iter_forward_root
    if root is None or root is state or not torch.is_grad_enabled():
        return
    nodes = _grad_nodes(output)
    if nodes:  # nodes, not tensors: a consumed output is gone while its node waits for backward
        _remembered.setdefault(state, []).extend(nodes)


def _hook_partial_outputs_through(partial_hook: str):
    """The wrapper of ``_register_group_forward_hooks`` whose partial path's hook is ``partial_hook``."""

    def wrapper(wrapped, instance, args, kwargs):
        return _hook_partial_outputs(wrapped, args, kwargs, partial_hook)

    return wrapper


def _hook_partial_outputs(wrapped, args, kwargs, partial_hook: str):
    pre_hook, post_hook, on_partial = (wrapped.argument(name) for name in (*_HOOKS, partial_hook))
    state = getattr(post_hook, "__self__", None)  # FSDPState.init hands over its bound _post_forward
    if state is None:
        return wrapped(*args, **kwargs)
    forward = _compat.fsdp_module("_fsdp_common").TrainingState.FORWARD

    # Torch calls these three in every forward: our part of each is isolated (on an exception of
    # ours the patch is recorded failed and torch's hook still runs), torch's hooks run unguarded.
    def start_pass(*hook_args, **hook_kwargs):
        _isolation.isolated(NAME, _forget_if_new_pass, state, forward)
        return pre_hook(*hook_args, **hook_kwargs)

    def complete(*hook_args, **hook_kwargs):  # torch hooks the completing output, fed by the pass
        _isolation.isolated(NAME, _remembered.pop, state, None)
        return post_hook(*hook_args, **hook_kwargs)

    def partial_and_remember(output):  # the partial path: torch casts here (and publishes CPU grad owners)
        output = on_partial(output)
        _isolation.isolated(NAME, _remember, state, output)
        return output

    return wrapped.again(pre_hook=start_pass, post_hook=complete, **{partial_hook: partial_and_remember})


def _forget_if_new_pass(state, forward) -> None:
    if state._training_state is not forward:  # a new pass: what an earlier one left is stale
        _remembered.pop(state, None)


def _unshard_before(state):
    def pre_hook(grad_outputs):  # returns nothing: the gradients go on unchanged
        state._pre_backward(grad_outputs[0] if grad_outputs else None)

    return pre_hook


def _hook_remembered_outputs(wrapped, root_state, args, kwargs):
    if not _remembered:
        return wrapped(*args, **kwargs)
    states = root_state._state_ctx.all_states
    incomplete = [s for s in states if s is not root_state and s._modules_to_run_forward]
    output = wrapped(*args, **kwargs)
    hooked = {id(node) for node in _grad_nodes(output)}  # torch hooked the root's output
    for state in incomplete:
        for node in _remembered.get(state, ()):
            if id(node) in hooked:
                continue
            hooked.add(id(node))
            node.register_prehook(_unshard_before(state))
            _events.fired(NAME, _WITHOUT, f"a repeat call of {_modules_of(state)}")
    for state in states:
        _remembered.pop(state, None)
    return output


def _modules_of(state) -> str:
    return ", ".join(type(module).__name__ for module in getattr(state, "_modules", ()))


PATCH = Patch(
    name=NAME,
    summary="a grouped unit's module called again in the root's forward (MTP head) keeps its weights for backward",
    symptom="RuntimeError: setStorage: ... out of bounds for storage of size 0",
    trigger="fully_shard([norm, head]), head called again inside the root's forward, its output not returned",
    upstream=("PyTorch issue 183702", "PyTorch PR 180428"),
    # measured: 2.13 - 2.15 fail, 2.8 - 2.12 right (no force-complete; nor in 2.6, 2.7).
    # <2.16 means "measured up to 2.15", not "fixed in 2.16": on a later release the check decides.
    affected=">=2.13,<2.16",
    check=_structural_check,
    targets=(
        *(Wrap(f"{_STATE}:_register_group_forward_hooks", _hook_partial_outputs_through(hook),
               reads=(*_HOOKS, hook), when=lambda hook=hook: partial_hook_name() == hook) for hook in _PARTIAL_HOOKS),
        Wrap(f"{_STATE}:FSDPState.{_FORCE_COMPLETE}", _hook_remembered_outputs),
    ),
    changes="repeat calls of a grouped unit inside the root's forward get its pre-backward hook",
)
