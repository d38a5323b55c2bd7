"""gradient_divide_factor_single_rank's case: a custom divide factor on an HSDP (2, 1) mesh (PyTorch issue 155903)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_grads, judge_against_reference, rank_batch, sum_loss

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


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size, 1), mesh_dim_names=("replicate", "shard"))
    model = _model().to(device)
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=mesh)
    for unit in (model[0], model[2], model):  # the setters act on each unit's own parameters
        unit.set_gradient_divide_factor(FACTOR)
        unit.set_force_sum_reduction_for_comms(True)
    sum_loss(model, rank_batch(rank, device=device)).backward()
    return {"grads": full_grads(model)}


def reference(world_size: int) -> dict[str, Any]:
    """One process: the sum of every rank's gradient, divided by the factor."""
    model = _model()
    for rank in range(world_size):
        (sum_loss(model, rank_batch(rank)) / FACTOR).backward()
    return {"grads": full_grads(model)}


def _norm(grads: dict[str, Any]) -> float:
    import torch

    return sum(float(torch.as_tensor(g).double().norm()) ** 2 for g in grads.values()) ** 0.5


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """The default verdict, with the ratio of the norms: 1 right, the factor where it divides twice."""
    right, text = judge_against_reference(record, reference)
    ratio = _norm(reference["grads"]) / max(_norm(record.get("grads", {})), 1e-30)
    return right, f"|reference| / |grad| = {ratio:.4f} (1 right, {FACTOR:g} divided twice); {text}"
