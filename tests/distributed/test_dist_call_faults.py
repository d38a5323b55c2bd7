"""Call-time isolation on real FSDP2 training steps: a function of ours made to raise.

Gloo ranks on CPU, the plugin on (``_call_faults_scenarios``). For each case one function a
wrapper calls (before torch's original, or after it where the wrapper has code after) is replaced
by a stand-in that raises ``InjectedFault``; each case runs the same training four ways in one
process: the patch reverted (torch's own behaviour), the patch healthy, the fault, and after it.
On every rank:

* no exception of ours reaches the training step: each run gives what the patch reverted gives
  (the values, or torch's own error where the patch's bug strikes);
* the patch's record is ``failed`` with "failed at call time: InjectedFault: <message> in <our
  function>", one WARNING is logged, and from then on the wrapper is not called (the stand-in is
  not reached, ``fired`` stops growing);
* with ``FSDP_AUTOPATCH_STRICT=1`` the injected exception reaches the caller, and afterwards torch's
  own behaviour again;
* where torch itself raises inside a wrapped call (an invalid ``reshard_after_forward``, a
  collective the restore issues), the user gets exactly torch's exception and the patch stays.

Three launches: 2 ranks (every case), 2 ranks with ``FSDP_AUTOPATCH_STRICT=1``, and 4 ranks for
the post-forward mesh cache (the only layout where its cache is used: 1 < k < shard size).
The third-party example (examples/third_party_patch) is on the ranks' path as a distribution
(``*.dist-info`` next to its module) unless it is installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import _call_faults_scenarios as cf
import _dist_checks as ck
from _dist_launcher import RunResult, run_ranks

pytestmark = pytest.mark.timeout(300)

LAUNCH_TIMEOUT_S = 120.0
PG_TIMEOUT_S = "15"  # a rank left alone in a collective fails fast
PHASES = ["off", "healthy", "fault", "later"]
FAULTS = tuple(name for name, case in cf.CASES.items() if case.target and case.kind == "ours")
TORCH_RAISES = tuple(name for name in cf.CASES if name.startswith("torch/"))
FOUR_RANKS = ("post_forward_mesh_cache/before", "post_forward_mesh_cache/after")
# SHARED.put only runs where the cache is used: an integer 1 < k < shard size (4 ranks)
TWO_RANKS = tuple(name for name in FAULTS if name != "post_forward_mesh_cache/after")
# the healthy patch never fires in these 2-rank runs: k=2 is the shard size there (torch's True);
# the example only counts (its census is checked instead)
NEVER_FIRES_ON_TWO_RANKS = {"post_forward_mesh_cache/before", f"{cf.EXAMPLE}/before"}
# keep_param_attributes/after fails at float(): before that the patch had carried the tags
BEFORE_THE_FAULT = {"keep_param_attributes/after": ("tags_sharded", "tags_trained")}
EXAMPLE_SOURCE = Path(__file__).resolve().parents[2] / "examples/third_party_patch/src/fsdp_autopatch_example"


@pytest.fixture(scope="module")
def job_env(tmp_path_factory) -> dict[str, str]:
    env = {"FSDP_DIST_PG_TIMEOUT_S": PG_TIMEOUT_S}
    if importlib.util.find_spec("fsdp_autopatch_example") is None:  # as pip leaves it, on PYTHONPATH
        root = tmp_path_factory.mktemp("third_party")
        shutil.copytree(EXAMPLE_SOURCE, root / "fsdp_autopatch_example")
        info = root / "fsdp_autopatch_example-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fsdp-autopatch-example\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(
            "[fsdp_autopatch.patches]\npost_backward_census = fsdp_autopatch_example:PATCH\n"
        )
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))
    return env


def launch(plan: list, env: dict[str, str], world_size: int = 2) -> RunResult:
    args = {"plan": plan}
    return run_ranks("call_faults", args=args, env=env, world_size=world_size, timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def default(job_env) -> RunResult:
    return launch([[name, PHASES, False] for name in TWO_RANKS + TORCH_RAISES], job_env)


@pytest.fixture(scope="module")
def strict(job_env) -> RunResult:
    plan = [[name, ["fault", "later"], False] for name in TWO_RANKS + TORCH_RAISES]
    return launch(plan, {**job_env, "FSDP_AUTOPATCH_STRICT": "1"})


@pytest.fixture(scope="module")
def four_ranks(job_env) -> RunResult:
    plan = [[name, PHASES, False] for name in FOUR_RANKS] + [[name, ["fault", "later"], True] for name in FOUR_RANKS]
    return launch(plan, job_env, world_size=4)


# --- reading the records -------------------------------------------------------------------------


def case_records(run: RunResult, key: str) -> list[dict[str, Any]]:
    """Every rank's record of one case; skips a case whose patch does not apply on this torch."""
    assert not run.timed_out, run.describe()
    name = key.removesuffix("/strict")
    patch = cf.CASES[name].patch
    records = []
    for rank in run.ranks:
        rec = rank.cases.get(key)
        assert rec is not None, f"rank {rank.rank} did not reach {key}\n{run.describe()}"
        error = rec["error"]
        assert error is None, f"rank {rank.rank}: {key} itself raised {error['type']}\n{error['traceback']}"
        records.append(rec)
    if "skipped" in records[0]:
        status = records[0]["skipped"]["status"]
        assert ck.EXPECTED_STATUS.get(patch) in (None, status, ck.ex.NOT_MEASURED), (patch, status)
        pytest.skip(f"{patch} is {status} on torch {torch.__version__}: nothing to make fail")
    return records


def same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(map(same, got, want))
    return got == want


def message(error: dict[str, Any]) -> str:
    """An exception's message, a printed set's items sorted (their order differs between processes)."""
    return re.sub(r"\{([^{}]*)\}", lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", error["message"])


def shown(outcome: dict[str, Any]) -> str:
    error = outcome["error"]
    return "ran" if error is None else f"{error['type']}: {error['message'][:300]}\n{error['traceback'][-3000:]}"


def assert_same_outcome(got: dict[str, Any], want: dict[str, Any], what: str, skip: tuple[str, ...] = ()) -> None:
    """``got`` is what ``want`` is: the same exception (type and message) or the same values."""
    if got["error"] is not None:
        assert got["error"]["type"] != "InjectedFault", f"{what}: our exception reached the step: {shown(got)}"
    if want["error"] is not None:
        assert got["error"] is not None, f"{what}: ran, where torch's own code raises {shown(want)}"
        pair = (got["error"]["type"], message(got["error"]))
        assert pair == (want["error"]["type"], message(want["error"])), f"{what}: {shown(got)} != {shown(want)}"
        return
    assert got["error"] is None, f"{what}: raised {shown(got)}"
    assert got.keys() == want.keys(), what
    for key in want.keys() - {"error", *skip}:
        assert same(got[key], want[key]), f"{what}: {key} differs: {got[key]} != {want[key]}"


def assert_failed_at_call_time(record: dict[str, Any], name: str, what: str) -> None:
    patch = cf.CASES[name].patch
    expected = f"failed at call time: InjectedFault: {cf.message_of(name)} in {cf.where_of(name)}"
    if record["status"] is not None:  # a fix or a third-party patch; a policy has only its text
        assert record["status"] == "failed", f"{what}: {patch} is {record['status']} ({record['reason']})"
    assert (record["reason"] or "").startswith(expected), f"{what}: {patch}'s record: {record['reason']!r}"


# --- a fault of ours ---------------------------------------------------------------------------------


def assert_isolated(records: list[dict[str, Any]], name: str, fires: bool) -> None:
    case, patch = cf.CASES[name], cf.CASES[name].patch
    for rank, rec in enumerate(records):
        off, healthy, fault, later = (rec[phase] for phase in PHASES)
        what = f"{name} rank {rank}"
        assert healthy["calls"] > 0, f"{what}: the runs never reach {cf.where_of(name)}: the case proves nothing"
        assert fault["calls"] >= 1 and later["calls"] == 0, (what, fault["calls"], later["calls"])
        for run in case.runs:
            skip = BEFORE_THE_FAULT.get(name, ())
            assert_same_outcome(fault["runs"][run], off["runs"][run], f"{what} {run} (fault)", skip)
            assert_same_outcome(later["runs"][run], off["runs"][run], f"{what} {run} (later)")
            for key in skip:  # what the patch did before it failed stays done
                assert same(fault["runs"][run][key], healthy["runs"][run][key]), (what, key)
        assert healthy["record"]["status"] in (None, "applied"), (what, healthy["record"])
        assert not (healthy["record"]["reason"] or "").startswith("failed at call time"), (what, healthy["record"])
        assert later["record"] == fault["record"], what
        # one warning, for this patch, when it failed; none later
        assert len(fault["warnings"]) == 1 and fault["warnings"][0].startswith(f"{patch} failed at call time"), (
            what, fault["warnings"])
        assert later["warnings"] == [], (what, later["warnings"])
        if healthy["fired"] is not None:  # fixes: fired stops growing once the patch failed
            assert later["fired"] == 0, (what, later["fired"])
            assert not fires or healthy["fired"] > 0, f"{what}: the healthy patch never fired: the check is vacuous"
        if healthy["census"] is not None and patch == cf.EXAMPLE:  # the example counts, it never fires
            assert healthy["census"] > 0 and later["census"] == 0, (what, healthy["census"], later["census"])
        assert_failed_at_call_time(fault["record"], name, what)  # last: what happened is checked first


@pytest.mark.parametrize("name", TWO_RANKS)
def test_a_fault_of_ours_gives_torchs_own_behaviour(default, name):
    assert_isolated(case_records(default, name), name, fires=name not in NEVER_FIRES_ON_TWO_RANKS)


@pytest.mark.parametrize("name", FOUR_RANKS)
def test_a_fault_of_ours_in_the_mesh_cache_on_four_ranks(four_ranks, name):
    records = case_records(four_ranks, name)
    assert_isolated(records, name, fires=True)
    for rec in records:  # torch alone: 2 process groups per unit (4 units); the cache: 2 in all
        off, healthy = rec["off"]["runs"]["reshard_int"], rec["healthy"]["runs"]["reshard_int"]
        assert (off["groups"], off["meshes"], healthy["groups"], healthy["meshes"]) == (8, 4, 2, 1)


def test_the_policy_fault_leaves_torchs_default(default):
    records = case_records(default, f"{cf.POLICY}/after")
    # torch's default: False from 2.13; before, no such attribute until the backport's setter runs
    # (measured on 2.8 and 2.12, 2026-12-02)
    default_flag = False if ck.NATIVE_UNUSED_PARAM_API else None
    for rec in records:
        flags = {phase: set(rec[phase]["runs"]["mlp"]["flags"].values()) for phase in PHASES}
        want = {"off": {default_flag}, "healthy": {True}, "fault": {default_flag}, "later": {default_flag}}
        assert flags == want, flags


def test_the_ranks_ran_with_the_third_party_example(default):
    assert all(rank.data["example"] for rank in default.ranks)
    default.assert_clean()


# --- strict ----------------------------------------------------------------------------------------


def assert_strict(records: list[dict[str, Any]], name: str, torchs_own: list[dict[str, Any]]) -> None:
    runs = cf.CASES[name].runs
    for rank, (rec, reference) in enumerate(zip(records, torchs_own)):
        what = f"{name} rank {rank} (strict)"
        first = rec["fault"]["runs"][runs[0]]
        assert first["error"] is not None, f"{what}: the injected exception did not reach the caller"
        assert (first["error"]["type"], first["error"]["message"]) == ("InjectedFault", cf.message_of(name)), (
            f"{what}: {shown(first)}")
        assert len(rec["fault"]["warnings"]) == 1, (what, rec["fault"]["warnings"])
        for run in runs[1:]:  # the patch failed: torch's own from the next run on
            assert_same_outcome(rec["fault"]["runs"][run], reference["off"]["runs"][run], f"{what} {run}")
        for run in runs:
            assert_same_outcome(rec["later"]["runs"][run], reference["off"]["runs"][run], f"{what} {run} (later)")
        assert rec["later"]["calls"] == 0, what
        assert_failed_at_call_time(rec["fault"]["record"], name, what)


@pytest.mark.parametrize("name", TWO_RANKS)
def test_strict_lets_the_injected_exception_reach_the_caller(strict, default, name):
    assert all(rank.data["strict_at_start"] for rank in strict.ranks)  # FSDP_AUTOPATCH_STRICT=1 read
    assert_strict(case_records(strict, name), name, case_records(default, name))


@pytest.mark.parametrize("name", FOUR_RANKS)
def test_strict_in_the_mesh_cache_on_four_ranks(four_ranks, name):
    assert_strict(case_records(four_ranks, f"{name}/strict"), name, case_records(four_ranks, name))


# --- torch raises inside a wrapped call ---------------------------------------------------------------


def _applied_throughout(rec: dict[str, Any], phases: list[str], what: str) -> None:
    for phase in phases:
        record = rec[phase]["record"]
        assert record["status"] == "applied", f"{what} ({phase}): {record}"
        assert rec[phase]["warnings"] == [], f"{what} ({phase}): {rec[phase]['warnings']}"


@pytest.mark.parametrize("launch_name", ["default", "strict"])
def test_torchs_validation_error_reaches_the_user_unchanged(request, launch_name):
    run = request.getfixturevalue(launch_name)
    name = "torch/invalid_reshard_after_forward"
    reference = case_records(request.getfixturevalue("default"), name)
    for rank, (rec, ref) in enumerate(zip(case_records(run, name), reference)):
        off = ref["off"]["runs"]["invalid_reshard"]
        assert off["error"] is None
        errors = off["errors"]
        assert all(error is not None and error["type"] == "ValueError" for error in errors.values()), errors
        phases = ["fault", "later"] if launch_name == "strict" else ["healthy", "fault", "later"]
        for phase in phases:
            got = rec[phase]["runs"]["invalid_reshard"]
            assert got["error"] is None
            pairs = {value: (e["type"], e["message"]) for value, e in got["errors"].items()}
            assert pairs == {value: (e["type"], e["message"]) for value, e in errors.items()}, (rank, phase)
        _applied_throughout(rec, phases, f"{name} rank {rank}")


COLLECTIVES = {"torch/collective": "unused_expert", "torch/clip_collective": "clip_two_meshes"}


@pytest.mark.parametrize("launch_name", ["default", "strict"])
@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_a_collective_error_inside_a_wrapper_reaches_the_user_unchanged(request, launch_name, name):
    """A collective our code issues (the restore's all-reduce, clip's full_tensor() per mesh) raises
    as a peer's failure would: the user gets that error, and the patch stays."""
    run, run_name = request.getfixturevalue(launch_name), COLLECTIVES[name]
    reference = case_records(request.getfixturevalue("default"), name)
    for rank, (rec, ref) in enumerate(zip(case_records(run, name), reference)):
        what = f"{name} rank {rank} ({launch_name})"
        assert rec["fault"]["calls"] >= 1, f"{what}: the collective was never reached"
        got = rec["fault"]["runs"][run_name]
        assert got["error"] is not None, f"{what}: the collective's error did not reach the user"
        assert (got["error"]["type"], got["error"]["message"]) == ("RuntimeError", cf.COLLECTIVE_ERROR), (
            f"{what}: {shown(got)}")
        _applied_throughout(rec, ["fault", "later"], what)
        # the patch stayed: the next step is the healthy patch's again, not torch's own
        assert rec["later"]["fired"] > 0 and rec["later"]["calls"] >= 1, what
        assert_same_outcome(rec["later"]["runs"][run_name], ref["healthy"]["runs"][run_name], what)
        off, healthy = ref["off"]["runs"][run_name], ref["healthy"]["runs"][run_name]
        assert off["error"] is not None or not same(off["none"], healthy["none"]), "the patch changes nothing here"
