"""The runtime registry: one record per patch saying whether it applied and why or why not.

Stdlib only. Thread-safe: the post-import hook may run in any thread that first imports torch's
FSDP2, while another thread reads ``fsdp_autopatch.status()``.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from . import _process
from ._catalogue import PATCH_NAMES
from ._config import KILL_SWITCH, THIRD_PARTY, Decision, patch_env_var
from ._process import HOOK_TARGET
from ._version import __version__


class PatchStatus(str, enum.Enum):
    """What happened to one patch in this process."""

    # the module the entry patches is not imported yet: FSDP2's (torch.distributed.fsdp._fully_shard)
    # for most, DCP's state_dict for dcp_optimizer_state_init (the reason names it)
    PENDING = "pending"
    APPLIED = "applied"  # torch is patched
    DISABLED = "disabled"  # switched off by an environment variable (the reason names it)
    NOT_NEEDED = "not_needed"  # this torch already has the fix
    UNSUPPORTED = "unsupported"  # torch internals differ from what the patch wraps; torch untouched
    # the patch raised while applying (torch untouched), or one of its wrappers raised at call time
    # (torch's original ran instead, and runs from then on); the reason has the error
    FAILED = "failed"

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
    # the environment variable that decided whether the patch was tried, and its value; None when
    # the default decided (the patch is on unless a variable says otherwise)
    variable: str | None = None
    value: str | None = None
    # how many times, in this process, the patch changed what torch would have done (0: it never
    # had to; see each patch's docs for what counts as one)
    fired: int = 0
    # the distribution that declares it, "<name> <version>"; None for fsdp-autopatch's own patches
    provider: str | None = None
    # failed at call time: it had applied, one of its wrappers raised, torch's code runs from then
    # on (``_isolation``); False for every other record. Not in ``to_dict`` (the reason says it).
    at_call_time: bool = False
    # applied, but someone replaced our value after us at these places, read when the snapshot was
    # taken: ``(place, what is there now, whether that still calls ours)``. Not in ``to_dict`` (the
    # reason says it). "still calls ours": ours is reachable from theirs (closure, __wrapped__).
    displaced: tuple[tuple[str, str, bool], ...] = ()

    @property
    def in_force(self) -> bool:
        """Applied, and every place it replaced still goes through its wrapper."""
        return self.status is PatchStatus.APPLIED and all(calls_ours for _, _, calls_ours in self.displaced)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status.value,
            "reason": self.reason,
            "env": self.env,
            "decided_by": self.decided_by,
            "variable": self.variable,
            "value": self.value,
            "fired": self.fired,
            "provider": self.provider,
        }


@dataclass(frozen=True)
class PolicyRecord:
    """The registry's answer for one policy that was switched on (a policy left off has none).

    ``status``: ``applied`` (in force), ``not_needed`` / ``unsupported`` (requested, but this torch
    has nothing for it to act on, or differs), ``failed`` (raised while arming, or at call time).
    ``description`` is what ``status().policies[name]`` shows; ``fired``: how often it acted in this
    process (a warning given, gradients dropped), as a patch's.
    """

    name: str
    status: PatchStatus
    description: str
    fired: int = 0

    @property
    def in_force(self) -> bool:
        return self.status is PatchStatus.APPLIED

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status.value, "description": self.description, "fired": self.fired}


@dataclass(frozen=True)
class StatusReport:
    """A snapshot of the registry: what ``fsdp_autopatch.status()`` returns."""

    version: str  # fsdp-autopatch's own version
    torch: str | None  # torch.__version__, or None when torch is not installed
    bootstrap: str  # how the plugin started here: "pth", "start", "explicit" or "not_run"
    patches: tuple[PatchRecord, ...]
    # policy name -> description, for each policy switched on (public since 0.1; see policy_records)
    policies: dict[str, str] = field(default_factory=dict)
    policy_records: tuple[PolicyRecord, ...] = ()
    # why patches declared by other distributions could not be discovered, or None
    third_party_failure: str | None = None

    def __getitem__(self, name: str) -> PatchRecord:
        for record in self.patches:
            if record.name == name:
                return record
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        report = {
            "version": self.version,
            "torch": self.torch,
            "bootstrap": self.bootstrap,
            "patches": [record.to_dict() for record in self.patches],
            "policies": dict(self.policies),
            # each policy switched on, with its status and how often it acted (``policies`` keeps
            # its 0.1 shape: name -> description)
            "policy_records": [record.to_dict() for record in self.policy_records],
        }
        if self.third_party_failure is not None:  # the usual report keeps its 0.1 keys
            report["third_party_failure"] = self.third_party_failure
        return report


_PENDING_REASON = f"waiting for {HOOK_TARGET} to be imported"


def _pending_reason(name: str) -> str:
    """Which import applies ``name``: FSDP2's, or another module's (``Entry.waits_for``)."""
    trigger = _process.trigger_of(name)
    if trigger == HOOK_TARGET:
        return _PENDING_REASON
    # not FSDP2's: a program that never imports this module never meets the bug (nothing to fix)
    return f"waiting for {trigger} to be imported (the module it fixes; FSDP2 does not import it)"

# Per applied patch name, where its values were replaced after it: (place, what is there, still calls ours)
DisplacementProbe = Callable[[str], list[tuple[str, str, bool]]]

# How the reason of a patch whose wrapper raised at call time starts (``_isolation``; doctor reads it).
CALL_TIME_FAILURE = "failed at call time"


class _Entry:
    """One patch's record as the registry keeps it (mutable under the registry's lock)."""

    __slots__ = ("status", "reason", "decided_by", "variable", "value", "provider", "at_call_time")

    def __init__(
        self, status: PatchStatus, reason: str, decided_by: str = "", variable=None, value=None, provider=None,
        at_call_time: bool = False,
    ) -> None:
        self.status = PatchStatus(status)
        self.reason = reason
        self.decided_by = decided_by
        self.variable = variable
        self.value = value
        self.provider = provider
        self.at_call_time = at_call_time


class Registry:
    """Every patch's and policy's record in this process, under one lock (:data:`REGISTRY`).

    Written by ``_activate`` (each entry's outcome, third-party discovery), ``_hook`` (what stays
    pending when the import hook could not run), ``_isolation`` (a wrapper that failed at call
    time) and ``_events.fired`` (each fire); read as a :class:`StatusReport` by :meth:`snapshot`
    (``fsdp_autopatch.status()``, the CLI, doctor). Every patch of the catalogue starts pending; a
    policy has a record only once it is switched on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, _Entry] = {}
        self._policies: dict[str, PolicyRecord] = {}
        self._policy_findings: dict[str, dict[str, str]] = {}  # policy -> key -> what it found
        self._third_party_failure: str | None = None
        self._fired: dict[str, int] = {}
        self._torch_version: str | None = None
        # reads, per applied patch, where its values were replaced after it (``_patching``); kept
        # across :meth:`reset`
        self._displaced: DisplacementProbe | None = None
        self.reset()

    def reset(self) -> None:
        """Every patch back to pending (tests; a fresh process starts like this)."""
        with self._lock:
            self._records = {name: _Entry(PatchStatus.PENDING, _pending_reason(name)) for name in PATCH_NAMES}
            self._policies = {}
            self._policy_findings = {}
            self._third_party_failure = None
            self._fired = {}

    def record(
        self, name: str, status: PatchStatus, reason: str, decided_by: str = "", decision: Decision | None = None
    ) -> None:
        """``decision``: what let the patch be tried or switched it off (None: not read yet)."""
        variable = decision.variable if decision is not None else None
        value = decision.value if decision is not None else None
        with self._lock:
            provider = self._records[name].provider if name in self._records else None
            self._records[name] = _Entry(status, reason, decided_by, variable, value, provider)

    def record_call_failure(self, name: str, reason: str) -> None:
        """An applied patch's wrapper failed at call time (``_isolation``): ``failed``, keeping
        the decision that let it be tried and which check decided it."""
        with self._lock:
            entry = self._records.get(name)
            if entry is None:  # a policy: recorded under "policies"
                self._policies[name] = PolicyRecord(name, PatchStatus.FAILED, reason)
                return
            applied = f" (it had applied: {entry.reason})" if entry.status is PatchStatus.APPLIED else ""
            self._records[name] = _Entry(
                PatchStatus.FAILED, reason + applied, entry.decided_by, entry.variable, entry.value, entry.provider,
                at_call_time=True,
            )

    def add_external(
        self, name: str, provider: str, status: PatchStatus = PatchStatus.PENDING, reason: str = ""
    ) -> None:
        """A record for a patch another distribution declares (kept until :meth:`reset`)."""
        with self._lock:
            if name not in self._records or status is not PatchStatus.PENDING:
                self._records[name] = _Entry(status, reason or _PENDING_REASON, provider=provider)

    def settle_pending(self, status: PatchStatus | str, reason: str) -> None:
        """Give every patch still pending ``status`` (the hook failed, or could not be armed)."""
        with self._lock:
            for name, entry in list(self._records.items()):
                if entry.status is PatchStatus.PENDING:
                    self._records[name] = _Entry(status, reason, provider=entry.provider)

    def count_fire(self, name: str) -> int:
        """One more fire of patch ``name``; returns its count in this process."""
        with self._lock:
            count = self._fired.get(name, 0) + 1
            self._fired[name] = count
            return count

    def record_policy(self, name: str, description: str, status: PatchStatus = PatchStatus.APPLIED) -> None:
        """A policy that was switched on: in force (``applied``) or why not (the other statuses)."""
        with self._lock:
            self._policies[name] = PolicyRecord(name, status, description)
            self._policy_findings.pop(name, None)

    def add_policy_finding(self, name: str, key: str, finding: str) -> None:
        """What a policy in force found while it ran (the cross-rank check: a process group it could
        not compare), shown after its description, one per ``key``; its status stays as recorded."""
        with self._lock:
            self._policy_findings.setdefault(name, {})[key] = finding

    def record_third_party_failure(self, reason: str) -> None:
        """Discovering other distributions' patches failed: none of them is armed."""
        with self._lock:
            self._third_party_failure = reason

    def record_torch_version(self, version: str | None) -> None:
        with self._lock:
            self._torch_version = version

    def watch_displacement(self, probe: DisplacementProbe) -> None:
        """``probe(name)``: where an applied patch's values were replaced after it, read at each
        snapshot (someone else's monkey-patch over ours is only visible at the target itself)."""
        self._displaced = probe

    def get(self, name: str) -> tuple[PatchStatus, str]:
        """A patch's status and reason (KeyError for a policy or an unknown name)."""
        with self._lock:
            entry = self._records[name]
            return entry.status, entry.reason

    def status_of(self, name: str) -> PatchStatus | None:
        """A patch's or policy's status; None for a policy without a record (not switched on)."""
        with self._lock:
            if name in self._records:
                return self._records[name].status
            policy = self._policies.get(name)
            return policy.status if policy is not None else None

    def snapshot(self) -> StatusReport:
        torch_version = self._torch_version or _process.torch_version()
        with self._lock:
            patches = tuple(
                _explain_pending(_as_record(name, e, self._fired.get(name, 0)), torch_version)
                for name, e in self._records.items()
            )
            policy_records = tuple(
                replace(r, description=_with_findings(r.description, self._policy_findings.get(r.name)),
                        fired=self._fired.get(r.name, 0))
                for r in self._policies.values()
            )
            third_party_failure = self._third_party_failure
        patches = tuple(_with_displacement(record, self._displaced) for record in patches)
        descriptions = {record.name: record.description for record in policy_records}
        started_by = _process.started_by() or "not_run"
        return StatusReport(
            __version__, torch_version, started_by, patches, descriptions, policy_records, third_party_failure
        )


def _with_findings(description: str, findings: dict[str, str] | None) -> str:
    return "; ".join([description, *findings.values()]) if findings else description


def _as_record(name: str, entry: _Entry, fired: int) -> PatchRecord:
    # A refused third-party record, "<distribution>:<name>", has no toggle of its own (its name's
    # toggle belongs to whoever owns the name): FSDP_AUTOPATCH_THIRD_PARTY silences it.
    env = THIRD_PARTY if ":" in name else patch_env_var(name)
    return PatchRecord(
        name, entry.status, entry.reason, env, entry.decided_by, entry.variable, entry.value, fired, entry.provider,
        entry.at_call_time,
    )


def _with_displacement(record: PatchRecord, probe: DisplacementProbe | None) -> PatchRecord:
    """An applied record says where someone else's value replaced ours after us."""
    if probe is None or record.status is not PatchStatus.APPLIED:
        return record
    try:
        found = tuple(probe(record.name))
    except Exception:  # a snapshot never raises: the record stays as it was applied
        return record
    if not found:
        return record
    notes = "; ".join(
        f"{place} was replaced after us by {what}, "
        + ("which wraps ours" if calls_ours else "which does not hold ours: not in force there")
        for place, what, calls_ours in found
    )
    return replace(record, reason=f"{record.reason} [{notes}]", displaced=found)


def _explain_pending(record: PatchRecord, torch_version: str | None) -> PatchRecord:
    """What "pending" really means when it can never change: kill switch at start, or no torch."""
    if record.status is not PatchStatus.PENDING:
        return record
    stopped_by = _process.disabled_at_start()
    if stopped_by is not None:
        reason = f"disabled by {KILL_SWITCH}={stopped_by.strip()} at interpreter start (nothing armed)"
        return replace(record, status=PatchStatus.DISABLED, reason=reason, variable=KILL_SWITCH, value=stopped_by)
    if torch_version is None:
        return replace(record, status=PatchStatus.UNSUPPORTED, reason="torch is not installed in this environment")
    return record


REGISTRY = Registry()
