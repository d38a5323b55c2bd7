"""optimizer_unsharded_params_guard's case: an optimizer built after a no-grad forward (PyTorch issue 149205)."""

from __future__ import annotations

from typing import Any

from ._common import (
    DIM,
    fsdp_api,
    full_params,
    judge_against_reference,
    rank_batch,
    sgd_steps,
    sum_loss,
    sum_reduction,
)

WORLD_SIZE = 2
WHAT = (
    "two Linear units and a root-owned head, fully_shard(root) without reshard_after_forward; one no_grad "
    "forward, then SGD(model.parameters()) and 3 steps"
)
STEPS = 3
LR = 0.1


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 4))


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
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
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):  # with the guard on, the first step raises its GuardError on every rank
        sum_loss(model, rank_batch(rank, device=device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    moved = float((model[2].weight.full_tensor() - head_before).abs().max())  # collective
    held = any(p is model[2].weight for g in optimizer.param_groups for p in g["params"])
    values = {"head_moved": moved > 0, "head_moved_by": moved, "optimizer_holds_head": held}
    return {"params": full_params(model), "values": values}


def reference(world_size: int) -> dict[str, Any]:
    """One process: SGD on the mean of every rank's loss, the optimizer holding the head itself."""
    model = _model()
    head_before = model[2].weight.detach().clone()
    sgd_steps(model, STEPS, LR, world_size)
    moved = float((model[2].weight.detach() - head_before).abs().max())
    values = {"head_moved": moved > 0, "head_moved_by": moved, "optimizer_holds_head": True}
    return {"params": full_params(model), "values": values}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the head moved, the optimizer holds it, and the weights equal the reference's."""
    params_right, params_text = judge_against_reference(record, reference)
    values = record["values"]
    text = f"after {STEPS} steps the root's head.weight moved by {values['head_moved_by']:.1e}"
    if not values["optimizer_holds_head"]:
        text += " (the optimizer holds a stale copy)"
    return params_right and values["head_moved"] and values["optimizer_holds_head"], f"{text}; {params_text}"
