"""restore_unused_param_grads adds no collective to a unit whose fill is off, and packs the usage
flags of every filled unit on one process group into a single int32 all-reduce per backward."""

from __future__ import annotations

import pytest

from _dist_launcher import run_ranks

pytestmark = pytest.mark.timeout(300)

# MLP: blocks.0.lin (weight, bias), blocks.1.lin (weight, bias), head (weight, bias)
PARAMS_PER_UNIT = {"blocks.0": 2, "blocks.1": 2, "root": 2}


@pytest.fixture(scope="module")
def run():
    result = run_ranks("restore_unused_param_grads:collectives")
    result.assert_clean()
    return result


def test_no_collective_when_the_fill_is_off(run):
    for rank in run.ranks:
        assert rank.cases["fill_off"]["all_reduce_numels"] == []


def test_one_packed_collective_per_backward_for_the_filled_units_only(run):
    for rank in run.ranks:
        # two backwards; only blocks.0 has the fill: one all-reduce of its 2 flags each time
        assert rank.cases["fill_one_unit"]["all_reduce_numels"] == [2, 2]
        # every unit filled, all on one process group: still one all-reduce, of all 6 flags
        assert rank.cases["fill_all"]["all_reduce_numels"] == [sum(PARAMS_PER_UNIT.values())] * 2


def test_used_parameters_keep_their_gradients(run):
    for rank in run.ranks:
        for case in ("fill_off", "fill_one_unit", "fill_all"):
            grads = rank.cases[case]["grads"]
            assert all(g is not None for g in grads.values()), (case, grads)
