"""stale_backward_recovery: the step after a backward that raised trains as if its batch was never seen.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/stale_backward_recovery.md.

Needed here?
    ``FSDPState._pre_forward`` takes ``TrainingState.PRE_BACKWARD`` for a recompute, the final
    callback is guarded by ``post_backward_final_callback_queued``, ``FSDPState._reset_iter_state``
    exists and clears that flag, and ``torch._C._current_graph_task_id`` tells whether a backward
    runs -> needed. Any of them missing -> unsupported.

The replacement
    * ``FSDPState._pre_forward`` wrapped: when the shared flag says a final callback is still
      queued and no backward is running on this thread (``torch._C._current_graph_task_id() ==
      -1``), the backward that queued it was cut off by an exception: the root state's
      ``_reset_iter_state()`` runs first (torch's own local reset: waits for in-flight
      collectives, reshards every unit, clears pending reduce-scatter and all-reduce state,
      post-forward order and indices, sets every state and unit to IDLE, clears the flag), then
      torch's ``_pre_forward`` sees a fresh iteration. The check costs one attribute read per
      pre-forward. It cannot be true in a healthy loop: activation checkpointing's recompute runs
      inside a backward; several forwards before one backward, several losses and backwards per
      step, gradient accumulation (``set_requires_gradient_sync``, ``set_is_last_backward``) and
      2.15's manual finalization all end each backward in the final callback, which clears it.
    * ``FSDPState._reset_iter_state`` wrapped (our recovery and the user's ``reset_iter_state()``):
      when the flag was set before torch's reset (a backward was cut off), every gradient of the
      cut-off iteration is dropped after it, as 2.15's reset does and 2.13's does not: each
      unsharded parameter's ``grad`` and ``unsharded_accumulated_grad``, and each sharded
      parameter's ``grad`` (which the failed backward's reductions may have written). Those of
      earlier ``no_sync`` micro-batches go with them, as torch's docstring of
      ``reset_iter_state`` says: a cut-off accumulation window cannot be split into its
      micro-batches. A reset with no backward cut off is torch's alone. ``fired`` once per
      recovery (and once per user reset that dropped a gradient).
    Nothing here is collective: the recovery is local to each rank (no post-backward runs, so
    neither the unused-param fill nor any reduction; the restore's per-backward usage probe is
    dropped by its own wrapper of ``FSDPParamGroup._reset_iter_state``, so its all-reduce never
    runs for the failed backward). A backward that fails on one rank only leaves its peers in
    collectives this rank never issues: no local reset repairs that.

Call-time isolation
    Both wrappers run before torch's ``_pre_forward`` or after torch's reset. Should our code raise
    before ``_pre_forward``, torch's runs as without the patch (the states stay stale); after the
    reset, the reset stands and the gradients stay (torch's ``reset_iter_state``). Should torch's
    reset raise when our pre-forward calls it (2.15: a gradient reduction owned by another root),
    the patch is recorded failed and torch's ``_pre_forward`` runs as without it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .. import _compat, _events
from .._spec import Patch, Verdict, Wrap, needed, unsupported

NAME = "stale_backward_recovery"
_STATE = f"{_compat.FSDP2_PACKAGE}._fsdp_state"
_RESET = "_reset_iter_state"
_QUEUED = "post_backward_final_callback_queued"
_automatic = threading.local()  # set while our pre-forward recovery runs torch's reset


def _state_class() -> type:
    return _compat.fsdp_class("_fsdp_state", "FSDPState")


def _structural_check() -> Verdict:
    state = _state_class()
    if not callable(getattr(torch._C, "_current_graph_task_id", None)):
        return unsupported("torch._C._current_graph_task_id is missing: cannot tell a recompute from a new forward")
    if _compat.class_attr(state, _RESET) is None:
        return unsupported(f"FSDPState.{_RESET} is missing (torch < 2.13): no local reset to recover with")
    looks_right = (
        _compat.reads_names(_compat.class_attr(state, "_pre_forward"), "_training_state", "PRE_BACKWARD")
        and _compat.reads_names(_compat.class_attr(state, "_register_root_post_backward_final_callback"), _QUEUED)
        and _compat.reads_names(_compat.class_attr(state, "_root_post_backward_final_callback"), _QUEUED)
        and _compat.reads_names(_compat.class_attr(state, _RESET), _QUEUED, "all_states")
    )
    if not looks_right:
        return unsupported(
            f"FSDPState._pre_forward / the final callback / {_RESET} do not read _training_state, "
            f"PRE_BACKWARD, {_QUEUED} as expected: torch left untouched"
        )
    return needed(
        "FSDPState._pre_forward takes a state left in PRE_BACKWARD by a failed backward for a recompute"
    )


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _root_of(state: Any) -> Any:
    return next((s for s in state._state_ctx.all_states if s._is_root), None)


def _stale_units(root: Any) -> str:
    names = []
    for state in root._state_ctx.all_states:
        groups = _compat.state_param_groups(state)
        stale = getattr(state._training_state, "name", "") != "IDLE" or any(
            getattr(g._training_state, "name", "") != "IDLE" for g in groups
        )
        if stale:
            names.append(next((g._module_fqn for g in groups if g._module_fqn), None) or "<root>")
    shown = ", ".join(names[:4]) + (f", +{len(names) - 4} more" if len(names) > 4 else "")
    return f"units left mid-backward: {shown or 'none'}"


def _recover_before_forward(wrapped, state, args, kwargs):
    if getattr(state._state_ctx, _QUEUED, False) and not _in_backward():
        root = _root_of(state)
        if root is not None:
            _automatic.where = _stale_units(root)
            try:
                root._reset_iter_state()  # torch's local reset, through our wrapper below
            finally:
                _automatic.where = None
    return wrapped(*args, **kwargs)


def _drop_grads(root: Any) -> int:
    """What torch 2.15's reset drops and 2.13's keeps: every gradient of the cut-off iteration."""
    dropped = 0
    for group in _compat.all_param_groups(root):
        for fsdp_param in group.fsdp_params:
            for holder in (_compat.unsharded_param(fsdp_param), fsdp_param.sharded_param):
                if holder is not None and holder.grad is not None:
                    holder.grad = None
                    dropped += 1
            if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                fsdp_param.unsharded_accumulated_grad = None
                dropped += 1
    return dropped


def _drop_stale_grads_after_reset(wrapped, root, args, kwargs):
    cut_off = bool(getattr(root._state_ctx, _QUEUED, False))  # read before torch's reset clears it
    result = wrapped(*args, **kwargs)
    if cut_off:
        dropped = _drop_grads(root)
        automatic = getattr(_automatic, "where", None)
        if automatic is not None:
            _events.fired(
                NAME,
                "the next forward would have been taken for a recompute: no gradient reduced, "
                "the sharded parameters never stepped again",
                f"{automatic}; {dropped} gradients of the failed backward dropped",
            )
        elif dropped:
            _events.fired(
                NAME,
                "reset_iter_state would have left the failed backward's gradients to be added into the next reduction",
                f"{dropped} gradients of the failed backward dropped",
            )
    return result


PATCH = Patch(
    name=NAME,
    summary="the step after a backward that raised trains as if its batch was never seen",
    symptom="after a caught exception in backward, no sharded parameter ever gets a gradient again (silently)",
    trigger="a backward raises on every rank (OOM, a raising hook), the loop catches it and goes on",
    upstream=("torchtitan issue 1329", "composer PR 3866"),
    # measured on 2.13 and 2.15 (0 of 6 gradients without the patch); < 2.13 lacks _reset_iter_state
    affected=">=2.13,<2.16",
    check=_structural_check,
    targets=(
        Wrap(f"{_STATE}:FSDPState._pre_forward", _recover_before_forward),
        Wrap(f"{_STATE}:FSDPState.{_RESET}", _drop_stale_grads_after_reset),
    ),
    changes="a backward cut off by an exception is reset locally at the next forward, its unsharded gradients dropped",
)
