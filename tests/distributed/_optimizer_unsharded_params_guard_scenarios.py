"""optimizer_unsharded_params_guard scenarios: the right ways around its case (an optimizer built
after a no-grad forward, on the root's unsharded parameters), which the guard must let through.

The case's model (two ``Linear`` units and a ``head`` the root owns), ``fully_shard(root)`` without
``reshard_after_forward`` except in ``explicit_reshard``; a no-grad forward (an eval pass, a shape
probe); then the case's SGD steps on this rank's batch:

* ``optimizer_first``: the optimizer built before the no-grad forward;
* ``reshard``: ``model.reshard()`` after the no-grad forward, then the optimizer;
* ``explicit_reshard``: ``fully_shard(root, reshard_after_forward=True)``, then the optimizer.

Each records which parameters the optimizer got (DTensor or plain), and the full weights before the
no-grad forward and after training. See ``test_dist_optimizer_unsharded_params_guard.py``.
"""

from __future__ import annotations

import torch

from _dist_common import Ctx
from _registry import scenario
from fsdp_autopatch.cases import optimizer_unsharded_params_guard as case
from fsdp_autopatch.cases._common import full_param_tensors, rank_batch, sum_loss, sum_reduction

CASES = ("optimizer_first", "reshard", "explicit_reshard")


def _kinds(optimizer: torch.optim.Optimizer) -> list[str]:
    from torch.distributed.tensor import DTensor

    return ["DTensor" if isinstance(p, DTensor) else "plain" for g in optimizer.param_groups for p in g["params"]]


def _case(ctx: Ctx, variant: str) -> None:
    from torch.distributed.fsdp import fully_shard

    with ctx.case(variant, continue_on_error=True) as rec:
        model = case._model()
        fully_shard(model[0], mesh=ctx.mesh)
        fully_shard(model[1], mesh=ctx.mesh)
        fully_shard(model, mesh=ctx.mesh, **({"reshard_after_forward": True} if variant == "explicit_reshard" else {}))
        sum_reduction(model, model[0], model[1])
        rec["init"] = full_param_tensors(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=case.LR) if variant == "optimizer_first" else None
        with torch.no_grad():
            model(rank_batch(ctx.rank))
        if variant == "reshard":
            model.reshard()
        optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=case.LR)
        rec["optimizer_params"] = _kinds(optimizer)
        for _ in range(case.STEPS):
            sum_loss(model, rank_batch(ctx.rank)).backward()
            optimizer.step()
            optimizer.zero_grad()
        rec["final"] = full_param_tensors(model)


@scenario("optimizer_unsharded_params_guard")
def sc_optimizer_unsharded(ctx: Ctx) -> None:
    for variant in CASES:
        _case(ctx, variant)
