"""The training runs of the call-time isolation scenarios (``_call_faults_scenarios``).

Each run builds a fresh model (the same seeds every time), trains it on this rank and returns what
the tests compare between phases: full gradients (and which are None), and per run what it is
about (a tag's survival, the unit flags, the process groups built, torch's errors). A run that
raises returns the exception (:func:`outcome`): what reached the training step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

import _clip_grad_norm_multi_mesh_scenarios as cl
import _dist_common as sc
import _grouped_module_reuse_scenarios as rs
import _post_forward_mesh_cache_scenarios as mc

TAG = "no_weight_decay"  # the parameter attribute keep_param_attributes carries
BAD_RESHARD = (3, 0, 2.0)  # invalid reshard_after_forward on a 2-rank mesh: torch's ValueError


def _shard_mlp(ctx: sc.Ctx, model: nn.Module, mp: str | None = None, **kwargs: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    policy = sc._mp_policy(mp)
    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh, mp_policy=policy, **kwargs)
    fully_shard(model, mesh=ctx.mesh, mp_policy=policy)
    return model


def _grads(model: nn.Module) -> dict[str, Any]:
    return {"grads": sc.grads_full(model), "none": {n: p.grad is None for n, p in model.named_parameters()}}


def run_mlp(ctx: sc.Ctx) -> dict[str, Any]:
    model = _shard_mlp(ctx, sc.build_model("mlp"))
    flags = sc.group_flags(model)
    sc._run_step(ctx, model, sc.plan_mlp, step=0, n_mb=1, accumulate=False)
    return {**_grads(model), "flags": flags}


def run_mlp_bf16_accum(ctx: sc.Ctx) -> dict[str, Any]:
    model = _shard_mlp(ctx, sc.build_model("mlp"), "bf16")
    sc._run_step(ctx, model, sc.plan_mlp, step=0, n_mb=2)
    return _grads(model)


def run_tower_skipped(ctx: sc.Ctx) -> dict[str, Any]:
    """accumulated_grad_guard's bug: the vision tower never runs forward (torch: AttributeError)."""
    from torch.distributed.fsdp import fully_shard

    model, policy = sc.build_model("text_vision"), sc._mp_policy("bf16")
    for unit in (model.tower, model.shared, model):
        fully_shard(unit, mesh=ctx.mesh, mp_policy=policy)
    sc._run_step(ctx, model, sc.plan_grad_guard, step=0, n_mb=2)
    return _grads(model)


def run_late_param(ctx: sc.Ctx) -> dict[str, Any]:
    """uniform_reduce_dtype's bug: an expert first used in the last micro-batch (torch: AssertionError)."""
    from torch.distributed.fsdp import fully_shard

    model = sc.build_model("experts", n_experts=2)
    fully_shard(model, mesh=ctx.mesh, mp_policy=sc._mp_policy("bf16"))
    sc._run_step(ctx, model, sc.plan_uniform_late_param, step=0, n_mb=2)
    return _grads(model)


def run_unused_expert(ctx: sc.Ctx) -> dict[str, Any]:
    """restore_unused_param_grads' bug: the fill on, expert 2 used by no rank (torch: a zero gradient)."""
    from torch.distributed.fsdp import fully_shard

    model = sc.build_model("experts", n_experts=3)
    fully_shard(model, mesh=ctx.mesh)
    model.set_reduce_scatter_unused_params(True)
    sc._run_step(ctx, model, sc.plan_restore_unused, step=1, n_mb=1, accumulate=False)
    return _grads(model)


def run_reshard_int(ctx: sc.Ctx) -> dict[str, Any]:
    """Every block with reshard_after_forward=2 (an int): a post-forward mesh of its own per unit
    where 2 < the shard size (4 ranks), torch's own normalisation to True on 2 ranks."""
    model = mc.build(4)
    created = mc.shard(model, ctx.mesh)
    sc.loss_fn(model, mc.plan(ctx.rank, 0, 0)).backward()
    return {**_grads(model), "groups": created, "meshes": len({id(i) for i in mc.post_forward_infos(model)})}


def run_invalid_reshard(ctx: sc.Ctx) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    errors = {}
    for value in BAD_RESHARD:
        try:
            fully_shard(nn.Linear(sc.DIM, sc.DIM), mesh=ctx.mesh, reshard_after_forward=value)
            errors[repr(value)] = None
        except Exception as error:  # noqa: BLE001 - torch's error is the measurement
            errors[repr(value)] = _error(error)
    return {"errors": errors}


def _reuse(mode: str) -> Callable[[sc.Ctx], dict[str, Any]]:
    def run(ctx: sc.Ctx) -> dict[str, Any]:
        model = rs.shard(rs.build(mode), ctx, "")
        rs.forward_backward(model, rs.inputs(ctx.rank, 0, 0))
        return _grads(model)

    return run


def run_attributes(ctx: sc.Ctx) -> dict[str, Any]:
    """A tag on every parameter before fully_shard, read after it, after a step and after ``float()``."""
    model = sc.build_model("mlp")
    for param in model.parameters():
        setattr(param, TAG, True)

    def tags() -> dict[str, Any]:
        return {n: getattr(p, TAG, None) for n, p in model.named_parameters()}

    _shard_mlp(ctx, model)
    out = {"tags_sharded": tags()}
    sc._run_step(ctx, model, sc.plan_mlp, step=0, n_mb=1, accumulate=False)
    out["tags_trained"] = tags()
    out["float_returns_model"] = model.float() is model  # FSDPModule._apply
    out["tags_after_apply"] = tags()
    return {**out, **_grads(model)}


_MESHES: dict[str, Any] = {}


def _clip(layout: str) -> Callable[[sc.Ctx], dict[str, Any]]:
    def run(ctx: sc.Ctx) -> dict[str, Any]:
        if not _MESHES:
            _MESHES.update(cl.meshes(ctx.world_size))
        model = cl.shard(cl.build(), layout, _MESHES)
        total = cl.clip(ctx, model, f"{layout}/clip/2/none/dtensors")
        grads = {n: cl._full(p.grad) for n, p in model.named_parameters()}
        return {"total": float(cl._full(total)), "grads": grads}

    return run


RUNS: dict[str, Callable[[sc.Ctx], dict[str, Any]]] = {
    "mlp": run_mlp,
    "mlp_bf16_accum": run_mlp_bf16_accum,
    "tower_skipped": run_tower_skipped,
    "late_param": run_late_param,
    "unused_expert": run_unused_expert,
    "reshard_int": run_reshard_int,
    "invalid_reshard": run_invalid_reshard,
    "reuse_full": _reuse("full"),
    "reuse_mtp": _reuse("mtp"),
    "attributes": run_attributes,
    "clip_one_mesh": _clip("one_mesh"),
    "clip_two_meshes": _clip("two_1d"),
}


def _error(error: BaseException) -> dict[str, Any]:
    record = sc._error_record(error)
    record["message"] = record["message"][:4000]
    record["traceback"] = record["traceback"][-6000:]
    return record


def outcome(ctx: sc.Ctx, run: str) -> dict[str, Any]:
    try:
        return {"error": None, **RUNS[run](ctx)}
    except Exception as error:  # noqa: BLE001 - what reaches the training step is the measurement
        return {"error": _error(error)}
