#!/usr/bin/env python3
"""The plugin on the next torch's FSDP2, before its wheel exists: FSDP2 files overlaid, torch untouched.

Give it a folder of FSDP2 sources of a newer torch (``_fsdp_param.py``, ``_fsdp_param_group.py``,
``_fsdp_state.py``, ``_fully_shard.py``, a new ``_fsdp_grad.py``...: fetched by hand from PyTorch's
repository, never committed). It writes a temporary directory holding a ``sitecustomize.py`` and
``scripts/_torch_overlay.py``, puts it first on ``PYTHONPATH``, and so every interpreter it starts
(and every rank those start) imports ``torch.distributed.fsdp._fully_shard.<name>`` from the
folder's ``<name>.py`` where it has one, the rest of the installed torch as it is. Then:

1. the plugin's registry, without and with the overlay, each in a fresh interpreter: a table of
   the entries (patches and policies) whose status changes, with the reason given with the overlay;
   an FSDP2 import that fails with the overlay (a file needing internals this torch lacks) is
   reported with its error and the overlay line it came from, the entries then stay ``pending``;
2. optionally the cases (``--cases``), ``tests/unit`` (``--unit``) and ``tests/distributed``
   (``--dist``) with the overlay: pass / fail / skip counts and the failures' first lines.

Usage (from the repository root; stdlib only)::

    python3 scripts/next_torch.py --python .venv/bin/python --overlay ~/fsdp2-next
    python3 scripts/next_torch.py --overlay ~/fsdp2-next --relabel 2.16.0.dev --cases --out /tmp/next
    python3 scripts/next_torch.py --relabel 2.16.0.dev          # no overlay: the installed FSDP2, relabelled

Exit status 0 when the registry probes ran and no test failed; 1 when the overlaid FSDP2 does not
import, a probe breaks, or a test fails. A verdict that changes is what the run is for, not a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import matrix  # the same pytest runner and junit reading as the release matrix

ROOT = Path(__file__).resolve().parent.parent
OVERLAY_MODULE = Path(__file__).resolve().parent / "_torch_overlay.py"
PROBE_TIMEOUT = 10 * 60
SUITES = {  # option -> pytest arguments (the torchrun launcher tests are left out, as in the matrix)
    "cases": ["tests/distributed/test_dist_cases.py"],
    "unit": ["tests/unit"],
    "dist": ["tests/distributed", "-m", "not launcher"],
}
# the tests hold every status to tests/expected.py's row for the release torch reports
RELABEL_NOTE = (
    "note: without --relabel the tests hold each status to tests/expected.py's row for the installed release, so "
    "a verdict the overlay changes fails every launch that checks the registry; --relabel 2.16.0.dev (a release "
    "not measured) lets the structural checks decide, as on the new release"
)
SITECUSTOMIZE = """\
# written by scripts/next_torch.py: FSDP2 files served from an overlay folder
import os, _torch_overlay
_torch_overlay.install({folder!r}, {relabel!r})
_torch_overlay.run_shadowed_sitecustomize(os.path.dirname(os.path.abspath(__file__)))
"""
# argv[1]: the overlay folder, when there is one. The FSDP2 import may fail (a file that needs
# internals this torch lacks): the error is recorded and the registry read all the same.
PROBE = r"""
import json, sys, traceback
failure = None
try:
    import torch.distributed.fsdp, torch.distributed.checkpoint.state_dict
except BaseException as exc:
    frames = traceback.extract_tb(exc.__traceback__)
    folder = sys.argv[1] if len(sys.argv) > 1 else None
    ours = [f for f in frames if folder and f.filename.startswith(folder)] or frames[-1:]
    failure = {"error": traceback.format_exception_only(type(exc), exc)[-1].strip(),
               "where": [f"{f.filename}:{f.lineno}: {f.line}" for f in ours[-1:]]}
import fsdp_autopatch
overlaid = []
if len(sys.argv) > 1:
    import _torch_overlay
    overlaid = _torch_overlay.overlaid_modules(sys.argv[1])
import torch
print(json.dumps({"torch": str(torch.__version__), "import_failure": failure, "overlaid": overlaid,
                  "report": fsdp_autopatch.status().to_dict()}))
"""


# --- the environment ----------------------------------------------------------------------------


def write_site(site_dir: Path, overlay: Path | None, relabel: str | None) -> Path:
    """``site_dir`` made into the directory that, first on PYTHONPATH, overlays FSDP2."""
    site_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(OVERLAY_MODULE, site_dir / OVERLAY_MODULE.name)
    folder = str(overlay.resolve()) if overlay is not None else None
    (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE.format(folder=folder, relabel=relabel))
    return site_dir


def is_overlay_site(directory: str) -> bool:
    """Whether ``directory`` is one :func:`write_site` made (its sitecustomize says so)."""
    try:
        return (Path(directory) / "sitecustomize.py").read_text().startswith(SITECUSTOMIZE.splitlines()[0])
    except OSError:
        return False


def environment(site_dir: Path | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, ``site_dir`` first on PYTHONPATH (None: the plain torch).

    The caller's ``FSDP_AUTOPATCH_*`` variables are dropped so that both runs decide alike;
    ``extra`` (``--env``) comes last. No bytecode is written, into the installed torch least of all.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_AUTOPATCH_")}
    # An overlay this run did not write (this script run under another's, as its own tests are
    # there) would serve its files in both runs: "without" is the installed torch.
    outer = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and not is_overlay_site(entry)]
    entries = ([str(site_dir)] if site_dir is not None else []) + outer
    env.pop("PYTHONPATH", None)
    if entries:
        env["PYTHONPATH"] = os.pathsep.join(entries)
    env.update(PYTHONDONTWRITEBYTECODE="1", **(extra or {}))
    return env


# --- the registry, without and with ---------------------------------------------------------------


def probe(python: str, env: dict[str, str], overlay: Path | None = None) -> dict:
    """The registry of a fresh interpreter; ``{"probe_error": ...}`` where it gave none."""
    cmd = [python, "-c", PROBE] + ([str(overlay.resolve())] if overlay is not None else [])
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"probe_error": f"timed out after {PROBE_TIMEOUT} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"probe_error": f"exited {proc.returncode}: {last}", "stderr": proc.stderr[-4000:]}
    try:
        return json.loads(lines[-1])
    except ValueError as exc:
        return {"probe_error": f"output unreadable: {exc}", "stdout": proc.stdout[-4000:]}


def verdicts(probed: dict) -> dict[str, dict[str, str]]:
    """``{entry: {"status", "reason"}}`` for every patch and every policy switched on."""
    report = probed.get("report") or {}
    entries = {p["name"]: {"status": p["status"], "reason": p["reason"]} for p in report.get("patches", [])}
    for policy in report.get("policy_records", []):
        entries[f"{policy['name']} (policy)"] = {"status": policy["status"], "reason": policy["description"]}
    return entries


def changed_verdicts(without: dict, with_overlay: dict) -> list[dict[str, str]]:
    """The entries whose status differs, in the registry's order (``absent``: not in that registry)."""
    before, after = verdicts(without), verdicts(with_overlay)
    absent = {"status": "absent", "reason": "not in the registry"}
    rows = []
    for name in [*before, *(n for n in after if n not in before)]:
        old, new = before.get(name, absent), after.get(name, absent)
        if old["status"] != new["status"]:
            rows.append({"entry": name, "without": old["status"], "with": new["status"], "reason": new["reason"]})
    return rows


def compare_registries(python: str, site_dir: Path, overlay: Path | None, extra_env=None) -> dict:
    """Both registries and what changed between them (``site_dir``: from :func:`write_site`)."""
    without = probe(python, environment(None, extra_env))
    with_overlay = probe(python, environment(site_dir, extra_env), overlay)
    return {"without": without, "with": with_overlay, "changes": changed_verdicts(without, with_overlay)}


# --- the report ----------------------------------------------------------------------------------


def describe_probe(label: str, probed: dict) -> list[str]:
    """What one registry run found, in a few lines: torch, the overlaid modules, an import failure."""
    if "probe_error" in probed:
        return [f"{label}: the probe failed ({probed['probe_error']})"]
    counts: dict[str, int] = {}
    for entry in verdicts(probed).values():
        counts[entry["status"]] = counts.get(entry["status"], 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    lines = [f"{label}: torch {probed['torch']}: {summary}"]
    if "overlaid" in probed and label != "without":
        lines.append(f"  modules served from the overlay: {', '.join(probed['overlaid']) or 'none'}")
    failure = probed.get("import_failure")
    if failure:
        lines.append(f"  the FSDP2 import FAILED: {failure['error']}")
        lines += [f"    at {where}" for where in failure["where"]]
    return lines


def format_changes(rows: list[dict[str, str]], width: int = 100) -> str:
    """The changed verdicts as a table: entry, without -> with, then the reason with the overlay."""
    if not rows:
        return "no entry changes its verdict"
    name_width = max(len(row["entry"]) for row in rows)
    out = [f"{'entry':<{name_width}}  without -> with", f"{'-' * name_width}  ---------------"]
    for row in rows:
        out.append(f"{row['entry']:<{name_width}}  {row['without']} -> {row['with']}")
        out += textwrap.wrap(row["reason"], width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(out)


def overlay_files(overlay: Path | None) -> list[str]:
    return sorted(p.name for p in overlay.glob("*.py")) if overlay is not None else []


def unused_files(overlay: Path | None, probed: dict) -> list[str]:
    """Overlay files no module was loaded from (a new module nothing imports, a misspelt name)."""
    loaded = {f"{name}.py" for name in probed.get("overlaid", [])}
    return [name for name in overlay_files(overlay) if name not in loaded]


# --- the suites ----------------------------------------------------------------------------------


def skip_reasons(junit: Path) -> list[str]:
    """Each distinct skip message, with how many tests gave it: on the new FSDP2 a skip is evidence too
    (a case skipped because its patch is ``unsupported`` there says what the bug did without it)."""
    if not junit.exists():
        return []
    messages = Counter(
        (skipped.get("message") or "").splitlines()[0][:300] if skipped.get("message") else "no reason given"
        for case in ET.parse(junit).getroot().iter("testcase")
        if (skipped := case.find("skipped")) is not None
    )
    return [f"{count} x {message}" for message, count in messages.most_common()]


def run_suite(name: str, python: str, env: dict[str, str], logs: Path, timeout: float) -> dict:
    """One pytest run with the overlay: counts and failures from its junit report."""
    junit = logs / f"{name}-junit.xml"
    junit.unlink(missing_ok=True)
    log_file = logs / f"{name}.log"
    log_file.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", *SUITES[name], "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", "-o", "junit_logging=no"]
    code = matrix.run(cmd, log_file=log_file, timeout=timeout, cwd=ROOT, env=env)
    return {"exit": code, "log": str(log_file), **matrix.junit_summary(junit), "skips": skip_reasons(junit)}


def describe_suite(name: str, result: dict, shown: int = 20) -> list[str]:
    lines = [f"{name}: {result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped"
             f" (exit {result['exit']}; log {result['log']})"]
    lines += [f"  FAILED {failure}" for failure in result["failures"][:shown]]
    if len(result["failures"]) > shown:
        lines.append(f"  ... and {len(result['failures']) - shown} more (the log)")
    lines += [f"  skipped: {reason}" for reason in result["skips"][:shown]]
    return lines


# --- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the venv's interpreter (default: this one)")
    parser.add_argument("--overlay", type=Path, help="folder of FSDP2 files (<name>.py) of the newer torch")
    parser.add_argument("--relabel", metavar="VERSION", help="torch.__version__ to report, e.g. 2.16.0.dev")
    for name, paths in SUITES.items():
        parser.add_argument(f"--{name}", action="store_true", help=f"run pytest {' '.join(paths)} with the overlay")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a variable for every run (a policy switched on, say); repeatable")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per test suite (default 3600)")
    parser.add_argument("--out", type=Path, default=ROOT / ".artifacts" / "next-torch",
                        help="folder for summary.json and the suites' logs (default .artifacts/next-torch)")
    args = parser.parse_args(argv)
    if args.overlay is None and args.relabel is None:
        parser.error("nothing to overlay: give --overlay DIR, --relabel VERSION or both")
    if args.overlay is not None and not args.overlay.is_dir():
        parser.error(f"--overlay {args.overlay}: not a folder")
    if any("=" not in item for item in args.env):
        parser.error("--env takes NAME=VALUE")
    return args


def report_registries(compared: dict, overlay: Path | None) -> list[str]:
    lines = [f"overlay files: {', '.join(overlay_files(overlay)) or 'none'}"]
    lines += describe_probe("without", compared["without"]) + describe_probe("with the overlay", compared["with"])
    with_overlay = compared["with"]
    if "probe_error" in with_overlay or with_overlay.get("import_failure"):
        # every entry waits for an import that never completed: no verdict to compare
        return [*lines, "", "no verdicts to compare: FSDP2 did not import with the overlay (registries: summary.json)"]
    unused = unused_files(overlay, with_overlay)
    if unused:
        lines.append(f"  not imported by FSDP2 here (served only when something imports them): {', '.join(unused)}")
    return [*lines, "", format_changes(compared["changes"])]


def broken(compared: dict, suites: dict[str, dict]) -> bool:
    probes = (compared["without"], compared["with"])
    if any("probe_error" in p or p.get("import_failure") for p in probes):
        return True
    return any(result["failed"] or result["exit"] not in (0, 5) for result in suites.values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    extra_env = dict(item.split("=", 1) for item in args.env)
    with tempfile.TemporaryDirectory(prefix="fsdp-next-torch-") as scratch:
        site_dir = write_site(Path(scratch) / "site", args.overlay, args.relabel)
        compared = compare_registries(args.python, site_dir, args.overlay, extra_env)
        print("\n".join(report_registries(compared, args.overlay)), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        suites = {}
        requested = [n for n in SUITES if getattr(args, n)]
        if requested and args.relabel is None:
            print("\n" + "\n".join(textwrap.wrap(RELABEL_NOTE, 100)), flush=True)
        for name in requested:
            print(f"\nrunning {name} with the overlay ...", flush=True)
            suites[name] = run_suite(name, args.python, environment(site_dir, extra_env), args.out, args.timeout)
            print("\n".join(describe_suite(name, suites[name])), flush=True)
    summary = {"python": args.python, "overlay": str(args.overlay), "relabel": args.relabel, **compared,
               "suites": suites}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nsummary: {args.out / 'summary.json'}")
    return 1 if broken(compared, suites) else 0


if __name__ == "__main__":
    sys.exit(main())
