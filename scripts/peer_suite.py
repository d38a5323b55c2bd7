#!/usr/bin/env python3
"""PyTorch's own FSDP2 tests as a peer suite: every file run with the plugin on and off.

PyTorch tests FSDP2 in its repository under ``test/distributed/_composable/fsdp/``
(``test_fully_shard_*.py``). Those files are not shipped in the torch wheel and are not part of
this repository, so this script does not fetch them and is not part of CI: copy the directory
from a PyTorch checkout at the release tag of the torch you test (``git -C pytorch checkout
v2.13.0``; the installed build's commit is ``torch.version.git_version``) into any directory
and point ``--tests-dir`` at it. The helpers they import (``torch.testing._internal``) ship in
the wheel; they need ``expecttest`` (``pip install expecttest``, or ``pip install --target DIR
expecttest`` and ``--pythonpath DIR`` to leave the environment untouched).

For each file and each mode the script runs, in a fresh interpreter and its own process group::

    PYTHON -m pytest FILE -p no:cacheprovider -v --junitxml=...

with ``CUDA_VISIBLE_DEVICES=""`` (CUDA-only tests skip; threaded ``FSDPTestMultiThread`` tests
and gloo ``FSDPTest`` tests with ``allow_cpu`` run) and, for the "off" run,
``FSDP_AUTOPATCH_ENABLED=0`` (the kill switch: nothing is armed). A file that outlives
``--timeout`` is killed; the tests it finished are still counted from pytest's ``-v`` lines.
Files run one after another (FSDPTest spawns a process per rank).

Output: a markdown table (file, passed/failed/skipped with the plugin on and off, seconds)
followed by every test id whose outcome differs, printed and written to ``OUT/peer_suite.md``
with the raw outcomes in ``OUT/peer_suite.json``.

Usage::

    python3 scripts/peer_suite.py --tests-dir /path/to/fsdp-tests \\
        --python .venv/bin/python [--out .artifacts/peer_suite] [--timeout 900] \\
        [--files test_fully_shard_training.py ...] [--pytest-args "-k MultiThread"] \\
        [--modes on off] [--pythonpath DIR] [--per-test-timeout 600]

Exit status 0 when no outcome differs between on and off, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

MODES = ("on", "off")
OUTCOMES = ("passed", "failed", "skipped")
VERBOSE_LINE = re.compile(
    r"^(?P<id>\S+::\S+)\s+(?P<word>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b"
)
WORD_TO_OUTCOME = {
    "PASSED": "passed",
    "XPASS": "passed",
    "FAILED": "failed",
    "ERROR": "failed",
    "SKIPPED": "skipped",
    "XFAIL": "skipped",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests-dir", type=Path, required=True)
    parser.add_argument("--python", required=True, help="interpreter with torch and the plugin")
    parser.add_argument("--out", type=Path, default=Path(".artifacts/peer_suite"))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per file and mode")
    parser.add_argument("--per-test-timeout", type=int, default=0,
                        help="pytest-timeout seconds per test (0: off; needs pytest-timeout)")
    parser.add_argument("--files", nargs="*", default=None, help="file names (default: all)")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. -k")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--pythonpath", default="", help="prepended to PYTHONPATH")
    return parser.parse_args(argv)


def test_files(tests_dir: Path, names: list[str] | None) -> list[Path]:
    if names:
        return [tests_dir / name for name in names]
    return sorted(tests_dir.glob("test_*.py"))


def mode_env(mode: str, pythonpath: str) -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    # The "on" run is the default an installed plugin gives: no variable at all.
    env.pop("FSDP_AUTOPATCH_ENABLED", None)
    if mode == "off":
        env["FSDP_AUTOPATCH_ENABLED"] = "0"
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    return env


def pytest_command(args: argparse.Namespace, path: Path, junit: Path) -> list[str]:
    command = [args.python, "-m", "pytest", str(path), "-p", "no:cacheprovider", "-v",
               "-rfE", f"--junitxml={junit}"]
    if args.per_test_timeout:
        command += ["-p", "pytest_timeout", f"--timeout={args.per_test_timeout}"]
    return command + shlex.split(args.pytest_args)


def run_bounded(command: list[str], env: dict[str, str], cwd: Path, log: Path,
                timeout: int) -> tuple[int | None, float]:
    """Run in a new session so a timeout kills the ranks FSDPTest spawned as well."""
    start = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
    return returncode, time.monotonic() - start


def outcomes_from_junit(junit: Path) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[test_id] = "failed"
        elif case.find("skipped") is not None:
            outcomes[test_id] = "skipped"
        else:
            outcomes[test_id] = "passed"
    return outcomes


def outcomes_from_log(log: Path) -> dict[str, str]:
    """pytest -v prints one line per finished test: what a killed run leaves behind."""
    outcomes: dict[str, str] = {}
    for line in log.read_text(errors="replace").splitlines():
        match = VERBOSE_LINE.match(line)
        if match:
            test_id = match["id"].split("/")[-1].replace(".py::", "::", 1)
            outcomes[test_id] = WORD_TO_OUTCOME[match["word"]]
    return outcomes


def normalize_ids(outcomes: dict[str, str]) -> dict[str, str]:
    """junit names a test ``module.Class::name``, -v ``file::Class::name``: keep ``Class::name``."""
    normalized = {}
    for test_id, outcome in outcomes.items():
        head, _, name = test_id.rpartition("::")
        normalized[f"{head.split('.')[-1].split('::')[-1]}::{name}"] = outcome
    return normalized


def run_file_mode(args: argparse.Namespace, path: Path, mode: str) -> dict:
    stem = f"{path.stem}.{mode}"
    junit, log = args.out / f"{stem}.xml", args.out / f"{stem}.log"
    junit.unlink(missing_ok=True)
    returncode, seconds = run_bounded(pytest_command(args, path, junit),
                                      mode_env(mode, args.pythonpath), path.parent, log,
                                      args.timeout)
    timed_out = returncode is None
    if junit.exists() and not timed_out:
        outcomes = outcomes_from_junit(junit)
    else:
        outcomes = outcomes_from_log(log)
    return {"returncode": returncode, "timed_out": timed_out, "seconds": round(seconds, 1),
            "outcomes": normalize_ids(outcomes)}


def counts(outcomes: dict[str, str]) -> dict[str, int]:
    return {name: sum(1 for o in outcomes.values() if o == name) for name in OUTCOMES}


def cell(run: dict | None) -> str:
    if run is None:
        return "not run"
    c = counts(run["outcomes"])
    text = f"{c['passed']} / {c['failed']} / {c['skipped']}"
    if run["timed_out"]:
        text += " (killed at timeout)"
    elif run["returncode"] not in (0, 1, 5) and not run["outcomes"]:
        text += f" (exit {run['returncode']}: collection error)"
    return text


def differences(results: dict[str, dict]) -> list[tuple[str, str, str]]:
    rows = []
    for name, runs in results.items():
        if "on" not in runs or "off" not in runs:
            continue
        on, off = runs["on"]["outcomes"], runs["off"]["outcomes"]
        for test_id in sorted(set(on) | set(off)):
            a, b = on.get(test_id, "not reached"), off.get(test_id, "not reached")
            if a != b:
                rows.append((f"{name}::{test_id}", a, b))
    return rows


def markdown(results: dict[str, dict]) -> str:
    lines = [
        "| file | plugin on: passed / failed / skipped | plugin off: passed / failed / skipped "
        "| seconds on / off |",
        "|---|---|---|---|",
    ]
    for name, runs in results.items():
        seconds = " / ".join(str(runs[m]["seconds"]) if m in runs else "-" for m in MODES)
        lines.append(f"| `{name}` | {cell(runs.get('on'))} | {cell(runs.get('off'))} "
                     f"| {seconds} |")
    diff_rows = differences(results)
    lines += ["", f"Outcomes that differ between on and off: {len(diff_rows)}"]
    if diff_rows:
        lines += ["", "| test | on | off |", "|---|---|---|"]
        lines += [f"| `{test}` | {a} | {b} |" for test, a, b in diff_rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.tests_dir = args.tests_dir.resolve()
    results: dict[str, dict] = {}
    for path in test_files(args.tests_dir, args.files):
        results[path.name] = {}
        for mode in args.modes:
            run = run_file_mode(args, path, mode)
            results[path.name][mode] = run
            print(f"{path.name} [{mode}] {cell(run)} in {run['seconds']} s", flush=True)
    (args.out / "peer_suite.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (args.out / "peer_suite.md").write_text(table)
    print()
    print(table, end="")
    return 1 if differences(results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
