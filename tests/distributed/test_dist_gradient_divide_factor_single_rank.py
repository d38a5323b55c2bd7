"""gradient_divide_factor_single_rank's variants on 2 gloo ranks, with the fix off and on
(``_gradient_divide_factor_single_rank_scenarios``). Its case (``test_dist_cases.py``) shows fp32
force-sum on an HSDP ``(2, 1)`` mesh (a one-rank shard group) dividing by the factor twice.

* the fp16 reduce on the same mesh (the sum path without force-sum): off, where torch has the
  dividing one-rank copy (2.13+), the gradients are the reference divided by the factor once more
  (|ref| / |grad| = 4), before it torch is right; on, the case's one-process reference (sum of the
  ranks' gradients / 4) within fp16 rounding, and its twin on a ``(1, 2)`` mesh;
* what torch gets right (force-sum and fp16 on a 2-rank shard group ``(1, 2)``, the ``(2, 1)``
  default path): the reference, bitwise what torch gives without the fix;
* ``fired`` once per corrected reduction where it applies.
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _gradient_divide_factor_single_rank_scenarios as gd
from _dist_launcher import RunResult

pytestmark = pytest.mark.timeout(300)

PATCH = "gradient_divide_factor_single_rank"
FP16_REL = 1e-3  # fp16 reduce vs the fp32 reference (measured 4.3e-05 absolute on 2.13)
CONTROLS = ("shard_1x2_sum", "shard_1x2_fp16", "hsdp_2x1_default")
# The (2, 1) factor-only case is right only where torch's one-rank copy divides (where the patch
# applies): before, the copy of PR 162021 dropped the PREMUL_SUM factor (a torch bug of its own),
# and before that gloo had no PREMUL_SUM reduce-scatter.
DIVIDING_COPY_ONLY = ("hsdp_2x1_default",)


def _skip_without_the_dividing_copy(case: str) -> None:
    if case in DIVIDING_COPY_ONLY and ck.EXPECTED_STATUS[PATCH] != "applied":
        pytest.skip(f"{case}: torch {torch.__version__} has no dividing one-rank copy")


unpatched, patched = ck.off_and_on("gradient_divide_factor_single_rank", PATCH)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return gd.reference_grads()


def _grads(run: RunResult, case: str) -> dict[str, torch.Tensor]:
    for rank in run.ranks:
        assert rank.cases[case]["error"] is None, (rank.rank, case, rank.cases[case]["error"])
    grads = run.ranks[0].cases[case]["full_grads"]
    for rank in run.ranks[1:]:  # the ranks agree (the bug is silent)
        assert all(torch.equal(grads[n], g) for n, g in rank.cases[case]["full_grads"].items()), case
    return {n: g.float() for n, g in grads.items()}


def _ratio(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """|reference| / |grads| over all parameters: 1 right, FACTOR divided twice."""
    norm = lambda d: sum(float(t.double().norm()) ** 2 for t in d.values()) ** 0.5  # noqa: E731
    return norm(ref) / norm(grads)


def _match(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], case: str) -> None:
    if "fp16" in case:
        for n in ref:
            err = ck.rel_err(grads[n], ref[n])
            assert err < FP16_REL, f"{case} {n}: relative error {err:.3g} (fp16 tolerance {FP16_REL})"
    else:
        ck.assert_grads_match(grads, ref)


def test_unpatched(unpatched, reference):
    """With the dividing one-rank copy, the (2, 1) fp16 path divides by the factor twice."""
    unpatched.assert_clean()
    for rank in unpatched.ranks:
        assert rank.cases["hsdp_2x1_fp16"]["shard_group_size"] == 1
        assert rank.cases["shard_1x2_fp16"]["shard_group_size"] == 2
    for case in gd.BUGGY:
        if ck.EXPECTED_STATUS[PATCH] == "applied":
            ratio = _ratio(_grads(unpatched, case), reference)
            assert abs(ratio - gd.FACTOR) < 1e-2, f"{case}: |ref|/|grad| = {ratio:.4f}"
        else:
            _match(_grads(unpatched, case), reference, case)
    for case in CONTROLS:  # torch is right on a 2-rank shard group and on the default path
        if case not in DIVIDING_COPY_ONLY or ck.EXPECTED_STATUS[PATCH] == "applied":
            _match(_grads(unpatched, case), reference, case)
    ck.assert_registry_with_disabled(unpatched, PATCH)


@pytest.mark.parametrize("case", list(gd.CASES))
def test_patched(patched, reference, case):
    _skip_without_the_dividing_copy(case)
    patched.assert_clean()
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    grads = _grads(patched, case)
    _match(grads, reference, case)
    if case in gd.TWIN:  # the same run on a 2-rank shard group
        twin = _grads(patched, gd.TWIN[case])
        for n in twin:
            torch.testing.assert_close(grads[n], twin[n], rtol=FP16_REL if "fp16" in case else 1e-5, atol=1e-6)
    ck.assert_fired_where_applied(patched, PATCH)


@pytest.mark.parametrize("case", CONTROLS)
def test_cases_torch_gets_right_are_unchanged(patched, unpatched, case):
    """A fix changes nothing where the bug does not strike: bitwise torch's gradients."""
    _skip_without_the_dividing_copy(case)
    got, torch_own = _grads(patched, case), _grads(unpatched, case)
    assert all(torch.equal(got[n], torch_own[n]) for n in torch_own), case


def test_fired_once_per_corrected_reduction(patched):
    """One fire per foreach_reduce it corrects: two units with parameters (the root has none of its
    own), per buggy variant; none where it does not apply."""
    expected = 2 * len(gd.BUGGY) if ck.EXPECTED_STATUS[PATCH] == "applied" else 0
    assert ck.fired(patched, PATCH) == [expected] * len(patched.ranks)
