"""The rank side of the demo: one rank of a sub-run, started by the parent as
``python -m fsdp_autopatch.demo --worker --scenario <key> --rank <r> --out <dir> --deadline <s>``.

The rank trains, rank 0 checks the invariants, and every rank writes ``<dir>/rank<r>.json`` (its
result or its error) and keeps ``<dir>/rank<r>.where`` up to date, so that the parent can say
where a rank was when it had to kill it. torch is imported inside functions only, after the
patches are installed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from ..cases import _four_bugs as four_bugs
from ._scenarios import PG_TIMEOUT_S, SCENARIOS, Scenario


class Progress:
    """Where the rank is, e.g. 'step 1, micro-batch 1/3 (text-only) backward'.

    Kept in memory for exception reports and mirrored to a file, so that the parent can still say
    where a rank was stuck when it has to kill it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.at("startup")

    def at(self, where: str) -> None:
        self.where = where
        self.path.write_text(where)


def start_watchdogs(deadline_s: float) -> None:
    """Exit if the demo's parent dies or the run overstays its budget: never leave an orphan."""
    parent = os.getppid()
    started = time.monotonic()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent or time.monotonic() - started > deadline_s:
                os._exit(4)

    threading.Thread(target=watch, name="demo-watchdog", daemon=True).start()


def _registry_snapshot() -> dict[str, Any]:
    """fsdp_autopatch.status() as JSON, after torch's FSDP2 was imported (hook has run)."""
    try:
        import fsdp_autopatch

        return fsdp_autopatch.status().to_dict()
    except Exception as exc:  # the registry is informative only: never fail the demo on it
        return {"error": f"{type(exc).__name__}: {exc}"}


def _ensure_installed() -> str:
    """Install the patches if this interpreter did not run the .pth (e.g. PYTHONPATH checkout)."""
    try:
        import fsdp_autopatch

        if fsdp_autopatch.status().bootstrap == "not_run":
            fsdp_autopatch.install()
            return "the .pth did not run in the ranks; the demo called fsdp_autopatch.install()"
    except Exception as exc:
        return f"fsdp_autopatch unavailable in the ranks: {type(exc).__name__}: {exc}"
    return ""


def _enable_fill(model, scenario: Scenario) -> str:
    if not scenario.fill:
        return "off (not called)"
    if not hasattr(model, "set_reduce_scatter_unused_params"):
        # torch < 2.13 with the backport disabled: nothing can turn the fill on.
        return "unavailable (torch < 2.13 and the backport is off)"
    model.set_reduce_scatter_unused_params(True)
    return "on"


def _run_rank(scenario: Scenario, rank: int, progress: Progress, result: dict[str, Any]) -> None:
    clock = time.monotonic()
    timings = result["seconds"] = {}

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.monotonic()
        timings[phase] = round(now - clock, 2)
        clock = now

    result["install_note"] = _ensure_installed()  # before torch, like the .pth would
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401  -- the patches are applied on this import
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # two ranks share two cores
    # torch 2.13 warns whenever an FSDP unit returns a view (any nn.Linear on a 3-D input does):
    # harmless here, no output is modified in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    if rank == 0:
        result["registry"] = _registry_snapshot()
        result["torch"] = torch.__version__
    lap("import")
    progress.at("init_process_group")
    dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (four_bugs.WORLD_SIZE,))
    progress.at("fully_shard")
    model = four_bugs.shard(four_bugs.build_model(), mesh)
    result["fill"] = _enable_fill(model, scenario)
    lap("setup")
    plan = four_bugs.plan()
    run = four_bugs.train(model, plan[rank], four_bugs.STEPS, at=progress.at)
    dist.barrier()
    dist.destroy_process_group()
    lap("train")
    if rank == 0:
        progress.at("checking invariants")
        result["checks"] = {
            "gradients": four_bugs.check_gradients(run, plan),
            "unused_expert": four_bugs.check_unused_expert(run),
            "loss": four_bugs.check_loss(run["losses"]),
        }
        lap("check")


def worker_main(scenario_key: str, rank: int, out_dir: str, deadline_s: float) -> int:
    """Run one rank of ``scenario_key`` and write its report; exits the process (never returns)."""
    start_watchdogs(deadline_s)
    scenario = SCENARIOS[scenario_key]
    progress = Progress(Path(out_dir) / f"rank{rank}.where")
    return run_reported(lambda result: _run_rank(scenario, rank, progress, result), rank, out_dir, progress)


def run_reported(body, rank: int, out_dir: str, progress: Progress) -> int:
    """Run ``body(result)``, write ``<out_dir>/rank<r>.json`` (its result or its error), exit."""
    result: dict[str, Any] = {"rank": rank, "error": None}
    code = 0
    try:
        body(result)
    except BaseException as exc:  # report every failure, including a gloo error, to the parent
        result["error"] = {
            "type": type(exc).__name__,
            "message": str(exc).strip(),
            "where": progress.where,
            "time": time.time(),
            "traceback": traceback.format_exc()[-4000:],
        }
        code = 3
    path = Path(out_dir) / f"rank{rank}.json"
    path.write_text(json.dumps(result, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    # A failed rank exits at once: tearing down gloo after a failed collective can block.
    os._exit(code)
