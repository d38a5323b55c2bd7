"""This machine's CPython interpreters, for scripts/matrix.py and scripts/interpreters.py.

A version such as ``3.12`` resolves to pyenv's build of it (``$(pyenv root)/versions/3.12.*``),
then to ``python3.12`` on PATH; anything else is taken as a path or a command name. Stdlib only.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

# the interpreters requires-python admits and CI checks (3.14+ are not on these machines)
PYTHONS = ("3.9", "3.10", "3.11", "3.12", "3.13")


def pyenv_root() -> Path:
    if os.environ.get("PYENV_ROOT"):
        return Path(os.environ["PYENV_ROOT"])
    try:
        out = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return Path(out) if out else Path.home() / ".pyenv"


def _numeric(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def resolve_python(spec: str) -> str:
    """The interpreter path for ``spec`` (``3.12``, ``3.12.1``, a path or a command); ValueError if none."""
    if re.fullmatch(r"\d+\.\d+(\.\d+)?", spec):
        versions = pyenv_root() / "versions"
        # "3.1" must not pick 3.12: match whole components only
        found = sorted(
            (p for p in versions.glob(f"{spec}*") if p.name == spec or p.name.startswith(spec + ".")),
            key=lambda p: _numeric(p.name),
        ) if versions.is_dir() else []
        for candidate in reversed(found):
            exe = candidate / "bin" / "python3"
            if os.access(exe, os.X_OK):
                return str(exe)
        on_path = shutil.which(f"python{spec}")
        if on_path:
            return on_path
        raise ValueError(f"no CPython {spec}: not under {versions} and no python{spec} on PATH")
    path = shutil.which(spec) or spec
    if not os.access(path, os.X_OK):
        raise ValueError(f"{spec}: not an executable interpreter")
    return path


def python_version(exe: str) -> str:
    """``platform.python_version()`` of the interpreter ``exe``."""
    return subprocess.run(
        [exe, "-c", "import platform; print(platform.python_version())"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()
