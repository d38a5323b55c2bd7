"""gradient_divide_factor_single_rank: a custom gradient divide factor divides once on a one-rank shard group.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/gradient_divide_factor_single_rank.md.

Needed here?
    Read from torch's own code (no process group): ``foreach_reduce``'s source has an
    ``if ...: reduce_scatter_comm(...) else: ...`` whose ``else`` divides by
    ``gradient_divide_factor``, and ``_get_gradient_divide_factors`` (parameters ``factor`` and
    ``reduce_scatter_group``), asked for a one-rank stand-in group with factor 4 on the sum path,
    still returns a divide factor -> needed. No copy branch (the reduce-scatter is unconditional),
    a copy that does not divide, or no divide factor at one rank -> not_needed (one division,
    conclusive). Anything else (no source, another shape) -> unsupported.

The replacement
    A wrapper of ``_fsdp_collectives._get_gradient_divide_factors`` (a module global that
    ``foreach_reduce`` reads at each call; its only caller). It calls torch's function, and only
    where ``factor`` is set, the reduce-scatter group has one rank (or is ``None``, which
    ``foreach_reduce`` treats as one rank) and a pre- or post-divide factor other than 1 came back,
    it returns no pre/post factor (``None, None``) with torch's two ops (SUM): the copy branch's
    division is then the only one. Gradients equal the same run on a 2-rank shard group and the
    one-process reference (fp32: bitwise here). Every other call returns torch's result unchanged.
    Each corrected reduction (one ``foreach_reduce`` call, a microbatch's partial reduction
    included) counts one ``fired``.

    fp16 (any reduce dtype other than fp32/bf16): torch splits ``f`` into ``sqrt f`` before and
    after the reduction to keep fp16 in range; with the patch the whole ``f`` is divided in the
    copy, before the HSDP all-reduce (the copy reads the same ``gradient_divide_factor`` that feeds
    this function, so the split cannot be kept from outside). With a large ``f`` a small fp16
    gradient can underflow where torch intended ``sqrt f``. An ``all_reduce_hook`` sees the fully
    divided gradient, as on the copy branch's AVG path.

Call-time isolation
    Our code runs after torch's function, which is pure: should it raise, the caller gets torch's
    result (``KEEP_RESULT``: the double division, as without the patch). It reads
    ``group.size()`` only (local, no collective) and allocates nothing.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from .. import _compat, _events
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

NAME = "gradient_divide_factor_single_rank"
_MODULE = "_fsdp_collectives"
_FUNCTION = "_get_gradient_divide_factors"
_READS = ("factor", "reduce_scatter_group")
_COMMS = frozenset(("reduce_scatter_comm", "reduce_scatter_tensor"))  # 2.8+ / 2.6-2.7: the reduce-scatter
_DIVISOR = "gradient_divide_factor"
_PROBE_FACTOR = 4.0

# what foreach_reduce's world-size-1 branch does (_copy_branch)
DIVIDES = "the one-rank copy divides by gradient_divide_factor"
COPIES = "the one-rank copy does not divide"
NO_BRANCH = "foreach_reduce reduce-scatters on every group size"



def _names_called(node: ast.AST) -> set[str]:
    called = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            called.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
    return called


def _divides_by(nodes: list[ast.stmt], name: str) -> bool:
    return any(
        isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Div) and isinstance(sub.right, ast.Name)
        and sub.right.id == name
        for node in nodes for sub in ast.walk(node)
    )


def _copy_branch(source: str) -> str | None:
    """What ``foreach_reduce`` (its source) does instead of a one-rank reduce-scatter; None: unknown."""
    tree = ast.parse(textwrap.dedent(source))
    if not _COMMS & _names_called(tree):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and node.orelse and any(_COMMS & _names_called(s) for s in node.body):
            if _divides_by(node.orelse, _DIVISOR):
                return DIVIDES
            return COPIES if "copy_" in _names_called(ast.Module(body=node.orelse, type_ignores=[])) else None
    return NO_BRANCH


class _OneRankGroup:
    """A stand-in reduce-scatter group for the check: ``_get_gradient_divide_factors`` reads its size."""

    def size(self) -> int:
        return 1


def _factors_at_one_rank(function: Any) -> float:
    import torch

    pre, post, *_ = function(
        reduce_scatter_group=_OneRankGroup(), all_reduce_group=None, reduce_dtype=torch.float32,
        device_type="cpu", factor=_PROBE_FACTOR, force_sum_reduction_for_comms=True,
    )
    return (pre or 1) * (post or 1)


def _structural_check() -> Verdict:
    module = _compat.fsdp_module(_MODULE)
    foreach_reduce = _compat.innermost(module.foreach_reduce)
    try:
        source = inspect.getsource(foreach_reduce)
    except (OSError, TypeError):
        return unsupported("foreach_reduce's source is not available: torch left untouched")
    branch = _copy_branch(source)
    if branch is None:
        return unsupported("foreach_reduce has no reduce-scatter call, or a one-rank branch of another shape")
    if branch != DIVIDES:
        return not_needed(f"{branch}: a custom factor is divided once (pre/post only)", conclusive=True)
    function = _compat.innermost(getattr(module, _FUNCTION))
    parameters = inspect.signature(function).parameters
    missing = [name for name in (*_READS, "force_sum_reduction_for_comms") if name not in parameters]
    if missing:
        return unsupported(f"{_FUNCTION} has no parameter {', '.join(missing)}: torch left untouched")
    total = _factors_at_one_rank(function)
    if total == 1:
        return not_needed(f"{DIVIDES}, and {_FUNCTION} returns no divide factor at one rank", conclusive=True)
    return needed(
        f"{DIVIDES} and {_FUNCTION} also divides by {total:g} on the sum path: factor**2 in all"
    )


def _divides(divisor: Any) -> bool:
    return divisor is not None and divisor != 1  # what torch's _div_if_needed skips


def _one_division(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    pre, post, reduce_scatter_op, all_reduce_op = result
    if not (_divides(pre) or _divides(post)):
        return result  # AVG / PREMUL_SUM path, or nothing to divide: the copy is the only division
    factor = wrapped.argument("factor")
    group = wrapped.argument("reduce_scatter_group")
    if factor is None or (group is not None and group.size() != 1):
        return result  # no factor: the copy does not divide; 2+ ranks: a real reduce-scatter, no copy
    _events.fired(
        NAME, f"gradients divided by {factor:g} twice (the one-rank copy, then pre {pre} / post {post})",
        f"factor {factor:g}, one-rank reduce-scatter group",
    )
    return None, None, reduce_scatter_op, all_reduce_op


PATCH = Patch(
    name=NAME,
    summary="set_gradient_divide_factor divides once on a one-rank shard group (HSDP (N, 1)) on the sum paths",
    symptom="gradients divided by factor**2 (4x too small for factor 4), silently, on every rank",
    trigger=(
        "set_gradient_divide_factor(f) with a one-rank shard group (HSDP (N, 1), one process per node) and "
        "set_force_sum_reduction_for_comms(True) or an fp16 reduce dtype"
    ),
    upstream=("PyTorch issue 155903", "PyTorch PR 162021", "PyTorch PR 155915"),
    # measured on 2.10 - 2.13 and 2.15 (matrix 2026-12-02 for 2.10 - 2.12); <2.16: the end of what
    # was measured (the bug is still there on 2.15)
    affected=">=2.10,<2.16",
    check=_structural_check,
    targets=(Wrap(f"{_compat.FSDP2_PACKAGE}.{_MODULE}:{_FUNCTION}", _one_division, reads=_READS),),
    changes="a one-rank reduce-scatter group with a custom factor gets no pre/post divide on top of the copy's",
)
