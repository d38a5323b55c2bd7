"""sac_prefetched_unit scenarios (NeMo Automodel issue 3958): SAC over an FSDP2 unit unsharded before
it, the ways its case (``l1.unshard()`` before the region) does not show.

Scenario ``sac_prefetched_unit`` (2 gloo ranks). The model: a root with three ``Linear(8, 8)``
units ``l0``, ``l1``, ``l2`` (each ``fully_shard``-ed, then the root); ``l1`` runs inside a region
checkpointed with selective activation checkpointing (``checkpoint(block, h, use_reentrant=False,
context_fn=partial(create_selective_checkpoint_contexts, policy))``), whose block is ``l1`` and
user ops FSDP2 also dispatches (``split``, ``cat``, ``view``). Two SGD steps (lr 0.1) per case.

Cases (``POLICY``: save ``aten.mm`` / ``aten.addmm``, recompute the rest, unless named):

- ``prefetch``: ``model.l0.set_modules_to_forward_prefetch([model.l1])``;
- ``save_all``: no prefetch, a policy saving every op (the silent variant: without the patch the
  recompute takes FSDP2's cached copy-out and the gradients are wrong);
- ``control``: no prefetch, the mm/addmm policy (the bug cannot strike).

Each case records the full gradients of both steps and the plugin's fired count after it. See
``test_dist_sac_prefetched_unit.py``.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

import _dist_common as sc
from _registry import scenario

NAME = "sac_prefetched_unit"
BATCH_SEED = 930
STEPS = 2
LR = 0.1
CASES = ("prefetch", "save_all", "control")


def policy(kind: str):
    from torch.utils.checkpoint import CheckpointPolicy

    def decide(ctx, func, *args, **kwargs):
        if kind == "save_all" or func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return decide


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(sc.DIM, sc.DIM), nn.Linear(sc.DIM, sc.DIM), nn.Linear(sc.DIM, sc.DIM)
        self.policy: str | None = None  # None: no checkpointing (the one-process reference)

    def block(self, h: torch.Tensor) -> torch.Tensor:
        y = self.l1(h)
        a, b = torch.split(y, sc.DIM // 2, dim=-1)
        z = torch.cat([torch.relu(a), b.sin()], dim=-1).view(-1, sc.DIM)
        return z * 2 + h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l0(x)
        if self.policy is None:
            h = self.block(h)
        else:
            from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

            context_fn = partial(create_selective_checkpoint_contexts, policy(self.policy))
            h = checkpoint(self.block, h, use_reentrant=False, context_fn=context_fn)
        return self.l2(h).sum()


def build() -> Net:
    torch.manual_seed(sc.MODEL_SEED)
    return Net()


def rank_batch(rank: int, step: int) -> torch.Tensor:
    return sc._randn(BATCH_SEED + 10 * step + rank, sc.ROWS_PER_RANK, sc.DIM)


def reference_grads() -> list[dict[str, torch.Tensor]]:
    """One process, no checkpointing: each step's gradient of the mean of the ranks' losses."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for step in range(STEPS):
        opt.zero_grad()
        (sum(model(rank_batch(rank, step)) for rank in range(sc.WORLD_SIZE)) / sc.WORLD_SIZE).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return grads


def _fired() -> int:
    records = {p["name"]: p for p in sc.autopatch_status().get("patches", ())}
    return records.get(NAME, {}).get("fired", 0)


@scenario("sac_prefetched_unit")
def sc_sac_prefetched_unit(ctx: sc.Ctx) -> None:
    from torch.distributed.fsdp import fully_shard

    for case in CASES:
        with ctx.case(case, continue_on_error=True) as rec:
            model = build()
            model.policy = "save_all" if case == "save_all" else "mm"
            for unit in (model.l0, model.l1, model.l2, model):
                fully_shard(unit, mesh=ctx.mesh)
            if case == "prefetch":
                model.l0.set_modules_to_forward_prefetch([model.l1])
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            fired_before = _fired()
            rec["steps"] = []
            for step in range(STEPS):
                opt.zero_grad()
                model(rank_batch(ctx.rank, step)).backward()
                rec["steps"].append(sc.grads_full(model))
                opt.step()
            rec["fired"] = _fired() - fired_before
        torch.distributed.barrier()
