"""A discarded accumulation window (2 gloo ranks): what ``pending_grads_warning`` and
``zero_grad_discards_pending_grads`` do, under whatever the launch's variables set.

Each variant trains a fresh 2-layer model (fp32 unless said, SGD): a first window of one
micro-batch runs backward with the gradient sync off and is discarded with ``zero_grad()`` (a loop
skipping a NaN), then a window of one micro-batch with the sync on steps the optimizer. DDP's
result applies only the second window; FSDP2 keeps the first and reduces it too.

- ``optimizer_zero_grad``: the window dropped with ``optimizer.zero_grad()``;
- ``model_zero_grad``: with ``model.zero_grad()``;
- ``mixed_precision``: bf16 parameters, fp32 ``reduce_dtype`` (the kept gradient lives in
  ``unsharded_accumulated_grad``);
- ``hsdp``: a 2 x 1 (replicate, shard) mesh with ``set_requires_all_reduce(False)``: the
  reduce-scatter runs and its output waits in ``_partial_reduce_output``;
- ``hsdp_two_optimizers``: the same HSDP run with one optimizer for the weights and one for the
  biases, each zeroed (the partial output is one buffer per unit: dropped once both were zeroed);
- ``hsdp_frozen_bias``: HSDP with the biases frozen (the optimizer never zeroes them);
- ``clean``: the usual loop (two micro-batches, the sync on for the last, ``zero_grad()`` after the
  step): nothing kept at any ``zero_grad()``, never a warning;
- ``step_sync_off``: the sync left off for the last micro-batch's backward, then ``step()``
  (where torch keeps pending gradients itself, an ``FSDPGrad``, that step raises: recorded as the
  variant's error, with the warnings given before it).

Per variant the rank records the full weights after the step and the fsdp-autopatch warnings
given (each variant starts with none: ``_pending_grads.forget``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

import _dist_common as sc
from _registry import scenario
from fsdp_autopatch.cases import _common

DISCARDED = ("optimizer_zero_grad", "model_zero_grad", "mixed_precision", "hsdp", "hsdp_two_optimizers",
             "hsdp_frozen_bias")  # a window dropped by zero_grad()
VARIANTS = (*DISCARDED, "clean", "step_sync_off")
ZERO_GRADS = {"hsdp_two_optimizers": 2}  # zero_grad() calls that meet kept gradients (1 elsewhere)
LR = 0.1
IN, HIDDEN, OUT = 8, 16, 4


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def batch(rank: int, window: int) -> torch.Tensor:
    return torch.randn(4, IN, generator=torch.Generator().manual_seed(1000 * window + rank))


def loss_of(model: torch.nn.Module, rank: int, window: int) -> torch.Tensor:
    return model(batch(rank, window)).float().pow(2).sum()


def reference(world_size: int, windows: tuple[int, ...], frozen_bias: bool = False) -> dict[str, Any]:
    """One SGD step, in one process, on the mean over the ranks of the gradients of ``windows``
    (DDP's result: ``(1,)``; FSDP2 keeping the discarded window: ``(0, 1)``)."""
    model = build()
    if frozen_bias:
        freeze_biases(model)
    for window in windows:
        for rank in range(world_size):
            (loss_of(model, rank, window) / world_size).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {name: p.detach().tolist() for name, p in model.named_parameters()}


def freeze_biases(model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        param.requires_grad_(not name.endswith("bias"))


def _optimizers(model: torch.nn.Module, variant: str) -> list[torch.optim.Optimizer]:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if variant != "hsdp_two_optimizers":
        return [torch.optim.SGD([p for _, p in trainable], lr=LR)]
    return [torch.optim.SGD([p for n, p in trainable if n.endswith(suffix)], lr=LR) for suffix in ("weight", "bias")]


def _sharded(ctx: sc.Ctx, variant: str) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build()
    if variant == "hsdp_frozen_bias":
        freeze_biases(model)
    if variant.startswith("hsdp"):
        mesh = init_device_mesh("cpu", (ctx.world_size, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (ctx.world_size,))
    mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
        if variant == "mixed_precision" else {}
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, **mp)
    fully_shard(model, mesh=mesh, **mp)
    _common.sum_reduction(model[0], model[2], model)
    return model


def _sync(model: Any, variant: str, on: bool) -> None:
    if variant.startswith("hsdp"):
        model.set_requires_all_reduce(on)
    else:
        model.set_requires_gradient_sync(on)


def run_variant(ctx: sc.Ctx, variant: str) -> dict[str, Any]:
    model = _sharded(ctx, variant)
    optimizers = _optimizers(model, variant)
    if variant == "clean":
        _sync(model, variant, False)
        loss_of(model, ctx.rank, 0).backward()
        _sync(model, variant, True)
        loss_of(model, ctx.rank, 1).backward()
        optimizers[0].step()
        optimizers[0].zero_grad()
        return {"params": _common.full_params(model)}
    _sync(model, variant, False)
    loss_of(model, ctx.rank, 0).backward()  # the window the loop discards
    if variant == "model_zero_grad":
        model.zero_grad()
    elif variant != "step_sync_off":
        for optimizer in optimizers:
            optimizer.zero_grad()
    _sync(model, variant, variant != "step_sync_off")
    loss_of(model, ctx.rank, 1).backward()
    for optimizer in optimizers:
        optimizer.step()
    return {"params": _common.full_params(model)}


@scenario("pending_grads_warning")
def sc_pending_grads(ctx: sc.Ctx) -> None:
    from fsdp_autopatch.patches import _pending_grads

    for variant in VARIANTS:
        _pending_grads.forget()  # each variant starts with no warning given
        with ctx.case(variant, continue_on_error=True) as rec:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    rec.update(run_variant(ctx, variant))
                finally:  # also where torch refuses the step (an FSDPGrad not yet synchronized)
                    rec["warnings"] = [str(w.message) for w in caught
                                       if str(w.message).startswith("fsdp-autopatch:")]
    import fsdp_autopatch

    with ctx.case("policies") as rec:  # the policies in force here, and how often each acted
        rec["records"] = {r.name: {"status": r.status.value, "fired": r.fired, "description": r.description}
                          for r in fsdp_autopatch.status().policy_records}
