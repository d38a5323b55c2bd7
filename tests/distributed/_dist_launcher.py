"""Start a 2-rank gloo CPU job made of fresh interpreter subprocesses.

Every rank runs ``python _dist_scenarios.py <scenario> <result file> <json args>`` with
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` set, ``CUDA_VISIBLE_DEVICES=""``,
one OpenMP thread, and only the ``FSDP_AUTOPATCH_*`` variables the caller passes (those
inherited from the pytest process are removed so a developer's shell cannot change a
result). Each rank runs in its own session, so on the outer timeout the launcher kills
each rank's whole process group: no rank and no grandchild survives a run.

A rank saves its measurements with ``torch.save`` into a per-run temporary directory;
``run_ranks`` loads them and returns them together with each rank's exit code and the
tail of its stdout/stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCENARIOS = HERE / "_dist_scenarios.py"

WORLD_SIZE = 2
DEFAULT_TIMEOUT_S = 120.0  # outer timeout for the whole job (all ranks)
PG_TIMEOUT_S = 30  # timeout of the gloo process group inside each rank
_TAIL_CHARS = 4000


def fsdp2_gloo_skip_reason() -> str | None:
    """Why FSDP2 jobs cannot run on gloo/CPU with this torch, or None (used by the conftests)."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # pragma: no cover
        return f"torch not importable: {e}"
    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available"
    from packaging.version import Version

    if Version(Version(torch.__version__.split("+")[0]).base_version) < Version("2.8"):
        return "FSDP2 on gloo/CPU needs torch >= 2.8"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: still running when the launcher gave up (then killed)
    stdout_tail: str
    stderr_tail: str
    data: dict[str, Any] | None  # what the rank saved, None if it saved nothing

    @property
    def error(self) -> dict[str, str] | None:
        return None if self.data is None else self.data.get("error")

    @property
    def cases(self) -> dict[str, Any]:
        return {} if self.data is None else self.data.get("cases", {})

    @property
    def autopatch(self) -> dict[str, Any] | None:
        return None if self.data is None else self.data.get("autopatch")


@dataclass
class RunResult:
    scenario: str
    args: dict[str, Any]
    env: dict[str, str]
    ranks: list[RankResult]
    timed_out: bool
    elapsed_s: float

    def __getitem__(self, rank: int) -> RankResult:
        return self.ranks[rank]

    def describe(self) -> str:
        """Human-readable summary for assertion messages."""
        lines = [
            f"scenario={self.scenario!r} args={self.args} env={self.env} "
            f"timed_out={self.timed_out} elapsed={self.elapsed_s:.1f}s"
        ]
        for r in self.ranks:
            err = r.error
            lines.append(
                f"--- rank {r.rank}: returncode={r.returncode} "
                f"saved={'yes' if r.data is not None else 'NO'} "
                f"cases={sorted(r.cases)} error={err['type'] + ': ' + err['message'] if err else None}"
            )
            if err and err.get("traceback"):
                lines.append("    traceback (tail):\n" + err["traceback"][-2000:])
            if r.stderr_tail.strip():
                lines.append("    stderr (tail):\n" + r.stderr_tail[-2000:])
        return "\n".join(lines)

    def assert_clean(self) -> None:
        """Every rank finished its scenario without error, in time."""
        problems = []
        if self.timed_out:
            problems.append("timed out")
        for r in self.ranks:
            if r.data is None:
                problems.append(f"rank {r.rank} saved no result")
            elif r.error is not None:
                problems.append(f"rank {r.rank} raised {r.error['type']}")
            if r.returncode != 0:
                problems.append(f"rank {r.rank} exit code {r.returncode}")
        if problems:
            raise AssertionError("; ".join(problems) + "\n" + self.describe())


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _TAIL_CHARS))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen) -> None:
    # Each rank is a session leader (start_new_session=True): its pgid is its pid.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def base_env(env: dict[str, str] | None) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_AUTOPATCH_")}
    for k in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        out.pop(k, None)
    out.update(
        MASTER_ADDR="127.0.0.1",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",
        FSDP_DIST_PG_TIMEOUT_S=str(PG_TIMEOUT_S),
    )
    out.update(env or {})
    return out


def _load(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - report as "saved nothing"
        print(f"cannot load {path}: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def run_agents(
    jobs: list[tuple[list[str], dict[str, str]]], timeout: float, cwd: Path | str | None = None
) -> list[subprocess.CompletedProcess]:
    """Start launcher commands (torchrun, accelerate launch) at once and collect their output.

    Each starts its own session; on ``timeout`` (for all of them together) every session is
    killed with its ranks and an AssertionError carries what they printed. Nothing survives a call.
    """
    agents = [
        subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        for cmd, env in jobs
    ]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for agent in agents:
            try:
                out, err = agent.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for a in agents:
                    _kill_group(a)
                # every agent's output: the one that hangs is often not the one waited for
                printed = [(a.args, *a.communicate()) for a in agents[len(results):]]
                report = "\n".join(f"--- {args}\n{out}\n{err[-3000:]}" for args, out, err in printed)
                raise AssertionError(f"timed out after {timeout:.0f} s: {agent.args}\n{report}") from None
            results.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    finally:
        for agent in agents:  # a rank or grandchild left behind by a finished agent
            _kill_group(agent)
    return results


def run_ranks(
    scenario: str,
    *,
    args: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    world_size: int = WORLD_SIZE,
    timeout: float = DEFAULT_TIMEOUT_S,
    script: Path | str = SCENARIOS,
    rank_env: dict[int, dict[str, str]] | None = None,
) -> RunResult:
    """Run ``scenario`` on ``world_size`` ranks; never hangs longer than ``timeout``.

    ``rank_env`` adds variables to single ranks only (a node whose environment differs).

    A job whose rendezvous port was taken in the meantime (other jobs run on this machine
    too) is run once more on a new port.
    """
    args = dict(args or {})
    env = dict(env or {})
    for attempt in range(2):
        run = _run_once(scenario, args, env, world_size, timeout, Path(script), rank_env or {})
        if attempt or run.timed_out or not any(_port_taken(r) for r in run.ranks):
            return run
    return run  # pragma: no cover


def _port_taken(rank: RankResult) -> bool:
    text = (rank.stderr_tail + str(rank.error or "")).lower()
    return "eaddrinuse" in text or "address already in use" in text


def _run_once(
    scenario: str,
    args: dict[str, Any],
    env: dict[str, str],
    world_size: int,
    timeout: float,
    script: Path,
    rank_env: dict[int, dict[str, str]],
) -> RunResult:
    tmp = Path(tempfile.mkdtemp(prefix=f"fsdp_dist_{scenario}_"))
    port = free_port()
    procs: list[subprocess.Popen] = []
    files = []
    start = time.monotonic()
    timed_out = False
    try:
        for rank in range(world_size):
            env_of_rank = base_env({**env, **rank_env.get(rank, {})})
            env_of_rank.update(
                MASTER_PORT=str(port),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
            )
            out = open(tmp / f"rank{rank}.stdout", "wb")
            err = open(tmp / f"rank{rank}.stderr", "wb")
            files += [out, err]
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(script),
                        scenario,
                        str(tmp / f"rank{rank}.pt"),
                        json.dumps(args),
                    ],
                    env=env_of_rank,
                    cwd=str(tmp),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
            )
        deadline = start + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        # Kill whatever is left (timeout, or an exception in the launcher itself) and
        # also any grandchild that a finished rank left behind in its process group.
        for p in procs:
            _kill_group(p)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
                pass
        for f in files:
            f.close()
    elapsed = time.monotonic() - start
    try:
        ranks = [
            RankResult(
                rank=rank,
                # None: killed by the launcher on timeout (it was still running)
                returncode=None if timed_out and p.returncode == -signal.SIGKILL else p.returncode,
                stdout_tail=_tail(tmp / f"rank{rank}.stdout"),
                stderr_tail=_tail(tmp / f"rank{rank}.stderr"),
                data=_load(tmp / f"rank{rank}.pt"),
            )
            for rank, p in enumerate(procs)
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return RunResult(scenario, args, env, ranks, timed_out, elapsed)
