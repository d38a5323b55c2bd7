"""frozen_first_mp_dtypes: a unit frozen at the first forward and unfrozen later keeps its mixed-precision
dtypes (a backport of PyTorch PR 187376, for PyTorch issue 186998).

Symptom, trigger, torch versions, measurements and upstream: docs/patches/frozen_first_mp_dtypes.md.

Needed here?
    ``FSDPParamGroup._init_mp_dtypes`` (run once per unit, from the root's lazy init at the first
    forward) takes the unit's ``_orig_dtype`` / ``_reduce_dtype`` from its trainable parameters only
    (it reads ``requires_grad``) and sets both attributes -> needed. It also reads
    ``is_floating_point`` (torch's fix: the floating parameters decide where none is trainable,
    2.14.1 and 2.15) -> not_needed (conclusive). It reads no ``requires_grad`` (2.7 and earlier: the
    dtypes of every parameter) -> not_needed (conclusive). Anything else -> unsupported.

The replacement
    A wrapper of ``FSDPParamGroup._init_mp_dtypes``: torch's method runs first, as it came (each
    parameter's dtype attributes, torch's uniformity assertions, its two attributes). Where the unit
    has a trainable parameter, nothing else happens: torch's result is the fix's. Where it has none,
    the rule of torch's fix decides: the dtypes of the unit's floating-point parameters, set where
    their original dtypes and their reduce dtypes are each one dtype, ``None`` (torch's value) where
    they are not or there is none. No collective, nothing per step: ``_init_mp_dtypes`` runs once per
    unit. The attributes are read only by a post-backward that has gradients to reduce, so a unit that
    stays frozen runs as before; a unit unfrozen later reduces in ``reduce_dtype`` and casts the
    sharded gradient to the parameters' dtype, as on 2.15.

    ``fired``: once per unit whose dtypes the rule set where torch left ``None`` (a frozen unit; it
    may stay frozen).

Call-time isolation
    Our code runs after torch's method: should it raise, torch's result stands (``KEEP_RESULT``: the
    bug's behaviour). What torch raises propagates. Under ``torch.compile`` the method runs in FSDP2's
    pre-forward hook, which torch hides from Dynamo: the wrapper runs eagerly there.
"""

from __future__ import annotations

from typing import Any

from .. import _compat, _events
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

NAME = "frozen_first_mp_dtypes"
_METHOD = "_init_mp_dtypes"
_SETS = ("_orig_dtype", "_reduce_dtype")
_WITHOUT = ("RuntimeError: attempting to assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype "
            "'Float' (the first backward after unfreezing)")


def check_init_mp_dtypes(method: Any) -> Verdict:
    """The structural verdict for torch's ``FSDPParamGroup._init_mp_dtypes`` (or a stand-in)."""
    if method is None:
        return unsupported(f"FSDPParamGroup has no {_METHOD}: torch left untouched")
    read = _compat.names_read(_compat.code_of(method))  # its list comprehensions included
    if "is_floating_point" in read:
        return not_needed(f"FSDPParamGroup.{_METHOD} takes the dtypes of the floating parameters where none is "
                          "trainable (PyTorch PR 187376)", conclusive=True)
    if not set(_SETS) <= read or "orig_dtype" not in read:
        return unsupported(f"FSDPParamGroup.{_METHOD} does not set _orig_dtype / _reduce_dtype from the parameters' "
                           "dtypes: torch left untouched")
    if "requires_grad" not in read:
        return not_needed(f"FSDPParamGroup.{_METHOD} takes the dtypes of every parameter, frozen or not",
                          conclusive=True)
    return needed(f"FSDPParamGroup.{_METHOD} takes the dtypes from the trainable parameters only: a unit frozen at "
                  "the first forward keeps None, and reduces in the compute dtype once unfrozen")


def _structural_check() -> Verdict:
    group = _compat.fsdp_class("_fsdp_param_group", "FSDPParamGroup")
    return check_init_mp_dtypes(_compat.class_attr(group, _METHOD))


def dtypes_of_frozen(fsdp_params: list[Any]) -> tuple[Any, Any]:
    """Torch's fix's rule for a unit without a trainable parameter: the original and reduce dtypes of
    its floating-point parameters, each ``None`` unless both sets hold one dtype."""
    floating = [p for p in fsdp_params if p.orig_dtype.is_floating_point]
    orig_dtypes = {p.orig_dtype for p in floating}
    reduce_dtypes = {p.reduce_dtype for p in floating}
    if len(orig_dtypes) == 1 and len(reduce_dtypes) == 1:
        return next(iter(orig_dtypes)), next(iter(reduce_dtypes))
    return None, None


def _init_mp_dtypes(wrapped, group, args, kwargs):
    result = wrapped(*args, **kwargs)
    fsdp_params = list(group.fsdp_params)
    if any(p.sharded_param.requires_grad for p in fsdp_params):
        return result  # torch's rule and its fix's agree
    orig_dtype, reduce_dtype = dtypes_of_frozen(fsdp_params)
    if orig_dtype is not None and (group._orig_dtype, group._reduce_dtype) != (orig_dtype, reduce_dtype):
        group._orig_dtype, group._reduce_dtype = orig_dtype, reduce_dtype
        _events.fired(NAME, _WITHOUT, str(getattr(group, "_module_fqn", "") or "the root"))
    return result


PATCH = Patch(
    name=NAME,
    summary="a unit frozen at the first forward and unfrozen later reduces in the mixed-precision reduce_dtype",
    symptom="RuntimeError: attempting to assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype "
            "'Float'",
    trigger="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) and a unit whose parameters are all frozen "
            "at the first forward, unfrozen later (progressive unfreezing)",
    upstream=("PyTorch issue 186998", "PyTorch PR 187376"),
    # measured 2.13 (the error) and 2.15 (torch's fix); read: 2.14.1 has the fix, 2.8 - 2.12 filter by
    # requires_grad as 2.13 does (PyTorch PR 154103, 2.8), 2.6 / 2.7 take every parameter's dtype
    affected=">=2.8,<2.14",
    check=_structural_check,
    targets=(Wrap(f"{_compat.FSDP2_PACKAGE}._fsdp_param_group:FSDPParamGroup.{_METHOD}", _init_mp_dtypes),),
    changes="a unit without a trainable parameter at the first forward takes its dtypes from its floating parameters",
)
