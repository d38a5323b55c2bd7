"""uniform_reduce_dtype's variant on 2 gloo ranks (``_uniform_reduce_dtype_scenarios``), with the fix
off and on. Its case (``test_dist_cases.py``) shows a parameter first used in the reducing micro-batch
(every rank asserts before any collective).

``fill_zero``: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, two micro-batches, no
gradient sync on the first, the unused-param fill on; expert 1 is used by rank 0 in the first
micro-batch only, so rank 1 reduces the fill's bf16 zero next to fp32 accumulations. Without the fix
(torch <= 2.14) the assertion fires on rank 1 only and rank 0, left in its reduce-scatter, loses its
peer; with it, fp32 gradients equal the reference on every rank.
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


def _unpatched_outcome(run) -> str:
    fill = [_is_dtype_assertion(ck.error_of(r, "fill_zero")) for r in run.ranks]
    if fill == [False, True]:
        return ck.ex.REPRODUCES
    return ck.ex.FIXED if not any(fill) else f"dtype assertion on fill_zero ranks {fill}"


def test_unpatched_fill_zero(unpatched):
    """torch <= 2.14 asserts on rank 1 only; 2.15 removed the assertion and gives the right gradients.
    Judged, not recorded: the matrix's "off" record is the case's."""
    assert not unpatched.timed_out, unpatched.describe()
    outcome = _unpatched_outcome(unpatched)
    assert ck.unpatched_agrees(BUG, outcome), (ck.UNPATCHED[BUG], outcome, unpatched.describe())
    ck.assert_registry_with_disabled(unpatched, PATCH)
    if outcome == ck.ex.FIXED:
        unpatched.assert_clean()
        _check_grads(unpatched, "fill_zero", sc.plan_uniform_fill_zero)
        return
    # rank 0's gradients were uniform: it entered the reduce-scatter and lost its peer
    err0 = ck.error_of(unpatched[0], "fill_zero")
    assert not ASSERT_RE.search(err0["message"]), err0
    assert err0["type"] in ("RuntimeError", "DistBackendError"), err0


def test_patched_grads_fp32_and_correct(patched):
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    _check_grads(patched, "fill_zero", sc.plan_uniform_fill_zero)


def test_patched_fires_on_the_mixed_dtype_reduce_only(patched):
    """Rank 1 alone reduces the fill's bf16 zero next to fp32: the fix acts there only."""
    applied = ck.EXPECTED_STATUS[PATCH] == "applied"
    assert ck.fired(patched, PATCH) == ([0, 1] if applied else [0, 0])


def test_patched_run_clean(patched):
    patched.assert_clean()
