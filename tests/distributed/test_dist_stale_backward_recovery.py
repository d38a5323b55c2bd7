"""stale_backward_recovery: the steps after a backward that raised on every rank (2 gloo ranks).

Scenario ``stale_backward_recovery`` (``_stale_backward_recovery_scenarios``): ``Net`` with two units and a
root, SGD; step 0's backward raises on every rank, the loop catches it and trains steps 1 and 2.

* patch off: every state stays in PRE_BACKWARD, the next forwards are taken for recomputes: no
  sharded parameter gets a gradient in steps 1 and 2 (0 of 6) and SGD never moves a weight, also
  without ``zero_grad`` and after a hand reset of ``_training_state``; under torch 2.15's manual
  finalization the next ``finalize_backward()`` raises instead;
* patch on: the gradients of steps 1 and 2 and the weights after them equal a one-process
  reference that skipped the failed batch, also without ``zero_grad`` after the exception, after
  torch's ``reset_iter_state()`` (whose 2.13 leaves the failed backward's gradients on the root's
  unsharded parameters), after a hand reset of ``_training_state`` and, on torch 2.15, under
  manual finalization; ``fired`` once per recovery;
* healthy loops (gradient accumulation, two losses and backwards per step, two forwards before one
  backward, activation checkpointing's recompute, manual finalization): never fire, and every
  gradient and weight is bitwise equal with and without the patch.
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _dist_common as sc
import _stale_backward_recovery_scenarios as sb
from _dist_launcher import RunResult

pytestmark = pytest.mark.timeout(300)

PATCH = "stale_backward_recovery"
BUG = ck.ex.BUG_OF[PATCH]
STEPS = (1, 2)


unpatched, patched = ck.off_and_on("stale_backward_recovery", PATCH)


def _cases(run: RunResult, names) -> list[str]:
    return [case for case in names if case in run.ranks[0].cases]


def reference(skip_failed: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """One process, SGD on the mean of every rank's loss: steps 1 and 2 (step 0 skipped, or its
    gradient added into step 1's where ``skip_failed`` is False)."""
    model = sb.build()
    opt = torch.optim.SGD(model.parameters(), lr=sb.LR)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for step in STEPS:
        batches = [(step, r) for r in range(sc.WORLD_SIZE)]
        if step == 1 and not skip_failed:
            batches += [(0, r) for r in range(sc.WORLD_SIZE)]
        for s, rank in batches:
            (sb.loss(model, sb.rank_batch(rank, s)) / sc.WORLD_SIZE).backward()
        out[f"grads{step}"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        out[f"weights{step}"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _skip_where_unsupported() -> None:
    """Before 2.13 (no FSDPState._reset_iter_state) the patch leaves torch untouched: nothing to check."""
    if ck.EXPECTED_STATUS[PATCH] == "unsupported":
        pytest.skip(f"{PATCH} is unsupported on this torch (torch left untouched)")


def _with_grad(run: RunResult, case: str, step: int) -> list[int]:
    return [sum(g is not None for g in rank.cases[case][f"grads{step}"].values()) for rank in run.ranks]


def _assert_clean_case(run: RunResult, case: str) -> None:
    for rank in run.ranks:
        rec = rank.cases[case]
        assert rec["error"] is None, (case, rec["error"])


def test_unpatched(unpatched):
    """Torch left alone: after the failed backward, no sharded parameter gets a gradient again."""
    unpatched.assert_clean()
    if ck.EXPECTED_STATUS[PATCH] == "unsupported":  # recorded, not judged (2.8: the next step raises)
        error = unpatched.ranks[0].cases["failed"]["error"]
        seen = f"the next step raised {error['type']}: {error['message'][:160]}" if error else "no error"
        ck.expect_unpatched(BUG, ck.ex.NOT_MEASURED, seen, unpatched)
        return
    n_params = len(unpatched.ranks[0].cases["failed"]["init"])
    for case in ("failed", "failed_kept_grads", "failed_hand_reset"):
        _assert_clean_case(unpatched, case)
        assert all(rank.cases[case]["caught"] == "injected" for rank in unpatched.ranks)
    counts = {step: _with_grad(unpatched, "failed", step) for step in STEPS}
    init = ck.gather(unpatched, lambda r: r.cases["failed"]["init"])
    after = ck.gather(unpatched, lambda r: r.cases["failed"]["weights2"])
    moved = sorted(n for n in init if not torch.equal(init[n], after[n]))
    if all(c == [0] * sc.WORLD_SIZE for c in counts.values()) and not moved:
        outcome = ck.ex.REPRODUCES
        detail = f"0 of {n_params} sharded parameters got a gradient in the 2 steps after; no weight moved"
    else:
        assert all(c == [n_params] * sc.WORLD_SIZE for c in counts.values()), counts
        outcome, detail = ck.ex.FIXED, "torch recovers by itself"
    for case in ("failed_kept_grads", "failed_hand_reset"):
        assert _with_grad(unpatched, case, 2) == [0] * sc.WORLD_SIZE, case
    ck.expect_unpatched(BUG, outcome, detail, unpatched)
    ck.assert_registry_with_disabled(unpatched, PATCH)


def test_unpatched_manual_finalization_refuses_the_next_finalize(unpatched):
    """Torch 2.15, manual finalization: the failed backward's queued flag makes the next step's
    finalize_backward() raise (measured), on every rank."""
    if "failed_manual" not in unpatched.ranks[0].cases:
        pytest.skip("torch has no set_manual_backward_finalization")
    for rank in unpatched.ranks:
        error = rank.cases["failed_manual"]["error"]
        assert error is not None and error["type"] == "RuntimeError", error
        assert error["message"] == "FSDP finalize_backward must be called after backward completes", error


def test_unpatched_torchs_reset_iter_state(unpatched):
    """Torch's own reset: 2.13 leaves the failed backward's gradients on the root's unsharded
    parameters (added into step 1's); 2.15 drops them (measured)."""
    _skip_where_unsupported()  # torch's reset_iter_state came with 2.13 too
    _assert_clean_case(unpatched, "failed_reset")
    got = ck.gather(unpatched, lambda r: r.cases["failed_reset"]["grads1"])
    right, leaked = reference(True)["grads1"], reference(False)["grads1"]
    head = ["head.weight", "head.bias"]
    if ck.RELEASE >= (2, 15):
        ck.assert_grads_match(got, right)
    else:
        ck.assert_grads_match(got, leaked, head)  # failed batch + step 1
        ck.assert_grads_match(got, right, ["fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias"])


@pytest.mark.parametrize("case", sb.FAILED)
def test_patched_trains_as_if_the_failed_batch_was_never_seen(patched, case):
    if case not in patched.ranks[0].cases:
        pytest.skip("torch has no set_manual_backward_finalization")
    _skip_where_unsupported()
    patched.assert_clean()
    _assert_clean_case(patched, case)
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    ref = reference()
    for step in STEPS:
        ck.assert_grads_match(ck.gather(patched, lambda r, key=f"grads{step}": r.cases[case][key]), ref[f"grads{step}"])
        weights = ck.gather(patched, lambda r, key=f"weights{step}": r.cases[case][key])
        for name, want in ref[f"weights{step}"].items():
            torch.testing.assert_close(weights[name], want, rtol=ck.FP32_RTOL, atol=ck.FP32_ATOL)
    fired = [rank.cases[case]["fired"] for rank in patched.ranks]
    # torch 2.15's reset_iter_state is complete: after it, nothing is left for the patch to do
    want = 0 if case == "failed_reset" and ck.RELEASE >= (2, 15) else 1
    assert fired == [want] * sc.WORLD_SIZE, fired


@pytest.mark.parametrize("case", sb.HEALTHY)
def test_healthy_loops_never_fire_and_are_bitwise_torchs(patched, unpatched, case):
    if case not in patched.ranks[0].cases:
        pytest.skip("torch has no set_manual_backward_finalization")
    _assert_clean_case(patched, case)
    _assert_clean_case(unpatched, case)
    assert [rank.cases[case]["fired"] for rank in patched.ranks] == [0] * sc.WORLD_SIZE
    for on, off in zip(patched.ranks, unpatched.ranks):
        for key in ("grads1", "weights1", "grads2", "weights2"):
            for name, value in off.cases[case][key].items():
                assert value is not None, (case, key, name)
                assert torch.equal(on.cases[case][key][name], value), (case, key, name)


def test_patched_observed(patched):
    patched.assert_clean()
    ck.assert_fired_where_applied(patched, PATCH)
    _skip_where_unsupported()
    ck.observe_patched(BUG, "the 2 steps after a failed backward equal a reference that skipped its batch")
