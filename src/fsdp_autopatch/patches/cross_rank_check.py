"""Policy ``cross_rank_check``: every rank of a process group must run the same patches.

Why it exists, the errors, where it is skipped and what is tested: docs/configuration.md, "The
cross-rank check".

What
    Once per process group FSDP2 reduces over (each unit's shard group and, for HSDP, its
    replicate group), at the root's lazy initialization (its first forward, before any FSDP2
    collective), every rank compares a fingerprint of its plugin state (fsdp-autopatch and torch
    versions, each patch's status, the policies' names) with its peers'. The comparison goes
    through the job's c10d store, not through a collective on the group: a peer without the plugin
    runs no check, and a collective would pair with that peer's first all-gather instead. Only on a
    mismatch does each rank read its peers' fingerprints to name the ranks and patches that differ.

Errors
    ``CrossRankMismatch`` on every rank of the group, from the first forward, with every group's
    findings in one error: "ranks disagree" (the differing items, the ranks on each side) or "never
    reported" (ranks silent until the store's timeout: the plugin is not active there).

Where it cannot compare, it steps aside
    A diagnostic: it raises only for a difference it has proven (or for ranks silent until the
    store's timeout). A process group it cannot compare (one rank, the ``fake`` and ``threaded``
    backends, a store of this process only or one that cannot do what the protocol needs, no
    default store) is skipped, the reason recorded in ``policies["cross_rank_check"]`` and logged
    at INFO; the fingerprint uses only policy names, so a skip never makes ranks differ.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, NamedTuple

from .. import _compat, _isolation, _patching, _process
from .._catalogue import BY_NAME, POLICY
from .._events import CrossRankMismatch
from .._registry import REGISTRY, PatchStatus
from .._spec import Patch, Verdict, Wrap, needed

NAME = "cross_rank_check"
_CHECKED = "_fsdp_autopatch_cross_rank_checked"  # FSDPState attribute: this root was checked
_KEY_PREFIX = "fsdp_autopatch/cross_rank_check"
_MAX_RANKS_SHOWN = 8
_UNNAMED_DIFFERENCE = "their fingerprints differ (the store cannot return them to name the items)"

ARMED = "once per process group at the root's first forward (FSDP_AUTOPATCH_CROSS_RANK_CHECK=0 turns it off)"
# Backends whose ranks cannot run a check of their own: "fake" simulates every rank but this one
# in one process; "threaded" runs every rank as a thread of this process, sharing one registry.
_SINGLE_PROCESS_BACKENDS = {
    "fake": "fake backend: one process stands in for every rank, the other ranks do not exist",
    "threaded": "threaded process group: every rank is a thread of this process and shares its registry",
}

logger = logging.getLogger("fsdp_autopatch")
_checked_groups: dict[str, Any] = {}  # group name -> group: each process group is checked once
# How often this process reverted the check: a check after a revert and a new activation (tests,
# gpu_check's step cost) publishes under fresh keys, not to meet the previous round's counts and
# "complete" key. Round 0 keeps earlier releases' keys: ranks of other versions meet, and are told.
_round = 0


def fingerprint() -> dict[str, str]:
    """What must be equal on every rank: the registry, minus the free-text reasons."""
    report = REGISTRY.snapshot()
    items = {"fsdp-autopatch": report.version, "torch": str(report.torch)}
    items.update({record.name: record.status.value for record in report.patches if not _waits_elsewhere(record)})
    items.update({f"policy {name}": "set" for name in sorted(report.policies)})  # absent: "missing"
    return items


def _waits_elsewhere(record: Any) -> bool:
    """A record still pending on a module other than FSDP2 (DCP's state_dict): whether a rank has
    imported that module before its first forward says nothing about its plugin, so it is left out."""
    return record.status is PatchStatus.PENDING and _process.trigger_of(record.name) != _process.HOOK_TARGET


def _forget_the_groups() -> None:
    """Reverted: a later activation checks every group afresh, under fresh store keys."""
    global _round
    _checked_groups.clear()
    _round += 1


_patching.on_revert(NAME, _forget_the_groups)


def _key_prefix(group_name: str) -> str:
    return f"{_KEY_PREFIX}/{group_name}" if _round == 0 else f"{_KEY_PREFIX}/round{_round}/{group_name}"


def record_skip(group_name: str, reason: str) -> None:
    """Say in the registry why a group was not compared; the run goes on."""
    logger.info("cross-rank check skipped for group %s: %s", group_name, reason)
    REGISTRY.add_policy_finding(NAME, group_name, f"skipped for group {group_name}: {reason}")


def check_after_lazy_init(wrapped, state, args, kwargs):
    """The policy's wrapper of ``FSDPState._lazy_init``."""
    result = wrapped(*args, **kwargs)
    # _lazy_init runs before every forward and returns at once after the first: stay as cheap.
    if state._is_root and not vars(state).get(_CHECKED):
        setattr(state, _CHECKED, True)
        try:
            groups = _process_groups(state)
        except Exception as error:  # internals we do not know: a diagnostic must not stop training
            record_skip("?", f"cannot list the process groups ({type(error).__name__}: {error})")
            return result
        check_groups(groups)
    return result


def _process_groups(root_state: Any) -> list[Any]:
    """The process groups FSDP2 reduces over for this root: shard groups and HSDP replicate groups."""
    groups: list[Any] = []
    for param_group in _compat.all_param_groups(root_state):
        groups += [group for group in _compat.mesh_process_groups(param_group) if all(group is not g for g in groups)]
    return groups


class _Comparison(NamedTuple):
    """One process group's comparison: keys under ``prefix`` in the job's c10d store."""

    store: Any
    prefix: str
    rank: int
    ranks: list[int]
    items: dict[str, str]


def check_groups(groups: list[Any]) -> None:
    """Compare this rank's fingerprint with every other rank of each group; raise on a difference."""
    comparisons = [c for c in map(_comparison_for, groups) if c is not None]
    if comparisons:
        _compare_all(comparisons)


def _comparison_for(group: Any) -> _Comparison | None:
    import torch.distributed as dist

    try:
        ranks = list(dist.get_process_group_ranks(group))
    except Exception as error:  # not a group of the default world (unusual init): cannot address it
        record_skip(str(getattr(group, "group_name", "?")), f"no ranks known ({type(error).__name__}: {error})")
        return None
    name = str(getattr(group, "group_name", "") or "-".join(map(str, ranks)))
    if name in _checked_groups:
        return None
    _checked_groups[name] = group
    reason = _why_not_comparable(group, ranks)
    if reason is None:
        try:
            store = dist.distributed_c10d._get_default_store()
            reason = _why_store_cannot_compare(store)
        except Exception as error:  # no default store (e.g. a group made without one)
            reason = f"no default store to compare through ({type(error).__name__}: {error})"
    if reason is not None:
        record_skip(name, reason)
        return None
    return _Comparison(store, _key_prefix(name), dist.get_rank(), ranks, fingerprint())


def _why_not_comparable(group: Any, ranks: list[int]) -> str | None:
    """Why this group's ranks have no peers in other processes to compare with, or None."""
    import torch.distributed as dist

    if len(ranks) < 2:
        return "one rank, nothing to compare"
    try:
        backend = str(dist.get_backend(group))
    except Exception:  # a group c10d does not know by backend: decided by its store below
        return None
    return _SINGLE_PROCESS_BACKENDS.get(backend)


def _why_store_cannot_compare(store: Any) -> str | None:
    """A store that only this process can reach (HashStore) means every rank using it is a thread
    of this process or simulated: nothing to compare, and peers that do not exist would be waited
    for until the timeout. PrefixStores are looked through. Other stores are tried: what they
    cannot do shows up as an error of the protocol itself (``_announce``, ``_peers_if_different``)."""
    import torch.distributed as dist

    for _ in range(16):  # PrefixStore(PrefixStore(...)): bounded, a store could point to itself
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    if isinstance(store, dist.HashStore):
        return "its store (HashStore) lives in this process only: the ranks are threads of this process or simulated"
    return None


def _is_timeout(error: BaseException) -> bool:
    # c10d says "Wait timeout" (HashStore, FileStore, PrefixStore) or "wait timeout after ...ms"
    # (TCPStore); DistStoreError is its class for those, FileStore raises a plain RuntimeError.
    text = str(error).lower()
    return "timeout" in text or "timed out" in text


def _digest(items: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


def _compare_all(comparisons: list[_Comparison]) -> None:
    """Report to every group first, then wait and compare, then raise everything found.

    Reporting first matters for HSDP: a rank belongs to a shard group and a replicate group, and if
    it stopped at a mismatch in the first before reporting to the second, the second group's peers
    would wait the whole timeout and then blame it as "never reported". No wait below depends on
    the order in which ranks visit their groups.
    """
    comparisons = [c for c in comparisons if _announced(c)]
    errors: list[RuntimeError] = []
    disagreeing: list[tuple[_Comparison, dict[int, dict[str, str]]]] = []
    for comparison in comparisons:
        try:
            peers = _peers_if_different(comparison)
        except _StoreCannot as error:
            record_skip(_group_of(comparison), str(error))
            continue
        except RuntimeError as error:
            errors.append(error)
            continue
        if peers is not None:
            disagreeing.append((comparison, peers))
    for comparison, peers in disagreeing:
        _wait_until_every_peer_has_read(comparison)
        errors.append(CrossRankMismatch(
            f"fsdp-autopatch cross-rank check: ranks disagree about the patches of process group "
            f"{_group_of(comparison)}, so they can issue different collectives: "
            f"{describe_differences(peers) or _UNNAMED_DIFFERENCE}. "
            "Give every rank the same FSDP_AUTOPATCH_* environment and the same torch, or set "
            "FSDP_AUTOPATCH_CROSS_RANK_CHECK=0 on every rank to skip this check."
        ))
    # Raised on purpose, for the user: call-time isolation lets these through.
    if len(errors) == 1:
        raise _isolation.for_the_user(errors[0])
    if errors:
        raise _isolation.for_the_user(CrossRankMismatch("\n".join(str(error) for error in errors)))


def _group_of(comparison: _Comparison) -> str:
    return comparison.prefix.rsplit("/", 1)[-1]


class _StoreCannot(Exception):
    """The store raised something other than a timeout: this group cannot be compared."""


def _store_cannot(operation: str, error: BaseException) -> _StoreCannot:
    return _StoreCannot(f"the store cannot {operation} ({type(error).__name__}: {str(error).splitlines()[0][:200]})")


def _announced(c: _Comparison) -> bool:
    """Publish, or record why the store cannot. Every rank of a group shares one store type, so a
    store that cannot ``set``/``add`` fails the same way on every rank: nobody waits for us."""
    try:
        _announce(c)
    except _StoreCannot as error:
        record_skip(_group_of(c), str(error))
        return False
    except Exception as error:
        record_skip(_group_of(c), str(_store_cannot("publish a fingerprint (set/add)", error)))
        return False
    return True


def _announce(c: _Comparison) -> None:
    """Publish this rank's fingerprint; the last rank to arrive releases everyone."""
    c.store.set(f"{c.prefix}/fingerprint/{c.rank}", json.dumps(c.items, sort_keys=True))
    c.store.add(f"{c.prefix}/digest/{_digest(c.items)}", 1)
    arrived = c.store.add(f"{c.prefix}/arrived", 1)
    if not isinstance(arrived, int) or arrived < 1:
        # A no-op store (torch 2.15's C++ FakeStore answers every call): nothing written is kept,
        # so no count read back from it could prove anything.
        raise _StoreCannot(f"the store cannot keep what is written (add returned {arrived!r} after adding 1)")
    if arrived == len(c.ranks):
        c.store.set(f"{c.prefix}/complete", "1")


def _peers_if_different(c: _Comparison) -> dict[int, dict[str, str]] | None:
    """None when every rank of the group has this rank's digest, else every rank's fingerprint."""
    try:
        c.store.wait([f"{c.prefix}/complete"])  # the store's timeout: the process group's
    except Exception as error:
        if not _is_timeout(error):
            raise _store_cannot("wait", error) from None
        silent = _silent_ranks(c)
        raise CrossRankMismatch(
            f"fsdp-autopatch cross-rank check: {_ranks(silent)} of process group {_group_of(c)} "
            f"never reported their patches ({type(error).__name__}: {error}). fsdp-autopatch is probably not "
            "active there (FSDP_AUTOPATCH_ENABLED=0, not installed in that environment, or python -S), so those "
            "ranks can issue different collectives, or its cross-rank check is off there "
            "(FSDP_AUTOPATCH_CROSS_RANK_CHECK=0 on some ranks only). Run every rank in the same environment, or set "
            "FSDP_AUTOPATCH_CROSS_RANK_CHECK=0 on every rank to skip this check."
        ) from None
    try:
        count = c.store.add(f"{c.prefix}/digest/{_digest(c.items)}", 0)
    except Exception as error:  # cannot count the digests: nothing proven
        raise _store_cannot("count the digests (add)", error) from None
    if count == len(c.ranks):
        return None
    if not isinstance(count, int) or not 1 <= count < len(c.ranks):
        # This rank's own digest counts 1, and no group has more ranks than it has: a store that
        # answers otherwise (a no-op store such as torch 2.15's C++ FakeStore) proves nothing.
        raise _StoreCannot(
            f"the store cannot keep what is written (it counts {count!r} of {len(c.ranks)} ranks' digests)"
        )
    try:  # the difference is proven; which items differ is what the fingerprints tell
        peers = {r: json.loads(c.store.get(f"{c.prefix}/fingerprint/{r}")) for r in c.ranks}
    except Exception:  # a store without get: the message cannot name the items
        peers = {}
    if c.store.add(f"{c.prefix}/read", 1) == len(c.ranks):
        c.store.set(f"{c.prefix}/read_complete", "1")
    return peers


def _silent_ranks(c: _Comparison) -> list[int]:
    try:
        return [r for r in c.ranks if not c.store.check([f"{c.prefix}/fingerprint/{r}"])]
    except Exception:  # a store without check: we cannot name them, the timeout is still proven
        return [r for r in c.ranks if r != c.rank]


def _wait_until_every_peer_has_read(c: _Comparison) -> None:
    # The store may live in one of these ranks (rank 0 without an elastic agent): nobody raises, and
    # so exits, before every rank has read what it needs for its own message.
    try:
        c.store.wait([f"{c.prefix}/read_complete"])
    except Exception:
        pass  # a peer died meanwhile: still raise


def describe_differences(peers: dict[int, dict[str, str]]) -> str:
    """``restore_unused_param_grads: applied on rank 0, disabled on rank 1; ...``"""
    keys = sorted({key for items in peers.values() for key in items})
    parts = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, items in sorted(peers.items()):
            by_value.setdefault(items.get(key, "missing"), []).append(rank)
        if len(by_value) > 1:
            sides = ", ".join(f"{value} on {_ranks(ranks)}" for value, ranks in by_value.items())
            parts.append(f"{key}: {sides}")
    return "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:_MAX_RANKS_SHOWN]))
    more = f" and {len(ranks) - _MAX_RANKS_SHOWN} more" if len(ranks) > _MAX_RANKS_SHOWN else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


def _structural_check() -> Verdict:
    # The root's _lazy_init runs before its first forward, before any FSDP2 collective.
    _patching.original_of(_compat.fsdp_class("_fsdp_state", "FSDPState"), "_lazy_init")
    return needed("FSDPState._lazy_init runs before the root's first collective")


PATCH = Patch(
    name=NAME,
    summary="every rank of a process group runs the same patches, checked at the first forward",
    symptom="ranks with different patches issue different collectives: NCCL hangs, gloo aborts",
    trigger="one node's environment differs (a patch switched off, another torch, no plugin)",
    upstream=(),
    affected=">=2.6",
    check=_structural_check,
    targets=(Wrap(f"{_compat.FSDP2_PACKAGE}._fsdp_state:FSDPState._lazy_init", check_after_lazy_init),),
    changes=ARMED,
    kind=POLICY,
    variable=BY_NAME[NAME].variable,
)
