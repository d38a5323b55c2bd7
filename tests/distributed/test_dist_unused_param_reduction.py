"""unused_param_reduction's variants on 2 gloo ranks (``_unused_param_reduction_scenarios``). Its case
(``test_dist_cases.py``) shows ``set_reduce_scatter_unused_params(True)`` with rank r using expert r,
off (no method before 2.13) and on.

Here the experts model in one unit: rank r routes its batch through expert r; expert 2 is used by
both ranks, expert 3 by none (fp32, one micro-batch). Without the unused-param fill each rank
reduce-scatters a different parameter list. What really happens on gloo (torch 2.13):

* equal sizes (rank r uses expert r), the flag not set: no error at all; the reduce-scatter
  silently adds rank 0's expert-0 gradient to rank 1's expert-1 gradient;
* different sizes (rank 0 uses one expert more): gloo aborts the receiving process
  (``gloo::EnforceNotMet ... Received data size doesn't match expected size``, SIGABRT)
  and its peer gets a connection error.

With the fill, every rank holds the global-batch gradient of every expert (an expert used on one
rank only gets that rank's gradient divided by the world size; one no rank used keeps None). Three
ways to turn the fill on: torch's own API (2.13+: its own fill does the work, not the backport's),
the plugin's backport forced on a torch whose API was deleted (simulating torch < 2.13), and the
``FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS=1`` policy without any code change.
"""
from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _dist_common as sc
from _dist_launcher import run_ranks

pytestmark = pytest.mark.timeout(300)

PATCH = "unused_param_reduction"
E = {i: (f"experts.{i}.weight", f"experts.{i}.bias") for i in range(4)}
ALWAYS = ("inp.weight", "inp.bias", "out.weight", "out.bias", *E[2])


@pytest.fixture(scope="module")
def native_then_flag_off():
    # flag_off_uneven kills the job, so it comes last
    return run_ranks("unused_param_reduction", args={"modes": ["native", "flag_off", "flag_off_uneven"]})


@pytest.fixture(scope="module")
def backport():
    return run_ranks("unused_param_reduction", args={"modes": ["backport"]})


@pytest.fixture(scope="module")
def env_policy():
    return run_ranks(
        "unused_param_reduction",
        args={"modes": ["env_policy"]},
        env={"FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS": "1"},
    )


@pytest.fixture(scope="module")
def reference():
    """Global-batch reference plus each rank's share (its local gradient / world size)."""
    model = sc.build_model("experts", n_experts=4)
    glob = sc.reference_grads(model, sc.plan_expert_routing, step=0, n_micro_batches=1)
    share = [
        sc.reference_grads(model, sc.plan_expert_routing, step=0, n_micro_batches=1, ranks=(r,))
        for r in range(sc.WORLD_SIZE)
    ]
    # the semantics the tests rely on: an expert used on one rank only gets that rank's
    # local gradient divided by the world size; expert 3 gets no gradient at all
    for r in range(sc.WORLD_SIZE):
        for n in E[r]:
            assert torch.equal(glob[n], share[r][n])
            assert share[1 - r][n] is None
    assert glob[E[3][0]] is None
    return glob, share


def _check_filled(run, case, reference):
    glob, _ = reference
    ck.reference_model("experts", run, case=case, n_experts=4)  # same initial weights
    grads = ck.case_grads(run, case)  # raises if a grad is None on one rank only
    ck.assert_full_grads_consistent(run, case, grads)
    ck.assert_grads_match(grads, glob)  # experts 0, 1 (one rank each), 2 (both), shared
    assert grads[E[3][0]] is None and grads[E[3][1]] is None  # no rank used it
    for rank in run.ranks:
        assert all(rank.cases[case]["group_flags"].values()), rank.cases[case]["group_flags"]


def test_flag_off_silently_mixes_expert_gradients(native_then_flag_off, reference):
    """Real behaviour on gloo without the flag: no abort, wrong gradients."""
    run = native_then_flag_off
    assert not run.timed_out, run.describe()
    _, share = reference
    for rank in run.ranks:
        assert ck.error_of(rank, "flag_off") is None, run.describe()
        assert not any(rank.cases["flag_off"]["group_flags"].values())
    g0 = run[0].cases["flag_off"]["grads"]
    g1 = run[1].cases["flag_off"]["grads"]
    # each rank only has a gradient for the expert it used
    assert all(g0[n] is None for n in E[1]) and all(g0[n] is not None for n in E[0])
    assert all(g1[n] is None for n in E[0]) and all(g1[n] is not None for n in E[1])
    # rank 0's expert-0 shard received rank 1's expert-1 rows (same slot in the
    # reduce-scatter input), and vice versa
    for n0, n1 in zip(E[0], E[1]):
        mixed = share[0][n0] + share[1][n1]
        torch.testing.assert_close(g0[n0], sc.shard_rows(mixed, 0), rtol=ck.FP32_RTOL, atol=ck.FP32_ATOL)
        torch.testing.assert_close(g1[n1], sc.shard_rows(mixed, 1), rtol=ck.FP32_RTOL, atol=ck.FP32_ATOL)
        assert not torch.allclose(g0[n0], sc.shard_rows(share[0][n0], 0), atol=1e-4)
    # parameters used by both ranks are still right
    shared = ck.gather(run, lambda r: {n: r.cases["flag_off"]["grads"][n] for n in ALWAYS})
    ck.assert_grads_match(shared, reference[0], ALWAYS)


def test_flag_off_uneven_sizes_abort(native_then_flag_off):
    run = native_then_flag_off
    assert not run.timed_out, run.describe()
    # gloo's wording of the size check differs by release: "Received data size doesn't match
    # expected size" (2.9+), "op.preamble.length <= op.nbytes" (2.8)
    aborted = [r for r in run.ranks if "gloo::EnforceNotMet" in r.stderr_tail]
    assert aborted, run.describe()
    for rank in aborted:
        assert rank.returncode is not None and rank.returncode < 0, run.describe()  # SIGABRT
        assert any(
            m in rank.stderr_tail
            for m in ("Received data size doesn't match expected size", "op.preamble.length <= op.nbytes")
        ), rank.stderr_tail
    for rank in run.ranks:
        rec = rank.cases.get("flag_off_uneven")
        if rank in aborted:
            # died inside backward: its earlier cases were saved, this one never finished
            assert rec is None and {"native", "flag_off"} <= set(rank.cases)
        else:  # the peer loses its connection
            assert rec["error"] is not None and rec["error"]["type"] in ("RuntimeError", "DistBackendError")
            assert "Connection" in rec["error"]["message"] or "connection" in rec["error"]["message"]


def test_native_api_gives_averaged_gradients(native_then_flag_off, reference):
    """``set_reduce_scatter_unused_params(True)`` as a user calls it: torch's, or the backport."""
    run = native_then_flag_off
    assert not run.timed_out, run.describe()
    ck.assert_registry(run, ck.EXPECTED_STATUS)
    _check_filled(run, "native", reference)
    for rank in run.ranks:
        fills = rank.cases["native"]["native_fill_calls"]
        if ck.NATIVE_UNUSED_PARAM_API:
            assert fills > 0  # torch's own fill did the work
        else:
            assert fills == 0  # torch has no fill: the backport did the work


def test_backport_gives_averaged_gradients(backport, reference):
    """torch's method deleted, the plugin's backport forced: same gradients."""
    backport.assert_clean()
    # registered at import as on any 2.13 process; forcing the backport does not break the others
    ck.assert_registry(backport, {n: s for n, s in ck.EXPECTED_STATUS.items() if n != PATCH})
    for rank in backport.ranks:
        assert ck.statuses(rank)[PATCH]["status"] in ("not_needed", "applied")
        info = rank.data["backport"]
        assert info["method_is_backport"], info
        # torch 2.13's own fill never ran: the zeros came from the backport
        assert rank.cases["backport"]["native_fill_calls"] == 0
    _check_filled(backport, "backport", reference)


def test_env_policy_without_code_change(env_policy, reference):
    env_policy.assert_clean()
    ck.assert_registry(env_policy, ck.EXPECTED_STATUS)
    for rank in env_policy.ranks:
        assert "reduce_scatter_unused_params_default_on" in rank.autopatch["policies"], rank.autopatch
    _check_filled(env_policy, "env_policy", reference)
