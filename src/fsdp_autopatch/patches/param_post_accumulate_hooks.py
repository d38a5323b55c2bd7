"""param_post_accumulate_hooks: post-accumulate-grad hooks registered before ``fully_shard`` keep running.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/param_post_accumulate_hooks.md.

Needed here?
    ``FSDPParam._init_sharded_param(self, param, ...)`` builds the sharded parameter as a new
    ``nn.Parameter`` (``sharded_param``) and does not read ``_post_accumulate_grad_hooks`` (so the
    hooks stay on the replaced ``param``), while FSDP2's ``foreach_reduce`` runs the hooks of
    ``fsdp_param.sharded_param._post_accumulate_grad_hooks`` after each reduce-scatter -> needed.
    ``_init_sharded_param`` names ``_post_accumulate_grad_hooks`` itself (torch carrying them) ->
    not needed (conclusive). ``foreach_reduce`` runs no such hooks (taking them over would not make
    them run), or the methods are not the known ones -> unsupported.

What it does
    A wrapper of ``FSDPParam._init_sharded_param`` (``fully_shard``, once per managed parameter):
    after torch's method, where the replaced parameter holds post-accumulate-grad hooks and the new
    sharded parameter holds none, the sharded parameter takes over the replaced one's hook dict, the
    same ``OrderedDict`` object (assigned through ``Tensor._post_accumulate_grad_hooks``, what
    ``register_post_accumulate_grad_hook`` itself does on its first call): the handles the user
    holds still remove their hooks, and a hook registered on either parameter later is seen by
    both. They then run where torch runs a sharded parameter's hooks, after the reduce-scatter
    (and HSDP's all-reduce) wrote the reduced, sharded gradient into ``param.grad``: what a hook
    registered on the sharded parameter after ``fully_shard`` gets. Nothing else changes: without
    such hooks (every usual run) the wrapper only reads one attribute per parameter, once.

    Not carried, as without FSDP2: hooks of a parameter replaced by ``load_state_dict(...,
    assign=True)``. ``Tensor.register_hook`` hooks are not carried either (they would be handed an
    unreduced, per-rank gradient on the unsharded copy, or never run on the sharded one):
    ``param_grad_hooks_guard`` stops those runs.

    ``fired``: once per parameter whose hooks were taken over.

Call-time isolation
    Our code runs after torch's method; should it raise, torch's result is kept (``KEEP_RESULT``)
    and the hooks stay where they were (the bug's behaviour). ``param`` is read by name; any other
    argument is forwarded. Local to the rank: no collective.
"""

from __future__ import annotations

from typing import Any

from .. import _compat, _events
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

NAME = "param_post_accumulate_hooks"
_PARAM = f"{_compat.FSDP2_PACKAGE}._fsdp_param"
_INIT = "_init_sharded_param"
_HOOKS = "_post_accumulate_grad_hooks"  # Tensor's own slot (a C property, not in the parameter's __dict__)
_LEFT = ": torch left untouched"


def check_fsdp_param(cls: type, reduce_fn: Any) -> Verdict:
    """The structural verdict for an ``FSDPParam`` class and the reduce function that runs the
    sharded parameters' hooks (torch's, or stand-ins in the tests)."""
    init = _compat.class_attr(cls, _INIT)
    if init is None or not _compat.has_parameters(init, "param"):
        return unsupported(f"FSDPParam.{_INIT}(param, ...) not found{_LEFT}")
    if _compat.reads_names(init, _HOOKS):
        return not_needed(f"FSDPParam.{_INIT} carries the post-accumulate-grad hooks itself", conclusive=True)
    if not _compat.reads_names(init, "Parameter", "sharded_param"):
        return unsupported(f"FSDPParam.{_INIT} does not build a new nn.Parameter into sharded_param{_LEFT}")
    if reduce_fn is None or not _compat.reads_names(reduce_fn, _HOOKS, "sharded_param"):
        return unsupported(f"foreach_reduce does not run the sharded parameter's {_HOOKS}{_LEFT}")
    return needed(
        f"FSDPParam.{_INIT} replaces each parameter by a new nn.Parameter without its post-accumulate-grad "
        "hooks, and FSDP2 runs only the sharded parameter's"
    )


def _structural_check() -> Verdict:
    collectives = _compat.fsdp_module("_fsdp_collectives")
    reduce_fn = getattr(collectives, "foreach_reduce", None)
    return check_fsdp_param(_compat.fsdp_class("_fsdp_param", "FSDPParam"), reduce_fn)


def take_over_hooks(original: Any, sharded: Any) -> bool:
    """Give ``sharded`` the post-accumulate-grad hook dict of ``original`` (the same object) where
    ``original`` holds hooks and ``sharded`` none; whether it did."""
    hooks = getattr(original, _HOOKS, None)
    if not hooks or sharded is None or sharded is original or getattr(sharded, _HOOKS, None) is not None:
        return False
    setattr(sharded, _HOOKS, hooks)  # Tensor's setter also installs the C++ hook, as registering does
    return True


def _keep_hooks(wrapped, fsdp_param, args, kwargs):
    original = wrapped.argument("param")
    result = wrapped(*args, **kwargs)
    if take_over_hooks(original, vars(fsdp_param).get("sharded_param")):
        info = fsdp_param._module_info
        _events.fired(
            NAME,
            f"{len(getattr(original, _HOOKS))} post-accumulate-grad hook(s) dropped at fully_shard: never run",
            f"{type(info.module).__name__}.{info.param_name}",
        )
    return result


PATCH = Patch(
    name=NAME,
    summary="post-accumulate-grad hooks registered before `fully_shard` (optimizer in backward) still run",
    symptom="silent: hooks registered with register_post_accumulate_grad_hook before fully_shard never run "
            "(0 of 18 calls); an optimizer-in-backward model never trains",
    trigger="Tensor.register_post_accumulate_grad_hook on parameters, then fully_shard (optimizer in backward, "
            "per-parameter gradient processing)",
    upstream=("PyTorch PR 129450 (FSDP2 runs the sharded parameter's hooks)", "torchrec PR 4268"),
    # measured 2.13, 2.15; read, not run, 2.8 - 2.12 and 2.14 (the same _init_sharded_param; foreach_reduce
    # runs the sharded parameter's hooks). <2.16: "measured up to 2.15", not "fixed in 2.16".
    affected=">=2.6,<2.16",
    check=_structural_check,
    targets=(Wrap(f"{_PARAM}:FSDPParam.{_INIT}", _keep_hooks, reads=("param",)),),
    changes="each sharded parameter takes over the post-accumulate-grad hooks of the parameter it replaces",
)
