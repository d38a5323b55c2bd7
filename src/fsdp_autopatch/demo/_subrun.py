"""The parent side of a sub-run: start two ranks with the shared launcher, collect their reports.

A sub-run's outcome is a :class:`RunResult`: each rank's JSON report (see ``_worker``), its exit
code, its output tail and what it was doing last; :meth:`RunResult.failures` orders what went
wrong, likely cause first, and :func:`describe_failure` says it in one line.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._launch import launch, port_taken, rank_results, retry_on_taken_port
from ..cases._four_bugs import WORLD_SIZE
from ._scenarios import FAIL_GRACE_S, RUN_TIMEOUT_S, Scenario

# Kept from an inherited environment: how much the plugin logs does not change what a run does.
KEEP_ENV = ("FSDP_AUTOPATCH_LOG_LEVEL",)
OUTPUT_TAIL_LINES = 12


@dataclass(frozen=True)
class Failure:
    rank: int
    kind: str  # "crash" (died without a report), "exception" or "killed" (by the demo)
    text: str  # the error message (for a crash: the native error it printed)
    where: str = ""  # what the rank was doing, if it could tell
    error_type: str = ""


@dataclass
class RunResult:
    scenario: Scenario
    seconds: float
    returncodes: list[int | None]
    ranks: list[dict[str, Any] | None]  # each rank's JSON report (None if it died without one)
    output_tails: list[str]
    killed: list[int]  # ranks the demo had to kill (stuck in a collective or past the timeout)
    last_where: list[str]  # what each rank was last doing
    timed_out: bool
    timeout_s: float

    @property
    def rank0(self) -> dict[str, Any]:
        return self.ranks[0] or {}

    def failures(self) -> list[Failure]:
        """Every rank's failure, the likely cause first.

        A rank that died natively (gloo aborts on a collective size mismatch) comes first, since
        its peer's error is then only "connection reset"; then Python exceptions in the order they
        happened; then ranks the demo killed because they were still waiting for their peer.
        """
        crashes, exceptions, killed = [], [], []
        for rank, report in enumerate(self.ranks):
            if rank in self.killed:
                killed.append(Failure(rank, "killed", "killed by the demo", self.last_where[rank]))
            elif report and report.get("error"):
                error = report["error"]
                exceptions.append((error.get("time", 0.0), Failure(
                    rank, "exception", error["message"], error["where"], error["type"])))
            elif report is None and self.returncodes[rank] != 0:
                text = _native_error(self.output_tails[rank])
                crashes.append(Failure(rank, "crash", text, error_type=f"exit {self.returncodes[rank]}"))
        return crashes + [f for _, f in sorted(exceptions, key=lambda item: item[0])] + killed


def _native_error(output: str) -> str:
    """The message a natively aborted rank printed (C++ 'what():' line), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("what():"):
            return line[len("what():"):].strip()
    return lines[-1] if lines else "no output"


def run_scenario(scenario: Scenario, timeout_s: float = RUN_TIMEOUT_S, bug: str = "",
                 world_size: int = WORLD_SIZE) -> RunResult:
    """Run one sub-run of ``scenario`` (the demo's training, or ``bug``'s show) and collect the
    ranks' reports.

    The free port is only reserved until the parent closes its probe socket; on a busy machine
    another process can take it before rank 0's store binds it. That run is simply retried.
    """
    return retry_on_taken_port(
        lambda port: _run_once(scenario, timeout_s, port, bug, world_size),
        lambda result: any(port_taken(f.text) for f in result.failures()),
        attempts=3,
    )


def _worker_command(scenario: Scenario, rank: int, out_dir: str, timeout_s: float, bug: str) -> list[str]:
    what = ["--bug", bug] if bug else ["--scenario", scenario.key]
    return [sys.executable, "-m", "fsdp_autopatch.demo", "--worker", *what,
            "--rank", str(rank), "--out", out_dir, "--deadline", str(timeout_s + 10)]


def _run_once(scenario: Scenario, timeout_s: float, port: int, bug: str, world_size: int) -> RunResult:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fsdp-autopatch-demo-") as tmp:
        out = Path(tmp)
        run = launch(
            lambda rank: _worker_command(scenario, rank, tmp, timeout_s, bug),
            world_size=world_size, port=port, logs=out, timeout_s=timeout_s,
            env=scenario.env, keep=KEEP_ENV, fail_grace_s=FAIL_GRACE_S, merge_stderr=True,
            tail_chars=None, tail_lines=OUTPUT_TAIL_LINES)
        ranks = rank_results(out, world_size)
        wheres = [_read(out / f"rank{rank}.where") or "startup" for rank in range(world_size)]
    # The demo stopped waiting (its timeout, or the grace after a failed rank) iff it killed a rank.
    return RunResult(scenario, time.monotonic() - start, [r.returncode for r in run.ranks], ranks,
                     [r.stdout for r in run.ranks], run.killed, wheres, bool(run.killed), timeout_s)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def one_line(text: str, limit: int = 200) -> str:
    """First line of an error, without gloo's '[/path/to/file.cc:123] ' prefix."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = re.sub(r"^\[(enforce fail at )?/[^\]]*\]\s*", "", line)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def describe_failure(result: RunResult) -> str:
    """One line about a run that did not complete: its first failure, then what the peers did."""
    failures = result.failures()
    if not failures:
        return f"ranks exited with codes {result.returncodes} without a report"
    first, rest = failures[0], failures[1:]
    if first.kind == "crash":
        text = f"rank {first.rank} aborted ({first.error_type}): {one_line(first.text)}"
    elif first.kind == "exception":
        text = f"{first.error_type}: {one_line(first.text)} (rank {first.rank}, {first.where})"
    else:
        text = (f"timeout: no rank finished within {result.timeout_s:g} s, the demo killed them "
                f"(rank {first.rank} was at: {first.where})")
    for other in rest:
        if other.kind == "killed" and first.kind == "killed":
            text += f"; rank {other.rank} was at: {other.where}"
        elif other.kind == "killed":
            text += (f"; rank {other.rank} was left waiting ({other.where}) "
                     f"and was killed after {FAIL_GRACE_S:g} s")
        elif other.kind == "exception":
            text += f"; rank {other.rank} then raised {other.error_type}: {one_line(other.text, 70)}"
        else:
            text += f"; rank {other.rank} aborted too: {one_line(other.text, 70)}"
    return text
