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
import _dist_scenarios as sc
from _dist_launcher import run_ranks

pytestmark = pytest.mark.timeout(300)

PATCH = "accumulated_grad_guard"
TOWER = ("tower.0.weight", "tower.0.bias", "tower.2.weight", "tower.2.bias")
MESSAGE = "'FSDPParam' object has no attribute '_unsharded_param'"


@pytest.fixture(scope="module")
def unpatched():
    return run_ranks("grad_guard", env={ck.ENV[PATCH]: "0"})


@pytest.fixture(scope="module")
def patched():
    return run_ranks("grad_guard")


def test_unpatched_crashes_in_first_no_sync_backward(unpatched):
    assert not unpatched.timed_out, unpatched.describe()
    for rank in unpatched.ranks:
        err = ck.error_of(rank, "text_only")
        assert err is not None, f"rank {rank.rank} did not crash\n{unpatched.describe()}"
        assert err["type"] == "AttributeError", unpatched.describe()
        assert err["message"] == MESSAGE
        assert "to_accumulated_grad_if_needed" in err["traceback"]
        assert "_root_post_backward_final_callback" in err["traceback"]
        assert "image_last" not in rank.cases
    ck.assert_registry_with_disabled(unpatched, PATCH)


def test_patched_text_only_step(patched):
    """Shared-layer grads equal the reference; the tower's grads stay None."""
    patched.assert_clean()
    ck.assert_registry(patched, {PATCH: "applied"})
    grads = ck.case_grads(patched, "text_only")
    ck.assert_full_grads_consistent(patched, "text_only", grads)
    model = ck.reference_model("text_vision", patched)
    ref = sc.reference_grads(model, sc.plan_grad_guard, step=0, n_micro_batches=2)
    for name in TOWER:
        assert ref[name] is None and grads[name] is None, name
    shared = [n for n in ref if n not in TOWER]
    assert {"shared.weight", "embed.weight", "head.weight"} <= set(shared)
    ck.assert_grads_match(grads, ref, shared, bf16=True)


def test_patched_tower_joins_in_a_later_step(patched):
    """Next step: text-only, then images: the tower gets its (correct) first gradients."""
    grads = ck.case_grads(patched, "image_last")
    ck.assert_full_grads_consistent(patched, "image_last", grads)
    model = ck.reference_model("text_vision", patched)
    ref = sc.reference_grads(model, sc.plan_grad_guard, step=1, n_micro_batches=2)
    assert all(ref[n] is not None for n in ref)
    ck.assert_grads_match(grads, ref, bf16=True)
