"""accumulated_grad_guard: don't crash post-backward on a unit that never ran forward.

The bug
    FSDP2 creates ``FSDPParam._unsharded_param`` lazily, at a unit's first unshard (its first
    forward). From torch 2.7 the root's final backward callback calls ``post_backward()`` on every
    ``FSDPParamGroup`` that did not reach POST_BACKWARD, including a separately wrapped unit that
    never ran forward, e.g. a vision tower on text-only micro-batches. With gradient sync off
    (``set_requires_gradient_sync(False)``, i.e. gradient accumulation) and a
    ``MixedPrecisionPolicy(reduce_dtype=...)`` set, that path calls
    ``FSDPParam.to_accumulated_grad_if_needed``, which reads ``self._unsharded_param`` and raises::

        AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'

    Upstream: PyTorch PR 194058; also verl PR 7475, NeMo Automodel PR 2744.

Torch versions
    Crashes on 2.7 - 2.14 (latent on 2.6). torch 2.15 rewrote gradient accumulation around
    ``Tensor.grad_dtype`` and removed ``to_accumulated_grad_if_needed``: not needed there.

Needed here?
    ``FSDPParam.to_accumulated_grad_if_needed`` exists and its bytecode reads ``_unsharded_param``
    -> needed. Method absent on torch >= 2.15 -> not needed. Anything else -> unsupported.

The replacement
    A wrapper that returns early when ``_unsharded_param`` does not exist yet. Missing lazy state
    means the parameter was never unsharded, so it has no unsharded gradient to upcast: returning
    is exactly what the method would do for a parameter without a gradient. Every other call goes
    to torch's method unchanged.

Disable with ``FSDP_AUTOPATCH_ACCUMULATED_GRAD_GUARD_ENABLED=0``.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from .. import _compat
from . import Patch

NAME = "accumulated_grad_guard"
_METHOD = "to_accumulated_grad_if_needed"
# 2.6 has the unguarded read but its final callback never reaches it (latent); 2.7-2.14 crash.
AFFECTED = SpecifierSet(">=2.6,<2.15")


def _fsdp_param_class() -> type:
    return _compat.fsdp_module("_fsdp_param").FSDPParam


def check() -> _compat.Verdict:
    return _compat.decide(_structural_check(), _compat.torch_release(), AFFECTED, "the _unsharded_param crash")


def _structural_check() -> _compat.Verdict:
    method = _compat.class_attr(_fsdp_param_class(), _METHOD)
    if method is None:
        return _compat.not_needed(
            f"FSDPParam has no {_METHOD} (2.15 rewrote gradient accumulation; the crash path is gone)"
        )
    if not _compat.reads_names(method, "_unsharded_param"):
        return _compat.unsupported(f"FSDPParam.{_METHOD} no longer reads _unsharded_param")
    return _compat.needed(f"FSDPParam.{_METHOD} reads the lazily created _unsharded_param")


def _skip_never_unsharded(wrapped, fsdp_param, args, kwargs):
    # No _unsharded_param: this parameter's unit never ran forward, so there is no unsharded
    # gradient to convert to reduce_dtype.
    if "_unsharded_param" not in vars(fsdp_param):
        return None
    return wrapped(*args, **kwargs)


def apply() -> str:
    cls = _fsdp_param_class()
    guarded = _compat.wrap(_compat.class_attr(cls, _METHOD), _skip_never_unsharded)
    _compat.replace_all(NAME, [(cls, _METHOD, guarded)])
    return "it now returns early for parameters that were never unsharded"


def revert() -> None:
    _compat.revert(NAME)


PATCH = Patch(NAME, "guard post-backward against units that never ran forward", check, apply, revert)
