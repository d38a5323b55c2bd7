"""keep_param_attributes's case: user attributes on parameters across fully_shard (PyTorch issue 136929)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_params, judge_against_reference, rank_batch, sum_loss, sum_reduction

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


def _attributes(model) -> list[str]:
    """The user attributes on the parameters, as ``"<parameter>.<attribute>"``, sorted."""
    return sorted(f"{n}.{k}" for n, p in model.named_parameters() for k in vars(p) if not k.startswith("_"))


def _adamw_step(model) -> None:
    import torch

    params = list(model.parameters())
    no_decay = [p for p in params if getattr(p, "no_weight_decay", False)]
    decay = [p for p in params if not getattr(p, "no_weight_decay", False)]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=0.1).step()


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _tagged_model().to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kept = _attributes(model)
    sum_reduction(model, *model)
    sum_loss(model, rank_batch(rank, device=device)).backward()
    _adamw_step(model)
    return {"params": full_params(model), "values": {"attributes": kept}}


def reference(world_size: int) -> dict[str, Any]:
    model = _tagged_model()
    attributes = _attributes(model)
    for rank in range(world_size):
        (sum_loss(model, rank_batch(rank)) / world_size).backward()
    _adamw_step(model)
    return {"params": full_params(model), "values": {"attributes": attributes}}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: every attribute set before fully_shard is still there, and the weights after the AdamW
    step equal the reference's."""
    params_right, params_text = judge_against_reference(record, reference)
    marks, kept = reference["values"]["attributes"], record["values"]["attributes"]
    marked = sorted({mark.rsplit(".", 1)[0] for mark in marks})
    lost = sorted({mark.rsplit(".", 1)[0] for mark in marks if mark not in kept})
    text = (f"{len(marked) - len(lost)} of {len(marked)} marked parameters keep their attributes"
            + (f" (lost: {', '.join(lost)})" if lost else "")
            + f"; {params_text} after an AdamW step")
    return params_right and kept == marks, text
