"""clip_grad_norm_multi_mesh scenarios (PyTorch issue 180346): gradient clipping over several meshes,
in the ways its case (``clip_grad_norm_``, norm 2, a ``("dp",)`` and an ``("edp",)`` mesh) does not show.

Scenario ``clip_grad_norm_multi_mesh`` (2 gloo ranks; see ``_registry``). The test imports this
module for the model, the data and the one-process reference.

Model: ``dense = Linear(8, 8)`` and ``experts = Linear(8, 8, bias=False)`` (an expert weight), and
``extra``, a parameter outside every FSDP2 unit (a plain-tensor gradient, averaged over the ranks by
hand as DDP would). Layouts, all over the same 2 ranks:

- ``two_1d``: ``experts`` on an ``("edp",)`` mesh, ``dense`` and the root on a ``("dp",)`` mesh
  (expert parallelism's layout);
- ``hsdp_1d``: ``experts`` on ``("edp",)``, ``dense`` and the root on a (1, 2) ``("rep", "shard")``
  HSDP mesh;
- ``one_mesh``: everything on ``("dp",)`` (what the multi-mesh results must equal).

A case is ``layout/api/norm/foreach/plain[/nan]``: a fresh backward, then ``clip_grad_norm_``
(``api=clip``), ``get_total_norm`` + ``clip_grads_with_norm_`` (``split``), or
``clip_grads_with_norm_`` alone with the reference total as a plain tensor (``scale``); ``plain``
adds ``extra``; ``nan`` puts a NaN in ``extra``'s gradient and asks ``error_if_nonfinite``.
Recorded per case: the total (``float``, and its type), the clipped full gradients.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.nn as nn
from torch.nn.utils import clip_grad_norm_ as clip_grad_norm_bound_early

import _dist_common as sc
from _registry import scenario

# bound before FSDP2 (and the plugin's patches) is imported: the fix must reach it too
FSDP2_IMPORTED_AT_BINDING = "torch.distributed.fsdp._fully_shard" in sys.modules

MAX_NORM = 0.5
LOSS_SCALE = 3.0  # large gradients: the clipping is active
NORMS = {"2": 2.0, "inf": math.inf}
FOREACH = {"none": None, "true": True, "false": False}
LAYOUTS = ("two_1d", "hsdp_1d", "one_mesh")


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(sc.DIM, sc.DIM)
        self.experts = nn.Linear(sc.DIM, sc.DIM, bias=False)
        self.extra = nn.Parameter(torch.randn(sc.DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(torch.relu(self.dense(x))) + self.extra


def parse(case: str) -> dict[str, Any]:
    layout, api, norm, foreach, plain, *nan = case.split("/")
    return {
        "layout": layout,
        "api": api,
        "norm": NORMS[norm],
        "foreach": FOREACH[foreach],
        "plain": plain == "plain",
        "nan": bool(nan),
    }


def build() -> Model:
    torch.manual_seed(sc.MODEL_SEED)
    return Model()


def inputs(rank: int) -> torch.Tensor:
    return sc._randn(30_000 + rank, sc.ROWS_PER_RANK, sc.DIM)


def loss_of(model: nn.Module, rank: int) -> torch.Tensor:
    return model(inputs(rank)).pow(2).sum() * LOSS_SCALE


def clipped_parameters(model: Model, plain: bool) -> list[nn.Parameter]:
    return [model.dense.weight, model.dense.bias, model.experts.weight] + ([model.extra] if plain else [])


def reference(case: str, world_size: int = sc.WORLD_SIZE) -> dict[str, Any]:
    """One process, the unsharded model: torch's clip_grad_norm_ on plain tensors."""
    spec = parse(case)
    model = build()
    (sum(loss_of(model, rank) for rank in range(world_size)) / world_size).backward()
    params = clipped_parameters(model, spec["plain"])
    if spec["nan"]:
        model.extra.grad[0] = float("nan")
    total = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type=spec["norm"], foreach=False)
    return {"total": float(total), "grads": {_name(model, p): p.grad.clone() for p in params}}


def _name(model: nn.Module, param: nn.Parameter) -> str:
    return next(name for name, p in model.named_parameters() if p is param)


# --- rank side ---------------------------------------------------------------------------------


def meshes(world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    return {
        "dp": init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",)),
        "edp": init_device_mesh("cpu", (world_size,), mesh_dim_names=("edp",)),
        "hsdp": init_device_mesh("cpu", (1, world_size), mesh_dim_names=("rep", "shard")),
    }


def shard(model: Model, layout: str, mesh: dict[str, Any]) -> Model:
    from torch.distributed.fsdp import fully_shard

    experts = mesh["dp"] if layout == "one_mesh" else mesh["edp"]
    dense = mesh["hsdp"] if layout == "hsdp_1d" else mesh["dp"]
    fully_shard(model.experts, mesh=experts)
    fully_shard(model.dense, mesh=dense)
    fully_shard(model, mesh=dense, ignored_params={model.extra})
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def backward(ctx: sc.Ctx, model: Model, nan: bool) -> None:
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    loss_of(model, ctx.rank).backward()
    dist.all_reduce(model.extra.grad)  # the plain parameter: averaged by hand, as DDP would
    model.extra.grad /= ctx.world_size
    if nan:
        model.extra.grad[0] = float("nan")


def clip(ctx: sc.Ctx, model: Model, case: str) -> torch.Tensor:
    spec = parse(case)
    backward(ctx, model, spec["nan"])
    params = clipped_parameters(model, spec["plain"])
    norm, foreach, error = spec["norm"], spec["foreach"], spec["nan"]
    if spec["api"] == "clip":
        return clip_grad_norm_bound_early(params, MAX_NORM, norm, error_if_nonfinite=error, foreach=foreach)
    if spec["api"] == "split":
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm, error, foreach)
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total, foreach)
        return total
    total = torch.tensor(reference(case, ctx.world_size)["total"])  # "scale": a total from elsewhere
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total, foreach)
    return total


@scenario("clip_grad_norm_multi_mesh")
def sc_clip_multi_mesh(ctx: sc.Ctx) -> None:
    """args["cases"]: each on the model of its layout (built once per layout, fresh gradients per
    case); a case that raises is recorded and the next one runs (both ranks raise alike)."""
    mesh = meshes(ctx.world_size)
    models = {layout: shard(build(), layout, mesh) for layout in LAYOUTS}
    ctx.data["grad_meshes"] = {}
    for case in ctx.args["cases"]:
        model = models[parse(case)["layout"]]
        with ctx.case(case, continue_on_error=True) as rec:
            total = clip(ctx, model, case)
            rec["total_type"] = type(total).__name__
            rec["total"] = float(_full(total))
            rec["grads"] = {_name(model, p): _full(p.grad) for p in clipped_parameters(model, True)}
    ctx.data["fired"] = _fired()
    ctx.data["fsdp2_imported_at_binding"] = FSDP2_IMPORTED_AT_BINDING
    if ctx.args.get("identity"):
        ctx.data["identity"] = identity(ctx, models["one_mesh"])


def identity(ctx: sc.Ctx, model: Model) -> dict[str, bool]:
    """The patch's wrappers on one-mesh DTensor gradients hand torch (here a spy standing in for
    it) the caller's very objects and return its very result."""
    from torch.nn.utils import clip_grad

    from fsdp_autopatch import _isolation, _patching
    from fsdp_autopatch.patches import clip_grad_norm_multi_mesh as patch

    backward(ctx, model, nan=False)
    params = clipped_parameters(model, False)
    grads = [p.grad for p in params]
    calls: list[tuple[Any, Any]] = []
    result = object()

    def torch_stand_in(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return result

    total = torch.tensor(1.0)
    def drive(wrapper, args):  # as the guard calls it, torch's function's signature, the stand-in
        target = next(t for t in patch.PATCH.targets if t.wrapper is wrapper)
        torch_function = _patching.original_of(*_patching.resolve(target.path))
        return _isolation.run_wrapper(
            wrapper, torch_stand_in, None, args, {}, target.reads, signature_of=torch_function
        )

    out = {
        "total_norm_result": drive(patch._total_norm_across_meshes, (grads, 2.0, False, None)) is result,
        "clip_result": drive(patch._clip_across_meshes, (params, MAX_NORM, total, None)) is result,
    }
    (total_args, total_kwargs), (clip_args, clip_kwargs) = calls
    out["total_norm_args"] = total_args[0] is grads and total_args[1:] == (2.0, False, None) and total_kwargs == {}
    out["clip_args"] = clip_args[0] is params and clip_args[2] is total and clip_kwargs == {}
    replaced = {attribute: original for _, attribute, original in _patching._applied[patch.PATCH.name]}
    out["installed"] = clip_grad._get_total_norm.__wrapped__ is replaced["_get_total_norm"]
    return out


def _fired() -> int:
    records = {p["name"]: p for p in sc.autopatch_status().get("patches", ())}
    return records.get("clip_grad_norm_multi_mesh", {}).get("fired", 0)
