"""stale_backward_recovery's variants on 2 gloo ranks, with the fix off and on
(``_stale_backward_recovery_scenarios``). Its case (``test_dist_cases.py``) shows the loop that
catches a failed backward, calls ``zero_grad`` and trains on: no gradient again with the fix off, the
reference that skipped the failed batch with it on.

* recovery loops the case does not show (no ``zero_grad`` after the exception, torch's
  ``reset_iter_state()``, a hand reset of ``_training_state``, torch 2.15's manual finalization):
  fix off, no sharded parameter gets a gradient again without ``zero_grad`` and after the hand
  reset, the next ``finalize_backward()`` raises under manual finalization, and torch's own reset
  leaves the failed backward's gradients on the root's unsharded parameters on 2.13; fix on, the
  gradients of steps 1 and 2 and the weights after them equal a one-process reference that skipped
  the failed batch, ``fired`` once per recovery (none after 2.15's complete ``reset_iter_state``);
* healthy loops (gradient accumulation, two losses and backwards per step, two forwards before one
  backward, activation checkpointing's recompute, manual finalization): never fire, and every
  gradient and weight is bitwise equal with and without the fix.
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


def test_unpatched_no_gradient_after_the_failure(unpatched):
    """Torch left alone, no zero_grad or a hand reset: no sharded parameter gets a gradient again."""
    unpatched.assert_clean()
    _skip_where_unsupported()
    for case in ("failed_kept_grads", "failed_hand_reset"):
        _assert_clean_case(unpatched, case)
        assert all(rank.cases[case]["caught"] == "injected" for rank in unpatched.ranks)
        assert _with_grad(unpatched, case, 2) == [0] * sc.WORLD_SIZE, case
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


def test_fired_where_applied(patched):
    patched.assert_clean()
    ck.assert_fired_where_applied(patched, PATCH)
