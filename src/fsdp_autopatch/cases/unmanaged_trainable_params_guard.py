"""unmanaged_trainable_params_guard's case: an adapter added after fully_shard, trained by each rank on
its own gradient (transformers PR 48792, FastVideo PR 1666)."""

from __future__ import annotations

from typing import Any

from ._common import (
    DIM,
    fsdp_api,
    full_params,
    judge_against_reference,
    listed,
    rank_batch,
    sgd_steps,
    sum_loss,
    sum_reduction,
)

WORLD_SIZE = 2
WHAT = (
    "two Linear units and the root fully_shard'ed, then a LoRA-like adapter Linear added to the root (the same "
    "initial weights on every rank); 3 SGD steps on each rank's own batch"
)
STEPS = 3
LR = 0.1


def _model():
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, 4)
            self.adapter = None

        def forward(self, x):
            h = self.inp(x)
            if self.adapter is not None:  # the adapter's low-rank update beside the frozen path
                h = h + self.adapter(x)
            return self.out(torch.tanh(h))

    torch.manual_seed(0)
    return Model()


def _add_adapter(model, device: str = "cpu") -> None:
    import torch
    from torch import nn

    torch.manual_seed(1)  # the same initial adapter on every rank, as a PEFT injection with a seed gives
    model.adapter = nn.Linear(DIM, DIM, bias=False).to(device)


def _apart(weight, world_size: int) -> float:
    """The largest difference between the ranks' copies of ``weight`` (a collective)."""
    import torch
    import torch.distributed as dist

    local = weight.detach().contiguous()
    every = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(every, local)
    return max(float((copy - every[0]).abs().max()) for copy in every)


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_reduction(model, model.inp)
    _add_adapter(model, device)  # after fully_shard: a plain parameter FSDP2 never reduces
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):  # with the guard on, the first step raises its GuardError on every rank
        sum_loss(model, rank_batch(rank, device=device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    apart = _apart(model.adapter.weight, world_size)
    return {"params": full_params(model), "values": {"adapters_apart": apart > 0, "adapters_apart_by": apart}}


def reference(world_size: int) -> dict[str, Any]:
    """One process: the adapter trained with the others on the mean of every rank's loss (in sync)."""
    model = _model()
    _add_adapter(model)
    params = listed(dict(sgd_steps(model, STEPS, LR, world_size).named_parameters()))
    return {"params": params, "values": {"adapters_apart": False, "adapters_apart_by": 0.0}}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: one adapter on every rank, and the weights the in-sync reference trains."""
    right, text = judge_against_reference(record, reference)
    apart = record["values"]["adapters_apart_by"]
    return right and apart == 0.0, f"after {STEPS} SGD steps the ranks' adapters are {apart:.2e} apart; {text}"
