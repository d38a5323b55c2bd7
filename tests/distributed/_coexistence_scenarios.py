"""Coexistence scenario (issue 29, item 4): the frameworks' own FSDP2 patches next to ours.

``coexist`` (2 gloo ranks, one launch). For each framework, in one process:

1. ``after``: our patches applied (the bootstrap; re-armed with ``_activate.activate``), then the
   framework's patch, then a training step: values, and our registry records for the entries that
   share its targets (status, ``in_force``, ``displaced``);
2. ``theirs``: ours reverted (``_activate.revert_all``): whether every place the framework set still
   holds its value (a revert of ours never undoes theirs), and the step with theirs alone;
3. ``before``: ours activated again, now over theirs: the step, and the records;
4. ours reverted, torch's attributes put back, the next framework.

Frameworks (the sources followed are cited in ``test_dist_coexistence.py``):

* ``nemo``: NeMo Automodel 0.7.0's real ``components/distributed/fsdp_patches.py`` (its path in
  ``args["nemo_file"]``, loaded alone by path), its functions called where its parallelizers call
  them: the accumulated-grad guard before ``fully_shard``, the uniform reduce dtype, and the
  unused-param backport only where torch lacks ``set_reduce_scatter_unused_params`` (else that
  API, as ``configure_fsdp_unused_param_reduction`` does). Steps: ``reduce`` (bf16 / fp32 reduce,
  the fill on, rank 1's fill zero next to fp32 accumulations) and ``guard`` (a vision tower no
  micro-batch runs);
* ``verl``: ``maybe_patch_fsdp_module`` (``_fully_shard.FSDPModule`` swapped for an ABC subclass
  while ABC modules are sharded) around the ``fully_shard`` calls of an ABC-first model;
* ``megatron``: ``_clone_fsdp_output_views`` forward hooks (registered before ``fully_shard``) on a
  unit whose output view the caller modifies in place;
* ``accelerate`` / ``torchtitan``: their own clipping over gradients on two meshes.
"""

from __future__ import annotations

import abc
import contextlib
import importlib.util
import math
from typing import Any, Callable

import torch

import _clip_grad_norm_multi_mesh_scenarios as clip_sc
import _dist_common as sc
import _fsdp_module_abc_layout_scenarios as abc_sc
import _inplace_view_output_scenarios as view_sc
from _registry import scenario

FRAMEWORKS = ("nemo", "verl", "megatron", "accelerate", "torchtitan")
# our entries that share the framework's targets (their records are saved)
OURS = {
    "nemo": ("uniform_reduce_dtype", "accumulated_grad_guard", "unused_param_reduction", "restore_unused_param_grads"),
    "verl": ("fsdp_module_abc_layout",),
    "megatron": ("inplace_view_output",),
    "accelerate": ("clip_grad_norm_multi_mesh",),
    "torchtitan": ("clip_grad_norm_multi_mesh",),
}
VIEW_CASE = "transpose/fp32"
# the references: clip_sc.reference(CLIP_CASES[framework]); torchtitan clips FSDP2's DTensors only
CLIP_CASES = {"accelerate": "two_1d/clip/2/none/plain", "torchtitan": "two_1d/clip/2/none/dtensors"}


# --- the frameworks' mechanisms --------------------------------------------------------------


def load_nemo(path: str) -> Any:
    """NeMo Automodel's fsdp_patches.py alone (it imports only torch; its package is not imported)."""
    spec = importlib.util.spec_from_file_location("nemo_automodel_fsdp_patches", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nemo_apply(nemo: Any) -> dict[str, str]:
    """Where NeMo's parallelizers call them; what each raised (2.15: the guard's AttributeError)."""
    from torch.distributed.fsdp import FSDPModule

    calls = ["patch_fsdp_accumulated_grad_guard", "patch_fsdp_uniform_reduce_dtype"]
    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        calls.append("patch_fsdp_unused_param_reduction")
    errors = {}
    for name in calls:
        try:
            getattr(nemo, name)()
        except Exception as error:  # recorded: the next call still runs, as in a test of theirs
            errors[name] = f"{type(error).__name__}: {error}"
    return errors


@contextlib.contextmanager
def verl_maybe_patch_fsdp_module(model: torch.nn.Module):
    """verl/utils/fsdp_utils.py ``maybe_patch_fsdp_module`` (verl PR 3072), re-created."""
    import torch.distributed.fsdp._fully_shard._fully_shard as fully_shard_module

    orig_fsdp_module = fully_shard_module.FSDPModule

    class FSDPModuleABC(abc.ABC, orig_fsdp_module):
        pass

    try:
        if isinstance(model, abc.ABC):
            fully_shard_module.FSDPModule = FSDPModuleABC
        yield
    finally:
        fully_shard_module.FSDPModule = orig_fsdp_module


def megatron_clone_fsdp_output_views(_module: Any, _inputs: Any, output: Any) -> Any:
    """Megatron-LM megatron/core/distributed/torch_fully_sharded_data_parallel.py
    ``_clone_fsdp_output_views``, re-created: clone every grad-requiring output view."""
    from torch.distributed.utils import _apply_to_tensors

    needs_clone = False

    def detect_view(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal needs_clone
        needs_clone |= tensor.requires_grad and tensor._base is not None
        return tensor

    _apply_to_tensors(detect_view, output)
    if not needs_clone:
        return output
    cloned: dict[int, torch.Tensor] = {}

    def clone_view(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.requires_grad or tensor._base is None:
            return tensor
        return cloned.setdefault(id(tensor), tensor.clone())

    return _apply_to_tensors(clone_view, output)


def _combine(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    if math.isinf(norm_type):
        return torch.stack(norms).max()
    return sum(n**norm_type for n in norms) ** (1.0 / norm_type)


def _full(norm: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


@torch.no_grad()
def accelerate_clip(parameters: list, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """accelerate PR 4219 ``Accelerator._clip_grad_norm_dtensor_aware``, re-created: DTensor
    gradients apart from plain ones, one total per kind (DTensors on several meshes stay in one
    ``get_total_norm`` call), combined, each kind clipped with it."""
    from torch.distributed.tensor import DTensor

    dtensor_params = [p for p in parameters if p.grad is not None and isinstance(p.grad, DTensor)]
    plain_params = [p for p in parameters if p.grad is not None and not isinstance(p.grad, DTensor)]
    norms = [_full(torch.nn.utils.get_total_norm([p.grad for p in group], norm_type))
             for group in (dtensor_params, plain_params)]
    total = _combine(norms, norm_type)
    for group in (dtensor_params, plain_params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


@torch.no_grad()
def torchtitan_clip(parameters: list, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torchtitan/distributed/utils.py ``_clip_grad_norm_with_ep``, re-created: gradients on an
    "ep" mesh apart from the others, one ``get_total_norm`` each (``full_tensor()`` of a DTensor
    total), combined, each part clipped with ``clip_grads_with_norm_`` (DTensor parameters only,
    as torchtitan asserts)."""
    ep, non_ep = [], []
    for p in parameters:
        if p.grad is None:
            continue
        names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
        (ep if "ep" in names else non_ep).append(p)
    norms = [_full(torch.nn.utils.get_total_norm([p.grad for p in part], norm_type)) for part in (ep, non_ep)]
    total = _combine(norms, norm_type)
    torch.nn.utils.clip_grads_with_norm_(ep, max_norm, total)
    torch.nn.utils.clip_grads_with_norm_(non_ep, max_norm, total)
    return total


# --- the steps ---------------------------------------------------------------------------------


def _fired() -> dict[str, int]:
    return {p["name"]: p["fired"] for p in sc.autopatch_status().get("patches", ())}


def step_nemo(ctx: sc.Ctx, rec: dict[str, Any]) -> None:
    from torch.distributed.fsdp import fully_shard

    mp = sc._mp_policy("bf16")
    model = sc.build_model("experts", n_experts=2)
    fully_shard(model, mesh=ctx.mesh, mp_policy=mp)
    if hasattr(model, "set_reduce_scatter_unused_params"):  # NeMo calls it where torch has it (>= 2.13)
        model.set_reduce_scatter_unused_params(True)  # configure_fsdp_unused_param_reduction
    sc._run_step(ctx, model, sc.plan_uniform_fill_zero, step=0, n_mb=2)
    rec["reduce"] = sc.grads_full(model)
    model = sc.build_model("text_vision")
    for unit in (model.tower, model.shared, model):
        fully_shard(unit, mesh=ctx.mesh, mp_policy=mp)
    sc._run_step(ctx, model, sc.plan_grad_guard, step=0, n_mb=2)
    rec["guard"] = sc.grads_full(model)
    rec["guard_tower_grad_none"] = all(p.grad is None for p in model.tower.parameters())


def step_verl(ctx: sc.Ctx, rec: dict[str, Any]) -> None:
    import torch.distributed.fsdp._fully_shard._fully_shard as fully_shard_module
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = abc_sc.build()
    with verl_maybe_patch_fsdp_module(model):
        # the ABC-first blocks and root; not the plain LayerNorm as its own unit: under verl's
        # swap that raises "layout differs" with or without us (measured, see the test)
        for unit in (*model.blocks, model):
            fully_shard(unit, mesh=ctx.mesh)
        rec["verl_class_kept"] = fully_shard_module.FSDPModule.__name__ == "FSDPModuleABC"
    rec["torch_class_back"] = fully_shard_module.FSDPModule is FSDPModule
    rec["is_fsdp_module"] = all(isinstance(u, FSDPModule) for u in (*model.blocks, model))
    abc_sc.loss(model, abc_sc.rank_batch(ctx.rank)).backward()
    rec["grads"] = sc.grads_full(model)


def step_megatron(ctx: sc.Ctx, rec: dict[str, Any]) -> None:
    from torch.distributed.fsdp import fully_shard

    model = view_sc.build(VIEW_CASE)
    for unit in (model.block, model):  # registered before fully_shard, as Megatron-LM does
        unit.register_forward_hook(megatron_clone_fsdp_output_views)
    fully_shard(model.block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    view_sc.loss(model, view_sc.rank_batch(VIEW_CASE, ctx.rank)).backward()
    rec["grads"] = sc.grads_full(model)


def _step_clip(clipper: Callable[..., torch.Tensor], plain: bool) -> Callable[[sc.Ctx, dict[str, Any]], None]:
    def step(ctx: sc.Ctx, rec: dict[str, Any]) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dp = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("dp",))
        ep = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("ep",))
        model = clip_sc.build()
        fully_shard(model.experts, mesh=ep)
        fully_shard(model.dense, mesh=dp)
        fully_shard(model, mesh=dp, ignored_params={model.extra})
        clip_sc.backward(ctx, model, nan=False)
        params = clip_sc.clipped_parameters(model, plain)
        rec["total"] = float(_full(clipper(params, clip_sc.MAX_NORM, 2.0)))
        rec["grads"] = {clip_sc._name(model, p): clip_sc._full(p.grad) for p in params}

    return step


STEPS = {
    "nemo": step_nemo, "verl": step_verl, "megatron": step_megatron,
    "accelerate": _step_clip(accelerate_clip, plain=True), "torchtitan": _step_clip(torchtitan_clip, plain=False),
}


# --- theirs next to ours ---------------------------------------------------------------------


def _places(framework: str) -> list[tuple[Any, str]]:
    """Where the framework's process-wide patch writes (none: per-model hooks, per-call code)."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    if framework == "nemo":
        return [(collectives, "foreach_reduce"), (param_group, "foreach_reduce"),
                (FSDPParam, "to_accumulated_grad_if_needed"), (param_group.FSDPParamGroup, "post_backward")]
    return []  # verl's swap lives inside its context only (step_verl)


def _records(framework: str) -> dict[str, dict[str, Any]]:
    import fsdp_autopatch

    report = fsdp_autopatch.status()
    out = {}
    for name in OURS[framework]:
        record = report[name]
        out[name] = {"status": record.status.value, "in_force": record.in_force,
                     "displaced": list(record.displaced), "reason": record.reason}
    return out


def _theirs(framework: str, ctx: sc.Ctx) -> dict[str, str]:
    """Apply the framework's process-wide patch (NeMo's; the others act inside their step)."""
    return nemo_apply(load_nemo(ctx.args["nemo_file"])) if framework == "nemo" else {}


def _run(ctx: sc.Ctx, framework: str, order: str) -> dict[str, Any]:
    with ctx.case(f"{framework}/{order}", continue_on_error=True) as rec:
        before = _fired()
        STEPS[framework](ctx, rec)
        after = _fired()
        rec["fired"] = {name: after.get(name, 0) - before.get(name, 0) for name in OURS[framework]}
        rec["records"] = _records(framework) if order != "theirs" else {}
    return rec


def coexist(ctx: sc.Ctx, framework: str) -> None:
    from fsdp_autopatch import _activate, _patching

    _activate.revert_all()
    places = _places(framework)
    torch_values = [vars(owner).get(name) for owner, name in places]
    _activate.activate()
    ctx.data.setdefault("apply_errors", {})[framework] = _theirs(framework, ctx)
    theirs = [vars(owner).get(name) for owner, name in places]
    ctx.data.setdefault("theirs_installed", {})[framework] = [t is not o for t, o in zip(theirs, torch_values)]
    _run(ctx, framework, "after")
    _patching.left_in_place.clear()
    _activate.revert_all()
    ctx.data.setdefault("theirs_kept", {})[framework] = [
        vars(owner).get(name) is value for (owner, name), value in zip(places, theirs)
    ]
    ctx.data.setdefault("left_in_place", {})[framework] = list(_patching.left_in_place)
    _run(ctx, framework, "theirs")
    if places:
        _activate.activate()
        _run(ctx, framework, "before")
        _activate.revert_all()
    for (owner, name), value in zip(places, torch_values):
        setattr(owner, name, value)
    _activate.activate()


def _torch_has_the_fill_api() -> bool:
    """torch's own set_reduce_scatter_unused_params (2.13 on); before it only our backport has one."""
    from packaging.version import Version

    return Version(torch.__version__).release[:2] >= (2, 13)


@scenario("coexist")
def sc_coexist(ctx: sc.Ctx) -> None:
    for framework in ctx.args.get("frameworks", FRAMEWORKS):
        if framework == "nemo" and (not ctx.args.get("nemo_file") or not _torch_has_the_fill_api()):
            continue  # below torch 2.13 NeMo swaps in its own unused-param fill: not measured (2.10 aborted)
        coexist(ctx, framework)
