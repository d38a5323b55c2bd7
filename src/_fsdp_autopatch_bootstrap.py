"""What ``fsdp_autopatch.pth`` (Python <= 3.14) and ``fsdp_autopatch.start`` (PEP 829, 3.15+) run.

Every interpreter in the environment pays for this module: pip, torchrun's agent, each rank,
each DataLoader worker. So it is one top-level module beside the package in site-packages, not a
submodule: importing ``fsdp_autopatch._bootstrap`` would make Python execute the package's
``__init__`` first, a second module at every interpreter start (bench/startup.py,
docs/performance.md). It is stdlib only (``os``, ``sys``), imports neither torch nor wrapt (nor
packaging, inspect, importlib.metadata, nor the package ``fsdp_autopatch``), prints nothing and
never raises. ``fsdp_autopatch._bootstrap`` is this same module under the package's name.

It does one thing: wait for ``import torch``. This module itself sits in ``sys.meta_path``: its
``find_spec`` notices the first ``import torch`` and, when torch starts executing, imports wrapt and
registers a post-import hook on ``torch.distributed.fsdp._fully_shard``; the hook
(``fsdp_autopatch._hook``) applies the patches. A process that never imports torch never pays
more than this module.

How it starts: the ``.pth`` line is ``import _fsdp_autopatch_bootstrap``, and when ``site`` is what
imports it, the last lines below call ``install("pth")``; the ``.start`` file calls ``start()``.
A plain ``import`` from anywhere else (``python -S``, the package, a test) starts nothing: that
is ``install()``'s job. The line is the shortest ``.pth`` line there is: ``site`` compiles it at
every start, twice in a venv, and a ``try``/``except`` around it (an ``exec`` of a string) cost
more than all the rest of this module's work (docs/performance.md).

``install()`` is idempotent because Python <= 3.14 runs a venv's ``.pth`` files twice (CPython
issue 75723) and because users may also call ``fsdp_autopatch.install()`` themselves.
"""

import os
import sys

# The kill switch's name, the same as ``_config.KILL_SWITCH`` (tests/unit/test_bootstrap.py checks).
# Spelled here so that a start without the variable, the usual case, imports only this module:
# every other module costs ~0.1-0.3 ms at every interpreter start (bench/startup.py).
KILL_SWITCH = "FSDP_AUTOPATCH_ENABLED"

# The process facts the package reads through ``fsdp_autopatch._process`` (which looks them up here
# in ``sys.modules``, so that this module imports nothing of the package at start-up):
# how the plugin started in this process: "pth", "start", "explicit"; None = not yet.
source = None
# The FSDP_AUTOPATCH_ENABLED value that stopped the bootstrap from arming anything, or None.
disabled_at_start = None
_hook_registered = False
# torch started executing: the hook is registered (or its failure recorded); the trigger is inert
fired = False
_searching = False  # the trigger is asking the other finders for torch's real spec


def install(how="explicit"):
    """Arrange for the patches to be applied when torch's FSDP2 is imported (now, if it already is).

    Never raises: a broken plugin must not break ``import site`` or the user's program.
    """
    global source, disabled_at_start
    try:
        if source is None:
            source = how
        if KILL_SWITCH in os.environ:  # unset (the usual case) means on: no need to parse anything
            from fsdp_autopatch._config import kill_switch_off

            if kill_switch_off():
                # Respect FSDP_AUTOPATCH_ENABLED=0 at its cheapest: arm nothing at all.
                disabled_at_start = os.environ.get(KILL_SWITCH)
                return
        if disabled_at_start is not None:
            source = how  # an earlier call armed nothing (kill switch): this is the one that starts the plugin
        disabled_at_start = None
        if "torch" in sys.modules:
            register_hook()  # torch came first (python -S, embedded, late explicit install)
            return
        trigger = sys.modules.get(__name__)  # this module: its find_spec below is the trigger
        for finder in sys.meta_path:
            if finder is trigger:
                return
        if trigger is not None:
            sys.meta_path.insert(0, trigger)
    except Exception:
        pass


def start():
    """Entry point of ``fsdp_autopatch.start`` (PEP 829)."""
    global source
    if source == "pth":  # a site that imports this module itself to resolve the entry point
        source = None  # (the .start file turns the .pth line off): it is the .start that starts us
    install("start")


# The torch-import trigger is this module itself, in ``sys.meta_path``: for every module not yet
# imported, the import system calls the module-level ``find_spec`` below. A module rather than a
# class: creating a class at every interpreter start would cost more than the rest of this module
# (bench/startup.py), and a module-level function is the cheapest call the import system can make
# for the names that are not "torch".
#
# It never imports anything inside ``find_spec``: the import system calls finders while holding
# its global import lock, and importing wrapt there could deadlock against another thread that
# holds a module lock (e.g. ``logging``) and waits for that global lock. Instead it asks the other
# finders for torch's real spec and wraps its loader, so that wrapt is imported at the start of
# torch's ``exec_module``, where only torch's own module lock is held, like any nested import.
#
# ``importlib.util.find_spec("torch")`` (an availability check) gets the wrapped spec too, but
# nothing happens until torch really executes. After that the trigger stays in ``sys.meta_path``,
# inert: removing it while the import system iterates ``sys.meta_path`` could skip a finder.


def find_spec(fullname, path=None, target=None):
    """``None`` for every name; for ``torch`` (until it executes), torch's own spec with its loader
    wrapped so that the hook is registered just before torch's ``__init__`` runs."""
    global _searching
    if fullname != "torch" or fired or _searching:
        return None
    try:
        trigger = sys.modules.get(__name__)
        spec = None
        _searching = True
        try:
            for finder in list(sys.meta_path):
                finder_find_spec = getattr(finder, "find_spec", None)
                if finder is not trigger and finder_find_spec is not None:
                    spec = finder_find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            _searching = False
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _arming_loader(spec.loader, spec)
        return spec
    except Exception:
        return None


_ArmBeforeExec = None  # the class below, made the first time torch is looked up (not at every start)


def _arming_loader(loader, spec):
    global _ArmBeforeExec
    if _ArmBeforeExec is None:

        class _ArmBeforeExec:
            """torch's own loader, plus one step before torch's ``__init__`` runs: register the hook."""

            def __init__(self, loader, spec):
                self._loader = loader
                self._spec = spec

            def create_module(self, spec):
                return self._loader.create_module(spec)

            def exec_module(self, module):
                global fired
                # Put torch's real loader back first, so that nothing after this sees the wrapper.
                self._spec.loader = self._loader
                if getattr(module, "__loader__", None) is self:
                    module.__loader__ = self._loader
                if not fired:
                    fired = True
                    try:
                        register_hook()
                    except Exception:
                        pass
                self._loader.exec_module(module)

            def __getattr__(self, name):  # get_filename, get_resource_reader, is_package, ...
                return getattr(self._loader, name)

    return _ArmBeforeExec(loader, spec)


def register_hook():
    """Register the wrapt post-import hooks once: on torch's FSDP2, and on each other module an entry
    waits for (DCP's state_dict); each fires now if its module is already imported."""
    global _hook_registered
    # stdlib only; here, not at interpreter start: only torch processes need the package
    from fsdp_autopatch import _hook
    from fsdp_autopatch._process import hook_targets

    if _hook_registered:
        # Already armed; if a target is already imported its patches ran, but an explicit install()
        # after the first activation should still (idempotently) patch anything left pending.
        for target in hook_targets():
            if target in sys.modules:
                _hook.on_fsdp_import(sys.modules[target])
        return
    try:
        import wrapt
    except Exception as error:  # wrapt missing or broken: say so in the registry, not on stderr
        _hook.record_every_patch("unsupported", f"wrapt could not be imported ({type(error).__name__}: {error})")
        return
    _hook_registered = True
    # A wrapt that imports but cannot register the hook (a broken or incompatible install) must
    # not leave every patch `pending` forever although FSDP2 was imported: record why.
    try:
        # The hook is a function, not a "module:function" string: wrapt would import that module
        # inside the user's import, and an error there would fail the user's import.
        for target in hook_targets():
            wrapt.register_post_import_hook(_hook.on_fsdp_import, target)
    except Exception as error:
        _hook.record_every_patch(
            "unsupported", f"wrapt could not register the import hook ({type(error).__name__}: {error})"
        )


def _imported_by_site():
    """Whether ``site`` is importing this module: it executes a ``.pth`` file's ``import`` line in
    its own namespace, so the first frame above the import machinery has ``site``'s globals."""
    getframe = getattr(sys, "_getframe", None)
    if getframe is None:  # an interpreter without frames: the .pth line is what imports us
        return True
    frame = getframe(2)  # above this function and the module's body
    while frame is not None and frame.f_globals.get("__name__") in _IMPORT_MACHINERY:
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__") == "site"


_IMPORT_MACHINERY = ("_frozen_importlib", "_frozen_importlib_external", "importlib._bootstrap",
                     "importlib._bootstrap_external")

# The .pth line, ``import _fsdp_autopatch_bootstrap``, starts the plugin here (install never raises).
try:
    if _imported_by_site():
        install("pth")
except Exception:
    pass
