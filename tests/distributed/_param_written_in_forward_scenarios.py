"""param_written_in_forward's variants (2 gloo ranks), the plugin as installed.

The bug's own run (``nn.Embedding(max_norm=1.0)`` in a unit resharding after forward, 2 SGD steps) is its
case, ``fsdp_autopatch.cases.param_written_in_forward``, whose model the ``written/*`` variants reuse. Each
variant builds a fresh model and optimizer and trains 2 steps (a ``GuardError`` is its recorded error):

- ``written/keep``: the embedding's unit with ``reshard_after_forward=False``: stopped at the
  post-backward reshard; ``written/int``: ``reshard_after_forward=1`` (a post-forward shard): stopped at
  the post-forward reshard; ``written/no_grad``: an evaluation forward under ``no_grad`` first: stopped
  in it (the write is dropped there too);
- nothing written (``Net``: two Linear units and the root, AdamW) and no stop: ``plain/<reshard>`` with
  ``reshard_after_forward`` True, False and 1; ``plain/bf16`` (bf16 ``param_dtype``);
  ``plain/checkpointed`` (each unit under non-reentrant activation checkpointing: the recompute runs in
  backward); ``plain/no_grad`` (an evaluation forward under ``no_grad`` between the steps);
  ``plain/step_while_unsharded`` (units kept unsharded after backward, ``set_reshard_after_backward(False)``,
  ``optimizer.step()`` before the explicit ``model.reshard()``); ``plain/explicit_unshard``
  (``model.unshard()`` before each forward, with prefetching of the second unit).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import _dist_common as sc
from _registry import scenario
from fsdp_autopatch.cases import _common
from fsdp_autopatch.cases import param_written_in_forward as case

STOPPED = ("written/keep", "written/int", "written/no_grad")
LET_THROUGH = ("plain/true", "plain/false", "plain/int", "plain/bf16", "plain/checkpointed", "plain/no_grad",
               "plain/step_while_unsharded", "plain/explicit_unshard")
CASES = (*STOPPED, *LET_THROUGH)
STEPS = 2


class Net(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(sc.DIM, sc.DIM), nn.Linear(sc.DIM, sc.DIM)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in (self.first, self.second):
            if self.checkpointed:
                from torch.utils.checkpoint import checkpoint

                x = checkpoint(lambda t, unit=unit: torch.tanh(unit(t)), x, use_reentrant=False)
            else:
                x = torch.tanh(unit(x))
        return x


def _reshard(variant: str) -> Any:
    return {"keep": False, "false": False, "int": 1}.get(variant.split("/")[1], True)


def run_written(ctx: sc.Ctx, variant: str) -> None:
    from torch.distributed.fsdp import fully_shard

    model = case._model()
    fully_shard(model[0], mesh=ctx.mesh, reshard_after_forward=_reshard(variant))
    _common.sum_reduction(fully_shard(model, mesh=ctx.mesh), model[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=case.LR)
    if variant == "written/no_grad":
        with torch.no_grad():
            model(case._ids(ctx.rank, 99))
    for step in range(STEPS):
        case._loss(model, case._ids(ctx.rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()


def run_plain(ctx: sc.Ctx, variant: str) -> None:
    from torch.distributed.fsdp import fully_shard

    kind = variant.split("/")[1]
    torch.manual_seed(0)
    model = Net(checkpointed=kind == "checkpointed")
    kwargs: dict[str, Any] = {"mesh": ctx.mesh, "reshard_after_forward": _reshard(variant)}
    if kind == "bf16":
        kwargs["mp_policy"] = sc._mp_policy("bf16")
    units = [fully_shard(model.first, **kwargs), fully_shard(model.second, **kwargs)]
    root = fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})
    _common.sum_reduction(root, *units)
    if kind == "step_while_unsharded":
        for module in (root, *units):
            module.set_reshard_after_backward(False)
    if kind == "explicit_unshard":
        units[0].set_modules_to_forward_prefetch([units[1]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        if kind == "explicit_unshard":
            root.unshard()
            units[0].unshard(async_op=True).wait()
        model(_common.rank_batch(ctx.rank)).float().pow(2).sum().backward()
        optimizer.step()  # writes the sharded parameters only
        if kind == "step_while_unsharded":
            root.reshard()
            for unit in units:
                unit.reshard()
        optimizer.zero_grad()
        if kind == "no_grad":
            with torch.no_grad():
                model(_common.rank_batch(ctx.rank, rows=2))


@scenario("param_written_in_forward")
def sc_param_written_in_forward(ctx: sc.Ctx) -> None:
    for variant in CASES:
        with ctx.case(variant, continue_on_error=True):
            (run_written if variant in STOPPED else run_plain)(ctx, variant)
