"""unmanaged_trainable_params_guard's variants on 2 gloo ranks, the plugin as installed
(``_unmanaged_trainable_params_guard_scenarios``). The bug itself, with the guard off and on, is its
case's (``test_dist_cases.py``).

* an adapter kept in sync by hand (broadcast once, gradients averaged by a hook), and
  ``ignored_params`` kept in sync the same way: no stop, the ranks' adapters bitwise equal, the
  weights the in-sync one-process reference's (the case's);
* ``ignored_params`` not kept in sync, and an adapter added after a first training step into a new
  optimizer: the first step of that optimizer raises the guard's ``GuardError`` on every rank;
* a frozen adapter, and a model with no unmanaged parameter: no stop.
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _unmanaged_trainable_params_guard_scenarios as un
from _dist_launcher import RunResult, run_ranks
from fsdp_autopatch.cases import unmanaged_trainable_params_guard as case

pytestmark = pytest.mark.timeout(300)

PATCH = "unmanaged_trainable_params_guard"
STOP = f"fsdp-autopatch guard {PATCH}: SGD holds 1 trainable parameter(s) that FSDP2 does not manage"


@pytest.fixture(scope="module")
def patched() -> RunResult:
    return run_ranks(PATCH)


def test_registry(patched):
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})


@pytest.mark.parametrize("variant", un.STOPPED)
def test_unsynced_parameters_stop_the_first_step_on_every_rank(patched, variant):
    errors = ck.assert_stopped_on_every_rank(patched, variant, STOP)
    assert all("adapter.weight" in e["message"] for e in errors), errors


@pytest.mark.parametrize("variant", [v for v in un.CASES if v not in un.STOPPED])
def test_what_the_guard_lets_through(patched, variant):
    for rank in patched.ranks:
        assert ck.error_of(rank, variant) is None, (rank.rank, ck.error_of(rank, variant))
    if variant in ("synced", "ignored_synced"):
        assert all(rank.cases[variant]["adapters_apart"] == 0.0 for rank in patched.ranks)
        want = case.reference(2)["params"]
        got = patched.ranks[0].cases[variant]["params"]
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(want[name]), rtol=1e-5, atol=1e-6)


def test_every_stop_counted_once_per_rank(patched):
    patched_fired = ck.fired(patched, PATCH)
    assert patched_fired == [len(un.STOPPED)] * len(patched.ranks), patched_fired
