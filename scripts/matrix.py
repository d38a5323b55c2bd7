#!/usr/bin/env python3
"""The torch compatibility matrix: every measured release (2.6 - 2.15) or any other, each in a throwaway venv.

For each release (latest patch, ``torch==2.N.*``) this creates a venv, installs that torch and
the wheel built from this checkout (not an editable install), and runs:

1. the registry check: ``import torch.distributed.fsdp`` in a fresh interpreter, then each
   patch's status and reason from ``fsdp_autopatch.status()``, compared with ``tests/expected.py``;
2. ``pytest tests/unit tests/distributed``: every 2-rank gloo scenario with the plugin active
   (values checked against single-process references) and with each patch disabled (the bug
   must reproduce exactly on the releases that ``tests/expected.py`` says have it); the tests
   record what they saw in a JSON-lines file that becomes the "without / with plugin" cells.

torch 2.6 and 2.7 cannot run FSDP2 on gloo (no ``ReduceOp.AVG``): for them only step 1 runs,
so the patches' structural checks are evaluated against the real torch modules.

A release that ``tests/expected.py`` has not measured (``--releases 2.16`` the day torch 2.16 is on
PyPI, or any later ``2.N``) runs the same steps as a *first measurement*: there are no
expectations to compare with (the plugin's structural checks decide alone on such a torch), so the
report shows what was measured, marked as the first measurement, and the run fails only on what is
wrong on every release: a patch ``failed`` or ``pending``, the ``.pth`` not starting the plugin,
a broken FSDP2 import, a failed install, a failing test (scripts/_matrix_verdict.py).

The venv is deleted after each release (a CUDA build of torch is several GB); the next
release's venv is installed while the current one is tested, so at most two exist at once.

Usage (from the repository root; stdlib only, any Python >= 3.9 with venv and pip)::

    python3 scripts/matrix.py                        # all measured releases, results in .artifacts/matrix
    python3 scripts/matrix.py --releases 2.12 2.15   # a subset
    python3 scripts/matrix.py --releases 2.16        # a release not measured yet: a first measurement
    python3 scripts/matrix.py --update-docs          # also rewrite the table in docs/compatibility.md
    python3 scripts/matrix.py --python 3.12 --releases 2.13   # venvs from another interpreter

``--python`` takes a version (resolved to pyenv's build, see scripts/_pythons.py) or a path; the
interpreter's version is recorded in each row. ``--report-only RUNS... --python-docs`` writes the
"Python versions" table (one row per interpreter and torch) into docs/compatibility.md.

Exit status 0 when every release matches its expectations (a first measurement: has no problem),
1 otherwise, a release that does not install included (pip's error is printed). Pip here caps torch
at 2.14.1 (``/etc/xdg/pip/constraints.txt``); the installs set ``PIP_CONSTRAINT=/dev/null`` to lift it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import _case_needs as case_needs
import _matrix_verdict as verdict
import _wheel
from _matrix_report import EXPECTED, docs_refusal, log, markdown, python_markdown, report_only, update_docs
from _pythons import python_version, resolve_python

ROOT = Path(__file__).resolve().parent.parent
RELEASES = tuple(verdict.default_releases())  # the default: every release tests/expected.py has measured
# expecttest: torch.testing._internal needs it; then every package a case's NEEDS names, as pyproject's
# examples extra pins it (peft and transformers: peft_generate_forward_method's case and variants)
TEST_PACKAGES = ("pytest>=7", "pytest-timeout>=2", "numpy", "expecttest", *case_needs.requirements())
INSTALL_TIMEOUT = 45 * 60
REGISTRY_TIMEOUT = 10 * 60
TESTS_TIMEOUT = 60 * 60

REGISTRY_PROBE = r"""
import json, platform
import torch
import torch.distributed as dist
import torch.distributed.fsdp  # the import that activates the plugin
import torch.distributed.checkpoint.state_dict  # and the one dcp_optimizer_state_init waits for
import fsdp_autopatch
print(json.dumps({
    "torch": torch.__version__,
    "python": platform.python_version(),
    "cuda": torch.version.cuda,
    "gloo_avg": hasattr(dist.ReduceOp, "AVG") and dist.is_gloo_available(),
    "plugin": fsdp_autopatch.__version__,
    "report": fsdp_autopatch.status().to_dict(),
}))
"""


def run(cmd, *, log_file: Path, timeout: float, cwd: Path | None = None, env=None) -> int:
    """Run ``cmd`` with its output appended to ``log_file``; the exit status, or -9 on timeout."""
    with open(log_file, "a") as out:
        out.write(f"$ {' '.join(map(str, cmd))}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the whole session: pytest and its rank processes
            proc.wait()
            out.write(f"\n*** timed out after {timeout:.0f} s\n")
            return -9


def tree_size_mb(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return round(total / 2**20)


def build_wheel(dest: Path, log_file: Path) -> Path:
    log("building the wheel")
    try:
        return _wheel.build_wheel(dest, timeout=600, log_file=log_file)
    except _wheel.WheelBuildFailed:
        sys.exit(f"wheel build failed, see {log_file}")


def pip_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PIP_CONSTRAINT="/dev/null", PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def test_env(record: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_AUTOPATCH_")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1")
    if record is not None:
        env["FSDP_MATRIX_RECORD"] = str(record)
    return env


def install(release: str, venv: Path, wheel: Path, logs: Path, python: str) -> dict:
    """Create ``venv`` with torch ``release`` (latest patch), the wheel and the test tools."""
    started = time.monotonic()
    log_file = logs / f"{release}-install.log"
    log_file.unlink(missing_ok=True)  # this run's words only: a failed install is reported from it
    shutil.rmtree(venv, ignore_errors=True)
    code = run([python, "-m", "venv", venv], log_file=log_file, timeout=300)
    if code == 0:
        pip = [venv / "bin" / "python", "-m", "pip", "install", "-q"]
        packages = [verdict.requirement(release), wheel, *TEST_PACKAGES]
        code = run([*pip, *packages], log_file=log_file, timeout=INSTALL_TIMEOUT, env=pip_env())
    venv_mb = tree_size_mb(venv) if venv.exists() else 0
    return {"ok": code == 0, "seconds": round(time.monotonic() - started), "venv_mb": venv_mb}


def check_registry(release: str, venv: Path, logs: Path, scratch: Path) -> dict:
    log_file = logs / f"{release}-registry.log"
    out_file = scratch / f"{release}-registry.json"
    started = time.monotonic()
    result = {"seconds": 0, "ok": False, "first_measurement": verdict.is_first_measurement(release), "problems": []}
    try:
        with open(out_file, "w") as out:
            proc = subprocess.run(
                [venv / "bin" / "python", "-c", REGISTRY_PROBE], cwd=scratch, env=test_env(),
                stdout=out, stderr=subprocess.PIPE, text=True, timeout=REGISTRY_TIMEOUT,
            )
    except subprocess.TimeoutExpired:
        result.update(seconds=round(time.monotonic() - started), error=f"probe timed out after {REGISTRY_TIMEOUT} s")
        return result
    log_file.write_text(proc.stderr)
    result["seconds"] = round(time.monotonic() - started)
    if proc.returncode != 0:
        # an import broken (torch's, FSDP2's or ours): wrong on any release
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        result["error"] = f"probe exited {proc.returncode}: {last}"
        return result
    try:
        probe = verdict.parse_probe(out_file.read_text())
    except ValueError as exc:
        result["error"] = f"probe output unreadable: {exc}"
        return result
    result.update(verdict.judge_registry(probe))
    return result


def junit_summary(path: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    if not path.exists():
        return {**counts, "failures": ["no junit report (pytest did not finish)"]}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            counts["failed"] += 1
            first_line = problem.get("message").splitlines()[0][:300] if problem.get("message") else ""
            failures.append(f"{test_id}: {first_line}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def run_tests(release: str, venv: Path, logs: Path, scratch: Path) -> dict:
    record = scratch / f"{release}-observations.jsonl"
    junit = scratch / f"{release}-junit.xml"
    record.unlink(missing_ok=True)
    started = time.monotonic()
    code = run(
        # the torchrun launcher tests are left to CI: ~2 minutes each release, no release-specific code
        [venv / "bin" / "python", "-m", "pytest", "tests/unit", "tests/distributed", "-m", "not launcher",
         "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "-o", "junit_logging=no"],
        cwd=ROOT, env=test_env(record), log_file=logs / f"{release}-tests.log", timeout=TESTS_TIMEOUT,
    )
    observations = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return {
        "exit": code, "seconds": round(time.monotonic() - started),
        **junit_summary(junit), "observations": observations,
    }


def bug_cells(observations: list[dict]) -> dict:
    """``{bug: {"off": ..., "on": ..., "expected_off": ...}}`` from the tests' records."""
    cells: dict[str, dict] = {}
    for obs in observations:
        cell = cells.setdefault(obs["bug"], {})
        key = obs["plugin"]
        # one bug can be observed by several scenarios: keep them all, in order
        cell.setdefault(key, [])
        if obs["outcome"] not in cell[key]:
            cell[key].append(obs["outcome"])
        if "expected" in obs:
            cell[f"expected_{key}"] = obs["expected"]
    return cells


def test_release(release: str, venv: Path, installed: dict, logs: Path, scratch: Path, runnable: bool) -> dict:
    result = {"release": release, "mode": "full" if runnable else "structural checks only", "install": installed}
    result["first_measurement"] = verdict.is_first_measurement(release)
    if not installed["ok"]:
        install_log = logs / f"{release}-install.log"
        words = verdict.install_error(install_log.read_text()) if install_log.exists() else "no install log"
        result["ok"] = False
        result["error"] = f"{verdict.requirement(release)} did not install: {words} (log: {install_log})"
        return result
    log(f"{release}: registry check" + (" (first measurement: not in tests/expected.py)"
                                         if result["first_measurement"] else ""))
    result["registry"] = check_registry(release, venv, logs, scratch)
    if runnable:
        log(f"{release}: unit + 2-rank distributed tests")
        tests = run_tests(release, venv, logs, scratch)
        tests["bugs"] = bug_cells(tests.pop("observations"))
        result["tests"] = tests
    result["ok"] = verdict.release_ok(result)
    return result


def git_commit() -> str:
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return found.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--releases", nargs="+", type=verdict.parse_release, default=list(RELEASES), metavar="2.N",
        help="torch minor releases, measured or not (default: every measured one, "
        f"{RELEASES[0]} - {RELEASES[-1]}; a later 2.N is a first measurement)",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / ".artifacts" / "matrix", help="results and logs (default: .artifacts/matrix)"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where the throwaway venvs go (default: a temporary directory)"
    )
    parser.add_argument(
        "--python", default=sys.executable,
        help="the interpreter the venvs are made from: a version (3.12: pyenv's build) or a path (default: this one)",
    )
    parser.add_argument("--keep-venvs", action="store_true", help="do not delete each venv after its release")
    parser.add_argument(
        "--update-docs", action="store_true", help="rewrite the measured table in docs/compatibility.md"
    )
    parser.add_argument(
        "--report-only", nargs="+", type=Path, metavar="MATRIX_JSON",
        help="run nothing: merge earlier matrix.json files (a later file's release replaces an earlier one's) "
        "and write the table, e.g. after re-running one release",
    )
    parser.add_argument(
        "--python-docs", action="store_true", help="with --report-only: rewrite the Python versions table"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        return report_only(args.report_only, args.out, args.update_docs, args.python_docs)
    try:
        python = resolve_python(args.python)
        version = python_version(python)
    except (ValueError, OSError, subprocess.SubprocessError) as exc:
        sys.exit(f"--python {args.python}: {exc}")
    log(f"venvs from Python {version} ({python})")

    started = time.monotonic()
    out, logs = args.out, args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fsdp-matrix-"))
    workdir.mkdir(parents=True, exist_ok=True)
    scratch = out / "raw"
    scratch.mkdir(exist_ok=True)
    commit = git_commit()  # what the wheel is built from: later commits during the run do not count
    wheel = build_wheel(workdir / "wheel", logs / "wheel.log")
    # once each: the next release's venv is installed while the previous one is tested
    releases = list(dict.fromkeys(args.releases))
    results: list[dict] = []

    def prepare(release: str):
        log(f"{release}: installing {verdict.requirement(release)} into a fresh venv")
        venv = workdir / f"venv-{release}"
        try:
            return venv, install(release, venv, wheel, logs, python)
        except OSError as exc:  # no disk space, a vanished interpreter: this release did not install
            with open(logs / f"{release}-install.log", "a") as out:
                out.write(f"ERROR: {type(exc).__name__}: {exc}\n")
            return venv, {"ok": False, "seconds": 0, "venv_mb": 0}

    # install release i+1 while release i is tested: pip is network/disk bound, the tests CPU bound
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(prepare, releases[0])
        for i, release in enumerate(releases):
            venv, installed = pending.result()
            if i + 1 < len(releases):
                pending = pool.submit(prepare, releases[i + 1])
            runnable = EXPECTED.release_of(release) >= EXPECTED.OLDEST_RUNNABLE
            result = {"python": version, **test_release(release, venv, installed, logs, scratch, runnable)}
            results.append(result)
            log(f"{verdict.summary(result)} (venv {installed['venv_mb']} MB)")
            if not args.keep_venvs:
                shutil.rmtree(venv, ignore_errors=True)
            (out / "matrix.json").write_text(json.dumps({"results": results}, indent=2))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)

    meta = {
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()} Linux, {os.cpu_count()} CPUs, no GPU",
        "plugin": wheel.name.split("-")[1],
        "commit": commit,
        "python": version,
        "wall_minutes": round((time.monotonic() - started) / 60, 1),
        "max_venv_mb": max((r["install"]["venv_mb"] for r in results), default=0),
    }
    for result in results:
        result["measured"] = f"{meta['date']}, commit {meta['commit']}"
    run = {"meta": meta, "results": results}
    (out / "matrix.json").write_text(json.dumps(run, indent=2))
    table = markdown(results, meta)
    (out / "matrix.md").write_text(table)
    (out / "python.md").write_text(python_markdown(results))
    if args.update_docs:
        refusal = docs_refusal(results)
        if refusal:
            log(f"docs/compatibility.md left as it is: {refusal}")
        else:
            update_docs(table, source=run)
    log(f"results: {out / 'matrix.json'}, {out / 'matrix.md'}; {meta['wall_minutes']} min")
    first = [r["release"] for r in results if r.get("first_measurement") and r["ok"]]
    if first:
        log("first measurements (no expectations in tests/expected.py; review the rows, then add them there): "
            + ", ".join(first))
    bad = [r["release"] for r in results if not r["ok"]]
    if bad:
        log("releases with a problem (see above and matrix.md): " + ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
