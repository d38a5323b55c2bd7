"""``demo --bug keep_param_attributes``: user attributes on parameters across fully_shard."""

from __future__ import annotations

from typing import Any

from ._common import DIM, TOLERANCE, backward_every_rank, fsdp_api, max_diff, rank_batch, sum_loss, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "parameters marked no_weight_decay / tagged before fully_shard; AdamW groups built from the marks; one step"
)


WEIGHT_DECAY = 0.5


def _tagged_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, DIM))
    for param in (model[0].bias, model[1].weight, model[1].bias, model[2].bias):
        param.no_weight_decay = True
    model[2].weight.tag = "expert"
    return model


def _user_attributes(model) -> dict[str, list[str]]:
    return {n: sorted(k for k in vars(p) if not k.startswith("_")) for n, p in model.named_parameters()}


def _adamw_step(model) -> None:
    import torch

    params = list(model.parameters())
    no_decay = [p for p in params if getattr(p, "no_weight_decay", False)]
    decay = [p for p in params if not getattr(p, "no_weight_decay", False)]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=0.1).step()


def show(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model, reference = _tagged_model().to(device), _tagged_model()
    expected = _user_attributes(reference)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kept = _user_attributes(model)
    sum_reduction(model, *model)
    sum_loss(model, rank_batch(rank, device=device)).backward()
    _adamw_step(model)
    weights = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}  # collective
    if rank != 0:
        return {"right": True, "value": ""}
    backward_every_rank(reference, sum_loss, world_size)
    _adamw_step(reference)
    diff = max_diff(weights, dict(reference.named_parameters()))
    marked = sorted(n for n in expected if expected[n])
    lost = [n for n in marked if kept[n] != expected[n]]
    value = (f"{len(marked) - len(lost)} of {len(marked)} marked parameters keep their attributes"
             + (f" (lost: {', '.join(lost)})" if lost else "")
             + f"; max relative |weight - reference| after an AdamW step {diff:.1e}")
    return {"right": not lost and diff <= TOLERANCE, "value": value}
