"""accumulated_grad_guard's variants on 2 gloo ranks, the plugin as installed
(``_accumulated_grad_guard_scenarios``). Its case (``test_dist_cases.py``) shows the crash, off and
on: a unit skipped by the first, no-sync micro-batch that runs in the second.

* ``text_only``: the vision tower (its own unit) never runs forward in the whole step: its
  gradients stay None, the shared layers' equal the reference;
* ``image_last``: the next step, text-only then images: the tower joins with its (correct) first
  gradients, after a step that never ran it.
"""

from __future__ import annotations

import pytest

import _dist_checks as ck
import _dist_common as sc
from _dist_launcher import RunResult, run_ranks

pytestmark = pytest.mark.timeout(300)

PATCH = "accumulated_grad_guard"
BUG = ck.ex.BUG_OF[PATCH]
TOWER = ("tower.0.weight", "tower.0.bias", "tower.2.weight", "tower.2.bias")


@pytest.fixture(scope="module")
def patched() -> RunResult:
    return run_ranks("accumulated_grad_guard")


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


def test_patched_text_only_step(patched):
    patched.assert_clean()
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    _check_text_only(patched)
    ck.assert_fired_where_applied(patched, PATCH)  # the skipped tower's post-backward


def test_patched_tower_joins_in_a_later_step(patched):
    _check_image_last(patched)
