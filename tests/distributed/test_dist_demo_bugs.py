"""``fsdp-autopatch demo --bug NAME`` as a user runs it, in a subprocess with an outer timeout: the
entry's case shows the failure without its patch (or the right value where this torch has no bug, as
``tests/expected.py`` says) and the right value with it, and exits 0.

Every case's values are tested in ``test_dist_cases.py``; here the command itself, on one fix and one
guard (the guard's error printed whole), so that the demo costs two pairs of launches, not one per entry."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import _dist_checks as ck
from fsdp_autopatch._catalogue import BY_NAME, GUARD

pytestmark = pytest.mark.timeout(200)

BUGS = ("inplace_view_output", "optimizer_unsharded_params_guard")  # a fix and a guard
SUB_RUN_TIMEOUT_S = 60  # the demo kills a sub-run's ranks after this
OUTER_TIMEOUT_S = 2 * SUB_RUN_TIMEOUT_S + 30


def _demo_bug(name: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_AUTOPATCH_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, "-m", "fsdp_autopatch", "demo", "--bug", name, "--timeout", str(SUB_RUN_TIMEOUT_S)],
        capture_output=True, text=True, timeout=OUTER_TIMEOUT_S, env=env,
    )


@pytest.mark.parametrize("name", BUGS)
def test_demo_bug_shows_the_failure_then_the_right_value(name):
    if ck.EXPECTED_STATUS.get(name) == "unsupported":
        pytest.skip(f"{name} is unsupported on this torch: torch left untouched, the demo shows the bug both times")
    run = _demo_bug(name)
    out = run.stdout
    assert run.returncode == 0, f"exit {run.returncode}\n{out}\n{run.stderr[-3000:]}"
    without, _, with_patch = out.partition("with the patch")
    expected = ck.UNPATCHED[ck.ex.BUG_OF[name]]
    if expected == ck.ex.REPRODUCES:
        assert "==> REPRODUCED" in without, out
    elif expected == ck.ex.FIXED:
        assert "==> right: this torch does not have the bug" in without, out
    else:  # a release tests/expected.py has not measured: either outcome, shown
        assert "==> REPRODUCED" in without or "==> right: this torch does not have the bug" in without, out
    assert "\n==> right" in with_patch, out
    if BY_NAME[name].kind == GUARD:  # the guard's error whole, as the user's own run prints it
        assert f"    GuardError: fsdp-autopatch guard {name}: " in with_patch, out
        assert f"set FSDP_AUTOPATCH_{name.upper()}_ENABLED=0.\n" in with_patch, out
    assert f"demo --bug {name}" in out and "upstream:" in out, out
