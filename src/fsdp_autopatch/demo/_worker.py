"""The rank side of the demo: one rank of a sub-run, started by the parent as
``python -m fsdp_autopatch.demo --worker --scenario <key> --rank <r> --out <dir> --deadline <s>``.

The rank trains, rank 0 checks the invariants, and every rank writes ``<dir>/rank<r>.json`` (its
result or its error) and keeps ``<dir>/rank<r>.where`` up to date, so that the parent can say
where a rank was when it had to kill it. torch is imported inside functions only, after the
patches are installed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, NoReturn

from .. import _rank_side as rank_side
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
    import torch
    import torch.distributed.fsdp  # noqa: F401  -- the patches are applied on this import
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # two ranks share two cores
    rank_side.ignore_view_output_warning()  # no output is modified in place here
    if rank == 0:
        result["registry"] = rank_side.registry_snapshot()
        result["torch"] = torch.__version__
    lap("import")
    progress.at("init_process_group")
    rank_side.init_process_group(PG_TIMEOUT_S)
    mesh = init_device_mesh("cpu", (four_bugs.WORLD_SIZE,))
    progress.at("fully_shard")
    model = four_bugs.shard(four_bugs.build_model(), mesh)
    result["fill"] = _enable_fill(model, scenario)
    lap("setup")
    plan = four_bugs.plan()
    run = four_bugs.train(model, plan[rank], four_bugs.STEPS, at=progress.at)
    rank_side.end_process_group()
    lap("train")
    if rank == 0:
        progress.at("checking invariants")
        result["checks"] = {
            "gradients": four_bugs.check_gradients(run, plan),
            "unused_expert": four_bugs.check_unused_expert(run),
            "loss": four_bugs.check_loss(run["losses"]),
        }
        lap("check")


def worker_main(scenario_key: str, rank: int, out_dir: str, deadline_s: float) -> NoReturn:
    """Run one rank of ``scenario_key`` and write its report; exits the process (never returns)."""
    scenario = SCENARIOS[scenario_key]
    run_rank_process(lambda result, progress: _run_rank(scenario, rank, progress, result), rank, out_dir, deadline_s)


def run_rank_process(body: Callable[[dict[str, Any], Progress], None], rank: int, out_dir: str,
                     deadline_s: float) -> NoReturn:
    """One demo rank: a watchdog, ``body(result, progress)``, then ``<out_dir>/rank<r>.json`` (its
    result or its error, with where the rank was and when) and the exit."""
    rank_side.start_watchdog(deadline_s, name="demo-watchdog")
    progress = Progress(Path(out_dir) / f"rank{rank}.where")
    result: dict[str, Any] = {"rank": rank, "error": None}
    path = Path(out_dir) / f"rank{rank}.json"
    rank_side.run_then_exit(lambda: body(result, progress), result,
                            lambda code: rank_side.write_json(path, result),
                            lambda exc: rank_side.error_record(exc, where=progress.where, time=time.time()))
