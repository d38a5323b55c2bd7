"""reshard_stale_unsharded's variants on 2 gloo ranks (``_reshard_stale_unsharded_scenarios``), with the
fix off and on. Its case (``test_dist_cases.py``) shows ``set_reshard_after_backward(False)`` left on.

* a ``no_grad`` evaluation forward between ``backward()`` and ``step()`` (the root kept unsharded
  after forward), ``set_reshard_after_backward(False)`` on every micro-batch of an accumulation
  window, and the same under HSDP with ``set_requires_all_reduce(False)`` on the first: off the
  one-process reference without the fix, on it with;
* the accumulation window keeps its unsharded copy after each micro-batch that does not reduce
  (fully, HSDP's all-reduce included), fix or not;
* the window with ``set_reshard_after_backward(True)`` on its last micro-batch, and the defaults:
  never fire, bitwise equal with and without the fix.
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _reshard_stale_unsharded_scenarios as rs
from _dist_launcher import RunResult

pytestmark = pytest.mark.timeout(300)

PATCH = rs.PATCH
STALE = ("nograd_eval", "every_micro", "hsdp_window")
HEALTHY = ("window", "healthy")
WINDOWS = ("every_micro", "window", "hsdp_window")

unpatched, patched = ck.off_and_on(PATCH, PATCH)


def _record(run: RunResult, variant: str, rank: int = 0) -> dict:
    record = run.ranks[rank].cases[variant]
    assert record["error"] is None, (variant, record["error"])
    return record


def _max_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(float((got[name] - want[name]).abs().max()) for name in want)


@pytest.mark.parametrize("variant", STALE)
def test_stale_triggers_are_off_the_reference_without_the_fix(unpatched, variant):
    assert _max_diff(_record(unpatched, variant)["params"], rs.reference(variant)) > 1e-3


@pytest.mark.parametrize("variant", STALE + HEALTHY)
def test_with_the_fix_every_variant_equals_the_reference(patched, variant):
    want = rs.reference(variant)
    for rank in range(len(patched.ranks)):
        got = _record(patched, variant, rank)["params"]
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", WINDOWS)
def test_the_accumulation_window_keeps_its_copy(unpatched, patched, variant):
    for run in (unpatched, patched):
        assert _record(run, variant)["kept"] == [True] * 3, (variant, _record(run, variant)["kept"])


@pytest.mark.parametrize("variant", HEALTHY)
def test_healthy_loops_unchanged_bitwise_and_never_fired(unpatched, patched, variant):
    off, on = _record(unpatched, variant), _record(patched, variant)
    assert on["fired"] == 0
    for name, tensor in off["params"].items():
        assert torch.equal(tensor, on["params"][name]), name


def test_fired_where_a_unit_was_stale(patched):
    for variant in STALE:
        assert _record(patched, variant)["fired"] > 0, variant


def test_registry(patched):
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
