"""The post-import hook on torch's FSDP2: apply the patches, and let nothing of ours escape.

wrapt lets a post-import hook's exception fail the import it is attached to: the user's
``import torch.distributed.fsdp``. So this module is standard library only (it must import on every
interpreter the package admits), imports the rest of the package only inside its functions,
and catches every exception our code raises there: a module of ours that does not import on this
interpreter, a bug in a check, an apply or the registry. The failure is recorded (every patch not
yet decided becomes ``failed``, naming the module of ours that raised) and the import goes on with
torch untouched by every patch that did not apply. Only ``FSDP_AUTOPATCH_STRICT=1`` re-raises.

Imported by the bootstrap when torch starts executing, never at interpreter start.
"""

import os
import sys

from . import _process

STRICT = "FSDP_AUTOPATCH_STRICT"  # the same as ``_config.STRICT``, which may be what broke


def on_fsdp_import(module):
    """wrapt's post-import hook for ``torch.distributed.fsdp._fully_shard`` and each other module an
    entry waits for (``_catalogue.HOOK_TARGETS``)."""
    try:
        from ._activate import activate

        activate(module)
    except Exception as error:
        if strict():
            raise  # asked for: the patch's error (already recorded by activate) or ours, to the import
        failure = f"{_process.our_module_in(error)}: {type(error).__name__}: {error}"
        _process.hook_failure = failure
        record_every_patch(
            "failed",
            f"fsdp-autopatch's own code raised in the FSDP2 import hook ({failure}); torch left untouched by it",
        )


def import_waited_for():
    """Import the modules some entries wait for (DCP's state_dict), as a training run that
    checkpoints does, so that ``status`` and ``doctor`` answer for those entries too. Their own
    hooks apply them; a module that does not import leaves its entries pending, and says nothing."""
    import importlib

    for target in _process.hook_targets()[1:]:
        try:
            importlib.import_module(target)
        except Exception:
            pass


def import_fsdp2(arm=False):
    """Import torch's FSDP2 and the modules some entries wait for, so that the registry holds real
    answers (``status``, ``doctor``), not "pending". None on success, else why FSDP2 is not there.

    ``arm``: where the bootstrap did not run in this process (``python -S``, no ``.pth``), apply the
    entries anyway, so that the user learns what they would do (doctor); not under the kill switch."""
    try:
        import torch.distributed.fsdp  # noqa: F401
    except Exception as error:
        return f"torch.distributed.fsdp cannot be imported ({type(error).__name__}: {error})"
    if _process.HOOK_TARGET not in sys.modules:
        return f"this torch has no {_process.HOOK_TARGET} (FSDP2 needs torch >= 2.6)"
    arm = arm and _process.disabled_at_start() is None and _nothing_ran()
    if arm:  # (the hook never raises, but strict)
        on_fsdp_import(sys.modules[_process.HOOK_TARGET])
    import_waited_for()  # DCP's state_dict: its hook applies the entries that wait for it
    if arm:
        for target in _process.hook_targets()[1:]:
            if target in sys.modules:
                on_fsdp_import(sys.modules[target])
    return None


def _nothing_ran():
    from ._registry import REGISTRY, PatchStatus

    return all(record.status is PatchStatus.PENDING for record in REGISTRY.snapshot().patches)


def strict():
    """``FSDP_AUTOPATCH_STRICT`` read without ``_config``; its value is only compared with fixed words."""
    return os.environ.get(STRICT, "").strip().lower() in ("1", "true", "yes", "on")


def record_every_patch(status, reason):
    """Give every patch not yet decided ``status``; silent if the registry itself is broken
    (``hook_failure`` and the CLI still say what broke)."""
    try:
        from ._registry import REGISTRY

        REGISTRY.settle_pending(status, reason)
    except Exception:
        pass
