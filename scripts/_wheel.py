"""Build this checkout's wheel (or another project's): the one builder the tests, scripts and
benchmarks share. Standard library only.

``python -m build --wheel`` (an isolated build env, the way a release is built) where that works,
else ``pip wheel --no-deps``. The attempts share one time budget; each child runs in its own
session, and on the timeout its whole process group (the build backend's too) is killed. Every
command and its output is appended to ``log_file`` when one is given. Import it with the
repository's ``scripts/`` directory on ``sys.path`` (``import _wheel``).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600.0


class WheelBuildFailed(RuntimeError):
    """No attempt left a wheel; the message has each command, its exit status and its output's end."""


class Built(NamedTuple):
    wheel: Path
    how: str  # e.g. "-m build --wheel (8.4 s)"


def attempts(out_dir: Path, project: Path, python: str) -> list[list[str]]:
    """The commands to try, in order (``build`` only where this interpreter may have it)."""
    commands = []
    if str(python) != sys.executable or importlib.util.find_spec("build") is not None:
        commands.append([str(python), "-m", "build", "--wheel", "--outdir", str(out_dir), str(project)])
    commands.append([str(python), "-m", "pip", "wheel", "--no-deps", "-q", "--wheel-dir", str(out_dir), str(project)])
    return commands


def build(
    out_dir: Path,
    *,
    project: Path = ROOT,
    python: str = sys.executable,
    timeout: float = TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    log_file: Path | None = None,
    pattern: str | None = None,
    fresh: bool = False,
) -> Built:
    """Build ``project``'s wheel into ``out_dir`` (emptied first if ``fresh``) within ``timeout``
    seconds in all; the newest-named match of ``pattern`` (``fsdp_autopatch-*.whl`` for this
    checkout, any ``*.whl`` for another project). Raises :class:`WheelBuildFailed`."""
    out_dir, project = Path(out_dir), Path(project)
    if fresh and out_dir.exists():
        for old in out_dir.iterdir():
            if old.is_file():
                old.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    pattern = pattern or ("fsdp_autopatch-*.whl" if project.resolve() == ROOT else "*.whl")
    deadline = time.monotonic() + timeout
    errors = []
    for cmd in attempts(out_dir, project, python):
        left = deadline - time.monotonic()
        if left <= 1:
            errors.append(f"{' '.join(cmd[:4])}: not tried, the {timeout:g} s budget is spent")
            break
        started = time.monotonic()
        code, output = _run(cmd, left, env, log_file)
        found = sorted(out_dir.glob(pattern))
        if code == 0 and found:
            return Built(found[-1], f"{' '.join(cmd[1:4])} ({time.monotonic() - started:.1f} s)")
        status = f"timed out after {left:.0f} s" if code is None else f"exit {code}"
        errors.append(f"{' '.join(cmd[:4])}: {status}\n{output[-1500:]}")
    raise WheelBuildFailed(f"could not build the wheel of {project}:\n" + "\n".join(errors))


def build_wheel(out_dir: Path, **options) -> Path:
    """:func:`build`'s wheel (same options)."""
    return build(out_dir, **options).wheel


def _run(cmd: list[str], timeout: float, env: Mapping[str, str] | None, log_file: Path | None):
    """``(exit status or None on the timeout, stdout and stderr together)``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, env=None if env is None else dict(env), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    except BaseException:  # Ctrl-C, a test's timeout: leave no build backend behind
        _kill(proc)
        raise
    if code is None:
        _kill(proc)
        output, _ = proc.communicate()
        output += f"\n*** timed out after {timeout:.0f} s\n"
    if log_file is not None:
        with open(log_file, "a") as log:
            log.write(f"$ {' '.join(cmd)}\n{output}")
    return code, output


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
