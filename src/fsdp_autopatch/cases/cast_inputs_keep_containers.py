"""cast_inputs_keep_containers's case: an MoE-style list of auxiliary losses that each block appends
to, with bf16 ``param_dtype`` (transformers issue 45663 and its kin: the same copy of a caller's
container, there a dict)."""

from __future__ import annotations

from typing import Any

from ._common import DIM, fsdp_api, full_grads, max_diff, rank_batch, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "3 blocks and a root, each fully_shard with param_dtype bf16 / reduce fp32; every block appends an fp32 "
    "auxiliary loss to the list its caller passes; loss = main + sum(aux); one backward"
)
BLOCKS = 3
AUX_WEIGHT = 0.5
BF16_TOLERANCE = 2e-2  # the GPU check: bf16 kernels there against the CPU's bf16 reference


def _model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(DIM, DIM)

        def forward(self, x, aux_losses: list):
            h = torch.tanh(self.linear(x))
            aux_losses.append(AUX_WEIGHT * h.float().pow(2).mean())  # a load-balancing-style term, fp32
            return h

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.head = nn.Linear(DIM, DIM)

        def forward(self, x, aux_losses: list):
            for block in self.blocks:
                x = block(x, aux_losses)
            return self.head(x)

    torch.manual_seed(0)
    return Model()


def _loss(model, batch):
    aux_losses: list = []
    main = model(batch, aux_losses).float().pow(2).mean()
    return main + sum(aux_losses, main.new_zeros(())), len(aux_losses)


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # cast_forward_inputs
    model = _model().to(device)
    units = [fully_shard(block, mesh=mesh, mp_policy=mp) for block in model.blocks]
    sum_reduction(fully_shard(model, mesh=mesh, mp_policy=mp), *units)
    loss, aux_terms = _loss(model, rank_batch(rank, device=device))
    loss.backward()
    return {"grads": full_grads(model), "values": {"aux_terms": aux_terms}}


def reference(world_size: int) -> dict[str, Any]:
    """One process, the model in bf16 (what FSDP2's param_dtype computes with), the fp32 gradients of
    every rank's loss averaged (FSDP2's fp32 reduce)."""
    import torch

    model = _model().to(torch.bfloat16)
    grads: dict[str, Any] = {}
    for rank in range(world_size):
        model.zero_grad(set_to_none=True)
        loss, aux_terms = _loss(model, rank_batch(rank).to(torch.bfloat16))
        loss.backward()
        for name, param in model.named_parameters():
            grads[name] = grads.get(name, 0) + param.grad.float() / world_size
    return {"grads": {name: g.tolist() for name, g in grads.items()}, "values": {"aux_terms": aux_terms}}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the caller sees every block's term, and the gradients equal the reference's within bf16's
    tolerance (the GPU's bf16 kernels round otherwise than the CPU's)."""
    terms, want = record.get("values", {}).get("aux_terms"), reference["values"]["aux_terms"]
    diff = max_diff(record.get("grads", {}), reference["grads"])
    return (terms == want and diff <= BF16_TOLERANCE,
            f"the caller's list holds {terms} of {want} auxiliary losses; max relative |grad - reference| {diff:.1e}")
