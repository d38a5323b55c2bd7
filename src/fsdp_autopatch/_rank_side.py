"""The rank side of a job that ``_launch`` started: what every rank process of the package does the
same way, for the demo's ranks (``fsdp_autopatch.demo``) and the GPU check's
(``fsdp_autopatch._gpu_check._rank``).

* a watchdog that ends the rank when its launcher goes away or its deadline passes, so that a rank
  stuck in a collective never outlives the job;
* the process group, with a short timeout, and its teardown;
* the plugin's registry as the rank sees it, the record of an exception, and the rank's JSON result,
  written whole or not at all (the parent may read it after killing the rank);
* the way out: :func:`exit_now`, since tearing down gloo or NCCL after a failed collective can block.

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
_WATCH_EVERY_S = 0.5


def start_watchdog(deadline_s: float, name: str = "rank-watchdog") -> None:
    """Exit with :data:`WATCHDOG_EXIT` once the launcher is gone or ``deadline_s`` have passed: a
    rank left waiting in a collective must never become an orphan."""
    parent, started = os.getppid(), time.monotonic()

    def watch() -> None:
        while True:
            time.sleep(_WATCH_EVERY_S)
            if os.getppid() != parent or time.monotonic() - started > deadline_s:
                os._exit(WATCHDOG_EXIT)

    threading.Thread(target=watch, name=name, daemon=True).start()


def registry_snapshot() -> dict[str, Any]:
    """``fsdp_autopatch.status()`` as JSON, taken after torch's FSDP2 was imported (the hook has run);
    ``{"error": ...}`` when the plugin cannot say: informative only, never a rank's failure."""
    try:
        import fsdp_autopatch

        return fsdp_autopatch.status().to_dict()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def error_record(exc: BaseException, *, message_chars: int | None = None, traceback_chars: int = 4000,
                 **context: Any) -> dict[str, Any]:
    """What a rank reports of ``exc`` (call it while handling it): type, message, the traceback's
    tail, then ``context`` (e.g. where the rank was)."""
    return {"type": type(exc).__name__, "message": str(exc).strip()[:message_chars], **context,
            "traceback": traceback.format_exc()[-traceback_chars:]}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` with ``data`` at once: a rank killed while writing leaves the previous file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, default=str))
    tmp.replace(path)


def exit_now(code: int) -> NoReturn:
    """End the rank with ``code`` without Python's teardown: the process group's would block after a
    failed collective, and the result is already written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def init_process_group(timeout_s: float, device: Any = None) -> str:
    """Join the job's process group (its rendezvous is the launcher's environment): NCCL bound to
    ``device`` when it is a CUDA device, else gloo; collectives give up after ``timeout_s``. Returns
    the backend's name."""
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


def run_then_exit(work: Callable[[], object], result: dict[str, Any], save: Callable[[int], None],
                  record: Callable[[BaseException], dict[str, Any]] = error_record) -> NoReturn:
    """Run ``work()``; if it raises anything (a gloo error, a KeyboardInterrupt), ``result["error"]`` is
    ``record(exc)``; then ``save(code)`` writes the result and the rank exits with ``code`` (0, or
    :data:`FAILED_EXIT`), at once: a failed rank must not block in the process group's teardown."""
    code = 0
    try:
        work()
    except BaseException as exc:  # every failure is reported to the parent, which judges it
        result["error"] = record(exc)
        code = FAILED_EXIT
    save(code)
    exit_now(code)
