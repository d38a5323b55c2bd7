"""The patch modules: one per fix, guard or policy, each declaring one ``PATCH``.

Which entries exist, of which kind, and in which order they apply is the catalogue's
(``fsdp_autopatch._catalogue``, a leaf module the settings and the registry read before torch is
imported); the names are re-exported here for 0.x callers. Importing this package imports no
patch code: :func:`load_patch` imports one module (it imports torch internals).
"""

import importlib

from .._catalogue import BY_NAME, FIXES, GUARDS, PATCH_NAMES, POLICIES


def module_of(name):
    """The module that declares ``name``, e.g. ``fsdp_autopatch.patches.uniform_reduce_dtype``."""
    return BY_NAME[name].module if name in BY_NAME else f"{__name__}.{name}"


def load_patch(name):
    """Import one declaring module (it imports torch internals) and return its ``PATCH``."""
    return importlib.import_module(module_of(name)).PATCH


def load_patches():
    """Every fix's and guard's declaration, in the order they are applied."""
    return tuple(load_patch(name) for name in PATCH_NAMES)


__all__ = ["FIXES", "GUARDS", "PATCH_NAMES", "POLICIES", "load_patch", "load_patches", "module_of"]
