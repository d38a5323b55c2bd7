"""grouped_module_reuse's variants (issue 183702) on 2 gloo ranks (``_grouped_module_reuse_scenarios``).
Its case (``test_dist_cases.py``) shows the issue's smallest input, off and on: ``fully_shard(layer)``,
``fully_shard([norm, head])``, ``fully_shard(model)``, the forward calling ``head`` again on
``mtp.proj(h)`` and keeping that output on ``model.mtp.aux``, one micro-batch.

Here, off and on: the repeat call over 2 micro-batches, called twice more (``mtp2``), on HSDP
meshes and under ``torch.compile``: without the patch every rank raises in backward there too
(2.13 - 2.15; 2.8 - 2.12 are right), with it gradients equal the reference, fired once per repeat
output. The paths the patch must leave alone (the group used once, ``aux`` returned, chunked loss
with one backward and with a backward per chunk): bitwise equal, the same collectives.
Worlds in one process: threaded ranks and the fake backend.
"""
from __future__ import annotations

import importlib.util
import re

import pytest
import torch

import _dist_checks as ck
import _grouped_module_reuse_scenarios as rs
from _dist_launcher import run_ranks

pytestmark = pytest.mark.timeout(300)

PATCH = "grouped_module_reuse"
BUG = ck.ex.BUG_OF[PATCH]
LAUNCH_TIMEOUT_S = 150.0
STORAGE_RE = re.compile(r"setStorage: .* out of bounds for storage of size 0")
TOLERANCE = 1e-5  # max |grad - reference|, fp32

REUSE_CASES = ("mtp/2", "mtp2/1", "mtp2/2", "mtp/1/hsdp", "mtp/1/hsdp_rep", "mtp/1/compile")
UNCHANGED_MODES = ("full", "mtp_return", "chunk_one", "chunk_each")
UNCHANGED_CASES = tuple(f"{mode}/{micro}" for mode in UNCHANGED_MODES for micro in (1, 2))
# the repeat-call cases last: without the patch they raise in backward (on every rank alike)
CASES = UNCHANGED_CASES + REUSE_CASES
APPLIED = ck.EXPECTED_STATUS[PATCH] == "applied"


@pytest.fixture(scope="module")
def unpatched():
    return run_ranks(
        "grouped_module_reuse", args={"cases": list(CASES)}, env={ck.ENV[PATCH]: "0"}, timeout=LAUNCH_TIMEOUT_S
    )


@pytest.fixture(scope="module")
def patched():
    return run_ranks("grouped_module_reuse", args={"cases": list(CASES)}, timeout=LAUNCH_TIMEOUT_S)


def _error(run, case: str, rank: int = 0):
    return ck.error_of(run[rank], case)


def _grads(run, case: str, step: int) -> dict:
    """The full gradients of one step; every rank's ``full_tensor()`` agrees."""
    per_rank = [r.cases[case][f"grads_{step}"] for r in run.ranks]
    for other in per_rank[1:]:
        for name, grad in per_rank[0].items():
            assert (grad is None) == (other[name] is None), (case, name)
            assert grad is None or torch.equal(grad, other[name]), (case, step, name)
    return per_rank[0]


def _reference(run, case: str, step: int) -> dict:
    mode, micro, _ = rs.parse(case)
    model = rs.build(mode)
    params = run[0].cases[case][f"params_{step}"]
    for rank in run.ranks[1:]:
        for name, value in rank.cases[case][f"params_{step}"].items():
            assert torch.equal(value, params[name]), f"{case} step {step}: ranks hold different {name}"
    ck.load_weights(model, params, must_equal=step == 0)
    return rs.reference_grads(model, step, micro)


def max_grad_error(run, case: str) -> float:
    """Max |grad - one-process reference| over every parameter and step; asserts presence agrees."""
    worst = 0.0
    for step in range(rs.STEPS):
        got, ref = _grads(run, case, step), _reference(run, case, step)
        for name, want in ref.items():
            if want is None:
                assert got[name] is None, (case, step, name)
                continue
            assert got[name] is not None and got[name].dtype == torch.float32, (case, step, name)
            assert want.norm() > 0, f"{case} {name}: zero reference gradient, a vacuous check"
            worst = max(worst, float((got[name] - want).abs().max()))
    return worst


def _storage_error_on_every_rank(run, case: str) -> bool:
    errors = [ck.error_of(rank, case) for rank in run.ranks]
    return all(e is not None and e["type"] == "RuntimeError" and STORAGE_RE.search(e["message"]) for e in errors)


def _unpatched_outcome(run) -> tuple[str, str]:
    if all(_storage_error_on_every_rank(run, case) for case in REUSE_CASES):
        return ck.ex.REPRODUCES, "RuntimeError setStorage ... out of bounds for storage of size 0 (every rank)"
    if all(_error(run, case) is None for case in REUSE_CASES):
        worst = max(max_grad_error(run, case) for case in REUSE_CASES)
        if worst <= TOLERANCE:
            return ck.ex.FIXED, f"gradients equal the reference (max |diff| {worst:.2g})"
        return "wrong gradients", f"max |grad - reference| {worst:.3g}"
    shown = {case: (_error(run, case) or {}).get("message", "ok")[:80] for case in REUSE_CASES}
    return "other", str(shown)


def test_unpatched(unpatched):
    """2.13 - 2.15: every rank raises in backward; 2.8 - 2.12 keep the group unsharded: right.
    Judged, not recorded: the matrix's "off" record is the case's."""
    assert not unpatched.timed_out, unpatched.describe()
    outcome, detail = _unpatched_outcome(unpatched)
    assert ck.unpatched_agrees(BUG, outcome), (ck.UNPATCHED[BUG], outcome, detail, unpatched.describe())
    ck.assert_registry_with_disabled(unpatched, PATCH)
    unpatched.assert_clean()  # the cases raised, the ranks finished


@pytest.mark.parametrize("case", REUSE_CASES)
def test_patched_repeat_call_gradients_equal_the_reference(patched, case):
    assert _error(patched, case) is None, patched.describe()
    worst = max_grad_error(patched, case)
    assert worst <= TOLERANCE, f"{case}: max |grad - reference| {worst:.3g}"


@pytest.mark.parametrize("case", UNCHANGED_CASES)
def test_patched_leaves_other_paths_alone(patched, unpatched, case):
    """Same gradients and the same all-gathers, reduce-scatters and pre-backward calls."""
    before, after = _error(unpatched, case), _error(patched, case)
    if before is not None:  # torch's own failure (chunk_each before PyTorch PR 180428)
        assert not APPLIED, f"{case} fails without the patch where it applies: {before['message']}"
        assert after is not None and (after["type"], after["message"]) == (before["type"], before["message"])
        first_sentence = before["message"].split(".")[0]
        ck.note(f"{case} fails in torch itself, with and without the patch (PyTorch PR 180428 fixed it in 2.13): "
                f"{before['type']}: {first_sentence}")
        return
    assert after is None, patched.describe()
    for rank_before, rank_after in zip(unpatched.ranks, patched.ranks):
        assert rank_after.cases[case]["counts"] == rank_before.cases[case]["counts"], case
    for step in range(rs.STEPS):
        got, want = _grads(patched, case, step), _grads(unpatched, case, step)
        assert all(torch.equal(got[n], want[n]) for n in want if want[n] is not None), (case, step)
    worst = max_grad_error(patched, case)
    assert worst <= TOLERANCE, f"{case}: max |grad - reference| {worst:.3g}"


def test_patched_fires_once_per_repeat_output(patched):
    """Fired: each remembered repeat-call output that got the pre-backward hook, nothing else."""
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    ck.assert_fired_where_applied(patched, PATCH)
    for rank in patched.ranks:
        for case in CASES:
            mode, micro, _ = rs.parse(case)
            record = rank.cases[case]
            if record["error"] is not None:  # torch's own failure, asserted above
                continue
            expected = rs.REPEAT_OUTPUTS.get(mode, 0) * micro * rs.STEPS if APPLIED else 0
            assert record["fired_after"] - record["fired_before"] == expected, (rank.rank, case, record)


def test_patched_run_clean(patched):
    patched.assert_clean()


# --- worlds in one process: threaded process groups and the fake backend ------------------------


@pytest.fixture(scope="module")
def threaded():
    if importlib.util.find_spec("expecttest") is None:
        pytest.skip("torch.testing._internal.common_distributed needs expecttest (the [test] extra)")
    run = run_ranks("grouped_module_reuse:threaded", world_size=1, timeout=LAUNCH_TIMEOUT_S)
    run.assert_clean()
    return run[0].cases["threaded"]


@pytest.fixture(scope="module")
def fake():
    run = run_ranks("grouped_module_reuse:fake", world_size=1, timeout=LAUNCH_TIMEOUT_S)
    run.assert_clean()
    return run[0].cases


def test_threaded_ranks_keep_their_own_records(threaded):
    """Two thread ranks' states share the patch's module: each gets its own hooks, right gradients."""
    assert threaded["passed"], threaded["report"]
    ranks = threaded["ranks"]
    assert sorted(ranks) == list(range(rs.THREADS))
    for step in range(rs.STEPS):
        model = rs.build("mtp")
        ck.load_weights(model, ranks[0][f"params_{step}"], must_equal=step == 0)
        want = rs.reference_grads(model, step, 1, world_size=rs.THREADS)
        for rank, record in ranks.items():
            for name, grad in record[f"grads_{step}"].items():
                diff = float((grad - want[name]).abs().max())
                assert diff <= TOLERANCE, (rank, step, name, diff)
    expected = rs.THREADS * rs.STEPS * rs.REPEAT_OUTPUTS["mtp"] if APPLIED else 0
    assert threaded["fired_after"] - threaded["fired_before"] == expected


def test_fake_backend(fake):
    """The fake backend's rank 0 trains with the patch; reverted, torch's error comes back."""
    patched, reverted = fake["fake_patched"], fake["fake_reverted"]
    assert patched["error"] is None and all(patched["grad_present"].values()), patched
    assert patched["fired_after"] - patched["fired_before"] == (1 if APPLIED else 0)
    if APPLIED:
        assert reverted["error"]["type"] == "RuntimeError" and STORAGE_RE.search(reverted["error"]["message"])
    else:
        assert reverted["error"] is None, reverted
