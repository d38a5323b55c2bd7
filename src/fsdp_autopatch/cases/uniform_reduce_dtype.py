"""uniform_reduce_dtype's case: a parameter first used in the reducing micro-batch, bf16 params and
fp32 reduce (PyTorch issue 196996, PyTorch PR 160279, NeMo Automodel PR 3540)."""

from __future__ import annotations

from typing import Any

from . import _accumulation
from ._accumulation import judge, reference

WORLD_SIZE = 2
WHAT = (
    "fully_shard(early, late: 2 Linear), param_dtype bf16 / reduce_dtype fp32; 2 micro-batches, sync off on "
    "the first (early only), late first used in the second (its bf16 gradient next to early's fp32: the assertion)"
)


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    return _accumulation.run(rank, world_size, device, late_own_unit=False)


__all__ = ["WHAT", "WORLD_SIZE", "judge", "reference", "run"]
