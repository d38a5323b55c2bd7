"""accumulated_grad_guard's case: a unit that skipped forward in a no-sync micro-batch, with a
reduce_dtype (PyTorch PR 194058, verl PR 7475, NeMo Automodel PR 2744)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_grads, max_diff, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "root Linear + fully_shard(side Linear), param_dtype bf16 / reduce_dtype fp32; 2 micro-batches, "
    "sync off on the first, which skips side; side runs in the second"
)

MICRO_BATCHES = 2
BF16_TOLERANCE = 2e-2  # bf16 compute against the fp32 reference


def _model():
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.main, self.side = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

        def forward(self, x, use_side: bool):
            h = self.main(x)
            return h + self.side(x) if use_side else h  # side runs forward on the last micro-batch only

    torch.manual_seed(0)
    return Model()


def _batch(rank: int, micro: int, device: str = "cpu"):
    import torch

    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 + 10 * rank + micro)).to(device)


def _loss(model, rank: int, micro: int, device: str = "cpu"):
    return model(_batch(rank, micro, device), use_side=micro == MICRO_BATCHES - 1).float().pow(2).sum()


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _model().to(device)
    fully_shard(model.side, mesh=mesh, mp_policy=mp)  # its own unit: never ran forward before micro-batch 1
    fully_shard(model, mesh=mesh, mp_policy=mp)
    sum_reduction(model, model.side)
    for micro in range(MICRO_BATCHES):
        model.set_requires_gradient_sync(micro == MICRO_BATCHES - 1)
        _loss(model, rank, micro, device).backward()  # micro-batch 0: the crash, without the patch
    return {"grads": full_grads(model)}


def reference(world_size: int) -> dict[str, Any]:
    model = _model()
    for micro in range(MICRO_BATCHES):
        for rank in range(world_size):
            (_loss(model, rank, micro) / world_size).backward()
    return {"grads": full_grads(model)}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the accumulation completed with the reference's gradients, within bf16's tolerance."""
    diff = max_diff(record.get("grads", {}), reference["grads"])
    return diff <= BF16_TOLERANCE, (f"{MICRO_BATCHES} micro-batches completed; max relative |grad - reference| "
                                    f"{diff:.1e} (bf16 tolerance {BF16_TOLERANCE:g})")
