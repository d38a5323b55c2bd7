"""Facts about this process that every part of the plugin reads: a leaf module, standard library only.

* how the plugin started here, and whether the kill switch stopped it at start (set by the
  bootstrap, the top-level module ``_fsdp_autopatch_bootstrap``, and read here from
  ``sys.modules`` so that this module imports nothing of ours and the bootstrap pays nothing for
  it at interpreter start);
* the module the post-import hook waits for, spelled once;
* torch's version, without importing torch;
* which module of this package raised an error, and the hook failure, if any.

Imported by the registry, ``doctor``, the hook and the CLI, never by the bootstrap at start-up.
"""

import sys

HOOK_TARGET = "torch.distributed.fsdp._fully_shard"
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
