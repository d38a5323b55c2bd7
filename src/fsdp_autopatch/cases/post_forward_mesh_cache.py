"""post_forward_mesh_cache's case: process groups per unit with an int reshard_after_forward."""

from __future__ import annotations

from typing import Any

from ._common import (
    DIM,
    fsdp_api,
    full_grads,
    judge_against_reference,
    one_process_grads,
    rank_batch,
    sum_loss,
    sum_reduction,
)

WORLD_SIZE = 4
WHAT = (
    "8 Linear units with reshard_after_forward=2, and the root, on a 4-rank mesh; one backward"
)


MESH_UNITS = 8


def strikes_at(world_size: int) -> tuple[bool, bool, str] | None:
    """The bug needs an even mesh of 4 or more ranks; elsewhere the case is not run."""
    if world_size < 4 or world_size % 2:
        return (False, False, f"needs 1 < reshard_after_forward < shard size, i.e. an even mesh of 4 or more "
                f"ranks (k=2), not {world_size}: not run")
    return None


def _linear_stack():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(MESH_UNITS)))


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
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
    return {"grads": full_grads(model), "values": {"process_groups": created}}


def reference(world_size: int) -> dict[str, Any]:
    return {"grads": one_process_grads(_linear_stack, sum_loss, world_size)}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: at most the one shared mesh's 2 process groups, and the reference's gradients."""
    grads_right, grads_text = judge_against_reference(record, reference)
    created = record["values"]["process_groups"]
    text = (f"{MESH_UNITS} units with reshard_after_forward=2 (and the root) created {created} process groups; "
            + grads_text)
    return grads_right and created <= 2, text
