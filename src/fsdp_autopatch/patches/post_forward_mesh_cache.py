"""post_forward_mesh_cache: FSDP2 units with the same mesh and integer reshard_after_forward share
one post-forward DeviceMesh.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/post_forward_mesh_cache.md.

Needed here?
    ``_fsdp_init._get_post_forward_mesh_info(reshard_after_forward, mesh_info)`` exists and its
    bytecode builds ``HSDPMeshInfo(DeviceMesh(mesh.device_type, mesh.mesh.view(...)))`` (it reads
    ``DeviceMesh``, ``HSDPMeshInfo``, ``mesh``, ``view``, ``device_type``, ``shard_mesh_size``)
    -> needed. A name it reads contains ``cache`` (the shape of torch's own fix in both PRs) ->
    not needed. Anything else -> unsupported.

The replacement
    ``_get_post_forward_mesh_info`` wrapped where it is defined and where it was imported by name
    (``_fully_shard``). For an integer ``k`` (not ``bool``) the wrapper looks the result up by what
    torch builds it from: the calling rank, the source mesh's device type and rank layout
    (``mesh.mesh``), ``k`` and the shard mesh size; not by the source DeviceMesh object, because
    ``world_mesh["dp"]`` gives a new, equal DeviceMesh on every slicing. Miss: torch's function runs
    (its validation, warning and normalisation are torch's) and a newly built ``HSDPMeshInfo`` is
    remembered. Hit: the remembered one is returned; a hit means an identical call already passed
    torch's validation, and torch would have built an identical mesh.

    The entries are kept per world and held strongly: [Note: one cache per world, held strongly]
    on ``SharedMeshes``.

Call-time isolation
    The lookup runs before torch's function, the remembering after it. Should the lookup raise,
    torch builds the mesh; should the remembering raise, torch's mesh is returned and not
    remembered; either way the patch then steps aside on every later call. Across ranks: building
    a mesh is collective (``new_group`` on every rank of the world), so hit or miss must agree on
    every rank. A failure caused by a changed torch strikes every rank at the same call, and every
    rank then builds alike; a failure on one rank only makes it build a mesh its peers take from
    the cache, and its ``new_group`` waits until the process group's timeout. A parameter a later
    torch adds is part of the lookup key (a call is served remembered only when every argument is
    the same; an unhashable one goes to torch).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .. import _compat, _events
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

NAME = "post_forward_mesh_cache"
_FUNCTION = "_get_post_forward_mesh_info"
# what torch builds the post-forward mesh from: the inputs the lookup key stands for
_BUILT_FROM = ("DeviceMesh", "HSDPMeshInfo", "mesh", "view", "device_type", "shard_mesh_size")
_READS = ("reshard_after_forward", "mesh_info")


def _structural_check() -> Verdict:
    # reshard_after_forward and mesh_info are checked by name from the target's ``reads``; any
    # other argument goes into the lookup key (a hit needs an identical call).
    function = getattr(_compat.fsdp_module("_fsdp_init"), _FUNCTION, None)
    if function is None or not _compat.has_parameters(function, *_READS):
        return unsupported(f"_fsdp_init.{_FUNCTION}({', '.join(_READS)}, ...) not found")
    code = _compat.code_of(function)
    if any("cache" in name.lower() for name in code.co_names):
        return not_needed(f"{_FUNCTION} already reuses post-forward meshes (it reads a cache)", conclusive=True)
    if not _compat.reads_names(function, *_BUILT_FROM):
        return unsupported(f"{_FUNCTION} does not build HSDPMeshInfo(DeviceMesh(device_type, mesh.mesh.view(-1, k)))")
    return needed(f"{_FUNCTION} builds a new DeviceMesh for every integer reshard_after_forward")


class SharedMeshes:
    """Per world (default process group, held weakly): lookup key -> the HSDPMeshInfo torch built.

    [Note: one cache per world, held strongly] The entries are kept per default process group
    (``torch.distributed.group.WORLD``, held weakly): several ranks in one process (threaded
    process groups) each have their own world and never see another rank's mesh, and a world made
    by ``init_process_group()`` after ``destroy_process_group()`` starts empty. Within a world an
    entry holds its mesh strongly, so every rank decides hit or miss alike: ``DeviceMesh`` creation
    is collective (``new_group`` on every rank of the world), and an entry that died with its units
    when the garbage collector ran on one rank but not yet on another would make one rank create
    groups its peers do not (a hang). Holding it costs a ``DeviceMesh`` object: its process groups
    stay registered in ``torch.distributed`` until ``destroy_process_group()`` with or without the
    patch.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # thread ranks share this object
        self._by_world: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, world: Any, key: tuple) -> Any:
        with self._lock:
            return self._by_world.get(world, {}).get(key)

    def put(self, world: Any, key: tuple, mesh_info: Any) -> None:
        with self._lock:
            self._by_world.setdefault(world, {})[key] = mesh_info

    def entries(self, world: Any) -> dict:
        with self._lock:
            return dict(self._by_world.get(world, {}))

    def worlds(self) -> int:
        with self._lock:
            return len(self._by_world)


SHARED = SharedMeshes()


def layout_key(reshard_after_forward: Any, mesh_info: Any) -> tuple | None:
    """What torch builds the post-forward mesh from, for an integer (not bool) value; None where
    torch decides alone (bool, anything else, a mesh_info of another shape)."""
    if isinstance(reshard_after_forward, bool) or not isinstance(reshard_after_forward, int):
        return None
    mesh = getattr(mesh_info, "mesh", None)
    layout = getattr(mesh, "mesh", None)  # the rank tensor torch views as (-1, k)
    device_type = getattr(mesh, "device_type", None)
    shard_size = getattr(mesh_info, "shard_mesh_size", None)
    if layout is None or device_type is None or shard_size is None:
        return None
    ranks = tuple(layout.flatten().tolist())
    return (device_type, tuple(layout.shape), ranks, reshard_after_forward, shard_size)


def current_world() -> tuple[Any, int] | None:
    """This rank's default process group and rank, or None (no process group, or one that cannot
    be held weakly: then torch decides alone)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.group.WORLD
    try:
        weakref.ref(world)
    except TypeError:
        return None
    return world, dist.get_rank()


def _other_arguments(wrapped) -> tuple | None:
    """Every argument besides the two the key is built from, hashable, or None (then torch decides
    alone): a parameter a later torch adds must be the same for a call to be served remembered."""
    others = wrapped.binder.unread(wrapped.args, wrapped.kwargs, _READS)
    try:
        hash(others)
    except TypeError:
        return None
    return others


def _shared_post_forward_mesh(wrapped, instance, args, kwargs):
    reshard_after_forward, mesh_info = wrapped.argument(_READS[0]), wrapped.argument(_READS[1])
    layout = layout_key(reshard_after_forward, mesh_info)
    others = _other_arguments(wrapped) if layout is not None else None
    here = current_world() if others is not None else None
    if here is None:
        return wrapped(*args, **kwargs)
    world, rank = here
    key = (rank, *layout, others)
    shared = SHARED.get(world, key)
    if shared is not None:
        _events.fired(
            NAME,
            "a new post-forward DeviceMesh with its own process groups",
            f"reshard_after_forward={reshard_after_forward} over ranks {list(layout[2])}",
        )
        return shared
    built = wrapped(*args, **kwargs)  # torch validates k here (ValueError) and may warn
    if built is not None and built is not mesh_info:  # a new mesh, not False/True's answer
        SHARED.put(world, key, built)
    return built


PATCH = Patch(
    name=NAME,
    summary="units with the same mesh and an integer reshard_after_forward share one post-forward mesh",
    symptom=(
        "every fully_shard(..., reshard_after_forward=k) builds its own DeviceMesh and process groups: "
        "8 units -> 16 groups, 16 -> 32 on 4 ranks with k=2"
    ),
    trigger="an integer reshard_after_forward with 1 < k < shard mesh size, on many units",
    upstream=(
        "PyTorch issue 187155",
        "PyTorch issue 153302",
        "PyTorch issue 147179",
        "PyTorch PR 187161",
        "NeMo Automodel patch_fsdp_post_forward_mesh_cache",
    ),
    # the same function in every release 2.6 - 2.15 (measured 2.8 - 2.15; read in the 2.6, 2.7 wheels).
    # <2.16 means "measured up to 2.15", not "fixed in 2.16": on a later release the check decides.
    affected=">=2.6,<2.16",
    check=_structural_check,
    # everywhere: _fully_shard imported the function by name
    targets=(
        Wrap(
            f"{_compat.FSDP2_PACKAGE}._fsdp_init:{_FUNCTION}", _shared_post_forward_mesh, everywhere=True, reads=_READS
        ),
    ),
    changes="units with equal (mesh layout, reshard_after_forward) get one post-forward mesh",
)
