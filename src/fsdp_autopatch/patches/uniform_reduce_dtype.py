"""uniform_reduce_dtype: give every FSDP2 reduce-scatter one gradient dtype.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/uniform_reduce_dtype.md.

Needed here?
    ``_fsdp_collectives.foreach_reduce`` takes ``(fsdp_params, unsharded_grads, ...)`` and its
    bytecode holds the "expects uniform gradient dtype" message -> needed. Message absent on
    torch >= 2.15 -> not needed. Anything else -> unsupported.

The replacement
    ``foreach_reduce`` wrapped at every module that imported it by name (``_fsdp_collectives`` and
    ``_fsdp_param_group``). When the floating-point gradient dtypes of one call differ, each
    gradient is converted to their type promotion (``torch.promote_types``: bf16 with fp32 gives
    fp32, bf16 with fp16 gives fp32, never an arbitrary pick), *in place in the list*, because the
    list owns the gradient references and torch clears it. Values do not change: foreach_reduce
    copies every gradient into a ``reduce_dtype`` buffer anyway. A uniform list passes through
    untouched (same tensor objects), and non-float mixtures (or dtypes without a promotion, such as
    fp8) are left alone so torch's assertion still fires for a genuine error.

    DTensor entries: NVIDIA's vendor builds (``2.13.0a0+nv...``) can hand ``foreach_reduce`` a
    ``DTensor`` unsharded gradient among plain tensors (NeMo Automodel localizes them before the
    call); foreach_reduce works on local tensors. Each DTensor entry is replaced by its local tensor
    (``to_local()``), in the list, before the dtypes are compared. Stock torch passes plain tensors
    only: nothing changes there.

Call-time isolation
    Our code runs before torch's ``foreach_reduce``; the list is either fully converted or left as
    it came (the conversions are made first). Should our code raise, ``foreach_reduce`` runs on the
    list as torch built it, and torch's assertion fires as without the patch. ``fsdp_params`` and
    ``unsharded_grads`` are read by name; any other argument is forwarded. Entries that are not
    tensors leave the list to torch.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from .. import _compat, _events
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

_FUNCTION = "foreach_reduce"
_ASSERT_MESSAGE = "expects uniform gradient dtype"
_READS = ("fsdp_params", "unsharded_grads")


def _structural_check() -> Verdict:
    # The parameters the wrapper reads (fsdp_params, unsharded_grads) are checked by name from the
    # target's ``reads``; every other one is forwarded as it came.
    function = getattr(_compat.fsdp_module("_fsdp_collectives"), _FUNCTION, None)
    # recognised by its parameters before its body is judged: "no assertion" proves torch's fix
    # only in the function that had it
    if function is None or not _compat.has_parameters(function, *_READS):
        return unsupported(f"_fsdp_collectives.{_FUNCTION}({', '.join(_READS)}, ...) not found")
    if not _compat.has_string_constant(function, _ASSERT_MESSAGE):
        return not_needed(f"{_FUNCTION} does not assert a uniform gradient dtype")
    return needed(f"{_FUNCTION} asserts a uniform gradient dtype")


def widest_float_dtype(dtypes) -> Any:
    """The type promotion of several floating dtypes, or None if they have none (e.g. fp8)."""
    try:
        return functools.reduce(torch.promote_types, dtypes)
    except RuntimeError:  # "Promotion for Float8 Types is not supported"
        return None


def localize(grads: list) -> int:
    """Replace, in place, each DTensor entry by its local tensor; returns how many there were."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return 0
    found = [i for i, grad in enumerate(grads) if isinstance(grad, dtensor)]
    if found:
        local = list(grads)
        for i in found:
            local[i] = grads[i].to_local()
        grads[:] = local  # all conversions made first: the list is converted whole or left
    return len(found)


def _dtensor_type() -> Any:
    # DTensor is imported by FSDP2 itself; read it from there (never import it ourselves)
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def make_uniform(grads: list, converted: list | None = None) -> Any:
    """Convert, in place, mixed floating-point gradients to their promoted dtype; returns the
    dtypes it found mixed, or None when it changed nothing. All conversions are made before the
    list is touched: the list is either fully converted or left as it came. ``converted``, if
    given, receives the positions of the gradients it converted."""
    if not all(isinstance(grad, torch.Tensor) for grad in grads):
        return None  # something torch will judge itself
    dtypes = {grad.dtype for grad in grads}
    if len(dtypes) < 2 or not all(dtype.is_floating_point for dtype in dtypes):
        return None
    target = widest_float_dtype(dtypes)
    if target is None:
        return None
    if converted is not None:
        converted.extend(i for i, grad in enumerate(grads) if grad.dtype != target)
    grads[:] = [grad if grad.dtype == target else grad.to(target) for grad in grads]
    return dtypes


def _uniform_dtype_reduce(wrapped, instance, args, kwargs):
    grads = wrapped.argument("unsharded_grads")
    if isinstance(grads, list) and grads and localize(grads):
        _events.fired(
            "uniform_reduce_dtype", "DTensor gradients in foreach_reduce's list of local tensors (vendor builds)",
            f"reduce-scatter of {_events.param_names(wrapped.argument('fsdp_params') or ())}",
        )
    converted: list = []
    mixed = make_uniform(grads, converted) if isinstance(grads, list) and grads else None
    if mixed:
        shown = ", ".join(sorted(str(dtype).replace("torch.", "") for dtype in mixed))
        fsdp_params = list(wrapped.argument("fsdp_params") or ())
        # name the parameters whose gradient was cast, not the whole unit's
        cast = [fsdp_params[i] for i in converted if i < len(fsdp_params)]
        _events.fired(
            "uniform_reduce_dtype",
            f"AssertionError: FSDP reduce-scatter expects uniform gradient dtype (got {shown})",
            f"cast to {str(grads[0].dtype).replace('torch.', '')}: {_events.param_names(cast)}",
        )
    return wrapped(*args, **kwargs)


PATCH = Patch(
    name="uniform_reduce_dtype",
    summary='mixed-precision gradient accumulation does not trip "FSDP reduce-scatter expects uniform gradient dtype"',
    symptom=(
        "AssertionError: FSDP reduce-scatter expects uniform gradient dtype but got {torch.bfloat16, torch.float32}"
    ),
    trigger="param_dtype != reduce_dtype, gradient accumulation, a parameter first used (or zero-filled) late",
    upstream=("PyTorch issue 196996", "PyTorch PR 160279", "NeMo Automodel PR 3540"),
    # foreach_reduce asserts one gradient dtype from FSDP2's start up to 2.14; 2.15 removed it.
    affected=">=2.6,<2.15",
    check=_structural_check,
    # everywhere: _fsdp_param_group imported foreach_reduce by name (found by the object, any name)
    targets=(
        Wrap(
            f"{_compat.FSDP2_PACKAGE}._fsdp_collectives:{_FUNCTION}",
            _uniform_dtype_reduce,
            everywhere=True,
            reads=_READS,
        ),
    ),
    changes="mixed gradient dtypes are widened",
)
