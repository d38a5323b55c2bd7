#!/usr/bin/env python3
"""The release, rehearsed: build the sdist and the wheel, check them as PyPI would, and prove that a
wheel built from the sdist alone auto-activates in a fresh venv. About 1 - 2 min; run by ``.ci/run``.

In a throwaway directory, with the interpreter that runs this script (stdlib only here):

1. a tools venv with ``build`` and ``twine`` (CI is a fresh clone: nothing is assumed installed);
2. ``python -m build`` of this checkout: the sdist, and the wheel ``build`` makes from it;
3. ``twine check`` of both (the description renders, the metadata is valid);
4. both artifacts carry LICENSE and CHANGELOG.md (the wheel in ``.dist-info/licenses/`` and
   ``.dist-info/extra_metadata/``), the sdist the ``.pth``/``.start`` sources, and CHANGELOG.md has a
   section for the version being built;
5. ``pip wheel`` of the sdist file alone (nothing from the checkout), as pip does for a user who gets
   no wheel; it must hold the same files as the wheel of step 2;
6. that wheel installed into a fresh venv without torch: ``fsdp-autopatch --version`` is the built
   version, and a program that only imports a stand-in ``torch.distributed.fsdp`` finds the plugin
   loaded by the ``.pth`` (``scripts/interpreters.py``'s check, reused).

Usage (from anywhere)::

    python3 scripts/release_check.py            # ends with "release check: N passed, N failed"
    python3 scripts/release_check.py --keep DIR # build in DIR and keep the artifacts

Exit status 1 if any step failed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

from interpreters import check_activation, run, tail

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("build>=1.2", "twine>=6.1")  # twine 6.1 is the first that reads core metadata 2.4 (PEP 639)
PIP = ("-m", "pip", "install", "-q", "--disable-pip-version-check")


class StepFailed(Exception):
    """A step of the release check failed; the message says what was found."""


def _ok(result, what: str) -> str:
    if result.returncode != 0:
        raise StepFailed(f"{what} exited {result.returncode}:\n{tail(result, 30)}")
    return what


def make_venv(path: Path, *packages: str) -> Path:
    _ok(run([sys.executable, "-m", "venv", path], timeout=300), "python -m venv")
    python = path / "bin" / "python"
    if packages:
        _ok(run([python, *PIP, *packages], timeout=900), f"pip install {' '.join(packages)}")
    return python


def build_both(tools: Path, out: Path) -> tuple[Path, Path]:
    _ok(run([tools, "-m", "build", "--outdir", out, ROOT], timeout=900), "python -m build")
    (sdist,) = out.glob("fsdp_autopatch-*.tar.gz")
    (wheel,) = out.glob("fsdp_autopatch-*.whl")
    return sdist, wheel


def twine_check(tools: Path, artifacts: list[Path]) -> str:
    return _ok(run([tools, "-m", "twine", "check", "--strict", *artifacts], timeout=300), "twine check --strict")


def version_of(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def sdist_names(sdist: Path) -> set[str]:
    with tarfile.open(sdist) as archive:
        return {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}


def check_contents(sdist: Path, wheel: Path) -> str:
    dist_info = f"fsdp_autopatch-{version_of(wheel)}.dist-info"
    wanted = {
        wheel: (wheel_names(wheel), (f"{dist_info}/licenses/LICENSE", f"{dist_info}/extra_metadata/CHANGELOG.md",
                                     "fsdp_autopatch.pth", "fsdp_autopatch.start", "fsdp_autopatch/py.typed")),
        sdist: (sdist_names(sdist), ("LICENSE", "CHANGELOG.md", "pyproject.toml", "README.md",
                                     "src/fsdp_autopatch.pth", "src/fsdp_autopatch.start")),
    }
    missing = [f"{artifact.name}: {name}" for artifact, (names, need) in wanted.items() for name in need
               if name not in names]
    if missing:
        raise StepFailed("missing " + ", ".join(missing))
    return "LICENSE and CHANGELOG.md in both, .pth/.start and py.typed in place"


def check_changelog(wheel: Path) -> str:
    version = version_of(wheel)
    if not re.search(rf"^## \[{re.escape(version)}\]", (ROOT / "CHANGELOG.md").read_text(), re.M):
        raise StepFailed(f"CHANGELOG.md has no '## [{version}]' section")
    return f"CHANGELOG.md has a section for {version}"


def wheel_from_sdist(tools: Path, sdist: Path, out: Path) -> Path:
    _ok(run([tools, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, sdist], timeout=900, cwd=out), "pip wheel")
    (wheel,) = out.glob("fsdp_autopatch-*.whl")
    return wheel


def same_files(built: Path, from_sdist: Path) -> str:
    differ = sorted(wheel_names(built) ^ wheel_names(from_sdist))
    if differ:
        raise StepFailed(f"the wheel built from the sdist differs from python -m build's: {differ}")
    return f"{len(wheel_names(from_sdist))} files, the same as python -m build's wheel"


def install_and_activate(wheel: Path, scratch: Path) -> str:
    python = make_venv(scratch / "venv", str(wheel))
    shown = run([python.parent / "fsdp-autopatch", "--version"], timeout=120)
    _ok(shown, "fsdp-autopatch --version")
    if version_of(wheel) not in shown.stdout:
        raise StepFailed(f"fsdp-autopatch --version says {shown.stdout.strip()!r}, the wheel is {version_of(wheel)}")
    ok, detail = check_activation(python, scratch)
    if not ok:
        raise StepFailed(detail)
    return f"--version {version_of(wheel)}; {detail}"


def run_steps(work: Path) -> list[tuple[str, bool, str, float]]:
    results: list[tuple[str, bool, str, float]] = []
    state: dict[str, Path] = {}

    def step(name, action) -> bool:
        started = time.monotonic()
        try:
            detail, ok = action(), True
        except StepFailed as exc:
            detail, ok = str(exc), False
        except (ValueError, OSError, subprocess.SubprocessError) as exc:  # ValueError: 0 or 2 artifacts found
            detail, ok = f"{type(exc).__name__}: {exc}", False
        results.append((name, ok, detail, time.monotonic() - started))
        print(f"   {'ok ' if ok else 'BAD'} {name} ({results[-1][3]:.0f} s): {detail}", flush=True)
        return ok

    def tools_venv() -> str:
        state["tools"] = make_venv(work / "tools", *TOOLS)
        return "build, twine"

    def build() -> str:
        state["sdist"], state["wheel"] = build_both(state["tools"], work / "dist")
        return f"{state['sdist'].name}, {state['wheel'].name}"

    def from_sdist() -> str:
        (work / "from-sdist").mkdir()
        state["rebuilt"] = wheel_from_sdist(state["tools"], state["sdist"], work / "from-sdist")
        return same_files(state["wheel"], state["rebuilt"])

    if step("tools venv", tools_venv) and step("python -m build (sdist, wheel)", build):
        step("twine check", lambda: twine_check(state["tools"], [state["sdist"], state["wheel"]]))
        step("contents", lambda: check_contents(state["sdist"], state["wheel"]))
        step("changelog", lambda: check_changelog(state["wheel"]))
        if step("wheel from the sdist", from_sdist):
            step("fresh venv: install, auto-activation", lambda: install_and_activate(state["rebuilt"], work))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="work in this (new or empty) directory and keep it")
    args = parser.parse_args(argv)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        results = run_steps(args.keep.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="fsdp-release-") as tmp:
            results = run_steps(Path(tmp))
    passed = sum(ok for _, ok, _, _ in results)
    print(f"release check: {passed} passed, {len(results) - passed} failed")
    return 0 if results and passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
