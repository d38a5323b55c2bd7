#!/usr/bin/env python3
"""Run ``fsdp-autopatch gpu-check`` on this checkout's wheel, as a user would have it installed.

    python3 scripts/gpu_check.py --device cuda        # every GPU of the machine, one rank each (NCCL)
    python3 scripts/gpu_check.py --device cpu         # 2 gloo ranks on CPU: the same logic, small
    python3 scripts/gpu_check.py --build-wheel DIR    # only build the wheel (for a machine that cannot)

Builds the wheel (or takes ``--wheel``), installs it into a throwaway venv made with
``--system-site-packages`` over this interpreter, and runs ``<venv>/bin/fsdp-autopatch gpu-check
--expected tests/expected.py`` with the other options passed on. Its exit status, or 2 when the wheel
or the venv failed. Standard library only; docs/compatibility.md, "CUDA".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import _wheel

ROOT = _wheel.ROOT
EXPECTED = ROOT / "tests" / "expected.py"
SETUP_TIMEOUT_S = 300.0


def _run(*cmd) -> str:
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=SETUP_TIMEOUT_S).stdout


def _venv(path: Path, wheel: Path) -> Path:
    _run(sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", path)
    python = path / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    if sys.prefix != sys.base_prefix:  # this venv's site-packages (torch), after the wheel, as plain paths
        dirs = [p for p in sys.path if p and Path(p).is_dir() and Path(p).name in ("site-packages", "dist-packages")]
        (site / "_gpu_check_parent_site.pth").write_text("".join(
            f"{d}\n" for d in dict.fromkeys([sysconfig.get_paths()["purelib"], *dirs])))
    # --ignore-installed: a fsdp-autopatch of this environment is neither seen nor uninstalled
    _run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", "--no-compile",
         "--disable-pip-version-check", wheel)
    return path / "bin" / "fsdp-autopatch"


def _cuda_devices() -> int:
    """CUDA devices this interpreter's torch sees; 1 where it cannot tell (the installed check then decides)."""
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 1
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="the other options: "
                                     "fsdp-autopatch gpu-check --help")
    parser.add_argument("--wheel", type=Path, help="install this wheel instead of building one")
    parser.add_argument("--build-wheel", type=Path, metavar="DIR", help="only build the wheel into DIR, then exit")
    parser.add_argument("--out", type=Path, default=ROOT / ".artifacts" / "gpu-check")
    parser.add_argument("--budget", type=float, help="overall time guard in seconds, the set-up here included")
    args, rest = parser.parse_known_args()
    started = time.monotonic()
    device = rest[rest.index("--device") + 1] if "--device" in rest[:-1] else "auto"
    if device in ("auto", "cuda") and not args.build_wheel and not _cuda_devices():
        # say it before the wheel and the venv cost their seconds: the installed command would say the same
        message = "gpu check: no CUDA device, nothing to check here. (--device cpu runs the same logic on gloo.)"
        print(message)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps({"skipped": message, "device": device}) + "\n")
        return 0
    with tempfile.TemporaryDirectory(prefix="fsdp-gpu-check-") as tmp:
        try:
            built = _wheel.Built(args.wheel.resolve(), "given (--wheel)") if args.wheel else \
                _wheel.build(args.build_wheel or Path(tmp) / "dist", timeout=SETUP_TIMEOUT_S)
            print(f"wheel: {built.wheel} ({built.how})", flush=True)
            if args.build_wheel:
                return 0
            seconds = {"wheel": round(time.monotonic() - started, 1)}
            command = _venv(Path(tmp) / "venv", built.wheel)
        except (_wheel.WheelBuildFailed, subprocess.SubprocessError, OSError) as failed:
            detail = getattr(failed, "stdout", None) or ("no network for the build backend? build the wheel where you "
                                                         "can (--build-wheel DIR), then pass --wheel")
            message = f"gpu check: setup failed: {failed}\n{str(detail)[-2000:]}"
            print(message, file=sys.stderr)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "report.json").write_text(json.dumps({"setup_failed": message, "device": device}) + "\n")
            return 2
        seconds["venv"] = round(time.monotonic() - started - seconds["wheel"], 1)
        setup = json.dumps({"wheel": built.wheel.name, "built": built.how, "seconds": seconds})
        budget = ["--budget", str(max(60.0, args.budget - (time.monotonic() - started)))] if args.budget else []
        expected = ["--expected", str(EXPECTED)] if EXPECTED.is_file() else []
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # the wheel, not src/
        return subprocess.run([command, "gpu-check", *expected, "--out", args.out.resolve(), *budget,
                               "--setup-json", setup, *rest], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
