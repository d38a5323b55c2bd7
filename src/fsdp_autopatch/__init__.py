"""fsdp-autopatch: install and forget; every FSDP2 run in this environment gets its fixes.

``pip install fsdp-autopatch`` puts ``fsdp_autopatch.pth`` (and a PEP 829 ``fsdp_autopatch.start``)
into site-packages. At interpreter start it arms a cheap, stdlib-only trigger; when torch's FSDP2
(``torch.distributed.fsdp._fully_shard``) is imported, the patches below are applied, each one
switchable by an environment variable, and a registry records what happened:

.. generated: patches
* ``accumulated_grad_guard``     – a unit that never ran forward does not crash post-backward.
* ``unused_param_reduction``     – `FSDPModule.set_reduce_scatter_unused_params` on torch < 2.13.
* ``uniform_reduce_dtype``       – mixed-precision gradient accumulation does not trip "FSDP reduce-scatter expects uniform gradient dtype".
* ``restore_unused_param_grads`` – a parameter that no rank used keeps `grad is None`.
.. end generated

Public API: :func:`install`, :func:`status`, :func:`applied`, :class:`PatchStatus`,
:class:`PatchRecord`, :class:`StatusReport`. Everything else is private.

This module is imported at every interpreter start (the ``.pth`` imports a submodule), so it
imports nothing heavy: the registry types are loaded on first use.
"""

# ``__version__`` is loaded on first use too (``__getattr__`` below): this module runs at every
# interpreter start, and one module fewer there is ~0.1-0.2 ms (bench/startup.py).

__all__ = [
    "PatchRecord",
    "PatchStatus",
    "StatusReport",
    "__version__",
    "applied",
    "install",
    "status",
]

_LAZY = {"PatchRecord", "PatchStatus", "StatusReport"}


def install() -> None:
    """Make sure the patches are (or will be) applied in this process; idempotent, never raises.

    Not needed after ``pip install``: the ``.pth`` file calls it at interpreter start. Call it
    yourself where ``site`` does not run (``python -S``, embedded interpreters). If torch's FSDP2 is
    already imported, the patches are applied right away; otherwise when it is imported.
    """
    from . import _bootstrap

    _bootstrap.install("explicit")


def status():
    """A :class:`StatusReport`: per patch its name, status, reason and the variable that toggles it,
    plus torch's version and whether the bootstrap ran in this process."""
    from ._registry import REGISTRY

    return REGISTRY.snapshot()


def applied() -> tuple:
    """Names of the patches applied in this process, in application order."""
    from ._registry import PatchStatus

    return tuple(record.name for record in status().patches if record.status is PatchStatus.APPLIED)


def __getattr__(name: str):
    if name == "__version__":
        from ._version import __version__

        return __version__
    if name in _LAZY:
        from . import _registry

        return getattr(_registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _LAZY | {"__version__"})
