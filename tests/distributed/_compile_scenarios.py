"""The compile suite: FSDP2 under ``torch.compile`` (``backend="aot_eager"``), plugin on or off.

``compile``: one job runs every variant of :data:`VARIANTS` in turn on the same 2 gloo ranks (a
launch costs 10 - 20 s here, a variant 1 - 5 s), each from a fresh Dynamo (``torch._dynamo.reset()``,
its counters and compilation metrics cleared). The model is :class:`Net`: three residual blocks
(each its own ``fully_shard`` unit) and a head in the root unit; ``STEPS`` SGD steps on each rank's
own batch. Variants:

* ``whole_model``: ``torch.compile(model)`` around the sharded model;
* ``per_unit``: each block ``.compile()``d in place after ``fully_shard`` (the head eager);
* ``torchtitan_order``: each block ``torch.compile(block, fullgraph=True)`` first, put back in
  its place, then ``fully_shard`` (torchtitan's order: the units are ``OptimizedModule``s);
* ``compiled_optimizer_step``: the model eager, ``torch.compile(optimizer.step)``;
* ``checkpointed_unit``: each block's body under ``torch.utils.checkpoint`` (``use_reentrant=False``),
  each block ``.compile()``d in place after ``fully_shard``;
* ``fill_on``: ``whole_model`` with the unused-param fill on every unit
  (``set_reduce_scatter_unused_params(True)``) and a parameter no rank uses (``blocks.1.spare``);
  skipped (with why) where ``FSDPModule`` has no such method (torch < 2.13 with the plugin off).

Each variant records Dynamo's counters (:func:`dynamo_counters`), the losses, and every parameter's
``full_tensor()`` after the last step. See ``test_dist_compile.py``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from _dist_common import Ctx, _randn
from _registry import scenario

BACKEND = "aot_eager"
DIM, OUT, ROWS = 8, 4, 4
N_BLOCKS = 3
STEPS, LR = 3, 0.1
MODEL_SEED, BATCH_SEED = 37, 3700
METRICS_LIMIT = 1024  # compilations kept for the recompile count (the unfixed plugin made 29 per variant)
ORIG_MOD = "_orig_mod."  # what torch.compile(module) puts in front of the names of its parameters


class Block(nn.Module):
    def __init__(self, checkpointed: bool = False, spare: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.checkpointed = checkpointed
        if spare:
            self.spare = nn.Linear(DIM, DIM)  # no rank uses it: the fill gives it a zero gradient

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return x + checkpoint(self.body, x, use_reentrant=False)
        return x + self.body(x)


class Net(nn.Module):
    """Three blocks (a unit each) and the head (the root unit)."""

    def __init__(self, checkpointed: bool = False, spare: bool = False) -> None:
        super().__init__()
        torch.manual_seed(MODEL_SEED)
        self.blocks = nn.ModuleList(Block(checkpointed, spare and i == 1) for i in range(N_BLOCKS))
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model_kwargs(variant: str) -> dict[str, bool]:
    return {"checkpointed": variant == "checkpointed_unit", "spare": variant == "fill_on"}


def rank_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    seed = BATCH_SEED + 100 * step + rank
    return _randn(seed, ROWS, DIM), _randn(seed + 50, ROWS, OUT)


def loss_of(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def plain_name(name: str) -> str:
    """A parameter's name without ``torch.compile``'s wrapper (torchtitan_order's blocks)."""
    return name.replace(ORIG_MOD, "")


def compile_unavailable() -> str | None:
    """Why ``torch.compile`` with :data:`BACKEND` cannot run here, or None (a tiny function)."""
    try:
        torch.compile(lambda t: t + 1, backend=BACKEND)(torch.ones(1))
    except Exception as e:  # noqa: BLE001 - the reason is what the test skips with
        return f"{type(e).__name__}: {e}"[:300]
    finally:
        torch._dynamo.reset()
    return None


# --- Dynamo's books -----------------------------------------------------------------------------


def reset_dynamo() -> None:
    """A fresh Dynamo: caches, counters and the compilation metrics of the previous variant gone."""
    from torch._dynamo import utils

    torch._dynamo.reset()
    utils.counters.clear()
    utils.clear_compilation_metrics()
    if hasattr(utils, "set_compilation_metrics_limit"):  # the default keeps the last 64 compilations
        utils.set_compilation_metrics_limit(METRICS_LIMIT)


def _first_line(text: str) -> str:
    return str(text).strip().splitlines()[0][:200] if str(text).strip() else ""


def dynamo_counters() -> dict[str, Any]:
    """What Dynamo counted since :func:`reset_dynamo`.

    ``graph_breaks``: the sum of ``counters["graph_break"]`` (one entry per break reason);
    ``break_reasons``: each reason's first line and its count; ``frames_total`` / ``frames_ok``:
    the frames Dynamo was asked to convert / converted; ``unique_graphs``: the FX graphs it made;
    ``recompiles``: the compilations of a frame that already had a cache entry (Dynamo has no
    counter for it: the compilation metrics with a ``recompile_reason``, the first line of each
    in ``recompile_reasons``); ``compiles``: all compilation metrics.
    """
    from torch._dynamo import utils

    counters = utils.counters
    reasons: dict[str, int] = {}
    for reason, count in counters["graph_break"].items():
        line = _first_line(reason)
        reasons[line] = reasons.get(line, 0) + count
    metrics = list(utils.get_compilation_metrics())
    recompiled = [m for m in metrics if getattr(m, "recompile_reason", None)]
    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "break_reasons": dict(sorted(reasons.items())),
        "frames_total": counters["frames"]["total"],
        "frames_ok": counters["frames"]["ok"],
        "unique_graphs": counters["stats"]["unique_graphs"],
        "recompiles": len(recompiled),
        "recompile_reasons": sorted(_first_line(m.recompile_reason) for m in recompiled),
        "compiles": len(metrics),
    }


# --- the variants -------------------------------------------------------------------------------


def _shard(ctx: Ctx, model: Net) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)


def whole_model(ctx: Ctx, model: Net) -> tuple[Callable, Callable]:
    _shard(ctx, model)
    return torch.compile(model, backend=BACKEND), lambda opt: opt.step


def per_unit(ctx: Ctx, model: Net) -> tuple[Callable, Callable]:
    _shard(ctx, model)
    for block in model.blocks:
        block.compile(backend=BACKEND)
    return model, lambda opt: opt.step


def torchtitan_order(ctx: Ctx, model: Net) -> tuple[Callable, Callable]:
    for i, block in enumerate(list(model.blocks)):
        model.blocks.register_module(str(i), torch.compile(block, backend=BACKEND, fullgraph=True))
    _shard(ctx, model)
    return model, lambda opt: opt.step


def compiled_optimizer_step(ctx: Ctx, model: Net) -> tuple[Callable, Callable]:
    _shard(ctx, model)
    return model, lambda opt: torch.compile(opt.step, backend=BACKEND)


def fill_missing() -> str | None:
    from torch.distributed.fsdp import FSDPModule

    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        return None
    return f"FSDPModule has no set_reduce_scatter_unused_params on torch {torch.__version__} (here)"


def fill_on(ctx: Ctx, model: Net) -> tuple[Callable, Callable]:
    _shard(ctx, model)
    for unit in (*model.blocks, model):
        unit.set_reduce_scatter_unused_params(True)
    return torch.compile(model, backend=BACKEND), lambda opt: opt.step


VARIANTS: dict[str, Callable[[Ctx, Net], tuple[Callable, Callable]]] = {
    "whole_model": whole_model,
    "per_unit": per_unit,
    "torchtitan_order": torchtitan_order,
    "compiled_optimizer_step": compiled_optimizer_step,
    "checkpointed_unit": per_unit,
    "fill_on": fill_on,
}


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (``DTensor.full_tensor()``: a collective, in the same order on every rank)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        out[plain_name(name)] = whole.detach().clone()
    return out


def train(ctx: Ctx, rec: dict[str, Any], variant: str) -> None:
    model = Net(**model_kwargs(variant))
    forward, make_step = VARIANTS[variant](ctx, model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step_fn = make_step(opt)
    rec["losses"] = []
    for step in range(STEPS):
        loss = loss_of(forward, *rank_batch(ctx.rank, step))
        loss.backward()
        # the parameters the step skips (the fill's spare one, where the plugin keeps grad None)
        rec["grad_none"] = sorted(plain_name(n) for n, p in model.named_parameters() if p.grad is None)
        step_fn()
        opt.zero_grad()
        rec["losses"].append(loss.detach().item())
    rec["weights"] = full_weights(model)


@scenario("compile")
def sc_compile(ctx: Ctx) -> None:
    reason = compile_unavailable()
    ctx.data["compile_unavailable"] = reason
    if reason is not None:
        ctx.save()
        return
    for variant in ctx.args.get("variants", list(VARIANTS)):
        with ctx.case(variant, continue_on_error=True) as rec:
            rec["skipped"] = fill_missing() if variant == "fill_on" else None
            if rec["skipped"] is not None:
                continue
            reset_dynamo()
            try:
                train(ctx, rec, variant)
            finally:
                rec["counters"] = dynamo_counters()
    import fsdp_autopatch  # only now: the variants ran with what the bootstrap installed

    ctx.data["autopatch_file"] = fsdp_autopatch.__file__  # which checkout the ranks imported
    ctx.save()
