#!/usr/bin/env python3
"""Cheap checks on every CPython here (3.9 - 3.13): no torch, a stand-in torch instead; ~1 min each.

For each interpreter (``scripts/_pythons.py`` finds pyenv's builds) this makes a small throwaway
venv and checks what a user of that interpreter hits first:

1. ``pip install`` of the wheel built from this checkout (every interpreter in ``PYTHONS`` is one
   that ``requires-python`` admits; for one it excludes, e.g. ``--python 3.8``, the check is that
   pip refuses the wheel, and that is the whole check for it).
2. ``pytest`` of the torch-free unit tests (bootstrap, fault injection, config, registry,
   activation, cross-rank check, the matrix runner on a release not measured yet) against the
   installed wheel; the few tests that need a real torch skip themselves.
3. Auto-activation from the installed wheel's ``.pth``: a program that only does
   ``import torch.distributed.fsdp`` (a stand-in torch package with the FSDP2 module the hook
   waits for and none of the internals) must find the plugin loaded by the ``.pth``, every patch
   ``unsupported`` ("torch internals differ"), and nothing on stdout/stderr.

Real torch on other interpreters: ``scripts/matrix.py --python 3.12``, and the install tests with
``FSDP_TEST_PYTHON`` / ``FSDP_TEST_TORCH`` (see docs/compatibility.md).

Usage (from the repository root; stdlib only)::

    python3 scripts/interpreters.py                 # every interpreter in _pythons.PYTHONS
    python3 scripts/interpreters.py --python 3.12   # one (a version or a path)

Ends with ``N passed, N failed`` (one per interpreter); exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import _wheel
from _matrix_report import EXPECTED  # tests/expected.py: the catalogue's names, in order
from _pythons import PYTHONS, python_version, resolve_python

ROOT = Path(__file__).resolve().parent.parent
UNIT_TESTS = (
    "tests/unit/test_bootstrap.py",
    "tests/unit/test_fault_injection.py",
    "tests/unit/test_own_module_faults.py",
    "tests/unit/test_config.py",
    "tests/unit/test_registry.py",
    "tests/unit/test_activate.py",
    "tests/unit/test_consistency.py",
    "tests/unit/test_matrix_unmeasured.py",
    "tests/unit/test_cases.py",
)
TOOLS = ("pytest>=7", "pytest-timeout>=2")
STAND_IN_TORCH = {
    "torch/__init__.py": "__version__ = '2.13.0+stand.in'\n",
    "torch/distributed/__init__.py": "",
    "torch/distributed/fsdp/__init__.py": "from . import _fully_shard\n",
    "torch/distributed/fsdp/_fully_shard/__init__.py": "",
}
# a user program: it never imports the plugin, the .pth must have armed it
ACTIVATION_PROBE = textwrap.dedent("""
    import json, sys
    import torch.distributed.fsdp
    plugin = sys.modules.get("fsdp_autopatch")
    report = plugin.status().to_dict() if plugin is not None else None
    sys.stdout.write(json.dumps({"loaded": plugin is not None, "report": report}))
""")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTHONWARNINGS")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_AUTOPATCH_") and k not in drop}
    env.update(
        CUDA_VISIBLE_DEVICES="", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONDONTWRITEBYTECODE="1"
    )
    env.update(extra or {})
    return env


def run(cmd, *, timeout: float, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
        env=env or child_env(), cwd=cwd, stdin=subprocess.DEVNULL,
    )


def tail(result: subprocess.CompletedProcess, lines: int = 15) -> str:
    return "\n".join((result.stdout + result.stderr).strip().splitlines()[-lines:])


def build_wheel(dest: Path) -> Path:
    try:
        return _wheel.build_wheel(dest, timeout=600, env=child_env())
    except _wheel.WheelBuildFailed as error:
        sys.exit(f"wheel build failed:\n{error}")


def requires_python() -> str:
    match = re.search(r'^requires-python\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    return match.group(1) if match else ""


def admitted(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies a ``>=X.Y`` requires-python (the only form this project uses)."""
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip())
    if not match:
        return True
    return tuple(int(p) for p in version.split(".")[:2]) >= (int(match.group(1)), int(match.group(2)))


def check_refused(venv_python: Path, wheel: Path) -> tuple[bool, str]:
    result = run([venv_python, "-m", "pip", "install", "-q", wheel], timeout=600)
    refused = result.returncode != 0 and "requires a different python" in (result.stdout + result.stderr).lower()
    return refused, "pip refuses the wheel (requires-python)" if refused else f"pip did not refuse it:\n{tail(result)}"


def check_unit_tests(venv_python: Path, scratch: Path) -> tuple[bool, str]:
    tests = [t for t in UNIT_TESTS if (ROOT / t).exists()]
    result = run(
        [venv_python, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--timeout=300",
         "--basetemp", scratch / "pytest"],
        timeout=1200, cwd=ROOT,
    )
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    return result.returncode == 0, summary if result.returncode == 0 else tail(result, 40)


def check_activation(venv_python: Path, scratch: Path) -> tuple[bool, str]:
    stand_in = scratch / "stand-in-torch"
    for relative, text in STAND_IN_TORCH.items():
        path = stand_in / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = child_env({"PYTHONPATH": str(stand_in)})
    result = run([venv_python, "-c", ACTIVATION_PROBE], timeout=120, env=env, cwd=scratch)
    if result.returncode != 0 or result.stderr:
        return False, f"exit {result.returncode}, stderr:\n{result.stderr.strip()}"
    data = json.loads(result.stdout)
    report = data["report"] or {}
    patches = report.get("patches", [])
    ok = (
        data["loaded"] and report.get("bootstrap") == "pth" and report.get("torch") == "2.13.0+stand.in"
        and [p["name"] for p in patches] == list(EXPECTED.PATCHES)
        and all(p["status"] == "unsupported" and "torch internals differ" in p["reason"] for p in patches)
    )
    found = f"loaded={data['loaded']}, bootstrap={report.get('bootstrap')}, " + ", ".join(
        f"{p['name']}={p['status']}" for p in patches
    )
    summary = f"auto-activated by the .pth, {len(patches)} patches unsupported, silent"
    return ok, (summary if ok else f"unexpected: {found}")


def check_interpreter(spec: str, wheel: Path, work: Path) -> dict:
    started = time.monotonic()
    result = {"python": spec, "ok": False, "steps": []}
    try:
        exe = resolve_python(spec)
        version = python_version(exe)
    except (ValueError, OSError, subprocess.SubprocessError) as exc:
        result["steps"].append(("find", False, str(exc)))
        return {**result, "seconds": round(time.monotonic() - started)}
    result["python"] = version
    scratch = work / f"py{version}"
    venv_python = scratch / "venv" / "bin" / "python"
    made = run([exe, "-m", "venv", scratch / "venv"], timeout=300)
    if made.returncode != 0:
        result["steps"].append(("venv", False, tail(made)))
        return {**result, "seconds": round(time.monotonic() - started)}
    if not admitted(version, requires_python()):
        ok, detail = check_refused(venv_python, wheel)
        result["steps"].append((f"refused ({requires_python()})", ok, detail))
        return {**result, "ok": ok, "seconds": round(time.monotonic() - started)}
    installed = run([venv_python, "-m", "pip", "install", "-q", wheel, *TOOLS], timeout=900)
    installed_ok = installed.returncode == 0
    result["steps"].append(("install", installed_ok, "wheel + pytest" if installed_ok else tail(installed)))
    if installed_ok:
        for name, check in (("unit tests", check_unit_tests), ("auto-activation", check_activation)):
            step_started = time.monotonic()
            ok, detail = check(venv_python, scratch)
            result["steps"].append((f"{name} ({time.monotonic() - step_started:.0f} s)", ok, detail))
    result["ok"] = all(ok for _, ok, _ in result["steps"])
    return {**result, "seconds": round(time.monotonic() - started)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python", nargs="+", default=list(PYTHONS), help="versions (3.12) or paths (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="fsdp-interpreters-") as tmp:
        work = Path(tmp)
        wheel = build_wheel(work / "wheel")
        for spec in args.python:
            result = check_interpreter(spec, wheel, work)
            results.append(result)
            verdict = "ok" if result["ok"] else "FAILED"
            print(f"== Python {result['python']}: {verdict} ({result['seconds']} s)", flush=True)
            for name, ok, detail in result["steps"]:
                print(f"   {'ok ' if ok else 'BAD'} {name}: {detail}", flush=True)
    passed = sum(r["ok"] for r in results)
    print(f"interpreters: {passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
