"""param_grad_hooks_guard's case: gradient-clamping ``register_hook`` hooks on managed parameters, one
registered before fully_shard and one after it (torchrec PRs 4268 / 4253: "any register_hook on a
DTensor param silently never fires")."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_params, judge_against_reference, listed, rank_batch, sum_loss, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "a gradient clamp by Tensor.register_hook on 0.weight before fully_shard and on 2.weight (the sharded "
    "DTensor) after it; 2 Linear units and the root, 3 SGD steps"
)
STEPS = 3
LR = 0.1
CLAMP = 0.05  # well below the gradients' largest entries: a clamp that runs changes the weights


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))


def _clamp(calls: list[int], index: int):
    def clamp(grad):
        calls[index] += 1
        return grad.clamp(-CLAMP, CLAMP)

    return clamp


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    calls = [0, 0]
    model[0].weight.register_hook(_clamp(calls, 0))  # before fully_shard: on the parameter it replaces
    units = [model[0], model[2]]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_reduction(model, *units)
    model[2].weight.register_hook(_clamp(calls, 1))  # after it: on the sharded DTensor
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):  # with the guard on, the first backward raises its GuardError on every rank
        sum_loss(model, rank_batch(rank, device=device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"params": full_params(model), "values": {"hook_calls": calls}}


def reference(world_size: int) -> dict[str, Any]:
    """One process: one backward per step of the mean of every rank's loss, so each clamp sees the
    whole gradient once per step."""
    import torch

    model = _model()
    calls = [0, 0]
    model[0].weight.register_hook(_clamp(calls, 0))
    model[2].weight.register_hook(_clamp(calls, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        (sum(sum_loss(model, rank_batch(rank)) for rank in range(world_size)) / world_size).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"params": listed(dict(model.named_parameters())), "values": {"hook_calls": calls}}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: each hook ran as often as in the reference, and the weights equal the reference's."""
    right, text = judge_against_reference(record, reference)
    got, want = record["values"]["hook_calls"], reference["values"]["hook_calls"]
    return right and got == want, f"the register_hook hooks ran {got} times (reference {want}); {text}"
