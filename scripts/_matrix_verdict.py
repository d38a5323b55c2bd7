"""What counts as right for one release of the compatibility matrix (scripts/matrix.py).

On a release that ``tests/expected.py`` has measured (2.6 - 2.15), every patch's registry status
must be the expected one. On any other (torch 2.16 the day it is on PyPI, a later ``2.N``) there is
nothing to compare with: ``tests/expected.py`` answers "not measured: the structural check decides",
and the row is a *first measurement*, reported as measured, never judged against a guess. What is
wrong on every release still fails it: a patch ``failed`` or still ``pending`` after the FSDP2
import, a patch missing from the registry, the plugin not started by its ``.pth``, a probe that
cannot import FSDP2, a failed install, a failing test.

Pure functions of the runner's records (no subprocess, no torch), so that the unit tests can feed
them a recorded probe (tests/unit/test_matrix_unmeasured.py). Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import re

from _matrix_report import EXPECTED


def parse_release(text: str) -> str:
    """``--releases`` values: a torch minor release ``2.N`` (or one patch release, ``2.N.M``).

    Any ``2.N`` is accepted, measured or not: a release outside tests/expected.py is a first
    measurement, not an error.
    """
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch release such as 2.15 or 2.16 (2.N or 2.N.M)")
    return text


def default_releases() -> list[str]:
    """Every release tests/expected.py has measured, oldest first."""
    return [EXPECTED.release_text(release) for release in EXPECTED.MEASURED]


def is_first_measurement(version: str) -> bool:
    """Whether ``version`` (``"2.16"``, ``"2.16.0+cu130"``) lies outside tests/expected.py."""
    return not EXPECTED.is_measured(EXPECTED.release_of(version))


def requirement(release: str) -> str:
    """``2.16`` -> ``torch==2.16.*`` (the latest patch release); ``2.15.0`` -> ``torch==2.15.0``."""
    return f"torch=={release}.*" if release.count(".") == 1 else f"torch=={release}"


def parse_probe(stdout: str) -> dict:
    """The registry probe's JSON: its last non-empty line of output (anything torch printed
    before it is ignored). ``ValueError`` when there is none."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("the probe printed nothing")
    data = json.loads(lines[-1])
    if not isinstance(data, dict) or "torch" not in data or "report" not in data:
        raise ValueError(f"not a probe record: {lines[-1][:200]}")
    return data


def judge_registry(probe: dict) -> dict:
    """The registry row of one release, from the probe's record (``REGISTRY_PROBE`` in matrix.py).

    ``expected`` is tests/expected.py's status per patch on the installed torch's release, or
    ``NOT_MEASURED`` for every patch on a release it has not measured; ``mismatches`` compare with
    those (none on a first measurement); ``problems`` are what is wrong on any release; ``ok`` is
    neither.
    """
    release = EXPECTED.release_of(probe["torch"])
    first = not EXPECTED.is_measured(release)
    want = EXPECTED.expected_status(release)
    report = probe["report"]
    patches = {p["name"]: p for p in report["patches"]}
    mismatches = {
        name: {"expected": status, "got": patches.get(name, {}).get("status")}
        for name, status in want.items()
        if not first and patches.get(name, {}).get("status") != status
    }
    problems = []
    for name in EXPECTED.PATCHES:
        got = patches.get(name, {}).get("status")
        if got is None:
            problems.append(f"{name}: missing from the registry")
        elif got in EXPECTED.ALWAYS_WRONG:
            problems.append(f"{name}: {got} ({one_line(patches[name].get('reason') or '')[:300]})")
    if report.get("bootstrap") != "pth":
        problems.append(f"bootstrap {report.get('bootstrap')!r}, not 'pth': the wheel's .pth did not start the plugin")
    unsupported = sorted(name for name, p in patches.items() if p.get("status") == "unsupported")
    return {
        "ok": not mismatches and not problems,
        "first_measurement": first,
        "torch": probe["torch"], "python": probe.get("python"), "cuda": probe.get("cuda"),
        "gloo_avg": probe.get("gloo_avg"), "bootstrap": report.get("bootstrap"),
        "patches": {n: {k: p.get(k) for k in ("status", "reason", "decided_by")} for n, p in patches.items()},
        "expected": want, "mismatches": mismatches, "problems": problems, "unsupported": unsupported,
    }


def install_error(log_text: str) -> str:
    """pip's own words for a failed install: its last ``ERROR:`` line, and the newest version the
    index has where pip listed them (``No matching distribution found for torch==2.16.*; newest
    on the index: 2.15.0``); else the log's last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    if not errors:
        return lines[-1] if lines else "no output"
    words = errors[-1][len("ERROR:"):].strip()
    listed = re.search(r"\(from versions: ([^)]*)\)", " ".join(errors))
    if listed and listed.group(1).strip() and listed.group(1).strip() != "none":
        words += f"; newest on the index: {listed.group(1).split(',')[-1].strip()}"
    return words


def problems_of_tests(tests: dict) -> list[str]:
    """What is wrong with a release's test run (on any release, measured or not)."""
    problems = [f"test failed: {failure}" for failure in tests.get("failures", [])]
    if tests.get("exit") == -9:
        problems.append("the tests timed out")
    elif tests.get("exit") not in (0, None) and not problems:
        problems.append(f"pytest exited {tests['exit']}")
    return problems


def release_ok(result: dict) -> bool:
    """A release passes when it installed, its registry has neither a mismatch nor a problem,
    and its tests (where they ran) all passed."""
    if not result["install"]["ok"] or not result.get("registry", {}).get("ok"):
        return False
    tests = result.get("tests")
    return tests is None or (tests["exit"] == 0 and tests["failed"] == 0)


def summary(result: dict) -> str:
    """One line per release for the runner's log."""
    release = result["release"]
    if not result["install"]["ok"]:
        return f"{release}: FAILED: {result.get('error', 'the install failed')}"
    registry = result.get("registry", {})
    label = "first measurement" if result.get("first_measurement") else "measured"
    torch_version = registry.get("torch", release)
    if result["ok"]:
        extra = f"; unsupported: {', '.join(registry['unsupported'])}" if registry.get("unsupported") else ""
        verdict = "no problem (nothing to compare with tests/expected.py)" if result.get("first_measurement") else "OK"
        return f"{release}: torch {torch_version}, {label}: {verdict}{extra}"
    found = list(registry.get("problems", []))
    found += [f"{n}: {m['got']}, expected {m['expected']}" for n, m in registry.get("mismatches", {}).items()]
    if "error" in registry:
        found.append(registry["error"])
    found += problems_of_tests(result.get("tests") or {})
    return f"{release}: torch {torch_version}, {label}: PROBLEM: " + "; ".join(found[:5]) + (
        f" (+{len(found) - 5} more)" if len(found) > 5 else ""
    )


def one_line(text: str) -> str:
    return " ".join(text.split())
