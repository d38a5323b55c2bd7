"""reshard_stale_unsharded scenarios: the triggers its case (``set_reshard_after_backward(False)`` on
every step) does not show, and the loops the fix must leave alone.

The case's model (two units and a root-owned head), SGD, 3 steps; each step has ``MICRO`` micro-batches
(``rank_batch(rank, 2 * step + micro)``), and every variant starts from the same weights:

* ``nograd_eval``: one micro-batch; the root without ``reshard_after_forward`` (kept unsharded after
  forward) and an evaluation forward under ``torch.no_grad()`` between ``backward()`` and ``step()``;
* ``every_micro``: ``set_reshard_after_backward(False)`` on both micro-batches, the sync off on the
  first only (meant for the first micro-batch only);
* ``window``: the same with ``set_reshard_after_backward(True)`` on the last micro-batch (VeOmni's
  loop): healthy; ``kept`` records whether every unit kept its unsharded copy after the first
  micro-batch (the API's point);
* ``hsdp_window``: HSDP on a ``(2, 1)`` mesh, the first micro-batch with ``set_requires_all_reduce(False)``
  (reduce-scatter, no all-reduce) and every micro-batch with ``set_reshard_after_backward(False)``;
* ``healthy``: the defaults, one micro-batch.

Recorded per variant: the full weights after the steps (``params``), ``kept``, and ``fired``.
"""

from __future__ import annotations

import torch

from _dist_common import Ctx
from _registry import scenario
from fsdp_autopatch.cases import reshard_stale_unsharded as case
from fsdp_autopatch.cases._common import rank_batch, sum_loss

PATCH = "reshard_stale_unsharded"
MICRO = 2
VARIANTS = ("nograd_eval", "every_micro", "window", "hsdp_window", "healthy")
ONE_MICRO = ("nograd_eval", "healthy")


def micro_batches(variant: str) -> int:
    return 1 if variant in ONE_MICRO else MICRO


def batch(rank: int, step: int, micro: int) -> torch.Tensor:
    return rank_batch(rank + 10 * (MICRO * step + micro))


def _fired() -> int:
    import fsdp_autopatch

    return fsdp_autopatch.status()[PATCH].fired


def _groups(model) -> list:
    return [g for s in model._get_fsdp_state()._state_ctx.all_states for g in s._fsdp_param_groups]


def _run(ctx: Ctx, variant: str, rec: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.mesh
    if variant == "hsdp_window":
        mesh = init_device_mesh("cpu", (ctx.world_size, 1), mesh_dim_names=("replicate", "shard"))
    model = case._model()
    units = (model[0], model[2], model)
    for unit in units:
        fully_shard(unit, mesh=mesh)
        unit.set_force_sum_reduction_for_comms(True)
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(params.values(), lr=case.LR)
    fired_before, kept = _fired(), []
    for step in range(case.STEPS):
        for micro in range(micro_batches(variant)):
            last = micro == micro_batches(variant) - 1
            if variant in ("every_micro", "window"):
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last and variant == "window")
            elif variant == "hsdp_window":
                model.set_requires_all_reduce(last)
                model.set_reshard_after_backward(False)
            sum_loss(model, batch(ctx.rank, step, micro)).backward()
            if not last:
                kept.append(all(group.is_unsharded for group in _groups(model)))
        if variant == "nograd_eval":
            with torch.no_grad():
                model(batch(ctx.rank, step, 1))
        optimizer.step()
        optimizer.zero_grad()
    rec["fired"] = _fired() - fired_before
    rec["kept"] = kept
    rec["params"] = {name: p.full_tensor().detach().clone() for name, p in params.items()}


@scenario("reshard_stale_unsharded")
def sc_reshard_stale_unsharded(ctx: Ctx) -> None:
    for variant in VARIANTS:
        with ctx.case(variant, continue_on_error=True) as rec:
            _run(ctx, variant, rec)


def reference(variant: str, world_size: int = 2) -> dict[str, torch.Tensor]:
    """One process: per step, the mean over ranks of every micro-batch's loss, then SGD."""
    model = case._model()
    optimizer = torch.optim.SGD(model.parameters(), lr=case.LR)
    for step in range(case.STEPS):
        for micro in range(micro_batches(variant)):
            for rank in range(world_size):
                (sum_loss(model, batch(rank, step, micro)) / world_size).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}
