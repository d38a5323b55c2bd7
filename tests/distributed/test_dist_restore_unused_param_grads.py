"""restore_unused_param_grads: a parameter no rank used must keep ``grad is None``.

Fill on (``set_reduce_scatter_unused_params(True)``), fp32, ``AdamW(weight_decay=0.1)``.
Warm-up step: every expert used on every rank (AdamW state and momentum non-zero).
Second step: rank r uses expert r only; expert 2 is used by no rank.
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _dist_common as sc
from _dist_launcher import run_ranks

pytestmark = pytest.mark.timeout(300)

PATCH = "restore_unused_param_grads"
BUG = ck.ex.BUG_OF[PATCH]
UNUSED = ("experts.2.weight", "experts.2.bias")
ONE_RANK = ("experts.0.weight", "experts.0.bias", "experts.1.weight", "experts.1.bias")


@pytest.fixture(scope="module")
def unpatched():
    return run_ranks("restore_unused_param_grads", env={ck.ENV[PATCH]: "0"})


@pytest.fixture(scope="module")
def patched():
    return run_ranks("restore_unused_param_grads", env={"FSDP_AUTOPATCH_LOG_LEVEL": "INFO"})


def test_patched_fires_and_logs_the_first_fire_once_per_process(patched):
    ck.assert_fired_where_applied(patched, PATCH)  # the expert no rank used, put back to None
    for rank in patched.ranks:
        output = rank.stdout_tail + rank.stderr_tail
        assert output.count(f"{PATCH} fired: ") == 1, output
        assert "experts.2." in output, output  # where: the parameter no rank used
    assert ck.fired(patched, "accumulated_grad_guard") == [0, 0]  # nothing for it to do here


def _check_warmup(run):
    grads = ck.case_grads(run, "warmup")
    model = ck.reference_model("experts", run, n_experts=3)
    ref = sc.reference_grads(model, sc.plan_restore_unused, step=0, n_micro_batches=1)
    ck.assert_grads_match(grads, ref)
    for rank in run.ranks:
        assert set(rank.cases["warmup"]["steps_after"].values()) == {1.0}


def _unused_param_outcome(run) -> tuple[str, str]:
    """(outcome, detail) of the "partial" step for the parameter no rank used."""
    moved = []
    for rank in run.ranks:
        rec = rank.cases["partial"]
        grads = [rec["grads"][n] for n in UNUSED]
        unchanged = torch.equal(rec["params_after"][UNUSED[0]], rec["params_before"][UNUSED[0]])
        if all(g is None for g in grads) and unchanged:
            continue
        moved.append(float((rec["params_after"][UNUSED[0]] - rec["params_before"][UNUSED[0]]).abs().max()))
    if not moved:
        return ck.ex.FIXED, "grad None, weights unchanged"
    return ck.ex.REPRODUCES, f"zero grad, AdamW moved the unused weight by up to {max(moved):.1e}"


def test_unpatched_unused_param_gets_zero_grad_and_moves(unpatched):
    unpatched.assert_clean()
    ck.assert_registry_with_disabled(unpatched, PATCH)
    _check_warmup(unpatched)
    ck.expect_unpatched(BUG, *_unused_param_outcome(unpatched), unpatched)
    for rank in unpatched.ranks:
        rec = rank.cases["partial"]
        for n in UNUSED:
            g = rec["grads"][n]
            assert g is not None, f"rank {rank.rank} {n}: grad None although unpatched"
            assert torch.count_nonzero(g) == 0, f"{n}: fill gradient not an exact zero"
            assert rec["steps_before"][n] == 1.0 and rec["steps_after"][n] == 2.0
            assert not torch.equal(rec["params_after"][n], rec["params_before"][n]), n
        # AdamW moved the weight no rank used (decay + leftover momentum)
        moved = (rec["params_after"][UNUSED[0]] - rec["params_before"][UNUSED[0]]).abs().max()
        assert moved > 1e-4, moved


def test_patched_unused_param_untouched(patched):
    patched.assert_clean()
    ck.assert_registry(patched, {PATCH: "applied"})
    _check_warmup(patched)
    for rank in patched.ranks:
        rec = rank.cases["partial"]
        for n in UNUSED:
            assert rec["grads"][n] is None, f"rank {rank.rank} {n}: grad {rec['grads'][n]}"
            assert torch.equal(rec["params_after"][n], rec["params_before"][n]), n  # bitwise
            assert rec["steps_before"][n] == rec["steps_after"][n] == 1.0, n
            assert rec["exp_avg_before"][n].abs().sum() > 0  # AdamW had momentum to move it with
    ck.observe_patched(BUG, "grad None, weights and AdamW step unchanged")


def test_patched_params_used_on_one_rank_keep_averaged_grads(patched):
    grads = ck.case_grads(patched, "partial")
    ck.assert_full_grads_consistent(patched, "partial", grads)
    # reference from the weights the ranks held after the warm-up step
    model = ck.reference_model("experts", patched, params_key="params_before", case="partial", n_experts=3)
    ref = sc.reference_grads(model, sc.plan_restore_unused, step=1, n_micro_batches=1)
    assert all(ref[n] is None for n in UNUSED)
    ck.assert_grads_match(grads, ref)  # ONE_RANK and shared params equal, UNUSED None
    for rank in patched.ranks:
        rec = rank.cases["partial"]
        for n in ONE_RANK:
            assert rec["grads"][n] is not None
            assert rec["steps_after"][n] == 2.0
            assert not torch.equal(rec["params_after"][n], rec["params_before"][n]), n
