"""clip_grad_norm_multi_mesh's case: dense parameters on ("dp",), experts on ("edp",) (PyTorch issue 180346)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, TOLERANCE, fsdp_api, full_grads, judge_against_reference, rank_batch, sum_loss, sum_reduction

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


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    _, init_device_mesh, fully_shard = fsdp_api()
    dp = init_device_mesh(device, (world_size,), mesh_dim_names=("dp",))
    edp = init_device_mesh(device, (world_size,), mesh_dim_names=("edp",))
    model = _dense_and_expert().to(device)
    sum_reduction(fully_shard(model[1], mesh=edp), fully_shard(model, mesh=dp))
    sum_loss(model, rank_batch(rank, device=device)).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    total = total.full_tensor() if hasattr(total, "full_tensor") else total
    return {"grads": full_grads(model), "values": {"total_norm": float(total)}}


def reference(world_size: int) -> dict[str, Any]:
    import torch

    model = _dense_and_expert()
    for rank in range(world_size):
        (sum_loss(model, rank_batch(rank)) / world_size).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return {"grads": full_grads(model), "values": {"total_norm": float(total)}}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the total norm and the clipped gradients equal the one-process clip's."""
    grads_right, grads_text = judge_against_reference(record, reference)
    total, ref_total = record["values"]["total_norm"], reference["values"]["total_norm"]
    norm_right = abs(total - ref_total) <= TOLERANCE * ref_total
    text = f"total norm {total:.6f} (reference {ref_total:.6f}); {grads_text.replace('grad', 'clipped grad')}"
    return grads_right and norm_right, text
