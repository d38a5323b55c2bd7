"""accumulated_grad_guard: don't crash post-backward on a unit that never ran forward.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/accumulated_grad_guard.md.

Needed here?
    ``FSDPParam.to_accumulated_grad_if_needed`` exists and its bytecode reads ``_unsharded_param``
    -> needed. Method absent on torch >= 2.15 -> not needed. Method absent where the no-sync path
    of ``FSDPParamGroup.post_backward`` calls ``FSDPParam.publish_unsharded_grad``, which reads
    ``_unsharded_param`` with ``getattr(..., None)`` (PyTorch's pending-gradient rewrite, commit
    acf70b43: ``FSDPGrad``) -> not needed, conclusively: torch skips a never-unsharded parameter
    itself. Anything else -> unsupported.

The replacement
    A wrapper that returns early when ``_unsharded_param`` does not exist yet. Missing lazy state
    means the parameter was never unsharded, so it has no unsharded gradient to upcast: returning
    is exactly what the method would do for a parameter without a gradient. Every other call goes
    to torch's method unchanged.

Call-time isolation
    Our code (one read of ``_unsharded_param``) runs before torch's method; should it raise, torch's
    method runs as without the patch (``_isolation``). A parameter a later torch adds is forwarded;
    the early return only takes the place of torch's ``AttributeError``.
"""

from __future__ import annotations

from .. import _compat, _events
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

_METHOD = "to_accumulated_grad_if_needed"
_REWRITE = "unsharded_grad_dtype"  # torch 2.15: the property its grad_dtype accumulation reads
_PUBLISH = "publish_unsharded_grad"  # the pending-gradient rewrite (FSDPGrad): what post_backward calls


def _structural_check() -> Verdict:
    fsdp_param = _compat.fsdp_class("_fsdp_param", "FSDPParam")
    method = _compat.class_attr(fsdp_param, _METHOD)
    if method is None:
        # Gone alone proves nothing (renamed?); gone with 2.15's Tensor.grad_dtype accumulation
        # in its place is torch's rewrite, which never converts a never-unsharded parameter.
        if isinstance(_compat.class_attr(fsdp_param, _REWRITE), property):
            return not_needed(
                f"FSDPParam has no {_METHOD}: gradients accumulate through Tensor.grad_dtype "
                f"(FSDPParam.{_REWRITE}, 2.15's rewrite); the crash path is gone"
            )
        if _skips_never_unsharded_itself(fsdp_param):
            return not_needed(
                f"FSDPParam has no {_METHOD}: post_backward's no-sync path calls FSDPParam.{_PUBLISH}, "
                "which reads _unsharded_param with getattr(..., None) (the pending-gradient rewrite): "
                "torch skips a never-unsharded parameter itself",
                conclusive=True,
            )
        return unsupported(f"FSDPParam has no {_METHOD} and no {_REWRITE}: cannot tell, torch left untouched")
    if not _compat.reads_names(method, "_unsharded_param"):
        return unsupported(f"FSDPParam.{_METHOD} does not read _unsharded_param")
    return needed(f"FSDPParam.{_METHOD} reads the lazily created _unsharded_param")


def _skips_never_unsharded_itself(fsdp_param: type) -> bool:
    """The pending-gradient rewrite's shape: post_backward hands each parameter to
    ``publish_unsharded_grad``, whose own code reads ``_unsharded_param`` through ``getattr``."""
    group = _compat.fsdp_class("_fsdp_param_group", "FSDPParamGroup")
    publish = _compat.class_attr(fsdp_param, _PUBLISH)
    return (_compat.reads_names(_compat.class_attr(group, "post_backward"), "reduce_grads", _PUBLISH)
            and _compat.reads_names(publish, "getattr", "_unsharded_param"))


def _skip_never_unsharded(wrapped, fsdp_param, args, kwargs):
    # No _unsharded_param: this parameter's unit never ran forward, so there is no unsharded
    # gradient to convert to reduce_dtype.
    if _compat.unsharded_param(fsdp_param) is None:
        if getattr(fsdp_param, "reduce_dtype", None) is not None:  # torch reads _unsharded_param: the crash
            _events.fired(
                "accumulated_grad_guard",
                "AttributeError: 'FSDPParam' object has no attribute '_unsharded_param' in post-backward",
                f"parameter {_events.param_names([fsdp_param])}, whose unit never ran forward",
            )
        return None
    return wrapped(*args, **kwargs)


PATCH = Patch(
    name="accumulated_grad_guard",
    summary="a unit that never ran forward does not crash post-backward",
    symptom="AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'",
    trigger="gradient accumulation (requires_gradient_sync False) with reduce_dtype, and a unit that skipped forward",
    upstream=("PyTorch PR 194058", "verl PR 7475", "NeMo Automodel PR 2744"),
    # 2.6 has the unguarded read but its final callback never reaches it (latent); 2.7-2.14 crash.
    affected=">=2.6,<2.15",
    check=_structural_check,
    targets=(Wrap(f"{_compat.FSDP2_PACKAGE}._fsdp_param:FSDPParam.{_METHOD}", _skip_never_unsharded),),
    changes="it returns early for parameters that were never unsharded",
)
