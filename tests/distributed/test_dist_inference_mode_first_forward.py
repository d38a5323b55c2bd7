"""inference_mode_first_forward's variants on 2 gloo ranks, with the fix off and on
(``_inference_mode_first_forward_scenarios``). Its case (``test_dist_cases.py``) shows an evaluation
under ``torch.inference_mode()`` before the first training step, fp32, units that reshard after forward.

Evaluate, then 2 AdamW steps, in bf16 ``param_dtype`` (resharding or not), fp32 units kept unsharded,
and on an HSDP ``(2, 1)`` mesh:

* fix off: every ``inference/*`` variant raises on every rank: ``RuntimeError: Inplace update to
  inference tensor outside InferenceMode is not allowed.`` at the first training step (resharding
  units), ``Inference tensors cannot be saved for backward`` (units kept unsharded), and on the
  HSDP ``(2, 1)`` mesh on torch 2.13 already in the evaluation, ``Inference tensors do not track
  version counter`` (2.15 skips those there, PyTorch PR 197327, and fails at the training step);
* fix on: each ``inference/*`` variant's evaluation output, gradients and parameters are bitwise
  equal to its ``no_grad/*`` reference, ``fired`` once per parameter of the model at the
  evaluation and never again; the ``no_grad`` references and the control (a training step before
  the evaluation) are bitwise equal with the fix on and off and fire nothing.
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _inference_mode_first_forward_scenarios as im

pytestmark = pytest.mark.timeout(300)

PATCH = im.NAME
INPLACE = "Inplace update to inference tensor outside InferenceMode is not allowed"
SAVED = "Inference tensors cannot be saved for backward"
COUNTER = "Inference tensors do not track version counter"  # the one-rank copy on 2.13
PARAMS_PER_MODEL = 4  # inp.weight, inp.bias, out.weight, out.bias


unpatched, patched = ck.off_and_on("inference_mode_first_forward", PATCH)


def _torch_error(error: dict | None) -> str | None:
    """Which of torch's inference-tensor errors ``error`` is, or None."""
    if error is None or error["type"] != "RuntimeError":
        return None
    return next((known for known in (INPLACE, SAVED, COUNTER) if known in error["message"]), None)


def _bitwise_equal(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_unpatched(unpatched):
    """Every evaluation under inference_mode breaks the run on every rank; no_grad trains."""
    assert not unpatched.timed_out, unpatched.describe()
    seen = {}
    for case in im.BUG_CASES:
        errors = [ck.error_of(rank, case) for rank in unpatched.ranks]
        kinds = {_torch_error(e) for e in errors}
        assert len(kinds) == 1 and None not in kinds, (case, errors)
        seen[case] = kinds.pop()
    for case in (*im.REFERENCES, *im.CONTROLS):
        assert all(ck.error_of(rank, case) is None for rank in unpatched.ranks), case
    assert seen["inference/fp32/keep"] == SAVED, seen
    ck.assert_registry_with_disabled(unpatched, PATCH)


@pytest.mark.parametrize("case", im.BUG_CASES)
def test_patched_equals_no_grad(patched, case):
    patched.assert_clean()
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    for rank in patched.ranks:
        got, want = rank.cases[case], rank.cases[im.reference_of(case)]
        assert got["error"] is None and want["error"] is None, (got["error"], want["error"])
        assert torch.equal(got["eval"], want["eval"]), case
        assert _bitwise_equal(got["grads"], want["grads"]), case
        assert _bitwise_equal(got["params"], want["params"]), case
    assert _bitwise_equal(patched.ranks[0].cases[case]["params"], patched.ranks[1].cases[case]["params"])


def test_patched_fires_once_per_parameter_at_the_evaluation(patched):
    patched.assert_clean()
    ck.assert_fired_where_applied(patched, PATCH)
    for rank in patched.ranks:
        count = 0
        for case in im.CASES:
            rec = rank.cases[case]
            count += PARAMS_PER_MODEL if case in im.BUG_CASES else 0
            assert (rec["fired_after_eval"], rec["fired_after"]) == (count, count), (rank.rank, case, rec)


@pytest.mark.parametrize("case", (*im.REFERENCES, *im.CONTROLS))
def test_controls_bitwise_equal_on_and_off(patched, unpatched, case):
    for on, off in zip(patched.ranks, unpatched.ranks):
        got, want = on.cases[case], off.cases[case]
        assert got["error"] is None and want["error"] is None, (got["error"], want["error"])
        assert torch.equal(got["eval"], want["eval"]), case
        assert _bitwise_equal(got["grads"], want["grads"]) and _bitwise_equal(got["params"], want["params"]), case
