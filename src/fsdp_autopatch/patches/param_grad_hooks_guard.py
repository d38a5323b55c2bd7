"""param_grad_hooks_guard: a ``Tensor.register_hook`` hook on a parameter FSDP2 manages stops the first backward.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/param_grad_hooks_guard.md.

Needed here?
    ``FSDPParam._init_sharded_param(self, param, ...)`` builds the sharded parameter as a new
    ``nn.Parameter`` (the replaced one's hooks stay behind), ``FSDPParamGroup.pre_backward`` exists
    (the group's first call in each backward), and neither ``foreach_reduce`` nor
    ``FSDPParamGroup.post_backward`` names ``_backward_hooks`` (torch runs no gradient hook of a
    sharded parameter) -> needed. One of them names ``_backward_hooks`` (torch running those hooks
    itself) -> not needed (conclusive). Anything else -> unsupported.

What it does
    * A wrapper of ``FSDPParam._init_sharded_param`` (``fully_shard``, once per parameter): after
      torch's method, where the replaced parameter has a ``_backward_hooks`` dict (it had a
      ``register_hook`` hook once), the FSDPParam keeps a reference to that dict. The dict, not the
      parameter: a hook the user removes with its handle before the backward stops nothing.
    * A wrapper of ``FSDPParamGroup.pre_backward`` (every group, every backward, before torch's
      unshard): the group's trainable parameters whose sharded parameter, or whose replaced original,
      holds a ``register_hook`` hook stop the backward with :class:`fsdp_autopatch.GuardError`
      naming them and ``register_post_accumulate_grad_hook``. No collective: the ranks register
      their hooks alike, so each stops at the same group. The common path reads two attributes per
      parameter of the group and calls torch's method.
    Why not run the hooks instead: the gradient the unsharded copy accumulates is this rank's own,
    unreduced one; a hook moved there would be right only where it is linear in it (a scale), and
    wrong for a clamp, a norm or a NaN check. FSDP2's own hooks live on forward outputs, never on
    parameters, so they do not count; nor do hooks on the unsharded copy (FSDP2's, during forward).

Call-time isolation
    The recording runs after torch's method (its result is kept should ours raise). The check runs
    before torch's ``pre_backward``: the GuardError reaches the user; should our code raise anything
    else, torch's method runs as it came (the bug's behaviour). Local to the rank: no collective.
"""

from __future__ import annotations

from typing import Any

from .. import _compat, _events
from .._catalogue import GUARD
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

NAME = "param_grad_hooks_guard"
_FSDP2 = _compat.FSDP2_PACKAGE
_INIT = "_init_sharded_param"
_HOOKS = "_backward_hooks"  # Tensor's own slot for register_hook hooks (a C property, not in __dict__)
# On an FSDPParam: the replaced parameter's register_hook dict (only where it had one)
ORIGINAL_HOOKS = "_fsdp_autopatch_original_backward_hooks"
_LEFT = ": torch left untouched"


def check_fsdp(fsdp_param_cls: type, group_cls: type, reduce_fn: Any) -> Verdict:
    """The structural verdict for ``FSDPParam``, ``FSDPParamGroup`` and the reduce function
    (torch's, or stand-ins in the tests)."""
    init = _compat.class_attr(fsdp_param_cls, _INIT)
    if init is None or not _compat.has_parameters(init, "param"):
        return unsupported(f"FSDPParam.{_INIT}(param, ...) not found{_LEFT}")
    if _compat.class_attr(group_cls, "pre_backward") is None:
        return unsupported(f"FSDPParamGroup.pre_backward not found{_LEFT}")
    post_backward = _compat.class_attr(group_cls, "post_backward")
    if any(_compat.reads_names(f, _HOOKS) for f in (init, post_backward, reduce_fn) if f is not None):
        return not_needed("FSDP2 runs the parameters' register_hook hooks itself", conclusive=True)
    if not _compat.reads_names(init, "Parameter", "sharded_param"):
        return unsupported(f"FSDPParam.{_INIT} does not build a new nn.Parameter into sharded_param{_LEFT}")
    return needed(
        "FSDP2 computes gradients on unsharded copies and writes the reduced shard into the sharded "
        "parameter's .grad itself: a register_hook hook on a managed parameter never runs"
    )


def _structural_check() -> Verdict:
    collectives = _compat.fsdp_module("_fsdp_collectives")
    return check_fsdp(
        _compat.fsdp_class("_fsdp_param", "FSDPParam"),
        _compat.fsdp_class("_fsdp_param_group", "FSDPParamGroup"),
        getattr(collectives, "foreach_reduce", None),
    )


def _remember_original_hooks(wrapped, fsdp_param, args, kwargs):
    original = wrapped.argument("param")
    result = wrapped(*args, **kwargs)
    hooks = getattr(original, _HOOKS, None)
    if hooks is not None and vars(fsdp_param).get("sharded_param") is not original:
        fsdp_param.__dict__[ORIGINAL_HOOKS] = hooks
    return result


def hooks_on(fsdp_param: Any) -> int:
    """How many ``register_hook`` hooks would never run for this managed parameter: those on its
    sharded parameter and those left on the parameter it replaced (0 for a frozen one)."""
    sharded = vars(fsdp_param).get("sharded_param")
    if sharded is None or not sharded.requires_grad:
        return 0
    return len(getattr(sharded, _HOOKS, None) or ()) + len(vars(fsdp_param).get(ORIGINAL_HOOKS) or ())


def _stop_on_grad_hooks(wrapped, group, args, kwargs):
    hooked = [(fsdp_param, count) for fsdp_param in group.fsdp_params if (count := hooks_on(fsdp_param))]
    if hooked:
        raise _stop([fsdp_param for fsdp_param, _ in hooked], sum(count for _, count in hooked))
    return wrapped(*args, **kwargs)


def _stop(fsdp_params: list[Any], count: int) -> Any:
    names = _events.param_names(fsdp_params)
    return _events.stop(
        NAME,
        f"{count} Tensor.register_hook hook(s) on the FSDP2-managed parameter(s) {names} would never run: "
        "FSDP2 computes each gradient on an unsharded copy and writes the reduced shard into the sharded "
        "parameter's .grad itself, outside autograd (a hook registered before fully_shard stays on the "
        "replaced parameter; one registered after it waits on the sharded parameter for an autograd "
        "gradient that never comes)",
        "Register it with param.register_post_accumulate_grad_hook(hook) instead: it runs after the "
        "reduce-scatter with the reduced, sharded gradient in param.grad (change param.grad in place to "
        "change the gradient). Moving the hook to the unsharded copy would hand it this rank's unreduced "
        "gradient, right only for a hook linear in it",
    )


PATCH = Patch(
    name=NAME,
    summary="a `Tensor.register_hook` hook on a parameter FSDP2 manages stops the first backward instead of "
            "never running",
    symptom="silent: register_hook hooks on managed parameters never run (0 of 3 calls), before or after "
            "fully_shard; a gradient clamp or scale in them is never applied",
    trigger="Tensor.register_hook on a parameter before fully_shard, or on its sharded DTensor after it",
    upstream=("torchrec PR 4268", "torchrec PR 4253"),
    # measured 2.13, 2.15; read, not run, 2.8 - 2.12 and 2.14 (no FSDP2 release runs these hooks).
    # <2.16: "measured up to 2.15", not "fixed in 2.16".
    affected=">=2.6,<2.16",
    check=_structural_check,
    targets=(
        Wrap(f"{_FSDP2}._fsdp_param:FSDPParam.{_INIT}", _remember_original_hooks, reads=("param",)),
        Wrap(f"{_FSDP2}._fsdp_param_group:FSDPParamGroup.pre_backward", _stop_on_grad_hooks),
    ),
    changes="a backward stops at the first group whose trainable parameters carry register_hook hooks",
    kind=GUARD,
)
