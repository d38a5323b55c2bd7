"""A whole run as users run it (issue 29, item 3): checkpoint, resume in fresh processes, evaluations.

Scenario ``lifecycle`` (``_lifecycle_scenarios``), 2 gloo ranks, five launches:

* ``on``: every entry active (the defaults). Save phase: the uninterrupted runs of every case of
  :data:`ON_CASES` (1-D FSDP, HSDP (2, 1), CPU offload; the unused-param fill on and off), each
  checkpointed after step ``K`` and before any step; resume phase (fresh processes): a new model
  and optimizer load each checkpoint and continue. Parameters, optimizer state and every
  evaluation are bitwise those of the uninterrupted run; the full-state-dict round trip is exact.
* ``dcp_off`` (our entries, ``dcp_optimizer_state_init`` disabled): the fill on, saved after step
  ``K``; resumed in the ``on`` resume launch. The checkpoint lacks the spare's optimizer entries
  (``restore_unused_param_grads`` kept its gradient None): the resume raises the missing key,
  whatever the loader does (the template of a fresh optimizer has every entry either way).
* ``off`` (``FSDP_AUTOPATCH_ENABLED=0``, torch alone): the fill on resumes (torch's zeros give the
  spare state); a parameter that never had a gradient raises the missing key (PyTorch issue
  192202); the step-0 checkpoint resumes silently wrong (Adam ``step`` 1 from the dummy step,
  PyTorch issue 164929); an evaluation under ``inference_mode`` before the first step crashes the
  next forward outside inference mode (here the ``no_grad`` evaluation; without one, the first step).

The ``inference_mode`` case with the plugin on needs the entry ``inference_mode_first_forward``:
where the catalogue has none yet it is not run, and its test is skipped with that reason.
Measured values are printed (``pytest -s``) for the closing note.
"""

from __future__ import annotations

import time

import pytest
import torch

import _dist_checks as ck
import _lifecycle_scenarios as lc
from _dist_launcher import RunResult, run_ranks

pytestmark = pytest.mark.timeout(900)

LAUNCH_TIMEOUT_S = 240
IM_ENTRY = "inference_mode_first_forward"
DCP_BUG, IM_BUG = ck.ex.BUG_OF["dcp_optimizer_state_init"], ck.ex.BUG_OF[IM_ENTRY]
IM_CASE = "fsdp/fill/im"
ON_CASES = ["fsdp/fill", "fsdp/nofill", "hsdp/fill", "offload/fill", "offload/nofill"]
# torch alone: the fill (and the im case, which has it) only where torch has its own (>= 2.13);
# the im case last: it crashes there
OFF_CASES = ["fsdp/fill", "fsdp/nofill", IM_CASE] if ck.NATIVE_UNUSED_PARAM_API else ["fsdp/nofill"]
NO_FILL_SKIP = "torch < 2.13 has no unused-param fill without the plugin"
OFF_ENV = {"FSDP_AUTOPATCH_ENABLED": "0"}
DCP_OFF_ENV = {"FSDP_AUTOPATCH_DCP_OPTIMIZER_STATE_INIT_ENABLED": "0"}
MISSING_KEY = "Missing key in checkpoint state_dict: optim.state."
INFERENCE_ERROR = "Inplace update to inference tensor outside InferenceMode is not allowed."


def im_entry_exists() -> bool:
    from fsdp_autopatch import _catalogue

    return IM_ENTRY in _catalogue.BY_NAME


IM_SKIP = f"the catalogue has no entry {IM_ENTRY!r} yet: with the plugin on the first step still crashes"


class Lifecycle:
    """The five launches' results, and the seconds each took."""

    def __init__(self, root: str) -> None:
        self.seconds: dict[str, float] = {}
        self.on_cases = ON_CASES + ([IM_CASE] if im_entry_exists() else [])
        self.save = {
            "on": self._launch("on/save", {}, phase="save", tag="on", cases=self.on_cases, step0=self.on_cases,
                               dir=root),
            "dcp_off": self._launch("dcp_off/save", DCP_OFF_ENV, phase="save", tag="dcp_off", cases=["fsdp/fill"],
                                    step0=[], dir=root),
            "off": self._launch("off/save", OFF_ENV, phase="save", tag="off", cases=OFF_CASES, step0=["fsdp/nofill"],
                                dir=root),
        }
        on_runs = [["on", case, step] for case in self.on_cases for step in (lc.K, 0)]
        off_runs = [["off", case, step] for case, step in (("fsdp/fill", lc.K), ("fsdp/nofill", lc.K),
                                                            ("fsdp/nofill", 0)) if case in OFF_CASES]
        self.resume = {
            "on": self._launch("on/resume", {}, phase="resume", runs=on_runs + [["dcp_off", "fsdp/fill", lc.K]],
                               dir=root),
            "off": self._launch("off/resume", OFF_ENV, phase="resume", runs=off_runs, dir=root),
        }

    def _launch(self, name: str, env: dict[str, str], **args) -> RunResult:
        start = time.monotonic()
        run = run_ranks("lifecycle", args=args, env=env, timeout=LAUNCH_TIMEOUT_S)
        self.seconds[name] = round(time.monotonic() - start, 1)
        return run

    def uninterrupted(self, tag: str, case: str) -> list[dict]:
        return [_ok(rank, case) for rank in self.save[tag].ranks]

    def resumed(self, loader: str, tag: str, case: str, step: int) -> list[dict]:
        return [_ok(rank, f"{tag}/{case}/step{step}") for rank in self.resume[loader].ranks]


@pytest.fixture(scope="module")
def life(tmp_path_factory) -> Lifecycle:
    result = Lifecycle(str(tmp_path_factory.mktemp("lifecycle")))
    print(f"\nlifecycle launches (s): {result.seconds}")
    return result


def _ok(rank, case: str) -> dict:
    rec = rank.cases.get(case)
    assert rec is not None, f"rank {rank.rank} did not reach {case!r}"
    assert rec["error"] is None, f"rank {rank.rank} {case}: {rec['error']['type']}: {rec['error']['message']}"
    return rec


def _error(run: RunResult, case: str, bug: str) -> list[str]:
    """Per rank, ``type: message`` of what ``case`` raised; [] where it raised nowhere, which must be
    what ``tests/expected.py`` says of ``bug`` on this torch with the plugin off (2.13, 2.15: it raises)."""
    errors = [ck.error_of(rank, case) for rank in run.ranks]
    outcome = ck.ex.REPRODUCES if any(errors) else ck.ex.FIXED
    assert ck.unpatched_agrees(bug, outcome), f"{case}: bug ({bug}) {outcome!r}, expected {ck.UNPATCHED[bug]!r}"
    assert all(errors) or not any(errors), f"{case} raised on some ranks only: {errors}"
    return [f"{e['type']}: {e['message']}" for e in errors if e]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def evals_from(want: dict, step: int) -> dict[str, float]:
    """The uninterrupted run's evaluations from those after ``step`` on (what a resumed run evaluates)."""
    return {key: value for key, value in want["evals"].items() if int(key.split("/")[0]) >= step}


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    """Every parameter and optimizer-state tensor bitwise the same."""
    assert got["params"].keys() == want["params"].keys()
    for n, p in want["params"].items():
        assert torch.equal(got["params"][n], p), (
            f"{what}: parameter {n} differs by {max_abs_diff(got['params'], want['params'])}"
        )
    assert got["optim"].keys() == want["optim"].keys(), (what, sorted(got["optim"]), sorted(want["optim"]))
    for n, state in want["optim"].items():
        assert got["optim"][n].keys() == state.keys(), (what, n)
        for key, value in state.items():
            assert torch.equal(got["optim"][n][key], value), f"{what}: optimizer state {n}.{key} differs"


def test_launches_clean(life):
    for run in (*life.save.values(), *life.resume.values()):
        run.assert_clean()  # every rank finished its cases; what a case raised is asserted below


def test_every_entry_active(life):
    """``on``: each entry as this torch expects it, the DCP fix acting at save and at resume; ``off``: none."""
    ck.assert_registry(life.save["on"], ck.EXPECTED_STATUS)
    for run in (life.save["on"], life.resume["on"]):
        for rank in run.ranks:
            records = ck.statuses(rank)
            assert records["dcp_optimizer_state_init"]["status"] == "applied", records["dcp_optimizer_state_init"]
        assert all(count > 0 for count in ck.fired(run, "dcp_optimizer_state_init")), run.describe()
    assert all(count > 0 for count in ck.fired(life.save["on"], "restore_unused_param_grads"))
    for rank in life.save["dcp_off"].ranks:
        assert ck.statuses(rank)["dcp_optimizer_state_init"]["status"] == "disabled"
        assert ck.statuses(rank)["restore_unused_param_grads"]["status"] == "applied"
    for run in (life.save["off"], life.resume["off"]):
        for rank in run.ranks:
            assert rank.autopatch["applied"] == [], rank.autopatch


@pytest.mark.parametrize("step", [lc.K, 0])
@pytest.mark.parametrize("case", ON_CASES + [IM_CASE])
def test_resume_bitwise_equal_to_uninterrupted(life, case, step):
    """After the resume in fresh processes: parameters, optimizer state, evaluations bitwise the same."""
    if case not in life.on_cases:
        pytest.skip(IM_SKIP)
    for want, got in zip(life.uninterrupted("on", case), life.resumed("on", "on", case, step)):
        assert got["evals"] == evals_from(want, step), (got["evals"], want["evals"])
        assert set(got["loaded_steps"].values()) <= ({0.0} if step == 0 else {0.0, float(step)})
        assert None not in got["loaded_steps"].values(), got["loaded_steps"]  # every parameter has state
        assert_bitwise(got, want, f"{case} resumed after step {step}")
    print(f"\n[on] {case} resumed after step {step}: max abs diff 0.0, optimizer state equal")


def test_inference_mode_first_equals_no_grad(life):
    """The evaluation before the first step under ``inference_mode``: the run of ``no_grad``, bitwise."""
    if IM_CASE not in life.on_cases:
        pytest.skip(IM_SKIP)
    for im, ng in zip(life.uninterrupted("on", IM_CASE), life.uninterrupted("on", "fsdp/fill")):
        assert im["evals"] == ng["evals"]
        assert_bitwise(im, ng, f"{IM_CASE} against fsdp/fill")
    for run in (life.save["on"], life.resume["on"]):  # each first forward under inference_mode
        assert all(count > 0 for count in ck.fired(run, IM_ENTRY)), ck.fired(run, IM_ENTRY)
    print(f"\n[on] {IM_CASE}: bitwise the no_grad run (fsdp/fill), max abs diff 0.0")


ROUND_TRIPS = [("on", case) for case in ON_CASES] + [("off", "fsdp/fill"), ("off", "fsdp/nofill")]


@pytest.mark.parametrize("tag,case", ROUND_TRIPS)
def test_full_state_dict_round_trip(life, tag, case):
    """``get_model_state_dict`` (full, cpu_offload) on rank 0, set into a fresh model: every value back."""
    if case not in (life.on_cases if tag == "on" else OFF_CASES):
        pytest.skip(NO_FILL_SKIP)
    recs = life.uninterrupted(tag, case)
    names = sorted(recs[0]["params"])
    assert recs[0]["full_keys"] == names and recs[1]["full_keys"] == []  # cpu_offload: rank 0 holds it
    for rec in recs:
        assert_bitwise({"params": rec["round_trip"], "optim": {}}, {"params": rec["params"], "optim": {}}, case)
    for n in names:
        shards = [rec["params"][n] for rec in recs]
        full = shards[0] if lc.CASES[case][0] == "hsdp" else torch.cat(shards)  # (2, 1): each rank holds it all
        assert torch.equal(recs[0]["round_trip_full"][n], full), n


def test_off_torch_resumes_with_the_fill(life):
    """torch alone, the fill on: its zeros give the spare optimizer state, the resume is exact."""
    if "fsdp/fill" not in OFF_CASES:
        pytest.skip(NO_FILL_SKIP)
    for want, got in zip(life.uninterrupted("off", "fsdp/fill"), life.resumed("off", "off", "fsdp/fill", lc.K)):
        assert got["evals"] == evals_from(want, lc.K)
        assert_bitwise(got, want, "off fsdp/fill")
    print("\n[off] fsdp/fill resumed after step 1: max abs diff 0.0 (torch alone resumes)")


def test_off_missing_key_for_a_parameter_that_never_had_a_gradient(life):
    """torch alone, the fill off: the spare never had a gradient, the resume stops (PyTorch issue 192202)."""
    errors = _error(life.resume["off"], f"off/fsdp/nofill/step{lc.K}", DCP_BUG)
    for error in errors:
        assert error.startswith("CheckpointException") and MISSING_KEY in error, error
        assert "optim.state.spare." in error or "optim.state.solo." in error, error
    print(f"\n[off] fsdp/nofill resume: {_key_line(errors[0]) if errors else 'resumes on this torch'}")


def test_dcp_fix_off_restore_leaves_missing_key(life):
    """Ours without the DCP fix, the fill on: ``restore_unused_param_grads`` keeps the spare's gradient
    None, the checkpoint has no entry for it, and the resume stops (with the fix: test_resume_...)."""
    errors = _error(life.resume["on"], f"dcp_off/fsdp/fill/step{lc.K}", DCP_BUG)
    for error in errors:
        assert error.startswith("CheckpointException") and MISSING_KEY + "spare." in error, error
    print(f"\n[dcp_off] fsdp/fill resume: {_key_line(errors[0]) if errors else 'resumes on this torch'}")


def test_off_step0_checkpoint_silently_wrong(life):
    """torch alone: the step-0 checkpoint holds the dummy step's ``step`` 1; the resumed run drifts."""
    diffs, loaded = [], []
    for want, got in zip(life.uninterrupted("off", "fsdp/nofill"), life.resumed("off", "off", "fsdp/nofill", 0)):
        loaded.append(set(got["loaded_steps"].values()))
        diffs.append(max_abs_diff(got["params"], want["params"]))
    outcome = ck.ex.REPRODUCES if max(diffs) > 0 else ck.ex.FIXED
    assert ck.unpatched_agrees(DCP_BUG, outcome), (outcome, ck.UNPATCHED[DCP_BUG], diffs)
    if outcome == ck.ex.REPRODUCES:
        assert loaded == [{1.0}] * len(loaded) and min(diffs) > 1e-4, (loaded, diffs)
    last = f"{lc.STEPS}/no_grad"
    print(f"\n[off] fsdp/nofill resumed from step 0: loaded Adam step 1.0; after {lc.STEPS} steps the parameters "
          f"differ by up to {max(diffs):.3e}; eval loss {got['evals'][last]:.6f} instead of {want['evals'][last]:.6f}")


def test_off_inference_mode_before_first_step_crashes(life):
    """torch alone: an evaluation under ``inference_mode`` before the first step crashes the next forward
    outside inference mode: the ``no_grad`` evaluation that follows it, else the first training step."""
    if IM_CASE not in OFF_CASES:
        pytest.skip(NO_FILL_SKIP)
    errors = _error(life.save["off"], IM_CASE, IM_BUG)
    for error in errors:
        assert error.startswith("RuntimeError") and INFERENCE_ERROR in error, error
    first = [rank.cases[IM_CASE]["evals"] for rank in life.save["off"].ranks]
    if errors:
        # the inference_mode evaluation ran; the next forward outside inference mode (the no_grad
        # evaluation before the first step; without it, the first step) raised
        assert all(list(evals) == ["0/inference_mode"] for evals in first), first
    print(f"\n[off] {IM_CASE}: {errors[0][:110] if errors else 'trains (no crash on this torch)'}")


def _key_line(error: str) -> str:
    start = error.index(MISSING_KEY)
    return "CheckpointException ... " + error[start:].split("\n")[0]
