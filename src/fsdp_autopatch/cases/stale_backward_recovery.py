"""stale_backward_recovery's case: the loop goes on after a failed backward (torchtitan 1329, composer PR 3866)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_params, judge_against_reference, rank_batch, sum_loss, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "two Linear units and a root-owned head; the first backward raises on every rank (a tensor hook), "
    "the loop catches it, zero_grad, then 2 SGD steps"
)
STEPS = 2
LR = 0.1


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM), nn.Linear(DIM, 4))


def _raise(grad):
    raise RuntimeError("injected")


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_reduction(model, model[0], model[2])
    sharded = list(model.parameters())  # what the optimizer holds
    optimizer = torch.optim.SGD(sharded, lr=LR)
    hook = model[1].register_forward_hook(lambda m, i, out: out.register_hook(_raise) and None)
    try:
        sum_loss(model, rank_batch(rank, device=device)).backward()
    except RuntimeError:  # the user's loop: an OOM, a raising hook: caught, the batch skipped
        pass
    hook.remove()
    optimizer.zero_grad(set_to_none=True)
    counts = []
    for _ in range(STEPS):
        sum_loss(model, rank_batch(rank, device=device)).backward()
        counts.append(sum(p.grad is not None for p in sharded))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"params": full_params(model), "values": {"with_grad": counts, "sharded": len(sharded)}}


def reference(world_size: int) -> dict[str, Any]:
    """One process: the failed batch skipped, SGD on the mean of every rank's loss for the steps after it."""
    import torch

    model = _model()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    counts = []
    for _ in range(STEPS):
        for rank in range(world_size):
            (sum_loss(model, rank_batch(rank)) / world_size).backward()
        counts.append(sum(p.grad is not None for p in params))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"params": full_params(model), "values": {"with_grad": counts, "sharded": len(params)}}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: every sharded parameter gets a gradient at each step, the weights the reference's."""
    right, text = judge_against_reference(record, reference)
    values = record["values"]
    every = all(c == values["sharded"] for c in values["with_grad"])
    counts = " and ".join(map(str, values["with_grad"]))
    text = f"after the failed backward, {counts} of {values['sharded']} sharded params got a grad; {text}"
    return right and every, text
