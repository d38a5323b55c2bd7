"""``demo --bug fsdp_module_abc_layout``: ``fully_shard`` on a model class that lists ``abc.ABC`` first."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, grads_verdict, rank_batch, sum_loss, sum_reduction

WORLD_SIZE = 2
WHAT = "class Model(abc.ABC, nn.Module) with an abstract hook, its block and itself as units; one backward"


def _abc_model():
    import abc

    import torch
    from torch import nn

    class Model(abc.ABC, nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, 4)

        @abc.abstractmethod
        def activation(self, x): ...

        def forward(self, x):
            return self.head(self.activation(self.block(x)))

    class TanhModel(Model):
        def activation(self, x):
            return torch.tanh(x)

    torch.manual_seed(0)
    return TanhModel()


def show(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    _, init_device_mesh, fully_shard = fsdp_api()
    from torch.distributed.fsdp import FSDPModule

    mesh = init_device_mesh(device, (world_size,))
    model = _abc_model().to(device)
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the ABC-first class: TypeError without the patch
    sum_reduction(model, model.block)
    sum_loss(model, rank_batch(rank, device=device)).backward()
    diff, grads_right = grads_verdict(model, _abc_model, sum_loss, world_size, rank)
    kept = isinstance(model, FSDPModule) and type(model).__mro__[2].__name__ == "TanhModel"
    value = (f"fully_shard worked: {type(model).__name__} is an FSDPModule and still a TanhModel ({kept}); "
             f"max relative |grad - reference| {diff:.1e}")
    return {"right": grads_right and kept, "value": value}
