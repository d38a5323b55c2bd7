"""FSDP2 worlds that live in one process: the fake backend and threaded process groups.

Run by ``_dist_launcher.run_ranks(name, world_size=1)`` (a fresh interpreter, so the ``.pth``
bootstrap installs the plugin as in a user's process, and the outer timeout applies); the ``Ctx``
and the models come from ``_dist_common`` and ``_restore_unused_param_grads_scenarios``. No gloo
group is made here (``gloo=False``): each scenario makes the world it is about. See ``test_dist_single_process.py``.

- ``fake``: ``init_process_group("fake", store=FakeStore(), rank=0, world_size=8)``, an 8-way CPU
  mesh, two ``Linear`` units plus the root, one forward and backward (issue 16, input 1).
- ``threaded``: PyTorch's own helpers for threaded process groups, as its ``FSDPTestMultiThread``
  tests use them: a ``MultiThreadedTestCase`` and a test method under
  ``spawn_threads_and_init_comms``, each training issue 16's unit (``l`` + ``spare``, fill on) on 2
  thread ranks for two steps (issue 16, input 2). ``args["cases"]`` picks them (default: both);
  the tests run each in its own interpreter, since torch 2.10 and 2.11 crash on a second threaded
  world in one process.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn

import _dist_common as sc
import _restore_unused_param_grads_scenarios as fin
from _registry import scenario

FAKE_WORLD = 8
THREADS = 2
# The store timeout the cross-rank check would wait out if it waited for thread ranks: short, so a
# regression fails in seconds, yet far above what a passing run takes.
STORE_TIMEOUT_S = 15


@scenario("fake", gloo=False)
def sc_fake(ctx: sc.Ctx) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_WORLD)
    mesh = init_device_mesh("cpu", (FAKE_WORLD,))
    ctx.data["fake_reduce_scatter_writes_output"] = _fake_reduce_scatter_writes_output()

    def forward_backward(rec: dict[str, Any]) -> None:
        torch.manual_seed(sc.MODEL_SEED)
        model = nn.Sequential(nn.Linear(sc.DIM, sc.DIM), nn.Tanh(), nn.Linear(sc.DIM, sc.DIM))
        for index in (0, 2):
            fully_shard(model[index], mesh=mesh)
        fully_shard(model, mesh=mesh)
        start = time.monotonic()
        output = model(sc._randn(1, sc.ROWS_PER_RANK, sc.DIM))
        output.sum().backward()
        rec["elapsed_s"] = time.monotonic() - start
        rec["output"] = output.detach()  # from the fake all-gather, which copies on every release
        rec["grads"] = sc.grads_local(model)
        rec["status"] = sc.autopatch_status()

    with ctx.case("plugin_on") as rec:
        forward_backward(rec)
    with ctx.case("plugin_off") as rec:  # the same run with every patch undone: FSDP2's own numbers
        from fsdp_autopatch._activate import revert_all

        revert_all()
        forward_backward(rec)


def _fake_reduce_scatter_writes_output() -> bool:
    """Whether this torch's fake backend writes a reduce-scatter's output (a copy of this rank's
    chunk of the input) or leaves it as it was. FSDP2 reduce-scatters into a buffer it made with
    ``new_empty``: where nothing is written, its gradients are whatever that memory held."""
    import torch.distributed as dist

    output = torch.full((1,), float("nan"))
    dist.reduce_scatter_tensor(output, torch.ones(FAKE_WORLD))
    return not bool(output.isnan().any())


# --- threaded process groups ---------------------------------------------------------------

_build_lock = threading.Lock()  # building seeds torch's global generator: one thread at a time


def _short_store_timeouts() -> None:
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while store is not None:
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        store = getattr(store, "underlying_store", None)


def train_thread_rank() -> dict[str, Any]:
    """Issue 16's unit on this thread's rank: two steps, local gradient shards after each."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _short_store_timeouts()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with _build_lock:
        model = fin.build("one_unit")
    fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)
    out: dict[str, Any] = {"init_params": sc.params_local(model)}
    start = time.monotonic()
    for step in range(fin.STEPS):
        model.zero_grad(set_to_none=True)
        fin.loss_of(model, fin.plan(rank, step, 0)).backward()
        out[f"grads_{step}"] = sc.grads_local(model)
        out[f"probes_left_{step}"] = fin.probes_left(model)
    out["elapsed_s"] = time.monotonic() - start
    return out


def _test_cases(results: dict[str, dict[int, Any]]) -> list[type]:
    import unittest

    from torch.testing._internal.common_distributed import MultiThreadedTestCase, spawn_threads_and_init_comms

    class Training(MultiThreadedTestCase):
        @property
        def world_size(self) -> int:
            return THREADS

        def setUp(self) -> None:
            super().setUp()
            self._spawn_threads()

        def test_train(self) -> None:
            import torch.distributed as dist

            results["multi_threaded_test_case"][dist.get_rank()] = train_thread_rank()

    class Spawned(unittest.TestCase):
        @spawn_threads_and_init_comms(world_size=THREADS)
        def test_train(self) -> None:
            import torch.distributed as dist

            results["spawn_threads_and_init_comms"][dist.get_rank()] = train_thread_rank()

    return [Training, Spawned]


def _forget_checked_groups() -> None:
    """Each test case starts as a fresh process would: the check has compared no group yet (every
    threaded world names its default group "0", and the check compares each name once)."""
    from fsdp_autopatch.patches import cross_rank_check

    cross_rank_check._checked_groups.clear()


@scenario("threaded", gloo=False)
def sc_threaded(ctx: sc.Ctx) -> None:
    import io
    import unittest

    results: dict[str, dict[int, Any]] = {"multi_threaded_test_case": {}, "spawn_threads_and_init_comms": {}}
    wanted = ctx.args.get("cases", list(results))  # one per interpreter where torch needs it
    for case, test_case in zip(results, _test_cases(results)):
        if case not in wanted:
            continue
        _forget_checked_groups()
        with ctx.case(case) as rec:
            stream = io.StringIO()
            start = time.monotonic()
            outcome = unittest.TextTestRunner(stream=stream, verbosity=0).run(
                unittest.defaultTestLoader.loadTestsFromTestCase(test_case)
            )
            rec["elapsed_s"] = time.monotonic() - start
            rec["passed"] = outcome.wasSuccessful() and outcome.testsRun == 1
            rec["report"] = stream.getvalue()[-4000:]
            rec["ranks"] = results[case]
            rec["status"] = sc.autopatch_status()
