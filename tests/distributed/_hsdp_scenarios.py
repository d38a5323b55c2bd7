"""4-rank HSDP scenarios: a (2 replicate x 2 shard) mesh, run by ``_dist_launcher.run_ranks``.

Scenarios ``hsdp`` and ``hsdp_cross_rank`` (``run_ranks(name, world_size=4)``; ``_rank`` sets up
gloo, saves each rank's record and leaves with ``os._exit``). The tests import this module for the
plans, the mesh layout and the single-process reference.

Mesh layout (``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))``)::

    replica 0: global ranks 0, 1   (shard group {0, 1})
    replica 1: global ranks 2, 3   (shard group {2, 3})
    replicate groups: {0, 2}, {1, 3}

A parameter's rows are split over the shard dim only (``torch.chunk`` over 2): rank r holds
shard ``r % 2``, and the two replicas hold the same shard. FSDP2 reduce-scatters over the shard
group and all-reduces over the replicate group: each gradient is the mean over all 4 ranks.

All data plans are indexed by the *global* rank.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

import _dist_common as sc
from _cross_rank_check_scenarios import count_cross_rank_checks
from _registry import scenario

REPLICATE = 2
SHARD = 2
WORLD = REPLICATE * SHARD
DIM_NAMES = ("replicate", "shard")


def replica_of(rank: int) -> int:
    return rank // SHARD


def shard_of(rank: int) -> int:
    return rank % SHARD


# --------------------------------------------------------------------------------------
# Data plans: plan(global rank, step, micro_batch) -> forward kwargs + target
# --------------------------------------------------------------------------------------

# (a) sc.plan_grad_guard: text-only steps, then images in the last micro-batch (every rank)
# (c) sc.plan_uniform_late_param (expert 1 joins in the last micro-batch, every rank) and
#     sc.plan_uniform_fill_zero (expert 1 used by global rank 0 in micro-batch 0 only)

ROUTING_EXPERTS = 5


def plan_routing(rank: int, step: int, mb: int) -> dict[str, Any]:
    """(b) rank r uses expert r only (one rank per expert, both replicas); expert 4 every rank."""
    return sc.batch(rank, step, mb, experts=(rank, 4))


RESTORE_EXPERTS = 4
# (d) second step: expert 0 only on global rank 0 (replica 0), expert 3 only on rank 3
# (replica 1), expert 1 on ranks 1 and 2 (one per replica), expert 2 on no rank.
RESTORE_STEP1 = {0: (0,), 1: (1,), 2: (1,), 3: (3,)}


def plan_restore(rank: int, step: int, mb: int) -> dict[str, Any]:
    """(d) step 0 warm-up: every expert on every rank; step 1: RESTORE_STEP1."""
    return sc.batch(rank, step, mb, experts=tuple(range(RESTORE_EXPERTS)) if step == 0 else RESTORE_STEP1[rank])


WINDOW_EXPERTS = 4


def plan_window(rank: int, step: int, mb: int) -> dict[str, Any]:
    """Deferred all-reduce window of 2 micro-batches (all-reduce only on the last).

    Expert 0: global rank 0 in micro-batch 0 only (earlier micro-batch, no rank in the last);
    expert 1: every rank, both micro-batches; expert 2: no rank, no micro-batch;
    expert 3: global rank 3 in the last micro-batch only.
    """
    experts = [1]
    if mb == 0 and rank == 0:
        experts.append(0)
    if mb == 1 and rank == 3:
        experts.append(3)
    return sc.batch(rank, step, mb, experts=tuple(experts))


def reference_grads(model, plan, step: int, n_micro_batches: int) -> dict[str, torch.Tensor | None]:
    """All 4 ranks' global batch in one process, each micro-batch's loss the mean over the ranks."""
    return sc.reference_grads(model, plan, step, n_micro_batches, ranks=tuple(range(WORLD)), world_size=WORLD)


# --------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------


def hsdp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (REPLICATE, SHARD), mesh_dim_names=DIM_NAMES)


def case_grad_guard(ctx: sc.Ctx, mesh) -> None:
    """(a) separately wrapped vision tower skipped by text-only micro-batches, bf16/fp32 MP."""
    from torch.distributed.fsdp import fully_shard

    model = sc.build_model("text_vision")
    mp = sc._mp_policy("bf16")
    for unit in (model.tower, model.shared, model):
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    with ctx.case("grad_guard_text_only", continue_on_error=True) as rec:
        rec["init_params"] = sc.params_local(model)
        sc._run_step(ctx, model, sc.plan_grad_guard, step=0, n_mb=2)
        rec["grads"] = sc.grads_local(model)
    if rec["error"] is not None:  # the upstream crash (patch off): this model is unusable
        return
    model.zero_grad(set_to_none=True)
    with ctx.case("grad_guard_image_last") as rec:
        sc._run_step(ctx, model, sc.plan_grad_guard, step=1, n_mb=2)
        rec["grads"] = sc.grads_local(model)


def experts_unit_with_fill(mesh, n_experts: int):
    """One FSDP unit holding ``n_experts`` experts on the HSDP mesh, unused-param fill on."""
    from torch.distributed.fsdp import fully_shard

    model = sc.build_model("experts", n_experts=n_experts)
    fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)
    return model


def case_routing(ctx: sc.Ctx, mesh) -> None:
    """(b) one FSDP unit, rank r uses expert r: torch's own (2.13+) or the backported fill."""

    model = experts_unit_with_fill(mesh, ROUTING_EXPERTS)
    with ctx.case("routing") as rec:
        rec["group_flags"] = sc.group_flags(model)
        rec["init_params"] = sc.params_local(model)
        sc._run_step(ctx, model, plan_routing, step=0, n_mb=1, accumulate=False)
        rec["grads"] = sc.grads_local(model)


def _uniform_case(ctx: sc.Ctx, mesh, name: str, plan, fill: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    model = sc.build_model("experts", n_experts=2)
    fully_shard(model, mesh=mesh, mp_policy=sc._mp_policy("bf16"))
    if fill:
        model.set_reduce_scatter_unused_params(True)
    # unpatched, late_param asserts on every rank before any collective: the job can go on
    with ctx.case(name, continue_on_error=(name == "late_param")) as rec:
        rec["init_params"] = sc.params_local(model)
        sc._run_step(ctx, model, plan, step=0, n_mb=2)
        rec["grads"] = sc.grads_local(model)


def case_late_param(ctx: sc.Ctx, mesh) -> None:
    """(c) bf16 params, fp32 reduce: expert 1 first used in the last micro-batch."""
    _uniform_case(ctx, mesh, "late_param", sc.plan_uniform_late_param, fill=False)


def case_fill_zero(ctx: sc.Ctx, mesh) -> None:
    """(c) fill on: global rank 0 uses expert 1 in micro-batch 0 only, ranks 1-3 reduce a bf16 zero.

    Unpatched, ranks 1-3 assert and rank 0 is left in its reduce-scatter: run it last.
    """
    _uniform_case(ctx, mesh, "fill_zero", sc.plan_uniform_fill_zero, fill=True)


def case_restore(ctx: sc.Ctx, mesh) -> None:
    """(d) fill on, AdamW(weight_decay=0.1): warm-up step, then RESTORE_STEP1 (expert 2 unused)."""

    model = experts_unit_with_fill(mesh, RESTORE_EXPERTS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with ctx.case("restore_warmup") as rec:
        rec["init_params"] = sc.params_local(model)
        sc._run_step(ctx, model, plan_restore, step=0, n_mb=1, accumulate=False)
        rec["grads"] = sc.grads_local(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    with ctx.case("restore_partial") as rec:
        rec["params_before"] = sc.params_local(model)
        rec["steps_before"] = sc.adam_steps(model, opt)
        rec["exp_avg_before"] = {n: sc._local(opt.state[p]["exp_avg"]) for n, p in model.named_parameters()}
        sc._run_step(ctx, model, plan_restore, step=1, n_mb=1, accumulate=False)
        rec["grads"] = sc.grads_local(model)
        rec["full_grads"] = sc.grads_full(model)
        opt.step()
        rec["params_after"] = sc.params_local(model)
        rec["steps_after"] = sc.adam_steps(model, opt)


def case_window(ctx: sc.Ctx, mesh) -> None:
    """Fill on, ``set_requires_all_reduce(False)`` on micro-batch 0 (the window), fp32."""

    model = experts_unit_with_fill(mesh, WINDOW_EXPERTS)
    with ctx.case("window") as rec:
        rec["init_params"] = sc.params_local(model)
        n_mb = 2
        for mb in range(n_mb):
            model.set_requires_all_reduce(mb == n_mb - 1)
            sc.loss_fn(model, plan_window(ctx.rank, 0, mb)).backward()
        rec["grads"] = sc.grads_local(model)
        rec["full_grads"] = sc.grads_full(model)


CASES: dict[str, Callable[[sc.Ctx, Any], None]] = {
    "grad_guard": case_grad_guard,
    "routing": case_routing,
    "late_param": case_late_param,
    "restore": case_restore,
    "window": case_window,
    "fill_zero": case_fill_zero,  # unpatched it ends the job: keep it last
}


@scenario("hsdp")
def sc_hsdp(ctx: sc.Ctx) -> None:
    """Run ``args["cases"]`` in order on one 2x2 mesh; record the mesh and the store checks."""
    import torch.distributed as dist

    checks = count_cross_rank_checks()
    mesh = hsdp_mesh()
    ctx.data["mesh"] = {
        "shard_group": dist.get_process_group_ranks(mesh.get_group("shard")),
        "replicate_group": dist.get_process_group_ranks(mesh.get_group("replicate")),
    }
    for name in ctx.args["cases"]:
        CASES[name](ctx, mesh)
        ctx.data["store_checks"] = checks[0]


@scenario("hsdp_cross_rank")
def sc_hsdp_cross_rank(ctx: sc.Ctx) -> None:
    """One MLP on the 2x2 mesh, one step: the cross-rank check runs at the first forward."""
    from torch.distributed.fsdp import fully_shard

    mesh = hsdp_mesh()
    with ctx.case("first_forward") as rec:
        model = sc.build_model("mlp")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sc._run_step(ctx, model, sc.plan_mlp, step=0, n_mb=1, accumulate=False)
        rec["grads"] = sc.grads_local(model)
