"""restore_unused_param_grads's variant on 2 gloo ranks, the plugin as installed
(``_restore_unused_param_grads_scenarios``, ``restore_unused``). Its case (``test_dist_cases.py``)
shows a parameter no rank used, with the fill on, off (a zero gradient, AdamW moves it) and on, on a
fresh AdamW.

Here the AdamW has state: fill on, fp32, ``AdamW(weight_decay=0.1)``; a warm-up step uses every expert
on every rank (step counts 1, momentum non-zero), then rank r uses expert r only and expert 2 no rank:
its grad stays None, its weights, step count and momentum untouched; the experts used on one rank
keep their averaged gradients; the first fire is logged once per process.
"""
from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _dist_common as sc
from _dist_launcher import run_ranks

pytestmark = pytest.mark.timeout(300)

PATCH = "restore_unused_param_grads"
UNUSED = ("experts.2.weight", "experts.2.bias")
ONE_RANK = ("experts.0.weight", "experts.0.bias", "experts.1.weight", "experts.1.bias")


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
