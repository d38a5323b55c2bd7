"""The runtime registry: one record per patch saying whether it applied and why or why not.

Stdlib only. Thread-safe: the post-import hook may run in any thread that first imports torch's
FSDP2, while another thread reads ``fsdp_autopatch.status()``.
"""

from __future__ import annotations

import enum
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from . import _bootstrap
from ._config import KILL_SWITCH, PATCH_NAMES, patch_env_var
from ._version import __version__

HOOK_TARGET = "torch.distributed.fsdp._fully_shard"


class PatchStatus(str, enum.Enum):
    """What happened to one patch in this process."""

    PENDING = "pending"  # torch's FSDP2 (torch.distributed.fsdp._fully_shard) not imported yet
    APPLIED = "applied"  # torch is patched
    DISABLED = "disabled"  # switched off by an environment variable (the reason names it)
    NOT_NEEDED = "not_needed"  # this torch already has the fix
    UNSUPPORTED = "unsupported"  # torch internals differ from what the patch wraps; torch untouched
    FAILED = "failed"  # the patch raised while applying; torch untouched (the reason has the error)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PatchRecord:
    """The registry's answer for one patch."""

    name: str
    status: PatchStatus
    reason: str
    env: str  # the variable that switches this patch on or off
    # which check decided applied / not_needed / unsupported: "structural check" or
    # "version range and structural check"; empty for pending, disabled and failed
    decided_by: str = ""

    def to_dict(self) -> dict[str, str]:
        return {
            "name": self.name,
            "status": self.status.value,
            "reason": self.reason,
            "env": self.env,
            "decided_by": self.decided_by,
        }


@dataclass(frozen=True)
class StatusReport:
    """A snapshot of the registry: what ``fsdp_autopatch.status()`` returns."""

    version: str  # fsdp-autopatch's own version
    torch: str | None  # torch.__version__, or None when torch is not installed
    bootstrap: str  # how the plugin started here: "pth", "start", "explicit" or "not_run"
    patches: tuple[PatchRecord, ...]
    policies: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> PatchRecord:
        for record in self.patches:
            if record.name == name:
                return record
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "torch": self.torch,
            "bootstrap": self.bootstrap,
            "patches": [record.to_dict() for record in self.patches],
            "policies": dict(self.policies),
        }


_PENDING_REASON = f"waiting for {HOOK_TARGET} to be imported"


class Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, tuple[PatchStatus, str, str]] = {}
        self._policies: dict[str, str] = {}
        self._torch_version: str | None = None
        self.reset()

    def reset(self) -> None:
        """Every patch back to pending (tests; a fresh process starts like this)."""
        with self._lock:
            self._records = {name: (PatchStatus.PENDING, _PENDING_REASON, "") for name in PATCH_NAMES}
            self._policies = {}

    def record(self, name: str, status: PatchStatus, reason: str, decided_by: str = "") -> None:
        with self._lock:
            self._records[name] = (PatchStatus(status), reason, decided_by)

    def settle_pending(self, status: PatchStatus | str, reason: str) -> None:
        """Give every patch still pending ``status`` (the hook failed, or could not be armed)."""
        with self._lock:
            for name, (current, _, _) in list(self._records.items()):
                if current is PatchStatus.PENDING:
                    self._records[name] = (PatchStatus(status), reason, "")

    def record_policy(self, name: str, description: str) -> None:
        with self._lock:
            self._policies[name] = description

    def record_torch_version(self, version: str | None) -> None:
        with self._lock:
            self._torch_version = version

    def get(self, name: str) -> tuple[PatchStatus, str]:
        with self._lock:
            status, reason, _ = self._records[name]
            return status, reason

    def snapshot(self) -> StatusReport:
        torch_version = self._torch_version or _torch_version_without_import()
        with self._lock:
            patches = tuple(
                PatchRecord(name, *_explain_pending(status, reason, torch_version), patch_env_var(name), decided_by)
                for name, (status, reason, decided_by) in self._records.items()
            )
            policies = dict(self._policies)
        return StatusReport(__version__, torch_version, _bootstrap.source or "not_run", patches, policies)


def _explain_pending(
    status: PatchStatus, reason: str, torch_version: str | None
) -> tuple[PatchStatus, str]:
    """What "pending" really means when it can never change: kill switch at start, or no torch."""
    if status is PatchStatus.PENDING and _bootstrap.disabled_at_start is not None:
        value = _bootstrap.disabled_at_start.strip()
        return PatchStatus.DISABLED, f"disabled by {KILL_SWITCH}={value} at interpreter start (nothing armed)"
    if status is PatchStatus.PENDING and torch_version is None:
        return PatchStatus.UNSUPPORTED, "torch is not installed in this environment"
    return status, reason


def _torch_version_without_import() -> str | None:
    """torch's version without importing torch (that takes seconds): from sys.modules or metadata."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(getattr(torch, "__version__", "unknown"))
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None
    except Exception:
        return None


REGISTRY = Registry()
