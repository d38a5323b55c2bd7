"""restore_unused_param_grads: keep ``grad is None`` for a parameter that no rank used.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/restore_unused_param_grads.md.

Needed here?
    A fill must exist (``FSDPModule.set_reduce_scatter_unused_params``) and the wrapped internals
    must be there: ``FSDPParamGroup.post_backward`` and
    ``FSDPState._root_post_backward_final_callback``; on a release with manual backward
    finalization (``FSDPModule.finalize_backward``, torch 2.15) also
    ``FSDPState._end_backward_iteration`` (reading ``_state_ctx.all_states``), reached from
    ``FSDPState.wait_for_gradient_reduction``, and the callback's
    ``manual_backward_finalization_active``; where ``FSDPModule.synchronize_gradients`` exists
    (PyTorch's pending-gradient rewrite, commit acf70b43) also the unit's
    ``FSDPParamGroup.synchronize_gradients`` running ``post_backward`` and the module's reaching
    its units' (``_fsdp_param_groups``). No fill -> not needed (nothing creates the zeros);
    missing internals -> unsupported.

The replacement
    * ``FSDPParamGroup.post_backward`` wrapped (outside the backport's fill, so it runs first): for
      a unit with the fill on that reduces in this backward, record per parameter whether this
      rank has a local gradient (an unsharded or accumulated gradient exists: usage comes from
      gradient *presence*, never from a zero value) and whether its sharded gradient already
      existed (then the reduction accumulates into it and it must stay).
    * At the end of each backward, the usage flags are reduced with MAX over each parameter's
      reduction domain (the shard process group, and the replicate group under HSDP), all flags of
      one process group packed into one int32 all-reduce. A parameter that no rank used and whose
      sharded gradient this reduction created gets ``grad = None`` again. The probes are taken
      off the groups before the all-reduce, so a second end-of-backward hook finds none: the
      restore runs once per backward, whichever way the backward is finalized:
      - ``FSDPState._root_post_backward_final_callback`` wrapped: after torch's callback (every
        reduction issued), unless manual finalization is active for this backward (then the
        callback only marks groups pending, their reductions come later). This covers automatic
        finalization on every release and the pipelining schedules of 2.8 - 2.14, which call
        ``post_backward`` and then this callback by hand (``_PipelineStageBase.perform_reduce_grad``).
      - ``FSDPState._end_backward_iteration`` wrapped (torch 2.15): where automatic finalization
        (``wait_for_gradient_reduction`` from the callback), ``finalize_backward()``,
        ``finalize_backward(async_op=True).wait()`` and 2.15's pipelining schedules (manual, async)
        all end, after the reductions were waited for.
      - ``FSDPModule.synchronize_gradients`` wrapped where it exists (the pending-gradient
        rewrite): it runs each unit's ``post_backward`` outside any backward, after the last
        backward's callback, so the fill's zeros would otherwise reach ``step()``. After torch's
        call, the units of the module's subtree that carry a probe are restored (only the
        synchronized ones can: every backward's end takes its probes off).
      - ``FSDPParamGroup._reset_iter_state`` wrapped where it exists (2.13+): a reset iteration is
        lost, and so is its usage probe.
    A unit whose fill is off records nothing and adds no collective at all.

Call-time isolation
    The usage probe runs before torch's ``post_backward``; the restore runs after torch's callback
    (or ``_end_backward_iteration``) returned. Should our code raise before torch's call, torch's
    runs; after it, torch's result is kept and the zeros stay (torch's behaviour, not a wrong one:
    the optimizer sees exact zeros). The usage all-reduce is torch's collective
    (``_isolation.torch_call``): what it raises (a peer's timeout) propagates. Across ranks: the
    probes and flags are built before the all-reduce on every rank, so a failure caused by a
    changed torch strikes every rank before it and no rank enters it; a failure on one rank only
    leaves its peers in the all-reduce until the process group's timeout (gloo raises, NCCL's
    watchdog aborts), which then propagates as torch's error. After the all-reduce only local
    assignments (``grad = None``) remain.

Limitation
    Under HSDP with the all-reduce deferred (``set_requires_all_reduce(False)``), a reduction that
    folds into a pending partial reduce is not treated as creating the gradient (the partial reduce
    may hold earlier micro-batches' gradients, which must survive). So a parameter that no rank
    used in any micro-batch of such a window keeps the reduced zero.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import _compat, _events, _isolation
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported
from . import unused_param_reduction

_CALLBACK = "_root_post_backward_final_callback"
_END_ITERATION = "_end_backward_iteration"  # torch 2.15: where every finalization path ends
_SYNCHRONIZE = "synchronize_gradients"  # the pending-gradient rewrite: post_backward outside backward
_RESET = "_reset_iter_state"  # FSDPParamGroup, torch 2.13+: recovery after a failed iteration
_PROBE = "_fsdp_autopatch_usage_probe"  # FSDPParamGroup attribute, lives for one backward
_FSDP2 = _compat.FSDP2_PACKAGE


class _UsageProbe:
    """What one rank saw for one ``FSDPParamGroup`` in this backward, one entry per FSDPParam."""

    __slots__ = ("used", "grad_existed")

    def __init__(self, group: Any) -> None:
        self.used = [_compat.has_local_grad(p) for p in group.fsdp_params]
        # HSDP with a deferred all-reduce: this reduction folds into a pending partial reduce that
        # may hold earlier micro-batches' gradients, so it does not "create" the gradient.
        folds_into_partial = getattr(group, "_partial_reduce_output", None) is not None
        self.grad_existed = [folds_into_partial or p.sharded_param.grad is not None for p in group.fsdp_params]

    def merge(self, group: Any) -> None:
        # post_backward ran twice in one backward (grouped units): usage is the union.
        self.used = [u or _compat.has_local_grad(p) for u, p in zip(self.used, group.fsdp_params)]


def _param_group_and_state() -> tuple[type, type]:
    return (
        _compat.fsdp_class("_fsdp_param_group", "FSDPParamGroup"),
        _compat.fsdp_class("_fsdp_state", "FSDPState"),
    )


def _structural_check() -> Verdict:
    if not unused_param_reduction.has_fill():
        # Not a property of the release: before 2.13 only the backport provides a fill.
        return not_needed(
            "no unused-param fill to undo (no FSDPModule.set_reduce_scatter_unused_params, "
            "and the backport is not applied)",
            conclusive=True,
        )
    param_group, state = _param_group_and_state()
    # What the wrappers read: group.fsdp_params / reduce_grads / mesh_info (set in __init__; 2.15
    # moved the per-param loop out of post_backward), and the root's _state_ctx.all_states.
    looks_right = (
        _compat.reads_names(_compat.class_attr(param_group, "__init__"), "fsdp_params", "reduce_grads", "mesh_info")
        and _compat.reads_names(_compat.class_attr(param_group, "post_backward"), "reduce_grads")
        and _compat.reads_names(_compat.class_attr(state, _CALLBACK), "_state_ctx", "all_states")
    )
    if not looks_right:
        return unsupported(
            f"FSDPParamGroup / FSDPState.{_CALLBACK} do not look as expected "
            "(fsdp_params, reduce_grads, mesh_info, _state_ctx.all_states)"
        )
    source = "torch's" if unused_param_reduction.has_native_api() else "the backported"
    if has_synchronize_gradients() and not _synchronize_looks_right(param_group):
        return unsupported(
            f"FSDPModule.{_SYNCHRONIZE} exists but does not reach FSDPParamGroup.{_SYNCHRONIZE} through "
            f"_fsdp_param_groups, or that does not run post_backward: its zeros would reach step()"
        )
    if not has_manual_finalization():
        return needed(f"{source} unused-param fill turns None into zero")
    if not _manual_finalization_looks_right(state):
        return unsupported(
            f"FSDPModule.finalize_backward exists but FSDPState.{_END_ITERATION} (reached from "
            f"wait_for_gradient_reduction, reading _state_ctx.all_states) or {_CALLBACK}'s "
            "manual_backward_finalization_active is missing: manually finalized backwards would keep the zeros"
        )
    return needed(f"{source} unused-param fill turns None into zero, also in manually finalized backwards")


def has_manual_finalization() -> bool:
    """Whether this torch lets the caller finalize backward (``FSDPModule.finalize_backward``, 2.15)."""
    return _compat.class_attr(_compat.fsdp_class("_fully_shard", "FSDPModule"), "finalize_backward") is not None


def has_synchronize_gradients() -> bool:
    """Whether pending gradients can be reduced outside a backward (``FSDPModule.synchronize_gradients``,
    PyTorch's pending-gradient rewrite)."""
    return _compat.class_attr(_compat.fsdp_class("_fully_shard", "FSDPModule"), _SYNCHRONIZE) is not None


def _synchronize_looks_right(param_group: type) -> bool:
    # The module's call must reach each unit's, and the unit's must run post_backward (our probe).
    module = _compat.fsdp_class("_fully_shard", "FSDPModule")
    return _compat.reads_names(
        _compat.class_attr(module, _SYNCHRONIZE), "_fsdp_param_groups", _SYNCHRONIZE
    ) and _compat.reads_names(_compat.class_attr(param_group, _SYNCHRONIZE), "post_backward")


def _has_reset() -> bool:
    param_group, _ = _param_group_and_state()
    return _compat.class_attr(param_group, _RESET) is not None


def _manual_finalization_looks_right(state: type) -> bool:
    # Every finalization path must reach _end_backward_iteration (via wait_for_gradient_reduction),
    # and the callback must tell a manual backward apart, so that the restore runs once, at the end.
    return (
        _compat.reads_names(_compat.class_attr(state, _END_ITERATION), "_state_ctx", "all_states")
        and _compat.reads_names(_compat.class_attr(state, "wait_for_gradient_reduction"), _END_ITERATION)
        and _compat.reads_names(_compat.class_attr(state, _CALLBACK), "manual_backward_finalization_active")
    )


def _probe_usage(wrapped, group, args, kwargs):
    if group.reduce_grads and getattr(group, unused_param_reduction.FLAG, False):
        probe = vars(group).get(_PROBE)
        if probe is None:
            setattr(group, _PROBE, _UsageProbe(group))
        else:
            probe.merge(group)
    return wrapped(*args, **kwargs)


def restore_unused(groups: list[Any]) -> None:
    """Reset the gradients this backward's reductions created for parameters no rank used."""
    by_domain: dict[tuple[Any, ...], list[tuple[Any, _UsageProbe]]] = {}
    for group in groups:  # same order on every rank: all_states follows the module tree
        # Taken off before any collective: whatever happens next, no probe outlives this backward.
        by_domain.setdefault(_compat.reduction_domain(group), []).append((group, vars(group).pop(_PROBE)))
    for domain, entries in by_domain.items():
        flags = [int(used) for _, probe in entries for used in probe.used]
        if domain and flags:
            packed = _flags_tensor(flags, entries[0][0].device)
            for process_group in domain:  # torch's collective: what it raises is torch's
                _isolation.torch_call(dist.all_reduce, packed, op=dist.ReduceOp.MAX, group=process_group)
            flags = packed.tolist()
        position = 0
        for group, probe in entries:
            for fsdp_param, existed in zip(group.fsdp_params, probe.grad_existed):
                if not flags[position] and not existed:
                    _put_back_none(fsdp_param)
                position += 1


def _flags_tensor(flags: list[int], device: Any) -> Any:
    """The usage flags on the domain's device, for the all-reduce.

    On CUDA they are staged in pinned host memory and copied without blocking: a pageable copy
    (``torch.tensor(..., device=cuda)``) waits for the whole queued backward, and ``tolist()`` after
    the all-reduce waits again. Queued on the current stream, the copy runs before the all-reduce
    (NCCL's stream waits on the current one), so the values are the same; the caching host
    allocator keeps the pinned block until the copy has run. One host sync per restore instead of
    two (docs/performance.md, "The restore's host syncs").
    """
    if getattr(device, "type", None) != "cuda":
        return torch.tensor(flags, dtype=torch.int32, device=device)
    return torch.tensor(flags, dtype=torch.int32, pin_memory=True).to(device, non_blocking=True)


def _put_back_none(fsdp_param: Any) -> None:
    if fsdp_param.sharded_param.grad is None:
        return
    fsdp_param.sharded_param.grad = None
    _events.fired(
        "restore_unused_param_grads",
        "an exact-zero gradient the optimizer would have stepped (weight decay, momentum)",
        f"parameter {_events.param_names([fsdp_param])}, used by no rank",
    )


def _restore_probed(root_state: Any) -> None:
    groups = [group for group in _compat.all_param_groups(root_state) if _PROBE in vars(group)]
    if groups:
        restore_unused(groups)


def _restore_after_callback(wrapped, root_state, args, kwargs):
    # Manual finalization (torch 2.15) is decided when backward starts; the callback then only
    # marks groups pending and their reductions come in finalize_backward, which ends in
    # _end_backward_iteration: restore there, once. Read before the call: ending an automatic
    # backward resets it to None.
    manual = getattr(root_state._state_ctx, "manual_backward_finalization_active", None)
    result = wrapped(*args, **kwargs)
    if not manual:
        _restore_probed(root_state)
    return result


def _restore_after_end_of_iteration(wrapped, root_state, args, kwargs):
    result = wrapped(*args, **kwargs)  # waits for the reductions first
    _restore_probed(root_state)
    return result


def _restore_after_synchronize(wrapped, module, args, kwargs):
    result = wrapped(*args, **kwargs)  # every unit of the subtree reduced (recurse or not)
    probed = []
    for submodule in module.modules():  # module-tree order: the same on every rank
        state = submodule._get_fsdp_state() if hasattr(submodule, "_get_fsdp_state") else None
        for group in _compat.state_param_groups(state) if state is not None else ():
            if _PROBE in vars(group) and group not in probed:
                probed.append(group)
    if probed:
        restore_unused(probed)
    return result


def _drop_probe_on_reset(wrapped, group, args, kwargs):
    vars(group).pop(_PROBE, None)  # the iteration is lost: so is its usage
    return wrapped(*args, **kwargs)


PATCH = Patch(
    name="restore_unused_param_grads",
    summary="a parameter that no rank used keeps `grad is None`",
    symptom="an unused parameter gets an exact-zero gradient: AdamW steps it (weight decay, old momentum)",
    trigger="the unused-param fill is on (set_reduce_scatter_unused_params) and no rank used a parameter",
    upstream=("DDP's PyTorch issue 28294 (same class)", "Megatron-LM documents it"),
    # Every release with a fill (torch's from 2.13, the backport before) zero-fills unused params.
    affected=">=2.6",
    check=_structural_check,
    targets=(
        Wrap(f"{_FSDP2}._fsdp_param_group:FSDPParamGroup.post_backward", _probe_usage),
        Wrap(f"{_FSDP2}._fsdp_state:FSDPState.{_CALLBACK}", _restore_after_callback),
        Wrap(f"{_FSDP2}._fsdp_state:FSDPState.{_END_ITERATION}", _restore_after_end_of_iteration,
             when=has_manual_finalization),
        Wrap(f"{_FSDP2}._fully_shard:FSDPModule.{_SYNCHRONIZE}", _restore_after_synchronize,
             when=has_synchronize_gradients),
        Wrap(f"{_FSDP2}._fsdp_param_group:FSDPParamGroup.{_RESET}", _drop_probe_on_reset, when=_has_reset),
    ),
    changes="gradients it creates for parameters no rank used are reset to None",
    # its post_backward wrapper must sit outside the fill's, so that its usage probe sees the
    # gradients before the zero fill
    after=("unused_param_reduction",),
)
