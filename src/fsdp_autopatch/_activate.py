"""The post-import hook: apply every patch, in order, each one isolated.

``activate`` runs when ``torch.distributed.fsdp._fully_shard`` has been imported (wrapt calls it
from inside that import, while the parent ``torch.distributed.fsdp`` is still importing: nothing
here touches the parent). An exception inside one patch is recorded in the registry and never
reaches the user's ``import torch...``, never stops the other patches, and leaves torch untouched
(each patch applies all-or-nothing). ``FSDP_AUTOPATCH_STRICT=1`` re-raises instead.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from . import _hook
from ._config import PATCH_NAMES, REDUCE_SCATTER_UNUSED_PARAMS, Settings, read_settings, warn
from ._registry import REGISTRY, PatchStatus

logger = logging.getLogger("fsdp_autopatch")
logger.addHandler(logging.NullHandler())

_lock = threading.RLock()  # two threads importing FSDP2 at once must not patch twice


def activate(module: Any = None) -> None:
    """Apply the patches. Idempotent; never raises unless ``FSDP_AUTOPATCH_STRICT=1``."""
    with _lock:
        settings = _read_settings_safely()
        _configure_logging(settings)
        REGISTRY.record_torch_version(_torch_version())
        for name in PATCH_NAMES:
            patch = _load_isolated(name, settings)
            if patch is not None:
                _apply_isolated(patch, settings)
        _apply_policies(settings)
        _apply_cross_rank_check(settings)


def _load_isolated(name: str, settings: Settings) -> Any:
    """The patch's declaration, or None when its module does not import (recorded as failed).

    One module at a time: a patch module that fails on this interpreter costs only that patch.
    """
    try:
        from . import patches

        return patches.load_patch(name)
    except Exception as error:
        status, _ = REGISTRY.get(name)
        if status is PatchStatus.PENDING:
            where = _hook.our_module_in(error)
            _record(name, PatchStatus.FAILED, f"loading the patch failed in {where}: {type(error).__name__}: {error}")
        if settings.strict:
            raise
        return None


def _read_settings_safely() -> Settings:
    try:
        return read_settings()
    except Exception:  # never let a parsing bug break the import of torch
        logger.exception("reading FSDP_AUTOPATCH_* variables failed; using defaults")
        return Settings()


def _torch_version() -> str | None:
    torch = sys.modules.get("torch")
    return str(getattr(torch, "__version__", "unknown")) if torch is not None else None


def _apply_isolated(patch: Any, settings: Settings) -> None:
    status, _ = REGISTRY.get(patch.name)
    if status is PatchStatus.APPLIED:
        return  # idempotent: a second activation leaves an applied patch alone
    enabled, why = settings.patch_enabled(patch.name)
    if not enabled:
        _record(patch.name, PatchStatus.DISABLED, f"disabled by {why}")
        return
    try:
        verdict = patch.check()
    except (ImportError, AttributeError) as error:
        # The internals the patch inspects are not there: this torch is shaped differently.
        _record(patch.name, PatchStatus.UNSUPPORTED, f"torch internals differ: {type(error).__name__}: {error}")
        return
    except Exception as error:
        _record(patch.name, PatchStatus.FAILED, f"check raised {type(error).__name__}: {error}")
        if settings.strict:
            raise
        return
    try:
        if verdict.status == "needed":
            changed = patch.apply()
            _record(patch.name, PatchStatus.APPLIED, f"{verdict.reason} -> patched: {changed}", verdict)
        else:
            _record(patch.name, PatchStatus(verdict.status), verdict.reason, verdict)
    except Exception as error:
        _record(patch.name, PatchStatus.FAILED, f"{type(error).__name__}: {error}")
        logger.debug("patch %s failed", patch.name, exc_info=True)
        if settings.strict:
            raise


def _apply_policies(settings: Settings) -> None:
    if not settings.reduce_scatter_unused_params:
        return
    try:
        # Inside the try: has_native_api() looks up FSDPModule, which raised AttributeError out of
        # the hook (and so out of the user's `import torch.distributed.fsdp`) when torch's internals
        # differ (tests/unit/test_fault_injection.py).
        from .patches import unused_param_reduction

        status, _ = REGISTRY.get("unused_param_reduction")
        # The policy needs a fill: torch's own (>= 2.13, whatever the backport's toggle) or the backport.
        if status is not PatchStatus.APPLIED and not unused_param_reduction.has_native_api():
            message = f"requested but not applied: no unused-param fill (unused_param_reduction is {status.value})"
            REGISTRY.record_policy("reduce_scatter_unused_params_default_on", message)
            warn(REDUCE_SCATTER_UNUSED_PARAMS, f"{REDUCE_SCATTER_UNUSED_PARAMS}=1 {message}")
            return
        description = unused_param_reduction.apply_default_on_policy()
        REGISTRY.record_policy(
            "reduce_scatter_unused_params_default_on",
            f"{description} (FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS=1)",
        )
    except Exception as error:
        REGISTRY.record_policy(
            "reduce_scatter_unused_params_default_on", f"failed: {type(error).__name__}: {error}"
        )
        if settings.strict:
            raise


def _apply_cross_rank_check(settings: Settings) -> None:
    """Every rank of a process group must run the same patches (see ``_consistency``)."""
    if not settings.cross_rank_check:
        return
    try:
        from . import _consistency

        REGISTRY.record_policy(_consistency.NAME, _consistency.apply())
    except Exception as error:  # the check is a safety net: never a reason for import torch to fail
        where = _hook.our_module_in(error)
        REGISTRY.record_policy("cross_rank_check", f"not armed: {type(error).__name__}: {error} (in {where})")
        logger.debug("cross-rank check not armed", exc_info=True)


def _record(name: str, status: PatchStatus, reason: str, verdict: Any = None) -> None:
    decided_by = verdict.decided_by if verdict is not None else ""
    if decided_by:
        reason = f"{reason} [decided by the {decided_by}]"
    REGISTRY.record(name, status, reason, decided_by)
    level = logging.WARNING if status is PatchStatus.FAILED else logging.INFO
    logger.log(level, "%s: %s (%s)", name, status.value, reason)


def _configure_logging(settings: Settings) -> None:
    """``FSDP_AUTOPATCH_LOG_LEVEL`` attaches one stderr handler; otherwise the library stays silent."""
    if settings.log_level is None:
        return
    logger.setLevel(settings.log_level)
    if not any(getattr(h, "_fsdp_autopatch", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("fsdp-autopatch %(levelname)s: %(message)s"))
        handler._fsdp_autopatch = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


def revert_all() -> None:
    """Undo every patch and policy and mark them pending again (tests)."""
    from . import _consistency
    from .patches import load_patches, unused_param_reduction

    with _lock:
        _consistency.revert()
        unused_param_reduction.revert_default_on_policy()
        for patch in reversed(load_patches()):
            patch.revert()
        REGISTRY.reset()
