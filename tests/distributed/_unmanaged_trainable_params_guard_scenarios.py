"""unmanaged_trainable_params_guard's variants (2 gloo ranks), the plugin as installed.

The bug's own run (an adapter added after ``fully_shard``, each rank stepping its own copy) is its
case, ``fsdp_autopatch.cases.unmanaged_trainable_params_guard``, whose model these reuse. Here what the
guard must let through and what else it must stop, each case with a fresh model and optimizer
(3 SGD steps; a ``GuardError`` is the case's recorded error):

- ``synced``: the adapter broadcast from rank 0 once and its gradient averaged by a hook
  (transformers' fix): no stop, the ranks' adapters equal, the weights the in-sync reference's;
- ``ignored_synced``: ``fully_shard(root, ignored_params={adapter})`` with the same sync: no stop;
- ``ignored_unsynced``: ``ignored_params`` without it: stopped;
- ``after_first_step``: the adapter added after a first training step, into a new optimizer:
  stopped at that optimizer's first step;
- ``frozen``: the adapter added with ``requires_grad=False``: no stop (it does not train);
- ``plain``: no unmanaged parameter: no stop.
"""

from __future__ import annotations

from typing import Any

import torch

import _dist_common as sc
from _registry import scenario
from fsdp_autopatch.cases import _common
from fsdp_autopatch.cases import unmanaged_trainable_params_guard as case

CASES = ("synced", "ignored_synced", "ignored_unsynced", "after_first_step", "frozen", "plain")
STOPPED = ("ignored_unsynced", "after_first_step")


def _sync(param: torch.Tensor, world_size: int) -> None:
    """Keep ``param`` in sync by hand: rank 0's values once, then every gradient averaged."""
    import torch.distributed as dist

    dist.broadcast(param.data, src=0)
    param.register_hook(lambda grad: _averaged(grad, world_size))


def _averaged(grad: torch.Tensor, world_size: int) -> torch.Tensor:
    import torch.distributed as dist

    grad = grad.clone()
    dist.all_reduce(grad)
    return grad / world_size


def _steps(model, optimizer, rank: int, steps: int = case.STEPS) -> None:
    for _ in range(steps):
        _common.sum_loss(model, _common.rank_batch(rank)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _sharded(ctx: sc.Ctx, variant: str):
    from torch.distributed.fsdp import fully_shard

    model = case._model()
    if variant.startswith("ignored"):
        case._add_adapter(model)  # present at fully_shard, left out of it
    fully_shard(model.inp, mesh=ctx.mesh)
    ignored = {"ignored_params": {model.adapter.weight}} if variant.startswith("ignored") else {}
    fully_shard(model, mesh=ctx.mesh, **ignored)
    _common.sum_reduction(model, model.inp)
    return model


def run_variant(ctx: sc.Ctx, variant: str, rec: dict[str, Any]) -> None:
    model = _sharded(ctx, variant)
    if variant in ("synced", "frozen"):
        case._add_adapter(model)
    if variant == "frozen":
        model.adapter.weight.requires_grad_(False)
    if variant in ("synced", "ignored_synced"):
        _sync(model.adapter.weight, ctx.world_size)
    if variant == "after_first_step":
        _steps(model, torch.optim.SGD(model.parameters(), lr=case.LR), ctx.rank, steps=1)
        case._add_adapter(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=case.LR)
    _steps(model, optimizer, ctx.rank)
    if model.adapter is not None:
        rec["adapters_apart"] = case._apart(model.adapter.weight, ctx.world_size)
    rec["params"] = _common.full_params(model)


@scenario("unmanaged_trainable_params_guard")
def sc_unmanaged(ctx: sc.Ctx) -> None:
    for variant in CASES:
        with ctx.case(variant, continue_on_error=True) as rec:
            run_variant(ctx, variant, rec)
