"""``fsdp-autopatch`` / ``python -m fsdp_autopatch``: ``status [--json]``, ``doctor [--json]`` and ``demo``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import _hook, _process
from ._process import HOOK_TARGET
from ._registry import REGISTRY, PatchStatus, StatusReport
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
        return _status(as_json=getattr(args, "json", False))
    if args.command == "doctor":
        from . import _doctor

        return _doctor.main(as_json=args.json)
    parser.error(f"unknown command {args.command}")  # pragma: no cover - argparse catches it
    return 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-autopatch",
        description="Automatic fixes for known PyTorch FSDP2 bugs: inspect them, diagnose the set-up, or run the demo.",
    )
    parser.add_argument("--version", action="version", version=f"fsdp-autopatch {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{status,doctor,demo}")
    status = commands.add_parser(
        "status", help="import torch's FSDP2 and show which patches applied here, and why"
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
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
    return parser


def _status(as_json: bool) -> int:
    _import_fsdp2()
    report = REGISTRY.snapshot()
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_table(report))
    return 1 if any(r.status is PatchStatus.FAILED for r in report.patches) else 0


def _import_fsdp2() -> None:
    """Import torch's FSDP2 so that the answer is the real one, not "pending"."""
    try:
        import torch.distributed.fsdp  # noqa: F401
    except Exception as error:
        _mark_pending_unsupported(f"torch.distributed.fsdp could not be imported ({type(error).__name__}: {error})")
        return
    if HOOK_TARGET not in sys.modules:
        _mark_pending_unsupported(f"this torch has no {HOOK_TARGET} (FSDP2 needs torch >= 2.6)")
        return
    _hook.import_waited_for()


def _mark_pending_unsupported(reason: str) -> None:
    """FSDP2 cannot be imported here: every patch still pending can never apply. (Without torch at
    all the registry's snapshot already says "torch is not installed".)"""
    if _process.torch_version() is not None:
        REGISTRY.settle_pending(PatchStatus.UNSUPPORTED, reason)


def format_table(report: StatusReport) -> str:
    torch = report.torch or "not installed"
    lines = [f"fsdp-autopatch {report.version}   torch {torch}   bootstrap: {report.bootstrap}", ""]
    width = max(len(r.name) for r in report.patches)
    lines.append(f"{'PATCH':<{width}}  {'STATUS':<11}  {'FIRED':>5}  REASON")
    for record in report.patches:
        lines.append(f"{record.name:<{width}}  {record.status.value:<11}  {record.fired:>5}  {record.reason}")
        source = f"   from {record.provider}" if record.provider else ""
        lines.append(f"{'':<{width}}  {'':<11}  {'':>5}  toggle: {record.env}=0|1{source}")
    for name, description in report.policies.items():
        lines.append(f"policy {name}: {description}")
    if report.bootstrap == "not_run":
        lines.append(
            "note: the start-up hook did not run in this process (python -S, or the package is not "
            "installed into this environment); call fsdp_autopatch.install() yourself."
        )
    return "\n".join(lines)
