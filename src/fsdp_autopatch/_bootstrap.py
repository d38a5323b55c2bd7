"""What ``fsdp_autopatch.pth`` (Python <= 3.14) and ``fsdp_autopatch.start`` (PEP 829, 3.15+) run.

Every interpreter in the environment pays for this module: pip, torchrun's agent, each rank,
each DataLoader worker. So it is stdlib only (``os``, ``sys``), imports neither torch nor wrapt
(nor packaging, inspect, importlib.metadata), prints nothing and never raises.

It does one thing: wait for ``import torch``. A meta-path finder that never finds anything
notices the first ``import torch`` and only then imports wrapt and registers a post-import hook
on ``torch.distributed.fsdp._fully_shard``; the hook (``_activate.activate``) applies the patches.
A process that never imports torch never pays more than this module.

``install()`` is idempotent because Python <= 3.14 runs a venv's ``.pth`` files twice (CPython
issue 75723) and because users may also call ``fsdp_autopatch.install()`` themselves.
"""

import sys

from ._config import kill_switch_off

HOOK_TARGET = "torch.distributed.fsdp._fully_shard"
_HOOK = "fsdp_autopatch._activate:activate"

# How the plugin started in this process: "pth", "start", "explicit"; None = not yet.
source = None
# Why nothing was armed, when the kill switch was off at start-up.
disabled_at_start = False
_hook_registered = False


def install(how="explicit"):
    """Arrange for the patches to be applied when torch's FSDP2 is imported (now, if it already is).

    Never raises: a broken plugin must not break ``import site`` or the user's program.
    """
    try:
        _install(how)
    except Exception:
        pass


def start():
    """Entry point of ``fsdp_autopatch.start`` (PEP 829)."""
    install("start")


def _install(how):
    global source, disabled_at_start
    if source is None:
        source = how
    if kill_switch_off():
        # Respect FSDP_AUTOPATCH_ENABLED=0 at its cheapest: arm nothing at all.
        disabled_at_start = True
        return
    disabled_at_start = False
    if "torch" in sys.modules:
        register_hook()  # torch came first (python -S, embedded, late explicit install)
    else:
        _arm_torch_import_trigger()


def _arm_torch_import_trigger():
    if not any(finder is _TorchImportTrigger for finder in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportTrigger)


class _TorchImportTrigger:
    """A meta-path finder that finds nothing; it only notices the first ``import torch``.

    It stays in ``sys.meta_path`` (inert) after firing: removing a finder while the import system
    iterates ``sys.meta_path`` could make it skip the next finder.
    """

    fired = False

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if cls.fired or fullname != "torch":
            return None
        cls.fired = True
        try:
            register_hook()
        except Exception:
            pass
        return None

    @classmethod
    def invalidate_caches(cls):
        pass


def register_hook():
    """Register the wrapt post-import hook on torch's FSDP2 once; fires now if already imported."""
    global _hook_registered
    if _hook_registered:
        # Already armed; if FSDP2 is already imported the patches ran, but an explicit install()
        # after the first activation should still (idempotently) patch anything left pending.
        if HOOK_TARGET in sys.modules:
            from ._activate import activate

            activate(sys.modules[HOOK_TARGET])
        return
    try:
        import wrapt
    except Exception as error:  # wrapt missing or broken: say so in the registry, not on stderr
        from ._activate import record_unavailable

        record_unavailable(f"wrapt could not be imported ({type(error).__name__}: {error})")
        return
    _hook_registered = True
    wrapt.register_post_import_hook(_HOOK, HOOK_TARGET)
