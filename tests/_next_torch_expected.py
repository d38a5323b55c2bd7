"""What the plugin must report on each simulated change (``_next_torch_changes.CHANGES``).

Shared by ``tests/unit/test_next_torch.py`` (the verdicts) and
``tests/distributed/test_dist_next_torch.py`` (the values): one table, per change and per release
whose internals were changed.
"""

from __future__ import annotations

from typing import Any

from _next_torch_changes import CHANGES

APPLIED, NOT_NEEDED, UNSUPPORTED = "applied", "not_needed", "unsupported"
# "failed" is allowed only where a wrapper may meet an object it cannot handle at call time (the
# gradients of another kind): the record says so ("failed at call time") and torch's code runs.
FAILED_AT_CALL_TIME = "failed"
_NEEDED_TO_FIXED = {"2.13": {APPLIED}, "2.15": {NOT_NEEDED}}  # torch 2.15 fixed bugs (a) and (c)
_BOTH = {"2.13": {APPLIED}, "2.15": {APPLIED}}
_GONE = {"2.13": {UNSUPPORTED}, "2.15": {UNSUPPORTED}}
_OTHER_GRADS = {"2.13": {APPLIED, UNSUPPORTED, FAILED_AT_CALL_TIME}, "2.15": {NOT_NEEDED, UNSUPPORTED}}
# What the patch named first in the case must report, per release whose internals were changed
# ("2.13": torch 2.13 and 2.14, "2.15": torch 2.15). A renamed internal is no proof of torch's fix:
# unsupported, never not_needed.
EXPECTED: dict[str, dict[str, set[str]]] = {
    "accumulated_grad_guard/new_keyword": {"2.13": {APPLIED}},  # 2.15 has no such method
    "accumulated_grad_guard/renamed": {"2.13": {UNSUPPORTED}},
    "uniform_reduce_dtype/new_keyword": _NEEDED_TO_FIXED,
    "uniform_reduce_dtype/imported_as": _NEEDED_TO_FIXED,
    "uniform_reduce_dtype/renamed": _GONE,
    "uniform_reduce_dtype/subclass_grads": _OTHER_GRADS,
    "uniform_reduce_dtype/lazy_grads": _OTHER_GRADS,
    "restore_unused_param_grads/new_keyword": _BOTH,
    "restore_unused_param_grads/renamed": _GONE,
    "restore_unused_param_grads/torch_fix": {"2.13": {APPLIED, NOT_NEEDED}, "2.15": {APPLIED, NOT_NEEDED}},
    "post_forward_mesh_cache/new_keyword": _BOTH,
    "post_forward_mesh_cache/renamed": _GONE,
    "post_forward_mesh_cache/torch_fix": {"2.13": {NOT_NEEDED}, "2.15": {NOT_NEEDED}},
    "grouped_module_reuse/new_keyword": _BOTH,
    "grouped_module_reuse/renamed": _GONE,
    "keep_param_attributes/new_keyword": _BOTH,
    "keep_param_attributes/renamed": _GONE,
    "clip_grad_norm_multi_mesh/dtype": _BOTH,
    "clip_grad_norm_multi_mesh/new_keyword": _BOTH,
    "clip_grad_norm_multi_mesh/new_keyword_total": _BOTH,
    "clip_grad_norm_multi_mesh/torch_fix": {"2.13": {NOT_NEEDED}, "2.15": {NOT_NEEDED}},
    "clip_grad_norm_multi_mesh/renamed": _GONE,
    "unused_param_reduction/new_keyword": {"2.13": {NOT_NEEDED}, "2.15": {NOT_NEEDED}},
}
assert set(EXPECTED) == set(CHANGES), sorted(set(EXPECTED) ^ set(CHANGES))


def patch_of(case: str) -> str:
    """``"uniform_reduce_dtype/renamed:late_param"`` -> ``"uniform_reduce_dtype"``."""
    return case.split("/", 1)[0]


def release_group(version: str) -> str | None:
    """Which column of :data:`EXPECTED` a torch belongs to, or None (not written for it)."""
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in version.split("+")[0].split(".")[:2])
    return {(2, 13): "2.13", (2, 14): "2.13", (2, 15): "2.15"}.get((major, minor))


def status_problem(case: str, record: dict[str, Any], version: str) -> str | None:
    """Why a registry record of the case's patch is not what the table allows, or None."""
    change = case.split(":", 1)[0]
    allowed = EXPECTED[change].get(release_group(version) or "", set())
    got, reason = record["status"], record["reason"]
    if not reason:
        return f"{got} with an empty reason"
    if got == FAILED_AT_CALL_TIME and got in allowed and "call time" not in reason:
        return f"failed, but not at call time: {reason}"
    if got not in allowed:
        return f"{got} ({reason}); allowed: {sorted(allowed)}"
    return None


__all__ = ["EXPECTED", "patch_of", "release_group", "status_problem"]
