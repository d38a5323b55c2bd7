"""The ``demo --bug NAME`` shows: one module per patch, named after it, found by listing this package.

A show module holds ``WORLD_SIZE`` (ranks), ``WHAT`` (the run, in one line) and
``show(rank, world_size, device="cpu") -> {"right": bool, "value": str}``: the smallest training that
meets the bug, built with FSDP2, and on rank 0 what was measured and whether it is right. The demo
runs it on CPU ranks (gloo); ``scripts/gpu_check.py`` runs it on CUDA (``device="cuda"``, NCCL, the
rank's current device) for every entry it has no case of its own for. Batches and one-process
references are made on the CPU, so a show reads the same numbers on every device.
It imports torch inside functions only: the demo's parent process reads its names and sizes here,
stdlib only. Adding a show is adding a module; ``demo --bug`` and its ``--help`` list it.
"""

from __future__ import annotations

import importlib
import pkgutil

NAMES = tuple(sorted(module.name for module in pkgutil.iter_modules(__path__) if not module.name.startswith("_")))


def load(name: str):
    """The show module of patch ``name`` (a ``KeyError`` for a name without a show)."""
    if name not in NAMES:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name}")
