"""Scenarios on a simulated next torch (``tests/_next_torch``), many cases per launch.

Scenario ``next_torch`` (``run_ranks("next_torch")``, 2 gloo ranks; 4 for the ``mesh`` runs; see
``_registry``). ``args["cases"]``: ``"<patch>/<change>:<run>"``, in order. Each case is
``_next_torch.on_simulated_torch``: the plugin reverted, the change simulated, the plugin activated
on it, the run, the registry read, the plugin reverted, the same run again, the change undone, the
plugin activated again. Recorded per case: ``on``, ``off`` (each the run's record or its error),
``status`` (per patch) and what the new keyword parameters received, or ``skipped`` (the change does
not apply to this torch).

The runs reuse the models, data and helpers of the patches' own scenario files; every value they
record is the same on every rank (full tensors):

- ``accum``: ``sc.TextVisionModel``, the tower skipped by two text-only micro-batches, bf16/fp32;
- ``late_param``, ``uniform``: the experts model, bf16/fp32, expert 1 first used in the second of two
  micro-batches (the dtype mix), or one micro-batch (no mix);
- ``restore``: the experts model, the fill on, AdamW; a warm-up step, then expert 2 used by no rank;
- ``routing``: the experts model, the fill on, rank r uses expert r and 2 (every expert used);
- ``reuse``: ``_grouped_module_reuse_scenarios``' ``mtp`` model, one step;
- ``attrs``: ``_keep_param_attributes_scenarios``' marked model: the marks after fully_shard, forward, backward;
- ``clip``: ``_clip_grad_norm_multi_mesh_scenarios``' model on two meshes and on one, ``clip_grad_norm_`` (with
  ``dtype=torch.float64`` too where the simulated torch has that parameter);
- ``mesh`` (4 ranks): 8 units with ``reshard_after_forward=2``: process groups created, one step.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

TESTS = str(Path(__file__).resolve().parents[1])  # _next_torch lives in tests/
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import torch  # noqa: E402

import _clip_grad_norm_multi_mesh_scenarios as cl  # noqa: E402
import _dist_common as sc  # noqa: E402
import _grouped_module_reuse_scenarios as rs  # noqa: E402
import _keep_param_attributes_scenarios as ats  # noqa: E402
import _next_torch as nt  # noqa: E402
import _next_torch_changes as ch  # noqa: E402
import _post_forward_mesh_cache_scenarios as mc  # noqa: E402
from _registry import scenario  # noqa: E402

# a run that checkpoints: the entries that wait for DCP's state_dict are applied too (after the
# modules above, which bind clip_grad_norm_ before FSDP2 is imported)
importlib.import_module("torch.distributed.checkpoint.state_dict")

CLIP_LAYOUTS = ("two_1d", "one_mesh")
_meshes: dict[str, Any] = {}


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every gradient as a full tensor; None where a rank has none."""
    present = sc.grads_full(model)
    return {name: present.get(name) for name, _ in model.named_parameters()}


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _shard_all(units: list[Any], mesh: Any, **kwargs: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        fully_shard(unit, mesh=mesh, **kwargs)


def run_accum(ctx: sc.Ctx) -> dict[str, Any]:
    model = sc.build_model("text_vision")
    _shard_all([model.tower, model.shared, model], ctx.mesh, mp_policy=sc._mp_policy("bf16"))
    sc._run_step(ctx, model, sc.plan_grad_guard, step=0, n_mb=2)
    return {"grads": full_grads(model)}


def _experts_bf16(ctx: sc.Ctx, micro_batches: int) -> dict[str, Any]:
    model = sc.build_model("experts", n_experts=2)
    _shard_all([model], ctx.mesh, mp_policy=sc._mp_policy("bf16"))
    sc._run_step(ctx, model, sc.plan_uniform_late_param, step=0, n_mb=micro_batches)
    return {"grads": full_grads(model)}


def run_restore(ctx: sc.Ctx) -> dict[str, Any]:
    model = sc.build_model("experts", n_experts=3)
    _shard_all([model], ctx.mesh)
    model.set_reduce_scatter_unused_params(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sc._run_step(ctx, model, sc.plan_restore_unused, step=0, n_mb=1, accumulate=False)
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = full_params(model)
    sc._run_step(ctx, model, sc.plan_restore_unused, step=1, n_mb=1, accumulate=False)
    grads = full_grads(model)
    opt.step()
    return {"params_before": before, "grads": grads, "params_after": full_params(model)}


def run_routing(ctx: sc.Ctx) -> dict[str, Any]:
    model = sc.build_model("experts", n_experts=3)  # expert r on rank r, expert 2 on both: all used
    _shard_all([model], ctx.mesh)
    model.set_reduce_scatter_unused_params(True)
    sc._run_step(ctx, model, sc.plan_expert_routing, step=0, n_mb=1, accumulate=False)
    return {"grads": full_grads(model)}


def run_reuse(ctx: sc.Ctx) -> dict[str, Any]:
    root = rs.build("mtp")
    model = rs.shard(root, ctx, "")
    rs.forward_backward(model, rs.inputs(ctx.rank, 0, 0))
    return {"grads": {n: None if p.grad is None else rs._full(p.grad) for n, p in root.named_parameters()}}


def run_attrs(ctx: sc.Ctx) -> dict[str, Any]:
    model = ats.build_marked_model()
    ats.shard_units(model, ctx.mesh)
    stages = {"fully_shard": ats.snapshot(model)}
    loss = sc.loss_fn(model, ats.plan(ctx.rank, 0, 0))
    stages["forward"] = ats.snapshot(model)
    loss.backward()
    stages["backward"] = ats.snapshot(model)
    return {"stages": stages, "grads": full_grads(model)}


def clip_once(ctx: sc.Ctx, layout: str, dtype: torch.dtype | None) -> dict[str, Any]:
    if not _meshes:
        _meshes.update(cl.meshes(ctx.world_size))  # once per process: every mesh makes groups
    model = cl.shard(cl.build(), layout, _meshes)
    cl.backward(ctx, model, nan=False)
    params = cl.clipped_parameters(model, plain=False)
    extra = {} if dtype is None else {"dtype": dtype}
    total = torch.nn.utils.clip_grad_norm_(params, cl.MAX_NORM, 2.0, **extra)  # looked up now
    return {"total": cl._full(total), "total_type": type(total).__name__,
            "grads": {cl._name(model, p): cl._full(p.grad) for p in params}}


def run_clip(ctx: sc.Ctx) -> dict[str, Any]:
    """One record per layout and dtype, each its own outcome (a failing one does not hide the rest)."""
    has_dtype = "dtype" in inspect.signature(torch.nn.utils.clip_grad_norm_).parameters
    dtypes = (None, torch.float64) if has_dtype else (None,)
    clips = {}
    for layout in CLIP_LAYOUTS:
        for dtype in dtypes:
            key = f"{layout}/{str(dtype).replace('torch.', '')}"
            clips[key] = nt.outcome(lambda layout=layout, dtype=dtype: clip_once(ctx, layout, dtype))
    return {"clips": clips}


def run_mesh(ctx: sc.Ctx) -> dict[str, Any]:
    model = mc.build(8)
    created = mc.shard(model, ctx.mesh)
    meshes = len({id(info) for info in mc.post_forward_infos(model)})
    sc.loss_fn(model, mc.plan(ctx.rank, 0, 0)).backward()
    return {"pg_created": created, "post_forward_meshes": meshes, "grads": full_grads(model)}


RUNS: dict[str, Callable[[sc.Ctx], dict[str, Any]]] = {
    "accum": run_accum,
    "late_param": lambda ctx: _experts_bf16(ctx, 2),
    "uniform": lambda ctx: _experts_bf16(ctx, 1),
    "restore": run_restore,
    "routing": run_routing,
    "reuse": run_reuse,
    "attrs": run_attrs,
    "clip": run_clip,
    "mesh": run_mesh,
}


@scenario("next_torch")
def sc_next_torch(ctx: sc.Ctx) -> None:
    for case in ctx.args["cases"]:
        change, run = case.split(":")
        with ctx.case(case, continue_on_error=True) as rec:
            rec.update(nt.on_simulated_torch(ch.CHANGES[change], lambda run=run: RUNS[run](ctx), label=case))
