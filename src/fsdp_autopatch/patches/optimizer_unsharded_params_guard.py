"""optimizer_unsharded_params_guard: stop an optimizer that holds FSDP2's *unsharded* parameters.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/optimizer_unsharded_params_guard.md.

Needed here?
    ``FSDPParam.init_unsharded_param`` builds an ``nn.Parameter`` into ``_unsharded_param``,
    ``FSDPParam.to_unsharded`` sets ``_unsharded_param`` on the modules, ``FSDPState._lazy_init``
    sets the root's ``post_forward_mesh_info`` (to None: no reshard after forward; under
    ``_auto_reshard_after_forward`` from 2.8) and ``torch.optim.optimizer`` offers
    ``register_optimizer_step_pre_hook`` -> needed. Anything else -> unsupported.

The guard
    * a wrapper of ``FSDPParam.init_unsharded_param`` records, after torch's method, each new
      unsharded parameter (``id -> (weakref(param), weakref(FSDPParam))``; not a
      ``WeakKeyDictionary``: its lookups compare tensors with ``==``). Later unshards reuse the
      object: one dict lookup and one identity test per call;
    * wrappers of ``Optimizer.__init__`` and ``Optimizer.add_param_group`` install, the first
      time a group holds a recorded unsharded parameter, ONE global optimizer
      step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``), kept for the
      process ([Note: a step hook only where needed] in ``_isolation``). The first
      ``step()`` of each optimizer (then a ``WeakSet`` membership test per step) looks every
      parameter of its ``param_groups`` up; one that is a recorded unsharded parameter (not its
      FSDPParam's ``sharded_param``, ``requires_grad``) makes the step raise
      :class:`fsdp_autopatch.GuardError` naming the parameters, their shapes and places, the fix
      and the toggle, on every rank that holds them (each rank's optimizer is built alike), before
      the optimizer changes anything. An optimizer with such parameters is never marked checked:
      each step raises again. Frozen parameters are skipped (they would not train anyway).
    Why a global hook and not a ``Wrap`` of ``step``: each ``Optimizer`` subclass defines its own
    ``step`` (``add_param_group`` is the base class's), and a process whose optimizers hold no
    unsharded parameter gets no hook at all. A global hook is not a target, so
    ``_patching.revert`` cannot remove it (and torch iterates the hook dict while calling it, so
    it cannot remove itself): it checks first that this patch is applied, and does nothing once
    the patch was reverted, disabled or failed; a later apply reuses it. Not done: replacing the
    parameters in ``param_groups`` (a fix) would rewrite a user object silently, and an optimizer
    loaded from a checkpoint keys its state by the tensor.

Call-time isolation
    The recording runs after torch's method (its result is kept should it raise). The hook's code
    runs inside ``_isolation.isolated``: the only exception it lets out is the GuardError. Nothing
    here is collective.
"""

from __future__ import annotations

import weakref
from typing import Any

from .. import _compat, _events, _isolation, _patching
from .._catalogue import GUARD
from .._spec import Patch, Verdict, Wrap, needed, unsupported
from ._optimizer_groups import group_targets

NAME = "optimizer_unsharded_params_guard"
_MAX_NAMED = 4  # the error names the first few parameters
# id(unsharded parameter) -> (weakref to it, weakref to its FSDPParam)
_unsharded: dict[int, tuple[Any, Any]] = {}
_checked: Any = weakref.WeakSet()  # optimizers whose parameters were checked and found right
_hook: dict[str, Any] = {"handle": None}


def _structural_check() -> Verdict:
    fsdp_param = _compat.fsdp_class("_fsdp_param", "FSDPParam")
    state = _compat.fsdp_class("_fsdp_state", "FSDPState")
    init = _compat.class_attr(fsdp_param, "init_unsharded_param")
    to_unsharded = _compat.class_attr(fsdp_param, "to_unsharded")
    lazy_init = _compat.class_attr(state, "_lazy_init")
    if init is None or not _compat.reads_names(init, "Parameter", "_unsharded_param"):
        return unsupported("FSDPParam.init_unsharded_param does not build an nn.Parameter into _unsharded_param")
    if to_unsharded is None or not _compat.reads_names(to_unsharded, "_setattr_on_modules", "_unsharded_param"):
        return unsupported("FSDPParam.to_unsharded does not set _unsharded_param on the modules")
    if lazy_init is None or not _compat.reads_names(lazy_init, "post_forward_mesh_info"):
        return unsupported("FSDPState._lazy_init does not set the root's post_forward_mesh_info")
    import torch.optim.optimizer as optimizer_module

    if not callable(getattr(optimizer_module, "register_optimizer_step_pre_hook", None)):
        return unsupported("torch.optim.optimizer has no register_optimizer_step_pre_hook")
    when = (
        "when reshard_after_forward was not given"
        if _compat.reads_names(lazy_init, "_auto_reshard_after_forward")
        else "always"
    )
    return needed(
        f"the root keeps its unsharded parameters on the module after forward ({when}): an optimizer "
        "built after a no_grad forward holds them and never trains them"
    )


# --- the registry of unsharded parameters ------------------------------------------------------


def _forget(key: int, reference: Any) -> None:
    entry = _unsharded.get(key)
    if entry is not None and entry[0] is reference:
        del _unsharded[key]


def owner_of(param: Any) -> Any:
    """The FSDPParam whose unsharded parameter ``param`` is, or None."""
    entry = _unsharded.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def record(fsdp_param: Any) -> None:
    """Remember ``fsdp_param``'s unsharded parameter (once per object); arm the hook."""
    param = _compat.unsharded_param(fsdp_param)
    if param is None:
        return
    key = id(param)
    entry = _unsharded.get(key)
    if entry is not None and entry[0]() is param:
        return  # the common path: a later unshard reuses the parameter
    reference = weakref.ref(param, lambda ref, key=key: _forget(key, ref))
    _unsharded[key] = (reference, weakref.ref(fsdp_param))


def _record_unsharded(wrapped, fsdp_param, args, kwargs):
    result = wrapped(*args, **kwargs)
    record(fsdp_param)
    return result


def _arm_if_held(optimizer: Any, groups: Any) -> None:
    """The step hook once a group holds an unsharded parameter ([Note: a step hook only where
    needed] in ``_isolation``); a group added after the optimizer's first step is checked at the next."""
    if any(owner_of(param) is not None for group in groups for param in group["params"]):
        _checked.discard(optimizer)
        if _hook["handle"] is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _hook["handle"] = register_optimizer_step_pre_hook(_isolation.aside_while_compiling(check_before_step))


# --- the check ---------------------------------------------------------------------------------


def is_active() -> bool:
    """Whether the hook checks optimizers: the patch is applied and did not fail at call time."""
    return _patching.in_force(NAME)


def check_before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The global optimizer step pre-hook: torch calls it before every ``step()``."""
    if optimizer in _checked or not is_active():
        return None
    _isolation.isolated(NAME, check_optimizer, optimizer)
    return None


def _name(fsdp_param: Any) -> str:
    fqn = getattr(fsdp_param, "_param_fqn", None)
    if fqn:
        return str(fqn)
    info = getattr(fsdp_param, "_module_info", None)
    return f"{type(info.module).__name__}.{info.param_name}" if info is not None else "?"


def offenders(optimizer: Any) -> list[str]:
    """``head.weight [4, 8] (param_groups[0]['params'][4])`` for each unsharded parameter held."""
    found = []
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            fsdp_param = owner_of(param)
            if fsdp_param is None or fsdp_param.sharded_param is param or not param.requires_grad:
                continue
            size = list(getattr(fsdp_param, "_orig_size", param.shape))
            found.append(f"{_name(fsdp_param)} {size} (param_groups[{g}]['params'][{i}])")
    return found


def check_optimizer(optimizer: Any) -> None:
    """Raise the guard's error if ``optimizer`` holds unsharded parameters; else mark it checked."""
    found = offenders(optimizer)
    if found:
        more = len(found) - _MAX_NAMED
        shown = ", ".join(found[:_MAX_NAMED]) + (f", +{more} more" if more > 0 else "")
        raise _events.stop(
            NAME,
            f"{type(optimizer).__name__} holds {len(found)} FSDP2 unsharded parameter(s): {shown}. They are the "
            "temporary all-gathered parameters fully_shard puts on a module between an unshard and the next "
            "reshard (the root stays unsharded after forward when reshard_after_forward was not given), not the "
            "sharded parameters FSDP2 trains, so this optimizer would never update them",
            "Build the optimizer before the first forward, or call model.reshard() after a no_grad/eval forward "
            "and before building the optimizer from model.parameters()",
        )
    try:
        _checked.add(optimizer)
    except TypeError:  # an optimizer that cannot be weakly referenced: checked at every step
        pass


PATCH = Patch(
    name=NAME,
    summary="an optimizer holding FSDP2's unsharded parameters stops at its first step instead of never training them",
    symptom="silent: the root's parameters never change (an optimizer built after a no_grad forward holds the "
    "root's unsharded parameters, whose grad is always None)",
    trigger="optimizer built from model.parameters() after a no_grad forward, fully_shard(root) without "
    "reshard_after_forward",
    upstream=("PyTorch issue 149205", "PyTorch PR 155319", "PyTorch PR 154704"),
    # read in 2.6 - 2.15 (the root is kept unsharded after forward in each), measured on 2.13 and 2.15
    affected=">=2.6,<2.16",
    check=_structural_check,
    targets=(
        Wrap(f"{_compat.FSDP2_PACKAGE}._fsdp_param:FSDPParam.init_unsharded_param", _record_unsharded),
        *group_targets(_arm_if_held),
    ),
    changes="each optimizer's first step checks that it holds no FSDP2 unsharded parameter",
    kind=GUARD,
)
