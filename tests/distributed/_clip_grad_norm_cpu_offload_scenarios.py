"""clip_grad_norm_cpu_offload's CPU stand-in (2 gloo ranks; the bug itself needs CUDA and NCCL: its
case, ``fsdp_autopatch.cases.clip_grad_norm_cpu_offload``, is the GPU check's).

The stand-in world: ``init_process_group("cuda:gloo")`` gives a group with a backend for ``cuda``
only (NCCL's shape), and a mesh over it labelled ``"cuda"`` (``DeviceMesh("cuda", ...)``: nothing
touches a GPU). Gradients are what FSDP2 with ``CPUOffloadPolicy`` leaves: DTensors on that mesh whose
local shards are CPU tensors (the reference's full gradients sharded as FSDP2 shards them). Without
the fix, torch's ``clip_grad_norm_`` meets the bug's exact error: ``No backend type associated with
device type cpu``.

With the fix, the two moves that need a GPU are stood in for (``_to_mesh_device`` /
``_to_home``): a partial norm "moved to the mesh's device" is the same local value on a twin mesh
over a gloo group that serves the CPU (the stand-in for NCCL on the GPU), and the total comes home
onto the gradients' own mesh. Every move is recorded (shape, from, to), so the tests see that only
0-dim norms go, to the mesh's ``device_type``; torch's ``stack`` / ``vector_norm`` / ``redistribute``
and gloo's all-reduce run for real. ``control``: the same gradients on the twin mesh itself (a
group that serves the CPU): torch's own path, which the fix must leave alone and equal bitwise.

Cases ``layout/api/norm/foreach/dtypes[/nan]``: layout ``1d`` (``("dp",)``), ``hsdp`` (a (1, 2)
``("rep", "shard")`` mesh), ``multi`` (the first layer on ``("edp",)``, the rest on ``("dp",)``: with
``clip_grad_norm_multi_mesh``); api ``clip`` (``clip_grad_norm_``) or ``split``
(``get_total_norm`` + ``clip_grads_with_norm_``); ``dtypes`` ``fp32`` or ``mixed`` (the biases in
bf16); ``nan``: a NaN in one gradient and ``error_if_nonfinite=True``.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import Any

import torch

from _registry import scenario

MAX_NORM = 0.5
SHAPES = {"0.weight": (8, 8), "0.bias": (8,), "1.weight": (5, 8), "1.bias": (5,)}  # 5 rows: uneven shards
NORMS = {"2": 2.0, "inf": math.inf, "1": 1.0}
FOREACH = {"none": None, "true": True, "false": False}
CASES = (
    "1d/clip/2/none/fp32", "1d/clip/inf/none/fp32", "1d/clip/1/false/fp32", "1d/split/2/true/fp32",
    "1d/clip/2/none/mixed", "1d/clip/2/none/fp32/nan", "hsdp/clip/2/none/fp32", "hsdp/split/inf/false/mixed",
    "multi/clip/2/none/fp32", "multi/clip/inf/true/fp32",
)


def parse(case: str) -> dict[str, Any]:
    layout, api, norm, foreach, dtypes, *nan = case.split("/")
    return {"layout": layout, "api": api, "norm": NORMS[norm], "foreach": FOREACH[foreach],
            "mixed": dtypes == "mixed", "nan": bool(nan)}


def full_grads(case: str) -> dict[str, torch.Tensor]:
    """The full gradients (large: the clipping is active), the same on every rank and in the test."""
    gen = torch.Generator().manual_seed(7)
    grads = {name: torch.randn(*shape, generator=gen) * 3 for name, shape in SHAPES.items()}
    if parse(case)["mixed"]:
        grads = {n: g.bfloat16() if n.endswith("bias") else g for n, g in grads.items()}
    if parse(case)["nan"]:
        grads["1.bias"][2] = float("nan")
    return grads


def reference(case: str) -> dict[str, Any]:
    """One process, plain tensors: torch's total and clipped gradients."""
    spec = parse(case)
    params = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in full_grads(case).items()}
    for name, param in params.items():
        param.grad = full_grads(case)[name].clone()
    total = torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM, spec["norm"], foreach=spec["foreach"])
    return {"total": float(total), "grads": {n: p.grad.float() for n, p in params.items()}}


def _dtensor(mesh, local: torch.Tensor, placements, shape) -> Any:
    """A DTensor whose local tensor stays where it is (as FSDP2 builds its CPU-offloaded ones:
    ``DTensor.from_local`` would move it to the mesh's device)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(torch.Size(shape), torch.empty(shape).stride(), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


class World:
    """The stand-in's meshes: per layout the "cuda" mesh over the cuda-only world, and its twin over
    a gloo group that serves the CPU."""

    def __init__(self, rank: int, world_size: int) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        ranks = list(range(world_size))
        self.cpu_group = dist.new_group(ranks, backend="gloo")
        singles = [dist.new_group([r], backend="gloo") for r in ranks]  # every rank creates every group
        # over the world's group (its default backend: cuda only); from_group sets no CUDA device
        world, own = dist.group.WORLD, [dist.new_group([r]) for r in ranks][rank]
        self.meshes = {
            "dp": DeviceMesh.from_group(world, "cuda", mesh_dim_names=("dp",)),
            "edp": DeviceMesh.from_group(world, "cuda", mesh_dim_names=("edp",)),
            "hsdp": DeviceMesh.from_group([own, world], "cuda", mesh=torch.tensor([ranks]),
                                          mesh_dim_names=("rep", "shard")),
        }
        self.twins = {
            "dp": DeviceMesh.from_group(self.cpu_group, "cpu", mesh_dim_names=("dp",)),
            "edp": DeviceMesh.from_group(self.cpu_group, "cpu", mesh_dim_names=("edp",)),
            "hsdp": DeviceMesh.from_group([singles[rank], self.cpu_group], "cpu", mesh=torch.tensor([ranks]),
                                          mesh_dim_names=("rep", "shard")),
        }
        self.moves: list[dict[str, Any]] = []

    def twin_of(self, mesh):
        return next(self.twins[k] for k, m in self.meshes.items() if m is mesh)

    def home_of(self, twin):
        return next(self.meshes[k] for k, t in self.twins.items() if t is twin)

    # the stand-ins of the fix's two moves (the GPU's side of them)
    def to_mesh_device(self, norm):
        from torch.distributed.tensor import DTensor

        local = norm.to_local()
        self.moves.append({"what": "norm", "shape": list(local.shape), "from": local.device.type,
                           "to": norm.device_mesh.device_type})
        return DTensor.from_local(local, self.twin_of(norm.device_mesh), norm.placements, run_check=False)

    def to_home(self, total, device):
        local = total.to_local().to(device)
        self.moves.append({"what": "total", "shape": list(local.shape), "from": "stand-in", "to": device.type,
                           "placements": [str(p) for p in total.placements]})
        return _dtensor(self.home_of(total.device_mesh), local, total.placements, total.shape)


def mesh_of(layout: str, name: str) -> str:
    if layout == "hsdp":
        return "hsdp"
    return "edp" if layout == "multi" and name.startswith("0.") else "dp"


def sharded_params(case: str, meshes: dict[str, Any], twins: dict[str, Any]) -> list[torch.nn.Parameter]:
    """Parameters with gradients as FSDP2 with CPU offload leaves them: Shard(0) on the shard
    dimension (HSDP: replicated on the other), local shards on the CPU, on ``meshes``' meshes."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    params = []
    for name, full in full_grads(case).items():
        key = mesh_of(parse(case)["layout"], name)
        placements = [Replicate(), Shard(0)] if key == "hsdp" else [Shard(0)]
        local = distribute_tensor(full, twins[key], placements).to_local()  # this rank's shard
        param = torch.nn.Parameter(_dtensor(meshes[key], torch.zeros_like(local), placements, full.shape))
        param.grad = _dtensor(meshes[key], local.clone(), placements, full.shape)
        params.append(param)
    return params


def clip(params, case: str):
    spec = parse(case)
    if spec["api"] == "clip":
        return torch.nn.utils.clip_grad_norm_(params, MAX_NORM, spec["norm"], error_if_nonfinite=spec["nan"],
                                              foreach=spec["foreach"])
    total = torch.nn.utils.get_total_norm([p.grad for p in params], spec["norm"], spec["nan"], spec["foreach"])
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total, spec["foreach"])
    return total


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _record(params, total, twins) -> dict[str, Any]:
    """The total (its full value, where it lives, its placements) and the full clipped gradients
    (gathered over the twins: a collective of the test's, on a group that serves the CPU)."""
    from torch.distributed.tensor import DTensor

    local = total.full_tensor() if isinstance(total, DTensor) else total  # torch's may still be partial
    grads = {}
    for name, param in zip(SHAPES, params):
        g = param.grad
        twin = g.device_mesh if g.device_mesh in twins.values() else twins[_key_of(g.device_mesh)]
        grads[name] = DTensor.from_local(g.to_local(), twin, g.placements, run_check=False, shape=g.shape,
                                         stride=g.stride()).full_tensor().float()
    return {"total": float(local), "total_bits": local.double().item(), "total_device": local.device.type,
            "total_type": type(total).__name__, "total_dtype": str(local.dtype),
            "total_placements": [str(p) for p in getattr(total, "placements", ())], "grads": grads}


_KEYS: dict[int, str] = {}


def _key_of(mesh) -> str:
    return _KEYS[id(mesh)]


def _fired() -> int:
    import fsdp_autopatch

    return fsdp_autopatch.status()["clip_grad_norm_cpu_offload"].fired


@scenario("clip_grad_norm_cpu_offload", gloo=False)
def sc_clip_cpu_offload(ctx) -> None:
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401  -- the plugin's patches apply here

    from fsdp_autopatch.patches import clip_grad_norm_cpu_offload as fix

    dist.init_process_group("cuda:gloo", timeout=timedelta(seconds=int(os.environ.get("FSDP_DIST_PG_TIMEOUT_S", "30"))))
    world = World(ctx.rank, ctx.world_size)
    _KEYS.update({id(m): k for k, m in world.meshes.items()})
    fix._to_mesh_device, fix._to_home = world.to_mesh_device, world.to_home  # the GPU's side, stood in for
    ctx.data["backends"] = {"world": [d.type for d in dist.group.WORLD._device_types]}
    for case in CASES:
        with ctx.case(case, continue_on_error=True) as rec:
            world.moves.clear()
            before = _fired()
            params = sharded_params(case, world.meshes, world.twins)
            total = clip(params, case)
            rec.update(_record(params, total, world.twins), moves=list(world.moves), fired=_fired() - before)
        with ctx.case(f"{case}/control", continue_on_error=True) as rec:  # a group that serves the CPU
            before = _fired()
            params = sharded_params(case, world.twins, world.twins)
            total = clip(params, case)
            rec.update(_record(params, total, world.twins), fired=_fired() - before)
    dist.barrier(world.cpu_group)
