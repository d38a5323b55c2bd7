"""Start the ranks of a CPU gloo job as fresh interpreters, bounded in time: standard library only.

One launcher for ``fsdp-autopatch demo`` (``fsdp_autopatch.demo``), ``fsdp-autopatch gpu-check``
and the multi-rank tests (``tests/distributed/_dist_launcher.py``), so that all keep the same guarantees:

* a free rendezvous port on 127.0.0.1, and :func:`retry_on_taken_port` when another process took
  it between the probe and rank 0's bind (the probe socket is closed before the ranks start);
* an environment with only the ``FSDP_AUTOPATCH_*`` variables the caller passes (inherited ones
  are removed, except the names in ``keep``), no variables of a torchrun agent that may have
  started the caller, ``CUDA_VISIBLE_DEVICES=""`` and one OpenMP thread;
* each rank in its own session, killed as a whole process group when the job overstays its
  timeout (or the grace after a first failed rank), and after it finished too: no rank and no
  grandchild survives :func:`launch`;
* the tail of each rank's output, and the JSON result each rank left (:func:`rank_results`).

The caller owns the directory the ranks write their logs (and results) to, and reads what it
needs before removing it. Nothing here imports torch or the rest of the package. What the ranks of
the demo and of ``fsdp-autopatch gpu-check`` do the same way (their watchdog, process group, error
record and JSON result) is :mod:`fsdp_autopatch._rank_side`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

ENV_PREFIX = "FSDP_AUTOPATCH_"
# Set by a torchrun agent for its own workers: a rank started here is not one of them.
_AGENT_VARIABLES = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK")
# What every process of a job gets unless the caller's env says otherwise.
JOB_DEFAULTS = {
    "MASTER_ADDR": "127.0.0.1",
    "CUDA_VISIBLE_DEVICES": "",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
_KILL_WAIT_S = 10.0  # SIGKILL cannot be ignored: a killed rank is reaped well within this
_POLL_S = 0.05

T = TypeVar("T")


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (see :func:`retry_on_taken_port`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_taken(text: str) -> bool:
    """Whether an error text says that the rendezvous port was already bound."""
    lowered = text.lower()
    return "eaddrinuse" in lowered or "address already in use" in lowered


def retry_on_taken_port(
    attempt: Callable[[int], T],
    taken: Callable[[T], bool],
    *,
    attempts: int = 2,
    port_source: Callable[[], int] = free_port,
) -> T:
    """Run ``attempt(port)`` on a fresh port until ``taken(result)`` is false; ``attempts`` at most."""
    for number in range(1, attempts + 1):
        result = attempt(port_source())
        if number == attempts or not taken(result):
            return result
    raise ValueError(f"attempts must be at least 1, not {attempts}")


def job_environ(env: Mapping[str, str] | None = None, keep: Iterable[str] = ()) -> dict[str, str]:
    """This process's environment as a job's process gets it, before its rank is set.

    Inherited ``FSDP_AUTOPATCH_*`` variables are removed (except the names in ``keep``) so that
    the caller's shell cannot change what a job runs; then :data:`JOB_DEFAULTS`, then ``env``.
    """
    kept = set(keep)
    out = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) or k in kept}
    for name in _AGENT_VARIABLES:
        out.pop(name, None)
    out.update(JOB_DEFAULTS)
    out.update(env or {})
    return out


def rank_environ(
    rank: int,
    world_size: int,
    port: int,
    env: Mapping[str, str] | None = None,
    keep: Iterable[str] = (),
) -> dict[str, str]:
    """:func:`job_environ` plus the rendezvous variables of ``rank`` (these always win)."""
    out = job_environ(env, keep)
    out.update(
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    return out


@dataclass(frozen=True)
class RankExit:
    rank: int
    returncode: int | None  # as the process ended (-9 when the launcher killed it)
    killed: bool  # still running when the launcher stopped waiting, so the launcher killed it
    stdout: str  # tail of its stdout (with its stderr when merged)
    stderr: str  # tail of its stderr ("" when merged into stdout)


@dataclass(frozen=True)
class Launch:
    ranks: list[RankExit]
    timed_out: bool  # the outer timeout expired with a rank still running
    elapsed_s: float

    @property
    def killed(self) -> list[int]:
        """Ranks the launcher had to kill (past the timeout, or past the grace after a failure)."""
        return [r.rank for r in self.ranks if r.killed]


def launch(
    command: Callable[[int], Sequence[str]],
    *,
    world_size: int,
    port: int,
    logs: Path,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
    keep: Iterable[str] = (),
    fail_grace_s: float | None = None,
    merge_stderr: bool = False,
    cwd: Path | str | None = None,
    tail_chars: int | None = 4000,
    tail_lines: int | None = None,
) -> Launch:
    """Run ``command(rank)`` for every rank and wait; never longer than ``timeout_s`` from the start.

    ``env`` goes to every rank, ``rank_env[rank]`` to one rank only (both on top of
    :func:`job_environ`). With ``fail_grace_s``, once a rank exited non-zero its peers get that
    long to end too: a rank that failed alone leaves its peers waiting in a collective. Output
    goes to ``logs/rank<r>.stdout`` and ``.stderr`` (stderr into stdout with ``merge_stderr``);
    each :class:`RankExit` carries its last ``tail_chars`` characters, then last ``tail_lines``
    lines (``None``: no limit).
    """
    keep = tuple(keep)
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    stopped_by = None
    try:
        for rank in range(world_size):
            rank_vars = {**(env or {}), **((rank_env or {}).get(rank) or {})}
            procs.append(_start(command(rank), rank_environ(rank, world_size, port, rank_vars, keep),
                                logs, rank, merge_stderr, cwd))
        stopped_by = _wait(procs, start + timeout_s, fail_grace_s)
    finally:
        running = [p.poll() is None for p in procs]
        # Also whatever a finished rank left behind in its process group.
        for proc in procs:
            kill_group(proc)
        for proc in procs:
            try:
                proc.wait(timeout=_KILL_WAIT_S)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
                pass
    elapsed = time.monotonic() - start
    ranks = [
        RankExit(
            rank=rank,
            returncode=proc.returncode,
            killed=running[rank],
            stdout=tail(logs / f"rank{rank}.stdout", tail_chars, tail_lines),
            stderr="" if merge_stderr else tail(logs / f"rank{rank}.stderr", tail_chars, tail_lines),
        )
        for rank, proc in enumerate(procs)
    ]
    return Launch(ranks, timed_out=stopped_by == "timeout", elapsed_s=elapsed)


def _start(
    cmd: Sequence[str], env: dict[str, str], logs: Path, rank: int, merge_stderr: bool, cwd
) -> subprocess.Popen:
    # The child holds its own descriptors: the parent's copies can be closed at once.
    with open(logs / f"rank{rank}.stdout", "wb") as out:
        if merge_stderr:
            return _popen(cmd, env, out, subprocess.STDOUT, cwd)
        with open(logs / f"rank{rank}.stderr", "wb") as err:
            return _popen(cmd, env, out, err, cwd)


def _popen(cmd, env, stdout, stderr, cwd) -> subprocess.Popen:
    return subprocess.Popen(
        list(cmd), env=env, cwd=None if cwd is None else str(cwd), stdin=subprocess.DEVNULL,
        stdout=stdout, stderr=stderr, start_new_session=True)


def _wait(procs: list[subprocess.Popen], deadline: float, fail_grace_s: float | None) -> str | None:
    """Wait for every rank; why the launcher stopped waiting with a rank still running, or None.

    "timeout": ``deadline`` passed; "grace": a rank failed and its peers overstayed the grace.
    """
    grace_end = None
    while any(p.poll() is None for p in procs):
        failed = any(p.poll() not in (None, 0) for p in procs)
        if grace_end is None and fail_grace_s is not None and failed:
            grace_end = time.monotonic() + fail_grace_s
        now = time.monotonic()
        if now > deadline:
            return "timeout"
        if grace_end is not None and now > grace_end:
            return "grace"
        time.sleep(_POLL_S)
    return None


def rank_results(folder: Path, world_size: int) -> list[dict | None]:
    """Each rank's ``folder/rank<r>.json`` (as ``_rank_side.write_json`` wrote it), None where it left none."""
    results: list[dict | None] = []
    for rank in range(world_size):
        try:
            results.append(json.loads((folder / f"rank{rank}.json").read_text()))
        except (OSError, ValueError):  # the rank died before its first result
            results.append(None)
    return results


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process's whole group: it was started in its own session, so its pgid is its pid."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        if proc.poll() is None:
            proc.kill()


def tail(path: Path, chars: int | None = None, lines: int | None = None) -> str:
    """The end of a log: its last ``chars`` characters, then of those its last ``lines`` lines."""
    try:
        with open(path, "rb") as file:
            if chars is not None:
                file.seek(0, os.SEEK_END)
                file.seek(max(0, file.tell() - chars))
            text = file.read().decode("utf-8", "replace")
    except OSError:
        return ""
    if lines is not None:
        text = "\n".join(text.splitlines()[-lines:])
    return text
