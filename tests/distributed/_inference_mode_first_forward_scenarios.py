"""inference_mode_first_forward scenarios: an evaluation under ``torch.inference_mode()`` before the
first training step, in the configurations its case (fp32, resharding units) does not show.

Scenario ``inference_mode_first_forward`` (2 gloo ranks). The model: ``Net``, a ``Linear(8, 5)`` unit
(``fully_shard(net.inp)``: 5 rows over 2 ranks, so padded) and the root's ``Linear(5, 4)``; AdamW
built right after ``fully_shard``. Each sequence: one evaluation forward under ``<mode>``, then 2
training steps (forward, ``loss.backward()``, ``step``, gradients recorded, ``zero_grad``).

Configurations (``<config>``): ``bf16/reshard`` (``reshard_after_forward=True``; bf16
``param_dtype``, fp32 ``reduce_dtype``), ``fp32/keep`` and ``bf16/keep``
(``reshard_after_forward=False``), ``hsdp/fp32`` (an HSDP mesh ``(2, 1)``: a shard group of one
rank, FSDP2's copy without all-gather). Cases ``<mode>/<config>``, modes ``inference`` (the bug)
and ``no_grad`` (its reference: what the patch must reproduce); control ``control/after_step``
(fp32, resharding: one training step first, then the evaluation under ``inference_mode``, then a
step: the buffers exist already, the patch must not act). Each case records the evaluation's output, the full parameters
after the steps, the last step's full gradients and the plugin's fired count after it. See
``test_dist_inference_mode_first_forward.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import _dist_common as sc
from _registry import scenario

NAME = "inference_mode_first_forward"
BATCH_SEED = 930
HIDDEN = 5  # uneven over 2 ranks: padded shards
CONFIGS = ("bf16/reshard", "fp32/keep", "bf16/keep", "hsdp/fp32")
BUG_CASES = tuple(f"inference/{config}" for config in CONFIGS)
REFERENCES = tuple(f"no_grad/{config}" for config in CONFIGS)
CONTROLS = ("control/after_step",)
CASES = (*BUG_CASES, *REFERENCES, *CONTROLS)
STEPS = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(sc.DIM, HIDDEN)
        self.out = nn.Linear(HIDDEN, sc.OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


def reference_of(case: str) -> str:
    """The ``no_grad`` case a bug case must equal."""
    return case.replace("inference/", "no_grad/", 1)


def _sharding(ctx: sc.Ctx, config: str) -> dict[str, Any]:
    kind, variant = config.split("/")
    kwargs: dict[str, Any] = {"reshard_after_forward": variant != "keep"}
    if kind == "bf16":
        kwargs["mp_policy"] = sc._mp_policy("bf16")
    if kind == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh("cpu", (ctx.world_size, 1), mesh_dim_names=("replicate", "shard"))
    else:
        kwargs["mesh"] = ctx.mesh
    return kwargs


def _batch(rank: int, step: int) -> torch.Tensor:
    return sc._randn(BATCH_SEED + 10 * rank + step, sc.ROWS_PER_RANK, sc.DIM)


def _fired() -> int:
    records = {p["name"]: p for p in sc.autopatch_status().get("patches", ())}
    return records.get(NAME, {}).get("fired", 0)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> dict[str, torch.Tensor]:
    model(_batch(rank, step)).float().pow(2).sum().backward()
    grads = sc.grads_full(model)
    opt.step()
    opt.zero_grad()
    return grads


def _evaluate(model: nn.Module, mode: str, rank: int) -> torch.Tensor:
    with torch.inference_mode() if mode == "inference" else torch.no_grad():
        return model(_batch(rank, -1)).float().clone()


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def run_sequence(ctx: sc.Ctx, rec: dict[str, Any], config: str, mode: str, train_first: bool = False) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(sc.MODEL_SEED)
    model = Net()
    kwargs = _sharding(ctx, config)
    fully_shard(model.inp, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    if train_first:
        _train_step(model, opt, ctx.rank, 100)
    rec["eval"] = _evaluate(model, mode, ctx.rank)
    rec["fired_after_eval"] = _fired()
    for step in range(STEPS):
        rec["grads"] = _train_step(model, opt, ctx.rank, step)
    rec["params"] = _full_params(model)
    rec["fired_after"] = _fired()


@scenario("inference_mode_first_forward")
def sc_inference_first_forward(ctx: sc.Ctx) -> None:
    for case in CASES:
        with ctx.case(case, continue_on_error=True) as rec:
            if case in CONTROLS:
                run_sequence(ctx, rec, "fp32/reshard", "inference", train_first=True)
            else:
                mode, config = case.split("/", 1)
                run_sequence(ctx, rec, config, mode)
