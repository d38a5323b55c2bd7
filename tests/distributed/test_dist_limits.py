"""The documented limit (docs/faq.md) and the two ways to restructure a model around it.

A whole FSDP unit that runs forward on some ranks only leaves its forward all-gather unmatched: no
patch can fix that, the job stops at the process-group timeout (or a gloo abort), with or without
the plugin. Running the unit on every rank (``0 * tower(zeros)`` on text-only rows), or folding its
parameters into the parent unit with the unused-param fill on, gives the single-process reference's
gradients with the plugin active.
"""

from __future__ import annotations

import pytest

import _dist_checks as ck
import _dist_common as sc
from _dist_launcher import run_ranks
from _limits_scenarios import plan_images_on_rank_0

pytestmark = pytest.mark.timeout(300)

PG_TIMEOUT_S = 10  # the skipped unit's all-gather waits this long, then the job must stop
TOWER = ("tower.0.weight", "tower.0.bias", "tower.2.weight", "tower.2.bias")


def _reference(run) -> dict:
    model = ck.reference_model("text_vision", run)
    return sc.reference_grads(model, plan_images_on_rank_0, step=0, n_micro_batches=1)


def test_unit_skipped_on_one_rank_stops_the_job_instead_of_hanging():
    run = run_ranks("tower_unit_skipped", timeout=120,
                    env={"FSDP_DIST_PG_TIMEOUT_S": str(PG_TIMEOUT_S)})
    assert not run.timed_out, "the job outlived the process-group timeout\n" + run.describe()
    errors = {r.rank: (r.cases.get("step") or {}).get("error") for r in run.ranks}
    assert all(errors.values()), "an unmatched forward all-gather completed?\n" + run.describe()
    messages = [e["message"].lower() for e in errors.values()]
    assert any("timed out" in m or "timeout" in m for m in messages), run.describe()
    ck.note(f"unit run on rank 0 only: every rank stopped with an error within the {PG_TIMEOUT_S} s "
            "process-group timeout, plugin active")


@pytest.mark.parametrize("scenario", ["tower_dummy_forward", "tower_in_parent_unit"])
def test_restructured_model_matches_the_reference(scenario):
    run = run_ranks(scenario)
    run.assert_clean()
    grads = ck.case_grads(run, "step")
    ref = _reference(run)
    assert all(ref[n] is not None for n in TOWER)  # rank 0's images reach the tower
    ck.assert_grads_match(grads, ref)
