"""gradient_divide_factor_single_rank scenario: ``set_gradient_divide_factor`` on a one-rank shard group.

``divide_factor_single_rank``: 2 gloo ranks; ``Sequential(Linear(8, 16), ReLU, Linear(16, 4))``
with ``fully_shard`` on both Linears and the root, ``set_gradient_divide_factor(FACTOR)`` on
every FSDP module (the setter acts on the module's own parameters only), one backward of this
rank's batch; the full gradients recorded per case:

* ``hsdp_2x1_sum``: HSDP mesh ``(2, 1)`` (replicate 2, shard 1: one-rank shard group),
  ``set_force_sum_reduction_for_comms(True)`` on every module, fp32 (the bug);
* ``hsdp_2x1_fp16``: the same mesh, ``reduce_dtype=float16`` (the sum path without force-sum);
* ``shard_1x2_sum`` / ``shard_1x2_fp16``: the same on mesh ``(1, 2)`` (a 2-rank shard group: torch
  is right there);
* ``hsdp_2x1_default``: mesh ``(2, 1)``, the factor without force-sum (the PREMUL_SUM path, whose
  reduce-scatter the dividing one-rank copy replaces: torch is right there; last, since releases
  without that copy may raise in it: gloo has no PREMUL_SUM reduce-scatter).

Right: each equals the one-process reference (sum over the ranks' gradients / FACTOR).
See ``test_dist_gradient_divide_factor_single_rank.py``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from _dist_common import Ctx, _randn, grads_full
from _registry import scenario

FACTOR = 4.0
BATCH_SEED = 900
MODEL_SEED = 4321
DIM_NAMES = ("replicate", "shard")
# case -> (mesh shape, force sum, reduce dtype)
CASES = {
    "hsdp_2x1_sum": ((2, 1), True, None),
    "hsdp_2x1_fp16": ((2, 1), False, torch.float16),
    "shard_1x2_sum": ((1, 2), True, None),
    "shard_1x2_fp16": ((1, 2), False, torch.float16),
    "hsdp_2x1_default": ((2, 1), False, None),
}
BUGGY = ("hsdp_2x1_sum", "hsdp_2x1_fp16")  # the ones a one-rank copy divides twice
TWIN = {"hsdp_2x1_sum": "shard_1x2_sum", "hsdp_2x1_fp16": "shard_1x2_fp16"}


def build() -> nn.Module:
    torch.manual_seed(MODEL_SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _randn(BATCH_SEED + rank, 6, 8), _randn(BATCH_SEED + 50 + rank, 6, 4)


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def reference_grads(world_size: int = 2) -> dict[str, torch.Tensor]:
    """One process: the sum of every rank's gradient, divided by FACTOR (what the factor means)."""
    model = build()
    for rank in range(world_size):
        loss(model, rank_batch(rank)).backward()
    return {name: param.grad / FACTOR for name, param in model.named_parameters()}


def _shard(model: nn.Module, mesh, force_sum: bool, reduce_dtype) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(FACTOR)
            if force_sum:
                unit.set_force_sum_reduction_for_comms(True)


@scenario("gradient_divide_factor_single_rank")
def sc_divide_factor_single_rank(ctx: Ctx) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {shape: init_device_mesh("cpu", shape, mesh_dim_names=DIM_NAMES) for shape in ((2, 1), (1, 2))}
    for case, (shape, force_sum, reduce_dtype) in CASES.items():
        with ctx.case(case, continue_on_error=True) as rec:
            model = build()
            _shard(model, meshes[shape], force_sum, reduce_dtype)
            rec["shard_group_size"] = meshes[shape]["shard"].size()
            loss(model, rank_batch(ctx.rank)).backward()
            rec["full_grads"] = grads_full(model)
