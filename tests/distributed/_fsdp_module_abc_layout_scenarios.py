"""fsdp_module_abc_layout scenario: ``fully_shard`` on module classes that list ``abc.ABC`` first.

``abc_layout``: ``AbcNet(abc.ABC, nn.Module)`` holds two ``Block(abc.ABC, nn.Module)`` (each its
own unit, with an abstract method the block implements and a ``super()`` call in ``forward``) and
a plain ``nn.LayerNorm`` (its own unit: a class torch already handles). Case ``bf16`` (bf16
parameters, fp32 reduce): ``fully_shard`` on the blocks, the norm and the root; one forward and
backward of ``loss`` on this rank's batch; the classes' facts and the full gradients recorded. The
ABC-first root alone in fp32 is the entry's case (``fsdp_autopatch.cases.fsdp_module_abc_layout``).
See ``test_dist_fsdp_module_abc_layout.py``.
"""

from __future__ import annotations

import abc

import torch
import torch.nn as nn

from _dist_common import DIM, Ctx, _mp_policy, _randn, grads_full
from _registry import scenario

BATCH_SEED = 700


class Block(abc.ABC, nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    @abc.abstractmethod
    def activation(self, x: torch.Tensor) -> torch.Tensor: ...

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.fc(x))


class TanhBlock(Block):
    def activation(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


class AbcNet(abc.ABC, nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TanhBlock(), TanhBlock()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build() -> AbcNet:
    torch.manual_seed(1234)
    return AbcNet()


def rank_batch(rank: int) -> torch.Tensor:
    return _randn(BATCH_SEED + rank, 4, DIM)


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).sum()


def _facts(model: nn.Module) -> dict[str, object]:
    from torch.distributed.fsdp import FSDPModule

    units = {"root": model, "block0": model.blocks[0], "block1": model.blocks[1], "norm": model.norm}
    return {
        "is_fsdp_module": {name: isinstance(unit, FSDPModule) for name, unit in units.items()},
        "keeps_class": {
            "root": isinstance(model, AbcNet), "block0": isinstance(model.blocks[0], TanhBlock),
            "norm": isinstance(model.norm, nn.LayerNorm),
        },
        "mro": {name: [c.__name__ for c in type(unit).__mro__] for name, unit in units.items()},
        # the plain class's FSDP class is torch's own: built by type(), not by a metaclass of ours
        "norm_metaclass": type(type(model.norm)).__name__,
    }


@scenario("fsdp_module_abc_layout")
def sc_abc_layout(ctx: Ctx) -> None:
    from torch.distributed.fsdp import fully_shard

    with ctx.case("bf16", continue_on_error=True) as rec:
        model = build()
        for unit in (*model.blocks, model.norm, model):
            fully_shard(unit, mesh=ctx.mesh, mp_policy=_mp_policy("bf16"))
        rec.update(_facts(model))
        loss(model, rank_batch(ctx.rank)).backward()
        rec["full_grads"] = grads_full(model)
