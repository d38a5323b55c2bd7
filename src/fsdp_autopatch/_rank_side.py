"""The rank side of a job ``_launch`` started, as the demo's ranks (``fsdp_autopatch.demo``) and the
GPU check's (``fsdp_autopatch._gpu_check._rank``) both do it: a watchdog, so that a rank stuck in a
collective never outlives its job; the process group with a short timeout; the plugin's registry as
the rank sees it; the record of an exception; the rank's JSON result, written whole or not at all;
and the exit without Python's teardown, since gloo's or NCCL's can block after a failed collective.

Standard library at import; torch is imported inside functions only, after the plugin's hook ran.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NoReturn

FAILED_EXIT = 3  # the rank's work raised: its JSON result says what
WATCHDOG_EXIT = 4  # the rank overstayed its deadline or lost its launcher


def start_watchdog(deadline_s: float, name: str = "rank-watchdog") -> None:
    """Exit with :data:`WATCHDOG_EXIT` once the launcher is gone or ``deadline_s`` have passed."""
    parent, started = os.getppid(), time.monotonic()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent or time.monotonic() - started > deadline_s:
                os._exit(WATCHDOG_EXIT)

    threading.Thread(target=watch, name=name, daemon=True).start()


def registry_snapshot() -> dict[str, Any]:
    """``fsdp_autopatch.status()`` as JSON, or ``{"error": ...}``: informative, never a rank's failure."""
    try:
        import fsdp_autopatch

        return fsdp_autopatch.status().to_dict()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def error_record(exc: BaseException, *, message_chars: int | None = None, traceback_chars: int = 4000,
                 **context: Any) -> dict[str, Any]:
    """``exc`` as a rank reports it (called while handling it), with ``context`` (where the rank was)."""
    return {"type": type(exc).__name__, "message": str(exc).strip()[:message_chars], **context,
            "traceback": traceback.format_exc()[-traceback_chars:]}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` at once: a rank killed while writing leaves the previous result."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, default=str))
    tmp.replace(path)


def run_then_exit(work: Callable[[], object], result: dict[str, Any], save: Callable[[int], None],
                  record: Callable[[BaseException], dict[str, Any]] = error_record) -> NoReturn:
    """Run ``work()``; whatever it raises (a gloo error too) becomes ``result["error"] = record(exc)``;
    then ``save(code)`` and exit with ``code``, 0 or :data:`FAILED_EXIT`."""
    code = 0
    try:
        work()
    except BaseException as exc:  # every failure goes to the parent, which judges it
        result["error"] = record(exc)
        code = FAILED_EXIT
    save(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def init_process_group(timeout_s: float, device: Any = None) -> str:
    """Join the launcher's job: NCCL bound to ``device`` when it is a CUDA device, else gloo;
    collectives give up after ``timeout_s``. Returns the backend's name."""
    from datetime import timedelta

    import torch.distributed as dist

    options: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    cuda = device is not None and device.type == "cuda"
    if cuda:
        options["device_id"] = device
    dist.init_process_group("nccl" if cuda else "gloo", **options)
    return str(dist.get_backend())


def end_process_group() -> None:
    """Wait for every rank, then leave the process group (a rank that raised never gets here)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def ignore_view_output_warning() -> None:
    """torch 2.13 warns whenever an FSDP unit returns a view (any ``nn.Linear`` on a 3-D input does):
    harmless in a training that modifies no output in place."""
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
