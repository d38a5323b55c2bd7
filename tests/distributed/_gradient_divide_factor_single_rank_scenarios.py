"""gradient_divide_factor_single_rank scenarios: the paths around its case (fp32 force-sum on an HSDP
``(2, 1)`` mesh, a one-rank shard group), on the case's model and batch.

2 gloo ranks; ``fully_shard`` on both Linears and the root, ``set_gradient_divide_factor(FACTOR)`` on
every FSDP module (the setter acts on the module's own parameters only), one backward of this rank's
batch; the full gradients recorded per variant:

* ``hsdp_2x1_fp16``: HSDP mesh ``(2, 1)``, ``reduce_dtype=float16`` (the sum path without force-sum:
  divided twice too);
* ``shard_1x2_sum`` / ``shard_1x2_fp16``: the case and the fp16 variant on mesh ``(1, 2)`` (a 2-rank
  shard group: torch is right there);
* ``hsdp_2x1_default``: mesh ``(2, 1)``, the factor without force-sum (the PREMUL_SUM path, whose
  reduce-scatter the dividing one-rank copy replaces: torch is right there; last, since releases
  without that copy may raise in it: gloo has no PREMUL_SUM reduce-scatter).

Right: each equals the case's one-process reference (sum over the ranks' gradients / FACTOR).
See ``test_dist_gradient_divide_factor_single_rank.py``.
"""

from __future__ import annotations

import torch

from _dist_common import Ctx, grads_full
from _registry import scenario
from fsdp_autopatch.cases import gradient_divide_factor_single_rank as case
from fsdp_autopatch.cases._common import rank_batch, sum_loss

FACTOR = case.FACTOR
DIM_NAMES = ("replicate", "shard")
# variant -> (mesh shape, force sum, reduce dtype)
CASES = {
    "hsdp_2x1_fp16": ((2, 1), False, torch.float16),
    "shard_1x2_sum": ((1, 2), True, None),
    "shard_1x2_fp16": ((1, 2), False, torch.float16),
    "hsdp_2x1_default": ((2, 1), False, None),
}
BUGGY = ("hsdp_2x1_fp16",)  # the one a one-rank copy divides twice
TWIN = {"hsdp_2x1_fp16": "shard_1x2_fp16"}


def reference_grads(world_size: int = 2) -> dict[str, torch.Tensor]:
    """The case's one process: the sum of every rank's gradient, divided by FACTOR."""
    return {name: torch.tensor(grad) for name, grad in case.reference(world_size)["grads"].items()}


def _shard(model: torch.nn.Module, mesh, force_sum: bool, reduce_dtype) -> None:
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
    for variant, (shape, force_sum, reduce_dtype) in CASES.items():
        with ctx.case(variant, continue_on_error=True) as rec:
            model = case._model()
            _shard(model, meshes[shape], force_sum, reduce_dtype)
            rec["shard_group_size"] = meshes[shape]["shard"].size()
            sum_loss(model, rank_batch(ctx.rank)).backward()
            rec["full_grads"] = grads_full(model)
