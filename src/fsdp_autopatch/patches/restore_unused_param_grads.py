"""restore_unused_param_grads: keep ``grad is None`` for a parameter that no rank used.

The bug
    The unused-param fill (torch 2.13's ``set_reduce_scatter_unused_params`` or this package's
    backport) gives a locally unused parameter a zero contribution so that every rank issues the
    same reduce-scatter. When *no* rank of the parameter's reduction domain used it, the reduction
    turns a missing gradient into an exact-zero one, and an optimizer takes that as a real
    gradient: AdamW counts a step, applies decoupled weight decay and keeps moving the weight with
    old momentum. Without the fill the gradient stays None and the optimizer skips the parameter.
    (Measured on torch 2.13: an unused weight moved by ~4.6e-3 in one AdamW step.) Same class of
    bug as DDP's PyTorch issue 28294; Megatron-LM documents it.

Torch versions
    Every version with the fill: torch >= 2.13 natively, 2.6 - 2.12 through
    ``unused_param_reduction``. Still relevant on 2.15.

Needed here?
    A fill must exist (``FSDPModule.set_reduce_scatter_unused_params``) and the wrapped internals
    must be there: ``FSDPParamGroup.post_backward`` and
    ``FSDPState._root_post_backward_final_callback``. No fill -> not needed (nothing creates the
    zeros); missing internals -> unsupported.

The replacement
    * ``FSDPParamGroup.post_backward`` wrapped (outside the backport's fill, so it runs first): for
      a unit with the fill on that reduces in this backward, record per parameter whether this
      rank has a local gradient (an unsharded or accumulated gradient exists: usage comes from
      gradient *presence*, never from a zero value) and whether its sharded gradient already
      existed (then the reduction accumulates into it and it must stay).
    * ``FSDPState._root_post_backward_final_callback`` wrapped: after torch's callback (every
      reduction issued), the usage flags are reduced with MAX over each parameter's reduction
      domain (the shard process group, and the replicate group under HSDP), all flags of one
      process group packed into one int32 all-reduce, once per backward. A parameter that no rank
      used and whose sharded gradient this reduction created gets ``grad = None`` again.
    A unit whose fill is off records nothing and adds no collective at all.

Limitation
    Under HSDP with the all-reduce deferred (``set_requires_all_reduce(False)``), a reduction that
    folds into a pending partial reduce is not treated as creating the gradient (the partial reduce
    may hold earlier micro-batches' gradients, which must survive). So a parameter that no rank
    used in any micro-batch of such a window keeps the reduced zero.

Disable with ``FSDP_AUTOPATCH_RESTORE_UNUSED_PARAM_GRADS_ENABLED=0``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from packaging.specifiers import SpecifierSet

from .. import _compat
from . import Patch
from . import unused_param_reduction

NAME = "restore_unused_param_grads"
_CALLBACK = "_root_post_backward_final_callback"
# Every release with a fill (torch's from 2.13, the backport before) zero-fills unused params.
AFFECTED = SpecifierSet(">=2.6")
_PROBE = "_fsdp_autopatch_usage_probe"  # FSDPParamGroup attribute, lives for one backward


class _UsageProbe:
    """What one rank saw for one ``FSDPParamGroup`` in this backward, one entry per FSDPParam."""

    __slots__ = ("used", "grad_existed")

    def __init__(self, group: Any) -> None:
        self.used = [_has_local_grad(p) for p in group.fsdp_params]
        # HSDP with a deferred all-reduce: this reduction folds into a pending partial reduce that
        # may hold earlier micro-batches' gradients, so it does not "create" the gradient.
        folds_into_partial = getattr(group, "_partial_reduce_output", None) is not None
        self.grad_existed = [folds_into_partial or p.sharded_param.grad is not None for p in group.fsdp_params]

    def merge(self, group: Any) -> None:
        # post_backward ran twice in one backward (grouped units): usage is the union.
        self.used = [u or _has_local_grad(p) for u, p in zip(self.used, group.fsdp_params)]


def _has_local_grad(fsdp_param: Any) -> bool:
    """Whether this rank's backward produced a gradient for the parameter since its last reduction."""
    unsharded = vars(fsdp_param).get("_unsharded_param")
    if unsharded is None:  # never unsharded: its unit never ran forward on this rank
        return False
    return unsharded.grad is not None or getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None


def _classes() -> tuple[type, type, type]:
    fsdp_module = _compat.fsdp_module("_fully_shard").FSDPModule
    param_group = _compat.fsdp_module("_fsdp_param_group").FSDPParamGroup
    state = _compat.fsdp_module("_fsdp_state").FSDPState
    return fsdp_module, param_group, state


def check() -> _compat.Verdict:
    fsdp_module, _, _ = _classes()
    if _compat.class_attr(fsdp_module, "set_reduce_scatter_unused_params") is None:
        # Not a property of the release: before 2.13 only the backport provides a fill.
        return _compat.not_needed(
            f"{_compat.describe(_compat.torch_release())} has no unused-param fill to undo "
            "(no FSDPModule.set_reduce_scatter_unused_params, and the backport is not applied)"
        )
    return _compat.decide(_structural_check(), _compat.torch_release(), AFFECTED, "zero gradients from the fill")


def _structural_check() -> _compat.Verdict:
    _, param_group, state = _classes()
    # What the wrappers read: group.fsdp_params / reduce_grads / mesh_info (set in __init__; 2.15
    # moved the per-param loop out of post_backward), and the root's _state_ctx.all_states.
    looks_right = (
        _compat.reads_names(_compat.class_attr(param_group, "__init__"), "fsdp_params", "reduce_grads", "mesh_info")
        and _compat.reads_names(_compat.class_attr(param_group, "post_backward"), "reduce_grads")
        and _compat.reads_names(_compat.class_attr(state, _CALLBACK), "_state_ctx", "all_states")
    )
    if not looks_right:
        return _compat.unsupported(
            f"FSDPParamGroup / FSDPState.{_CALLBACK} do not look as expected "
            "(fsdp_params, reduce_grads, mesh_info, _state_ctx.all_states)"
        )
    source = "torch's" if unused_param_reduction.has_native_api() else "the backported"
    return _compat.needed(f"{source} unused-param fill turns None into zero")


def _probe_usage(wrapped, group, args, kwargs):
    if group.reduce_grads and getattr(group, "reduce_scatter_unused_params", False):
        probe = vars(group).get(_PROBE)
        if probe is None:
            setattr(group, _PROBE, _UsageProbe(group))
        else:
            probe.merge(group)
    return wrapped(*args, **kwargs)


def _reduction_domain(group: Any) -> tuple[Any, ...]:
    """The process groups a parameter's gradient is reduced over: shard, plus replicate (HSDP)."""
    mesh_info = group.mesh_info
    domain = []
    for attribute in ("shard_process_group", "replicate_process_group"):
        process_group = getattr(mesh_info, attribute, None)
        if process_group is not None and process_group.size() > 1:
            domain.append(process_group)
    return tuple(domain)


def _probed_groups(root_state: Any) -> list[Any]:
    return [
        group
        for state in root_state._state_ctx.all_states
        for group in _compat.state_param_groups(state)
        if _PROBE in vars(group)
    ]


def restore_unused(groups: list[Any]) -> None:
    """Reset the gradients this backward's reductions created for parameters no rank used."""
    by_domain: dict[tuple[Any, ...], list[Any]] = {}
    for group in groups:  # same order on every rank: all_states follows the module tree
        by_domain.setdefault(_reduction_domain(group), []).append(group)
    for domain, domain_groups in by_domain.items():
        probes = [vars(group).pop(_PROBE) for group in domain_groups]
        flags = [int(used) for probe in probes for used in probe.used]
        if domain and flags:
            packed = torch.tensor(flags, dtype=torch.int32, device=domain_groups[0].device)
            for process_group in domain:
                dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=process_group)
            flags = packed.tolist()
        position = 0
        for group, probe in zip(domain_groups, probes):
            for fsdp_param, existed in zip(group.fsdp_params, probe.grad_existed):
                if not flags[position] and not existed:
                    fsdp_param.sharded_param.grad = None
                position += 1


def _restore_after_callback(wrapped, root_state, args, kwargs):
    result = wrapped(*args, **kwargs)
    groups = _probed_groups(root_state)
    if groups:
        restore_unused(groups)
    return result


def apply() -> str:
    _, param_group, state = _classes()
    post_backward = _compat.class_attr(param_group, "post_backward")
    callback = _compat.class_attr(state, _CALLBACK)
    _compat.replace_all(
        NAME,
        [
            (param_group, "post_backward", _compat.wrap(post_backward, _probe_usage)),
            (state, _CALLBACK, _compat.wrap(callback, _restore_after_callback)),
        ],
    )
    return "gradients it creates for parameters no rank used are reset to None"


def revert() -> None:
    _compat.revert(NAME)


PATCH = Patch(NAME, "keep grad None for parameters that no rank used", check, apply, revert)
