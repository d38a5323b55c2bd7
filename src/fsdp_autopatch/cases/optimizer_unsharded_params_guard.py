"""``demo --bug optimizer_unsharded_params_guard``: an optimizer built after a no-grad forward."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, guard_stopped, rank_batch, sum_loss, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "two Linear units and a root-owned head, fully_shard(root) without reshard_after_forward; one no_grad "
    "forward, then SGD(model.parameters()) and 3 steps"
)
STEPS = 3


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 4))


def show(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root owns model[2], the head
    sum_reduction(model, model[0], model[1])
    head_before = model[2].weight.full_tensor().clone()  # collective
    with torch.no_grad():  # an eval pass
        model(rank_batch(rank, device=device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for _ in range(STEPS):
            sum_loss(model, rank_batch(rank, device=device)).backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as error:  # the guard's GuardError, raised alike on every rank
        return guard_stopped(error, "the first step stopped")
    moved = float((model[2].weight.full_tensor() - head_before).abs().max())  # collective
    held = sum(1 for g in optimizer.param_groups for p in g["params"] if p is model[2].weight)
    value = f"after {STEPS} steps the root's head.weight moved by {moved:.1e}"
    return {"right": moved > 0 and held == 1, "value": value + ("" if held else " (the optimizer holds a stale copy)")}
