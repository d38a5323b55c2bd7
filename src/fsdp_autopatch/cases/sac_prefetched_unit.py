"""sac_prefetched_unit's case: a unit unsharded before a selective-checkpointing region (NeMo Automodel
issue 3958, torchtitan issue 3427)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_grads, one_process_grads, rank_batch, sum_loss, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "three Linear units and a root; the middle one runs inside checkpoint(..., context_fn=SAC contexts, "
    "policy saving mm/addmm) and was unshard()ed before the region; one backward"
)


def _policy(ctx, func, *args, **kwargs):
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _model():
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l0, self.l1, self.l2 = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
            self.sac = False  # the one-process reference runs without checkpointing

        def block(self, h):
            return torch.relu(self.l1(h)) + h

        def forward(self, x):
            if not self.sac:
                return self.l2(self.block(self.l0(x)))
            from functools import partial

            from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

            self.l1.unshard()  # a manual prefetch, before the region
            h = self.l0(x)
            context_fn = partial(create_selective_checkpoint_contexts, _policy)
            return self.l2(checkpoint(self.block, h, use_reentrant=False, context_fn=context_fn))

    torch.manual_seed(0)
    return Model()


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    for unit in (model.l0, model.l1, model.l2, model):
        fully_shard(unit, mesh=mesh)
    sum_reduction(model, model.l0, model.l1, model.l2)
    model.sac = True
    sum_loss(model, rank_batch(rank, device=device)).backward()  # every rank raises at the same recomputed op
    return {"grads": full_grads(model)}


def reference(world_size: int) -> dict[str, Any]:
    return {"grads": one_process_grads(_model, sum_loss, world_size)}  # without checkpointing
