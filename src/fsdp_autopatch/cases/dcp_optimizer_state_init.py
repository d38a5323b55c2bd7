"""dcp_optimizer_state_init's case: a DCP checkpoint with a parameter that never had a gradient, loaded
into a fresh model and optimizer (PyTorch issues 192202, 164929)."""

from __future__ import annotations

import tempfile
from typing import Any

from ._common import DIM, fsdp_api, full_params, judge_against_reference, listed, rank_batch

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


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    folder = [tempfile.mkdtemp(prefix="fsdp-autopatch-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)  # one checkpoint folder for every rank
    try:
        model, optim = _sharded(mesh, fully_shard)
        model(rank_batch(rank, device=device)).sum().backward()
        optim.step()
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder[0])
        fresh, fresh_optim = _sharded(mesh, fully_shard)
        model_sd, optim_sd = get_state_dict(fresh, fresh_optim)  # the template a fresh optimizer gives
        try:
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder[0])
        except CheckpointException as error:  # its message is every rank's traceback: the record keeps
            failure = error.failures[min(error.failures)][0]  # what the first failing rank raised
            raise failure if isinstance(failure, Exception) else RuntimeError(str(error)) from error
        step = float(optim_sd["state"]["spare.weight"]["step"])
        return {"params": full_params(fresh), "values": {"spare_step": step}}
    finally:  # dcp.load raises on every rank alike: every rank meets the barrier
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder[0], ignore_errors=True)


def reference(world_size: int) -> dict[str, Any]:
    """One process: the mean of the ranks' losses, one AdamW step (spare, without a gradient, is left
    as it was), and spare's step as it is before its first step: 0."""
    import torch

    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for rank in range(world_size):
        (model(rank_batch(rank)).sum() / world_size).backward()
    optim.step()
    return {"params": listed(dict(model.named_parameters())), "values": {"spare_step": 0.0}}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the loaded weights are the saved run's, and spare.weight's AdamW step is 0 (it never stepped)."""
    params_right, params_text = judge_against_reference(record, reference)
    step = record["values"]["spare_step"]
    text = f"the resume loaded; spare.weight's AdamW step {step:g} (it never stepped); {params_text}"
    return params_right and step == reference["values"]["spare_step"], text
