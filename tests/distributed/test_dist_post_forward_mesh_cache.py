"""post_forward_mesh_cache's variants on 4 gloo ranks (``_post_forward_mesh_cache_scenarios``, several
cases in one launch), with the patch off and on. Its case (``test_dist_cases.py``) shows 8 units with
``reshard_after_forward=2`` off (2 process groups per unit) and on; ``units8`` here is the first model
the other cases build beside, judged with the patch only.

Without the patch every other case builds its own post-forward meshes too: 2 process groups per unit
and mesh (16 units -> 32, a second mesh -> 32), and torch's validation gives the errors the patch must
keep. With the patch the units of a world share one post-forward mesh: 2 groups for the first model, then 0
for a second model alive beside it, a mesh sliced anew per call, parameters placed on a second mesh
over the same ranks, new models after the old ones were deleted (which gives no group back); a new
world gets its own, and ranks whose collectors ran at different times agree. torch's validation of
bad values is kept; gradients equal the one-process reference.
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _post_forward_mesh_cache_scenarios as mc
from _dist_launcher import RunResult

pytestmark = pytest.mark.timeout(600)

PATCH = "post_forward_mesh_cache"
BUG = ck.ex.BUG_OF[PATCH]
LAUNCH_TIMEOUT_S = 240.0  # 4 ranks on a busy 2-core machine: torch import x 4 is most of it
TRAINED = ("units8", "units16", "uneven_gc")
CASE_TRIGGER = "units8"  # 8 units on one mesh: its case's, judged off there
# process groups each rank gains per case: torch alone (2 per unit and mesh) / with the patch
WITHOUT = {"second_model": 16, "sliced": 16, "placement": 32, "after_del": 16, "units16": 32, "uneven_gc": 16}
WITH = {"units8": 2, "second_model": 0, "sliced": 0, "placement": 0, "after_del": 0,
        "units16": 2, "uneven_gc": 0}
FACTOR = "ValueError: If passing reshard_after_forward as an int, it should be a factor of 4, not {}"
ERRORS = {
    **{repr(k): FACTOR.format(k) for k in (3, 0, 8, -2)},
    "2.0": "ValueError: reshard_after_forward should be a bool or an int representing the group size "
    "to reshard to, not 2.0",
}


unpatched, patched = ck.off_and_on("post_forward_mesh_cache", PATCH, world_size=mc.WORLD, timeout=LAUNCH_TIMEOUT_S)


def records(run: RunResult, case: str) -> list[dict]:
    out = []
    for rank in run.ranks:
        rec = rank.cases.get(case)
        assert rec is not None, f"rank {rank.rank} did not run case {case!r}\n{run.describe()}"
        assert rec["error"] is None, f"rank {rank.rank} {case}: {rec['error']['message']}\n{run.describe()}"
        out.append(rec)
    return out


def measured(run: RunResult, case: str, key: str) -> object:
    """The value every rank recorded (the ranks must agree)."""
    values = [rec.get(key) for rec in records(run, case)]
    assert all(v == values[0] for v in values), f"{case} {key}: ranks differ: {values}"
    return values[0]


def skipped(run: RunResult, case: str) -> bool:
    return "skipped" in records(run, case)[0]


def cases(run: RunResult) -> list[str]:
    return [case for case in WITH if not skipped(run, case)]


def assert_grads_equal_reference(run: RunResult, case: str) -> None:
    recs = records(run, case)
    model = mc.build(measured(run, case, "units"))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), recs[0]["init_params"][name]), f"{case} {name}: other initial weights"
    for step, ref in enumerate(mc.reference_steps(model)):
        for rank, rec in enumerate(recs):
            ck.assert_grads_match(rec[f"grads_{step}"], ref)
            assert set(rec[f"grads_{step}"]) == set(ref), (case, rank, step)


def _unpatched_outcome(run: RunResult) -> tuple[str, str]:
    counts = {case: measured(run, case, "pg_fully_shard") for case in cases(run) if case != CASE_TRIGGER}
    if counts == {case: WITHOUT[case] for case in counts}:
        return ck.ex.REPRODUCES, f"process groups per rank: {counts}"
    if counts == {case: WITH[case] for case in counts}:
        return ck.ex.FIXED, f"process groups per rank: {counts}"
    return "other", f"process groups per rank: {counts}"


def test_unpatched(unpatched):
    """Every unit builds its own post-forward mesh in each other case too: the process groups grow with
    the units and the meshes. Judged, not recorded: the matrix's "off" record is the case's."""
    assert not unpatched.timed_out, unpatched.describe()
    unpatched.assert_clean()
    outcome, detail = _unpatched_outcome(unpatched)
    assert ck.unpatched_agrees(BUG, outcome), (ck.UNPATCHED[BUG], outcome, detail, unpatched.describe())
    ck.assert_registry_with_disabled(unpatched, PATCH)
    for case in cases(unpatched):
        if case == CASE_TRIGGER:
            continue
        units = measured(unpatched, case, "units")
        meshes_per_unit = 2 if case == "placement" else 1  # weights' mesh and the biases' mesh
        assert measured(unpatched, case, "post_forward_meshes") == meshes_per_unit * units, case
    assert measured(unpatched, "after_del", "pg_released_by_del") == 0
    assert measured(unpatched, "validation", "errors") == ERRORS  # torch's own, kept by the patch
    for case in TRAINED:
        if case != CASE_TRIGGER:
            assert measured(unpatched, case, "pg_training") == 0, case
            assert_grads_equal_reference(unpatched, case)


def test_patched_process_groups_do_not_grow_with_units(patched):
    patched.assert_clean()
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    counts = {case: measured(patched, case, "pg_fully_shard") for case in cases(patched)}
    assert counts == {case: WITH[case] for case in counts}, counts
    for case in counts:
        assert measured(patched, case, "post_forward_meshes") == 1, case
    for case in ("second_model", "sliced") + (() if skipped(patched, "placement") else ("placement",)):
        assert measured(patched, case, "shares_first_mesh") is True, case
    assert measured(patched, "sliced", "new_mesh_per_slicing") is True  # an identity-keyed cache would miss


def test_patched_new_world_gets_its_own_mesh(patched):
    """After destroy_process_group() + init_process_group(), with a first-world model alive."""
    assert measured(patched, "units16", "pg_fully_shard") == 2
    assert measured(patched, "units16", "reuses_first_world_mesh") is False


def test_patched_ranks_agree_when_their_collectors_ran_at_different_times(patched):
    """The world's post-forward mesh survives its last unit (collected on rank 0 only): every rank
    reuses it, none creates groups its peers do not (an entry that died with its units would)."""
    assert measured(patched, "uneven_gc", "pg_fully_shard") == 0
    assert_grads_equal_reference(patched, "uneven_gc")


@pytest.mark.parametrize("case", TRAINED)
def test_patched_grads_equal_reference(patched, case):
    assert measured(patched, case, "pg_training") == 0
    assert_grads_equal_reference(patched, case)


def test_patched_keeps_torchs_validation(patched):
    assert measured(patched, "validation", "errors") == ERRORS


def test_deleting_models_gives_no_process_group_back(patched):
    """They stay registered until destroy_process_group(), patch or not: the leak is for the job."""
    assert measured(patched, "after_del", "pg_released_by_del") == 0


def test_patched_fires_once_per_post_forward_mesh_not_built(patched):
    ck.assert_fired_where_applied(patched, PATCH)
    # hits per rank: units8 7, second_model 8, sliced 8, after_del 8, the first-world model kept
    # alive 8, units16 15, uneven_gc 8; placement 16 (weights and biases) where it ran
    expected = 7 + 8 + 8 + 8 + 8 + 15 + 8 + (0 if skipped(patched, "placement") else 16)
    assert ck.fired(patched, PATCH) == [expected] * mc.WORLD
