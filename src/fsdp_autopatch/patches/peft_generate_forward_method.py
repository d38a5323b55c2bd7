"""peft_generate_forward_method: ``generate()`` on a PEFT model that is FSDP2's root runs inside the
root's pre-forward and post-forward, as the root's forward does.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/peft_generate_forward_method.md.

Needed here?
    ``FSDPState.init`` takes ``modules`` and registers ``_pre_forward`` / ``_post_forward`` as their
    hooks, ``_pre_forward(module, args, kwargs)`` and ``_post_forward(module, input, output)`` have
    those parameters and ``_pre_forward`` reads ``_training_state``, ``_lazy_init`` sets
    ``_is_root``, ``TrainingState`` has ``IDLE``, and ``register_fsdp_forward_method`` runs a method
    between ``_pre_forward`` and ``_post_forward`` (what this patch does for ``generate``) ->
    needed. Anything else -> unsupported.

The replacement
    A wrapper of ``FSDPState.init`` (``fully_shard``'s call): after torch's method, a module sharded
    alone whose class's ``generate`` is PEFT's own (defined in the ``peft`` package: ``PeftModel``
    and its task classes, ``PeftMixedModel``, the tuner models that define one) and which has no
    ``generate`` of its own instance gets one: at each call it decides, then

    * this module is the root (``_is_root`` True), or nothing is lazily initialized yet (``None``:
      ``generate`` before the first training step; the call makes it the root, as a forward would),
      and its state is idle: ``generate`` runs between the state's ``_pre_forward`` and
      ``_post_forward``, exactly what ``register_fsdp_forward_method`` gives. ``fired`` counts each
      such call where the root unit holds parameters or lazy init had not run;
    * anything else goes to PEFT's ``generate`` as it came: a PEFT model that is not the root (its
      own units unshard as torch does), a call inside the root's forward or inside a method the user
      registered by hand (the state is in FORWARD: the user's ``register_fsdp_forward_method`` wraps
      this one, which then passes through: no double pre-/post-forward, no fire), the patch reverted
      or failed, ``torch.compile`` tracing.

    Left alone: every root whose class's ``generate`` is not PEFT's (a transformers model: its
    ``generate`` calls its own forward), a PEFT tuner model without a ``generate`` of its own (e.g.
    ``LoraModel``, whose ``generate`` is the wrapped model's through ``__getattr__``) as the root.
    Like torch's registration, the instance attribute is a closure (a module pickled whole, which
    FSDP2 does not support anyway, would not pickle).

Call-time isolation
    The install after torch's ``init`` keeps torch's result should it raise (``KEEP_RESULT``). At a
    ``generate`` call our decision runs in ``_isolation.isolated``: should it raise, the patch is
    recorded failed and PEFT's ``generate`` runs as it came (the bug's behaviour). What torch's
    ``_pre_forward`` / ``_post_forward`` and PEFT's ``generate`` raise propagates. No collective of
    ours.
"""

from __future__ import annotations

import functools
from typing import Any

from .. import _compat, _events, _isolation, _patching
from .._spec import Patch, Verdict, Wrap, needed, unsupported

NAME = "peft_generate_forward_method"
_METHOD = "generate"
_WITHOUT = ("RuntimeError: aten.embedding.default got mixed torch.Tensor and DTensor (generate bypasses the "
            "root's forward)")
_LEFT = ": torch left untouched"


def _structural_check() -> Verdict:
    state = _compat.fsdp_class("_fsdp_state", "FSDPState")
    init, pre, post = (_compat.class_attr(state, name) for name in ("init", "_pre_forward", "_post_forward"))
    if init is None or not _compat.has_parameters(init, "modules") or not _compat.reads_names(
            init, "_pre_forward", "_post_forward"):
        return unsupported(f"FSDPState.init(modules, ...) does not register _pre_forward / _post_forward{_LEFT}")
    if pre is None or post is None or not (_compat.has_parameters(pre, "module", "args", "kwargs")
                                           and _compat.has_parameters(post, "module", "input", "output")):
        return unsupported(f"FSDPState._pre_forward(module, args, kwargs) / _post_forward(module, input, output) "
                           f"not found{_LEFT}")
    lazy_init = _compat.class_attr(state, "_lazy_init")
    if not _compat.reads_names(pre, "_training_state") or lazy_init is None or not _compat.reads_names(
            lazy_init, "_is_root"):
        return unsupported(f"FSDPState keeps no _training_state / _is_root{_LEFT}")
    if not hasattr(_compat.fsdp_class("_fsdp_common", "TrainingState"), "IDLE"):
        return unsupported(f"TrainingState has no IDLE{_LEFT}")
    register = getattr(_compat.fsdp_module("_fully_shard"), "register_fsdp_forward_method", None)
    method = _compat.nested_code(register, "wrapped_method") if register is not None else None
    if method is None or not {"_pre_forward", "_post_forward"} <= set(method.co_names):
        return unsupported(f"register_fsdp_forward_method does not run a method between _pre_forward and "
                           f"_post_forward{_LEFT}")
    return needed("FSDP2 runs its pre-/post-forward around forward only: a PEFT root's generate calls the "
                  "wrapped model's generate and forward, never the root's")


# --- at fully_shard ------------------------------------------------------------------------------


def peft_generate(module: Any) -> Any:
    """The function ``module.generate`` would call when it is PEFT's own (defined in the ``peft``
    package; every one calls the wrapped model's ``generate``) and the instance has none of its
    own; None otherwise."""
    func = _compat.class_attr(type(module), _METHOD)
    owner = getattr(func, "__module__", None) or ""
    if not callable(func) or not (owner == "peft" or owner.startswith("peft.")):
        return None
    return None if _METHOD in vars(module) else func


def _install_on_peft_module(wrapped, state, args, kwargs):
    modules = tuple(wrapped.argument("modules"))
    result = wrapped(*args, **kwargs)
    if len(modules) == 1:  # a group (fully_shard([a, b])) is never the root
        generate = peft_generate(modules[0])
        if generate is not None:
            install(modules[0], state, generate)
    return result


def install(module: Any, state: Any, generate: Any) -> None:
    """Give ``module`` an instance ``generate`` that runs PEFT's ``generate`` (``generate``, its
    class's function) inside ``state``'s pre-/post-forward where :func:`route` says so."""

    # while Dynamo traces a generate() (a compiled caller): torch's, as it came
    routed = _isolation.aside_while_compiling(lambda: _isolation.isolated(NAME, route, module, state))

    def root_generate(*args: Any, **kwargs: Any) -> Any:
        through = routed()
        if through is None:
            return generate(module, *args, **kwargs)
        args, kwargs = through._pre_forward(module, args, kwargs)
        output = generate(module, *args, **kwargs)
        return through._post_forward(module, args, output)

    functools.update_wrapper(root_generate, generate, assigned=("__module__", "__name__", "__qualname__", "__doc__"),
                             updated=())
    root_generate.__fsdp_autopatch_patch__ = NAME  # type: ignore[attr-defined]
    setattr(module, _METHOD, root_generate)


# --- at generate ---------------------------------------------------------------------------------


def is_active() -> bool:
    """Whether the instance ``generate``s route: the patch is applied and did not fail at call time."""
    return _patching.in_force(NAME)


def route(module: Any, state: Any) -> Any:
    """The state to run this ``generate`` call inside (the root's), or None: leave it to torch."""
    if not is_active():
        return None
    if not isinstance(module, _compat.fsdp_class("_fully_shard", "FSDPModule")):
        return None  # fully_shard failed after FSDPState.init: not an FSDP2 module
    if state._is_root is False:
        _events.left_to_torch(NAME, "not the root", f"generate() of {type(module).__name__}, which is not FSDP2's "
                              "root, runs as torch runs it (register_fsdp_forward_method on it by hand if it fails)")
        return None
    idle = _compat.fsdp_class("_fsdp_common", "TrainingState").IDLE
    if state._training_state != idle:  # inside the root's forward, or a method registered by hand
        return None
    if state._is_root is None or any(group.fsdp_params for group in _compat.state_param_groups(state)):
        _events.fired(NAME, _WITHOUT, type(module).__name__)
    return state


PATCH = Patch(
    name=NAME,
    summary="`generate()` on a PEFT model that is FSDP2's root runs inside the root's pre-/post-forward",
    symptom="RuntimeError: aten.embedding.default got mixed torch.Tensor and DTensor, need to convert all "
            "torch.Tensor to DTensor before calling distributed operators!",
    trigger="fully_shard applied to a PeftModel (the root, as TRL / Accelerate do) and generate() called on it, "
            "before or after the first training step, without register_fsdp_forward_method(model, 'generate')",
    upstream=("TRL issue 4550", "PyTorch PR 125394 (register_fsdp_forward_method)"),
    # measured 2.8 - 2.15 (2.15 in CI's matrix row). <2.16 means "measured up to 2.15", not "fixed in
    # 2.16": on a later release the check decides. 2.6, 2.7: the same API (PR 125394, 2.4), not run.
    affected=">=2.6,<2.16",
    check=_structural_check,
    targets=(Wrap(f"{_compat.FSDP2_PACKAGE}._fsdp_state:FSDPState.init", _install_on_peft_module,
                  reads=("modules",)),),
    changes="a PEFT model sharded as a unit gets a generate() that runs inside FSDP2's pre-/post-forward where it "
            "is the root",
)
