"""frozen_first_mp_dtypes's case: progressive unfreezing under bf16 mixed precision with an fp32
``reduce_dtype``; a unit frozen at the first forward and unfrozen later (PyTorch issue 186998, PR 187376)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_params, listed, max_diff, rank_batch, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "fully_shard(first, last: 2 Linear) and the root, param_dtype bf16 / reduce_dtype fp32; first frozen for "
    "the first SGD step, then unfrozen for 2 more (the first backward after unfreezing reduces its gradients)"
)
FROZEN_STEPS, STEPS = 1, 3
LR = 0.1
BF16_TOLERANCE = 2e-2  # bf16 compute against the fp32 reference


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))


def _loss(model, batch):
    return model(batch).float().pow(2).sum()


def _train(model, step_loss) -> None:
    """SGD with the first Linear frozen for ``FROZEN_STEPS`` steps, then trained with the rest."""
    import torch

    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # a frozen parameter without a grad is skipped
    for step in range(STEPS):
        if step == FROZEN_STEPS:
            model[0].requires_grad_(True)
        step_loss(model).backward()
        optimizer.step()
        optimizer.zero_grad()


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _model().to(device)
    fully_shard(model[0], mesh=mesh, mp_policy=mp)
    fully_shard(model[2], mesh=mesh, mp_policy=mp)
    sum_reduction(fully_shard(model, mesh=mesh, mp_policy=mp), model[0], model[2])
    _train(model, lambda m: _loss(m, rank_batch(rank, device=device)))
    return {"params": full_params(model)}


def reference(world_size: int) -> dict[str, Any]:
    """One process, fp32: the same freezing schedule on the mean of every rank's loss."""
    model = _model()
    _train(model, lambda m: sum(_loss(m, rank_batch(rank)) for rank in range(world_size)) / world_size)
    return {"params": listed(dict(model.named_parameters()))}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the unfrozen unit trained, its weights the reference's within bf16's tolerance."""
    diff = max_diff(record.get("params", {}), reference["params"])
    return diff <= BF16_TOLERANCE, (f"{STEPS} SGD steps, the first unit unfrozen after {FROZEN_STEPS}; max relative "
                                    f"|weight - reference| {diff:.1e} (bf16 tolerance {BF16_TOLERANCE:g})")
