"""optimizer_unsharded_params_guard: an optimizer built after a no-grad forward (2 gloo ranks).

Scenario ``optimizer_unsharded_params_guard`` (``_optimizer_unsharded_params_guard_scenarios``): two ``Linear``
units and a root-owned ``head``; 3 SGD steps per case, against a one-process reference.

* patch off, case ``bug``: the optimizer got the root's ``head.weight`` / ``head.bias`` as plain
  (unsharded) tensors; after 3 steps they equal their initial values exactly, and the weights
  differ from the reference;
* patch on, case ``bug``: the first ``step()`` raises ``GuardError`` on every rank, naming the
  guard, ``head.weight [4, 8]`` / ``head.bias [4]`` with their places, the fix and the toggle;
  ``fired`` is 1 on every rank (the right cases ran before it and stayed silent);
* either way, cases ``optimizer_first``, ``reshard`` and ``explicit_reshard``: no error, every
  optimizer parameter a DTensor, weights equal the reference within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _dist_common as sc
import _optimizer_unsharded_params_guard_scenarios as ou
from _dist_launcher import RunResult

pytestmark = pytest.mark.timeout(300)

PATCH = "optimizer_unsharded_params_guard"
BUG = ck.ex.BUG_OF[PATCH]
RIGHT_CASES = ("optimizer_first", "reshard", "explicit_reshard")
ROOT_PARAMS = ("head.weight", "head.bias")
MIN_DIFF = 1e-3  # measured |w - ref| of head.* after 3 steps: 3.0e-2 / 7.1e-2 on 2.13


unpatched, patched = ck.off_and_on("optimizer_unsharded_params_guard", PATCH)


def reference() -> dict[str, torch.Tensor]:
    """One process, the full batch (the mean of every rank's loss), 3 SGD steps."""
    model = ou.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=ou.LR)
    for step in range(ou.STEPS):
        (sum(ou.loss(model, rank, step) for rank in range(sc.WORLD_SIZE)) / sc.WORLD_SIZE).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], name: str) -> float:
    return float((a[name] - b[name]).abs().max())


def assert_right(run: RunResult, case: str) -> None:
    ref = reference()
    for rank in run.ranks:
        rec = rank.cases[case]
        assert rec["error"] is None, rec["error"]
        assert rec["optimizer_params"] == ["DTensor"] * 6, rec["optimizer_params"]
        for name, want in ref.items():
            torch.testing.assert_close(rec["final"][name], want, rtol=ck.FP32_RTOL, atol=ck.FP32_ATOL)
        assert all(max_diff(rec["final"], rec["init"], n) > MIN_DIFF for n in ROOT_PARAMS)  # the root trained


def test_unpatched(unpatched):
    """The optimizer holds the root's unsharded parameters: they never move, silently."""
    unpatched.assert_clean()
    ck.assert_registry_with_disabled(unpatched, PATCH)
    ref = reference()
    moved, off_ref = {}, {}
    for rank in unpatched.ranks:
        rec = rank.cases["bug"]
        assert rec["error"] is None, rec["error"]
        moved = {n: max_diff(rec["final"], rec["init"], n) for n in ROOT_PARAMS}
        off_ref = {n: max_diff(rec["final"], ref, n) for n in ROOT_PARAMS}
        if rec["optimizer_params"][4:] == ["plain", "plain"]:
            assert rec["optimizer_params"][:4] == ["DTensor"] * 4, rec["optimizer_params"]
            assert all(torch.equal(rec["final"][n], rec["init"][n]) for n in ROOT_PARAMS), moved
            assert all(d > MIN_DIFF for d in off_ref.values()), off_ref
            outcome = ck.ex.REPRODUCES
        else:
            assert rec["optimizer_params"] == ["DTensor"] * 6, rec["optimizer_params"]
            outcome = ck.ex.FIXED
    detail = (
        f"the optimizer holds head.weight/head.bias unsharded: moved {moved['head.weight']:.1e}/"
        f"{moved['head.bias']:.1e} in {ou.STEPS} steps, |w - ref| {off_ref['head.weight']:.1e}/"
        f"{off_ref['head.bias']:.1e}"
        if outcome == ck.ex.REPRODUCES
        else "the optimizer holds the sharded parameters"
    )
    ck.expect_unpatched(BUG, outcome, detail, unpatched)


@pytest.mark.parametrize("case", RIGHT_CASES)
def test_unpatched_right_cases(unpatched, case):
    assert_right(unpatched, case)


def test_patched_stops_the_first_step(patched):
    patched.assert_clean()
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    if ck.EXPECTED_STATUS[PATCH] != "applied":
        assert_right(patched, "bug")
        return
    for rank in patched.ranks:
        rec = rank.cases["bug"]
        assert rec["optimizer_params"][4:] == ["plain", "plain"], rec["optimizer_params"]
        error = rec["error"]
        assert error is not None and error["type"] == "GuardError", error
        message = error["message"]
        for fragment in (
            f"fsdp-autopatch guard {PATCH}: SGD holds 2 FSDP2 unsharded parameter(s)",
            "head.weight [4, 8] (param_groups[0]['params'][4]), head.bias [4] (param_groups[0]['params'][5])",
            "Build the optimizer before the first forward, or call model.reshard()",
            f"{ck.ENV[PATCH]}=0",
        ):
            assert fragment in message, message
        assert "optimizer.step()" in error["traceback"], error["traceback"]  # raised by the step itself
        assert "final" not in rec  # stopped at the first step
    assert ck.fired(patched, PATCH) == [1] * len(patched.ranks)  # the right cases ran first, silent
    ck.assert_fired_where_applied(patched, PATCH)


@pytest.mark.parametrize("case", RIGHT_CASES)
def test_patched_right_cases_are_silent(patched, case):
    patched.assert_clean()
    assert_right(patched, case)


def test_patched_observed(patched):
    patched.assert_clean()
    if ck.EXPECTED_STATUS[PATCH] == "applied":
        for rank in patched.ranks:
            assert rank.cases["bug"]["error"]["type"] == "GuardError"
        detail = "GuardError at the first step on every rank, naming head.weight/head.bias and the fix"
    else:
        detail = "the optimizer holds the sharded parameters"
    ck.observe_patched(BUG, detail + "; the right cases equal the reference, silent")
