"""Rank side of ``scripts/gpu_check.py``: the bug cases of the last four patches (fp32, as the
gloo tests and ``demo --bug`` run them), on the check's device.

Each returns ``{"right": bool, "value": str}`` on every rank (rank 0's is reported): process groups
created, gradients / weights / norms against a one-process reference, the attributes kept.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from _gpu_check_net import Ctx, full, max_diff

DIM = 8
MESH_UNITS = 8
WEIGHT_DECAY = 0.5
MAX_NORM = 0.1


def _batch(rank: int, device):
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 + rank)).to(device)


def _sum_loss(model, batch):
    return model(batch).pow(2).sum()


def _sum_reduction(*units) -> None:
    """SUM then divide on every unit where torch has the switch: torch 2.8's gloo reduce-scatter
    sums even for AVG (PyTorch issue 162338); the values are the same as AVG's."""
    for unit in units:
        if hasattr(unit, "set_force_sum_reduction_for_comms"):
            unit.set_force_sum_reduction_for_comms(True)


def _full_grads(model, device) -> dict[str, Any]:
    return {n: full(p.grad, device) for n, p in model.named_parameters() if p.grad is not None}


def _backward_every_rank(model, loss_of, ctx: Ctx) -> None:
    for rank in range(ctx.world_size):
        (loss_of(model, _batch(rank, ctx.device)) / ctx.world_size).backward()


def _grads_verdict(model, build, loss_of, ctx: Ctx) -> tuple[float, bool]:
    grads = _full_grads(model, ctx.device)  # collective: every rank
    if ctx.rank != 0:
        return 0.0, True
    reference = build().to(ctx.device)
    _backward_every_rank(reference, loss_of, ctx)
    diff, differ = max_diff(grads, {n: p.grad for n, p in reference.named_parameters()})
    return diff, not differ and diff <= ctx.fp32_tolerance


def _linear_stack():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(MESH_UNITS)))


def case_e(ctx: Ctx) -> dict[str, Any]:
    """post_forward_mesh_cache: 8 units with reshard_after_forward=2 on one mesh (>= 4 ranks)."""
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.mesh()
    model = _linear_stack()
    before = len(dist.distributed_c10d._world.pg_map)
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)
    created = len(dist.distributed_c10d._world.pg_map) - before
    _sum_reduction(model, *model)
    _sum_loss(model, _batch(ctx.rank, ctx.device)).backward()
    diff, grads_right = _grads_verdict(model, _linear_stack, _sum_loss, ctx)
    value = (f"{MESH_UNITS} units with reshard_after_forward=2 on {ctx.world_size} ranks created {created} "
             f"process groups; max relative |grad - reference| {diff:.1e}")
    return {"right": grads_right and created <= 2, "value": value, "process_groups": created}


def _mtp_model():
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
    return model(batch).pow(2).sum() + model.mtp.aux.pow(2).sum()


def case_f(ctx: Ctx) -> dict[str, Any]:
    """grouped_module_reuse: fully_shard([norm, head]); head called again inside the root's forward."""
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.mesh()
    model = _mtp_model()
    fully_shard(model.layer, mesh=mesh)
    fully_shard([model.norm, model.head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    _sum_reduction(model, model.layer, model.norm)
    _mtp_loss(model, _batch(ctx.rank, ctx.device)).backward()
    diff, right = _grads_verdict(model, _mtp_model, _mtp_loss, ctx)
    return {"right": right, "value": f"backward completed; max relative |grad - reference| {diff:.1e}"}


def _tagged_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, DIM))
    for param in (model[0].bias, model[1].weight, model[1].bias, model[2].bias):
        param.no_weight_decay = True
    model[2].weight.tag = "expert"
    return model


def _user_attributes(model) -> dict[str, list[str]]:
    return {n: sorted(k for k in vars(p) if not k.startswith("_")) for n, p in model.named_parameters()}


def _adamw_step(model) -> None:
    params = list(model.parameters())
    no_decay = [p for p in params if getattr(p, "no_weight_decay", False)]
    decay = [p for p in params if not getattr(p, "no_weight_decay", False)]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=0.1).step()


def case_g(ctx: Ctx) -> dict[str, Any]:
    """keep_param_attributes: marks set before fully_shard pick the AdamW groups after it."""
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.mesh()
    model, reference = _tagged_model(), _tagged_model().to(ctx.device)
    expected = _user_attributes(reference)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kept = _user_attributes(model)
    _sum_reduction(model, *model)
    _sum_loss(model, _batch(ctx.rank, ctx.device)).backward()
    _adamw_step(model)
    weights = {n: full(p, ctx.device) for n, p in model.named_parameters()}  # collective
    if ctx.rank != 0:
        return {"right": True, "value": ""}
    _backward_every_rank(reference, _sum_loss, ctx)
    _adamw_step(reference)
    diff, _ = max_diff(weights, {n: p.detach() for n, p in reference.named_parameters()})
    marked = sorted(n for n in expected if expected[n])
    lost = [n for n in marked if kept[n] != expected[n]]
    value = (f"{len(marked) - len(lost)} of {len(marked)} marked parameters keep their attributes"
             + (f" (lost: {', '.join(lost)})" if lost else "")
             + f"; max relative |weight - reference| after an AdamW step {diff:.1e}")
    return {"right": not lost and diff <= ctx.fp32_tolerance, "value": value}


def _dense_and_expert():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))


def case_h(ctx: Ctx) -> dict[str, Any]:
    """clip_grad_norm_multi_mesh: a dense layer on ("dp",), an expert on ("edp",), clip_grad_norm_."""
    from torch.distributed.fsdp import fully_shard

    dp, edp = ctx.mesh(("dp",)), ctx.mesh(("edp",))
    model = _dense_and_expert()
    expert = fully_shard(model[1], mesh=edp)
    _sum_reduction(expert, fully_shard(model, mesh=dp))
    _sum_loss(model, _batch(ctx.rank, ctx.device)).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    total = total.full_tensor() if hasattr(total, "full_tensor") else total
    grads = _full_grads(model, ctx.device)  # collective
    if ctx.rank != 0:
        return {"right": True, "value": ""}
    reference = _dense_and_expert().to(ctx.device)
    _backward_every_rank(reference, _sum_loss, ctx)
    ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    diff, differ = max_diff(grads, {n: p.grad for n, p in reference.named_parameters()})
    norm_diff = float((total - ref_total).abs())
    value = (f"total norm {float(total):.6f} (reference {float(ref_total):.6f}); "
             f"max relative |clipped grad - reference| {diff:.1e}")
    right = not differ and norm_diff <= ctx.fp32_tolerance * float(ref_total) and diff <= ctx.fp32_tolerance
    return {"right": right, "value": value}


CASES = {"e": case_e, "f": case_f, "g": case_g, "h": case_h}
