"""Cross-rank check: every rank of a process group must run the same patches.

Why
    The patches change which collectives a rank issues: ``restore_unused_param_grads`` adds an
    all-reduce per backward, the unused-param fill changes what a rank reduce-scatters. If one
    node's environment differs (a patch switched off there, another torch, the plugin missing),
    its ranks issue other collectives than their peers: NCCL hangs until its timeout, gloo aborts,
    or gradients are silently mixed. This check turns that into an immediate, explicit error.

What
    Once per process group FSDP2 reduces over (each unit's shard group and, for HSDP, its
    replicate group), at the root's lazy initialization (its first forward, before any FSDP2
    collective), every rank compares a fingerprint of its plugin state (fsdp-autopatch and torch
    versions, each patch's status, the policies) with its peers'. The comparison goes through
    the job's c10d store, not through a collective on the group: a peer without the plugin runs
    no check, and a collective would pair with that peer's first all-gather instead.

    Happy path: per rank and process group, one ``set`` and three ``add`` calls and one ``wait``
    on the store, i.e. O(world size) store operations for the whole job, whatever its size; no tensor
    collective, nothing per step. Only on a mismatch does each rank read its peers' fingerprints
    to name the ranks and patches that differ.

Errors
    ``RuntimeError`` on every rank of the group, from the first forward (every group's findings
    in one error when several groups differ, e.g. an HSDP shard group and a replicate group):
    * "ranks disagree": lists each differing item (e.g. ``restore_unused_param_grads``) with the
      ranks on each side;
    * "never reported": ranks that did not reach the check within the store's timeout (which
      ``init_process_group`` sets to the process group timeout), i.e. where fsdp-autopatch is not
      active (``FSDP_AUTOPATCH_ENABLED=0``, not installed in that environment, ``python -S``).

Disable with ``FSDP_AUTOPATCH_CROSS_RANK_CHECK=0`` (every rank: a rank that still checks waits
for the others until the timeout).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, NamedTuple

from . import _compat
from ._registry import REGISTRY

NAME = "cross_rank_check"
_CHECKED = "_fsdp_autopatch_cross_rank_checked"  # FSDPState attribute: this root was checked
_KEY_PREFIX = "fsdp_autopatch/cross_rank_check"
_MAX_RANKS_SHOWN = 8

logger = logging.getLogger("fsdp_autopatch")
_checked_groups: dict[str, Any] = {}  # group name -> group: each process group is checked once


def fingerprint() -> dict[str, str]:
    """What must be equal on every rank: the registry, minus the free-text reasons."""
    report = REGISTRY.snapshot()
    items = {"fsdp-autopatch": report.version, "torch": str(report.torch)}
    items.update({record.name: record.status.value for record in report.patches})
    items.update({f"policy {name}": "set" for name in sorted(report.policies)})  # absent: "missing"
    return items


def apply() -> str:
    state_cls = _compat.fsdp_module("_fsdp_state").FSDPState
    lazy_init = _compat.class_attr(state_cls, "_lazy_init")
    if lazy_init is None:
        raise AttributeError("FSDPState._lazy_init not found")
    _compat.replace_all(NAME, [(state_cls, "_lazy_init", _compat.wrap(lazy_init, _check_after_lazy_init))])
    return "once per process group at the root's first forward (FSDP_AUTOPATCH_CROSS_RANK_CHECK=0 turns it off)"


def revert() -> None:
    _compat.revert(NAME)
    _checked_groups.clear()


def _check_after_lazy_init(wrapped, state, args, kwargs):
    result = wrapped(*args, **kwargs)
    # _lazy_init runs before every forward and returns at once after the first: stay as cheap.
    if state._is_root and not vars(state).get(_CHECKED):
        setattr(state, _CHECKED, True)
        check_groups(_process_groups(state))
    return result


def _process_groups(root_state: Any) -> list[Any]:
    """The process groups FSDP2 reduces over for this root: shard groups and HSDP replicate groups."""
    groups: list[Any] = []
    for state in root_state._state_ctx.all_states:
        for param_group in _compat.state_param_groups(state):
            mesh_info = param_group.mesh_info
            for attribute in ("shard_process_group", "replicate_process_group"):
                group = getattr(mesh_info, attribute, None)
                if group is not None and all(group is not g for g in groups):
                    groups.append(group)
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

    ranks = list(dist.get_process_group_ranks(group))
    if len(ranks) < 2:
        return None
    name = str(getattr(group, "group_name", "") or "-".join(map(str, ranks)))
    if name in _checked_groups:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception as error:  # no default store (unusual init): nothing to compare through
        logger.debug("cross-rank check skipped for group %s: %s", name, error)
        return None
    _checked_groups[name] = group
    return _Comparison(store, f"{_KEY_PREFIX}/{name}", dist.get_rank(), ranks, fingerprint())


def _digest(items: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


def _compare_all(comparisons: list[_Comparison]) -> None:
    """Report to every group first, then wait and compare, then raise everything found.

    Reporting first matters for HSDP: a rank belongs to a shard group and a replicate group, and if
    it stopped at a mismatch in the first before reporting to the second, the second group's peers
    would wait the whole timeout and then blame it as "never reported". No wait below depends on
    the order in which ranks visit their groups.
    """
    for comparison in comparisons:
        _announce(comparison)
    errors: list[RuntimeError] = []
    disagreeing: list[tuple[_Comparison, dict[int, dict[str, str]]]] = []
    for comparison in comparisons:
        try:
            peers = _peers_if_different(comparison)
        except RuntimeError as error:
            errors.append(error)
            continue
        if peers is not None:
            disagreeing.append((comparison, peers))
    for comparison, peers in disagreeing:
        _wait_until_every_peer_has_read(comparison)
        errors.append(RuntimeError(
            f"fsdp-autopatch cross-rank check: ranks disagree about the patches of process group "
            f"{_group_of(comparison)}, so they can issue different collectives: {describe_differences(peers)}. "
            "Give every rank the same FSDP_AUTOPATCH_* environment and the same torch, or set "
            "FSDP_AUTOPATCH_CROSS_RANK_CHECK=0 on every rank to skip this check."
        ))
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise RuntimeError("\n".join(str(error) for error in errors))


def _group_of(comparison: _Comparison) -> str:
    return comparison.prefix.rsplit("/", 1)[-1]


def _announce(c: _Comparison) -> None:
    """Publish this rank's fingerprint; the last rank to arrive releases everyone."""
    c.store.set(f"{c.prefix}/fingerprint/{c.rank}", json.dumps(c.items, sort_keys=True))
    c.store.add(f"{c.prefix}/digest/{_digest(c.items)}", 1)
    if c.store.add(f"{c.prefix}/arrived", 1) == len(c.ranks):
        c.store.set(f"{c.prefix}/complete", "1")


def _peers_if_different(c: _Comparison) -> dict[int, dict[str, str]] | None:
    """None when every rank of the group has this rank's digest, else every rank's fingerprint."""
    try:
        c.store.wait([f"{c.prefix}/complete"])  # the store's timeout: the process group's
    except Exception as error:
        silent = [r for r in c.ranks if not c.store.check([f"{c.prefix}/fingerprint/{r}"])]
        raise RuntimeError(
            f"fsdp-autopatch cross-rank check: {_ranks(silent)} of process group {_group_of(c)} "
            f"never reported their patches ({type(error).__name__}: {error}). fsdp-autopatch is probably not "
            "active there (FSDP_AUTOPATCH_ENABLED=0, not installed in that environment, or python -S), so those "
            "ranks can issue different collectives, or its cross-rank check is off there "
            "(FSDP_AUTOPATCH_CROSS_RANK_CHECK=0 on some ranks only). Run every rank in the same environment, or set "
            "FSDP_AUTOPATCH_CROSS_RANK_CHECK=0 on every rank to skip this check."
        ) from None
    if c.store.add(f"{c.prefix}/digest/{_digest(c.items)}", 0) == len(c.ranks):
        return None
    peers = {r: json.loads(c.store.get(f"{c.prefix}/fingerprint/{r}")) for r in c.ranks}
    if c.store.add(f"{c.prefix}/read", 1) == len(c.ranks):
        c.store.set(f"{c.prefix}/read_complete", "1")
    return peers


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
