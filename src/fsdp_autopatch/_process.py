"""Facts about this process that every part of the plugin reads: a leaf module, standard library only.

* how the plugin started here, and whether the kill switch stopped it at start (set by the
  bootstrap, the top-level module ``_fsdp_autopatch_bootstrap``, and read here from
  ``sys.modules`` so that this module imports nothing of ours and the bootstrap pays nothing for
  it at interpreter start);
* the modules the post-import hooks wait for (spelled once, in the catalogue), and which of them
  have arrived;
* torch's version, without importing torch;
* which module of this package raised an error, and the hook failure, if any.

Imported by the registry, ``doctor``, the hook and the CLI, never by the bootstrap at start-up.
"""

import sys

HOOK_TARGET = "torch.distributed.fsdp._fully_shard"
# The hook targets whose post-import hook has fired. wrapt calls a hook from inside the import, where
# ``sys.modules`` already holds the module half initialised, so presence there is not enough.
arrived = set()
_PACKAGE = __name__.rsplit(".", 1)[0]
# The start-up module: top-level, beside the package, so that interpreter start imports one module.
BOOTSTRAP = "_fsdp_autopatch_bootstrap"

# When our own code raised inside the hook: "<our module>: <Type>: <message>", else None. Kept in
# this leaf module because the module that failed may be the registry itself.
hook_failure = None


def started_by():
    """How the plugin started in this process: "pth", "start", "explicit", or None (not yet)."""
    return getattr(sys.modules.get(BOOTSTRAP), "source", None)


def disabled_at_start():
    """The ``FSDP_AUTOPATCH_ENABLED`` value that stopped the bootstrap from arming anything, or None."""
    return getattr(sys.modules.get(BOOTSTRAP), "disabled_at_start", None)


def armed():
    """Whether the bootstrap ran here and armed the hook (not stopped by the kill switch)."""
    return started_by() is not None and disabled_at_start() is None


def torch_version():
    """``torch.__version__`` if torch is imported, else the installed distribution's version (torch's
    import takes seconds), else None when torch is not installed."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(getattr(torch, "__version__", "unknown"))
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # PackageNotFoundError, or broken metadata: no version to report
        return None


def hook_targets():
    """Every module whose import applies entries: FSDP2 first, then those some entries wait for."""
    from ._catalogue import WAITED_FOR

    return (HOOK_TARGET,) + WAITED_FOR


def trigger_of(name):
    """The module whose import applies entry ``name`` (FSDP2's unless the catalogue says otherwise)."""
    from ._catalogue import BY_NAME

    entry = BY_NAME.get(name)
    return (entry.waits_for if entry is not None else None) or HOOK_TARGET


def imported(name):
    """Whether module ``name`` is imported far enough for the entries that wait for it to apply:
    its hook fired, or it is in ``sys.modules`` and not still executing (a module that imports
    FSDP2 at its top is half initialised while FSDP2's hook runs)."""
    if name in arrived:
        return True
    module = sys.modules.get(name)
    if module is None:
        return False
    return not getattr(getattr(module, "__spec__", None), "_initializing", False)


def importable(name):
    """Whether this torch has module ``name``, found without importing it (nor its package: the
    finder reads the file system under the already imported parent packages)."""
    from importlib.machinery import PathFinder

    parent, _, _ = name.rpartition(".")
    while parent and parent not in sys.modules:  # the nearest imported package, then down by path
        parent, _, _ = parent.rpartition(".")
    path = getattr(sys.modules.get(parent), "__path__", None)
    for depth in range(parent.count(".") + 1 if parent else 0, name.count(".") + 1):
        spec = PathFinder.find_spec(".".join(name.split(".")[: depth + 1]), path)
        if spec is None:
            return False
        path = spec.submodule_search_locations
    return True


def our_module_in(error):
    """The innermost module of this package in ``error``'s traceback, e.g. ``fsdp_autopatch._config``
    (the package's name when none is: a file of ours that does not even compile names itself in
    the ``SyntaxError`` message)."""
    found = _PACKAGE
    tb = error.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_globals.get("__name__", "")
        if name == _PACKAGE or name.startswith(_PACKAGE + "."):
            found = name
        tb = tb.tb_next
    return found
