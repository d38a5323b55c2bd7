"""``fsdp-autopatch`` / ``python -m fsdp_autopatch``: ``status [-v] [NAME] [--json]``, ``doctor [--json]``,
``demo`` and ``gpu-check [--device ...]`` (``fsdp_autopatch._gpu_check``, imported only when it runs).

``status`` prints one line per patch (name, kind, status, fired, what it gives or why not) and a
short footer; ``status -v`` each whole reason and toggle; ``status NAME`` one entry in full. Text
fits the terminal's width (100 columns when the output is not a terminal: ``_columns``);
``--json`` is the whole report, the same keys whatever the other options.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from . import _catalogue, _hook, _process, patches
from ._columns import shorten, table, terminal_width, wrap
from ._config import KILL_SWITCH, PREFIX, read_settings
from ._registry import REGISTRY, PatchRecord, PatchStatus, PolicyRecord, StatusReport
from ._version import __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from . import demo

        return demo.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in (None, "status"):
        return _status(
            as_json=getattr(args, "json", False), verbose=getattr(args, "verbose", False),
            name=getattr(args, "name", None), parser=getattr(args, "status_parser", parser),
        )
    if args.command == "doctor":
        from . import _doctor

        return _doctor.main(as_json=args.json)
    if args.command == "gpu-check":
        from ._gpu_check import _main

        return _main.run(args)
    parser.error(f"unknown command {args.command}")  # pragma: no cover - argparse catches it (error exits 2)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-autopatch",
        description="Automatic fixes for known PyTorch FSDP2 bugs: inspect them, diagnose the set-up, run the demo, "
        "or check them on this machine's GPUs.",
    )
    parser.add_argument("--version", action="version", version=f"fsdp-autopatch {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{status,doctor,demo,gpu-check}")
    status = commands.add_parser(
        "status", help="import torch's FSDP2 and show which patches applied here, and why"
    )
    status.add_argument("name", nargs="?", metavar="NAME", help="show this one fix, guard or policy in full")
    status.add_argument("-v", "--verbose", action="store_true", help="every whole reason and toggle")
    status.add_argument("--json", action="store_true", help="machine-readable output (the whole report)")
    status.set_defaults(status_parser=status)
    doctor = commands.add_parser(
        "doctor",
        help="explain whether runs started like this one are protected, and what to do if not "
        "(exit status 1 when they are not)",
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    commands.add_parser(
        "demo",
        help="train a tiny vision-language MoE on 2 CPU ranks that hits the first four patches' bugs "
        "(--without-patches shows the failures; --bug NAME another patch's bug on its own model)",
        add_help=False,
    )
    _add_gpu_check(commands)
    return parser


def _add_gpu_check(commands) -> None:
    gpu = commands.add_parser(
        "gpu-check",
        help="check the plugin as installed here on this machine's GPUs (NCCL; --device cpu: 2 gloo ranks): "
        "every patch's bug, training, step cost; writes report.json (exit status 1 when a case is wrong)",
    )
    gpu.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                     help="auto (default): cuda when torch sees a GPU, else say so and exit 0")
    gpu.add_argument("--out", default="fsdp-autopatch-gpu-check", help="report folder (default %(default)s)")
    gpu.add_argument("--expected", metavar="PATH", help="a checkout's tests/expected.py: also judge the plugin-off "
                     "runs against what it says for this torch (findings)")
    gpu.add_argument("--world-size", type=int, help="ranks (default: the GPUs on cuda, 2 on cpu)")
    gpu.add_argument("--budget", type=float, help="overall time guard in seconds (default 450 cuda, 240 cpu)")
    gpu.add_argument("--jobs", type=int, help="launches at a time before the cost (default: 4 on cuda, 2 on cpu)")
    gpu.add_argument("--compile-backend", help="torch.compile backend of the compiled training and the compile "
                     "modes' counters (default inductor on cuda, aot_eager on cpu)")
    gpu.add_argument("--only", nargs="+", metavar="PATCH",
                     choices=[e.name for e in _catalogue.ENTRIES if e.kind != _catalogue.POLICY],
                     help="only these patches' bug cases (no training, compile modes or cost)")
    gpu.add_argument("--off-runs", nargs="+", metavar="PATCH",
                     choices=[e.name for e in _catalogue.ENTRIES if e.kind != _catalogue.POLICY],
                     help="the plugin-off runs of these patches only (default: every patch whose case runs); "
                     "every case still runs with the plugin on")
    gpu.add_argument("--setup-json", help=argparse.SUPPRESS)  # scripts/gpu_check.py: its wheel and set-up times


def _status(as_json: bool, verbose: bool, name: str | None, parser: argparse.ArgumentParser) -> int:
    _import_fsdp2()
    report = REGISTRY.snapshot()
    if name is not None:
        return _status_of_one(report, name, as_json, parser)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_table(report) if verbose else format_summary(report))
    return 1 if any(r.status is PatchStatus.FAILED for r in report.patches) else 0


def _status_of_one(report: StatusReport, name: str, as_json: bool, parser: argparse.ArgumentParser) -> int:
    record = next((r for r in report.patches if r.name == name), None)
    policy = next((p for p in report.policy_records if p.name == name), None)
    if record is None and policy is None and name not in _catalogue.POLICIES:
        known = [r.name for r in report.patches] + list(_catalogue.POLICIES)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        parser.error(f"no fix, guard or policy named {name!r}{hint} (`fsdp-autopatch status` lists them)")
    if as_json:
        print(json.dumps(record.to_dict() if record else _policy_dict(name, policy), indent=2))
    else:
        print("\n".join([_header(report), "", *(_entry_lines(record) if record else _policy_lines(name, policy))]))
    failed = (record or policy) is not None and (record or policy).status is PatchStatus.FAILED
    return 1 if failed else 0


def _import_fsdp2() -> None:
    """Import torch's FSDP2 so that the answer is the real one, not "pending"."""
    why_not = _hook.import_fsdp2()
    if why_not is not None:
        _mark_pending_unsupported(why_not)


def _mark_pending_unsupported(reason: str) -> None:
    """FSDP2 cannot be imported here: every patch still pending can never apply. (Without torch at
    all the registry's snapshot already says "torch is not installed".)"""
    if _process.torch_version() is not None:
        REGISTRY.settle_pending(PatchStatus.UNSUPPORTED, reason)


def _header(report: StatusReport) -> str:
    return f"fsdp-autopatch {report.version}   torch {report.torch or 'not installed'}   bootstrap: {report.bootstrap}"


_NOT_RUN = (
    "note: the start-up hook did not run in this process (python -S, or the package is not "
    "installed into this environment); call fsdp_autopatch.install() yourself."
)


def format_summary(report: StatusReport, width: int | None = None) -> str:
    """``status``: one line per patch within ``width`` columns (the terminal's; 100 when not a
    terminal), then the policies and where to read more."""
    width = width or terminal_width()
    rows = [("PATCH", "KIND", "STATUS", "FIRED", "WHY")]
    rows += [(r.name, _kind(r.name), r.status.value, str(r.fired), _gist(r)) for r in report.patches]
    lines = [_header(report), "", *table(rows, right=frozenset({3}), width=width)]
    lines += _failures(report, width)
    for policy in report.policy_records:
        lines += _wrap(f"policy {policy.name}{_fired_note(policy.fired)}: {policy.description}", width)
    lines += _opt_in_footer(report, width)
    providers: dict[str, int] = {}
    for record in report.patches:
        if record.provider:
            providers[record.provider] = providers.get(record.provider, 0) + 1
    if providers:  # which patch is whose: status NAME
        listed = ", ".join(f"{provider} ({count})" for provider, count in sorted(providers.items()))
        lines.append(shorten(f"third-party patches from: {listed}", width))
    lines += _wrap(f"toggles: {PREFIX}<PATCH>_ENABLED=0|1 switches one, {KILL_SWITCH}=0 all of them", width)
    lines += _wrap("more: fsdp-autopatch status -v (whole reasons, toggles), status NAME (one entry), --json", width)
    if report.bootstrap == "not_run":
        lines += textwrap.wrap(_NOT_RUN, width)
    return "\n".join(lines)


def _fired_note(fired: int) -> str:
    return f" (fired {fired} time{'' if fired == 1 else 's'})" if fired else ""


def _opt_in_footer(report: StatusReport, width: int) -> list[str]:
    """The policies that are off here, each with the variable that switches it on: a user cannot
    ask for what ``status`` never names."""
    lines = []
    for name in _catalogue.POLICIES:
        if name not in report.policies:
            lines += _wrap(f"policy {name}: off ({_why_off(name)})", width)
    return lines


def _why_off(name: str) -> str:
    """How to switch a policy on that is off here: its variable, unless the kill switch is why."""
    stopped = _process.disabled_at_start()
    if stopped is not None:
        return f"{KILL_SWITCH}={stopped.strip()} at interpreter start: nothing armed"
    decision = read_settings(warn=lambda variable, message: None).decision(name)
    if decision.variable == KILL_SWITCH:
        return f"{decision.describe()}: every patch and policy is off"
    return f"{_catalogue.BY_NAME[name].toggle}=1 switches it on"


def _failures(report: StatusReport, width: int, most: int = 3) -> list[str]:
    """What failed is what a user must read: each distinct reason once (the whole hook failing
    fails every patch with one reason), wrapped at 100 columns."""
    grouped: dict[str, list[str]] = {}
    for record in report.patches:
        if record.status is PatchStatus.FAILED:
            grouped.setdefault(_TORCH_PREFIX.sub("", record.reason), []).append(record.name)
    lines = []
    for reason, names in list(grouped.items())[:most]:
        who = names[0] if len(names) == 1 else f"({len(names)} patches)"
        lines += _wrap(f"failed {who}: {reason}", width)
    return lines + ([f"failed: {len(grouped) - most} more reasons (status -v)"] if len(grouped) > most else [])


def _wrap(text: str, width: int) -> list[str]:
    """A footer item: at most 3 lines of ``width`` columns (module names are never split)."""
    return textwrap.wrap(text, width, subsequent_indent="    ", break_on_hyphens=False, max_lines=3, placeholder=" ...")


def _kind(name: str) -> str:
    entry = _catalogue.BY_NAME.get(name)
    return entry.kind if entry is not None else _catalogue.FIX  # another distribution's patch is a fix


# "torch 2.13.0: " opens most reasons: the header already says which torch
_TORCH_PREFIX = re.compile(r"^torch \S+: ")


def _gist(record: PatchRecord) -> str:
    """A few words of why: for an applied entry what the user gets (its ``Patch.summary``; the
    reason, which names torch internals, is in ``status -v``), otherwise the reason without its torch
    prefix, up to its first "; ". A patch switched off by its own toggle says so in words: the
    toggle's name is longer than the room."""
    summary = _summary(record.name) if record.status is PatchStatus.APPLIED else None
    if summary is not None:
        return summary
    if record.status is PatchStatus.PENDING:  # the module whose import applies it, short enough to fit
        return f"waits for {_process.trigger_of(record.name).removeprefix('torch.distributed.')} to be imported"
    if record.status is PatchStatus.DISABLED and record.variable == record.env:
        return f"by its own toggle, set to {(record.value or '').strip()}"
    reason = _TORCH_PREFIX.sub("", record.reason).split("; ", 1)[0]
    if record.status is PatchStatus.DISABLED and reason.startswith("disabled by "):
        return reason[len("disabled "):]  # the STATUS column says "disabled"
    return reason


def _summary(name: str) -> str | None:
    """An applied built-in entry's summary, from its module (already imported: it applied);
    None for another distribution's patch."""
    module = sys.modules.get(patches.module_of(name)) if name in _catalogue.BY_NAME else None
    return getattr(getattr(module, "PATCH", None), "summary", None)


def _wrapped(label: str, text: str) -> list[str]:
    return wrap(text, terminal_width(), first=f"  {label}: ", rest=" " * (len(label) + 4))


def _entry_lines(record: PatchRecord) -> list[str]:
    """``status NAME`` for a fix or guard: every field of its record, wrapped at 100 columns."""
    lines = [f"{record.name}: {_kind(record.name)}, {record.status.value}, fired {record.fired} time"
             + ("" if record.fired == 1 else "s"), *_wrapped("why", record.reason)]
    if record.decided_by:
        lines.append(f"  decided by: {record.decided_by}")
    if record.variable is not None:
        lines.append(f"  set by: {record.variable}={record.value}")
    lines.append(f"  toggle: {record.env}=0|1")
    if record.provider:
        lines.append(f"  from: {record.provider}")
    return lines


def _policy_lines(name: str, policy: PolicyRecord | None) -> list[str]:
    variable = _catalogue.BY_NAME[name].toggle
    if policy is None:
        return [f"{name}: policy, off", f"  why: {_why_off(name)}", f"  toggle: {variable}=0|1"]
    return [f"{name}: policy, {policy.status.value}, fired {policy.fired} time{'' if policy.fired == 1 else 's'}",
            *_wrapped("what", policy.description),
            f"  toggle: {variable}=0|1"]


def _policy_dict(name: str, policy: PolicyRecord | None) -> dict[str, Any]:
    if policy is None:
        return {"name": name, "status": "off", "description": "", "fired": 0}
    return policy.to_dict()


_READABLE = 60  # the least room for a whole reason beside its row in ``status -v``


def format_table(report: StatusReport, width: int | None = None) -> str:
    """``status -v``: each patch's whole reason and its toggle, wrapped at ``width`` columns (the
    terminal's; 100 when not a terminal) with continuation lines under the REASON column."""
    width = width or terminal_width()
    lines = [_header(report), ""]
    name_width = max(len(r.name) for r in report.patches)
    head = f"{'PATCH':<{name_width}}  {'STATUS':<11}  {'FIRED':>5}  "
    # on a narrow terminal (or beside a long third-party name) the REASON column would be a tall
    # strip of a few words a line: the reason goes below its row instead, indented
    beside = width - len(head) >= _READABLE
    indent = " " * len(head) if beside else "    "
    lines.append(f"{head}REASON")
    for record in report.patches:
        row = f"{record.name:<{name_width}}  {record.status.value:<11}  {record.fired:>5}  "
        source = f"   from {record.provider}" if record.provider else ""
        if beside:
            lines += wrap(record.reason, width, first=row, rest=indent)
        else:
            lines += [row.rstrip(), *wrap(record.reason, width, first=indent, rest=indent)]
        lines += wrap(f"toggle: {record.env}=0|1{source}", width, first=indent, rest=indent)
    for name, description in report.policies.items():
        lines += wrap(f"policy {name}: {description}", width)
    lines += _opt_in_footer(report, width)  # as in ``status``: what is off, and how to switch it on
    if report.bootstrap == "not_run":
        lines += wrap(_NOT_RUN, width, rest="")
    return "\n".join(lines)
