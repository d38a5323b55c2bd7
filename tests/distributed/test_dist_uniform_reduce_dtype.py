"""uniform_reduce_dtype: fp32 accumulated gradients next to bf16 ones in one reduce-scatter.

``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, two micro-batches, no
gradient sync on the first. Gradients of the first micro-batch are kept as fp32
accumulations; at the reducing post-backward a parameter still contributes bf16:

* ``late_param``: expert 1 is first used in the last micro-batch (every rank), so the
  upstream assertion fires on every rank before any collective;
* ``fill_zero``: the unused-param fill is on and expert 1 is used by rank 0 in the first
  micro-batch only, so rank 1 reduces the fill's bf16 zero next to fp32 accumulations:
  the assertion fires on rank 1 only and rank 0 is left in its reduce-scatter.
"""

from __future__ import annotations

import re

import pytest

import _dist_checks as ck
import _dist_common as sc

pytestmark = pytest.mark.timeout(300)

PATCH = "uniform_reduce_dtype"
BUG = ck.ex.BUG_OF[PATCH]
ASSERT_RE = re.compile(
    r"FSDP reduce-scatter expects uniform gradient dtype but got "
    r"\{torch\.(bfloat16|float32), torch\.(bfloat16|float32)\}"
)
EXPERT1 = ("experts.1.weight", "experts.1.bias")


unpatched, patched = ck.off_and_on("uniform_reduce_dtype", PATCH)


def _is_dtype_assertion(err) -> bool:
    if err is None or err["type"] != "AssertionError":
        return False
    m = ASSERT_RE.fullmatch(err["message"])
    return bool(m) and {m.group(1), m.group(2)} == {"bfloat16", "float32"}


def _check_grads(run, case, plan):
    grads = ck.case_grads(run, case)
    ck.assert_full_grads_consistent(run, case, grads)
    model = ck.reference_model("experts", run, case=case, n_experts=2)
    ref = sc.reference_grads(model, plan, step=0, n_micro_batches=2)
    assert all(ref[n] is not None for n in ref)
    ck.assert_grads_match(grads, ref, bf16=True)  # includes dtype == float32
    for n in EXPERT1:
        assert grads[n].abs().sum() > 0, n


def _unpatched_outcome(run) -> tuple[str, str]:
    late = [_is_dtype_assertion(ck.error_of(r, "late_param")) for r in run.ranks]
    fill = [_is_dtype_assertion(ck.error_of(r, "fill_zero")) for r in run.ranks]
    if all(late) and fill == [False, True]:
        return ck.ex.REPRODUCES, (
            "AssertionError 'expects uniform gradient dtype' "
            "(late param: every rank; fill zero: rank 1 only, rank 0 loses its peer)"
        )
    if not any(late) and not any(fill):
        return ck.ex.FIXED, "no assertion, fp32 gradients equal the reference"
    return "other", f"dtype assertion on late_param ranks {late}, fill_zero ranks {fill}"


def test_unpatched(unpatched):
    """torch <= 2.14 asserts; 2.15 removed the assertion and gives the right gradients."""
    assert not unpatched.timed_out, unpatched.describe()
    outcome, detail = _unpatched_outcome(unpatched)
    ck.expect_unpatched(BUG, outcome, detail, unpatched)
    ck.assert_registry_with_disabled(unpatched, PATCH)
    if outcome == ck.ex.FIXED:
        unpatched.assert_clean()
        _check_grads(unpatched, "late_param", sc.plan_uniform_late_param)
        _check_grads(unpatched, "fill_zero", sc.plan_uniform_fill_zero)
        return
    assert "foreach_reduce" in ck.error_of(unpatched[0], "late_param")["traceback"]
    # rank 0's gradients were uniform: it entered the reduce-scatter and lost its peer
    err0 = ck.error_of(unpatched[0], "fill_zero")
    assert not ASSERT_RE.search(err0["message"]), err0
    assert err0["type"] in ("RuntimeError", "DistBackendError"), err0


@pytest.mark.parametrize(
    "case,plan", [("late_param", sc.plan_uniform_late_param), ("fill_zero", sc.plan_uniform_fill_zero)]
)
def test_patched_grads_fp32_and_correct(patched, case, plan):
    if case == "late_param":  # registry check once per run
        ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    _check_grads(patched, case, plan)
    ck.observe_patched(BUG, "fp32 gradients equal the reference (late param, fill zero)")


def test_patched_fires_on_the_mixed_dtype_reduce(patched):
    ck.assert_fired_where_applied(patched, PATCH)


def test_patched_run_clean(patched):
    patched.assert_clean()
