"""clip_grad_norm_multi_mesh: ``clip_grad_norm_`` over gradients on several DeviceMeshes.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/clip_grad_norm_multi_mesh.md.

Needed here?
    ``clip_grad._get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)`` and
    ``_clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)`` exist,
    ``clip_grad_norm_`` calls both, and ``_get_total_norm`` stacks norms grouped by
    ``_group_tensors_by_device_and_dtype`` -> needed. ``_get_total_norm`` reading
    ``full_tensor`` or a name with ``mesh`` (torch's own fix) -> not needed. Else unsupported.

The replacement
    ``_get_total_norm`` / ``_clip_grads_with_norm_`` are replaced in ``torch.nn.utils.clip_grad``
    (``clip_grad_norm_`` looks them up there at every call, so every reference to it, even one
    imported before this patch, takes the fix) and under their public names
    ``torch.nn.utils.get_total_norm`` / ``clip_grads_with_norm_``, by plain functions around
    torch's (``functools.wraps``), not wrapt proxies: ``torch.compile`` traces the user code that
    calls them, and dynamo fails on a proxy's ``__closure__`` guard. Tensors whose DTensors share one
    mesh (or that hold no DTensor) go to torch unchanged, the same objects. Otherwise they are split
    in first-appearance order (the same on every rank) into one group per mesh plus the plain
    tensors; torch's function computes each group's norm (a DTensor's made plain by
    ``full_tensor()``, a collective over its mesh) and the total is
    ``vector_norm(stack(group norms), p)`` (the norm of norms composes for every p but 0, where
    torch's norm of per-tensor norms counts the tensors that have a non-zero entry: the groups'
    counts are summed); ``error_if_nonfinite`` raises torch's own message.
    Clipping runs torch's ``_clip_grads_with_norm_`` per group with that (plain) total. The total
    returned on this path is a plain tensor, the same on every rank.

Call-time isolation
    The arguments the wrappers read (``tensors``, ``norm_type``, ``error_if_nonfinite``;
    ``parameters``, ``total_norm``) are bound by name; every other one (``foreach``, PyTorch PR
    194033's ``dtype``) is forwarded unchanged to torch's function, on one mesh and to each per-mesh
    call. Should our code raise in the total norm, torch's ``_get_total_norm`` is called again with
    the caller's arguments (a pure function; on several meshes that gives torch's own error); in
    the clipping, every group is computed before torch scales the first, so nothing of ours runs
    between torch's calls. The ``full_tensor()`` of each group's norm is a collective over that
    group's mesh, issued in the same order on every rank.
"""

from __future__ import annotations

import sys

import torch

from .. import _compat, _events, _isolation
from .._spec import CALL_AGAIN, KEEP_RESULT, TRACED, Patch, Verdict, Wrap, needed, not_needed, unsupported

_CLIP = "torch.nn.utils.clip_grad"
_UTILS = "torch.nn.utils"
_TOTAL_READS = ("tensors", "norm_type", "error_if_nonfinite")  # what the wrappers read, by name
_CLIP_READS = ("parameters", "total_norm")


def _structural_check() -> Verdict:
    import torch.nn.utils.clip_grad as clip

    # The parameters the wrappers read are checked by name from the targets' ``reads``
    # (``_patching.contract_problem``); any other parameter (PyTorch PR 194033's ``dtype``) is
    # forwarded to torch's function on every path, per-mesh groups included.
    total, scale = getattr(clip, "_get_total_norm", None), getattr(clip, "_clip_grads_with_norm_", None)
    if not _compat.has_parameters(total, *_TOTAL_READS) or not _compat.has_parameters(scale, *_CLIP_READS):
        return unsupported(
            f"clip_grad._get_total_norm({', '.join(_TOTAL_READS)}, ...) / "
            f"_clip_grads_with_norm_({', '.join(_CLIP_READS)}, ...) not found"
        )
    if not _compat.reads_names(getattr(clip, "clip_grad_norm_", None), "_get_total_norm", "_clip_grads_with_norm_"):
        return unsupported("clip_grad_norm_ does not call _get_total_norm and _clip_grads_with_norm_")
    names = _compat.names_read(_compat.code_of(total))
    if "full_tensor" in names or any("mesh" in name for name in names):
        return not_needed("_get_total_norm handles DeviceMeshes itself", conclusive=True)
    if not _compat.reads_names(total, "stack", "_group_tensors_by_device_and_dtype"):
        return unsupported("_get_total_norm does not stack norms grouped by (device, dtype)")
    return needed("_get_total_norm stacks per-gradient norms grouped by (device, dtype), not by DeviceMesh")


def _mesh_groups(tensors):
    """Indices per DeviceMesh (first-appearance order), then the plain ones; None for one mesh."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    if dtensor is None:
        return None  # no DTensor can exist before torch.distributed.tensor is imported
    meshes, groups, plain = [], [], []
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, dtensor):
            plain.append(index)
            continue
        mesh = tensor.device_mesh
        position = next((i for i, known in enumerate(meshes) if mesh is known or mesh == known), None)
        if position is None:
            meshes.append(mesh)
            groups.append([index])
        else:
            groups[position].append(index)
    return groups + ([plain] if plain else []) if len(meshes) > 1 else None


def _plain(tensor):
    # full_tensor() is a collective over the DTensor's mesh: what it raises is torch's
    return _isolation.torch_call(tensor.full_tensor) if hasattr(tensor, "full_tensor") else tensor


def _as_list(wrapped, name):
    """The argument ``name`` as a list: an iterator is read once, and torch (and any fallback)
    then gets the list read here, not the spent iterator. None for a single tensor."""
    value = wrapped.argument(name)
    if isinstance(value, torch.Tensor):
        return None
    if not isinstance(value, (list, tuple)):
        value = list(value)
        wrapped.rebind(**{name: value})
    return value


def _total_norm_across_meshes(wrapped, instance, args, kwargs):
    tensors = _as_list(wrapped, "tensors")
    groups = _mesh_groups(tensors) if tensors is not None else None
    if groups is None:
        return wrapped.again()  # the caller's arguments, every one as it came
    _fired("the total norm", len(tensors), groups)
    norm_type = wrapped.argument("norm_type")
    with torch.no_grad():
        device = tensors[0].device
        subsets = [[tensors[i] for i in group] for group in groups]
        # each group through torch's own function, every other argument (foreach, dtype) as given
        norms = [_plain(wrapped.again(tensors=subset, error_if_nonfinite=False)) for subset in subsets]
        norms = [norm.to(device) for norm in norms]
        total = _norm_of_group_norms(torch.stack(norms), float(norm_type))
        if wrapped.argument("error_if_nonfinite") and torch.logical_or(total.isnan(), total.isinf()):
            wrapped.again(tensors=[total], error_if_nonfinite=True)  # raises torch's own message
    return total


def _norm_of_group_norms(norms, norm_type: float):
    """What torch's norm of the per-tensor norms gives, from the per-group norms it computed."""
    if norm_type == 0.0:  # a group's 0-"norm" counts its tensors with a non-zero entry
        return norms.sum()
    return torch.linalg.vector_norm(norms, norm_type)


def _clip_across_meshes(wrapped, instance, args, kwargs):
    parameters = _as_list(wrapped, "parameters")
    with_grad = [p for p in parameters if p.grad is not None] if parameters is not None else []
    groups = _mesh_groups([p.grad for p in with_grad]) if with_grad else None
    if groups is None:
        return wrapped.again()
    _fired("the clipping", len(with_grad), groups)
    with torch.no_grad():
        total_norm = _plain(wrapped.argument("total_norm"))
        # Everything of ours is computed before torch scales the first group: once torch has
        # scaled a group, nothing of ours can fail and leave the others unscaled.
        subsets = [[with_grad[i] for i in group] for group in groups]
        for subset in subsets:
            wrapped.again(parameters=subset, total_norm=total_norm)
    return None


def _fired(what: str, count: int, groups) -> None:
    _events.fired(
        "clip_grad_norm_multi_mesh",
        "RuntimeError: All operands in aten.stack.default must have the same mesh",
        f"{what} of {count} gradients in {len(groups)} groups (one per DeviceMesh, then plain tensors)",
    )


def _public(name):
    return lambda: hasattr(sys.modules.get(_UTILS), name)


def _replace(path: str, wrapper, reads, when=None, after_torch=KEEP_RESULT) -> Wrap:
    """A plain function in place of torch's, not a wrapt proxy: ``torch.compile`` traces user code
    that calls these functions, and dynamo's guard on a proxy's ``__closure__`` fails ("Guard
    failed on the same frame it was created"); a plain function is traced like torch's own."""
    return Wrap(path, wrapper, when=when, reads=reads, proxy=False, after_torch=after_torch, dynamo=TRACED)


PATCH = Patch(
    name="clip_grad_norm_multi_mesh",
    summary="clip_grad_norm_ works over gradients on several DeviceMeshes (experts + dense, HSDP + 1-D)",
    symptom="RuntimeError: All operands in aten.stack.default must have the same mesh",
    trigger="clip_grad_norm_ / get_total_norm over FSDP2 gradients sharded on two or more meshes",
    upstream=("PyTorch issue 180346", "PyTorch PR 180501"),
    # measured: every release 2.8 - 2.15 fails; 2.6 and 2.7 not read (structural check decides).
    # <2.16 means "measured up to 2.15", not "fixed in 2.16": on a later release the check decides.
    affected=">=2.8,<2.16",
    check=_structural_check,
    # the public names are the same functions bound under other names: each needs its own target
    # The public names are the same functions bound under other names: each needs its own target.
    # If our code raises after torch ran: the total norm is computed again by torch (a pure
    # function); the clipping keeps torch's result (nothing of ours runs between its groups).
    targets=(
        _replace(f"{_CLIP}:_get_total_norm", _total_norm_across_meshes, _TOTAL_READS, after_torch=CALL_AGAIN),
        _replace(f"{_CLIP}:_clip_grads_with_norm_", _clip_across_meshes, _CLIP_READS),
        _replace(f"{_UTILS}:get_total_norm", _total_norm_across_meshes, _TOTAL_READS,
                 when=_public("get_total_norm"), after_torch=CALL_AGAIN),
        _replace(f"{_UTILS}:clip_grads_with_norm_", _clip_across_meshes, _CLIP_READS,
                 when=_public("clip_grads_with_norm_")),
    ),
    changes="multi-mesh gradients are normed and clipped per mesh, then combined",
    # its wrapper sits outside clip_grad_norm_cpu_offload's: each per-mesh total it asks for is
    # reduced on that mesh's device there (CPU-offloaded gradients on an NCCL-only group)
    after=("clip_grad_norm_cpu_offload",),
)
