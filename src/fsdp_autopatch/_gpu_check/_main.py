"""The driver of ``fsdp-autopatch gpu-check`` (the options are ``fsdp_autopatch._cli``'s): probe this
interpreter, launch the ranks under one overall time guard, write ``report.json`` and ``table.txt``,
print the table. Standard library only; torch is imported by the probe and the rank processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import _env as env
from . import _plan as plan
from . import _report as report

BUDGET_S = {"cuda": 450.0, "cpu": 240.0}  # the overall guard: 8 minutes on one GPU
COST_RESERVE_S = {"cuda": 120.0, "cpu": 45.0}  # kept back for the cost launch, which runs last
SETUP_TIMEOUT_S = 300.0


def _cuda_devices(timeout: float) -> tuple[int, str]:
    """How many CUDA devices this interpreter's torch sees (asked in a child: this process never
    touches the GPU), and why none when none."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 0, "asking torch for CUDA devices timed out"
    if result.returncode != 0:
        return 0, f"torch is not importable here: {result.stderr.strip().splitlines()[-1:]}"
    count = int(result.stdout.split()[-1])
    return count, "" if count else "torch sees no CUDA device here (CUDA_VISIBLE_DEVICES, no GPU or a CPU build)"


def _write(out: Path, data: dict, text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (out / "table.txt").write_text(text + "\n")


def _hard_guard(seconds: float) -> threading.Timer:
    """Last resort if something unbounded slipped through: every step has its own timeout, and the
    ranks' watchdogs end them when this process is gone. Cancelled when the check returns."""
    def fire() -> None:
        print(f"gpu check: the overall time guard ({seconds:.0f} s) expired; exiting", file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 when every case is right with the plugin on and the cost was measured, or
    when there is no CUDA device and ``--device cpu`` was not given; 1 otherwise; 2 when the setup
    failed (the probe, ``--expected``)."""
    started = time.monotonic()
    device = args.device
    args.out = Path(args.out)
    if device in ("auto", "cuda"):
        count, why = _cuda_devices(120.0)
        if not count:
            message = (f"gpu check: no CUDA device, nothing to check here: {why}. "
                       "(--device cpu runs the same logic on gloo.)")
            print(message)
            _write(args.out, {"skipped": message, "device": device}, message)
            return 0
        device = "cuda"
    budget = args.budget or BUDGET_S[device]
    guard = _hard_guard(budget + 90)
    try:
        expected = _expected(args.expected)
        with tempfile.TemporaryDirectory(prefix="fsdp-gpu-check-") as tmp:
            return _check(args, device, expected, Path(tmp), started, started + budget)
    except env.SetupFailed as failed:
        message = f"gpu check: setup failed: {failed}"
        print(message, file=sys.stderr)
        _write(args.out, {"setup_failed": str(failed), "device": device}, message)
        return 2
    finally:
        guard.cancel()


def _expected(path: str | None) -> Any:
    """The module ``--expected`` names (``tests/expected.py`` of a checkout), or None."""
    try:
        return plan.load_expected(Path(path)) if path else None
    except Exception as error:  # a missing file, a syntax error: the caller's input
        raise env.SetupFailed(f"--expected {path}: {type(error).__name__}: {error}") from None


def launch_timeout(kind: str, device: str, left: float, reserve: float) -> tuple[float, str]:
    """(the outer timeout of a launch of ``kind``, why it is skipped or ""): its own timeout, capped by
    what the overall guard has ``left`` less the ``reserve`` kept for the cost; skipped under the
    least it needs (``plan.MIN_TIMEOUT_S``, 20 s by default)."""
    timeout = min(plan.TIMEOUTS[device][kind], left - reserve)
    least = plan.MIN_TIMEOUT_S.get(kind, {}).get(device, 20)
    if timeout < least:
        return timeout, (f"the overall time guard left too little time ({max(0.0, timeout):.0f} s of the "
                         f"{least} s it needs)")
    return timeout, ""


def _check(args, device: str, expected: Any, tmp: Path, started: float, deadline: float) -> int:
    def left() -> float:
        return deadline - time.monotonic()

    clock = time.monotonic()
    found = env.probe(env.child_env(device), min(SETUP_TIMEOUT_S, left()), cwd=tmp)
    given = json.loads(args.setup_json) if args.setup_json else {}
    found["setup_seconds"] = {**given.get("seconds", {}), "probe": round(time.monotonic() - clock, 1)}
    found["given"] = given
    world_size = args.world_size or (found["device_count"] if device == "cuda" else 2)
    if device == "cuda" and not (found["cuda_available"] and found["nccl"]):
        raise env.SetupFailed(f"torch {found['torch']} here has no CUDA device or no NCCL")
    if device == "cuda" and not 1 <= world_size <= found["device_count"]:
        raise env.SetupFailed(f"--world-size {world_size}: one rank per GPU, and {found['device_count']} are visible")
    print(f"python {found['python']} ({sys.executable}): torch {found['torch']} from "
          f"{Path(found['torch_file']).parent.parent}, plugin {found['plugin_version']} from "
          f"{Path(found['plugin_file']).parent} (its .pth); {device}, world size {world_size}", flush=True)
    backend = args.compile_backend or plan.COMPILE_BACKEND[device]
    launches = plan.plan(device, world_size, {**plan.COST_SPECS[device], "cases": ["fill_off", "fill_on"]}, args.only,
                         args.off_runs)
    results: dict[str, dict] = {}

    def one(launch: plan.Launch, reserve: float) -> None:
        timeout, skipped = launch_timeout(launch.kind, device, left(), reserve)
        if skipped:
            results[launch.name] = {"name": launch.name, "cases": launch.cases, "skipped": skipped}
            print(f"  skipped (time guard): {launch.name}", flush=True)
            return
        result = env.launch_ranks(launch, device=device, world_size=world_size, timeout_s=timeout,
                                  pg_timeout_s=plan.PG_TIMEOUT_S[device], compile_backend=backend,
                                  scratch=tmp / "runs")
        results[launch.name] = result
        state = "timed out" if result["timed_out"] else f"exit {result['returncodes']}"
        print(f"  {result['seconds']:6.1f} s  {launch.name} ({state})", flush=True)

    shared, solo = [x for x in launches if not x.solo], [x for x in launches if x.solo]
    jobs = args.jobs or (4 if device == "cuda" else 2)  # launches wait more than they compute
    reserve = COST_RESERVE_S[device] if solo else 0.0
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(lambda x: one(x, reserve), shared))
    for launch in solo:
        one(launch, 0.0)
    data = _report(args, device, world_size, backend, expected, found, results, started)
    text = report.table(data)
    _write(args.out, data, text)
    print("\n" + text)
    return 0 if data["ok"] else 1


def _report(args, device, world_size, backend, expected, found, results, started) -> dict:
    letters, expected_off = plan.expected_off(expected, found["torch"])
    given = found["given"]
    data = {
        "version": 1, "device": device, "backend": "nccl" if device == "cuda" else "gloo",
        "world_size": world_size, "report_path": str(args.out.resolve() / "report.json"),
        "machine": {k: found[k] for k in ("python", "torch", "cuda", "device_count", "device_names")}
        | {"cpu_count": os.cpu_count(), "executable": sys.executable},
        "setup_seconds": found["setup_seconds"],
        "plugin": {"wheel": given.get("wheel"), "built": given.get("built"), "version": found["plugin_version"],
                   "file": found["plugin_file"],
                   "bootstrap": found["bootstrap"], "statuses": found["statuses"],
                   "wrapt": found["wrapt"], "packaging": found["packaging"]},
        "compile": {"backend": backend, "note": plan.COMPILE_NOTE[device] if not args.compile_backend else "given",
                    **(report.compile_rows(results) if not args.only else {"skipped": "--only"})},
        "expected_source": str(Path(args.expected).resolve()) if expected else
        "no --expected: the plugin-off runs are recorded, not judged",
        "patches": report.patch_rows(results, world_size, expected_off, found["statuses"], letters, device),
        # entries without a case module (none today): their gloo tests cover them
        "not_in_gpu_check": [name for name in found["statuses"] if name not in plan.BY_NAME],
        "world_size_1": {p.name: dict(zip(("can_strike", "runs", "note"), plan.strikes(p.name, 1, device)))
                         for p in plan.PATCHES},
        "training": report.training_rows(results, device) if not args.only else {},
        "cost": report.cost_summary(results.get("step cost")) if not args.only else {"skipped": "--only"},
        "launches": [_launch_record(r) for r in results.values()],
    }
    data["seconds"] = round(time.monotonic() - started, 1)
    data["ok"], data["problems"], data["findings"] = report.verdict(data)
    return data


def _launch_record(result: dict) -> dict:
    """A launch as the report keeps it: no per-rank data, output tails only where it went wrong."""
    record = {k: v for k, v in result.items() if k not in ("ranks", "tails")}
    record["plugin"] = ((result.get("ranks") or [None])[0] or {}).get("plugin")
    if result.get("timed_out") or any(code not in (0, None) for code in result.get("returncodes", [])):
        record["tails"] = result.get("tails")
    return record
