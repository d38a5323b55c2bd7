"""``demo --bug clip_grad_norm_multi_mesh``: dense parameters on ("dp",), experts on ("edp",)."""

from __future__ import annotations

from typing import Any

from ._common import (
    DIM,
    TOLERANCE,
    backward_every_rank,
    fsdp_api,
    full_grads,
    max_diff,
    rank_batch,
    sum_loss,
    sum_reduction,
)

WORLD_SIZE = 2
WHAT = (
    "a dense layer on a ('dp',) mesh and an expert on an ('edp',) mesh over the same ranks; clip_grad_norm_"
)


MAX_NORM = 0.1


def _dense_and_expert():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))


def show(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    _, init_device_mesh, fully_shard = fsdp_api()
    dp = init_device_mesh(device, (world_size,), mesh_dim_names=("dp",))
    edp = init_device_mesh(device, (world_size,), mesh_dim_names=("edp",))
    model = _dense_and_expert().to(device)
    sum_reduction(fully_shard(model[1], mesh=edp), fully_shard(model, mesh=dp))
    sum_loss(model, rank_batch(rank, device=device)).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    total = (total.full_tensor() if hasattr(total, "full_tensor") else total).cpu()
    grads = full_grads(model)  # collective
    if rank != 0:
        return {"right": True, "value": ""}
    reference = _dense_and_expert()
    backward_every_rank(reference, sum_loss, world_size)
    ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    diff = max_diff(grads, {n: p.grad for n, p in reference.named_parameters()})
    norm_diff = float((total - ref_total).abs())
    value = (f"total norm {float(total):.6f} (reference {float(ref_total):.6f}); "
             f"max relative |clipped grad - reference| {diff:.1e}")
    return {"right": norm_diff <= TOLERANCE * float(ref_total) and diff <= TOLERANCE, "value": value}
