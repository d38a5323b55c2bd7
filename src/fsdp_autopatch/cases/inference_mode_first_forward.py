"""inference_mode_first_forward's case: an evaluation under ``torch.inference_mode()`` before the first
training step (no upstream issue; PyTorch PR 197327 fixed a different inference-mode crash)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_grads, one_process_grads, rank_batch, sum_loss, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "fully_shard(layer) and the root; one evaluation forward under torch.inference_mode() before any "
    "training step, then a training forward and backward"
)


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_reduction(model, model[0])
    with torch.inference_mode():  # the evaluation: FSDP2's first unshard
        model(rank_batch(rank, device=device))
    sum_loss(model, rank_batch(rank, device=device)).backward()
    return {"grads": full_grads(model)}


def reference(world_size: int) -> dict[str, Any]:
    """No evaluation at all: it changes nothing (what one under ``torch.no_grad()`` gives)."""
    return {"grads": one_process_grads(_model, sum_loss, world_size)}
