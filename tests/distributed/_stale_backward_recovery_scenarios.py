"""stale_backward_recovery scenarios: the steps after a backward that raised on every rank, in the
recovery loops its case (``zero_grad`` after the exception, then train on) does not show, and the
healthy loops the fix must leave alone.

``stale_backward``: ``Net`` (``fc0`` and ``fc1`` their own units, ``head`` in the root's), plain
SGD. Every case starts from the same weights; each step's batch is ``rank_batch(rank, step)``.

Failure cases (step 0's backward raises ``RuntimeError("injected")`` on every rank, from a tensor
hook on the activation between ``fc0`` and ``fc1``; the loop catches it and trains steps 1 and 2):

* ``failed_kept_grads``: no ``zero_grad`` (the failed backward reduced ``fc1``'s gradient);
* ``failed_reset``: ``zero_grad`` and torch's own ``model.reset_iter_state()``;
* ``failed_hand_reset``: ``zero_grad`` and every ``_training_state`` set to IDLE by hand;
* ``failed_manual`` (torch with ``set_manual_backward_finalization``): ``zero_grad`` after the
  exception (the case's loop) with manual finalization on, ``finalize_backward()`` after each healthy backward.

For each trained step: the local shard of each sharded parameter's gradient (``None`` if none) and
the local weights after ``optimizer.step()``.

Healthy cases (must never fire, and be bitwise equal with and without the patch), two steps each:
``accumulation`` (2 micro-batches, ``set_requires_gradient_sync`` on the last), ``two_losses``
(two losses of one forward, two backwards), ``two_forwards`` (two forwards, one backward),
``checkpointed`` (``fc1`` under composable activation checkpointing: its pre-forward runs again
inside the backward, in PRE_BACKWARD) and ``manual`` (2 micro-batches, manual finalization; where
torch has it). ``fired`` is recorded per case (the registry's count before and after).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from _dist_common import DIM, Ctx, _local, _randn
from _registry import scenario

PATCH = "stale_backward_recovery"
BATCH_SEED = 900
HIDDEN = 16
LR = 0.1
FAILED = ("failed_kept_grads", "failed_reset", "failed_hand_reset", "failed_manual")
HEALTHY = ("accumulation", "two_losses", "two_forwards", "checkpointed", "manual")
MANUAL = ("failed_manual", "manual")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc0 = nn.Linear(DIM, HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, 4)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc0(x))
        if self.fail and h.requires_grad:
            h.register_hook(_raise)
        return self.head(torch.relu(self.fc1(h)))


def _raise(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("injected")


def build() -> Net:
    torch.manual_seed(4321)
    return Net()


def rank_batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    return _randn(BATCH_SEED + 100 * step + 10 * micro + rank, 4, DIM)


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).sum()


def has_manual_finalization() -> bool:
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_manual_backward_finalization")


def _fired() -> int:
    import fsdp_autopatch

    return fsdp_autopatch.status()[PATCH].fired


def _shard(ctx: Ctx, case: str) -> tuple[Net, list[tuple[str, torch.Tensor]], torch.optim.Optimizer]:
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard

    model = build()
    if case == "checkpointed":
        checkpoint(model.fc1)
    for unit in (model.fc0, model.fc1, model):
        fully_shard(unit, mesh=ctx.mesh)
    if case in MANUAL:
        model.set_manual_backward_finalization(True)
    sharded = list(model.named_parameters())  # the optimizer's parameters, whatever FSDP registers later
    return model, sharded, torch.optim.SGD([p for _, p in sharded], lr=LR)


def _backward(model: Net, case: str, x: torch.Tensor) -> None:
    loss(model, x).backward()
    if case in MANUAL:
        model.finalize_backward()


def _fail_once(model: Net, case: str, ctx: Ctx, opt: torch.optim.Optimizer) -> str:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    model.fail = True
    try:
        loss(model, rank_batch(ctx.rank, 0)).backward()
    except RuntimeError as error:
        caught = str(error)
    else:
        caught = "no exception"
    model.fail = False
    if case != "failed_kept_grads":
        opt.zero_grad(set_to_none=True)
    if case == "failed_reset":
        model.reset_iter_state()
    if case == "failed_hand_reset":
        for state in model._get_fsdp_state()._state_ctx.all_states:
            state._training_state = TrainingState.IDLE
            for group in state._fsdp_param_groups:
                group._training_state = TrainingState.IDLE
    return caught


def _healthy_step(model: Net, case: str, ctx: Ctx, step: int) -> None:
    if case in ("accumulation", "manual"):
        for micro in (0, 1):
            if case == "accumulation":
                model.set_requires_gradient_sync(micro == 1)
            _backward(model, case, rank_batch(ctx.rank, step, micro))
    elif case == "two_losses":
        out = model(rank_batch(ctx.rank, step))
        out.pow(2).sum().backward(retain_graph=True)
        out.sum().backward()
    elif case == "two_forwards":
        (loss(model, rank_batch(ctx.rank, step)) + loss(model, rank_batch(ctx.rank, step, 1))).backward()
    else:  # checkpointed
        loss(model, rank_batch(ctx.rank, step)).backward()


def _run_case(ctx: Ctx, case: str, rec: dict) -> None:
    model, sharded, opt = _shard(ctx, case)
    rec["init"] = {n: _local(p) for n, p in sharded}
    fired_before = _fired()
    steps = (1, 2)
    if case in FAILED:
        rec["caught"] = _fail_once(model, case, ctx, opt)
    for step in steps:
        if case in FAILED:
            _backward(model, case, rank_batch(ctx.rank, step))
        else:
            _healthy_step(model, case, ctx, step)
        rec[f"grads{step}"] = {n: None if p.grad is None else _local(p.grad) for n, p in sharded}
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec[f"weights{step}"] = {n: _local(p) for n, p in sharded}
    rec["fired"] = _fired() - fired_before


@scenario("stale_backward_recovery")
def sc_stale_backward(ctx: Ctx) -> None:
    for case in (*FAILED, *HEALTHY):
        if case in MANUAL and not has_manual_finalization():
            continue
        with ctx.case(case, continue_on_error=True) as rec:
            _run_case(ctx, case, rec)
