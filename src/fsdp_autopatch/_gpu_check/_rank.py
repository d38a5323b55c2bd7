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
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any


def _watchdog(deadline_s: float) -> None:
    parent, started = os.getppid(), time.monotonic()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent or time.monotonic() - started > deadline_s:
                os._exit(4)

    threading.Thread(target=watch, name="gpu-check-watchdog", daemon=True).start()


def _plugin_state(loaded_before_import: bool) -> dict[str, Any]:
    """What the plugin says in this rank; ``loaded_before_import``: its bootstrap was imported at
    interpreter start (by the .pth), before this program imported anything."""
    try:
        import fsdp_autopatch

        report = fsdp_autopatch.status().to_dict()
        return {"loaded_by_startup": loaded_before_import, "file": fsdp_autopatch.__file__,
                "bootstrap": report.get("bootstrap"), "torch": report.get("torch"),
                "statuses": {p["name"]: p["status"] for p in report["patches"]}}
    except Exception as exc:  # reported, and judged by the parent
        return {"loaded_by_startup": loaded_before_import, "error": f"{type(exc).__name__}: {exc}"}


class Results:
    def __init__(self, path: Path, rank: int) -> None:
        self.path, self.data = path, {"rank": rank, "cases": {}, "where": "startup"}

    def at(self, where: str) -> None:
        self.data["where"] = where
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, default=str))
        tmp.replace(self.path)


def _error(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc).strip()[:2000], "traceback": traceback.format_exc()[-3000:]}


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--cases", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, default=300.0)
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--cost-json", default="")
    args = parser.parse_args(argv)
    _watchdog(args.deadline)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = Results(Path(args.out) / f"rank{rank}.json", rank)
    results.save()
    loaded_before = "_fsdp_autopatch_bootstrap" in sys.modules  # what the .pth imports at start-up
    code = 0
    try:
        code = _body(args, rank, world_size, results, loaded_before)
    except BaseException as exc:  # setup failed: the parent reports it
        results.data["error"] = _error(exc)
        code = 3
    results.at("done" if code == 0 else results.data["where"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a failed rank must not block in a process group's teardown


def _body(args, rank: int, world_size: int, results: Results, loaded_before: bool) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401  -- the plugin's hook applies the patches here

    from ._net import Ctx

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
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
    options: dict[str, Any] = {"timeout": timedelta(seconds=args.pg_timeout)}
    if args.device == "cuda":
        options["device_id"] = device
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", **options)
    results.data["backend"] = str(dist.get_backend())
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
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
