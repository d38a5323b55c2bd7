"""dcp_optimizer_state_init's variants on 2 gloo ranks, with the fix off and on
(``_dcp_optimizer_state_init_scenarios``). Its case (``test_dist_cases.py``) shows a checkpoint whose
``spare`` never had a gradient, loaded into a fresh model and optimizer.

* fix off: with the unused-param fill and restore_unused_param_grads (``spare``'s gradient reset to
  ``None``) the resume stops at ``dcp.load`` with ``Missing key in checkpoint state_dict:
  optim.state.spare.weight.step``; a step-0 checkpoint loads, but 3 steps after it the parameters
  differ from a run that never checkpointed (Adam's ``step`` 1 from the template's dummy step);
* fix on: both load, and the parameters and the optimizer state after the steps that follow are
  bitwise equal to the run that did not stop; ``fired`` on every rank.
"""

from __future__ import annotations

import pytest
import torch

import _dcp_optimizer_state_init_scenarios as dc
import _dist_checks as ck
from _dist_launcher import RunResult, run_ranks

pytestmark = pytest.mark.timeout(300)

PATCH = dc.PATCH
BUG = ck.ex.BUG_OF[PATCH]
RESUMES = ("fill_resume",)


@pytest.fixture(scope="module")
def unpatched(tmp_path_factory) -> RunResult:
    folder = tmp_path_factory.mktemp("dcp_off")
    return run_ranks("dcp_optimizer_state_init", args={"dir": str(folder)}, env={ck.ENV[PATCH]: "0"})


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> RunResult:
    return run_ranks("dcp_optimizer_state_init", args={"dir": str(tmp_path_factory.mktemp("dcp_on"))})


def _max_diff(rec: dict) -> float:
    a, b = rec["uninterrupted"]["params"], rec["resumed"]["params"]
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _bitwise(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_bitwise(a[k], b[k]) for k in a)
    return torch.equal(a, b) and a.dtype == b.dtype


def _lazy(state: dict) -> bool:
    """What Adam's lazy initialisation creates: step 0 and zero moments."""
    return all(float(t.abs().max()) == 0 for t in state.values())


def _same_run(uninterrupted: dict, resumed: dict) -> bool:
    """Bitwise equal parameters and optimizer state; the resumed run may also hold the lazy state of a
    parameter that never stepped (the load template's), which the other run never created."""
    extra = resumed["optim"].keys() - uninterrupted["optim"].keys()
    common = {n: resumed["optim"][n] for n in uninterrupted["optim"]}
    return (_bitwise(uninterrupted["params"], resumed["params"]) and _bitwise(uninterrupted["optim"], common)
            and all(_lazy(resumed["optim"][n]) for n in extra))


def test_without_the_patch_the_resume_fails_or_drifts(unpatched: RunResult) -> None:
    errors = {case: unpatched.ranks[0].cases[case]["error"] for case in RESUMES}
    step0 = [_max_diff(rank.cases["step0"]) for rank in unpatched.ranks]
    missing = all(e is not None and "Missing key" in e["message"] and "spare" in e["message"] for e in errors.values())
    outcome = ck.ex.REPRODUCES if missing and min(step0) > 0 else ck.ex.FIXED
    last_lines = [((e or {}).get("message") or "no error").strip().splitlines()[-1] for e in errors.values()]
    detail = f"{'; '.join(last_lines)}; step-0 resume: parameters off by {max(step0):.3g} after 3 steps"
    assert ck.unpatched_agrees(BUG, outcome), (outcome, detail)
    assert all(not rank.cases[case]["spare_has_state"] for rank in unpatched.ranks for case in RESUMES)


def test_with_the_patch_every_resume_is_the_run_that_did_not_stop(patched: RunResult) -> None:
    ck.assert_registry(patched, ck.EXPECTED_STATUS)
    for rank in patched.ranks:
        for case in dc.CASES:
            rec = rank.cases[case]
            assert rec["error"] is None, (rank.rank, case, rec["error"], patched.describe())
            assert _same_run(rec["uninterrupted"], rec["resumed"]), (rank.rank, case, _max_diff(rec))
            assert rec["fired"] > 0, (rank.rank, case)
        # the never-used parameter was given its lazy state (step 0, zero moments) for the save
        assert rank.cases["fill_resume"]["resumed"]["optim"]["spare.weight"]["step"].item() == 0
