"""The orchestration side of ``scripts/gpu_check.py``: the wheel, the throwaway venv that sees the
machine's torch, the probe of what the venv's interpreter activates, and the rank launches (the
package's launcher, ``src/fsdp_autopatch/_launch.py``, loaded from the checkout by path).
Standard library only: nothing here imports torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import _wheel

ROOT = Path(__file__).resolve().parent.parent
RANK_PROGRAM = ROOT / "scripts" / "_gpu_check_rank.py"
LAUNCHER = ROOT / "src" / "fsdp_autopatch" / "_launch.py"
PARENT_PTH = "_gpu_check_parent_site.pth"


class SetupFailed(Exception):
    pass


def load_launcher():
    """``fsdp_autopatch._launch`` from this checkout (standard library only), without the package."""
    spec = importlib.util.spec_from_file_location("_gpu_check_launch", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def run(cmd: list, timeout: float, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """A bounded child in its own session; on the timeout its whole process group is killed."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise SetupFailed(f"timed out after {timeout:.0f} s: {' '.join(map(str, cmd))}\n{out[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def build_wheel(out: Path, timeout: float) -> tuple[Path, str]:
    """The wheel of this checkout, as a release builds it (``python -m build``), else ``pip wheel``
    (``scripts/_wheel.py``); with how it was built."""
    try:
        built = _wheel.build(out, timeout=timeout)
    except _wheel.WheelBuildFailed as error:
        raise SetupFailed("could not build the wheel here (no network for the build backend?); build it where you can "
                          f"(python3 scripts/gpu_check.py --build-wheel DIR) and pass --wheel\n{error}") from None
    return built.wheel, built.how


def _site_dirs() -> list[str]:
    """Where this interpreter finds its packages (torch among them): its site-packages directories."""
    dirs = [p for p in sys.path if p and Path(p).is_dir() and Path(p).name in ("site-packages", "dist-packages")]
    purelib = sysconfig.get_paths()["purelib"]
    return list(dict.fromkeys([purelib, *dirs]))


def make_venv(path: Path, wheel: Path, timeout: float) -> Path:
    """``python -m venv --system-site-packages`` over this interpreter, the wheel installed into it.

    When this interpreter is itself a venv (the GPU machine's python3 is one), ``--system-site-packages``
    reaches only the base interpreter's packages, so a ``.pth`` of plain path lines appends this
    interpreter's site-packages (torch, wrapt, packaging) after the venv's own: the wheel installed in the
    venv comes first, and no ``.pth`` of those directories runs (an editable fsdp-autopatch there stays out).
    """
    if path.exists():
        shutil.rmtree(path)
    made = run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", path], timeout)
    if made.returncode != 0:
        raise SetupFailed(f"python -m venv failed:\n{made.stdout[-2000:]}")
    python = path / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 60).stdout.strip())
    site.mkdir(parents=True, exist_ok=True)
    if sys.prefix != sys.base_prefix:
        (site / PARENT_PTH).write_text("".join(f"{d}\n" for d in _site_dirs()))
    # --ignore-installed: a fsdp-autopatch of the parent environment is neither seen nor uninstalled
    installed = run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
                     "--no-compile", "--disable-pip-version-check", wheel], timeout)
    if installed.returncode != 0:
        raise SetupFailed(f"pip install of {wheel.name} into the venv failed:\n{installed.stdout[-2000:]}")
    return python


PROBE = r"""
import json, os, sys
startup = "_fsdp_autopatch_bootstrap" in sys.modules
import torch, torch.distributed.fsdp
import fsdp_autopatch, wrapt, packaging
report = fsdp_autopatch.status().to_dict()
cuda = torch.cuda.is_available()
print(json.dumps({
    "python": sys.version.split()[0], "executable": sys.executable, "torch": torch.__version__,
    "torch_file": torch.__file__, "cuda": torch.version.cuda, "cuda_available": cuda,
    "device_count": torch.cuda.device_count() if cuda else 0,
    "device_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
    "nccl": cuda and torch.distributed.is_nccl_available(), "gloo": torch.distributed.is_gloo_available(),
    "plugin_file": fsdp_autopatch.__file__, "plugin_version": report.get("version"),
    "bootstrap": report.get("bootstrap"), "loaded_at_startup": startup,
    "wrapt": getattr(wrapt, "__version__", "?"), "packaging": getattr(packaging, "__version__", "?"),
    "statuses": {p["name"]: p["status"] for p in report["patches"]},
}))
"""


def probe(python: Path, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """What the venv's interpreter has: torch, devices, and the plugin its ``.pth`` activated."""
    result = run([python, "-c", PROBE], timeout, env=env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise SetupFailed("the venv's interpreter could not import torch's FSDP2 and the plugin:\n"
                          + result.stdout[-3000:])
    found = json.loads(lines[-1])
    venv = str(python.parent.parent.resolve())
    if not str(Path(found["plugin_file"]).resolve()).startswith(venv) or found["bootstrap"] != "pth":
        raise SetupFailed(f"the plugin did not auto-activate from the venv's .pth: {found['plugin_file']}, "
                          f"bootstrap {found['bootstrap']!r}")
    return found


def child_env(device: str, world_size: int | None = None) -> dict[str, str]:
    """The environment of every child (the launcher adds its own defaults and each launch's variables);
    ``world_size`` None: the GPUs stay as this process sees them (the probe counts them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_AUTOPATCH_", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = ""  # the launcher starts from os.environ: a checkout's src must not shadow the wheel
    if device != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif world_size is not None:  # the launcher would hide every GPU otherwise
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        env["CUDA_VISIBLE_DEVICES"] = visible or ",".join(str(i) for i in range(world_size))
    return env


def launch_ranks(launcher, python: Path, launch, *, device: str, world_size: int, timeout_s: float,
                 pg_timeout_s: float, compile_backend: str, scratch: Path) -> dict[str, Any]:
    """One launch of ``world_size`` ranks; what each rank reported, with exit codes and output tails."""
    logs = scratch / launch.name.replace(" ", "_").replace(":", "")
    logs.mkdir(parents=True, exist_ok=True)
    extra = ["--cost-json", json.dumps(launch.cost)] if launch.cost else []

    def command(rank: int) -> list[str]:
        return [str(python), str(RANK_PROGRAM), "--device", device, "--cases", ",".join(launch.cases),
                "--out", str(logs), "--deadline", str(timeout_s + 10), "--pg-timeout", str(pg_timeout_s),
                "--compile-backend", compile_backend, *extra]

    env = {**child_env(device, world_size), **launch.env}
    if device == "cuda":
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // (2 * world_size)))
    done = launcher.retry_on_taken_port(
        lambda port: launcher.launch(command, world_size=world_size, port=port, logs=logs, timeout_s=timeout_s,
                                     env=env, fail_grace_s=15.0, merge_stderr=True, cwd=logs, tail_lines=25),
        lambda result: any(launcher.port_taken(r.stdout) for r in result.ranks), attempts=2)
    ranks = []
    for rank in range(world_size):
        path = logs / f"rank{rank}.json"
        try:
            ranks.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            ranks.append(None)
    return {
        "name": launch.name, "cases": launch.cases, "env": launch.env, "seconds": round(done.elapsed_s, 1),
        "timeout_s": round(timeout_s), "timed_out": done.timed_out, "killed": done.killed,
        "returncodes": [r.returncode for r in done.ranks], "ranks": ranks,
        "tails": [r.stdout for r in done.ranks],
    }
