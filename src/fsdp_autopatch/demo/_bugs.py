"""``fsdp-autopatch demo --bug NAME``: one bug's smallest training, without its patch, then with it.

Each entry's bug has its smallest training in its case (``fsdp_autopatch.cases``, one module per
entry), so each has its own short run: a sub-run with only that patch disabled
(``FSDP_AUTOPATCH_<NAME>_ENABLED=0``) shows the failure or the wrong value, a sub-run with the
plugin as installed shows the right value. Both are bounded by the demo's timeouts. Stdlib only.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from .. import cases
from ._scenarios import RUN_TIMEOUT_S, Scenario
from ._subrun import RunResult, describe_failure, one_line, run_scenario


@dataclass(frozen=True)
class BugShow:
    name: str
    world_size: int
    what: str  # the run, in one line


def _shows() -> dict[str, BugShow]:
    shows = {}
    for name in cases.NAMES:
        module = cases.load(name)
        shows[name] = BugShow(name, module.WORLD_SIZE, module.WHAT)
    return shows


BUG_SHOWS = _shows()


def _variable(name: str) -> str:
    return f"FSDP_AUTOPATCH_{name.upper()}_ENABLED"


def _run(show: BugShow, patched: bool, timeout_s: float) -> RunResult:
    env = {} if patched else {_variable(show.name): "0"}
    title = "plugin as installed" if patched else f"{_variable(show.name)}=0"
    scenario = Scenario(f"bug:{show.name}", title, env=env, patch=show.name)
    return run_scenario(scenario, timeout_s, bug=show.name, world_size=show.world_size)


def _outcome(result: RunResult) -> tuple[bool | None, str]:
    """(right, what happened) of one sub-run, from rank 0's verdict; right is None where the run
    gave no verdict (a rank failed outside the case: a timeout, a crash): the first failure."""
    rank0 = result.rank0
    if "right" in rank0 and not result.failures():
        return bool(rank0["right"]), rank0["value"]
    return None, describe_failure(result)


def _status_line(result: RunResult) -> str:
    status = result.rank0.get("status") or {}
    if not status:
        return "registry unavailable"
    return f"{status.get('status', '?')} ({one_line(status.get('reason', ''), 120)})"


def demo_bug(name: str, timeout_s: float = RUN_TIMEOUT_S) -> int:
    """Exit 0 when the patched run gives the right value (whether or not this torch still has the bug);
    2 when the case cannot run here (its ``NEEDS``: a CUDA device, a package this environment lacks)."""
    show = BUG_SHOWS[name]
    print(f"fsdp-autopatch demo --bug {name}: {show.world_size} CPU ranks (gloo)")
    print(f"  run: {show.what}")
    unmet = cases.unmet(name)
    if unmet:  # a CUDA-only bug, or a package this environment lacks: nothing to show here
        print(f"\nnot run: {unmet}")
        return 2
    off, on = _run(show, False, timeout_s), _run(show, True, timeout_s)
    declared = on.rank0.get("declared") or off.rank0.get("declared") or {}
    if declared:
        upstream = f" (upstream: {declared['upstream']})" if declared["upstream"] else ""
        print(f"  bug: {declared['symptom']}{upstream}")
    off_right, off_text = _outcome(off)
    on_right, on_text = _outcome(on)
    label = {True: "right: this torch does not have the bug", False: "REPRODUCED",
             None: "the run failed before its case gave a record (not necessarily the bug)"}[off_right]
    print(f"\nwithout the patch [{off.seconds:.1f} s]: {off_text}\n==> {label}")
    print(f"\nwith the patch [{on.seconds:.1f} s], {_status_line(on)}: {on_text}")
    if on_right and on.rank0.get("guard_error"):  # whole: it is what the user's own run prints
        print(textwrap.indent(on.rank0["guard_error"], "    "))
    print(f"==> {'right' if on_right else 'WRONG'}" + (f": {declared['summary']}" if on_right and declared else ""))
    return 0 if on_right else 1
