"""gradient_divide_factor_single_rank in one process: which divide factors it drops, which it leaves to torch,
and what its structural check reads in each shape of foreach_reduce."""

from __future__ import annotations

import pytest
import torch

import expected as ex

pytest.importorskip("torch.distributed.fsdp")

from torch.distributed import ReduceOp  # noqa: E402

from fsdp_autopatch import _compat  # noqa: E402
from fsdp_autopatch._isolation import Binder, Call  # noqa: E402
from fsdp_autopatch.patches import gradient_divide_factor_single_rank as patch  # noqa: E402

# Tests that call this torch's own _get_gradient_divide_factors / read its foreach_reduce: only where
# tests/expected.py says the dividing copy is there (2.10 on; 2.8's takes a real group, measured).
SHAPED = pytest.mark.skipif(
    ex.expected_status(ex.release_of(torch.__version__)).get("gradient_divide_factor_single_rank") == "not_needed",
    reason="this torch has no dividing one-rank copy (tests/expected.py): the patch is not needed",
)


def torch_factors():
    return _compat.innermost(_compat.fsdp_module("_fsdp_collectives")._get_gradient_divide_factors)


class TwoRanks:
    def size(self) -> int:
        return 2


ONE = patch._OneRankGroup()


def run(monkeypatch, group, reduce_dtype=torch.float32, factor=4.0, force_sum=True, all_reduce_group=None):
    """The wrapper around torch's function, called as foreach_reduce calls it (positionally)."""
    fires = []
    monkeypatch.setattr(patch._events, "fired", lambda name, without, where="": fires.append((name, without)))
    function = torch_factors()
    args = (group, all_reduce_group, reduce_dtype, "cpu", factor, force_sum)
    call = Call(function, args, {}, Binder(function, patch._READS))
    return patch._one_division(call, None, args, {}), function(*args), fires


@SHAPED
@pytest.mark.parametrize("group", [ONE, None], ids=["one-rank group", "no group"])
@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_rank_with_a_factor_on_the_sum_path_gets_no_pre_or_post_divide(monkeypatch, group, reduce_dtype):
    got, torchs, fires = run(monkeypatch, group, reduce_dtype)
    assert torchs[:2] != (None, None)  # torch's second division (fp32/bf16: post 4; fp16: 2 and 2)
    assert got == (None, None, torchs[2], torchs[3])
    assert got[2] == ReduceOp.SUM and got[3] == ReduceOp.SUM
    assert [name for name, _ in fires] == [patch.NAME]


@SHAPED
def test_fp16_without_force_sum_is_a_sum_path_too(monkeypatch):
    got, torchs, fires = run(monkeypatch, ONE, torch.float16, force_sum=False)
    assert torchs[:2] == (2, 2.0) and got[:2] == (None, None) and len(fires) == 1


@SHAPED
@pytest.mark.parametrize(
    "kwargs",
    [
        {"group": TwoRanks()},  # a real reduce-scatter: no copy branch
        {"group": TwoRanks(), "reduce_dtype": torch.float16},
        {"group": ONE, "factor": None},  # no factor: the copy does not divide
        {"group": None, "factor": None, "all_reduce_group": TwoRanks()},
        {"group": ONE, "factor": 1.0},  # nothing to divide
    ],
    ids=["2 ranks", "2 ranks fp16", "no factor", "no factor HSDP", "factor 1"],
)
def test_every_other_call_gets_torchs_result(monkeypatch, kwargs):
    got, torchs, fires = run(monkeypatch, **kwargs)
    assert got == torchs and fires == []


@SHAPED
def test_the_avg_and_premul_path_is_left_to_torch(monkeypatch):
    try:
        got, torchs, fires = run(monkeypatch, ONE, force_sum=False)
    except (RuntimeError, TypeError, ValueError) as error:  # a build without PREMUL_SUM on CPU
        pytest.skip(f"PREMUL_SUM not constructible here: {error}")
    assert torchs[:2] == (None, None) and fires == []
    assert got is torchs or got == torchs


@SHAPED
def test_the_structural_check_finds_the_double_division_here():
    verdict = patch._structural_check()
    assert verdict.status == "needed", verdict
    assert "factor**2" in verdict.reason


# foreach_reduce's one-rank branch in the shapes torch has had (abridged, as _copy_branch reads them)
DIVIDING = """
def foreach_reduce(reduce_scatter_comm, gradient_divide_factor, world_size):
    if world_size > 1:
        reduce_scatter_comm(output_tensor=out, input_tensor=inp, group=g, op=op)
    else:
        if gradient_divide_factor is not None:
            out.copy_(inp / gradient_divide_factor)
        else:
            out.copy_(inp)
"""
COPYING = """
def foreach_reduce(reduce_scatter_comm, gradient_divide_factor, world_size):
    if world_size > 1:
        reduce_scatter_comm(output_tensor=out, input_tensor=inp, group=g, op=op)
    else:
        out.copy_(inp)
"""
ALWAYS_COMM = """
def foreach_reduce(reduce_scatter_comm, gradient_divide_factor):
    _div_if_needed(inp, predivide_factor)
    reduce_scatter_comm(output_tensor=out, input_tensor=inp, group=g, op=op)
"""
ALWAYS_TENSOR = """
def foreach_reduce(group, gradient_divide_factor):
    dist.reduce_scatter_tensor(output=out, input=inp, group=group, op=op)
"""
OTHER = """
def foreach_reduce(gradient_divide_factor):
    return something_else(gradient_divide_factor)
"""
ODD_BRANCH = """
def foreach_reduce(reduce_scatter_comm, world_size):
    if world_size > 1:
        reduce_scatter_comm(output_tensor=out, input_tensor=inp, group=g, op=op)
    else:
        pass
"""


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (DIVIDING, patch.DIVIDES),  # 2.13 - 2.15
        (COPYING, patch.COPIES),  # PR 162021's copy
        (ALWAYS_COMM, patch.NO_BRANCH),  # 2.8
        (ALWAYS_TENSOR, patch.NO_BRANCH),  # 2.6 / 2.7: dist.reduce_scatter_tensor directly
        (OTHER, None),
        (ODD_BRANCH, None),
    ],
    ids=["dividing copy", "plain copy", "always reduce-scatter", "reduce_scatter_tensor", "no call", "odd branch"],
)
def test_copy_branch_reads_each_shape(source, expected):
    assert patch._copy_branch(source) == expected


@pytest.mark.parametrize(("source", "status"), [(COPYING, "not_needed"), (ALWAYS_COMM, "not_needed"),
                                                (OTHER, "unsupported")])
def test_the_check_on_other_shapes(monkeypatch, source, status):
    monkeypatch.setattr(patch.inspect, "getsource", lambda function: source)
    verdict = patch._structural_check()
    assert verdict.status == status, verdict
    if status == "not_needed":
        assert verdict.conclusive  # positive evidence: a custom factor is divided once


def test_the_check_sees_no_bug_where_torch_returns_no_factor_at_one_rank(monkeypatch):
    collectives = _compat.fsdp_module("_fsdp_collectives")

    def no_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="", factor=None,
                   force_sum_reduction_for_comms=False):
        return None, None, ReduceOp.SUM, ReduceOp.SUM

    monkeypatch.setattr(collectives, "_get_gradient_divide_factors", no_factors)
    verdict = patch._structural_check()
    assert (verdict.status, verdict.conclusive) == ("not_needed", True), verdict


@SHAPED
def test_the_check_wants_the_parameters_the_wrapper_reads(monkeypatch):
    collectives = _compat.fsdp_module("_fsdp_collectives")
    monkeypatch.setattr(collectives, "_get_gradient_divide_factors", lambda reduce_scatter_group, dtype: None)
    verdict = patch._structural_check()
    assert verdict.status == "unsupported" and "factor" in verdict.reason, verdict
