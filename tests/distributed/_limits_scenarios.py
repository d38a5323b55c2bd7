"""Scenarios for the documented limit: a whole FSDP unit that runs forward on some ranks only.

Scenarios ``tower_unit_skipped``, ``tower_dummy_forward`` and ``tower_in_parent_unit`` (see
``_registry``); the ``Ctx`` and the models come from ``_dist_common``. See ``test_dist_limits.py``
and ``docs/faq.md``.

Rank 0's micro-batch has images, rank 1's is text-only. The vision tower is
- ``tower_unit_skipped``: its own ``fully_shard`` unit, skipped by rank 1: the tower's forward
  all-gather is issued by rank 0 only (the limit; no patch can fix it);
- ``tower_dummy_forward``: its own unit, run by every rank; rank 1 feeds zeros and multiplies the
  output by 0 (restructure 1: the collectives match and rank 1 contributes an exact zero);
- ``tower_in_parent_unit``: not wrapped on its own, so the parent unit all-gathers it on every rank,
  with ``set_reduce_scatter_unused_params(True)`` (restructure 2: rank 1 has no local gradient for
  the tower, the unused-param fill gives it a zero contribution so the reduce-scatter matches).
"""

from __future__ import annotations

from typing import Any

import torch

import _dist_common as sc
from _registry import scenario


def plan_images_on_rank_0(rank: int, step: int, mb: int) -> dict[str, Any]:
    if rank == 0:
        return sc.batch(rank, step, mb, image=sc.image(rank, step, mb))
    return sc.batch(rank, step, mb)


class TowerOnEveryRank(sc.TextVisionModel):
    """Restructure 1: the tower runs on every rank; text-only rows contribute ``0 * tower(zeros)``."""

    def forward(self, x: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x)
        if image is None:
            dummy = x.new_zeros(x.shape[0], self.IMAGE_DIM)
            h = h + 0.0 * self.tower(dummy)
        else:
            h = h + self.tower(image)
        return self.head(torch.tanh(self.shared(h)))


def _train_one_step(ctx: sc.Ctx, model: torch.nn.Module, rec: dict[str, Any]) -> None:
    ctx.data["init_params"] = sc.params_local(model)
    sc.loss_fn(model, plan_images_on_rank_0(ctx.rank, 0, 0)).backward()
    rec["grads"] = sc.grads_local(model)


@scenario("tower_unit_skipped")
def sc_tower_unit_skipped(ctx: sc.Ctx) -> None:
    from torch.distributed.fsdp import fully_shard

    model = sc.build_model("text_vision")
    fully_shard(model.tower, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    with ctx.case("step") as rec:
        _train_one_step(ctx, model, rec)


@scenario("tower_dummy_forward")
def sc_tower_dummy_forward(ctx: sc.Ctx) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(sc.MODEL_SEED)  # same initial weights as build_model("text_vision")
    model = TowerOnEveryRank()
    fully_shard(model.tower, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    with ctx.case("step") as rec:
        _train_one_step(ctx, model, rec)


@scenario("tower_in_parent_unit")
def sc_tower_in_parent_unit(ctx: sc.Ctx) -> None:
    from torch.distributed.fsdp import fully_shard

    model = sc.build_model("text_vision")
    fully_shard(model, mesh=ctx.mesh)  # the tower's parameters belong to the root unit
    model.set_reduce_scatter_unused_params(True)
    with ctx.case("step") as rec:
        _train_one_step(ctx, model, rec)
