"""optimizer_unsharded_params_guard's variants on 2 gloo ranks, the plugin as installed
(``_optimizer_unsharded_params_guard_scenarios``). The bug itself (an optimizer built after a no-grad
forward: the root's head never moves with the guard off, the first step stops with it on) is its
case's (``test_dist_cases.py``); the guard's message is ``tests/unit``'s.

* the optimizer built before the no-grad forward, after ``model.reshard()``, or with
  ``fully_shard(root, reshard_after_forward=True)``: no stop, ``fired`` 0, every optimizer
  parameter a DTensor, the root's head trained, and the weights the case's one-process reference's.
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _optimizer_unsharded_params_guard_scenarios as ou
from _dist_launcher import RunResult, run_ranks
from fsdp_autopatch.cases import optimizer_unsharded_params_guard as case

pytestmark = pytest.mark.timeout(300)

PATCH = "optimizer_unsharded_params_guard"
ROOT_PARAMS = ("2.weight", "2.bias")  # the head the root owns
MIN_DIFF = 1e-3


@pytest.fixture(scope="module")
def patched() -> RunResult:
    return run_ranks(PATCH)


def test_registry(patched):
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})


@pytest.mark.parametrize("variant", ou.CASES)
def test_right_optimizers_are_let_through(patched, variant):
    patched.assert_clean()
    want = case.reference(2)["params"]
    for rank in patched.ranks:
        rec = rank.cases[variant]
        assert rec["error"] is None, rec["error"]
        assert rec["optimizer_params"] == ["DTensor"] * 6, rec["optimizer_params"]
        assert rec["final"].keys() == want.keys()
        for name in want:
            torch.testing.assert_close(rec["final"][name], torch.tensor(want[name]),
                                       rtol=ck.FP32_RTOL, atol=ck.FP32_ATOL)
        for name in ROOT_PARAMS:  # the root trained
            assert float((rec["final"][name] - rec["init"][name]).abs().max()) > MIN_DIFF, name


def test_never_fired(patched):
    assert ck.fired(patched, PATCH) == [0] * len(patched.ranks)
