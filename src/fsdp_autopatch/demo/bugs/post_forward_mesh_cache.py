"""``demo --bug post_forward_mesh_cache``: process groups per unit with an int reshard_after_forward."""

from __future__ import annotations

from typing import Any

from .._bug_common import DIM, fsdp_api, grads_verdict, rank_batch, sum_loss, sum_reduction

WORLD_SIZE = 4
WHAT = (
    "8 Linear units with reshard_after_forward=2, and the root, on a 4-rank mesh; one backward"
)


MESH_UNITS = 8


def _linear_stack():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(MESH_UNITS)))


def show(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    dist, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _linear_stack().to(device)
    groups_before = len(dist.distributed_c10d._world.pg_map)
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)  # the root as most scripts leave it: the count is the units'
    created = len(dist.distributed_c10d._world.pg_map) - groups_before
    sum_reduction(model, *model)
    sum_loss(model, rank_batch(rank, device=device)).backward()
    diff, grads_right = grads_verdict(model, _linear_stack, sum_loss, world_size, rank)
    value = (f"{MESH_UNITS} units with reshard_after_forward=2 (and the root) on {world_size} ranks created "
             f"{created} process groups; max relative |grad - reference| {diff:.1e}")
    return {"right": grads_right and created <= 2, "value": value, "process_groups": created}
