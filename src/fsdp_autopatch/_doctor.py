"""``fsdp-autopatch doctor``: would a run started like this one be protected, and if not, why.

It looks at this interpreter and this process: whether the start-up file is where this
interpreter reads it, whether the bootstrap ran here (and why not: ``-S``, the kill switch,
another environment), which ``FSDP_AUTOPATCH_*`` variables are set and which are malformed,
torch's version and what each patch does with it. Every problem comes with one suggested action.
Hints close the list: FSDP2 pitfalls of the installed torch that no patch fixes because they are a
choice of the training configuration, which doctor cannot see (bf16 gradient accumulation); a hint
says when it applies and never changes the verdict.
Exit status 1 when the plugin would not protect a run started the same way (same interpreter,
same flags, same environment), 0 otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import NamedTuple

from . import _hook, _process
from ._catalogue import PATCH_NAMES, POLICIES
from ._columns import terminal_width, wrap
from ._config import CROSS_RANK_CHECK, DISABLED_LIST, KILL_SWITCH, PREFIX, THIRD_PARTY, ConfigWarning, read_settings
from ._process import HOOK_TARGET
from ._registry import REGISTRY, PatchRecord, PatchStatus, StatusReport

PTH_NAME = "fsdp_autopatch.pth"
START_NAME = "fsdp_autopatch.start"

OK, WARNING, PROBLEM = "ok", "warning", "problem"
# A known FSDP2 pitfall of this torch that no patch fixes (it is a choice of the training
# configuration, which doctor cannot see): told, never counted against the verdict.
HINT = "hint"


class Finding(NamedTuple):
    check: str  # what was looked at: "startup file", "bootstrap", "environment", "torch", a patch name
    level: str  # ok, warning (named, still protected), problem (not protected) or hint (not the plugin's)
    message: str
    action: str = ""  # what to do about it; empty when there is nothing to do

    def to_dict(self) -> dict[str, str]:
        return self._asdict()


def diagnose() -> list[Finding]:
    """Every finding, in the order a user would fix them."""
    findings = [_startup_file(), _bootstrap_ran()]
    findings += _environment()
    findings += _torch_and_patches()
    findings += hints()
    return findings


def main(as_json: bool = False) -> int:
    findings = diagnose()
    protected = not any(f.level == PROBLEM for f in findings)
    if as_json:
        report = {
            "protected": protected,
            "python": sys.executable,
            "python_version": sys.version.split()[0],
            "findings": [f.to_dict() for f in findings],
            "status": REGISTRY.snapshot().to_dict(),
        }
        print(json.dumps(report, indent=2))
    else:
        print(format_findings(findings, protected))
    return 0 if protected else 1


def format_findings(findings: list[Finding], protected: bool, width: int | None = None) -> str:
    """The findings for a terminal: each wrapped at ``width`` columns (the terminal's; 100 when the
    output is not a terminal), continuation lines indented under their finding."""
    width = width or terminal_width()
    lines = wrap(f"fsdp-autopatch doctor: Python {sys.version.split()[0]} at {sys.executable}", width) + [""]
    for finding in _collapse_kill_switch(findings):
        lines += wrap(f"{finding.check}: {finding.message}", width, first=f"[{finding.level}] ")
        if finding.action:
            lines += wrap(finding.action, width, first="    -> ", rest="       ")
    problems = sum(f.level == PROBLEM for f in findings)
    lines.append("")
    lines.append(
        "verdict: runs started like this one are protected"
        if protected
        else f"verdict: NOT protected ({problems} problem{'s' if problems != 1 else ''} above)"
    )
    return "\n".join(lines)


def _collapse_kill_switch(findings: list[Finding]) -> list[Finding]:
    """The kill switch disables every patch for one reason, and the bootstrap or environment finding
    above already says what to do: one line for all of them, not the same advice once per patch.
    (``--json`` keeps one finding per patch.)"""
    stopped = [f for f in findings if f.action == _KILL_SWITCH_ACTION]
    if len(stopped) < 2:
        return findings
    first = findings.index(stopped[0])
    reason = stopped[0].message.split(" [from ", 1)[0]
    merged = Finding(f"all {len(stopped)} fixes and guards", WARNING, f"{reason} (see above for what to do)")
    rest = [f for f in findings if f.action != _KILL_SWITCH_ACTION]
    return rest[:first] + [merged] + rest[first:]


# --- checks ------------------------------------------------------------------------------------


def site_directories() -> list[str]:
    """The directories whose ``.pth`` files this interpreter runs at start-up (when ``site`` runs)."""
    import site

    # Under -S, site never ran its venv detection: find the venv from pyvenv.cfg ourselves.
    prefix = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    prefixes = [prefix] if os.path.isfile(os.path.join(prefix, "pyvenv.cfg")) else None
    directories = list(site.getsitepackages(prefixes))
    if site.ENABLE_USER_SITE is not False and not sys.flags.no_user_site:
        directories.append(site.getusersitepackages())
    return directories


def _startup_file() -> Finding:
    directories = site_directories()
    found = [d for d in directories if os.path.isfile(os.path.join(d, PTH_NAME))]
    if found:
        path = os.path.join(found[0], PTH_NAME)
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        if _process.BOOTSTRAP not in text:
            return Finding(
                "startup file", PROBLEM, f"{path} does not start fsdp_autopatch's bootstrap",
                f"reinstall: {sys.executable} -m pip install --force-reinstall fsdp-autopatch",
            )
        if sys.flags.no_site:
            return Finding("startup file", OK, f"{path} (installed, but python -S does not run it)")
        return Finding("startup file", OK, f"{path} (this interpreter runs it at start-up)")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return Finding(
        "startup file",
        PROBLEM,
        f"not installed in this interpreter: no {PTH_NAME} in {', '.join(directories) or 'any site directory'} "
        f"(fsdp_autopatch itself was imported from {here})",
        f"install it into this interpreter: {sys.executable} -m pip install fsdp-autopatch",
    )


def _bootstrap_ran() -> Finding:
    if _process.disabled_at_start() is not None:
        return Finding(
            "bootstrap", PROBLEM,
            f"ran, but {KILL_SWITCH}={_process.disabled_at_start().strip()} at interpreter start: nothing is armed",
            f"unset {KILL_SWITCH} (or set it to 1)",
        )
    if _process.started_by() in ("pth", "start"):
        return Finding("bootstrap", OK, f"ran at interpreter start (from the .{_process.started_by()} file)")
    if _process.started_by() == "explicit":
        return Finding("bootstrap", OK, "armed by an explicit fsdp_autopatch.install()")
    if sys.flags.no_site:
        return Finding(
            "bootstrap", PROBLEM, "did not run: python -S skips site-packages and its .pth files",
            "drop -S, or call fsdp_autopatch.install() at the top of the training script",
        )
    return Finding(
        "bootstrap", PROBLEM,
        "did not run: this interpreter's site-packages has no fsdp_autopatch.pth (another environment?)",
        f"install fsdp-autopatch into the environment of {sys.executable}",
    )


def _environment() -> list[Finding]:
    variables = {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}
    told: list[tuple[str, str]] = []  # (variable, message): what read_settings would warn
    settings = read_settings(
        os.environ, warn=lambda variable, message: told.append((variable, message)), names=_patch_names()
    )
    findings = []
    if variables:
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(variables.items()))
        findings.append(Finding("environment", OK, f"set: {shown}"))
    else:
        findings.append(Finding("environment", OK, "no FSDP_AUTOPATCH_* variable set: defaults"))
    for variable, message in told:
        findings.append(Finding(
            "environment", WARNING, message, f"fix or unset {variable}"
        ))
    if not settings.decision("cross_rank_check").enabled:
        # Off on some ranks only, the ranks that still check wait for the silent ones and then
        # blame them as "never reported": the value must be the same everywhere.
        findings.append(Finding(
            "environment", WARNING,
            f"{CROSS_RANK_CHECK}=0: ranks with different patches are not stopped at the first forward",
            f"set {CROSS_RANK_CHECK}=0 on every rank of the job or on none",
        ))
    if not settings.enabled and _process.disabled_at_start() is None:
        findings.append(Finding(
            "environment", PROBLEM, f"{KILL_SWITCH}={os.environ.get(KILL_SWITCH)!r} turns every patch off",
            f"unset {KILL_SWITCH}",
        ))
    return findings


def _patch_names() -> tuple[str, ...]:
    """Built-in patches and the third-party ones installed here (their toggles are known variables)."""
    try:
        from . import _thirdparty  # inside the try: doctor must run when our own modules do not

        externals, _ = _thirdparty.discover(PATCH_NAMES + POLICIES)
    except Exception:  # unreadable metadata, or a module of ours that does not import: findings say so
        externals = []
    return PATCH_NAMES + tuple(external.name for external in externals)


def _torch_and_patches() -> list[Finding]:
    version = _installed_torch_version()
    if version is None:
        return [Finding(
            "torch", PROBLEM, "torch is not installed in this interpreter: nothing to protect",
            f"{sys.executable} -m pip install torch",
        )]
    with warnings.catch_warnings():  # the environment findings already name bad values
        warnings.simplefilter("ignore", ConfigWarning)
        error = _hook.import_fsdp2(arm=True)
    if error is not None:
        action = "use torch >= 2.6 (FSDP2); see docs/compatibility.md"
        return [Finding("torch", PROBLEM, f"torch {version}: {error}", action)]
    findings = [Finding("torch", OK, f"torch {version}, FSDP2 at {HOOK_TARGET}")]
    if _process.hook_failure is not None:
        findings.append(Finding(
            "hook", PROBLEM,
            f"fsdp-autopatch's own code raised in the FSDP2 import hook ({_process.hook_failure}); "
            "your import went on, torch is untouched by the patches that did not apply",
            f"report it with `fsdp-autopatch doctor --json` (Python {sys.version.split()[0]}); "
            "meanwhile use a fsdp-autopatch release that works on this interpreter",
        ))
    report = REGISTRY.snapshot()
    armed = _process.armed()
    findings += _policy_findings(report)
    for record in report.patches:
        finding = _patch_finding(record)
        if not armed and finding.level == OK:
            # evaluated by doctor itself: says what the patch would do once the bootstrap runs
            finding = finding._replace(message=f"would be {finding.message} (evaluated here; not armed at start-up)")
        findings.append(finding)
    return findings


def _patch_finding(record: PatchRecord) -> Finding:
    finding = _patch_finding_of_status(record)
    if record.provider:  # a patch another distribution declares: say whose, and whom to tell
        finding = finding._replace(message=f"{finding.message} [from {record.provider}]")
        if record.status is PatchStatus.FAILED:
            finding = finding._replace(
                action=f"report it to the maintainers of {record.provider.rsplit(' ', 1)[0]}, or set {record.env}=0"
            )
    return finding


def _patch_finding_of_status(record: PatchRecord) -> Finding:
    status = record.status
    if status is PatchStatus.APPLIED and not record.in_force:
        # someone else's monkey-patch replaced ours after us and does not call ours
        theirs = ", ".join(sorted({what for _, what, calls_ours in record.displaced if not calls_ours}))
        return Finding(
            record.name, WARNING, f"applied, but no longer in force everywhere: {record.reason}",
            f"{theirs} now runs instead of this patch: check that it fixes what this patch fixes "
            f"(docs/patches/{record.name}.md), or apply it before fsdp-autopatch activates",
        )
    if status in (PatchStatus.APPLIED, PatchStatus.NOT_NEEDED):
        return Finding(record.name, OK, f"{status.value}: {record.reason}")
    if status is PatchStatus.DISABLED:
        reason = record.reason if record.reason.startswith("disabled ") else f"disabled: {record.reason}"
        return Finding(record.name, WARNING, reason, _how_to_enable(record))
    if status is PatchStatus.UNSUPPORTED:
        return Finding(
            record.name, PROBLEM, f"unsupported on this torch, not protected: {record.reason}",
            "use a torch release from docs/compatibility.md, or report the torch build",
        )
    if status is PatchStatus.FAILED and record.at_call_time:
        # in-process only (fsdp_autopatch.status() in the training program): a wrapper of ours
        # raised, torch's own code ran instead and runs for the rest of the process
        action = (
            "the rest of this run is not protected by this patch; report it with the warning the "
            f"fsdp_autopatch logger printed (its traceback), or set {record.env}=0"
        )
        return Finding(record.name, PROBLEM, record.reason, action)
    if status is PatchStatus.FAILED:
        action = "report this with `fsdp-autopatch doctor --json`"
        return Finding(record.name, PROBLEM, f"failed: {record.reason}", action)
    if status is PatchStatus.PENDING and _process.trigger_of(record.name) != HOOK_TARGET:
        # FSDP2 is here and armed the hook of the other module it waits for (DCP's state_dict)
        return Finding(record.name, OK, f"{status.value}: {record.reason}")
    return Finding(record.name, PROBLEM, f"{status.value}: {record.reason}", "see the bootstrap finding above")


def _policy_findings(report: StatusReport) -> list[Finding]:
    """A policy that was switched on but is not in force; a third-party discovery that failed."""
    findings = [
        Finding(f"policy {record.name}", WARNING, record.description, "report this with `fsdp-autopatch doctor --json`")
        for record in report.policy_records
        if not record.in_force
    ]
    if report.third_party_failure is not None:
        findings.append(Finding(
            "third-party patches", WARNING, f"none armed: {report.third_party_failure}",
            f"report this with `fsdp-autopatch doctor --json`, or set {THIRD_PARTY}=0",
        ))
    return findings


_KILL_SWITCH_ACTION = f"unset {KILL_SWITCH} (it turns every patch off)"


def _how_to_enable(record: PatchRecord) -> str:
    """The variable that really switched this patch off (the kill switch wins over the others)."""
    if record.variable == KILL_SWITCH:
        return _KILL_SWITCH_ACTION
    if record.variable == DISABLED_LIST:
        return f"remove {record.name} from {DISABLED_LIST} (or set {record.env}=1)"
    return f"unset {record.env} or set it to 1"


def _installed_torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(getattr(torch, "__version__", "unknown"))


def hints() -> list[Finding]:
    """FSDP2 pitfalls of the installed torch that are the user's configuration to change."""
    accumulation = bf16_accumulation_hint()
    return [accumulation] if accumulation is not None else []


# Measured with 2 gloo ranks, a 2-layer MLP, 64 and 256 micro-batches (docs/faq.md).
_BF16_ACCUMULATION_COST = (
    "sums the micro-batch gradients of set_requires_gradient_sync(False) in bf16 and reduce-scatters "
    "them in bf16: 3x the gradient error of reduce_dtype=torch.float32 after 64 micro-batches, "
    "6x after 256 (docs/faq.md)"
)


def bf16_accumulation_hint() -> Finding | None:
    """Which MixedPrecisionPolicy accumulates gradients in bf16 on this torch, read from how
    ``FSDPParam.init_dtype_attrs`` resolves ``reduce_dtype``; None when FSDP2 is not importable
    or the method is not one of the two known shapes."""
    try:
        from . import _compat  # inside the try: doctor must run when our own modules do not

        resolve = _compat.class_attr(_compat.fsdp_class("_fsdp_param", "FSDPParam"), "init_dtype_attrs")
    except Exception:  # no torch, no FSDP2, or our module broken: the findings above say so
        return None
    if _compat.reads_names(resolve, "unsharded_grad_dtype"):
        # PyTorch's pending-gradient rewrite (commit acf70b43): the unsharded gradient, and so every
        # pending no-sync contribution, is in reduce_dtype, else param_dtype (as on torch <= 2.14)
        policy = "MixedPrecisionPolicy(param_dtype=torch.bfloat16) without reduce_dtype"
        aside = " (or with reduce_dtype=torch.bfloat16, as accelerate passes)"
    elif _compat.reads_names(resolve, "sharded_grad_dtype"):
        # torch >= 2.15: reduce_dtype=None follows the parameter's dtype (fp32 for fp32 parameters)
        policy = "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)"
        aside = " (accelerate passes reduce_dtype equal to param_dtype)"
    elif _compat.reads_names(resolve, "reduce_dtype", "param_dtype"):
        # torch <= 2.14: reduce_dtype=None means "reduce in param_dtype"
        policy = "MixedPrecisionPolicy(param_dtype=torch.bfloat16) without reduce_dtype"
        aside = " (or with reduce_dtype=torch.bfloat16, as accelerate passes)"
    else:
        return None
    return Finding(
        "bf16 gradient accumulation", HINT,
        f"on this torch, {policy}{aside} {_BF16_ACCUMULATION_COST}",
        "pass reduce_dtype=torch.float32 when you accumulate gradients over micro-batches",
    )
