"""Apply every declared patch and policy, in catalogue order, each one isolated.

``activate`` runs when ``torch.distributed.fsdp._fully_shard`` has been imported (wrapt calls it
from inside that import, while the parent ``torch.distributed.fsdp`` is still importing: nothing
here touches the parent). For each declaration (``_spec.Patch``: a fix, a guard, a policy or another
distribution's patch) the same steps, written once in ``_run``:

1. the environment decides whether it is tried (``_config.Decision``: the variable and value);
2. its module is imported and its structural check combined with its version range
   (``_compat.decide``): needed, not needed or unsupported;
3. if needed, its targets are replaced all or nothing (``_patching.apply``);
4. the outcome goes to the registry, with the decision and which check decided.

A policy differs only in how its outcome is recorded (``_record``): under ``status().policies``, in
the words that dict has had since 0.1, and not at all while it is switched off.

An exception inside one patch is recorded and never reaches the user's ``import torch...``, never
stops the other patches, and leaves torch untouched. ``FSDP_AUTOPATCH_STRICT=1`` re-raises instead.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from packaging.specifiers import SpecifierSet

from . import _compat, _isolation, _patching, _process, _thirdparty, patches
from ._catalogue import PATCH_NAMES, POLICIES, WAITED_FOR
from ._config import THIRD_PARTY, Decision, Settings, read_settings, warn
from ._registry import REGISTRY, PatchStatus
from ._spec import Need, Patch, Verdict, unsupported

logger = logging.getLogger("fsdp_autopatch")
logger.addHandler(logging.NullHandler())

_lock = threading.RLock()  # two threads importing FSDP2 at once must not patch twice


def activate(module: Any = None) -> None:
    """Apply the patches and policies. Idempotent; never raises unless ``FSDP_AUTOPATCH_STRICT=1``.

    ``module`` is the module wrapt's post-import hook passes: FSDP2, or another module some entries
    wait for (``Entry.waits_for``: DCP's state_dict). An entry is tried only once the module it
    waits for is imported (``_process.imported``); until then it stays pending. The hook of such
    a module applies only the entries that wait for it (FSDP2's hook, which comes first, has done
    the rest).
    """
    with _lock:
        trigger = getattr(module, "__name__", None)
        if trigger is not None:
            _process.arrived.add(trigger)
        if trigger in WAITED_FOR:
            _activate_waiting_for(trigger)
            return
        externals, refused = _discover_isolated()
        settings = _read_settings_safely(PATCH_NAMES + tuple(external.name for external in externals))
        _record_refused(refused, settings)
        _configure_logging(settings)
        _isolation.set_strict(settings.strict)
        REGISTRY.record_torch_version(_process.torch_version())
        for name in PATCH_NAMES:  # fixes and guards, in catalogue order
            _run_when_imported(name, settings)
        for external in externals:
            _run_external(external, settings)
        for name in POLICIES:
            _run(name, settings)
        _log_summary()


def _log_summary() -> None:
    """One INFO line per process: how many entries are in force, what the others are (each entry's
    own line is DEBUG; a failure is a WARNING of its own)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    counts: dict[str, int] = {}
    for record in REGISTRY.snapshot().patches:
        counts[record.status.value] = counts.get(record.status.value, 0) + 1
    told = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
    logger.info("active on torch %s: %s (fsdp-autopatch status: each entry and why)",
                _process.torch_version(), told)


def _run_when_imported(name: str, settings: Settings) -> None:
    """Try ``name`` if the module it waits for is imported (FSDP2's: this activation is its hook's, or
    an explicit one after it), or if this torch has no such module (its check says so: unsupported);
    otherwise it stays pending until that module's own hook applies it (switched off, it says so now)."""
    trigger = _process.trigger_of(name)
    if trigger == _process.HOOK_TARGET or _process.imported(trigger) or not _process.importable(trigger):
        _run(name, settings)
        return
    decision = settings.decision(name)
    if not decision.enabled:
        _record(name, PatchStatus.DISABLED, f"disabled by {decision.describe()}", decision)


def _activate_waiting_for(trigger: str) -> None:
    """The fixes and guards that wait for ``trigger`` (not FSDP2), once it is imported."""
    # FSDP2's activation has already warned about the variables (with the third-party names known)
    quiet = _process.imported(_process.HOOK_TARGET)
    settings = _read_settings_safely(PATCH_NAMES, warn=_ignore if quiet else warn)
    _configure_logging(settings)
    REGISTRY.record_torch_version(_process.torch_version())
    for name in PATCH_NAMES:
        if _process.trigger_of(name) == trigger:
            _run(name, settings)


def _discover_isolated() -> tuple[list[_thirdparty.External], list[_thirdparty.Refused]]:
    """Third-party patches from installed metadata (no code imported); none if that fails."""
    try:
        externals, refused = _thirdparty.discover(PATCH_NAMES + POLICIES)
    except Exception as error:
        REGISTRY.record_third_party_failure(f"discovery failed: {type(error).__name__}: {error}")
        return [], []
    for external in externals:
        REGISTRY.add_external(external.name, external.provider)
    return externals, refused


def _record_refused(refused: list[_thirdparty.Refused], settings: Settings) -> None:
    # Switched off as a whole, third-party patches are not a problem: not even refused ones.
    status = PatchStatus.FAILED if settings.third_party else PatchStatus.DISABLED
    for entry in refused:
        reason = entry.reason if settings.third_party else f"disabled by {THIRD_PARTY}=0 ({entry.reason})"
        REGISTRY.add_external(entry.key, entry.provider, status, reason)


def _run_external(external: _thirdparty.External, settings: Settings) -> None:
    if not settings.third_party:
        decision = Decision(False, THIRD_PARTY, "0")
        _record(external.name, PatchStatus.DISABLED, f"disabled by {decision.describe()}", decision)
        return
    _run(external.name, settings, lambda _: _thirdparty.validate(external.load(), external), external.provider)


def _run(name: str, settings: Settings, load: Any = None, provider: str | None = None) -> None:
    """One entry through the steps of this module's docstring; every outcome recorded, none raised
    (unless strict). ``load``: name -> its ``Patch`` (default: ours, ``patches.load_patch``)."""
    if REGISTRY.status_of(name) is PatchStatus.APPLIED or _isolation.has_failed(name):
        # idempotent: a second activation leaves an applied entry alone, and one whose wrappers
        # failed at call time (they pass through to torch) keeps saying so
        return
    decision = settings.decision(name)
    if not decision.enabled:
        _record(name, PatchStatus.DISABLED, f"disabled by {decision.describe()}", decision)
        return
    patch = _load_isolated(name, load or patches.load_patch, provider, settings, decision)
    if patch is None:
        return
    verdict = _verdict_isolated(patch, settings, decision)
    if verdict is None:
        return
    if verdict.status != Need.NEEDED:
        _record_not_applied(name, verdict, decision)
        return
    try:
        replaced = _patching.apply(patch)
    except Exception as error:
        if _failed(name, PatchStatus.FAILED, f"{type(error).__name__}: {error}", error, settings, decision):
            raise
        return
    reason = patch.changes if name in POLICIES else f"{verdict.reason} -> patched: {patch.changes} (wraps {replaced})"
    _record(name, PatchStatus.APPLIED, reason, decision, verdict)


def _load_isolated(name: str, load: Any, provider: str | None, settings: Settings, decision: Decision) -> Patch | None:
    """The declaration, or None when its module does not import (recorded as failed).

    One module at a time: a patch module that fails on this interpreter costs only that patch.
    """
    try:
        return load(name)
    except Exception as error:
        where = provider or _process.our_module_in(error)
        reason = f"loading the patch failed in {where}: {type(error).__name__}: {error}"
        if _failed(name, PatchStatus.FAILED, reason, error, settings, decision):
            raise
        return None


def _verdict_isolated(patch: Patch, settings: Settings, decision: Decision) -> Verdict | None:
    """"Needed here?", or None when the check itself could not answer (recorded)."""
    try:
        return verdict_of(patch)
    except (ImportError, AttributeError) as error:
        # The internals the patch inspects are not there: this torch is shaped differently.
        reason = f"torch internals differ: {type(error).__name__}: {error}"
        if _failed(patch.name, PatchStatus.UNSUPPORTED, reason, error, settings, decision):
            raise
    except Exception as error:
        if _failed(patch.name, PatchStatus.FAILED, f"check raised {type(error).__name__}: {error}", error, settings,
                   decision):
            raise
    return None


def _failed(
    name: str, status: PatchStatus, reason: str, error: BaseException, settings: Settings, decision: Decision
) -> bool:
    """Record a step that raised; True when strict mode wants the error to reach the caller: a fix's
    or guard's failure, and a policy's only when the user asked for it by its variable."""
    policy = name in POLICIES
    failed = status is PatchStatus.FAILED
    if policy:  # one wording for every step: "not armed", naming our module that raised
        status = PatchStatus.FAILED
        reason = f"not armed: {type(error).__name__}: {error} (in {_process.our_module_in(error)})"
    # logged as a fix's would be: a policy that cannot act on this torch's internals is no warning
    _record(name, status, reason, decision, level=logging.WARNING if failed else logging.DEBUG)
    logger.debug("%s: %s", name, reason, exc_info=error)
    return settings.strict and status is PatchStatus.FAILED and (not policy or decision.variable is not None)


def _record_not_applied(name: str, verdict: Verdict, decision: Decision) -> None:
    """Not needed or unsupported here. A policy the user switched on by its variable says so too: a
    request that changed nothing must not pass unseen."""
    if name not in POLICIES:
        _record(name, PatchStatus(verdict.status), verdict.reason, decision, verdict)
        return
    message = f"requested but not applied: {verdict.reason}"
    _record(name, PatchStatus(verdict.status), message, decision, verdict)
    if decision.variable:
        warn(decision.variable, f"{decision.describe()} {message}")


def verdict_of(patch: Patch) -> Verdict:
    """The patch's structural check, combined with the releases measured to have its bug.

    A "needed" check is only as good as the contract of its wrappers: a parameter a wrapper reads
    that torch's function no longer has, or a reference torch holds where it cannot be replaced,
    makes the patch unsupported (torch left untouched), whatever the version says.
    """
    structural = patch.check()
    if structural.status == Need.NEEDED:
        problem = _patching.contract_problem(patch)
        if problem is not None:
            structural = unsupported(f"{problem}: torch left untouched")
    return _compat.decide(structural, _compat.torch_release(), SpecifierSet(patch.affected))


def _ignore(variable: str, message: str) -> None:
    pass


def _read_settings_safely(names: tuple[str, ...], warn: Any = warn) -> Settings:
    try:
        return read_settings(names=names, warn=warn)
    except Exception:  # never let a parsing bug break the import of torch
        logger.exception("reading FSDP_AUTOPATCH_* variables failed; using defaults")
        return Settings()


def _record(
    name: str, status: PatchStatus, reason: str, decision: Decision | None = None, verdict: Verdict | None = None,
    level: int | None = None,
) -> None:
    """Into the registry, and one log line: a WARNING for a failure, DEBUG otherwise (INFO is
    ``_log_summary``'s)."""
    if name in POLICIES:
        if status is PatchStatus.DISABLED:
            return  # a policy left off has no record: ``status().policies`` lists those switched on
        REGISTRY.record_policy(name, reason, status)
    else:
        REGISTRY.record(name, status, reason, verdict.decided_by if verdict is not None else "", decision)
    if level is None:
        level = logging.WARNING if status is PatchStatus.FAILED else logging.DEBUG
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
    with _lock:
        _patching.revert_all()
        _isolation.forget()
        REGISTRY.reset()
