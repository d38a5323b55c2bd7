"""``demo --bug stale_backward_recovery``: the loop goes on after a backward that raised."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, rank_batch, sum_loss, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "two Linear units and a root-owned head; the first backward raises on every rank (a tensor hook), "
    "the loop catches it, zero_grad, then 2 SGD steps"
)
STEPS = 2


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM), nn.Linear(DIM, 4))


def _raise(grad):
    raise RuntimeError("injected")


def show(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_reduction(model, model[0], model[2])
    sharded = list(model.parameters())  # what the optimizer holds
    optimizer = torch.optim.SGD(sharded, lr=0.1)
    hook = model[1].register_forward_hook(lambda m, i, out: out.register_hook(_raise) and None)
    try:
        sum_loss(model, rank_batch(rank, device=device)).backward()
    except RuntimeError:  # an OOM, a raising hook: caught, the batch skipped
        pass
    hook.remove()
    optimizer.zero_grad(set_to_none=True)
    counts = []
    for _ in range(STEPS):
        sum_loss(model, rank_batch(rank, device=device)).backward()
        counts.append(sum(p.grad is not None for p in sharded))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    value = f"after the failed backward, {' and '.join(map(str, counts))} of {len(sharded)} sharded params got a grad"
    return {"right": all(c == len(sharded) for c in counts), "value": value}
