"""cast_inputs_keep_containers's variants (2 gloo ranks), the plugin as installed or the entry off.

The bug's own run (a list of auxiliary losses) is its case. Here 3 blocks and a root, each
``fully_shard`` with bf16 ``param_dtype`` / fp32 ``reduce_dtype``; the root builds the containers
and hands them to every block:

- ``dict/empty``: a Gemma-3n-style ``shared_kv_states`` dict, empty: block 0 stores its key, block 2
  reads it (no tensor in the dict is cast when block 0 gets it: the unit gets the caller's dict);
- ``dict/fp32``: the same dict, also holding an fp32 tensor every block reads (cast: the unit gets
  torch's copy, whose new key must reach the caller's dict before block 2);
- ``nested``: a dict holding an fp32 scale and an aux-loss list the blocks append to (a copied
  dict around a list that is the caller's own at first, copied once it holds fp32 terms);
- ``unchanged``: a tuple, a NamedTuple, a dataclass and a dict of fp32 tensors and a list, read by
  every block and changed by none: must stay bitwise equal off and on, and fire nothing.

Each records ``grads`` (full, fp32) and ``values``: the aux terms the caller saw, and the entry's
fires during the variant.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
import torch.nn as nn

import _dist_common as sc
from _registry import scenario

NAME = "cast_inputs_keep_containers"
VARIANTS = ("dict/empty", "dict/fp32", "nested", "unchanged")
BUGGED = ("dict/empty", "dict/fp32")  # KeyError without the entry
DIM = 8
BLOCKS = 3


class Pair(NamedTuple):
    scale: torch.Tensor
    shift: torch.Tensor


@dataclasses.dataclass
class Extra:
    bias: torch.Tensor
    note: str = "unchanged"


class Block(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x, variant: str, box: Any):
        h = torch.tanh(self.linear(x))
        if variant.startswith("dict/"):
            if self.index == 0:
                box["kv"] = h * 0.5  # the key a later layer reads
            if self.index == BLOCKS - 1:
                h = h + box["kv"]
            if "scale" in box:
                h = h * box["scale"]
        elif variant == "nested":
            h = h * box["scale"]
            box["aux"].append(0.5 * h.float().pow(2).mean())
        else:
            plain, pair, extra, mapping = box
            h = h * plain[0] + pair.shift + extra.bias + mapping["w"] * mapping["rest"][0]
        return h


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(BLOCKS))
        self.head = nn.Linear(DIM, DIM)
        self.reference_dtype = None  # the one-process reference casts the containers' tensors as FSDP2 does

    def forward(self, x, variant: str, aux: list):
        box = containers(variant, x.device, self.reference_dtype)
        for block in self.blocks:
            x = block(x, variant, box)
        if variant == "nested":
            aux.extend(box["aux"])
        return self.head(x)


def containers(variant: str, device, dtype=None) -> Any:
    fp32 = torch.linspace(0.5, 1.5, DIM, device=device)  # fp32 whatever the compute dtype: cast by FSDP2

    def leaf(factor: float) -> torch.Tensor:
        value = fp32 * factor
        return value if dtype is None else value.to(dtype)

    if variant == "dict/empty":
        return {}
    if variant == "dict/fp32":
        return {"scale": leaf(1.0)}
    if variant == "nested":
        return {"scale": leaf(1.0), "aux": []}
    return ((leaf(1.0), 3), Pair(leaf(1.0), leaf(0.1)), Extra(leaf(0.2)), {"w": leaf(1.0), "rest": [leaf(0.3)]})


def model() -> Model:
    torch.manual_seed(sc.MODEL_SEED)
    return Model()


def batch(rank: int) -> torch.Tensor:
    return torch.randn(sc.ROWS_PER_RANK, DIM, generator=torch.Generator().manual_seed(700 + rank))


def loss_of(net: nn.Module, x: torch.Tensor, variant: str) -> tuple[torch.Tensor, int]:
    aux: list = []
    main = net(x, variant, aux).float().pow(2).mean()
    return main + sum(aux, main.new_zeros(())), len(aux)


def reference(variant: str, world_size: int = sc.WORLD_SIZE) -> dict[str, Any]:
    """One process, the model in bf16, every rank's fp32 gradients averaged."""
    net = model().to(torch.bfloat16)
    net.reference_dtype = torch.bfloat16
    grads: dict[str, torch.Tensor] = {}
    for rank in range(world_size):
        net.zero_grad(set_to_none=True)
        loss, aux_terms = loss_of(net, batch(rank).to(torch.bfloat16), variant)
        loss.backward()
        for name, param in net.named_parameters():
            grads[name] = grads.get(name, 0) + param.grad.float() / world_size
    return {"grads": grads, "aux_terms": aux_terms}


def _fired() -> int:
    records = {p["name"]: p for p in sc.autopatch_status().get("patches", ())}
    return records.get(NAME, {}).get("fired", 0)


@scenario("cast_inputs_keep_containers")
def sc_cast_inputs_keep_containers(ctx: sc.Ctx) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for variant in VARIANTS:
        with ctx.case(variant, continue_on_error=True) as rec:
            fired = _fired()
            net = model()
            for unit in (*net.blocks, net):
                fully_shard(unit, mesh=ctx.mesh, mp_policy=mp).set_force_sum_reduction_for_comms(True)
            loss, aux_terms = loss_of(net, batch(ctx.rank), variant)
            loss.backward()
            rec["grads"] = sc.grads_full(net)
            rec["values"] = {"aux_terms": aux_terms, "fired": _fired() - fired}
