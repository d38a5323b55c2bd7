"""With nothing unused, the plugin changes no bit of any gradient or weight.

A 2-block MLP (each block and the root wrapped), two AdamW steps of two accumulated
micro-batches each, in three configurations: fp32, bf16/fp32 mixed precision, and mixed
precision with the unused-param fill on. Run once with the plugin on and once with
``FSDP_AUTOPATCH_ENABLED=0``; every gradient and final weight must be bitwise identical.
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _dist_common as sc
from _dist_launcher import run_ranks

pytestmark = pytest.mark.timeout(300)

CASES = ("fp32", "mp", "mp_fill")


@pytest.fixture(scope="module")
def plugin_on():
    return run_ranks("no_change")


@pytest.fixture(scope="module")
def plugin_off():
    return run_ranks("no_change", env={"FSDP_AUTOPATCH_ENABLED": "0"})


def test_registry(plugin_on, plugin_off):
    plugin_on.assert_clean()
    plugin_off.assert_clean()
    if any(rank.data.get("gloo_avg_sums") for rank in plugin_on.ranks):
        ck.note("gloo's reduce-scatter sums for ReduceOp.AVG (PyTorch issue 162338, not one of our bugs): "
                "the scenarios call set_force_sum_reduction_for_comms(True) on every unit")
    ck.assert_registry(plugin_on, ck.EXPECTED_STATUS)
    for name in ck.EXPECTED_STATUS:
        assert ck.fired(plugin_on, name) == [0, 0], name  # a clean model: no patch had to act
    ck.assert_plugin_off(plugin_off)


@pytest.mark.parametrize("case", CASES)
def test_bitwise_identical(plugin_on, plugin_off, case):
    if case == "mp_fill" and not ck.NATIVE_UNUSED_PARAM_API:
        pytest.skip("torch < 2.13 has no fill without the plugin: nothing to compare with")
    for on, off in zip(plugin_on.ranks, plugin_off.ranks):
        a, b = on.cases[case], off.cases[case]
        assert a["error"] is None and b["error"] is None, (a["error"], b["error"])
        for key in ("grads_0", "grads_1", "params_after"):
            assert a[key].keys() == b[key].keys()
            for n in a[key]:
                assert a[key][n] is not None, (case, key, n)
                assert a[key][n].dtype == b[key][n].dtype == torch.float32
                assert torch.equal(a[key][n], b[key][n]), f"rank {on.rank} {case} {key} {n} differs"
        assert a["steps_after"] == b["steps_after"] and set(a["steps_after"].values()) == {2.0}


@pytest.mark.parametrize("case", CASES)
def test_first_step_matches_reference(plugin_on, case):
    """Guards against a vacuous comparison: the gradients are the right ones."""
    grads = ck.gather(plugin_on, lambda r: r.cases[case]["grads_0"])
    model = ck.reference_model("mlp", plugin_on, case=case)
    ref = sc.reference_grads(model, sc.plan_mlp, step=0, n_micro_batches=2)
    ck.assert_grads_match(grads, ref, bf16=(case != "fp32"))
