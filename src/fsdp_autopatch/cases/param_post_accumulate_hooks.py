"""param_post_accumulate_hooks's case: an optimizer in backward, its hooks registered before fully_shard
(PyTorch PR 129450 runs a sharded parameter's hooks; torchrec PR 4268 moved to these hooks for FSDP2)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_params, judge_against_reference, listed, rank_batch, sum_loss, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "an optimizer in backward: a per-parameter SGD step in post-accumulate-grad hooks registered before "
    "fully_shard (3 Linear units and the root), 3 steps; then the hooks removed by their handles and one more backward"
)
STEPS = 3
LR = 0.1


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))


def _step_in_backward(model, fires: list[int]) -> list[Any]:
    """One SGD step per parameter as soon as its gradient is accumulated (the optimizer-in-backward
    pattern); returns the hooks' handles."""
    import torch

    def sgd_step(param) -> None:
        fires[0] += 1
        with torch.no_grad():
            param.add_(param.grad, alpha=-LR)
        param.grad = None

    return [param.register_post_accumulate_grad_hook(sgd_step) for param in model.parameters()]


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    fires = [0]
    handles = _step_in_backward(model, fires)  # before fully_shard, on the parameters it replaces
    units = [model[0], model[2], model[4]]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_reduction(model, *units)
    for _ in range(STEPS):
        sum_loss(model, rank_batch(rank, device=device)).backward()
    fired = fires[0]
    for handle in handles:  # the user's handles still remove the hooks
        handle.remove()
    sum_loss(model, rank_batch(rank, device=device)).backward()
    return {"params": full_params(model), "values": {"hook_calls": fired, "hook_calls_after_remove": fires[0]}}


def reference(world_size: int) -> dict[str, Any]:
    """One process: one backward per step of the mean of every rank's loss (the hooks run once per step)."""
    model = _model()
    fires = [0]
    handles = _step_in_backward(model, fires)
    for _ in range(STEPS):
        (sum(sum_loss(model, rank_batch(rank)) for rank in range(world_size)) / world_size).backward()
    fired = fires[0]
    for handle in handles:
        handle.remove()
    (sum(sum_loss(model, rank_batch(rank)) for rank in range(world_size)) / world_size).backward()
    params = listed(dict(model.named_parameters()))
    return {"params": params, "values": {"hook_calls": fired, "hook_calls_after_remove": fires[0]}}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the hooks ran as often as in the reference (and not after their removal), and the
    weights they stepped equal the reference's."""
    right, text = judge_against_reference(record, reference)
    got, want = record["values"], reference["values"]
    return right and got == want, (f"the post-accumulate-grad hooks ran {got['hook_calls']} times "
                                   f"(reference {want['hook_calls']}); {text}")
