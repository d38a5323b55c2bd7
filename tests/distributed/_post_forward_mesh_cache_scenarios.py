"""4-rank scenario ``post_forward_mesh_cache`` (``run_ranks("post_forward_mesh_cache", world_size=4)``).

An integer ``reshard_after_forward=2`` on a 4-rank shard mesh makes FSDP2 build a post-forward
``DeviceMesh`` of shape (2, 2): 2 process groups on each rank, per unit without the patch. Every
case counts the process groups this rank gained (``torch.distributed``'s ``_world.pg_map``) around
its ``fully_shard`` calls, and the distinct post-forward meshes among the units. One launch runs:

first world (the launcher's gloo world, 1-D mesh over ranks 0-3)
  ``units8``        8 ``Block`` units + the root, 2 SGD steps: gradients as full tensors per step
  ``second_model``  8 more units while the first model is alive
  ``sliced``        8 units, each ``fully_shard(..., mesh=world_mesh["dp"])`` sliced anew
  ``placement``     8 units whose biases a ``shard_placement_fn`` puts on a second mesh over the
                    same ranks (``ShardPlacementResult``, torch >= 2.12; skipped before)
  ``validation``    the errors of bad values, with the post-forward meshes already built
  ``after_del``     every model deleted and collected, then 8 new units
second world (``destroy_process_group()`` + ``init_process_group()``, models of the first kept)
  ``units16``       16 units + the root, 2 SGD steps; is its post-forward mesh the first world's?
  ``uneven_gc``     ``units16``'s model deleted and collected on rank 0 only (automatic collection
                    off), then 8 new units, 2 SGD steps: ranks whose collector ran at different
                    times must still agree on which groups to create

The tests import this module for the model and the single-process reference.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn

import _dist_common as sc
from _registry import scenario

WORLD = 4
K = 2  # reshard_after_forward: 1 < K < shard size 4
STEPS = 2
LR = 0.1
BAD_VALUES = (3, 0, 8, -2, 2.0)


class Tower(nn.Module):
    """``units`` residual blocks (one FSDP unit each) and a head in the root unit."""

    def __init__(self, units: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(sc.Block() for _ in range(units))
        self.head = nn.Linear(sc.DIM, sc.OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(units: int) -> Tower:
    torch.manual_seed(sc.MODEL_SEED)
    return Tower(units)


def plan(rank: int, step: int, mb: int) -> dict[str, Any]:
    return sc.batch(rank, step, mb)


def reference_steps(model: nn.Module, steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    """The gradients of each SGD step over the 4 ranks' global batch, in one process."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(steps):
        grads = sc.reference_grads(model, plan, step, 1, ranks=tuple(range(WORLD)), world_size=WORLD)
        out.append(grads)
        opt.step()
    return out


# --------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------


def process_groups() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


def post_forward_infos(model: Tower) -> list[Any]:
    from fsdp_autopatch import _compat

    return [g.post_forward_mesh_info for b in model.blocks for g in _compat.state_param_groups(b._get_fsdp_state())]


def shard(model: Tower, mesh, **kwargs: Any) -> int:
    """``fully_shard`` every block with ``reshard_after_forward=K``, then the root; ``mesh`` may be
    a callable giving a mesh per call. Returns the process groups this rank gained."""
    from torch.distributed.fsdp import fully_shard

    def mesh_now():
        return mesh() if callable(mesh) else mesh

    before = process_groups()
    for block in model.blocks:
        fully_shard(block, mesh=mesh_now(), reshard_after_forward=K, **kwargs)
    fully_shard(model, mesh=mesh_now())
    return process_groups() - before


def record_sharding(rec: dict[str, Any], model: Tower, created: int, first: Any = None) -> None:
    infos = post_forward_infos(model)
    rec["pg_fully_shard"] = created
    rec["post_forward_meshes"] = len({id(info) for info in infos})
    rec["units"] = len(model.blocks)
    if first is not None:
        rec["shares_first_mesh"] = all(info is first for info in infos)


def train(ctx: sc.Ctx, rec: dict[str, Any], model: Tower) -> None:
    """STEPS SGD steps; each step's full gradients, and the process groups training created."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    before = process_groups()
    for step in range(STEPS):
        sc.loss_fn(model, plan(ctx.rank, step, 0)).backward()
        rec[f"grads_{step}"] = sc.grads_full(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec["pg_training"] = process_groups() - before


def sharded_and_trained(ctx: sc.Ctx, case: str, units: int, mesh) -> Tower:
    with ctx.case(case) as rec:
        model = build(units)
        rec["init_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        record_sharding(rec, model, shard(model, mesh))
        train(ctx, rec, model)
    return model


def case_second_model(ctx: sc.Ctx, mesh, first: Any) -> Tower:
    with ctx.case("second_model") as rec:
        model = build(8)
        record_sharding(rec, model, shard(model, mesh), first)
    return model


def case_sliced(ctx: sc.Ctx, first: Any) -> Tower:
    from torch.distributed.device_mesh import init_device_mesh

    world_mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("pp", "dp"))
    with ctx.case("sliced") as rec:
        rec["new_mesh_per_slicing"] = world_mesh["dp"] is not world_mesh["dp"]
        model = build(8)
        record_sharding(rec, model, shard(model, lambda: world_mesh["dp"]), first)
    return model


def case_placement(ctx: sc.Ctx, mesh, first: Any) -> Tower | None:
    """Biases on a second mesh over the same ranks, as expert meshes next to a dense mesh have."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    with ctx.case("placement") as rec:
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
        except ImportError:
            rec["skipped"] = "no ShardPlacementResult in this torch"
            return None
        second = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group(list(range(WORLD))), "cpu"), shard_mesh_dim=0)

        def biases_on_second_mesh(param):
            return ShardPlacementResult(Shard(0), second) if param.ndim == 1 else None

        model = build(8)
        created = shard(model, mesh, shard_placement_fn=biases_on_second_mesh)
        record_sharding(rec, model, created)
        rec["shares_first_mesh"] = all(info is first for info in post_forward_infos(model))
    return model


def case_validation(ctx: sc.Ctx, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    with ctx.case("validation") as rec:
        errors = {}
        for value in BAD_VALUES:
            try:
                fully_shard(nn.Linear(sc.DIM, sc.DIM), mesh=mesh, reshard_after_forward=value)
                errors[repr(value)] = "accepted"
            except Exception as e:  # noqa: BLE001 - the error is the measurement
                errors[repr(value)] = f"{type(e).__name__}: {e}"
        rec["errors"] = errors


def case_uneven_gc(ctx: sc.Ctx, mesh, dropped: list) -> None:
    """The last model using the world's post-forward mesh is deleted; automatic collection is off
    and only rank 0 collects (FSDP2 units hold reference cycles, so only the collector frees them):
    then 8 new units. A rank that created groups its peers do not would hang here."""
    dropped.clear()
    if ctx.rank == 0:
        gc.collect()
    with ctx.case("uneven_gc") as rec:
        model = build(8)
        rec["init_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        record_sharding(rec, model, shard(model, mesh))
        train(ctx, rec, model)


def case_after_del(ctx: sc.Ctx, mesh, models: list) -> None:
    with ctx.case("after_del") as rec:
        before = process_groups()
        models.clear()
        gc.collect()
        rec["pg_released_by_del"] = before - process_groups()
        model = build(8)
        record_sharding(rec, model, shard(model, mesh))


def new_world(ctx: sc.Ctx):
    """``destroy_process_group()`` and a new gloo world over the same ranks (a prefix of the old
    store: its server on rank 0 stays up because this rank holds it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("second_world", store),
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timedelta(seconds=int(os.environ.get("FSDP_DIST_PG_TIMEOUT_S", "30"))),
    )
    return init_device_mesh("cpu", (ctx.world_size,))


@scenario("post_forward_mesh_cache")
def sc_mesh_cache(ctx: sc.Ctx) -> None:
    mesh = ctx.mesh
    first_model = sharded_and_trained(ctx, "units8", 8, mesh)
    first = post_forward_infos(first_model)[0]
    models = [first_model, case_second_model(ctx, mesh, first), case_sliced(ctx, first)]
    models.append(case_placement(ctx, mesh, first))
    case_validation(ctx, mesh)
    del first
    case_after_del(ctx, mesh, models)
    kept = build(8)  # a first-world model alive in the second world
    shard(kept, mesh)
    old = post_forward_infos(kept)[0]
    gc.disable()  # from here on only case_uneven_gc collects, and on rank 0 only
    try:
        second_mesh = new_world(ctx)
        holder = [sharded_and_trained(ctx, "units16", 16, second_mesh)]
        infos = post_forward_infos(holder[0])
        ctx.data["cases"]["units16"]["reuses_first_world_mesh"] = any(info is old for info in infos)
        del infos
        case_uneven_gc(ctx, second_mesh, holder)
    finally:
        gc.enable()
    ctx.save()
