"""Start a 2-rank gloo CPU job made of fresh interpreter subprocesses.

Every rank runs ``python _rank.py <scenario> <result file> <json args>`` (the one rank entry point;
it finds the scenario by name, see ``_registry``) with
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` set, ``CUDA_VISIBLE_DEVICES=""``,
one OpenMP thread, and only the ``FSDP_AUTOPATCH_*`` variables the caller passes (those
inherited from the pytest process are removed so a developer's shell cannot change a
result). Each rank runs in its own session, so on the outer timeout the launcher kills
each rank's whole process group: no rank and no grandchild survives a run.

Starting, bounding and killing the ranks, the port retry and the output tails are the
package's launcher (``fsdp_autopatch._launch``, shared with ``fsdp-autopatch demo``); this
module adds what the tests need on top: the rank entry point, its results and the summaries.

A rank saves its measurements with ``torch.save`` into a per-run temporary directory;
``run_ranks`` loads them and returns them together with each rank's exit code and the
tail of its stdout/stderr.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_autopatch import _launch

HERE = Path(__file__).resolve().parent
RANK_ENTRY = HERE / "_rank.py"

WORLD_SIZE = 2
DEFAULT_TIMEOUT_S = 120.0  # outer timeout for the whole job (all ranks)
PG_TIMEOUT_S = 30  # timeout of the gloo process group inside each rank
_TAIL_CHARS = 4000
# On top of the shared launcher's defaults, for every process a test starts.
_TEST_DEFAULTS = {
    "MKL_NUM_THREADS": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "FSDP_DIST_PG_TIMEOUT_S": str(PG_TIMEOUT_S),
}


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
    return _launch.free_port()


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


def base_env(env: dict[str, str] | None) -> dict[str, str]:
    """The environment of a process a test starts (a torchrun agent, a rank), before its rank."""
    return _launch.job_environ({**_TEST_DEFAULTS, **(env or {})})


def _load(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - report as "saved nothing"
        print(f"cannot load {path}: {type(e).__name__}: {e}", file=sys.stderr)
        return None


TEARDOWN_ABORT = "terminate called without an active exception"


def run_agents(
    jobs: list[tuple[list[str], dict[str, str]]], timeout: float, cwd: Path | str | None = None,
    ranks: int | None = None,
) -> list[subprocess.CompletedProcess]:
    """Start launcher commands (torchrun, accelerate launch) at once and collect their output.

    Each starts its own session; on ``timeout`` (for all of them together) every session is
    killed with its ranks and an AssertionError carries what they printed. Nothing survives a call.

    ``ranks``: how many ``{"rank": ...}`` reports the script prints. A run that failed only by gloo's
    abort at interpreter exit, after every rank had reported, is run once more (docs/troubleshooting.md:
    gloo's worker releasing a work launched in backward while the interpreter finalizes, with or
    without the plugin, rare). The examples run here are users' scripts, left as users write them;
    a script of our own leaves with ``os._exit`` instead. That abort says nothing of the run, and a
    second one is reported as it is.
    """
    results = _run_agents_once(jobs, timeout, cwd)
    if ranks is not None and _only_the_teardown_abort(results, ranks):
        print("only gloo's teardown abort after every rank reported: run again\n"
              + "\n".join(f"--- exit {r.returncode}\n{r.stderr[-1500:]}" for r in results))
        results = _run_agents_once(jobs, timeout, cwd)
    return results


def _only_the_teardown_abort(results: list[subprocess.CompletedProcess], ranks: int) -> bool:
    failed = any(r.returncode != 0 for r in results)
    reported = sum(r.stdout.count('{"rank"') for r in results)
    return failed and reported >= ranks and any(TEARDOWN_ABORT in r.stderr for r in results)


def _run_agents_once(
    jobs: list[tuple[list[str], dict[str, str]]], timeout: float, cwd: Path | str | None
) -> list[subprocess.CompletedProcess]:
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
                    _launch.kill_group(a)
                # every agent's output: the one that hangs is often not the one waited for
                printed = [(a.args, *a.communicate()) for a in agents[len(results):]]
                report = "\n".join(f"--- {args}\n{out}\n{err[-3000:]}" for args, out, err in printed)
                raise AssertionError(f"timed out after {timeout:.0f} s: {agent.args}\n{report}") from None
            results.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    finally:
        for agent in agents:  # a rank or grandchild left behind by a finished agent
            _launch.kill_group(agent)
    return results


def run_ranks(
    scenario: str,
    *,
    args: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    world_size: int = WORLD_SIZE,
    timeout: float = DEFAULT_TIMEOUT_S,
    script: Path | str = RANK_ENTRY,
    rank_env: dict[int, dict[str, str]] | None = None,
) -> RunResult:
    """Run ``scenario`` on ``world_size`` ranks; never hangs longer than ``timeout``.

    ``rank_env`` adds variables to single ranks only (a node whose environment differs).

    A job whose rendezvous port was taken in the meantime (other jobs run on this machine
    too) is run once more on a new port.
    """
    args = dict(args or {})
    env = dict(env or {})
    return _launch.retry_on_taken_port(
        lambda port: _run_once(scenario, args, env, world_size, timeout, Path(script), rank_env or {}, port),
        lambda run: not run.timed_out and any(_port_taken(r) for r in run.ranks),
        # resolved at each call: a test replaces this module's free_port
        port_source=lambda: free_port(),
    )


def _port_taken(rank: RankResult) -> bool:
    return _launch.port_taken(rank.stderr_tail + str(rank.error or ""))


def _run_once(
    scenario: str,
    args: dict[str, Any],
    env: dict[str, str],
    world_size: int,
    timeout: float,
    script: Path,
    rank_env: dict[int, dict[str, str]],
    port: int,
) -> RunResult:
    tmp = Path(tempfile.mkdtemp(prefix=f"fsdp_dist_{scenario}_"))
    try:
        launch = _launch.launch(
            lambda rank: [sys.executable, str(script), scenario, str(tmp / f"rank{rank}.pt"), json.dumps(args)],
            world_size=world_size,
            port=port,
            logs=tmp,
            timeout_s=timeout,
            env={**_TEST_DEFAULTS, **env},
            rank_env=rank_env,
            cwd=tmp,
            tail_chars=_TAIL_CHARS,
        )
        ranks = [
            RankResult(
                rank=r.rank,
                returncode=None if r.killed else r.returncode,  # None: killed on timeout
                stdout_tail=r.stdout,
                stderr_tail=r.stderr,
                data=_load(tmp / f"rank{r.rank}.pt"),
            )
            for r in launch.ranks
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return RunResult(scenario, args, env, ranks, launch.timed_out, launch.elapsed_s)
