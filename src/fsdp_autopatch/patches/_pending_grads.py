"""FSDP2 gradients not yet reduced: what ``pending_grads_warning`` and
``zero_grad_discards_pending_grads`` share (not an entry of its own).

With ``set_requires_gradient_sync(False)`` (FSDP1's ``no_sync``) a unit's post-backward keeps each
gradient unreduced on the FSDPParam: in ``_unsharded_param.grad``, or in
``unsharded_accumulated_grad`` when ``reduce_dtype`` differs from ``param_dtype``; with HSDP's
``set_requires_all_reduce(False)`` the reduce-scatter runs and its output waits in the unit's
``_partial_reduce_output`` for the all-reduce. The optimizer and ``nn.Module.zero_grad`` see only
the sharded parameters, so ``zero_grad()`` leaves all of that in place, and the next backward that
syncs reduces it together with its own gradients.

The entries find those units by wrapping ``FSDPParamGroup.post_backward``: a unit whose
post-backward ran with the sync off is remembered (a ``WeakSet``), and forgotten once a synced one
consumed what it kept. ``zero_grad()`` and ``optimizer.step()`` then look only at remembered units,
so a training loop that never turns the sync off pays one empty-set test per call.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any

from .. import _compat, _events, _isolation, _patching, _warn

WARNING = "pending_grads_warning"
DISCARD = "zero_grad_discards_pending_grads"
_kept: Any = weakref.WeakSet()  # FSDPParamGroups whose last post-backward kept gradients unreduced
_warned: set[str] = set()  # one warning per process and kind ("zero_grad", "step")
# per unit, the FSDPParams zeroed since its last post-backward: HSDP's partial output is one buffer,
# dropped once every trainable parameter of the unit was zeroed (two optimizers, frozen biases)
_zeroed: Any = weakref.WeakKeyDictionary()
_hook: dict[str, Any] = {"handle": None}


def torch_handles_pending_grads() -> str | None:
    """Why neither entry is needed where torch keeps pending gradients itself (None: it does not).

    PyTorch's pending-gradient rewrite (commit acf70b43) publishes what a no-sync backward leaves
    as an ``FSDPGrad`` (``_fsdp_grad``: a DTensor of reduced, unreduced and partial components) on
    the sharded parameter: ``zero_grad()`` drops or zeroes it there, and ``step()`` on a pending one
    raises until ``FSDPModule.synchronize_gradients()``. Recognised by that shape, not a release."""
    grad_module = sys.modules.get(f"{_compat.FSDP2_PACKAGE}._fsdp_grad")
    fsdp_grad = getattr(grad_module, "FSDPGrad", None)
    fsdp_module = _compat.fsdp_class("_fully_shard", "FSDPModule")
    if not (isinstance(fsdp_grad, type) and all(callable(getattr(fsdp_grad, name, None))
                                                for name in ("materialize", "local_components"))):
        return None
    if _compat.class_attr(fsdp_module, "synchronize_gradients") is None:
        return None
    fsdp_param = _compat.fsdp_class("_fsdp_param", "FSDPParam")
    if not _compat.reads_names(_compat.class_attr(fsdp_param, "publish_unsharded_grad"), "FSDPGrad"):
        return None
    return ("torch keeps gradients not yet reduced itself (FSDPParam.publish_unsharded_grad makes an FSDPGrad "
            "on the sharded parameter): zero_grad() drops them, and step() on one raises until "
            "FSDPModule.synchronize_gradients()")


def structural_problem() -> str | None:
    """What the entries rely on in this torch that is not there (None: everything is)."""
    group = _compat.fsdp_class("_fsdp_param_group", "FSDPParamGroup")
    post_backward = _compat.class_attr(group, "post_backward")
    if post_backward is None or not _compat.reads_names(post_backward, "reduce_grads"):
        return "FSDPParamGroup.post_backward does not keep gradients by reduce_grads"
    fsdp_param = _compat.fsdp_class("_fsdp_param", "FSDPParam")
    # 2.15: the leaf's own gradient, in its accumulation dtype (unsharded_accumulated_grad is a
    # property reading it); up to 2.14: the leaf's gradient, or a copy in reduce_dtype
    on_leaf = isinstance(_compat.class_attr(fsdp_param, "unsharded_accumulated_grad"), property)
    accumulate = _compat.class_attr(fsdp_param, "to_accumulated_grad_if_needed")
    if not on_leaf and (accumulate is None or not _compat.reads_names(
            accumulate, "_unsharded_param", "unsharded_accumulated_grad")):
        return "FSDPParam keeps no gradient on _unsharded_param / unsharded_accumulated_grad"
    import torch.optim.optimizer as optimizer_module

    if not callable(getattr(optimizer_module, "register_optimizer_step_pre_hook", None)):
        return "torch.optim.optimizer has no register_optimizer_step_pre_hook"
    return None


def remember(wrapped, group, args, kwargs):
    """``FSDPParamGroup.post_backward``: torch's, then remember or forget the unit."""
    result = wrapped(*args, **kwargs)
    _zeroed.pop(group, None)  # a new backward: what it keeps was not zeroed yet
    if keeps_gradients(group):
        _kept.add(group)
        if _hook["handle"] is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _hook["handle"] = register_optimizer_step_pre_hook(_isolation.aside_while_compiling(_before_step))
    else:
        _kept.discard(group)
    return result


def keeps_gradients(group: Any) -> bool:
    """Whether the unit holds gradients that no reduction has consumed yet."""
    if getattr(group, "_partial_reduce_output", None) is not None:
        return True
    return any(_compat.has_local_grad(fsdp_param) for fsdp_param in group.fsdp_params)


def pending_in(params: Iterable[Any]) -> list[tuple[Any, list[Any]]]:
    """Per remembered unit, its FSDPParams among ``params`` (sharded parameters, as an optimizer or
    ``nn.Module.parameters()`` holds them) whose gradients are still unreduced."""
    if not _kept:
        return []
    ids = {id(param) for param in params}
    found = []
    for group in list(_kept):
        held = [fp for fp in group.fsdp_params if id(fp.sharded_param) in ids]
        pending = [fp for fp in held if _compat.has_local_grad(fp)]
        if not pending and held and getattr(group, "_partial_reduce_output", None) is not None:
            pending = held  # HSDP: reduce-scattered, waiting for the all-reduce
        if pending:
            found.append((group, pending))
    return found


def discard(found: list[tuple[Any, list[Any]]]) -> None:
    """Drop the unreduced gradients of ``found``, as DDP's ``zero_grad()`` after ``no_sync`` does."""
    for group, fsdp_params in found:
        for fsdp_param in fsdp_params:
            unsharded = _compat.unsharded_param(fsdp_param)
            if unsharded is not None:
                unsharded.grad = None
            if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:  # up to 2.14 (2.15: the leaf's)
                fsdp_param.unsharded_accumulated_grad = None
        # the partial output is one buffer for the whole unit: dropped once every trainable parameter
        # of it was zeroed (in this call or an earlier one since the backward), as torch's own reset
        # drops it (2.15 also keeps where each parameter lies in it)
        zeroed = _zeroed.setdefault(group, set())
        zeroed.update(id(fp) for fp in fsdp_params)
        if all(id(fp) in zeroed for fp in group.fsdp_params if fp.sharded_param.requires_grad):
            group._partial_reduce_output = None
            layout = getattr(group, "_partial_reduce_output_layout", None)
            if layout:
                layout.clear()
        if not keeps_gradients(group):
            _kept.discard(group)


def describe(found: list[tuple[Any, list[Any]]]) -> str:
    fsdp_params = [fp for _, group_params in found for fp in group_params]
    return f"{len(fsdp_params)} parameter(s) in {len(found)} unit(s): {_events.param_names(fsdp_params)}"


def is_active(name: str) -> bool:
    return _patching.in_force(name)


def on_zero_grad(name: str, params: Iterable[Any], caller: str) -> None:
    """After torch's ``zero_grad()``, as entry ``name``: discard the unreduced gradients
    (``zero_grad_discards_pending_grads``), or warn once (``pending_grads_warning``, unless the
    discarding entry is in force: its wrapper, outside this one, drops them next)."""
    found = pending_in(params)
    if not found:
        return
    if name == DISCARD:
        _events.fired(DISCARD, "the discarded window's gradients would be reduced into the next step", describe(found))
        discard(found)
        return
    if is_active(DISCARD):
        return
    _events.fired(WARNING, "zero_grad() left FSDP2's unreduced gradients for the next step", describe(found))
    warn_once("zero_grad", (
        f"{caller}.zero_grad() left FSDP2 gradients that are not reduced yet ({describe(found)}): backward ran "
        "with set_requires_gradient_sync(False) (or HSDP's set_requires_all_reduce(False)) since the last "
        "reduction. zero_grad() clears only the sharded gradients; FSDP2 reduces the kept ones with the next "
        "backward that syncs, so the next optimizer step also applies the window zero_grad() was meant to "
        "discard (DDP's no_sync would have dropped it). To drop them at zero_grad() as DDP does, set "
        "FSDP_AUTOPATCH_ZERO_GRAD_DISCARDS_PENDING=1; if your loop relies on FSDP2's behaviour, set "
        "FSDP_AUTOPATCH_PENDING_GRADS_WARNING=0. (Shown once per process.)"))


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The global optimizer step pre-hook, installed when a unit first keeps gradients."""
    if _kept and is_active(WARNING):
        _isolation.isolated(WARNING, _check_step, optimizer)
    return None


def _check_step(optimizer: Any) -> None:
    found = pending_in(p for group in optimizer.param_groups for p in group["params"])
    if not found:
        return
    _events.fired(WARNING, "optimizer.step() ran with FSDP2 gradients not reduced yet", describe(found))
    warn_once("step", (
        f"{type(optimizer).__name__}.step() ran while FSDP2 gradients it updates are not reduced yet "
        f"({describe(found)}): the last backward ran with set_requires_gradient_sync(False). This step applies "
        "only gradients reduced before; the kept ones go into the next reduction. Turn the sync back on "
        "(model.set_requires_gradient_sync(True)) before the last micro-batch's backward. "
        "FSDP_AUTOPATCH_PENDING_GRADS_WARNING=0 silences this. (Shown once per process.)"))


def warn_once(kind: str, message: str) -> None:
    """A ``UserWarning`` once per process and ``kind``; never an exception (``-W error`` included)."""
    if kind in _warned:
        return
    _warned.add(kind)
    # at the user's zero_grad()/step() line, on the first rank of each node (``_warn``)
    _warn.warn(f"fsdp-autopatch: {message}")


def forget() -> None:
    """Forget the remembered units and the warnings given (a reverted entry; tests)."""
    _kept.clear()
    _warned.clear()
    _zeroed.clear()


def targets(name: str, wrap: Any) -> tuple[Any, ...]:
    """Entry ``name``'s three wrappers: the post-backward that keeps gradients, and both zero_grads
    (each reads nothing: ``set_to_none`` and anything else go to torch as they came)."""

    def zero_grad_of_optimizer(wrapped, optimizer, args, kwargs):
        result = wrapped(*args, **kwargs)
        if _kept:
            params = (p for group in optimizer.param_groups for p in group["params"])
            on_zero_grad(name, params, type(optimizer).__name__)
        return result

    def zero_grad_of_module(wrapped, module, args, kwargs):
        result = wrapped(*args, **kwargs)
        if _kept:
            on_zero_grad(name, module.parameters(), "model")
        return result

    return (
        wrap(f"{_compat.FSDP2_PACKAGE}._fsdp_param_group:FSDPParamGroup.post_backward", remember),
        # plain functions (a compiled train step may call them: Dynamo traces torch's, stepping ours aside)
        wrap("torch.optim.optimizer:Optimizer.zero_grad", zero_grad_of_optimizer, proxy=False),
        wrap("torch.nn.modules.module:Module.zero_grad", zero_grad_of_module, proxy=False),
    )
