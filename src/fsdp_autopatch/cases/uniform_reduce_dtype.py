"""uniform_reduce_dtype's case: a parameter first used in the reducing micro-batch, bf16 params and
fp32 reduce (PyTorch issue 196996, PyTorch PR 160279, NeMo Automodel PR 3540)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_grads, max_diff, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "fully_shard(a, b: 2 Linear), param_dtype bf16 / reduce_dtype fp32; 2 micro-batches, sync off on "
    "the first (a only), b first used in the second (a + b)"
)

MICRO_BATCHES = 2
BF16_TOLERANCE = 2e-2  # bf16 compute against the fp32 reference


def _model():
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

        def forward(self, x, use_b: bool):
            h = self.a(x)
            return h + self.b(x) if use_b else h

    torch.manual_seed(0)
    return Model()


def _batch(rank: int, micro: int, device: str = "cpu"):
    import torch

    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 + 10 * rank + micro)).to(device)


def _loss(model, rank: int, micro: int, device: str = "cpu"):
    # b's first gradient (bf16) meets a's accumulated one (fp32) in the reducing micro-batch
    return model(_batch(rank, micro, device), use_b=micro == MICRO_BATCHES - 1).float().pow(2).sum()


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                 reduce_dtype=torch.float32))
    sum_reduction(model)
    for micro in range(MICRO_BATCHES):
        model.set_requires_gradient_sync(micro == MICRO_BATCHES - 1)
        _loss(model, rank, micro, device).backward()  # micro-batch 1: the assertion, without the patch
    return {"grads": full_grads(model)}


def reference(world_size: int) -> dict[str, Any]:
    model = _model()
    for micro in range(MICRO_BATCHES):
        for rank in range(world_size):
            (_loss(model, rank, micro) / world_size).backward()
    return {"grads": full_grads(model)}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the reduce-scatter completed with the reference's gradients, within bf16's tolerance."""
    diff = max_diff(record.get("grads", {}), reference["grads"])
    return diff <= BF16_TOLERANCE, (f"reduce-scatter completed; max relative |grad - reference| {diff:.1e} "
                                    f"(bf16 tolerance {BF16_TOLERANCE:g})")
