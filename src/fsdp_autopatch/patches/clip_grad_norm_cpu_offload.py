"""clip_grad_norm_cpu_offload: ``clip_grad_norm_`` with CPU-offloaded gradients on an NCCL-only group.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/clip_grad_norm_cpu_offload.md.

Needed here?
    ``clip_grad._get_total_norm`` has the parameters it reads, by name (tensors, norm_type,
    error_if_nonfinite, foreach), and every other one has a default (its per-gradient norm loop is
    mirrored below: a parameter torch adds is honoured where it is passed at its default, which
    keeps torch's old behaviour; ``dtype``, PyTorch PR 194033's, is mirrored by name; any other value
    of a parameter the mirror does not know goes to torch), ``clip_grad_norm_`` calls it, it
    groups by ``_group_tensors_by_device_and_dtype``, norms with ``_foreach_norm`` /
    ``vector_norm`` and stacks, and DTensor / DeviceMesh / ProcessGroup have what the wrapper
    reads -> needed. ``_get_total_norm`` reading ``device_mesh`` or ``device_type`` (torch's own
    fix would) -> not needed. Else unsupported.

The replacement
    ``_get_total_norm`` (and its public name ``torch.nn.utils.get_total_norm``) is replaced by a plain
    function (``functools.wraps``; ``torch.compile`` traces these: see ``clip_grad_norm_multi_mesh``).
    It acts only where the bug strikes: every tensor a DTensor on one mesh, and some gradient lives on
    a device type that a process group of that mesh lacks (a mesh dimension of more than one rank
    where the gradient is not replicated), while the groups serve the mesh's own ``device_type``.
    Everything else (gloo, ``"cpu:gloo,cuda:nccl"``, no offload, plain tensors, one rank, several
    meshes: ``clip_grad_norm_multi_mesh``'s) goes to torch unchanged, the same objects: bitwise
    torch's result. Where it acts, torch's steps are run in torch's order with one difference:
    each gradient's norm is computed where the gradient lives (``_foreach_norm`` per (device, dtype)
    group, or ``vector_norm`` each, as torch chooses; with PR 194033's ``dtype``, ``vector_norm(g,
    norm_type, dtype=dtype)`` each and the total in ``dtype``), then only these 0-dim partial norms move to
    the mesh's device (``DTensor.from_local`` of the local value, placements kept), where torch's
    ``stack`` and ``vector_norm`` reduce them (the collective on the mesh's backend). The total is
    made replicated there if it is still partial, and returned on the first gradient's device, where
    torch puts it: a replicated DTensor whose local value is on the CPU, so that clipping
    (``_clip_grads_with_norm_``, torch's own) and ``total.full_tensor()`` issue no collective.
    ``error_if_nonfinite``: torch's check on the total, and torch's own message. ``foreach=True`` on a
    device without foreach kernels: torch's own error.

Composition with clip_grad_norm_multi_mesh
    This wrapper is the inner one (``clip_grad_norm_multi_mesh.after`` names this entry): the
    multi-mesh fix calls the function under it once per mesh, so each mesh's partial norms are
    reduced here on that mesh's device and come back replicated; its ``full_tensor()`` is then
    free. Several meshes with this fix alone are left to torch (torch's stack error).

Call-time isolation
    Reads ``tensors``, ``norm_type``, ``error_if_nonfinite``, ``foreach`` by name (and ``dtype`` where
    torch has it; any other argument only to see it is at its default). The reduction (torch's
    ``stack`` / ``vector_norm`` / ``redistribute`` on the mesh's device) runs through ``torch_call``: a
    peer's failure is torch's error. Should our code raise, torch's ``_get_total_norm`` is called
    again with the caller's arguments (a pure function): the bug's error, as without the fix.
    Every rank of the mesh takes the same path (the same gradients' devices and meshes), so the
    collective is issued alike.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from .. import _compat, _events, _isolation
from .._spec import CALL_AGAIN, TRACED, Patch, Verdict, Wrap, needed, not_needed, unsupported

NAME = "clip_grad_norm_cpu_offload"
_CLIP = "torch.nn.utils.clip_grad"
_UTILS = "torch.nn.utils"
_READS = ("tensors", "norm_type", "error_if_nonfinite", "foreach")  # by name; others forwarded as they came
_DTYPE = "dtype"  # PyTorch PR 194033 (open upstream): norms and their total accumulated in dtype
_STEP_ASIDE = object()  # an argument the mirror does not know, passed with another value than its default
_LOOP = ("_group_tensors_by_device_and_dtype", "_has_foreach_support", "_device_has_foreach_support",
         "_foreach_norm", "vector_norm", "stack")  # what the mirrored loop does as torch does
_FOREACH = ("_group_tensors_by_device_and_dtype", "_has_foreach_support", "_device_has_foreach_support")


def _structural_check() -> Verdict:
    import torch.nn.utils.clip_grad as clip
    import torch.utils._foreach_utils as foreach_utils
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    total = getattr(clip, "_get_total_norm", None)
    if not _compat.has_parameters(_compat.innermost(total), *_READS):
        return unsupported(f"clip_grad._get_total_norm has no parameters ({', '.join(_READS)})")
    undefaulted = [name for name, parameter in _parameters(total).items()
                   if name not in _READS and parameter.default is parameter.empty
                   and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)]
    if undefaulted:
        return unsupported(f"clip_grad._get_total_norm's {', '.join(undefaulted)} have no default: "
                           "a call of the mirrored loop cannot leave them out")
    if not _compat.reads_names(getattr(clip, "clip_grad_norm_", None), "_get_total_norm"):
        return unsupported("clip_grad_norm_ does not call _get_total_norm")
    names = _compat.names_read(_compat.code_of(total))
    if "device_mesh" in names or "device_type" in names:
        return not_needed("_get_total_norm reduces the norms on the mesh's device itself", conclusive=True)
    if not _compat.reads_names(total, *_LOOP):
        return unsupported("_get_total_norm does not norm per (device, dtype) group with _foreach_norm / "
                           "vector_norm and stack the norms")
    missing = [f"torch.utils._foreach_utils.{n}" for n in _FOREACH if not hasattr(foreach_utils, n)]
    missing += [f"DTensor.{n}" for n in ("from_local", "to_local", "redistribute", "device_mesh", "placements")
                if not hasattr(DTensor, n)]
    missing += [f"DeviceMesh.{n}" for n in ("get_group", "size", "ndim") if not hasattr(DeviceMesh, n)]
    # a property from 2.9 on (read), an attribute its __init__ sets in 2.8 (measured)
    if not hasattr(DeviceMesh, "device_type") and not _compat.reads_names(DeviceMesh.__init__, "device_type"):
        missing.append("DeviceMesh.device_type")
    missing += [] if hasattr(ProcessGroup, "_device_types") else ["ProcessGroup._device_types"]
    if missing:
        return unsupported(f"not found: {', '.join(missing)}")
    return needed("_get_total_norm reduces DTensor gradients' partial norms on the device the gradients "
                  "live on, which a process group without a backend for it (NCCL and CPU offload) refuses")


def _parameters(function) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(_compat.innermost(function)).parameters)
    except (TypeError, ValueError):  # no signature to read
        return {}


def _dtype_of(wrapped) -> Any:
    """PR 194033's ``dtype`` of the call (None where torch has none, or it was not passed), or
    :data:`_STEP_ASIDE` where the call passes a parameter the mirror does not know at another value
    than its default (a new behaviour of torch's, which only torch's own code gives)."""
    if len(wrapped.args) <= len(_READS) and not set(wrapped.kwargs) - set(_READS):
        return None  # torch's own callers of 2.8 - 2.15: nothing more to bind
    parameters = _parameters(wrapped.original)
    try:
        bound = inspect.Signature(list(parameters.values())).bind(*wrapped.args, **wrapped.kwargs).arguments
    except TypeError:
        return _STEP_ASIDE  # a call torch itself would refuse: torch's own error
    for name, value in bound.items():
        if name in _READS or name == _DTYPE:
            continue
        default = parameters[name].default
        if not (value is default or (type(value) is type(default) and value == default)):
            return _STEP_ASIDE
    return bound.get(_DTYPE)


def _dtensor_class():
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def _device_types(group) -> set | None:
    """The device types ``group`` has a backend for; None where it does not say (then: served)."""
    devices = getattr(group, "_device_types", None)
    return None if devices is None else {device.type for device in devices}


def _stranded(tensors) -> Any | None:
    """The mesh whose groups cannot reduce where some of ``tensors`` live, or None: every tensor a
    DTensor on one mesh, and a mesh dimension of more than one rank on which some tensor is not
    replicated has a group without a backend for that tensor's device type but with one for the
    mesh's ``device_type`` (torch's path, where the bug strikes). A DTensor subclass that defines
    its own ``placements`` (the pending ``FSDPGrad`` of PyTorch's rewrite, whose ``placements``
    raises) is never read: torch's own path."""
    dtensor = _dtensor_class()
    if dtensor is None or not tensors or not all(isinstance(t, dtensor) for t in tensors):
        return None
    if any(type(t).placements is not dtensor.placements for t in tensors):
        return None  # a gradient with placements of its own (a pending FSDPGrad raises): torch's
    mesh = tensors[0].device_mesh
    if any(t.device_mesh is not mesh and t.device_mesh != mesh for t in tensors):
        return None  # several meshes: clip_grad_norm_multi_mesh's (or torch's own error)
    where = {t.device.type for t in tensors}
    if where == {mesh.device_type}:
        return None  # everything on the mesh's device: torch's own path works (the common case)
    dims = [d for d in range(mesh.ndim) if mesh.size(d) > 1
            and any(not t.placements[d].is_replicate() for t in tensors)]
    stranded = False
    for dim in dims:
        served = _device_types(mesh.get_group(dim))
        if served is None:
            continue
        if mesh.device_type not in served:
            return None  # nowhere to reduce: torch's own error
        stranded = stranded or bool(where - served)
    return mesh if stranded else None


def _norms_where_they_live(tensors, norm_type: float, foreach, dtype=None):
    """Torch's per-tensor norms, computed as ``_get_total_norm`` computes them (per (device, dtype)
    group, ``_foreach_norm`` or one ``vector_norm`` each; with a ``dtype``, ``vector_norm`` in it
    each), in torch's order; None where torch would raise its own ``foreach=True`` error."""
    from torch.utils._foreach_utils import (
        _device_has_foreach_support,
        _group_tensors_by_device_and_dtype,
        _has_foreach_support,
    )

    norms = []
    for (device, _), ([device_tensors], _) in _group_tensors_by_device_and_dtype([tensors]).items():
        if (foreach is None and _has_foreach_support(device_tensors, device)) or (
            foreach and _device_has_foreach_support(device)
        ):
            norms.extend(torch._foreach_norm(device_tensors, norm_type) if dtype is None
                         else [torch.linalg.vector_norm(g, norm_type, dtype=dtype) for g in device_tensors])
        elif foreach:
            return None
        else:
            norms.extend(torch.linalg.vector_norm(g, norm_type, dtype=dtype) for g in device_tensors)
    return norms


def _to_mesh_device(norm):
    """A 0-dim partial norm on its mesh's device: its local value moved (``from_local`` puts it on
    ``device_mesh.device_type``), its placements kept; no collective."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(norm.to_local(), norm.device_mesh, norm.placements, run_check=False)


def _to_home(total, device):
    """The replicated total on ``device`` (where torch puts it): a local copy, no collective."""
    return total.to(device)


def _reduce(norms, norm_type: float, dtype=None):
    """Torch's ``vector_norm(stack(norms))`` of the partial norms, then replicated: the collectives."""
    from torch.distributed.tensor import Replicate

    total = torch.linalg.vector_norm(torch.stack(norms), norm_type, dtype=dtype)
    if any(placement.is_partial() for placement in total.placements):
        total = total.redistribute(total.device_mesh, [Replicate()] * total.device_mesh.ndim)
    return total


def _total_norm_on_mesh_device(wrapped, instance, args, kwargs):
    tensors = wrapped.argument("tensors")
    if isinstance(tensors, torch.Tensor):
        listed = [tensors]
    else:
        listed = tensors if isinstance(tensors, (list, tuple)) else list(tensors)
        if listed is not tensors:
            wrapped.rebind(tensors=listed)  # an iterator is read once: torch (and a fallback) get the list
    mesh = _stranded(listed)
    dtype = _dtype_of(wrapped) if mesh is not None else None
    if mesh is None or dtype is _STEP_ASIDE:
        return wrapped.again()  # the caller's arguments, every one as it came
    norm_type = float(wrapped.argument("norm_type"))
    with torch.no_grad():
        norms = _norms_where_they_live(listed, norm_type, wrapped.argument("foreach"), dtype)
        if norms is None:
            return wrapped.again()  # torch raises its own foreach=True error before any collective
        _fired(listed, mesh)
        moved = [_to_mesh_device(norm) for norm in norms]
        total = _isolation.torch_call(_reduce, moved, norm_type, dtype)
        if wrapped.argument("error_if_nonfinite") and bool(torch.logical_or(total.isnan(), total.isinf())):
            # torch's own message, from torch's function on the (plain) non-finite total
            wrapped.again(tensors=[total.to_local()], error_if_nonfinite=True)
        return _to_home(total, listed[0].device)


def _fired(tensors, mesh) -> None:
    where = ", ".join(sorted({t.device.type for t in tensors}))
    _events.fired(
        NAME,
        "RuntimeError: No backend type associated with device type cpu",
        f"the total norm of {len(tensors)} gradients on {where}: partial norms reduced on "
        f"{mesh.device_type} (a {tuple(mesh.mesh.shape)} mesh)",
    )


def _public(name):
    return lambda: hasattr(sys.modules.get(_UTILS), name)


def _replace(path: str, when=None) -> Wrap:
    """A plain function in place of torch's, not a wrapt proxy (``torch.compile`` traces user code
    that calls it: see ``clip_grad_norm_multi_mesh._replace``); torch's function is called again
    with the caller's arguments should our code raise (a pure function)."""
    return Wrap(path, _total_norm_on_mesh_device, when=when, reads=_READS, proxy=False, after_torch=CALL_AGAIN,
                dynamo=TRACED)


PATCH = Patch(
    name=NAME,
    summary="clip_grad_norm_ works with CPUOffloadPolicy on an NCCL-only process group",
    symptom="RuntimeError: No backend type associated with device type cpu",
    trigger="clip_grad_norm_ / get_total_norm over FSDP2 gradients offloaded to the CPU "
            "(CPUOffloadPolicy) when the process group has no CPU backend (init_process_group('nccl'))",
    upstream=("NeMo Automodel PR 3461", "torchtune PR 2108", "axolotl issue 3058"),
    # Reproduced and fixed on 2.8 - 2.15 with a CPU stand-in (a group that serves cuda only; 2.15 in
    # CI's matrix row); on CUDA: read, not run. <2.16 is the end of what was measured, not a fix.
    affected=">=2.8,<2.16",
    check=_structural_check,
    targets=(
        _replace(f"{_CLIP}:_get_total_norm"),
        _replace(f"{_UTILS}:get_total_norm", when=_public("get_total_norm")),
    ),
    changes="offloaded gradients' partial norms are reduced on the mesh's device",
)
