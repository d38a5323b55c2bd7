"""``demo --bug compiled_autograd_guard``: FSDP2's backward under compiled autograd."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, guard_stopped, rank_batch, sum_loss

WORLD_SIZE = 2
WHAT = (
    "Linear, ReLU, Linear, each Linear and the root fully_shard'ed; 3 SGD steps with "
    "compiled_autograd._enable(torch.compile(backend='eager')) around backward()"
)
STEPS = 3


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 4))


def show(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch
    from torch._dynamo import compiled_autograd

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=mesh)
    first = model[0].weight  # the sharded parameter the optimizer updates
    before = first.full_tensor().clone()  # collective
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for _ in range(STEPS):
            loss = sum_loss(model, rank_batch(rank, device=device))
            with compiled_autograd._enable(torch.compile(backend="eager")):
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as error:  # the guard's GuardError, raised alike on every rank
        return guard_stopped(error, "the first backward stopped")
    moved = float((first.full_tensor() - before).abs().max())  # collective
    value = f"after {STEPS} steps the first layer's weight moved by {moved:.1e} (eager FSDP2: it trains)"
    return {"right": moved > 0, "value": value}
