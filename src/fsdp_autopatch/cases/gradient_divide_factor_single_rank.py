"""``demo --bug gradient_divide_factor_single_rank``: a custom divide factor on an HSDP (2, 1) mesh."""

from __future__ import annotations

from typing import Any

from ._common import DIM, TOLERANCE, fsdp_api, full_grads, max_diff, rank_batch, sum_loss

WORLD_SIZE = 2
WHAT = (
    "HSDP mesh (2, 1) (a one-rank shard group), set_gradient_divide_factor(4) and "
    "set_force_sum_reduction_for_comms(True) on every unit; one backward"
)


FACTOR = 4.0


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM))


def _reference(world_size: int) -> dict[str, Any]:
    """One process: the sum of every rank's gradient, divided by the factor."""
    model = _model()
    for rank in range(world_size):
        sum_loss(model, rank_batch(rank)).backward()
    return {n: p.grad / FACTOR for n, p in model.named_parameters()}


def _norm(grads: dict[str, Any]) -> float:
    return sum(float(g.double().norm()) ** 2 for g in grads.values()) ** 0.5


def show(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size, 1), mesh_dim_names=("replicate", "shard"))
    model = _model().to(device)
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=mesh)
    for unit in (model[0], model[2], model):  # the setters act on each unit's own parameters
        unit.set_gradient_divide_factor(FACTOR)
        unit.set_force_sum_reduction_for_comms(True)
    sum_loss(model, rank_batch(rank, device=device)).backward()
    grads = full_grads(model)  # collective: every rank
    if rank != 0:
        return {"right": True, "value": ""}
    reference = _reference(world_size)
    diff = max_diff(grads, reference)
    value = (f"|reference| / |grad| = {_norm(reference) / _norm(grads):.4f} (1 right, {FACTOR:g} divided twice); "
             f"max relative |grad - reference| {diff:.1e}")
    return {"right": diff <= TOLERANCE, "value": value}
