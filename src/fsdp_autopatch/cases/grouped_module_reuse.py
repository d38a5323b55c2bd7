"""grouped_module_reuse's case: a grouped unit's head called again inside the root's forward (PyTorch issue 183702)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_grads, one_process_grads, rank_batch, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "a grouped unit fully_shard([norm, head]) whose head runs again for an auxiliary output kept on a "
    "module attribute; one backward"
)


def _mtp_model():
    import torch
    from torch import nn

    class Mtp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(DIM, DIM)
            self.aux = None

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.norm = nn.Linear(DIM, DIM), nn.LayerNorm(DIM)
            self.head, self.mtp = nn.Linear(DIM, 4, bias=False), Mtp()

        def forward(self, x):
            h = torch.relu(self.layer(x))
            logits = self.head(self.norm(h))
            self.mtp.aux = self.head(self.mtp.proj(h))  # kept aside, not returned (MTP-style)
            return logits

    torch.manual_seed(0)
    return Model()


def _mtp_loss(model, batch):
    logits = model(batch)
    return logits.pow(2).sum() + model.mtp.aux.pow(2).sum()


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _mtp_model().to(device)
    fully_shard(model.layer, mesh=mesh)
    fully_shard([model.norm, model.head], mesh=mesh)  # one unit over two modules
    fully_shard(model, mesh=mesh)
    sum_reduction(model, model.layer, model.norm)
    _mtp_loss(model, rank_batch(rank, device=device)).backward()
    return {"grads": full_grads(model)}


def reference(world_size: int) -> dict[str, Any]:
    return {"grads": one_process_grads(_mtp_model, _mtp_loss, world_size)}
