"""restore_unused_param_grads under HSDP with a deferred all-reduce must not drop real gradients.

With ``set_requires_all_reduce(False)`` each micro-batch's reduce-scatter folds into a pending
partial reduce; only the last micro-batch writes the sharded gradient. A parameter used in the first
micro-batch and by no replica in the last still has a real gradient: the patch must keep it, so the
patched gradients equal torch's own (unpatched) ones exactly.
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
from _dist_launcher import run_ranks

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def runs():
    patched = run_ranks("restore_unused_param_grads:hsdp_window")
    unpatched = run_ranks("restore_unused_param_grads:hsdp_window", env={ck.ENV["restore_unused_param_grads"]: "0"})
    return patched, unpatched


def test_gradient_from_an_earlier_micro_batch_of_the_window_survives(runs):
    patched, unpatched = runs
    patched.assert_clean()
    unpatched.assert_clean()
    for rank_patched, rank_unpatched in zip(patched.ranks, unpatched.ranks):
        got = rank_patched.cases["window"]["grads"]
        torch_own = rank_unpatched.cases["window"]["grads"]
        assert got["experts.0.weight"] is not None, "expert 0's real gradient was reset to None"
        assert torch.count_nonzero(got["experts.0.weight"]) > 0
        for name, expected in torch_own.items():
            assert expected is not None, name
            assert torch.equal(got[name], expected), f"rank {rank_patched.rank} {name} differs from torch's"
