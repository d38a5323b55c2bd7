"""FSDP2 in worlds that live in one process, with the plugin on (issue 16, inputs 1 and 2).

The cross-rank check cannot compare anything there (the fake backend's other ranks do not exist;
threaded ranks share this process's registry): it must step aside, say why in the registry, and
let training run, with the numbers FSDP2 gives without the plugin (the gradients only where the
fake backend's reduce-scatter writes its output, see ``tests/expected.py``). Each scenario runs in
a fresh interpreter (``_single_process_scenarios``) under the launcher's outer timeout.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

import _dist_checks as ck
import _dist_common as sc
import _restore_unused_param_grads_scenarios as fin
import _single_process_scenarios as sp
from _dist_launcher import run_ranks

pytestmark = pytest.mark.timeout(240)

OUTER_TIMEOUT_S = 120.0
THREADED_CASES = ("multi_threaded_test_case", "spawn_threads_and_init_comms")
FAKE_RS_WRITES = ck.ex.fake_backend_reduce_scatter_writes_output(ck.RELEASE)
FAKE_RS_WRITES_NOTHING = (
    "this torch's fake backend (FakeProcessGroup) reduce_scatter_tensor leaves its output unwritten "
    "(it copies the rank's chunk from torch 2.13, PyTorch PR 182365), so FSDP2's gradients there are "
    "uninitialized memory, with or without the plugin"
)


def _run(name: str, args: dict | None = None):
    result = run_ranks(name, world_size=1, args=args or {}, timeout=OUTER_TIMEOUT_S)
    result.assert_clean()
    return result[0]


def _policy(status: dict) -> str:
    return status["policies"]["cross_rank_check"]


@pytest.fixture(scope="module")
def fake():
    return _run("fake")


@pytest.fixture(scope="module")
def threaded():
    """Each way of making thread ranks in its own interpreter: torch 2.10 and 2.11 crash (SIGSEGV)
    when a second threaded world starts in a process where one has run, plugin or not (measured
    with ``python -S``, the plugin not even loaded)."""
    if importlib.util.find_spec("expecttest") is None:
        pytest.skip("torch.testing._internal.common_distributed needs expecttest (the [test] extra)")
    runs = [_run("threaded", {"cases": [case]}) for case in THREADED_CASES]
    return SimpleNamespace(cases={case: run.cases[case] for case, run in zip(THREADED_CASES, runs)})


def test_fake_backend_trains_with_the_patches_applied(fake):
    writes = fake.data["fake_reduce_scatter_writes_output"]
    assert writes == FAKE_RS_WRITES, "tests/expected.py is wrong about this torch's fake reduce-scatter"
    on, off = fake.cases["plugin_on"], fake.cases["plugin_off"]
    assert "restore_unused_param_grads" in on["status"]["applied"]
    assert off["status"]["applied"] == []  # every patch undone for the reference run
    assert torch.equal(on["output"], off["output"])  # the forward: FSDP2's own numbers
    assert set(on["grads"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, grad in on["grads"].items():
        assert grad is not None and grad.shape[0] == 1, (name, grad)  # one row of 8 per fake rank


@pytest.mark.skipif(not FAKE_RS_WRITES, reason=FAKE_RS_WRITES_NOTHING)
def test_fake_backend_trains_with_fsdp2s_own_numbers(fake):
    on, off = fake.cases["plugin_on"], fake.cases["plugin_off"]
    for name, grad in on["grads"].items():
        assert torch.equal(grad, off["grads"][name]), name


def test_fake_backend_check_records_why_it_skipped(fake):
    policy = _policy(fake.cases["plugin_on"]["status"])
    assert "skipped for group 0: fake backend" in policy, policy
    assert fake.cases["plugin_on"]["elapsed_s"] < 10  # no store wait


@pytest.mark.parametrize("case", THREADED_CASES)
def test_threaded_ranks_train_without_waiting_for_the_store(threaded, case):
    rec = threaded.cases[case]
    assert rec["passed"], rec["report"]
    assert rec["elapsed_s"] < sp.STORE_TIMEOUT_S, rec["elapsed_s"]  # nothing waited out the timeout
    assert sorted(rec["ranks"]) == list(range(sp.THREADS))
    policy = _policy(rec["status"])
    assert "skipped for group 0: threaded process group" in policy, policy


@pytest.mark.parametrize("case", THREADED_CASES)
def test_threaded_ranks_get_the_reference_gradients(threaded, case):
    ranks = threaded.cases[case]["ranks"]
    shards = [ranks[r] for r in range(sp.THREADS)]
    model = fin.build("one_unit")
    ck.load_weights(model, _concat(shards, "init_params"), must_equal=True)
    for step in range(fin.STEPS):
        ref = sc.reference_grads(model, fin.plan, step=step, n_micro_batches=1, world_size=sp.THREADS)
        ck.assert_grads_match(_concat(shards, f"grads_{step}"), ref)  # spare: None in step 0
        assert all(shard[f"probes_left_{step}"] == [] for shard in shards)


def _concat(shards: list[dict], key: str) -> dict:
    """Full tensors from the thread ranks' Shard(0) pieces, as ``_dist_checks.gather`` builds them."""
    return ck.gather(SimpleNamespace(ranks=shards), lambda shard: shard[key])
