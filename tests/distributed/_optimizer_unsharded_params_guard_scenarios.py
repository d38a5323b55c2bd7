"""optimizer_unsharded_params_guard scenario: an optimizer built after a no-grad forward.

``optimizer_unsharded``: ``Net`` = two ``Linear`` layers (each its own unit) and a ``head``
``Linear`` the root owns; ``fully_shard(root)`` without ``reshard_after_forward`` (except case
``explicit_reshard``). Every case trains 3 SGD steps on this rank's rows of the batch; cases, in
this order (the bug case last, so that the registry's ``fired`` counts only its stop):

* ``optimizer_first``: optimizer built before the first forward, then a no-grad forward (eval);
* ``reshard``: a no-grad forward, ``model.reshard()``, then the optimizer;
* ``explicit_reshard``: ``fully_shard(root, reshard_after_forward=True)``, a no-grad forward, then
  the optimizer;
* ``bug``: a no-grad forward, then the optimizer (it gets the root's unsharded parameters).

Each case records which parameters the optimizer got (DTensor or plain), the full weights before
the no-grad forward and after training, or the error. See ``test_dist_optimizer_unsharded_params_guard.py``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from _dist_common import DIM, OUT, Ctx, batch
from _registry import scenario

STEPS = 3
LR = 0.1
CASES = ("optimizer_first", "reshard", "explicit_reshard", "bug")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.head = nn.Linear(DIM, OUT)  # the root's own parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    inputs = batch(rank, step, 0)
    return F.mse_loss(model(inputs["x"]), inputs["target"])


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()
    }


def _kinds(optimizer: torch.optim.Optimizer) -> list[str]:
    from torch.distributed.tensor import DTensor

    return ["DTensor" if isinstance(p, DTensor) else "plain" for g in optimizer.param_groups for p in g["params"]]


def _case(ctx: Ctx, case: str) -> None:
    from torch.distributed.fsdp import fully_shard

    with ctx.case(case, continue_on_error=True) as rec:
        model = build()
        for layer in model.layers:
            fully_shard(layer, mesh=ctx.mesh)
        fully_shard(model, mesh=ctx.mesh, **({"reshard_after_forward": True} if case == "explicit_reshard" else {}))
        rec["init"] = full_weights(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR) if case == "optimizer_first" else None
        with torch.no_grad():  # an eval pass, a shape probe
            model(batch(ctx.rank, 0, 0)["x"])
        if case == "reshard":
            model.reshard()
        optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=LR)
        rec["optimizer_params"] = _kinds(optimizer)
        for step in range(STEPS):
            loss(model, ctx.rank, step).backward()
            optimizer.step()
            optimizer.zero_grad()
        rec["final"] = full_weights(model)


@scenario("optimizer_unsharded_params_guard")
def sc_optimizer_unsharded(ctx: Ctx) -> None:
    for case in CASES:
        _case(ctx, case)
