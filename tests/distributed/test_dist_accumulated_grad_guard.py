"""accumulated_grad_guard: a separately wrapped unit that never ran forward.

A vision tower (its own ``fully_shard`` unit) is skipped by text-only micro-batches;
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; gradient accumulation with
``set_requires_gradient_sync(False)`` on all but the last micro-batch. The root's final
backward callback calls ``post_backward()`` on the tower, which reads the lazily created
``_unsharded_param`` that does not exist yet.
"""

from __future__ import annotations

import pytest

import _dist_checks as ck
import _dist_common as sc

pytestmark = pytest.mark.timeout(300)

PATCH = "accumulated_grad_guard"
BUG = ck.ex.BUG_OF[PATCH]
TOWER = ("tower.0.weight", "tower.0.bias", "tower.2.weight", "tower.2.bias")
MESSAGE = "'FSDPParam' object has no attribute '_unsharded_param'"


unpatched, patched = ck.off_and_on("accumulated_grad_guard", PATCH)


def _crashed(run) -> bool:
    errors = [rank.cases.get("text_only", {}).get("error") for rank in run.ranks]
    return all(e is not None and e["type"] == "AttributeError" and e["message"] == MESSAGE for e in errors)


def _check_text_only(run) -> None:
    """Shared-layer grads equal the reference; the tower's grads stay None."""
    grads = ck.case_grads(run, "text_only")
    ck.assert_full_grads_consistent(run, "text_only", grads)
    model = ck.reference_model("text_vision", run)
    ref = sc.reference_grads(model, sc.plan_grad_guard, step=0, n_micro_batches=2)
    for name in TOWER:
        assert ref[name] is None and grads[name] is None, name
    shared = [n for n in ref if n not in TOWER]
    assert {"shared.weight", "embed.weight", "head.weight"} <= set(shared)
    ck.assert_grads_match(grads, ref, shared, bf16=True)


def _check_image_last(run) -> None:
    """Next step: text-only, then images: the tower gets its (correct) first gradients."""
    grads = ck.case_grads(run, "image_last")
    ck.assert_full_grads_consistent(run, "image_last", grads)
    model = ck.reference_model("text_vision", run)
    ref = sc.reference_grads(model, sc.plan_grad_guard, step=1, n_micro_batches=2)
    assert all(ref[n] is not None for n in ref)
    ck.assert_grads_match(grads, ref, bf16=True)


def test_unpatched(unpatched):
    """torch 2.7-2.14 crash in the first no-sync backward; 2.15 gives the right gradients."""
    assert not unpatched.timed_out, unpatched.describe()
    if _crashed(unpatched):
        outcome, detail = ck.ex.REPRODUCES, "AttributeError '_unsharded_param' on every rank"
    else:
        outcome, detail = ck.ex.FIXED, "no error, gradients equal the reference"
    ck.expect_unpatched(BUG, outcome, detail, unpatched)
    ck.assert_registry_with_disabled(unpatched, PATCH)
    if outcome == ck.ex.FIXED:
        unpatched.assert_clean()
        _check_text_only(unpatched)
        _check_image_last(unpatched)
        return
    for rank in unpatched.ranks:
        err = ck.error_of(rank, "text_only")
        assert "to_accumulated_grad_if_needed" in err["traceback"]
        assert "_root_post_backward_final_callback" in err["traceback"]
        assert "image_last" not in rank.cases


def test_patched_text_only_step(patched):
    patched.assert_clean()
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    _check_text_only(patched)
    ck.assert_fired_where_applied(patched, PATCH)  # the skipped tower's post-backward


def test_patched_tower_joins_in_a_later_step(patched):
    _check_image_last(patched)
    ck.observe_patched(BUG, "tower grads None on text-only steps, all grads equal the reference")
