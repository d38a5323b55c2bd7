"""dcp_optimizer_state_init scenarios: a DCP save, then a fresh model and optimizer that load it, and
both runs train on; what its case (``spare`` without a gradient, one step, save, load) does not show.

``dcp_resume``: ``Net`` (``block`` and ``spare`` their own units, ``head`` in the root's), AdamW
with weight decay; ``spare`` is in no rank's forward. Each case saves
``{"model", "optim"}`` from ``get_state_dict`` with ``dcp.save`` into ``args["dir"]/<case>``,
builds a new model and optimizer, takes ``get_state_dict`` of them as the load template,
``dcp.load`` + ``set_state_dict``, and trains on; the run that saved trains on too (a checkpointing
loop that goes on). Recorded per case: the error of the load (if any), and the local shards of
every parameter and of the optimizer state (``step``, ``exp_avg``, ``exp_avg_sq``) of both runs
after the last step.

* ``fill_resume``: the unused-param fill on (``set_reduce_scatter_unused_params(True)``); 2 steps,
  save, 1 more step. ``spare``'s gradient is ``None`` (restore_unused_param_grads), so AdamW has no
  state for it at the save;
* ``step0``: the save before the first ``optimizer.step()``; 3 steps after the load, against 3 steps
  of a run that never checkpointed (PyTorch issue 164929).

``fired`` is recorded per case. A failed load is recorded as the case's ``error`` (DCP's
``CheckpointException`` is a ``BaseException``, which ``Ctx.case`` lets through).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from _dist_common import DIM, Ctx, _local, _randn
from _registry import scenario

PATCH = "dcp_optimizer_state_init"
HIDDEN = 16
CASES = ("fill_resume", "step0")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(DIM, HIDDEN)
        self.spare = nn.Linear(DIM, HIDDEN)  # in no rank's forward
        self.head = nn.Linear(HIDDEN, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(x)))


def _shard(ctx: Ctx, fill: bool) -> tuple[Net, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(77)
    model = Net()
    for unit in (model.block, model.spare, model):
        fully_shard(unit, mesh=ctx.mesh)
        if fill:
            unit.set_reduce_scatter_unused_params(True)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _step(model: Net, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    model(_randn(500 + 10 * step + rank, 4, DIM)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _local_state(model: Net, opt: torch.optim.Optimizer) -> dict:
    params = {p: n for n, p in model.named_parameters()}
    return {
        "params": {n: _local(p) for n, p in model.named_parameters()},
        "optim": {params[p]: {k: _local(v) for k, v in s.items()} for p, s in opt.state.items()},
    }


def _fired() -> int:
    import fsdp_autopatch

    return fsdp_autopatch.status()[PATCH].fired


def _save(model: Net, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _load(ctx: Ctx, fill: bool, path: str) -> tuple[Net, torch.optim.Optimizer]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _shard(ctx, fill)
    model_sd, optim_sd = get_state_dict(model, opt)  # the template a fresh optimizer gives
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


def _run_case(ctx: Ctx, case: str, rec: dict) -> None:
    fill = case == "fill_resume"
    path = os.path.join(ctx.args["dir"], case)
    fired_before = _fired()
    before, after = (0, 3) if case == "step0" else (2, 1)
    model, opt = _shard(ctx, fill)
    for step in range(before):
        _step(model, opt, ctx.rank, step)
    rec["spare_has_state"] = any(len(opt.state.get(p, ())) > 0 for p in model.spare.parameters())
    # step 0: the run that goes on never checkpointed (torch's dummy step would touch the saver's state)
    uninterrupted = _shard(ctx, fill) if case == "step0" else (model, opt)
    _save(model, opt, path)
    try:
        resumed = _load(ctx, fill, path)
    except BaseException as error:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        rec["error"] = {"type": type(error).__name__, "message": str(error)}
        return
    for step in range(before, before + after):
        for run in (uninterrupted, resumed):
            _step(*run, ctx.rank, step)
    rec["uninterrupted"] = _local_state(*uninterrupted)
    rec["resumed"] = _local_state(*resumed)
    rec["fired"] = _fired() - fired_before


@scenario("dcp_optimizer_state_init")
def sc_dcp_resume(ctx: Ctx) -> None:
    import torch.distributed.checkpoint.state_dict  # noqa: F401  (the module the fix waits for)

    for case in CASES:
        with ctx.case(case, continue_on_error=True) as rec:
            _run_case(ctx, case, rec)
