"""The upstream changes a next torch may make, per patch, as ``_next_torch`` simulations.

``CHANGES["<patch>/<change>"](sim)`` schedules one change on a :class:`_next_torch.Simulation`
(raising :class:`_next_torch.Unavailable` where this torch lacks the internal it edits). Kinds:

- ``new_keyword``: each function the patch wraps gains a keyword parameter ``added_in_next_release``
  (default None) that every caller in torch passes (``=True``); the function records what it
  received (``Simulation.received``), so a wrapper that drops the argument shows;
- ``renamed``: a wrapped internal gets another name, at its definition and every reference;
- ``torch_fix``: torch's own fix written in (the upstream PR named in each);
- one-off changes: ``foreach_reduce`` imported under another name, gradients of another kind
  handed to ``foreach_reduce``, PyTorch PR 194033's ``dtype`` for gradient clipping, the
  pending-gradient rewrite's ``post_partial_forward`` (the group hook's 5th parameter).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable

import torch

import _next_torch as nt
import _next_torch_edits as ed
from _next_torch import NEW, RECEIVED, Simulation, Unavailable, fsdp


def new_keyword(sim: Simulation, owner: Any, attribute: str, receivers: tuple[str, ...] | None = None) -> None:
    inner = nt.innermost(nt.require(owner, attribute))
    module = sys.modules[inner.__module__]
    if RECEIVED not in vars(module):
        sim.set(module, RECEIVED, sim.received)
    record = f"{RECEIVED}.append(({nt.describe(owner, attribute)!r}, {NEW}))"
    sim.edit(owner, attribute, ed.add_parameter(NEW), ed.insert_first(record))
    for caller, name in nt.callers(attribute):
        sim.edit(caller, name, ed.pass_argument(attribute, NEW, "True", receivers, required=False))


def renamed(sim: Simulation, owner: Any, attribute: str, new: str) -> None:
    nt.require(owner, attribute)
    sim.edit(owner, attribute, ed.rename(attribute, new))
    for caller, name in nt.callers(attribute):
        if not (caller is owner and name == attribute):
            sim.edit(caller, name, ed.rename(attribute, new, definition=False))


def _param() -> type:
    return fsdp("_fsdp_param").FSDPParam


def _group() -> type:
    return fsdp("_fsdp_param_group").FSDPParamGroup


def _state() -> type:
    return fsdp("_fsdp_state").FSDPState


def _clip() -> Any:
    return importlib.import_module("torch.nn.utils.clip_grad")


# --- accumulated_grad_guard ---------------------------------------------------------------------

def accum_new_keyword(sim: Simulation) -> None:
    new_keyword(sim, _param(), "to_accumulated_grad_if_needed")


def accum_renamed(sim: Simulation) -> None:
    renamed(sim, _param(), "to_accumulated_grad_if_needed", "to_reduce_dtype_grad_if_needed")


# --- uniform_reduce_dtype -----------------------------------------------------------------------

def reduce_new_keyword(sim: Simulation) -> None:
    new_keyword(sim, fsdp("_fsdp_collectives"), "foreach_reduce")


def reduce_imported_as(sim: Simulation) -> None:
    """``from ._fsdp_collectives import foreach_reduce as _reduce_scatter_grads`` in _fsdp_param_group."""
    group_module = fsdp("_fsdp_param_group")
    original = nt.require(group_module, "foreach_reduce")
    sim.delete(group_module, "foreach_reduce")
    sim.set(group_module, "_reduce_scatter_grads", original)
    for caller, name in nt.callers("foreach_reduce", [group_module]):
        sim.edit(caller, name, ed.rename("foreach_reduce", "_reduce_scatter_grads", definition=False))


def reduce_renamed(sim: Simulation) -> None:
    renamed(sim, fsdp("_fsdp_collectives"), "foreach_reduce", "foreach_reduce_grads")


class ReducedGrad(torch.Tensor):
    """A gradient handed over as a tensor subclass (as ``AsyncCollectiveTensor`` is)."""


class LazyGrad:
    """A lazily reduced gradient: not a Tensor; dtype and shape known, the data on ``materialize()``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    @property
    def dtype(self) -> torch.dtype:
        return self._tensor.dtype

    @property
    def shape(self) -> torch.Size:
        return self._tensor.shape

    def materialize(self) -> torch.Tensor:
        return self._tensor


def _grads_of_another_kind(kind: Callable[[torch.Tensor], Any]) -> Callable[[Simulation], None]:
    def change(sim: Simulation) -> None:
        collectives, group_module = fsdp("_fsdp_collectives"), fsdp("_fsdp_param_group")
        nt.require(collectives, "foreach_reduce")
        sim.set(group_module, "_next_torch_grads", lambda grads: [kind(grad) for grad in grads])
        sim.set(collectives, "_NextTorchLazyGrad", LazyGrad)
        for caller, name in nt.callers("foreach_reduce", [group_module]):
            sim.edit(caller, name, ed.wrap_argument("foreach_reduce", 1, "_next_torch_grads"))
        sim.edit(collectives, "foreach_reduce", ed.insert_first("""
            for _index, _grad in enumerate(unsharded_grads):  # the next release materializes them
                if isinstance(_grad, _NextTorchLazyGrad):
                    unsharded_grads[_index] = _grad.materialize()
        """))

    return change


# --- restore_unused_param_grads -----------------------------------------------------------------

def restore_new_keyword(sim: Simulation) -> None:
    new_keyword(sim, _group(), "post_backward")
    new_keyword(sim, _state(), "_root_post_backward_final_callback")
    if "_end_backward_iteration" in vars(_state()):  # torch 2.15
        new_keyword(sim, _state(), "_end_backward_iteration")
    new_keyword(sim, _group(), "_reset_iter_state", receivers=("fsdp_param_group",))


def restore_renamed(sim: Simulation) -> None:
    renamed(sim, _state(), "_root_post_backward_final_callback", "_post_backward_final_callback")


RESTORE_FIX = '''
def _restore_unused_param_grads(root_state):
    """torch's own fix (PyTorch PR 174862's idea): a parameter no rank used keeps grad None."""
    for state in root_state._state_ctx.all_states:
        for group in state._fsdp_param_groups:
            if not group.reduce_scatter_unused_params:
                continue
            created = [vars(p).pop("_zero_filled_grad_created", None) for p in group.fsdp_params]
            used = torch.tensor([int(c is None) for c in created], dtype=torch.int32)
            pg = getattr(group.mesh_info, "shard_process_group", None)
            if pg is not None and pg.size() > 1:
                torch.distributed.all_reduce(used, op=torch.distributed.ReduceOp.MAX, group=pg)
            for p, c, u in zip(group.fsdp_params, created, used.tolist()):
                if c and not u:
                    p.sharded_param.grad = None
'''


def restore_torch_fix(sim: Simulation) -> None:
    """The zero fill marks what it filled; the end of backward all-reduces "used" and puts None back."""
    state = _state()
    sim.define(fsdp("_fsdp_state"), RESTORE_FIX)
    sim.edit(_param(), "unsharded_zero_grad_data",
             ed.insert_first("self._zero_filled_grad_created = self.sharded_param.grad is None"))
    manual = "_end_backward_iteration" in vars(state)  # torch 2.15: where every finalization ends
    end = "_end_backward_iteration" if manual else "_root_post_backward_final_callback"
    sim.edit(state, end, ed.append_last("_restore_unused_param_grads(self)"))


# --- post_forward_mesh_cache --------------------------------------------------------------------

def mesh_new_keyword(sim: Simulation) -> None:
    new_keyword(sim, fsdp("_fsdp_init"), "_get_post_forward_mesh_info")


def mesh_renamed(sim: Simulation) -> None:
    renamed(sim, fsdp("_fsdp_init"), "_get_post_forward_mesh_info", "_build_post_forward_mesh_info")


_MESH_BUILT = """
        post_forward_mesh = DeviceMesh(
            mesh_info.mesh.device_type, post_forward_mesh_tensor
        )
        post_forward_mesh_info = HSDPMeshInfo(
            post_forward_mesh, shard_mesh_dim=1, replicate_mesh_dim=0
        )
"""
_MESH_CACHED = """
        cache_key = (
            mesh_info.mesh.device_type,
            tuple(post_forward_mesh_tensor.shape),
            tuple(post_forward_mesh_tensor.flatten().tolist()),
        )
        post_forward_mesh_info = _post_forward_mesh_cache.get(cache_key)
        if post_forward_mesh_info is None:
            post_forward_mesh = DeviceMesh(
                mesh_info.mesh.device_type, post_forward_mesh_tensor
            )
            post_forward_mesh_info = HSDPMeshInfo(
                post_forward_mesh, shard_mesh_dim=1, replicate_mesh_dim=0
            )
            _post_forward_mesh_cache[cache_key] = post_forward_mesh_info
"""


def mesh_torch_fix(sim: Simulation) -> None:
    """PyTorch PR 187161: the function keeps the meshes it built in a module-level cache."""
    init = fsdp("_fsdp_init")
    cache: dict = {}
    sim.set(init, "_post_forward_mesh_cache", cache)
    sim.between_runs.append(cache.clear)  # the plugin-off run starts from an empty cache too
    sim.edit(init, "_get_post_forward_mesh_info", ed.replace_text(_MESH_BUILT, _MESH_CACHED))


# --- grouped_module_reuse -----------------------------------------------------------------------

def reuse_new_keyword(sim: Simulation) -> None:
    new_keyword(sim, fsdp("_fsdp_state"), "_register_group_forward_hooks")


def reuse_partial_hook(sim: Simulation) -> None:
    """PyTorch's pending-gradient rewrite (commit acf70b43): the group hook's 5th parameter is
    ``post_partial_forward`` (the partial path's hook), not ``cast_output_dtype``; callers pass it
    by position. The same partial path otherwise."""
    state_module = fsdp("_fsdp_state")
    function = nt.require(state_module, "_register_group_forward_hooks")
    if "cast_output_dtype" not in inspect.signature(function).parameters:
        raise Unavailable("_register_group_forward_hooks has no cast_output_dtype parameter in this torch")
    sim.edit(state_module, "_register_group_forward_hooks",
             ed.rename_parameter("cast_output_dtype", "post_partial_forward"))


def reuse_renamed(sim: Simulation) -> None:
    renamed(sim, _state(), "_force_complete_incomplete_states", "_complete_partial_group_states")


# --- keep_param_attributes ----------------------------------------------------------------------

def attrs_new_keyword(sim: Simulation) -> None:
    new_keyword(sim, _param(), "_setattr_on_modules")


def attrs_renamed(sim: Simulation) -> None:
    renamed(sim, _param(), "_setattr_on_modules", "_install_on_modules")


# --- clip_grad_norm_multi_mesh ------------------------------------------------------------------

# torch 2.15's DTensor has no sharding rule for _foreach_norm(..., dtype=) ("'>=' not supported between
# instances of 'torch.dtype' and 'int'"): with a dtype the per-tensor norms are vector_norm's
_FOREACH_NORM = "torch._foreach_norm(device_tensors, norm_type)"
_FOREACH_NORM_IN_DTYPE = ("(torch._foreach_norm(device_tensors, norm_type) if dtype is None else "
                          "[torch.linalg.vector_norm(g, norm_type, dtype=dtype) for g in device_tensors])")


def clip_dtype(sim: Simulation) -> None:
    """PyTorch PR 194033: ``_get_total_norm(tensors, norm_type, error_if_nonfinite, foreach, dtype=None)``
    accumulates the per-tensor norms and their norm in ``dtype`` (and returns it in ``dtype``);
    ``clip_grad_norm_`` gains the same parameter and passes it on."""
    clip = _clip()
    sim.edit(clip, "_get_total_norm", ed.add_parameter("dtype", keyword_only=False),
             ed.pass_argument("vector_norm", "dtype", "dtype"), ed.replace_text(_FOREACH_NORM, _FOREACH_NORM_IN_DTYPE))
    sim.edit(clip, "clip_grad_norm_", ed.add_parameter("dtype", keyword_only=False),
             ed.pass_argument("_get_total_norm", "dtype", "dtype"))


def clip_new_keyword(sim: Simulation) -> None:
    new_keyword(sim, _clip(), "_clip_grads_with_norm_")


def total_new_keyword(sim: Simulation) -> None:
    new_keyword(sim, _clip(), "_get_total_norm")


_STACKED = "torch.stack([norm.to(first_device) for norm in norms])"
_STACKED_PLAIN = ('torch.stack([(norm.full_tensor() if hasattr(norm, "full_tensor") else norm).to(first_device) '
                  "for norm in norms])")


_SCALED = "            torch._foreach_mul_(device_grads, clip_coef_clamped.to(device))\n"
_SCALED_PER_MESH = """\
            for mesh_grads in _grads_by_mesh(device_grads):
                torch._foreach_mul_(mesh_grads, clip_coef_clamped.to(device))
"""
_BY_MESH = '''
def _grads_by_mesh(grads):
    """Gradients grouped by DeviceMesh (plain tensors together), in first-appearance order."""
    groups = {}
    for grad in grads:
        groups.setdefault(id(getattr(grad, "device_mesh", None)), []).append(grad)
    return list(groups.values())
'''


def clip_torch_fix(sim: Simulation) -> None:
    """PyTorch PR 180501: ``_get_total_norm`` makes each DTensor norm plain (``full_tensor()``, a
    collective over its own mesh) before stacking, so norms on several meshes combine, and
    ``_clip_grads_with_norm_`` scales the gradients of each mesh by their own foreach call."""
    clip = _clip()
    sim.define(clip, _BY_MESH)
    sim.edit(clip, "_get_total_norm", ed.replace_text(_STACKED, _STACKED_PLAIN))
    sim.edit(clip, "_clip_grads_with_norm_", ed.replace_text(_SCALED, _SCALED_PER_MESH))


def clip_renamed(sim: Simulation) -> None:
    renamed(sim, _clip(), "_get_total_norm", "_compute_total_norm")


# --- unused_param_reduction ---------------------------------------------------------------------

def fill_new_keyword(sim: Simulation) -> None:
    new_keyword(sim, _group(), "post_backward")


CHANGES: dict[str, Callable[[Simulation], None]] = {
    "accumulated_grad_guard/new_keyword": accum_new_keyword,
    "accumulated_grad_guard/renamed": accum_renamed,
    "uniform_reduce_dtype/new_keyword": reduce_new_keyword,
    "uniform_reduce_dtype/imported_as": reduce_imported_as,
    "uniform_reduce_dtype/renamed": reduce_renamed,
    "uniform_reduce_dtype/subclass_grads": _grads_of_another_kind(lambda grad: grad.as_subclass(ReducedGrad)),
    "uniform_reduce_dtype/lazy_grads": _grads_of_another_kind(LazyGrad),
    "restore_unused_param_grads/new_keyword": restore_new_keyword,
    "restore_unused_param_grads/renamed": restore_renamed,
    "restore_unused_param_grads/torch_fix": restore_torch_fix,
    "post_forward_mesh_cache/new_keyword": mesh_new_keyword,
    "post_forward_mesh_cache/renamed": mesh_renamed,
    "post_forward_mesh_cache/torch_fix": mesh_torch_fix,
    "grouped_module_reuse/new_keyword": reuse_new_keyword,
    "grouped_module_reuse/renamed": reuse_renamed,
    "grouped_module_reuse/post_partial_forward": reuse_partial_hook,
    "keep_param_attributes/new_keyword": attrs_new_keyword,
    "keep_param_attributes/renamed": attrs_renamed,
    "clip_grad_norm_multi_mesh/dtype": clip_dtype,
    "clip_grad_norm_multi_mesh/new_keyword": clip_new_keyword,
    "clip_grad_norm_multi_mesh/new_keyword_total": total_new_keyword,
    "clip_grad_norm_multi_mesh/torch_fix": clip_torch_fix,
    "clip_grad_norm_multi_mesh/renamed": clip_renamed,
    "unused_param_reduction/new_keyword": fill_new_keyword,
}


__all__ = ["CHANGES", "LazyGrad", "ReducedGrad", "Simulation", "Unavailable"]
