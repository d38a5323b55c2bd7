"""restore_unused_param_grads on every way a backward is finalized (issue 16, input 3).

One 2-rank gloo job runs every path this torch offers, each on issue 16's unit (``l`` + ``spare``,
fill on) and on a two-unit model (see ``_restore_unused_param_grads_scenarios``):
- ``automatic``: ``loss.backward()`` (the autograd final callback); ``automatic_not_last``: the
  same with ``set_is_last_backward(False)`` in step 0 (gradient sync on);
- ``manual_sync`` / ``manual_async`` / ``manual_no_sync_window`` (torch 2.15's
  ``set_manual_backward_finalization(True)`` + ``finalize_backward()``, ``finalize_backward(
  async_op=True).wait()``, and the documented no-sync window before one finalization);
- ``synchronize``: sync off for each micro-batch's backward, then ``synchronize_gradients()``
  (PyTorch's pending-gradient rewrite: the reductions run outside any backward); skipped where
  FSDPModule has no such method (the scenario reports it);
- ``pipelining``: ``torch.distributed.pipelining``'s ``ScheduleGPipe``, one stage per rank, FSDP over
  both: 2.8 - 2.14 call ``post_backward`` and the final callback by hand, 2.15 finalizes manually
  and asynchronously.
Step 0: no rank uses ``spare``, so its gradient must be None. Step 1: rank 0 uses it, so it must
equal the single-process reference (rank 0's contribution averaged over both ranks). After each
backward no usage probe is left and the patch issued exactly one flag all-reduce.
"""

from __future__ import annotations

import pytest

import _dist_checks as ck
import _dist_common as sc
import _restore_unused_param_grads_scenarios as fin
from _dist_launcher import run_ranks

pytestmark = pytest.mark.timeout(240)

PG_TIMEOUT_S = "20"
OUTER_TIMEOUT_S = 180.0
PARAMS = {"one_unit": 4, "two_units": 6}  # FSDPParams in units with the fill on (one domain)
HAS_MANUAL = ck.ex.has_manual_backward_finalization(ck.RELEASE)  # no FSDP2 import at collection
# Outside the measured releases the scenario says what this FSDP2 has (the pending-gradient rewrite,
# overlaid and counted as 2.16, has no manual finalization): every path is collected, run where it exists.
MEASURED = ck.ex.is_measured(ck.RELEASE)
NO_MANUAL = "this torch has no manual backward finalization (FSDPModule.finalize_backward, torch 2.15+)"
NO_PIPELINING = ("torch's pipelining finalizes through an FSDPModule method this FSDP2 lacks "
                 "(FSDP2 files of another torch overlaid)")
PATHS = [path for path in fin.PATHS if HAS_MANUAL or not MEASURED or path not in fin.MANUAL_PATHS]
NO_SYNCHRONIZE = "this torch has no FSDPModule.synchronize_gradients (PyTorch's pending-gradient rewrite)"
CASES = [f"{path}/{kind}" for path in PATHS for kind in fin.MODELS] + ["pipelining/one_unit"]


@pytest.fixture(scope="module")
def run():
    result = run_ranks(
        "restore_unused_param_grads:finalization", env={"FSDP_DIST_PG_TIMEOUT_S": PG_TIMEOUT_S}, timeout=OUTER_TIMEOUT_S
    )
    result.assert_clean()
    ck.assert_registry(result, {"restore_unused_param_grads": "applied"})
    if MEASURED:
        assert result[0].data["has_manual_finalization"] == HAS_MANUAL, "tests/expected.py is wrong about this torch"
    return result


def _skip_if_not_run(run, case: str) -> None:
    # Not keyed on the release: the rewrite and torch 2.15 relabelled count as the same one.
    data = run[0].data
    if case.startswith(fin.SYNCHRONIZE_PATHS) and not data["has_synchronize_gradients"]:
        pytest.skip(NO_SYNCHRONIZE)
    if case.startswith(fin.MANUAL_PATHS) and not data["has_manual_finalization"]:
        pytest.skip(NO_MANUAL)
    if case.startswith("pipelining") and not data["pipelining_runs"]:
        pytest.skip(NO_PIPELINING)


def _reference(run, case: str, step: int) -> dict:
    path, kind = case.split("/")
    model = fin.build(kind)
    ck.load_weights(model, ck.gather(run, lambda r: r.cases[case]["init_params"]), must_equal=True)
    return sc.reference_grads(model, fin.plan, step=step, n_micro_batches=fin.micro_batches_of(path))


@pytest.mark.parametrize("case", CASES)
def test_unused_param_keeps_none_and_used_params_their_averaged_grads(run, case):
    _skip_if_not_run(run, case)
    for step in range(fin.STEPS):
        ref = _reference(run, case, step)
        assert all(ref[n] is None for n in fin.SPARE) == (step == 0)
        ck.assert_grads_match(ck.case_grads(run, case, key=f"grads_{step}"), ref)


@pytest.mark.parametrize("case", CASES)
def test_one_flag_all_reduce_per_backward_and_no_probe_left(run, case):
    _skip_if_not_run(run, case)
    for rank in run.ranks:
        rec = rank.cases[case]
        for step in range(fin.STEPS):
            assert rec[f"probes_left_{step}"] == [], (rank.rank, step, rec[f"probes_left_{step}"])
            assert rec[f"all_reduce_numels_{step}"] == [PARAMS[case.split("/")[1]]], (rank.rank, step)


@pytest.mark.skipif(MEASURED and not HAS_MANUAL, reason=NO_MANUAL)
def test_async_restore_waits_for_the_reductions(run):
    """``finalize_backward(async_op=True)`` issues the reductions; the restore belongs to ``wait()``."""
    _skip_if_not_run(run, "manual_async")
    for rank in run.ranks:
        assert rank.cases["manual_async/one_unit"]["probe_before_wait_0"] == ["<root>"]
        assert rank.cases["manual_async/two_units"]["probe_before_wait_0"] == ["<root>", "block"]


@pytest.mark.skipif(MEASURED and not HAS_MANUAL, reason=NO_MANUAL)
def test_reset_iter_state_drops_the_probe_of_an_abandoned_backward(run):
    _skip_if_not_run(run, "manual_sync")
    for rank in run.ranks:
        rec = rank.cases["manual_reset/two_units"]
        assert rec["probes_before_reset"] == ["block"], rec
        assert rec["probes_after_reset"] == [], rec
