"""What the plugin must report on each simulated change (``_next_torch_changes.CHANGES``).

Shared by ``tests/unit/test_next_torch.py`` (the verdicts) and
``tests/distributed/test_dist_next_torch.py`` (the values): one table, per change and, where the
verdict turns on it, per shape of torch's code (never per release number: the suite runs on every
torch, the next one included).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import _next_torch as nt
from _next_torch_changes import CHANGES

APPLIED, NOT_NEEDED, UNSUPPORTED = "applied", "not_needed", "unsupported"
# "failed" is allowed only where a wrapper may meet an object it cannot handle at call time (the
# gradients of another kind): the record says so ("failed at call time") and torch's code runs.
FAILED_AT_CALL_TIME = "failed"


class ByShape:
    """The statuses allowed where they depend on the shape of torch's code the change edits, not
    on its release number: ``ask()`` reads that code (True / False), ``answers`` maps each to a set.
    A torch of either shape, whatever its version says, is judged by the column of its shape."""

    def __init__(self, question: str, ask: Callable[[], bool], answers: dict[bool, set[str]]) -> None:
        self.question, self.ask, self.answers = question, ask, answers

    def allowed(self) -> set[str]:
        return self.answers[bool(self.ask())]


def _source(owner: Any, attribute: str) -> str:
    """torch's own text of ``owner.attribute`` (behind the plugin's wrappers); "" where it has none."""
    inner = nt.innermost(vars(owner).get(attribute))
    try:
        return inspect.getsource(inner) if inner is not None else ""
    except (OSError, TypeError):
        return ""


def asserts_uniform_grad_dtype() -> bool:
    """Bug (a)'s shape: ``foreach_reduce`` asserts one gradient dtype (torch 2.13, 2.14; 2.15 fixed it)."""
    return "expects uniform gradient dtype" in _source(nt.fsdp("_fsdp_collectives"), "foreach_reduce")


_UNIFORM_ASSERTED = "foreach_reduce asserts a uniform gradient dtype"
_NEEDED_TO_FIXED = ByShape(_UNIFORM_ASSERTED, asserts_uniform_grad_dtype, {True: {APPLIED}, False: {NOT_NEEDED}})
_OTHER_GRADS = ByShape(_UNIFORM_ASSERTED, asserts_uniform_grad_dtype,
                       {True: {APPLIED, UNSUPPORTED, FAILED_AT_CALL_TIME}, False: {NOT_NEEDED, UNSUPPORTED}})
_APPLIED, _GONE = {APPLIED}, {UNSUPPORTED}
# What the patch named first in the case must report on the simulated change: one set wherever the
# change applies (a change that finds no code of the shape it edits raises Unavailable: the case
# skips), or a ByShape where the verdict turns on torch's code. Never a release number: a torch
# counted as 2.16 with 2.15's code is judged as 2.15's code. A renamed internal is no proof of
# torch's fix: unsupported, never not_needed.
EXPECTED: dict[str, set[str] | ByShape] = {
    "accumulated_grad_guard/new_keyword": _APPLIED,  # the method is gone in 2.15: the case skips
    "accumulated_grad_guard/renamed": _GONE,
    "uniform_reduce_dtype/new_keyword": _NEEDED_TO_FIXED,
    "uniform_reduce_dtype/imported_as": _NEEDED_TO_FIXED,
    "uniform_reduce_dtype/renamed": _GONE,
    "uniform_reduce_dtype/subclass_grads": _OTHER_GRADS,
    "uniform_reduce_dtype/lazy_grads": _OTHER_GRADS,
    "restore_unused_param_grads/new_keyword": _APPLIED,
    "restore_unused_param_grads/renamed": _GONE,
    "restore_unused_param_grads/torch_fix": {APPLIED, NOT_NEEDED},
    "post_forward_mesh_cache/new_keyword": _APPLIED,
    "post_forward_mesh_cache/renamed": _GONE,
    "post_forward_mesh_cache/torch_fix": {NOT_NEEDED},
    "grouped_module_reuse/new_keyword": _APPLIED,
    "grouped_module_reuse/renamed": _GONE,
    "grouped_module_reuse/post_partial_forward": _APPLIED,
    "keep_param_attributes/new_keyword": _APPLIED,
    "keep_param_attributes/renamed": _GONE,
    "clip_grad_norm_multi_mesh/dtype": _APPLIED,
    "clip_grad_norm_multi_mesh/new_keyword": _APPLIED,
    "clip_grad_norm_multi_mesh/new_keyword_total": _APPLIED,
    "clip_grad_norm_multi_mesh/torch_fix": {NOT_NEEDED},
    "clip_grad_norm_multi_mesh/renamed": _GONE,
    "unused_param_reduction/new_keyword": {NOT_NEEDED},
}
assert set(EXPECTED) == set(CHANGES), sorted(set(EXPECTED) ^ set(CHANGES))
# What other patches that read the changed code must report on it: clip_grad_norm_cpu_offload binds
# what it reads of _get_total_norm by name, so a new parameter (PR 194033's dtype, or any other with
# a default) leaves it applied.
ALSO: dict[str, dict[str, set[str] | ByShape]] = {
    "clip_grad_norm_multi_mesh/dtype": {"clip_grad_norm_cpu_offload": _APPLIED},
    "clip_grad_norm_multi_mesh/new_keyword_total": {"clip_grad_norm_cpu_offload": _APPLIED},
    "clip_grad_norm_multi_mesh/new_keyword": {"clip_grad_norm_cpu_offload": _APPLIED},
}


def patch_of(case: str) -> str:
    """``"uniform_reduce_dtype/renamed:late_param"`` -> ``"uniform_reduce_dtype"``."""
    return case.split("/", 1)[0]


def allowed(change: str, patch: str | None = None) -> set[str]:
    """The statuses the table allows the change's patch (or ``patch``, of :data:`ALSO`) on this
    torch's code."""
    entry = EXPECTED[change] if patch is None else ALSO[change][patch]
    return entry.allowed() if isinstance(entry, ByShape) else entry


def status_problem(case: str, record: dict[str, Any], patch: str | None = None) -> str | None:
    """Why a registry record of the case's patch (or of ``patch``, one of :data:`ALSO`) is not what
    the table allows, or None (asked outside the simulation: of the torch the change was made on)."""
    permitted = allowed(case.split(":", 1)[0], patch)
    got, reason = record["status"], record["reason"]
    if not reason:
        return f"{got} with an empty reason"
    if got == FAILED_AT_CALL_TIME and got in permitted and "call time" not in reason:
        return f"failed, but not at call time: {reason}"
    if got not in permitted:
        return f"{got} ({reason}); allowed: {sorted(permitted)}"
    return None


__all__ = ["ALSO", "EXPECTED", "ByShape", "allowed", "patch_of", "status_problem"]
