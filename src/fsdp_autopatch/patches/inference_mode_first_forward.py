"""inference_mode_first_forward: an evaluation under ``torch.inference_mode()`` before the first
training step no longer breaks training.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/inference_mode_first_forward.md.

Needed here?
    ``FSDPParam.init_all_gather_outputs`` creates ``all_gather_outputs`` with ``torch.empty`` and
    does not turn inference mode off, ``FSDPParam.init_unsharded_param`` builds the
    ``nn.Parameter`` into ``_unsharded_param``, and the all-gather copy-out creates the buffers
    through ``init_all_gather_outputs`` (``foreach_all_gather_copy_out``; from 2.15 its default
    ``_default_all_gather_output_fn``) -> needed. ``init_all_gather_outputs`` names
    ``inference_mode`` / ``is_inference_mode_enabled`` itself -> not_needed (conclusive). Anything
    else -> unsupported.

The replacement
    Wrappers of ``FSDPParam.init_all_gather_outputs`` and ``FSDPParam.init_unsharded_param``: when
    inference mode is on (``torch.is_inference_mode_enabled()``), torch's method runs under
    ``torch.inference_mode(False)`` and ``torch.no_grad()``, exactly the mode of the same unshard
    under ``torch.no_grad()``; the buffers and the parameter are normal tensors, the forward's values
    are the same, and later steps equal the run that evaluated under ``no_grad``. Outside inference
    mode (every training step, every evaluation after the first unshard, which reuses the buffers)
    the wrappers call torch's method as it came. Under ``torch.compile`` tracing they step aside.

    ``fired``: once per parameter whose all-gather outputs were created under inference mode (the
    count of buffers that would have been inference tensors).

    What else the first forward creates under inference mode, and why it is left to torch: the
    flat all-gather buffer and the copy-in inputs (new per unshard, only read), the post-forward
    shard of ``reshard_after_forward=<int>`` (made anew at every post-forward, freed at the next
    unshard, only read), CPU offload's device copies of the shards (new per unshard, only read).
    Reduce-scatter and all-reduce buffers are made in backward, never under inference mode.
    ``FSDPParam.reset_sharded_param`` in the root's lazy init re-pads a shard only if its local
    tensor was replaced without FSDP2's own load / ``_apply`` hooks, which already re-pad it.

Call-time isolation
    Our code before torch's method (the mode and the buffers read) falls back to torch's method as
    it came (the bug's behaviour); the fire count after it keeps torch's result (``KEEP_RESULT``).
    What torch's method raises propagates. No collective of ours.
"""

from __future__ import annotations

from typing import Any

from .. import _compat, _events
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

NAME = "inference_mode_first_forward"
_PARAM = f"{_compat.FSDP2_PACKAGE}._fsdp_param"
_OUTPUTS = "init_all_gather_outputs"
_UNSHARDED = "init_unsharded_param"
# the copy-out that calls _OUTPUTS: 2.15 moved it into the default all_gather_output_fn
_COPY_OUTS = ("foreach_all_gather_copy_out", "_default_all_gather_output_fn")
_TORCH_TURNS_IT_OFF = ("inference_mode", "is_inference_mode_enabled")
_WITHOUT = ("RuntimeError: Inplace update to inference tensor outside InferenceMode is not allowed "
            "(at the first training step)")
_LEFT = ": torch left untouched"


def names_in(func: Any) -> set[str]:
    """The names and string constants of torch's function behind any wrappers, nested code objects
    (comprehensions, lambdas) included: Python 3.11 compiles a list comprehension on its own."""
    pending, seen = [_compat.code_of(func)], set()
    while pending:
        code = pending.pop()
        if code is None:
            continue
        seen.update(code.co_names)
        for const in code.co_consts:
            if isinstance(const, str):
                seen.add(const)
            elif isinstance(const, type(code)):
                pending.append(const)
    return seen


def check_fsdp_param(cls: type, copy_outs: tuple[Any, ...]) -> Verdict:
    """The structural verdict for an ``FSDPParam`` class and the copy-out functions found (torch's,
    or stand-ins in the tests)."""
    outputs, unsharded = _compat.class_attr(cls, _OUTPUTS), _compat.class_attr(cls, _UNSHARDED)
    if outputs is None or unsharded is None:
        return unsupported(f"FSDPParam has no {_OUTPUTS} / {_UNSHARDED}{_LEFT}")
    created = names_in(outputs)
    if created & set(_TORCH_TURNS_IT_OFF):
        return not_needed(f"FSDPParam.{_OUTPUTS} handles inference mode itself", conclusive=True)
    if not {"all_gather_outputs", "empty"} <= created:
        return unsupported(f"FSDPParam.{_OUTPUTS} does not create all_gather_outputs with torch.empty{_LEFT}")
    if not _compat.reads_names(unsharded, "_unsharded_param", "Parameter"):
        return unsupported(f"FSDPParam.{_UNSHARDED} does not build an nn.Parameter into _unsharded_param{_LEFT}")
    if not any(_compat.reads_names(copy_out, _OUTPUTS) for copy_out in copy_outs):
        return unsupported(f"the all-gather copy-out does not create the buffers through FSDPParam.{_OUTPUTS}{_LEFT}")
    return needed(
        f"FSDPParam.{_OUTPUTS} / {_UNSHARDED} create the buffers every later unshard reuses in the first "
        "unshard's autograd mode: inference tensors under inference_mode"
    )


def _structural_check() -> Verdict:
    collectives = _compat.fsdp_module("_fsdp_collectives")
    copy_outs = tuple(getattr(collectives, name) for name in _COPY_OUTS if hasattr(collectives, name))
    return check_fsdp_param(_compat.fsdp_class("_fsdp_param", "FSDPParam"), copy_outs)


def _strikes() -> bool:
    """Whether this call runs in inference mode."""
    import torch

    return torch.is_inference_mode_enabled()


def _mode_off(wrapped, args, kwargs):
    """Torch's method in the mode the same call has under ``torch.no_grad()``."""
    import torch

    with torch.inference_mode(False), torch.no_grad():
        return wrapped(*args, **kwargs)


def _create_outputs(wrapped, fsdp_param, args, kwargs):
    if not _strikes():
        return wrapped(*args, **kwargs)
    before = fsdp_param.all_gather_outputs
    result = _mode_off(wrapped, args, kwargs)
    if fsdp_param.all_gather_outputs is not before:
        _events.fired(NAME, _WITHOUT, str(getattr(fsdp_param, "_param_fqn", None) or fsdp_param))
    return result


def _create_unsharded(wrapped, fsdp_param, args, kwargs):
    if not _strikes():
        return wrapped(*args, **kwargs)
    return _mode_off(wrapped, args, kwargs)


PATCH = Patch(
    name=NAME,
    summary="an evaluation under `torch.inference_mode()` before the first training step does not break training",
    symptom="RuntimeError: Inplace update to inference tensor outside InferenceMode is not allowed.",
    trigger="the first forward (the first unshard) of an FSDP2 model runs under torch.inference_mode(): "
            "an evaluation or rollout before the first training step",
    upstream=("PyTorch PR 197327 (a different inference-mode crash)", "PyTorch PR 146709"),
    # measured 2.13, 2.15; read, not run, 2.6 - 2.12 and 2.14 (the same two methods).
    # <2.16 means "measured up to 2.15", not "fixed in 2.16": on a later release the check decides.
    affected=">=2.6,<2.16",
    check=_structural_check,
    targets=(
        Wrap(f"{_PARAM}:FSDPParam.{_OUTPUTS}", _create_outputs),
        Wrap(f"{_PARAM}:FSDPParam.{_UNSHARDED}", _create_unsharded),
    ),
    changes="the all-gather outputs and unsharded parameters are created with inference mode off",
)
