"""param_written_in_forward's variants on 2 gloo ranks, the plugin as installed
(``_param_written_in_forward_scenarios``). The bug itself, with the guard off and on, is its case's
(``test_dist_cases.py``).

* ``nn.Embedding(max_norm=...)`` in a unit with ``reshard_after_forward`` False or 1, or meeting a
  ``no_grad`` evaluation first: the guard's ``GuardError`` on every rank, naming ``0.weight``;
* nothing written in forward: no stop, whatever the resharding (True, False, 1), bf16 compute,
  activation checkpointing (its recompute), ``no_grad`` evaluations, an ``optimizer.step()`` while
  the units are still unsharded, explicit ``unshard()`` with prefetching; ``fired`` counts only the stops.
"""

from __future__ import annotations

import pytest

import _dist_checks as ck
import _param_written_in_forward_scenarios as pw
from _dist_launcher import RunResult, run_ranks

pytestmark = pytest.mark.timeout(300)

PATCH = "param_written_in_forward"
STOP = f"fsdp-autopatch guard {PATCH}: 0.weight (unit 0) was written in place since FSDP2 unsharded it"


@pytest.fixture(scope="module")
def patched() -> RunResult:
    return run_ranks(PATCH)


def test_registry(patched):
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})


@pytest.mark.parametrize("variant", pw.STOPPED)
def test_a_written_parameter_stops_every_rank(patched, variant):
    ck.assert_stopped_on_every_rank(patched, variant, STOP)


@pytest.mark.parametrize("variant", pw.LET_THROUGH)
def test_no_false_stop(patched, variant):
    for rank in patched.ranks:
        assert ck.error_of(rank, variant) is None, (rank.rank, ck.error_of(rank, variant))


def test_every_stop_counted_once_per_rank(patched):
    assert ck.fired(patched, PATCH) == [len(pw.STOPPED)] * len(patched.ranks)
