"""The orchestration side of ``fsdp-autopatch gpu-check``: the probe of what this interpreter
activates at start-up, and the rank launches (the package's launcher, ``fsdp_autopatch._launch``).
The ranks are this interpreter too, so they test the plugin as installed here. Standard library
only: nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .. import _launch as launcher

RANK_MODULE = f"{__package__}._rank"
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the fsdp_autopatch this check runs from


class SetupFailed(Exception):
    pass


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


def probe(env: dict[str, str], timeout: float, cwd: Path) -> dict[str, Any]:
    """What this interpreter has in a fresh process: torch, devices, and the plugin its ``.pth``
    activated, which must be the one this check runs from."""
    result = run([sys.executable, "-c", PROBE], timeout, env=env, cwd=cwd)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise SetupFailed(f"{sys.executable} could not import torch's FSDP2 and the plugin:\n" + result.stdout[-3000:])
    found = json.loads(lines[-1])
    if Path(found["plugin_file"]).resolve().parent != PACKAGE_DIR:
        raise SetupFailed(f"a new process imports another fsdp_autopatch ({found['plugin_file']}) than this check "
                          f"({PACKAGE_DIR}): PYTHONPATH, or the current directory?")
    if found["bootstrap"] != "pth":
        raise SetupFailed(f"the plugin did not activate at interpreter start (bootstrap {found['bootstrap']!r}): "
                          "its .pth file did not run; `fsdp-autopatch doctor` says why")
    return found


def child_env(device: str, world_size: int | None = None) -> dict[str, str]:
    """The environment of every child (the launcher adds its own defaults and each launch's variables);
    ``world_size`` None: the GPUs stay as this process sees them (the probe counts them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_AUTOPATCH_", "VIRTUAL_ENV"))}
    if device != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif world_size is not None:  # the launcher would hide every GPU otherwise
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        env["CUDA_VISIBLE_DEVICES"] = visible or ",".join(str(i) for i in range(world_size))
    return env


def launch_ranks(launch, *, device: str, world_size: int, timeout_s: float,
                 pg_timeout_s: float, compile_backend: str, scratch: Path) -> dict[str, Any]:
    """One launch of ``world_size`` ranks; what each rank reported, with exit codes and output tails."""
    logs = scratch / launch.name.replace(" ", "_").replace(":", "")
    logs.mkdir(parents=True, exist_ok=True)
    extra = ["--cost-json", json.dumps(launch.cost)] if launch.cost else []

    def command(rank: int) -> list[str]:
        return [sys.executable, "-m", RANK_MODULE, "--device", device, "--cases", ",".join(launch.cases),
                "--out", str(logs), "--deadline", str(timeout_s + 10), "--pg-timeout", str(pg_timeout_s),
                "--compile-backend", compile_backend, *extra]

    env = {**child_env(device, world_size), **launch.env}
    if device == "cuda":
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // (2 * world_size)))
    done = launcher.retry_on_taken_port(
        lambda port: launcher.launch(command, world_size=world_size, port=port, logs=logs, timeout_s=timeout_s,
                                     env=env, fail_grace_s=15.0, merge_stderr=True, cwd=logs, tail_lines=25),
        lambda result: any(launcher.port_taken(r.stdout) for r in result.ranks), attempts=2)
    ranks = launcher.rank_results(logs, world_size)
    return {
        "name": launch.name, "cases": launch.cases, "env": launch.env, "seconds": round(done.elapsed_s, 1),
        "timeout_s": round(timeout_s), "timed_out": done.timed_out, "killed": done.killed,
        "returncodes": [r.returncode for r in done.ranks], "ranks": ranks,
        "tails": [r.stdout for r in done.ranks],
    }
