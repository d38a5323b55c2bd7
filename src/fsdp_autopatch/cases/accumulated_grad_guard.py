"""accumulated_grad_guard's case: a unit that skipped forward in a no-sync micro-batch, with a
reduce_dtype (PyTorch PR 194058, verl PR 7475, NeMo Automodel PR 2744)."""

from __future__ import annotations

from typing import Any

from . import _accumulation
from ._accumulation import judge, reference

WORLD_SIZE = 2
WHAT = (
    "root Linear + fully_shard(late Linear), param_dtype bf16 / reduce_dtype fp32; 2 micro-batches, "
    "sync off on the first, which skips late (the crash, without the patch); late runs in the second"
)


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    return _accumulation.run(rank, world_size, device, late_own_unit=True)


__all__ = ["WHAT", "WORLD_SIZE", "judge", "reference", "run"]
