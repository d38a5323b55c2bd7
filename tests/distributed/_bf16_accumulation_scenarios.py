"""bf16 gradient accumulation scenarios (LlamaFactory issue 9769): what doctor's hint states.

Scenario ``bf16_accumulation`` (``run_ranks("bf16_accumulation")``, 2 gloo ranks; see ``_registry``).
The test imports this module for the model, the data and the one-process references.

Model: ``Linear(64, 256) -> GELU -> Linear(256, 64)``, fp32 parameters, each ``Linear`` its own unit
plus the root. Every rank runs ``args["micro_batches"]`` micro-batches of 8 samples with
``set_requires_gradient_sync(False)`` on all but the last, each micro-batch's loss divided by their
number. One case per ``MixedPrecisionPolicy``: ``fp32`` (none), ``bf16/None`` (param_dtype bf16, no
reduce_dtype), ``bf16/bf16`` and ``bf16/fp32``. Recorded per case: the full gradients and the dtype
FSDP2 held the first unit's unsharded gradient in before the last micro-batch.

No FSDP2 internals are changed here: no patch is involved (the plugin's patches stay as they are).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import _dist_common as sc
from _registry import scenario

IN, HIDDEN, SAMPLES = 64, 256, 8
CONFIGS = ("fp32", "bf16/None", "bf16/bf16", "bf16/fp32")
_REDUCE = {"None": None, "bf16": torch.bfloat16, "fp32": torch.float32}


def build(dtype: torch.dtype | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, IN))
    return model.to(dtype) if dtype is not None else model


def micro_batches(rank: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(SAMPLES, IN, generator=generator) for _ in range(count)]


def loss_of(model: nn.Module, x: torch.Tensor, count: int) -> torch.Tensor:
    return model(x).float().pow(2).mean() / count


def fp64_model_grads(count: int, world_size: int = sc.WORLD_SIZE) -> list[torch.Tensor]:
    """The same model and data in fp64, ranks averaged as FSDP2 does: what training wants."""
    model = build(torch.float64)
    for rank in range(world_size):
        for x in micro_batches(rank, count):
            (loss_of(model, x.double(), count) / world_size).backward()
    return [p.grad for p in model.parameters()]


def exact_sum_of_bf16_grads(count: int, world_size: int = sc.WORLD_SIZE) -> list[torch.Tensor]:
    """A bf16 copy of the model, one backward per micro-batch, the bf16 gradients summed in fp64:
    the exact accumulation of the micro-batch gradients FSDP2 computes with param_dtype=bf16."""
    model = build(torch.bfloat16)
    total = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for rank in range(world_size):
        for x in micro_batches(rank, count):
            model.zero_grad(set_to_none=True)
            loss_of(model, x.bfloat16(), count).backward()
            for t, p in zip(total, model.parameters()):
                t += p.grad.double() / world_size
    return total


def relative_error(grads: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    num = sum(float((g.double() - r).pow(2).sum()) for g, r in zip(grads, ref))
    den = sum(float(r.pow(2).sum()) for r in ref)
    return (num / den) ** 0.5


# --- rank side ---------------------------------------------------------------------------------


def _policy(config: str) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if config == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=_REDUCE[config.split("/")[1]])


def _accumulation_dtype(unit: nn.Module) -> str:
    """The dtype the unit's first unsharded gradient waits in between micro-batches."""
    fsdp_param = unit._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
    waiting = getattr(fsdp_param, "unsharded_accumulated_grad", None)  # torch <= 2.14 with reduce_dtype
    if waiting is None:
        waiting = fsdp_param._unsharded_param.grad
    return str(waiting.dtype).replace("torch.", "") if waiting is not None else "none"


def _accumulate(ctx: sc.Ctx, config: str, count: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = build()
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=ctx.mesh, mp_policy=_policy(config))
    accumulated_in = "none"
    for i, x in enumerate(micro_batches(ctx.rank, count)):
        model.set_requires_gradient_sync(i == count - 1)
        loss_of(model, x, count).backward()
        if i == count - 2:
            accumulated_in = _accumulation_dtype(model[0])
    return {"grads": [p.grad.full_tensor().double() for p in model.parameters()], "accumulated_in": accumulated_in}


@scenario("bf16_accumulation")
def sc_bf16_accumulation(ctx: sc.Ctx) -> None:
    count = int(ctx.args["micro_batches"])
    for config in CONFIGS:
        with ctx.case(config) as rec:
            rec.update(_accumulate(ctx, config, count))
