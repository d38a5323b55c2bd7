"""The catalogue: every patch and policy, in the order they are applied. Standard library only.

Each entry names the module whose ``PATCH`` declares it (see ``fsdp_autopatch._spec.Patch``). The
names are known without importing any patch code (that imports torch internals): the registry,
the settings and the CLI need them before torch is imported.

Order matters: ``restore_unused_param_grads`` must wrap ``FSDPParamGroup.post_backward`` after
``unused_param_reduction`` does, so that its usage probe runs before the zero fill; the policies
come after the fixes they build on.
"""

import importlib

FIXES = (
    "accumulated_grad_guard",
    "unused_param_reduction",
    "uniform_reduce_dtype",
    "restore_unused_param_grads",
    "post_forward_mesh_cache",
    "grouped_module_reuse",
    "keep_param_attributes",
    "clip_grad_norm_multi_mesh",
)
POLICIES = (
    "reduce_scatter_unused_params_default_on",
    "cross_rank_check",
)
PATCH_NAMES = FIXES  # the registry's per-patch records; policies are recorded under "policies"

# A policy declared next to the code it arms rather than in this package.
_ELSEWHERE = {"cross_rank_check": "fsdp_autopatch._consistency"}


def module_of(name):
    """The module that declares ``name``, e.g. ``fsdp_autopatch.patches.uniform_reduce_dtype``."""
    return _ELSEWHERE.get(name, f"{__name__}.{name}")


def load_patch(name):
    """Import one declaring module (it imports torch internals) and return its ``PATCH``."""
    return importlib.import_module(module_of(name)).PATCH


def load_patches():
    """Every fix's declaration, in the order they are applied."""
    return tuple(load_patch(name) for name in FIXES)


__all__ = ["FIXES", "PATCH_NAMES", "POLICIES", "load_patch", "load_patches", "module_of"]
