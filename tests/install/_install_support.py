"""Helpers for the install tests: fresh venvs, bounded subprocesses, and the probe programs.

Every check runs in a child interpreter of a fresh venv (``python -m venv``) into which the real
wheel (or an editable install) was put with that venv's own pip. The programs those children run
never import ``fsdp_autopatch`` to activate it: they import torch's FSDP2 like any training script
and read the registry from ``sys.modules``, where the ``.pth`` file must already have put it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
for _folder in ("tests", "scripts"):  # tests/expected.py (the per-release expectations), scripts/_wheel.py
    if str(REPO / _folder) not in sys.path:
        sys.path.insert(0, str(REPO / _folder))
import _wheel  # noqa: E402
import expected as ex  # noqa: E402
from _wrap_points import DEPTH, applied_entries, expected_wrappers, wrap_points  # noqa: E402,F401 (re-exported)

# Which interpreter the venvs are made from and which torch goes into them. By default the test
# runner's own interpreter and torch 2.13.0 (on this machine pip takes it from local disk, cp311
# only); e.g. FSDP_TEST_PYTHON=$(pyenv root)/versions/3.9.18/bin/python3 FSDP_TEST_TORCH='torch==2.8.0'
# takes torch 2.8.0 from PyPI. Not FSDP_AUTOPATCH_*: the plugin warns about unknown variables with
# its prefix.
TEST_PYTHON = os.environ.get("FSDP_TEST_PYTHON", "").strip()
TORCH_REQUIREMENT = os.environ.get("FSDP_TEST_TORCH", "").strip() or "torch==2.13.0"


def _pinned_version(requirement: str) -> str:
    """``torch==2.8.0`` -> ``2.8.0``, ``torch==2.8.*`` -> ``2.8.``: the expectations below are one
    release's, so the requirement must name it (the torch_venv fixture checks what pip installed)."""
    match = re.fullmatch(r"torch\s*==\s*(\d+\.\d+)(\.\d+|\.\*)?", requirement)
    if match is None:
        raise RuntimeError(
            f"FSDP_TEST_TORCH={requirement!r}: pin a release (torch==2.8.0 or torch==2.8.*); "
            "the install tests expect that release's statuses (tests/expected.py)"
        )
    return match.group(1) + (match.group(2) or ".").rstrip("*")


# ``report["torch"].startswith(TORCH_VERSION)`` for the torch in the test venvs
TORCH_VERSION = _pinned_version(TORCH_REQUIREMENT)
TORCH_RELEASE = ex.release_of(TORCH_VERSION + "0" if TORCH_VERSION.endswith(".") else TORCH_VERSION)
# torch >= 2.13 has FSDPModule.set_reduce_scatter_unused_params; before it only our backport does
NATIVE_UNUSED_PARAM_API = ex.has_native_unused_param_api(TORCH_RELEASE)

PATCH_NAMES = ex.PATCHES


# The probes import torch.distributed.fsdp only: an entry that waits for another module (DCP's
# state_dict, ``Entry.waits_for``) is still pending there (tests/unit/test_activate.py: the wait).
WAITING = {name: "pending" for name in PATCH_NAMES if ex.WAITS_FOR.get(name)}


def statuses_with(**changes: str) -> dict[str, str]:
    """The registry statuses on this torch with nothing switched off (tests/expected.py), then
    ``changes``. Before 2.13 the backported setter is the only unused-param fill, so without it
    applied restore_unused_param_grads has nothing to undo (``not_needed``) unless told otherwise."""
    result = {**ex.expected_status(TORCH_RELEASE), **WAITING, **changes}
    fill_missing = not NATIVE_UNUSED_PARAM_API and result["unused_param_reduction"] != "applied"
    restore_applied = result["restore_unused_param_grads"] == "applied"
    if fill_missing and "restore_unused_param_grads" not in changes and restore_applied:
        result["restore_unused_param_grads"] = "not_needed"
    return result


# What the contract promises on this torch with nothing switched off.
DEFAULT_STATUSES = statuses_with()
# What `fsdp-autopatch status` / `doctor` report: they import the waited-for modules too, as a
# checkpointing run does, so those entries are decided there.
CLI_STATUSES = {**DEFAULT_STATUSES, **{name: ex.expected_status(TORCH_RELEASE)[name] for name in WAITING}}

# Timeouts (seconds). Generous: other jobs share the 2 cores, and a first `import torch` in a
# fresh venv also compiles torch's .pyc files.
T_PY = 60  # an interpreter that does not import torch
T_TORCH = 240  # an interpreter that imports torch.distributed.fsdp
T_VENV = 300  # python -m venv (runs ensurepip)
T_PIP = 600  # pip install of small packages, editable builds
T_PIP_TORCH = 1200  # pip install torch (a ~200 MB wheel from local disk; ~1 min for 4.7 GB from PyPI)
T_BUILD = 600  # python -m build --wheel (isolated build env with hatchling), pip wheel if that fails

# Variables of the test runner's own environment that must not leak into the children.
_DROP = {
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONWARNINGS",
    "PYTHONINSPECT",
    "PYTHONVERBOSE",
    "PYTHONDEVMODE",
    "PYTHONSAFEPATH",
    "PYTHONUSERBASE",
    "PYTHONEXECUTABLE",
    "PYTHONNOUSERSITE",
    "__PYVENV_LAUNCHER__",
    "VIRTUAL_ENV",
    # Let the children write .pyc files: torch is installed with --no-compile (compiling all of
    # torch costs minutes), so the first import compiles what FSDP2 needs once and later imports
    # take seconds instead of ~10 s each.
    "PYTHONDONTWRITEBYTECODE",
}


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The runner's environment without any ``FSDP_AUTOPATCH_*`` or interpreter-steering variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_AUTOPATCH_") and k not in _DROP}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PIP_NO_INPUT"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra or {})
    return env


def run(
    cmd: Sequence[object],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: object = None,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(cmd, env=..., capture_output=True, text=True, timeout=...)``, plus: the
    child gets its own process group, and a timeout (or an interrupted test) kills the whole group
    (pip's build backends included) so that nothing is left behind; a timeout is a test failure
    that shows whatever output there was."""
    argv = [str(c) for c in cmd]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=dict(env) if env is not None else clean_env(),
        cwd=None if cwd is None else str(cwd),
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"timed out after {timeout} s: {argv}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
            pytrace=False,
        )
    except BaseException:  # pytest-timeout, Ctrl-C: leave no process behind
        _kill_group(process)
        process.communicate()
        raise
    result = subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        pytest.fail(f"exit {result.returncode}: {argv}\n{describe(result)}", pytrace=False)
    return result


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def describe(result: subprocess.CompletedProcess) -> str:
    return f"--- exit {result.returncode} ---\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


def base_python() -> str:
    """``FSDP_TEST_PYTHON`` (a path or a command), else the interpreter behind the test run's venv
    (python -m venv from a venv nests oddly)."""
    if TEST_PYTHON:
        found = shutil.which(TEST_PYTHON)
        if found is None:
            pytest.fail(f"FSDP_TEST_PYTHON={TEST_PYTHON!r}: no such interpreter", pytrace=False)
        return found
    return getattr(sys, "_base_executable", None) or sys.executable


class Venv:
    """A fresh virtual environment and how to run things in it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.python = self.path / "bin" / "python"
        # How fsdp-autopatch went in (a wheel path, or "-e", dir), so that a test that uninstalls it
        # can have it put back for the tests after it.
        self.plugin_args: tuple[str, ...] = ()
        self.installed = False

    @classmethod
    def create(cls, path: Path) -> Venv:
        run([base_python(), "-m", "venv", path], timeout=T_VENV, check=True)
        return cls(path)

    @classmethod
    def linked_to(cls, source: Venv, path: Path, leave_out: Callable[[str], bool]) -> Venv:
        """A fresh venv whose site-packages links every entry of ``source``'s (pip and torch
        included) except those ``leave_out(name)`` is true for: another environment with the same
        torch in about a second, instead of a second torch install (~1 GB, 20 s or more here).
        Its own pip installs go into its own site-packages; never modify a linked entry."""
        run([base_python(), "-m", "venv", "--without-pip", path], timeout=T_PY, check=True)
        venv = cls(path)
        for entry in source.site_packages.iterdir():
            if not leave_out(entry.name):
                (venv.site_packages / entry.name).symlink_to(entry)
        return venv

    @property
    def site_packages(self) -> Path:
        (found,) = sorted((self.path / "lib").glob("python3*/site-packages"))
        return found

    def bin(self, name: str) -> Path:
        return self.path / "bin" / name

    def pip(self, *args: object, timeout: float = T_PIP) -> subprocess.CompletedProcess:
        return run([self.python, "-m", "pip", *args], timeout=timeout, check=True)

    def install_plugin(self, *plugin_args: object, also: Sequence[str] = (), timeout: float = T_PIP) -> None:
        """``pip install -q [also...] <plugin_args>``, e.g. ``also=("--no-compile", "torch==2.13.0")``."""
        self.plugin_args = tuple(str(a) for a in plugin_args)
        self.pip("install", "-q", *also, *self.plugin_args, timeout=timeout)
        self.installed = True

    def ensure_installed(self) -> None:
        """Put fsdp-autopatch back (its dependencies are still there) after an uninstall test."""
        if not self.installed:
            self.pip("install", "-q", "--no-deps", *self.plugin_args)
            self.installed = True

    def py(
        self,
        code: str,
        *,
        flags: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float = T_PY,
    ) -> subprocess.CompletedProcess:
        """``<venv>/bin/python [flags] -c code`` with a clean environment plus ``env``."""
        return run([self.python, *flags, "-c", textwrap.dedent(code)], env=clean_env(env), timeout=timeout)

    def fsdp_autopatch_files(self) -> list[str]:
        """Everything in site-packages and bin/ whose name mentions the package."""
        names = [p.name for p in self.site_packages.iterdir() if "fsdp_autopatch" in p.name.lower()]
        names += [f"bin/{p.name}" for p in (self.path / "bin").iterdir() if "fsdp" in p.name.lower()]
        return sorted(names)


def build_wheel(project: Path, out: Path) -> Path:
    """``project``'s wheel, built the way a release is built (isolated build env), into ``out``
    (``scripts/_wheel.py``, the builder the scripts share; its failure is the test's)."""
    try:
        return _wheel.build_wheel(out, project=project, timeout=T_BUILD, env=clean_env())
    except _wheel.WheelBuildFailed as error:
        pytest.fail(str(error), pytrace=False)


def json_from(result: subprocess.CompletedProcess) -> object:
    """The last stdout line as JSON (torch may print above it)."""
    assert result.returncode == 0, describe(result)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines, describe(result)
    return json.loads(lines[-1])


# --- the probe: a user program that imports torch's FSDP2 and nothing else of ours --------------

PROBE = r'''
import json, sys
{pre}
import torch.distributed.fsdp
# The probe never imports the plugin: the .pth loaded it at start-up (or nothing did).
plugin = sys.modules.get("fsdp_autopatch")
wrapt_loaded = "wrapt" in sys.modules  # only the plugin's hook imports wrapt
import importlib
def attribute(module, owner, name):
    found = importlib.import_module(module)
    if owner is None:
        return vars(found)[name]
    for part in owner.split("."):
        found = getattr(found, part)
    return next(vars(klass)[name] for klass in found.__mro__ if name in vars(klass))
points = {{name: attribute(*where) for name, where in {wrap_points}.items()}}
# "patched" counts our wrappers only (wrapt's, and our plain replacements: see _wrap_points.DEPTH)
import wrapt
{depth}
guard = points["FSDPParam.to_accumulated_grad_if_needed"]
print(json.dumps({{
    "loaded": plugin is not None,
    "file": getattr(plugin, "__file__", None),
    "wrapt_loaded": wrapt_loaded,
    "status": plugin.status().to_dict() if plugin is not None else None,
    "patched": {{name: _depth(obj) for name, obj in points.items()}},
    "guard_has___wrapped__": hasattr(guard, "__wrapped__"),
}}))
'''


def probe_code(pre: str = "") -> str:
    """The probe program; ``pre`` runs before torch is imported (what a launcher might do)."""
    return PROBE.format(pre=textwrap.dedent(pre), wrap_points=repr(wrap_points()), depth=DEPTH)


def statuses(report: Mapping) -> dict[str, str]:
    return {p["name"]: p["status"] for p in report["patches"]}


def reasons(report: Mapping) -> dict[str, str]:
    return {p["name"]: p["reason"] for p in report["patches"]}


def assert_torch_matches_registry(probe: Mapping) -> None:
    """Each torch attribute carries one wrapper per applied patch that wraps it, and no other."""
    status = applied_entries(probe["status"])
    assert probe["patched"] == expected_wrappers(status), (status, probe["patched"])


def config_warnings(stderr: str) -> list[str]:
    """fsdp-autopatch's configuration warnings in a child's stderr, one line each (whatever the
    exact layout: ``warnings`` output, or the plain line written when a filter made it raise)."""
    return [line for line in stderr.splitlines() if "ConfigWarning" in line and "fsdp-autopatch" in line]
