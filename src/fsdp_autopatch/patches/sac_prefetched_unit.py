"""sac_prefetched_unit: FSDP2's forward hooks run outside selective activation checkpointing's bookkeeping.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/sac_prefetched_unit.md.

Needed here?
    ``torch.utils.checkpoint`` has ``_CachingTorchDispatchMode`` and ``_CachedTorchDispatchMode``,
    both keep ``func_counter`` and ``storage`` and the cached mode raises "invocation index"
    (indexed replay); ``torch.utils._python_dispatch`` has ``_get_current_dispatch_mode_stack``,
    ``_pop_mode`` and ``_push_mode``; ``FSDPState`` defines ``_pre_forward`` and ``_post_forward``
    and ``FSDPState.init`` registers them (reads both names) -> needed. torch's own
    ``checkpoint.py`` listing the profiler's ``_record_function_enter`` ops in ``SAC_IGNORED_OPS``
    (what both upstream PRs add) -> unsupported: part of upstream's fix is there, its bypass cannot
    be recognised yet. Anything else missing -> unsupported.

The replacement
    ``FSDPState._pre_forward`` and ``FSDPState._post_forward`` are wrapped on the class. torch
    registers them as bound methods (``self._pre_forward``) at ``fully_shard`` time, for one
    module (``register_forward_pre_hook`` / ``register_forward_hook``) and for grouped modules
    (``_register_group_forward_hooks``): the plugin applies when FSDP2 is imported, so every
    ``fully_shard`` after that registers our wrapper (units created before keep torch's hooks).
    When no SAC mode is on this thread's dispatch-mode stack (an empty stack: one C call), torch's
    function is called unchanged. When one is, the modes from the top down to the lowest SAC mode
    are popped, the non-SAC ones pushed back in their order, torch's hook runs, and the stack is
    restored exactly (``finally``). FSDP2's ops are then never policy-checked, counted, cached or
    looked up; the user's ops, which run between the hooks, keep their policy decisions and their
    invocation indices; every other dispatch mode (below SAC, or pushed above it: a FLOP counter,
    DebugMode) still sees FSDP2's ops. Under ``torch.compile`` both wrappers are hidden from Dynamo
    as torch's hooks are (``Wrap.dynamo``'s default): they run eagerly, where the eager stack is. Applied after
    ``stale_backward_recovery`` (``after``), so it is the outer wrapper of ``_pre_forward`` and that
    patch's code runs outside SAC too.

    Behaviour change where the bug does not strike: inside any SAC region the user's policy is no
    longer called for FSDP2's own ops, and they are never saved. Gradients of a policy that does not
    name FSDP2's ops are bitwise unchanged; a save-every-op policy stops producing the silent wrong
    gradients; a policy that counts its calls sees fewer. ``fired`` counts every hook call that ran
    with SAC's modes taken off the stack (two per unit per forward inside a SAC region, two more per
    recompute), whether or not that call would have mismatched: the forward cannot tell what the
    recompute will do.

Call-time isolation
    Our code runs before and after torch's hook. Should it raise while taking the modes off, the
    stack is put back and torch's hook runs as without the patch; should restoring raise after
    torch's hook ran, torch's result is kept (``KEEP_RESULT``). What torch's hook raises propagates
    after the stack is restored. Nothing here is collective, and the decision (a SAC mode on the
    stack) is the same on every rank running the same model.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .. import _compat, _events
from .._spec import Patch, Verdict, Wrap, needed, unsupported

NAME = "sac_prefetched_unit"
_STATE = f"{_compat.FSDP2_PACKAGE}._fsdp_state"
_HOOKS = ("_pre_forward", "_post_forward")
_SAC_CLASSES = ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
_STACK_API = ("_get_current_dispatch_mode_stack", "_pop_mode", "_push_mode")
_PROFILER_OP = "_record_function_enter"  # what upstream's PRs add to SAC_IGNORED_OPS
_WITHOUT = "RuntimeError: <op> invocation index N encountered during backward but not found in storage"


def _checkpoint_module() -> Any:
    from torch.utils import checkpoint

    return checkpoint


def _dispatch_module() -> Any:
    from torch.utils import _python_dispatch

    return _python_dispatch


def _sac_mode_types() -> tuple[type, ...]:
    checkpoint = _checkpoint_module()
    return tuple(getattr(checkpoint, name) for name in _SAC_CLASSES)


def _torch_ignores_profiler_ops(checkpoint: Any) -> bool:
    """Whether torch's own checkpoint.py lists the profiler ops in SAC_IGNORED_OPS (its source,
    not the set: a framework may add them at run time, NeMo Automodel's ensure_fsdp_ops_sac_ignored)."""
    try:
        source = inspect.getsource(checkpoint)
    except (OSError, TypeError):  # no source shipped: the set as it is now
        ignored = getattr(checkpoint, "SAC_IGNORED_OPS", ())
        return any(_PROFILER_OP in str(op) for op in ignored)
    start = source.find("SAC_IGNORED_OPS = ")
    end = source.find("}", start)
    return start >= 0 and _PROFILER_OP in source[start:end]


def _structural_check() -> Verdict:
    checkpoint = _checkpoint_module()
    classes = [getattr(checkpoint, name, None) for name in _SAC_CLASSES]
    if not all(isinstance(cls, type) for cls in classes):
        return unsupported(f"torch.utils.checkpoint has no {' / '.join(_SAC_CLASSES)}")
    indexed = all(_compat.reads_names(vars(cls).get("__init__"), "func_counter", "storage") for cls in classes)
    if not indexed or not _compat.has_string_constant(vars(classes[1]).get("__torch_dispatch__"), "invocation index"):
        return unsupported(
            "SAC does not replay by per-op invocation index (func_counter; torch < 2.13 replays FIFO lists): "
            "not the SAC this patch was measured on"
        )
    dispatch = _dispatch_module()
    missing = [name for name in _STACK_API if not callable(getattr(dispatch, name, None))]
    if missing:
        return unsupported(f"torch.utils._python_dispatch has no {', '.join(missing)}")
    state = _compat.fsdp_class("_fsdp_state", "FSDPState")
    if not all(callable(vars(state).get(name)) for name in _HOOKS):
        return unsupported("FSDPState defines no _pre_forward / _post_forward")
    if not _compat.reads_names(vars(state).get("init"), *_HOOKS):
        return unsupported("FSDPState.init does not register _pre_forward / _post_forward as its hooks")
    if _torch_ignores_profiler_ops(checkpoint):
        return unsupported(
            "torch's SAC_IGNORED_OPS lists the profiler's record_function ops: part of upstream's fix "
            "(PyTorch PRs 185178 / 196862) is there, its bypass is not recognised: torch left untouched"
        )
    return needed(
        "FSDP2's forward hooks run inside a SAC region, whose recompute looks up each op by invocation index"
    )


# --- the dispatch-mode stack -------------------------------------------------------------------


def sac_lowest(stack: list[Any], sac_types: tuple[type, ...]) -> int | None:
    """Index of the lowest SAC mode on ``stack`` (bottom first), or None."""
    return next((index for index, mode in enumerate(stack) if isinstance(mode, sac_types)), None)


class OutsideSac:
    """Take every SAC mode off this thread's dispatch-mode stack, keep every other mode in order;
    :meth:`restore` puts the stack back exactly. ``taken``: whether there was a SAC mode."""

    __slots__ = ("popped", "kept", "pushed", "taken")

    def __init__(self) -> None:
        self.popped: list[Any] = []  # top first
        self.kept: list[Any] = []  # bottom first
        self.pushed = 0
        self.taken = False

    def enter(self, sac_types: tuple[type, ...]) -> bool:
        dispatch = _dispatch_module()
        stack = dispatch._get_current_dispatch_mode_stack()
        lowest = sac_lowest(stack, sac_types)
        if lowest is None:
            return False
        try:
            for _ in range(len(stack) - lowest):
                self.popped.append(dispatch._pop_mode())
            self.kept = [mode for mode in reversed(self.popped) if not isinstance(mode, sac_types)]
            for mode in self.kept:
                dispatch._push_mode(mode)
                self.pushed += 1
        except BaseException:
            self.restore()
            raise
        self.taken = True
        return True

    def restore(self) -> None:
        dispatch = _dispatch_module()
        while self.pushed:
            dispatch._pop_mode()
            self.pushed -= 1
        while self.popped:
            dispatch._push_mode(self.popped.pop())  # bottom of the popped ones first


def _outside_sac(wrapped, args, kwargs, hook: str):
    if torch._C._len_torch_dispatch_stack() == 0:
        return wrapped(*args, **kwargs)
    outside = OutsideSac()
    if not outside.enter(_sac_mode_types()):
        return wrapped(*args, **kwargs)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        outside.restore()
    _events.fired(NAME, _WITHOUT, f"FSDPState.{hook} ran outside SAC")
    return result


def _pre_forward_outside_sac(wrapped, state, args, kwargs):
    return _outside_sac(wrapped, args, kwargs, "_pre_forward")


def _post_forward_outside_sac(wrapped, state, args, kwargs):
    return _outside_sac(wrapped, args, kwargs, "_post_forward")


PATCH = Patch(
    name=NAME,
    summary="an FSDP2 unit unshard()ed or forward-prefetched before a selective-checkpointing region trains",
    symptom=(
        "RuntimeError: profiler._record_function_enter_new.default invocation index 2 encountered during "
        "backward but not found in storage (the op varies)"
    ),
    trigger=(
        "an FSDP2 unit inside a SAC region (create_selective_checkpoint_contexts) whose parameters were "
        "unsharded before it: unit.unshard() or set_modules_to_forward_prefetch"
    ),
    upstream=("NeMo Automodel issue 3958", "torchtitan issue 3427", "PyTorch PR 185178", "PyTorch PR 196862"),
    # measured on 2.13 and 2.15 (the error on every rank); < 2.13 has FIFO-replay SAC (unsupported)
    affected=">=2.13,<2.16",
    check=_structural_check,
    targets=(
        Wrap(f"{_STATE}:FSDPState._pre_forward", _pre_forward_outside_sac),
        Wrap(f"{_STATE}:FSDPState._post_forward", _post_forward_outside_sac),
    ),
    changes="FSDPState._pre_forward/_post_forward run with SAC's dispatch modes off the stack, other modes kept",
    after=("stale_backward_recovery",),
)
