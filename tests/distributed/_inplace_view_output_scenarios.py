"""inplace_view_output scenarios (PyTorch issue 181832): a unit's output view modified in place, the
ways its case (``transpose/fp32``: a transpose, ``mul_``, fp32) does not show.

Scenario ``inplace_view_output`` (2 gloo ranks). The model: ``pre = Linear(8, 8)`` (the root's own
parameters) and ``block``, its own unit (``fully_shard(block)``: reshard after forward), whose
``lin = Linear(8, 8)`` output is returned as a view; the root's forward (the caller) modifies that
output in place, then the loss is ``out.float().pow(2).sum()``.

Cases ``<kind>/<variant>``; kinds (the view, and the caller's in-place op):

- ``transpose``: ``lin(h).transpose(0, 1)``, then ``out.mul_(2)``;
- ``view``: ``lin(h).view(-1)``, then ``out += 1`` (``add_``);
- ``linear3d``: ``lin(h)`` on a 3-D input (a view of the 2-D matmul on torch 2.13, not on 2.15:
  PyTorch PR 194077), then ``out.masked_fill_(mask, 0)`` (every third element);

variants: ``fp32``; ``ac`` (the block's body under ``torch.utils.checkpoint``,
``use_reentrant=False``); ``bf16`` (bf16 parameters, fp32 reduce); every pair but the case's
``transpose/fp32`` (``build`` still makes it: ``_coexistence_scenarios`` trains it). Controls, the bug cannot strike:
``control/no_inplace`` (transpose, ``out = out * 2``) and ``control/not_view`` (``lin`` on a 2-D
input, not a view, ``out.mul_(2)``). Each case records the full gradients, whether the output was
a view, and the plugin's fired count after it. See ``test_dist_inplace_view_output.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import _dist_common as sc
from _registry import scenario

BATCH_SEED = 810
KINDS = ("transpose", "view", "linear3d")
VARIANTS = ("fp32", "ac", "bf16")
THE_CASE = "transpose/fp32"  # fsdp_autopatch.cases.inplace_view_output, run by test_dist_cases
BUG_CASES = tuple(f"{kind}/{variant}" for kind in KINDS for variant in VARIANTS if f"{kind}/{variant}" != THE_CASE)
CONTROLS = ("control/no_inplace", "control/not_view")
CASES = (*BUG_CASES, *CONTROLS)


class Block(nn.Module):
    def __init__(self, kind: str, checkpointed: bool) -> None:
        super().__init__()
        self.kind, self.checkpointed = kind, checkpointed
        self.lin = nn.Linear(sc.DIM, sc.DIM)

    def body(self, h: torch.Tensor) -> torch.Tensor:
        y = self.lin(h)
        if self.kind == "transpose":
            return y.transpose(0, 1)
        if self.kind == "view":
            return y.view(-1)
        return y  # linear3d, not_view: what nn.Linear returns

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.body, h, use_reentrant=False)
        return self.body(h)


class Net(nn.Module):
    def __init__(self, kind: str, checkpointed: bool = False, in_place: bool = True) -> None:
        super().__init__()
        self.in_place = in_place
        self.pre = nn.Linear(sc.DIM, sc.DIM)
        self.block = Block(kind, checkpointed)
        self.out_was_view: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(torch.tanh(self.pre(x)))
        self.out_was_view = out._is_view()
        kind = self.block.kind
        if not self.in_place:
            return out * 2
        if kind == "view":
            out += 1.0
        elif kind == "linear3d":
            out.masked_fill_(torch.arange(out.numel()).view(out.shape) % 3 == 0, 0.0)
        else:  # transpose, not_view
            out.mul_(2.0)
        return out


def parse(case: str) -> dict[str, Any]:
    """A case's model arguments and mixed precision."""
    kind, variant = case.split("/")
    if kind == "control":
        return {"kind": "not_view" if variant == "not_view" else "transpose",
                "in_place": variant == "not_view", "checkpointed": False, "mp": None}
    mp = "bf16" if variant == "bf16" else None
    return {"kind": kind, "in_place": True, "checkpointed": variant == "ac", "mp": mp}


def build(case: str) -> Net:
    spec = parse(case)
    torch.manual_seed(sc.MODEL_SEED)
    return Net(spec["kind"], spec["checkpointed"], spec["in_place"])


def rank_batch(case: str, rank: int) -> torch.Tensor:
    shape = (2, 3, sc.DIM) if parse(case)["kind"] == "linear3d" else (sc.ROWS_PER_RANK, sc.DIM)
    return sc._randn(BATCH_SEED + rank, *shape)


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).sum()


def _fired() -> int:
    records = {p["name"]: p for p in sc.autopatch_status().get("patches", ())}
    return records.get("inplace_view_output", {}).get("fired", 0)


@scenario("inplace_view_output")
def sc_inplace_view(ctx: sc.Ctx) -> None:
    from torch.distributed.fsdp import fully_shard

    for case in CASES:
        with ctx.case(case, continue_on_error=True) as rec:
            spec = parse(case)
            model = build(case)
            kwargs = {"mesh": ctx.mesh, **({"mp_policy": sc._mp_policy(spec["mp"])} if spec["mp"] else {})}
            fully_shard(model.block, **kwargs)
            fully_shard(model, **kwargs)
            value = loss(model, rank_batch(case, ctx.rank))
            rec["out_was_view"] = model.out_was_view
            value.backward()
            rec["full_grads"] = sc.grads_full(model)
            rec["fired_after"] = _fired()
