"""compiled_autograd_guard's case: FSDP2's backward under compiled autograd (torchtitan issue 1708)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_params, judge_against_reference, rank_batch, sgd_steps, sum_loss

WORLD_SIZE = 2
WHAT = (
    "Linear, ReLU, Linear, each Linear and the root fully_shard'ed; 3 SGD steps with "
    "compiled_autograd._enable(torch.compile(backend='eager')) around backward()"
)
STEPS = 3
LR = 0.1


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 4))


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch
    from torch._dynamo import compiled_autograd

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=mesh)
    first = model[0].weight  # the sharded parameter the optimizer updates
    before = first.full_tensor().clone()  # collective
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):  # with the guard on, the first backward raises its GuardError on every rank
        loss = sum_loss(model, rank_batch(rank, device=device))
        with compiled_autograd._enable(torch.compile(backend="eager")):
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    moved = float((first.full_tensor() - before).abs().max())  # collective
    return {"params": full_params(model), "values": {"first_weight_moved": moved > 0, "first_weight_moved_by": moved}}


def reference(world_size: int) -> dict[str, Any]:
    """One process, eager: SGD on the mean of every rank's loss (what eager FSDP2 trains to)."""
    model = _model()
    before = model[0].weight.detach().clone()
    sgd_steps(model, STEPS, LR, world_size)
    moved = float((model[0].weight.detach() - before).abs().max())
    return {"params": full_params(model), "values": {"first_weight_moved": moved > 0, "first_weight_moved_by": moved}}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the weights equal the eager one-process reference's (the first layer trains)."""
    right, text = judge_against_reference(record, reference)
    moved = record["values"]["first_weight_moved_by"]
    return right, (f"after {STEPS} steps the first layer's weight moved by {moved:.1e} "
                   f"(eager: {reference['values']['first_weight_moved_by']:.1e}); {text}")
