"""grouped_module_reuse: a grouped unit's repeat call inside the root's forward gets a pre-backward hook.

The bug
    A grouped unit ``fully_shard([norm, head])`` whose ``head`` runs again later in the same root
    forward (an MTP-style auxiliary head), with that output kept on a module attribute instead of
    returned. The repeat call starts a new pass of the group that never completes, so it takes the
    group's partial post-forward path (output-dtype cast only: no reshard, no pre-backward hook).
    The root's post-forward then force-completes the group (``_force_complete_incomplete_states``):
    it reshards it and registers its pre-backward hook on the root's output only. Autograd reaches
    the repeat call's backward first (its nodes are newer) and reads the freed unsharded weight,
    on every rank::

        RuntimeError: setStorage: sizes [4, 8], strides [8, 1], storage offset 0, and itemsize 4
        requiring a storage size of 128 are out of bounds for storage of size 0

    Upstream: PyTorch issue 183702 (open); the force-complete comes from PyTorch PR 180428.

Torch versions
    Measured on 2 gloo ranks: fails on 2.13, 2.14 and 2.15; right on 2.8 - 2.12, which predate
    the force-complete (PyTorch PR 180428): a partial group stays unsharded until backward there.
    2.6 and 2.7 predate it too (not run: FSDP2 does not run on gloo before 2.8).

Needed here?
    ``_fsdp_state._register_group_forward_hooks(modules, pre_hook, post_hook, modules_to_run,
    cast_output_dtype)`` exists, ``FSDPState._post_forward`` calls
    ``_force_complete_incomplete_states``, and the group post-hook's partial path reads nothing
    but ``remove`` / ``len`` -> needed. No ``_force_complete_incomplete_states`` (2.6 - 2.12)
    -> not needed, conclusively. A partial path that does more -> not needed (torch changed it).
    Anything else -> unsupported.

The replacement
    ``_register_group_forward_hooks`` is wrapped: torch registers its own hooks, around three small
    functions in place of the ``pre_hook`` / ``post_hook`` / ``cast_output_dtype`` it receives. On
    the partial path, inside another state's root forward, the autograd nodes of the output are
    remembered; a call that completes the group forgets them (torch hooks the completing output);
    a new pass forgets stale ones. ``FSDPState._force_complete_incomplete_states`` is wrapped: after
    torch's body, each remembered node of a force-completed state that is not the node of a root
    output gets a node pre-hook running the state's ``_pre_backward`` (what the tensor hook a
    single-module unit puts on every call's output does). Nothing else changes: single-module
    units, groups that complete in the forward and calls outside a root forward (chunked loss)
    are never hooked.

Disable with ``FSDP_AUTOPATCH_GROUPED_MODULE_REUSE_ENABLED=0``.
"""

from __future__ import annotations

import weakref

import torch

from .. import _compat, _events
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

_STATE = f"{_compat.FSDP2_PACKAGE}._fsdp_state"
_FORCE_COMPLETE = "_force_complete_incomplete_states"
_GROUP_HOOK_PARAMETERS = ("modules", "pre_hook", "post_hook", "modules_to_run", "cast_output_dtype")
# torch's partial path removes the module from the set and compares its length, nothing else
_PARTIAL_PATH_NAMES = {"remove", "len"}
_PARTIAL_PATH_FREEVARS = {"cast_output_dtype", "module", "modules_to_run", "post_hook"}
_WITHOUT = "RuntimeError: setStorage: ... out of bounds for storage of size 0 in backward"

# FSDPState -> autograd nodes of partial-path outputs made inside another state's root forward.
# Keyed by state, so ranks sharing a process (threaded process groups) never see each other's;
# emptied when the group completes, when the root force-completes it, or at the group's next pass.
_remembered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _structural_check() -> Verdict:
    state_module = _compat.fsdp_module("_fsdp_state")
    state_class = state_module.FSDPState
    force = _compat.class_attr(state_class, _FORCE_COMPLETE)
    if force is None:
        reason = f"no FSDPState.{_FORCE_COMPLETE}: a partial group stays unsharded until backward"
        return not_needed(reason, conclusive=True)
    group_hooks = getattr(state_module, "_register_group_forward_hooks", None)
    if group_hooks is None or _compat.first_parameters(group_hooks, 5) != _GROUP_HOOK_PARAMETERS:
        return unsupported("_register_group_forward_hooks(..., cast_output_dtype) not found")
    if not _compat.reads_names(force, "_modules_to_run_forward", "post_forward"):
        return unsupported(f"FSDPState.{_FORCE_COMPLETE} differs from the measured releases")
    if not _compat.reads_names(_compat.class_attr(state_class, "_post_forward"), _FORCE_COMPLETE):
        return unsupported("FSDPState._post_forward does not force-complete incomplete groups")
    partial = _compat.nested_code(group_hooks, "wrapped_post_hook")
    if partial is None or set(partial.co_freevars) != _PARTIAL_PATH_FREEVARS:
        return unsupported("the group post-hook differs from the measured releases")
    if not set(partial.co_names) <= _PARTIAL_PATH_NAMES:
        return not_needed("the group post-hook's partial path does more than cast the output")
    return needed("a grouped unit's partial post-forward registers no pre-backward hook; the root force-completes it")


def _grad_nodes(output) -> list:
    """The autograd nodes of the grad-requiring tensors in ``output``, found the way torch finds
    the tensors it hooks (``collect_grad_tensors``: dict, list, tuple, NamedTuple, dataclass)."""
    collect = getattr(_compat.fsdp_module("_fsdp_state"), "collect_grad_tensors", None)
    if collect is not None:
        tensors = collect(output)
    else:
        tensors = torch.utils._pytree.tree_leaves(output)
    return [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _remember(state, output) -> None:
    # Only inside another state's root forward does a force-complete follow; a call outside it
    # (chunked loss) claims iter_forward_root itself or finds none.
    root = state._state_ctx.iter_forward_root
    if root is None or root is state or not torch.is_grad_enabled():
        return
    nodes = _grad_nodes(output)
    if nodes:  # nodes, not tensors: a consumed output is gone while its node waits for backward
        _remembered.setdefault(state, []).extend(nodes)


def _hook_partial_outputs(wrapped, instance, args, kwargs):
    modules, pre_hook, post_hook, modules_to_run, cast_output_dtype = _group_hook_args(*args, **kwargs)
    state = getattr(post_hook, "__self__", None)  # FSDPState.init hands over its bound _post_forward
    if state is None:
        return wrapped(*args, **kwargs)
    forward = _compat.fsdp_module("_fsdp_common").TrainingState.FORWARD

    def start_pass(*hook_args, **hook_kwargs):
        if state._training_state is not forward:  # a new pass: what an earlier one left is stale
            _remembered.pop(state, None)
        return pre_hook(*hook_args, **hook_kwargs)

    def complete(*hook_args, **hook_kwargs):  # torch hooks the completing output, fed by the pass
        _remembered.pop(state, None)
        return post_hook(*hook_args, **hook_kwargs)

    def cast_and_remember(output):  # the partial path: torch only casts here
        output = cast_output_dtype(output)
        _remember(state, output)
        return output

    return wrapped(modules, start_pass, complete, modules_to_run, cast_and_remember)


def _group_hook_args(modules, pre_hook, post_hook, modules_to_run, cast_output_dtype):
    return modules, pre_hook, post_hook, modules_to_run, cast_output_dtype


def _unshard_before(state):
    def pre_hook(grad_outputs):  # returns nothing: the gradients go on unchanged
        state._pre_backward(grad_outputs[0] if grad_outputs else None)

    return pre_hook


def _hook_remembered_outputs(wrapped, root_state, args, kwargs):
    if not _remembered:
        return wrapped(*args, **kwargs)
    states = root_state._state_ctx.all_states
    incomplete = [s for s in states if s is not root_state and s._modules_to_run_forward]
    output = wrapped(*args, **kwargs)
    hooked = {id(node) for node in _grad_nodes(output)}  # torch hooked the root's output
    for state in incomplete:
        for node in _remembered.get(state, ()):
            if id(node) in hooked:
                continue
            hooked.add(id(node))
            node.register_prehook(_unshard_before(state))
            _events.fired("grouped_module_reuse", _WITHOUT, f"a repeat call of {_modules_of(state)}")
    for state in states:
        _remembered.pop(state, None)
    return output


def _modules_of(state) -> str:
    return ", ".join(type(module).__name__ for module in getattr(state, "_modules", ()))


PATCH = Patch(
    name="grouped_module_reuse",
    summary="a grouped unit's module called again in the root's forward (MTP head) keeps its weights for backward",
    symptom="RuntimeError: setStorage: ... out of bounds for storage of size 0",
    trigger="fully_shard([norm, head]), head called again inside the root's forward, its output not returned",
    upstream=("PyTorch issue 183702", "PyTorch PR 180428"),
    # measured: 2.13 - 2.15 fail, 2.8 - 2.12 right (no force-complete; nor in 2.6, 2.7)
    affected=">=2.13,<2.16",
    check=_structural_check,
    targets=(
        Wrap(f"{_STATE}:_register_group_forward_hooks", _hook_partial_outputs),
        Wrap(f"{_STATE}:FSDPState.{_FORCE_COMPLETE}", _hook_remembered_outputs),
    ),
    changes="repeat calls of a grouped unit inside the root's forward get its pre-backward hook",
)
