"""The cross-rank check's store protocol, with ranks as threads and an in-memory c10d store."""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest

from fsdp_autopatch import _consistency


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
    return run_threads({
        rank: functools.partial(_consistency._compare_all, [_consistency._Comparison(store, prefix, rank, ranks, prints[rank])])
        for rank in prints
    })


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
            _consistency._Comparison(store, f"fsdp_autopatch/cross_rank_check/{name}", rank, ranks, prints[rank])
            for name, ranks in groups
        ]

    return run_threads({rank: functools.partial(_consistency._compare_all, comparisons(rank)) for rank in prints})


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
    text = _consistency.describe_differences(peers)
    assert "restore_unused_param_grads: applied on ranks 0, 1, 2, 3, 4, 5, 6, 7 and 3 more, missing on rank 11" in text
    assert "torch: 2.13.0 on ranks" in text and "2.12.0 on rank 11" in text
    assert "fsdp-autopatch" not in text  # equal everywhere


def test_fingerprint_has_versions_statuses_and_policies_not_reasons(monkeypatch):
    from fsdp_autopatch._registry import REGISTRY, PatchStatus

    REGISTRY.reset()
    REGISTRY.record("uniform_reduce_dtype", PatchStatus.APPLIED, "some reason that may differ per rank")
    REGISTRY.record_policy("reduce_scatter_unused_params_default_on", "free text")
    try:
        items = _consistency.fingerprint()
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
    assert settings.cross_rank_check is expected
