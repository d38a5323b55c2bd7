"""The model that bugs (a) and (c) share: gradient accumulation with bf16 parameters and an fp32
``reduce_dtype``, where a Linear ``late`` runs forward only in the last micro-batch (sync on).

``late`` as its own unit never ran forward before the first, no-sync micro-batch's post-backward
(``accumulated_grad_guard``); ``late`` in the same unit as ``early`` gives its first (bf16) gradient
next to ``early``'s accumulated fp32 one in the reducing micro-batch (``uniform_reduce_dtype``).
"""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_grads, max_diff, sum_reduction

MICRO_BATCHES = 2
BF16_TOLERANCE = 2e-2  # bf16 compute against the fp32 reference


def _model():
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.early, self.late = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

        def forward(self, x, use_late: bool):
            h = self.early(x)
            return h + self.late(x) if use_late else h

    torch.manual_seed(0)
    return Model()


def _loss(model, rank: int, micro: int, device: str = "cpu"):
    import torch

    batch = torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 + 10 * rank + micro)).to(device)
    return model(batch, use_late=micro == MICRO_BATCHES - 1).float().pow(2).sum()


def run(rank: int, world_size: int, device: str, late_own_unit: bool) -> dict[str, Any]:
    """Shard (``late`` its own unit or not), then accumulate: sync off on micro-batch 0, on on 1."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _model().to(device)
    units = [fully_shard(model.late, mesh=mesh, mp_policy=mp)] if late_own_unit else []
    sum_reduction(fully_shard(model, mesh=mesh, mp_policy=mp), *units)
    for micro in range(MICRO_BATCHES):
        model.set_requires_gradient_sync(micro == MICRO_BATCHES - 1)
        _loss(model, rank, micro, device).backward()
    return {"grads": full_grads(model)}


def reference(world_size: int) -> dict[str, Any]:
    """One process, fp32: every micro-batch of every rank, the mean over the ranks."""
    model = _model()
    for micro in range(MICRO_BATCHES):
        for rank in range(world_size):
            (_loss(model, rank, micro) / world_size).backward()
    return {"grads": full_grads(model)}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the accumulation completed with the reference's gradients, within bf16's tolerance."""
    diff = max_diff(record.get("grads", {}), reference["grads"])
    return diff <= BF16_TOLERANCE, (f"{MICRO_BATCHES} micro-batches reduced; max relative |grad - reference| "
                                    f"{diff:.1e} (bf16 tolerance {BF16_TOLERANCE:g})")
