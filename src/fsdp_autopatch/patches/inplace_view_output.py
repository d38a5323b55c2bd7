"""inplace_view_output: a unit's output that is a view survives an in-place op by the caller.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/inplace_view_output.md.

Needed here?
    ``FSDPState._register_pre_backward_hook(output)``'s source registers ``self._pre_backward``
    with ``<tensor>.register_hook`` on the output tensors, and ``FSDPState._pre_backward`` sets
    ``_training_state`` to ``TrainingState.PRE_BACKWARD`` (what our hook reads to stay a no-op
    once torch's has run) -> needed. A torch that hooks ``<tensor>._base`` itself -> not_needed
    (conclusive). No source, another shape -> unsupported.

The replacement
    A wrapper of ``FSDPState._register_pre_backward_hook``. After torch's body, for each output
    tensor it hooked that is a view (``t._base`` set) whose base requires grad, is not a leaf and
    is not itself an output, the base gets a hook of ours too (once per base per call). An in-place
    op on the view reroutes the gradient around the view's node but still through the base's old
    node, which is where the base's hook sits; that node comes after the view's in backward. So:
    torch's hook on the view runs first (no in-place op): ours sees the state in ``PRE_BACKWARD``
    and does nothing. Torch's hook was bypassed: ours finds the state not yet in ``PRE_BACKWARD``
    and runs torch's own ``state._pre_backward`` (unshard, prefetch, final callback), before the
    base's node reads the weight. The output is never copied (no memory, aliasing kept); the
    gradient is never changed; outputs that are not views get nothing. Leaf bases (a view of a
    parameter or of a leaf input) are left alone.

    ``fired``: once per unit and backward where torch's hook was bypassed (our hook ran
    ``_pre_backward``): the count of unshards that would have been missing. Registering the hooks
    counts nothing.

    Left to torch: a unit called twice before one backward whose second call's output is such a
    view (the state is already in ``PRE_BACKWARD`` from the first call's backward: our hook stays
    a no-op, the error as without the patch).

Call-time isolation
    The wrapper's work runs after torch's body; should it raise, torch's output is returned
    without the base hooks (``KEEP_RESULT``: the bug's behaviour). The hook runs our check
    isolated (``_isolation.isolated``); torch's ``_pre_backward`` inside it runs as torch's
    (``torch_call``), so its errors (a failing all-gather) reach the user. No collective of ours.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings
from typing import Any

from .. import _compat, _events, _hiding, _isolation
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

NAME = "inplace_view_output"
_STATE = f"{_compat.FSDP2_PACKAGE}._fsdp_state"
_REGISTER = "_register_pre_backward_hook"
_HOOK = "_pre_backward"
_WITHOUT = "RuntimeError: setStorage: ... out of bounds for storage of size 0 (pre-backward hook of a view dropped)"

# how torch's _register_pre_backward_hook hooks its outputs (_hooked_receivers)
ON_TENSOR = "on the output tensor"
ON_BASE = "on the output's base"



def _hooked_receivers(source: str) -> set[str]:
    """Where ``<x>.register_hook(self._pre_backward)`` calls in ``source`` put the hook."""
    found = set()
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register_hook" and len(node.args) == 1):
            continue
        arg, receiver = node.args[0], node.func.value
        if not (isinstance(arg, ast.Attribute) and arg.attr == _HOOK):
            continue
        if isinstance(receiver, ast.Attribute) and receiver.attr == "_base":
            found.add(ON_BASE)
        elif isinstance(receiver, ast.Name):
            found.add(ON_TENSOR)
    return found


def _structural_check() -> Verdict:
    module = _compat.fsdp_module("_fsdp_state")
    state_cls = getattr(module, "FSDPState", None)
    register = _compat.class_attr(state_cls, _REGISTER) if state_cls is not None else None
    pre_backward = _compat.class_attr(state_cls, _HOOK) if state_cls is not None else None
    if register is None or pre_backward is None or not _compat.has_parameters(register, "output"):
        return unsupported(f"FSDPState has no {_REGISTER}(output) / {_HOOK}: torch left untouched")
    if not hasattr(_compat.fsdp_module("_fsdp_common").TrainingState, "PRE_BACKWARD"):
        return unsupported("TrainingState has no PRE_BACKWARD: torch left untouched")
    if not _compat.reads_names(pre_backward, "_training_state", "PRE_BACKWARD"):
        return unsupported(f"FSDPState.{_HOOK} does not set _training_state to PRE_BACKWARD: torch left untouched")
    try:
        receivers = _hooked_receivers(inspect.getsource(_compat.innermost(register)))
    except (OSError, TypeError, SyntaxError):
        return unsupported(f"FSDPState.{_REGISTER}'s source is not available: torch left untouched")
    if ON_BASE in receivers:
        return not_needed(f"FSDPState.{_REGISTER} hooks an output view's base itself", conclusive=True)
    if receivers != {ON_TENSOR}:
        return unsupported(f"FSDPState.{_REGISTER} does not hook each output tensor: torch left untouched")
    return needed(
        f"FSDPState.{_REGISTER} hooks each output tensor's own node: an in-place op on an output view "
        "reroutes the gradient around it"
    )


def _grad_tensors(output: Any) -> list[Any]:
    """The tensors torch hooked: its own collector where the module has one (2.13+), else the
    flattened output's grad-requiring tensors (what 2.6 - 2.12 iterate)."""
    import torch

    collect = getattr(_compat.fsdp_module("_fsdp_state"), "collect_grad_tensors", None)
    if collect is not None:
        return list(collect(output))
    leaves = torch.utils._pytree.tree_leaves(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def bases_to_hook(tensors: list[Any]) -> list[Any]:
    """The bases of the output views that need a hook: non-leaf, requiring grad, not an output
    themselves (torch hooked those), each once."""
    hooked = {id(t) for t in tensors}
    bases: dict[int, Any] = {}
    for t in tensors:
        base = t._base
        if base is None or not base.requires_grad or base.is_leaf or id(base) in hooked:
            continue
        bases.setdefault(id(base), base)
    return list(bases.values())


def _modules_of(state: Any) -> str:
    return ", ".join(type(module).__name__ for module in getattr(state, "_modules", ())) or "?"


def _bypassed(state: Any) -> bool:
    """Whether torch's own hook has not run for this state in this backward."""
    pre_backward = _compat.fsdp_module("_fsdp_common").TrainingState.PRE_BACKWARD
    return state._training_state != pre_backward


def _base_hook(state: Any) -> Any:
    def hook(grad):  # returns None: the gradient goes on unchanged
        if _isolation.isolated(NAME, _bypassed, state):
            _events.fired(NAME, _WITHOUT, _modules_of(state))
            _isolation.torch_call(state._pre_backward, grad)

    return _hiding.hidden(hook)  # [Note: hidden as torch hides]: not a frame Dynamo compiles


# torch's warning for a view output (PyTorch PR 181850): true without this patch, false for the
# views it covers (a non-leaf base, hooked below); kept where some view is left to torch
_TORCH_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


def _all_views_covered(tensors: list[Any], bases: list[Any]) -> bool:
    covered = {id(t) for t in tensors} | {id(b) for b in bases}
    return all(t._base is None or id(t._base) in covered for t in tensors)


def _hook_view_bases(wrapped, state, args, kwargs):
    import torch

    tensors = _grad_tensors(wrapped.argument("output")) if torch.is_grad_enabled() else []
    bases = bases_to_hook(tensors)
    with warnings.catch_warnings():
        if bases and _all_views_covered(tensors, bases):
            warnings.filterwarnings("ignore", message=_TORCH_VIEW_WARNING, category=UserWarning)
        output = wrapped(*args, **kwargs)
    for base in bases:
        base.register_hook(_base_hook(state))
    return output


PATCH = Patch(
    name=NAME,
    summary="a unit's output view modified in place by the caller (`logits.div_(T)`) still unshards for backward",
    symptom="RuntimeError: setStorage: ... out of bounds for storage of size 0",
    trigger="a unit's forward returns a view (transpose, view, slicing; nn.Linear on 3-D before 2.15) "
            "and the caller modifies it in place",
    upstream=("PyTorch issue 181832", "PyTorch PR 181850", "PyTorch PR 194077", "Megatron-LM clone_output_views"),
    # measured 2.13, 2.15; read, not run, 2.6 - 2.12 (the same tensor hook per output).
    # <2.16 means "measured up to 2.15", not "fixed in 2.16": on a later release the check decides.
    affected=">=2.6,<2.16",
    check=_structural_check,
    targets=(Wrap(f"{_STATE}:FSDPState.{_REGISTER}", _hook_view_bases, reads=("output",)),),
    changes="the non-leaf base of each output view also runs the unit's pre-backward hook, once torch's is bypassed",
)
