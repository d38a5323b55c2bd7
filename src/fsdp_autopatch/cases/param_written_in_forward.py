"""param_written_in_forward's case: ``nn.Embedding(max_norm=...)`` inside a unit renormalizes the rows it
looks up in place, in the unsharded copy that FSDP2 drops at reshard (no upstream issue)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_params, listed, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "fully_shard(nn.Embedding(10, 8, max_norm=1.0)) and the root (a Linear); 2 SGD steps on each rank's own "
    "token ids: the forward renormalizes the looked-up rows in place"
)
ROWS, TOKENS = 10, 6
MAX_NORM = 1.0
STEPS = 2
LR = 0.1


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)  # N(0, 1) rows of 8: norms near 2.8, above max_norm
    return nn.Sequential(nn.Embedding(ROWS, DIM, max_norm=MAX_NORM), nn.Linear(DIM, DIM))


def _ids(rank: int, step: int):
    import torch

    return torch.randint(0, ROWS, (TOKENS,), generator=torch.Generator().manual_seed(300 + 10 * rank + step))


def _loss(model, ids):
    return model(ids).pow(2).sum()


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    fully_shard(model[0], mesh=mesh)
    sum_reduction(fully_shard(model, mesh=mesh), model[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):  # with the guard on, the first forward stops at the embedding's reshard
        _loss(model, _ids(rank, step).to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"params": full_params(model)}


def reference(world_size: int) -> dict[str, Any]:
    """One process: every rank's ids looked up (and their rows renormalized, kept), the mean of the losses."""
    import torch

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        sum(_loss(model, _ids(rank, step)) for rank in range(world_size)).div(world_size).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"params": listed(dict(model.named_parameters()))}
