"""inplace_view_output's variants on 2 gloo ranks, with the fix off and on
(``_inplace_view_output_scenarios``). Its case (``test_dist_cases.py``) shows a transposed output
modified with ``mul_``, fp32.

* the other views and in-place ops (``view`` and ``+=``, ``nn.Linear`` on 3-D and
  ``masked_fill_``) in fp32, under activation checkpointing and with bf16/fp32, and the transpose
  checkpointed and in bf16: fix off, the backward raises ``RuntimeError: setStorage: ... out of
  bounds for storage of size 0`` on every rank (``linear3d`` too where torch's ``nn.Linear``
  returns a view: 2.13; 2.15 returns none, PR 194077, and is right); under activation
  checkpointing the recomputed forward raises ``RuntimeError: aten.mm.default got mixed
  torch.Tensor and DTensor`` instead (the unit's parameters are still the sharded ones);
* fix on: every variant's gradients equal a one-process reference (fp32: 1e-5; bf16: the bf16
  tolerance), ``fired`` once per variant whose output was a view on each rank (the block's unit;
  the root hooks the rebased output itself);
* the controls (no in-place op, an output that is not a view) are bitwise equal with the fix on
  and off and fire nothing.
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _dist_common as sc
import _inplace_view_output_scenarios as iv

pytestmark = pytest.mark.timeout(300)

PATCH = "inplace_view_output"
BUG = ck.ex.BUG_OF[PATCH]
MESSAGE_START = "setStorage: sizes [8, 8], strides [8, 1], storage offset 0, and itemsize "
MESSAGE_END = "out of bounds for storage of size 0"
# under activation checkpointing the recomputed forward meets the sharded DTensor weight instead
AC_MESSAGE = "aten.mm.default got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor"


unpatched, patched = ck.off_and_on("inplace_view_output", PATCH)


def reference_grads(case: str) -> dict[str, torch.Tensor]:
    """One process, fp32: the mean of every rank's loss, what FSDP2's reduce-scatter gives."""
    model = iv.build(case)
    for rank in range(sc.WORLD_SIZE):
        (iv.loss(model, iv.rank_batch(case, rank)) / sc.WORLD_SIZE).backward()
    return {name: param.grad for name, param in model.named_parameters()}


def _is_the_bug(case: str, error: dict | None) -> bool:
    if error is None or error["type"] != "RuntimeError":
        return False
    if case.endswith("/ac"):
        # 2.13 words it "aten.mm.default got mixed ...", 2.8 "aten.mm.default: got mixed ..."
        return AC_MESSAGE.split(" got ", 1)[1] in error["message"]
    return error["message"].startswith(MESSAGE_START) and MESSAGE_END in error["message"]


def test_unpatched(unpatched):
    """Every view variant fails in backward on every rank; a non-view output (linear3d on 2.15) is right."""
    assert not unpatched.timed_out, unpatched.describe()
    failing, right = [], []
    for case in iv.BUG_CASES:
        errors = [ck.error_of(rank, case) for rank in unpatched.ranks]
        if all(_is_the_bug(case, e) for e in errors):
            failing.append(case)
        else:
            assert errors == [None] * len(errors), (case, errors)
            assert not unpatched.ranks[0].cases[case]["out_was_view"], f"{case}: a view output, no error"
            right.append(case)
    assert all(case in failing for case in iv.BUG_CASES if not case.startswith("linear3d")), failing
    outcome = ck.ex.REPRODUCES if failing else ck.ex.FIXED
    assert ck.unpatched_agrees(BUG, outcome), (outcome, failing, right, unpatched.describe())
    ck.assert_registry_with_disabled(unpatched, PATCH)


@pytest.mark.parametrize("case", iv.BUG_CASES)
def test_patched(patched, case):
    patched.assert_clean()
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    for rank in patched.ranks:
        assert rank.cases[case]["error"] is None, rank.cases[case]["error"]
    grads = patched.ranks[0].cases[case]["full_grads"]
    for rank in patched.ranks[1:]:
        assert all(torch.equal(grads[n], g) for n, g in rank.cases[case]["full_grads"].items())
    ck.assert_grads_match(grads, reference_grads(case), bf16=case.endswith("/bf16"))


def test_patched_fires_once_per_bug_case(patched):
    patched.assert_clean()
    ck.assert_fired_where_applied(patched, PATCH)
    views = [case for case in iv.BUG_CASES if patched.ranks[0].cases[case]["out_was_view"]]
    for rank in patched.ranks:
        # cumulative after each case: +1 for each case whose output was a view, 0 for the controls
        counts = [rank.cases[case]["fired_after"] for case in iv.CASES]
        want, expected = 0, []
        for case in iv.CASES:
            want += case in views
            expected.append(want)
        assert counts == expected, (rank.rank, dict(zip(iv.CASES, counts)))


@pytest.mark.parametrize("case", iv.CONTROLS)
def test_controls_bitwise_equal_on_and_off(patched, unpatched, case):
    for on, off in zip(patched.ranks, unpatched.ranks):
        assert on.cases[case]["error"] is None and off.cases[case]["error"] is None
        got, want = on.cases[case]["full_grads"], off.cases[case]["full_grads"]
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), case
    ck.assert_grads_match(patched.ranks[0].cases[case]["full_grads"], reference_grads(case))
