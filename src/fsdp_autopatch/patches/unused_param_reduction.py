"""unused_param_reduction: backport ``FSDPModule.set_reduce_scatter_unused_params`` to torch < 2.13.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/unused_param_reduction.md.

Needed here?
    ``FSDPModule.set_reduce_scatter_unused_params`` exists -> not needed. Otherwise
    ``FSDPParamGroup.post_backward`` must look as it does in 2.6 - 2.12 (reads ``reduce_grads``,
    ``fsdp_params`` and the unsharded parameter, ``_unsharded_param`` or on 2.6 the
    ``unsharded_param`` property) and ``FSDPParam.init_unsharded_param`` must create
    ``_unsharded_param`` -> needed; else unsupported. Both must agree with the version range
    (< 2.13) on the releases measured in docs/compatibility.md.

The replacement
    * ``FSDPModule.set_reduce_scatter_unused_params(reduce_scatter_unused_params, *, recurse=True)``
      with torch 2.13's signature and semantics: a per-unit flag, off by default, stored in the same
      attribute torch 2.13 uses (``FSDPParamGroup.reduce_scatter_unused_params``), so user code is
      the same on every version.
    * ``FSDPParamGroup.post_backward`` wrapped: when the flag is on and the unit reduces gradients
      in this backward, each unsharded parameter that requires grad but has no local gradient gets
      ``grad = zeros_like(unsharded_param)`` just before torch's own post-backward reads it (the same
      zero torch 2.13 appends). The zero has ``param_dtype``; mixing it with fp32 accumulated
      gradients is what ``uniform_reduce_dtype`` handles.

Call-time isolation
    The fill runs before torch's ``post_backward``, and the list of parameters to fill is built
    before the first zero is set. Should our code raise, torch's ``post_backward`` runs without the
    fill: the reduce-scatters of that unit may differ across ranks, as without the patch. A
    failure caused by a changed torch strikes every rank at the same parameter, so every rank
    fills alike; a failure on one rank only (out of memory in ``zeros_like``) leaves that rank's
    reduce-scatter shorter, the failure the fill exists to prevent.

Policy
    ``FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS=1``: every FSDP unit starts with the flag on, on
    every torch version, for users who cannot edit their training code
    (``reduce_scatter_unused_params_default_on``). Off by default, as in torch.
"""

from __future__ import annotations

import torch

from .. import _compat, _events
from .._spec import Add, Patch, Verdict, Wrap, needed, not_needed, unsupported

_METHOD = "set_reduce_scatter_unused_params"
FLAG = "reduce_scatter_unused_params"  # FSDPParamGroup attribute, as in torch >= 2.13
_FSDP2 = _compat.FSDP2_PACKAGE


def _classes() -> tuple[type, type]:
    return _compat.fsdp_class("_fully_shard", "FSDPModule"), _compat.fsdp_class("_fsdp_param_group", "FSDPParamGroup")


def has_native_api() -> bool:
    """Whether torch itself provides ``FSDPModule.set_reduce_scatter_unused_params``."""
    fsdp_module, _ = _classes()
    method = _compat.class_attr(fsdp_module, _METHOD)
    return method is not None and not getattr(method, "__fsdp_autopatch__", False)


def has_fill() -> bool:
    """Whether units can zero-fill unused parameters here: torch's method or the applied backport."""
    fsdp_module, _ = _classes()
    return _compat.class_attr(fsdp_module, _METHOD) is not None


def _structural_check() -> Verdict:
    if has_native_api():
        # torch's own method is conclusive, whatever the version says (a vendor backport)
        return not_needed(f"torch provides FSDPModule.{_METHOD}", conclusive=True)
    _, param_group = _classes()
    fsdp_param = _compat.fsdp_class("_fsdp_param", "FSDPParam")
    post_backward = _compat.class_attr(param_group, "post_backward")
    # What the zero fill relies on: post_backward walks group.fsdp_params when reduce_grads is
    # set and collects each unsharded parameter's .grad (2.6 reads it through the
    # unsharded_param property, 2.7-2.12 through _unsharded_param), which FSDPParam creates in
    # init_unsharded_param.
    looks_right = (
        _compat.reads_names(post_backward, "reduce_grads", "fsdp_params")
        and (
            _compat.reads_names(post_backward, "_unsharded_param")
            or _compat.reads_names(post_backward, "unsharded_param")
        )
        and _compat.reads_names(_compat.class_attr(fsdp_param, "init_unsharded_param"), "_unsharded_param")
    )
    if not looks_right:
        return unsupported("FSDPParamGroup.post_backward is not the 2.6-2.12 one")
    return needed(f"FSDPModule.{_METHOD} is missing")


def _make_setter(fsdp_module_cls: type):
    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """
        Sets whether to include zero gradients for parameters that did not
        receive a gradient in backward. This is needed when different ranks
        use different parameters due to conditional control flow (e.g.
        multi-modal models, mixture of experts), causing mismatched
        reduce-scatter collectives. Similar to DDP's
        ``find_unused_parameters``.

        Backported from torch 2.13 by fsdp-autopatch (patch ``unused_param_reduction``).

        Args:
            reduce_scatter_unused_params (bool): Whether to include zero
                gradients for unused parameters in gradient reduction.
            recurse (bool): Whether to set for all FSDP submodules or just
                the passed-in module.
        """
        modules = list(self.modules()) if recurse else [self]
        for module in modules:
            if isinstance(module, fsdp_module_cls):
                for group in _compat.state_param_groups(module._get_fsdp_state()):
                    setattr(group, FLAG, reduce_scatter_unused_params)

    set_reduce_scatter_unused_params.__fsdp_autopatch__ = True
    return set_reduce_scatter_unused_params


def _needs_zero_grad(fsdp_param) -> bool:
    # Never unsharded (its unit never ran forward): torch skips it in post_backward, so do we.
    unsharded = _compat.unsharded_param(fsdp_param)
    return unsharded is not None and unsharded.requires_grad and not _compat.has_local_grad(fsdp_param)


def _zero_fill_unused(wrapped, group, args, kwargs):
    if group.reduce_grads and getattr(group, FLAG, False):
        filled = [fsdp_param for fsdp_param in group.fsdp_params if _needs_zero_grad(fsdp_param)]
        for fsdp_param in filled:
            unsharded = fsdp_param._unsharded_param
            unsharded.grad = torch.zeros_like(unsharded)
        if filled:  # one fire per unit that got the fill
            _events.fired(
                "unused_param_reduction",
                "this rank would have left them out of the reduce-scatter (size mismatch, hang or mixed gradients)",
                f"zero gradients for {_events.param_names(filled)}",
            )
    return wrapped(*args, **kwargs)


PATCH = Patch(
    name="unused_param_reduction",
    summary="`FSDPModule.set_reduce_scatter_unused_params` on torch < 2.13",
    symptom="ranks issue different reduce-scatters: gloo aborts on a size mismatch, NCCL hangs or mixes gradients",
    trigger="ranks use different parameters of one unit (MoE experts without tokens, a skipped branch)",
    upstream=("PyTorch issue 158719", "PyTorch PR 174862", "torchtitan issue 2747"),
    # torch 2.13 added the method; every FSDP2 release before lacks it.
    affected=">=2.6,<2.13",
    check=_structural_check,
    targets=(
        Add(f"{_FSDP2}._fully_shard:FSDPModule.{_METHOD}", _make_setter),
        Wrap(f"{_FSDP2}._fsdp_param_group:FSDPParamGroup.post_backward", _zero_fill_unused),
    ),
    changes="method added; post_backward zero-fills unused params of flagged units",
)
