"""reshard_stale_unsharded's case: ``set_reshard_after_backward(False)`` left on across optimizer steps
(Robbyant/lingbot-vla PR 50: "manually reshard all FSDP2 modules after optimizer step")."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, judge_against_reference, listed, rank_batch, sum_loss, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "two Linear units and a root-owned head, set_reshard_after_backward(False) on every unit; 3 steps of "
    "backward, clip_grad_norm_(model.parameters(), 1.0), SGD"
)
STEPS = 3
LR = 0.1
MAX_NORM = 1.0


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 4))


def _local(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, batches_of_step, params) -> dict[str, Any]:
    """The loop both runs share: per step, backward, clip what ``model.parameters()`` shows, step."""
    import torch

    optimizer = torch.optim.SGD(params.values(), lr=LR)
    with_grad, norms = [], []
    for step in range(STEPS):
        for loss in batches_of_step(step):
            loss.backward()
        shown = list(model.parameters())  # what the user's clip sees
        with_grad.append(sum(p.grad is not None for p in shown))
        norms.append(float(_local(torch.nn.utils.clip_grad_norm_(shown, MAX_NORM))))  # collective
        optimizer.step()
        optimizer.zero_grad()
    values = {"with_grad": with_grad, "clip_norm": norms[0], "shown": len(params)}
    return {"params": listed({name: _local(p) for name, p in params.items()}), "values": values}


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root owns model[4], the head
    sum_reduction(model, model[0], model[2])
    model.set_reshard_after_backward(False)  # meant for an accumulation window, left on across the steps
    params = dict(model.named_parameters())  # the sharded parameters: what the optimizer steps
    batch = rank_batch(rank, device=device)
    return _train(model, lambda step: [sum_loss(model, batch)], params)


def reference(world_size: int) -> dict[str, Any]:
    """One process: each step on the mean of every rank's loss, clipped, then SGD."""
    model = _model()
    batches = [rank_batch(rank) for rank in range(world_size)]
    params = dict(model.named_parameters())
    return _train(model, lambda step: [sum_loss(model, b) / world_size for b in batches], params)


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the clip sees every gradient (the reference's norm) and the weights equal the reference's."""
    right, text = judge_against_reference(record, reference)
    values, ref = record["values"], reference["values"]
    counts = " / ".join(map(str, values["with_grad"]))
    every = all(count == values["shown"] for count in values["with_grad"])
    text = (f"clip_grad_norm_(model.parameters()) saw {counts} of {values['shown']} gradients, norm "
            f"{values['clip_norm']:.3g} (reference {ref['clip_norm']:.3g}); {text}")
    return right and every, text
