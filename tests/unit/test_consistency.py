"""The cross-rank check's store protocol, with ranks as threads and an in-memory c10d store."""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest

from fsdp_autopatch.patches import cross_rank_check


class FakeStore:
    """The subset of ``torch.distributed.Store`` the check uses; ``wait`` times out like c10d's."""

    def __init__(self, timeout: float = 5.0) -> None:
        self.data: dict[str, bytes] = {}
        self.timeout = timeout
        self.calls = 0
        self._cond = threading.Condition()

    def set(self, key, value):
        with self._cond:
            self.calls += 1
            self.data[key] = value.encode() if isinstance(value, str) else value
            self._cond.notify_all()

    def get(self, key):
        with self._cond:
            self.calls += 1
            return self.data[key]

    def add(self, key, amount):
        with self._cond:
            self.calls += 1
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def check(self, keys):
        with self._cond:
            return all(k in self.data for k in keys)

    def wait(self, keys):
        with self._cond:
            self.calls += 1
            if not self._cond.wait_for(lambda: all(k in self.data for k in keys), self.timeout):
                raise RuntimeError("Wait timeout")


PRINT = {"fsdp-autopatch": "0.1.0", "torch": "2.13.0", "restore_unused_param_grads": "applied"}


def run_threads(protocol_of_rank: dict[int, Any]) -> dict[int, BaseException | None]:
    """Run each rank's protocol in a thread; returns rank -> exception or None."""
    errors: dict[int, BaseException | None] = {}

    def one(rank):
        try:
            protocol_of_rank[rank]()
            errors[rank] = None
        except BaseException as e:  # noqa: BLE001
            errors[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in protocol_of_rank]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def run_ranks(store, prints: dict[int, dict[str, str]], ranks=None):
    """Each rank of ``prints`` runs the protocol for one group in a thread."""
    ranks = ranks or sorted(prints)
    prefix = "fsdp_autopatch/cross_rank_check/0"
    comparisons = {rank: [cross_rank_check._Comparison(store, prefix, rank, ranks, prints[rank])] for rank in prints}
    return run_threads({rank: functools.partial(cross_rank_check._compare_all, comparisons[rank]) for rank in prints})


def test_equal_fingerprints_pass_with_a_constant_number_of_store_calls_per_rank():
    for world in (2, 8, 32):
        store = FakeStore()
        errors = run_ranks(store, {r: dict(PRINT) for r in range(world)})
        assert errors == {r: None for r in range(world)}
        # set + add + add + wait + add(0) per rank, plus one set by the last to arrive
        assert store.calls == 5 * world + 1


def test_a_difference_names_the_item_and_the_ranks_on_every_rank():
    prints = {r: dict(PRINT) for r in range(4)}
    prints[2]["restore_unused_param_grads"] = "disabled"
    errors = run_ranks(FakeStore(), prints)
    for rank, error in errors.items():
        assert isinstance(error, RuntimeError), (rank, error)
        message = str(error)
        assert "ranks disagree" in message
        assert "restore_unused_param_grads: applied on ranks 0, 1, 3, disabled on rank 2" in message
        assert "FSDP_AUTOPATCH_CROSS_RANK_CHECK=0" in message


def test_a_rank_that_never_reports_is_named_after_the_timeout():
    store = FakeStore(timeout=0.5)
    errors = run_ranks(store, {0: dict(PRINT), 2: dict(PRINT)}, ranks=[0, 1, 2])
    for rank in (0, 2):
        message = str(errors[rank])
        assert "rank 1 of process group 0 never reported" in message, message
        assert "FSDP_AUTOPATCH_ENABLED=0" in message


def _hsdp_groups(rank: int) -> list[tuple[str, list[int]]]:
    """2 replicas x 2 shards: shard groups {0,1} {2,3}, replicate groups {0,2} {1,3}."""
    shard = [rank - rank % 2, rank - rank % 2 + 1]
    replicate = [rank % 2, rank % 2 + 2]
    return [(f"shard{shard[0]}", shard), (f"replicate{replicate[0]}", replicate)]


def run_hsdp_ranks(store, prints: dict[int, dict[str, str]], *, reverse_on=()):
    """Each rank checks its two groups at once; ranks in ``reverse_on`` visit them in the other order."""

    def comparisons(rank):
        groups = _hsdp_groups(rank)[::-1] if rank in reverse_on else _hsdp_groups(rank)
        return [
            cross_rank_check._Comparison(store, f"fsdp_autopatch/cross_rank_check/{name}", rank, ranks, prints[rank])
            for name, ranks in groups
        ]

    return run_threads({rank: functools.partial(cross_rank_check._compare_all, comparisons(rank)) for rank in prints})


@pytest.mark.parametrize("reverse_on", [(), (3,), (1, 2)])
def test_hsdp_a_rank_that_differs_is_named_in_each_of_its_groups_without_waiting_for_the_timeout(reverse_on):
    """Rank 3 differs: its shard group {2,3} and replicate group {1,3} name it at once; ranks 0
    and 2 share {0,2}, which agrees. Before every group was reported to first, a rank stopped at
    its first mismatch, and its other group's peers waited the whole timeout ("never reported")."""
    import time

    prints = {r: dict(PRINT) for r in range(4)}
    prints[3]["restore_unused_param_grads"] = "disabled"
    start = time.monotonic()
    errors = run_hsdp_ranks(FakeStore(timeout=10.0), prints, reverse_on=reverse_on)
    assert time.monotonic() - start < 5.0, "a rank waited for the store timeout"
    assert errors[0] is None  # {0,1} and {0,2} agree; rank 0 learns of it from its peers' exits
    mismatch = "restore_unused_param_grads: applied on rank {peer}, disabled on rank 3"
    assert mismatch.format(peer=1) in str(errors[1]) and "never reported" not in str(errors[1])
    assert mismatch.format(peer=2) in str(errors[2])
    assert mismatch.format(peer=2) in str(errors[3]) and mismatch.format(peer=1) in str(errors[3])


def test_differences_list_missing_items_and_truncate_long_rank_lists():
    peers = {r: dict(PRINT) for r in range(12)}
    peers[11]["torch"] = "2.12.0"
    del peers[11]["restore_unused_param_grads"]
    text = cross_rank_check.describe_differences(peers)
    assert "restore_unused_param_grads: applied on ranks 0, 1, 2, 3, 4, 5, 6, 7 and 3 more, missing on rank 11" in text
    assert "torch: 2.13.0 on ranks" in text and "2.12.0 on rank 11" in text
    assert "fsdp-autopatch" not in text  # equal everywhere


def test_fingerprint_has_versions_statuses_and_policies_not_reasons(monkeypatch):
    from fsdp_autopatch._registry import REGISTRY, PatchStatus

    REGISTRY.reset()
    REGISTRY.record("uniform_reduce_dtype", PatchStatus.APPLIED, "some reason that may differ per rank")
    REGISTRY.record_policy("reduce_scatter_unused_params_default_on", "free text")
    try:
        items = cross_rank_check.fingerprint()
    finally:
        REGISTRY.reset()
    assert items["uniform_reduce_dtype"] == "applied"
    assert items["policy reduce_scatter_unused_params_default_on"] == "set"
    assert "fsdp-autopatch" in items and "torch" in items
    assert not any("reason" in v for v in items.values())


@pytest.mark.parametrize("value, expected", [(None, True), ("0", False), ("off", False), ("1", True), ("bogus", True)])
def test_the_check_is_on_by_default_and_can_be_switched_off(value, expected):
    from fsdp_autopatch._config import CROSS_RANK_CHECK, read_settings

    environ = {} if value is None else {CROSS_RANK_CHECK: value}
    settings = read_settings(environ, warn=lambda variable, message: None)
    assert settings.decision("cross_rank_check").enabled is expected


class StoreWithout(FakeStore):
    """A store whose ``operations`` raise as c10d's base ``Store`` does (``FakeStore`` of fake_pg)."""

    def __init__(
        self, *operations: str, error: str = "Tried to call pure virtual function \"::c10d::Store::add\""
    ) -> None:
        super().__init__(timeout=30.0)
        for operation in operations:
            setattr(self, operation, functools.partial(self._raise, error))

    @staticmethod
    def _raise(error, *args, **kwargs):
        raise RuntimeError(error)


@pytest.fixture
def clean_registry():
    from fsdp_autopatch._registry import REGISTRY

    REGISTRY.reset()
    REGISTRY.record_policy(cross_rank_check.NAME, cross_rank_check.ARMED)  # as activation leaves it
    yield REGISTRY
    REGISTRY.reset()


@pytest.mark.parametrize(
    "operations, says",
    [
        (("set", "add", "wait", "get", "check"), "the store cannot publish a fingerprint (set/add)"),
        (("add",), "the store cannot publish a fingerprint (set/add)"),
        (("wait",), "the store cannot wait"),
    ],
)
def test_a_store_that_cannot_is_skipped_at_once_and_recorded(clean_registry, operations, says):
    """No raise, no wait for the timeout: the group is skipped and the registry says why."""
    import time

    store = StoreWithout(*operations)
    start = time.monotonic()
    errors = run_ranks(store, {r: dict(PRINT) for r in range(2)})
    assert time.monotonic() - start < 5.0, "waited for the store timeout"
    assert errors == {0: None, 1: None}
    policy = clean_registry.snapshot().policies[cross_rank_check.NAME]
    assert policy.startswith(cross_rank_check.ARMED)
    assert f"skipped for group 0: {says} (RuntimeError: Tried to call pure virtual function" in policy, policy


class NoOpStore(FakeStore):
    """Answers every call and keeps nothing, as torch 2.15's C++ ``FakeStore`` does."""

    def set(self, key, value):
        pass

    def add(self, key, amount):
        return 0

    def wait(self, keys):
        pass

    def get(self, key):
        return b""

    def check(self, keys):
        return True


def test_a_store_that_keeps_nothing_is_skipped_not_taken_for_a_difference(clean_registry):
    errors = run_ranks(NoOpStore(), {r: dict(PRINT) for r in range(8)})
    assert errors == {r: None for r in range(8)}
    policy = clean_registry.snapshot().policies[cross_rank_check.NAME]
    assert "skipped for group 0: the store cannot keep what is written (add returned 0 after adding 1)" in policy


def test_a_timeout_is_still_reported_when_the_store_cannot_check(clean_registry):
    store = StoreWithout("check")
    store.timeout = 0.5
    errors = run_ranks(store, {0: dict(PRINT)}, ranks=[0, 1])
    assert "rank 1 of process group 0 never reported" in str(errors[0]), errors


def test_a_proven_difference_is_raised_when_the_store_cannot_get(clean_registry):
    prints = {r: dict(PRINT) for r in range(2)}
    prints[1]["torch"] = "2.15.0"
    errors = run_ranks(StoreWithout("get"), prints)
    for error in errors.values():
        assert "ranks disagree" in str(error) and "the store cannot return them" in str(error), error


def test_the_fingerprint_does_not_change_when_a_group_is_skipped(clean_registry):
    before = cross_rank_check.fingerprint()
    cross_rank_check.record_skip("3", "fake backend: ...")
    assert cross_rank_check.fingerprint() == before


def test_groups_without_peers_in_other_processes_are_not_compared(monkeypatch):
    dist = pytest.importorskip("torch.distributed")  # a real torch: its stores and groups

    group = object()
    assert cross_rank_check._why_not_comparable(group, [0]) == "one rank, nothing to compare"
    for backend, says in (("fake", "fake backend"), ("threaded", "threaded process group")):
        monkeypatch.setattr(dist, "get_backend", lambda g, b=backend: b)
        assert cross_rank_check._why_not_comparable(group, [0, 1]).startswith(says)
    for backend in ("gloo", "nccl", "cpu:gloo,cuda:nccl", "my_custom_backend"):
        monkeypatch.setattr(dist, "get_backend", lambda g, b=backend: b)
        assert cross_rank_check._why_not_comparable(group, [0, 1]) is None, backend


def test_a_store_only_this_process_reaches_is_not_compared(tmp_path):
    dist = pytest.importorskip("torch.distributed")  # a real torch: its stores and groups

    in_process = dist.PrefixStore("default_pg", dist.PrefixStore("x", dist.HashStore()))
    assert "HashStore" in cross_rank_check._why_store_cannot_compare(in_process)
    assert cross_rank_check._why_store_cannot_compare(dist.FileStore(str(tmp_path / "store"), 1)) is None


def test_torchs_fake_store_is_skipped_by_what_it_can_do(clean_registry):
    """torch's FakeStore raises "Not implemented" (2.13, 2.14) or answers without keeping anything
    (2.15): either way the group is skipped without the backend's name telling us."""
    dist = pytest.importorskip("torch.distributed")  # a real torch: its stores and groups
    from torch.testing._internal.distributed.fake_pg import FakeStore as TorchFakeStore

    store = dist.PrefixStore("default_pg", TorchFakeStore())
    prefix = "fsdp_autopatch/cross_rank_check/0"
    comparison = cross_rank_check._Comparison(store, prefix, 0, list(range(8)), dict(PRINT))
    cross_rank_check._compare_all([comparison])
    policy = clean_registry.snapshot().policies[cross_rank_check.NAME]
    assert "skipped for group 0: the store cannot" in policy, policy
