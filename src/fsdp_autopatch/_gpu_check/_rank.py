"""One rank of a ``fsdp-autopatch gpu-check`` launch, run by the interpreter the check runs in:

    python -m fsdp_autopatch._gpu_check._rank --device cuda|cpu --cases NAME,train_eager,compile_whole,... --out DIR
        [--deadline S] [--pg-timeout S] [--compile-backend NAME] [--cost-json '{...}']

The plugin is whatever that interpreter's ``.pth`` activated when torch's FSDP2 was imported (the
launch's ``FSDP_AUTOPATCH_*`` variables decide which patches); nothing here installs it. The cases
run one after the other; after each, ``DIR/rank<r>.json`` is rewritten with everything so far, so
that a rank killed by a native abort or the launcher's timeout still reports the cases before.
A watchdog ends the rank when its launcher goes away or ``--deadline`` seconds have passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from .. import _rank_side as rank_side


def _plugin_state(loaded_before_import: bool) -> dict[str, Any]:
    """What the plugin says in this rank (an error is reported, and judged by the parent);
    ``loaded_before_import``: its bootstrap was imported at interpreter start (by the .pth), before
    this program imported anything."""
    report = rank_side.registry_snapshot()
    if "error" in report:
        return {"loaded_by_startup": loaded_before_import, "error": report["error"]}
    import fsdp_autopatch

    return {"loaded_by_startup": loaded_before_import, "file": fsdp_autopatch.__file__,
            "bootstrap": report.get("bootstrap"), "torch": report.get("torch"),
            "statuses": {p["name"]: p["status"] for p in report["patches"]}}


class Results:
    def __init__(self, path: Path, rank: int) -> None:
        self.path, self.data = path, {"rank": rank, "cases": {}, "where": "startup"}

    def at(self, where: str) -> None:
        self.data["where"] = where
        self.save()

    def save(self) -> None:
        rank_side.write_json(self.path, self.data)


def _error(exc: BaseException) -> dict[str, str]:
    return rank_side.error_record(exc, message_chars=2000, traceback_chars=3000)


def _run_case(name: str, func, ctx, results: Results) -> None:
    import torch

    results.at(f"case {name}")
    started = time.monotonic()
    entry: dict[str, Any]
    try:
        entry = dict(func(ctx))
        entry.setdefault("right", False)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the case's outcome: the bug's exception (DCP's CheckpointException is
        entry = {"right": False, "error": _error(exc)}  # a BaseException), or ours
    if ctx.device.type == "cuda":
        try:
            torch.cuda.synchronize()  # the case's seconds include its GPU work
        except Exception as exc:  # a CUDA error the case left behind: the case's outcome
            entry = {"right": False, "error": _error(exc)}
    entry["seconds"] = round(time.monotonic() - started, 2)
    results.data["cases"][name] = entry
    results.save()


def main(argv: list[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--cases", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, default=300.0)
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--cost-json", default="")
    args = parser.parse_args(argv)
    rank_side.start_watchdog(args.deadline, name="gpu-check-watchdog")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = Results(Path(args.out) / f"rank{rank}.json", rank)
    results.save()
    loaded_before = "_fsdp_autopatch_bootstrap" in sys.modules  # what the .pth imports at start-up
    # a failed setup is reported to the parent; the rank's "where" stays where it failed
    rank_side.run_then_exit(lambda: _body(args, rank, world_size, results, loaded_before), results.data,
                            lambda code: results.at("done" if code == 0 else results.data["where"]), _error)


def _body(args, rank: int, world_size: int, results: Results, loaded_before: bool) -> None:
    import torch
    import torch.distributed.fsdp  # noqa: F401  -- the plugin's hook applies the patches here

    from ._net import Ctx

    rank_side.ignore_view_output_warning()
    results.data["plugin"] = _plugin_state(loaded_before)
    results.data["torch"] = torch.__version__
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        results.data["device_name"] = torch.cuda.get_device_name(local)
        results.data["cuda"] = torch.version.cuda
    else:
        torch.set_num_threads(1)  # the ranks share the machine's cores
        device = torch.device("cpu")
    results.at("init_process_group")
    results.data["backend"] = rank_side.init_process_group(args.pg_timeout, device)
    ctx = Ctx(rank, world_size, device, args.compile_backend)
    from ._compile import CASES as COMPILE_CASES
    from ._entries import case_for
    from ._training import CASES

    for name in filter(None, args.cases.split(",")):
        _run_case(name, CASES.get(name) or COMPILE_CASES.get(name) or case_for(name), ctx, results)
    if args.cost_json:
        from ._cost import run_cost

        results.at("cost")
        try:
            results.data["cost"] = run_cost(ctx, json.loads(args.cost_json), results.at)
        except Exception as exc:
            results.data["cost"] = {"error": _error(exc), "where": results.data["where"]}
    results.at("barrier")
    rank_side.end_process_group()


if __name__ == "__main__":
    sys.exit(main())
