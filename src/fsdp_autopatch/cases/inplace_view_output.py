"""inplace_view_output's case: a unit's output view modified in place by its caller (PyTorch issue 181832)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_grads, one_process_grads, rank_batch, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "fully_shard(block) whose forward returns lin(x).transpose(0, 1); the caller modifies that output in "
    "place (out.mul_(2)); one backward"
)


def _model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(DIM, DIM)

        def forward(self, x):
            return self.lin(x).transpose(0, 1)  # a view of lin's output

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre, self.block = nn.Linear(DIM, DIM), Block()

        def forward(self, x):
            out = self.block(torch.tanh(self.pre(x)))
            out.mul_(2.0)  # the caller's in-place op on the view
            return out

    torch.manual_seed(0)
    return Model()


def _loss(model, batch):
    return model(batch).pow(2).sum()


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import warnings

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    fully_shard(model.block, mesh=mesh)  # reshards after forward
    fully_shard(model, mesh=mesh)
    sum_reduction(model, model.block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.13+ warns of the view (PyTorch PR 181850)
        loss = _loss(model, rank_batch(rank, device=device))
    loss.backward()
    return {"grads": full_grads(model)}


def reference(world_size: int) -> dict[str, Any]:
    return {"grads": one_process_grads(_model, _loss, world_size)}
