"""fsdp_module_abc_layout's case: fully_shard on a model class that lists abc.ABC first (PyTorch issue 160068)."""

from __future__ import annotations

from typing import Any

from ._common import (
    DIM,
    fsdp_api,
    full_grads,
    judge_against_reference,
    one_process_grads,
    rank_batch,
    sum_loss,
    sum_reduction,
)

WORLD_SIZE = 2
WHAT = "class Model(abc.ABC, nn.Module) with an abstract hook, its block and itself as units; one backward"

# torch's method resolution order for an FSDP class: FSDP<Name>, FSDPModule, <Name>, ...
MRO = ["FSDPTanhModel", "FSDPModule", "TanhModel"]


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


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _abc_model().to(device)
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the ABC-first class: TypeError without the patch
    sum_reduction(model, model.block)
    sum_loss(model, rank_batch(rank, device=device)).backward()
    mro = [cls.__name__ for cls in type(model).__mro__[: len(MRO)]]
    return {"grads": full_grads(model), "values": {"mro": mro}}


def reference(world_size: int) -> dict[str, Any]:
    return {"grads": one_process_grads(_abc_model, sum_loss, world_size), "values": {"mro": MRO}}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the model is an FSDPModule and still a TanhModel (torch's FSDP class order), and the
    gradients equal the reference's."""
    grads_right, grads_text = judge_against_reference(record, reference)
    mro = record["values"]["mro"]
    kept = mro == reference["values"]["mro"]
    text = (f"fully_shard worked: {mro[0]} is an FSDPModule and still a TanhModel ({kept}; classes "
            f"{', '.join(mro)}); {grads_text}")
    return grads_right and kept, text
