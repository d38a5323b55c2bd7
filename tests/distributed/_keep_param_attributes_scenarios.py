"""2-rank scenario for keep_param_attributes: user attributes on parameters across ``fully_shard``.

Scenario ``keep_param_attributes`` (2 gloo ranks; ``_rank`` makes gloo, the CPU mesh and the gloo-AVG
workaround of torch 2.8), the plugin as installed: the attribute kinds, stages, grouped unit and CPU
offload its case does not show. The tests import this module for the model, the marks and the rules.

Model ``AttrsNet``: ``inp = Linear(8, 8)`` (its own unit), ``proj = Linear(8, 8)`` (the root unit,
no marks), ``norm = LayerNorm(8)`` and ``head = Linear(8, 4)`` (one grouped unit,
``fully_shard([norm, head])``). ``MARKS`` are set on the original parameters before
``fully_shard``: public flags, a tag string, a dict, a private name, a tensor and a list holding a
tensor. A rank records, per stage, each parameter's public ``__dict__`` names and the values of
the marked names as the module's current parameter has them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import _dist_common as sc
from _registry import scenario

TENSOR = "<tensor>"  # a mark whose value is a tensor shaped like the parameter
LIST_OF_TENSOR = "<list of tensor>"
MARKS: dict[str, dict[str, Any]] = {
    "inp.weight": {"tag": "dense", "_user_private": 1},
    "inp.bias": {"no_weight_decay": True, "main_grad": TENSOR},
    "proj.weight": {},
    "proj.bias": {},
    "norm.weight": {"no_weight_decay": True, "sequence_parallel": True},
    "norm.bias": {"no_weight_decay": True, "sequence_parallel": True},
    "head.weight": {"tag": "expert0", "meta": {"lr_mult": 0.5}, "buffers": LIST_OF_TENSOR},
    "head.bias": {"no_weight_decay": True},
}
MARK_NAMES = sorted({name for marks in MARKS.values() for name in marks})
WEIGHT_DECAY = 0.5
LR = 0.1
STEPS = 2


class AttrsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(sc.DIM, sc.DIM)
        self.proj = nn.Linear(sc.DIM, sc.DIM)
        self.norm = nn.LayerNorm(sc.DIM)
        self.head = nn.Linear(sc.DIM, sc.OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(torch.relu(self.inp(x))))
        return self.head(self.norm(h))


def build_marked_model() -> AttrsNet:
    torch.manual_seed(sc.MODEL_SEED)
    model = AttrsNet()
    for name, param in model.named_parameters():
        for attribute, value in MARKS[name].items():
            if value == TENSOR:
                value = torch.zeros_like(param)
            elif value == LIST_OF_TENSOR:
                value = [torch.zeros_like(param)]
            setattr(param, attribute, value)
    return model


def expected_carried(name: str) -> dict[str, Any]:
    """The marks of parameter ``name`` that the patch carries: public, holding no tensor."""
    return {k: v for k, v in MARKS[name].items() if not k.startswith("_") and v not in (TENSOR, LIST_OF_TENSOR)}


def optimizer_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """An optimizer builder as frameworks write it: decay unless ``no_weight_decay`` is set."""
    decay = [p for p in model.parameters() if not getattr(p, "no_weight_decay", False)]
    no_decay = [p for p in model.parameters() if getattr(p, "no_weight_decay", False)]
    return decay, no_decay


def build_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, list[str]]:
    decay, no_decay = optimizer_groups(model)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}], lr=LR
    )
    names = {id(p): n for n, p in model.named_parameters()}
    return opt, sorted(names[id(p)] for p in decay)


def plan(rank: int, step: int, mb: int) -> dict[str, Any]:
    return sc.batch(rank, step, mb)


# --- rank side ----------------------------------------------------------------------------


def describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TENSOR
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return LIST_OF_TENSOR
    return value


def public_names(param: Any) -> list[str]:
    return sorted(name for name in vars(param) if not name.startswith("_"))


def marks_of(param: Any) -> dict[str, Any]:
    return {name: describe(vars(param)[name]) for name in MARK_NAMES if name in vars(param)}


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Per parameter, as the module shows it now: public names, marks and its kind."""
    return {
        name: {"public": public_names(p), "marks": marks_of(p), "type": type(p).__name__}
        for name, p in model.named_parameters()
    }


def strict_read(param: Any, name: str) -> str:
    try:
        return repr(getattr(param, name))
    except AttributeError as e:
        return f"AttributeError: {e}"


def shard_units(model: AttrsNet, mesh, **kwargs: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.inp, mesh=mesh, **kwargs)
    fully_shard([model.norm, model.head], mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)


def train_and_snapshot(ctx: sc.Ctx, model: AttrsNet, rec: dict[str, Any]) -> None:
    """Forward, backward and an AdamW step per step; snapshots after each (first step)."""
    seen: dict[str, Any] = {}

    def in_forward(module: nn.Module, args: Any) -> None:  # the module shows the unsharded parameter
        seen["marks"] = marks_of(module.weight)
        seen["type"] = type(module.weight).__name__
        seen["strict_read"] = strict_read(module.weight, "sequence_parallel")

    handle = model.norm.register_forward_pre_hook(in_forward)
    opt, rec["decay_group"] = build_optimizer(model)
    stages = rec["stages"]
    for step in range(STEPS):
        loss = sc.loss_fn(model, plan(ctx.rank, step, 0))
        if step == 0:
            stages["forward"] = snapshot(model)
            rec["in_forward"] = dict(seen)
        loss.backward()
        if step == 0:
            stages["backward"] = snapshot(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stages[f"step{step}"] = snapshot(model)
    handle.remove()
    rec["params_after"] = sc.params_local(model)


def case_attrs(ctx: sc.Ctx, name: str, **shard_kwargs: Any) -> None:
    model = build_marked_model()
    with ctx.case(name) as rec:
        rec["stages"] = stages = {"before": snapshot(model)}
        shard_units(model, ctx.mesh, **shard_kwargs)
        stages["fully_shard"] = snapshot(model)
        model.float()  # Module._apply: swap_tensors swaps a DTensor parameter's __dict__ away
        stages["apply"] = snapshot(model)
        rec["strict_read"] = strict_read(model.norm.weight, "no_weight_decay")
        rec["init_params"] = sc.params_local(model)
        train_and_snapshot(ctx, model, rec)
        model.norm.unshard()  # the grouped unit, explicitly
        stages["unshard"] = snapshot(model)
        model.norm.reshard()
        stages["reshard"] = snapshot(model)
        # a change on the parameters the module shows travels with the next swaps
        model.head.weight.tag = "expert1"
        vars(model.inp.weight).pop("tag", None)
        sc.loss_fn(model, plan(ctx.rank, STEPS, 0)).backward()
        stages["changed"] = snapshot(model)


@scenario("keep_param_attributes")
def sc_keep_attrs(ctx: sc.Ctx) -> None:
    """``default``: the units as above; ``cpu_offload``: the same with ``CPUOffloadPolicy``."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    case_attrs(ctx, "default")
    # pin_memory needs an accelerator: on this CPU-only build CPUOffloadPolicy() fails at fully_shard
    case_attrs(ctx, "cpu_offload", offload_policy=CPUOffloadPolicy(pin_memory=False))
