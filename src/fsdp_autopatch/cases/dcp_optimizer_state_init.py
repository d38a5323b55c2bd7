"""``demo --bug dcp_optimizer_state_init``: a DCP checkpoint with a parameter that never had a
gradient, loaded into a fresh model and optimizer."""

from __future__ import annotations

import tempfile
from typing import Any

from ._common import DIM, fsdp_api, rank_batch

WORLD_SIZE = 2
WHAT = (
    "fully_shard(block), fully_shard(spare) and the root, spare in no forward; AdamW, one step, "
    "dcp.save(get_state_dict(...)), then a fresh model and optimizer: get_state_dict as the template, dcp.load"
)


def _model():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block, self.spare, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 4)

        def forward(self, x):  # spare: in no forward
            return self.head(self.block(x).tanh())

    torch.manual_seed(0)
    return Net()


def _sharded(mesh, fully_shard):
    import torch

    model = _model().to(mesh.device_type)
    for unit in (model.block, model.spare, model):
        fully_shard(unit, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)


def show(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    folder = [tempfile.mkdtemp(prefix="fsdp-autopatch-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)  # one checkpoint folder for every rank
    model, optim = _sharded(mesh, fully_shard)
    model(rank_batch(rank, device=device)).sum().backward()
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder[0])
    fresh, fresh_optim = _sharded(mesh, fully_shard)
    model_sd, optim_sd = get_state_dict(fresh, fresh_optim)  # the template a fresh optimizer gives
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder[0])
    step = float(optim_sd["state"]["spare.weight"]["step"])
    return {"right": step == 0.0, "value": f"the resume loaded; spare.weight's AdamW step {step:g} (it never stepped)"}
