"""The four patches, in the order they are applied.

Each patch module reads top to bottom as: the bug (symptom, trigger, upstream reference) ->
the torch versions affected -> how "needed here?" is decided -> the replacement. It ends with
``PATCH``, a small declarative object, so the hook, the registry and the CLI treat all four alike.

The order matters: ``restore_unused_param_grads`` must wrap ``FSDPParamGroup.post_backward``
after ``unused_param_reduction`` does, so that its usage probe runs before the zero fill.
"""

from __future__ import annotations

import importlib
from typing import Callable, NamedTuple

from .._compat import Verdict
from .._config import PATCH_NAMES


class Patch(NamedTuple):
    name: str
    summary: str
    check: Callable[[], Verdict]  # "needed here?" from torch's version and internals
    apply: Callable[[], str]  # atomic and idempotent; returns what it changed (for the registry)
    revert: Callable[[], None]  # undo (tests)


def load_patch(name: str) -> Patch:
    """Import one patch module (it imports torch internals) and return its ``PATCH``."""
    return importlib.import_module(f"{__name__}.{name}").PATCH


def load_patches() -> tuple[Patch, ...]:
    """Every patch's ``PATCH``, in the order they are applied."""
    return tuple(load_patch(name) for name in PATCH_NAMES)


__all__ = ["PATCH_NAMES", "Patch", "load_patch", "load_patches"]
