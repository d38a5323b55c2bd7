"""compiled_autograd_guard scenario: FSDP2's backward under compiled autograd (torchtitan issue 1708).

``compiled_autograd``: ``Sequential(Linear(8, 16), ReLU, Linear(16, 4))``, both Linears and the root
``fully_shard``ed, this rank's own batch (the first layer's input needs no gradient, so its
post-backward is left to the root's final callback), 3 SGD steps (lr 0.1). Cases, in this order:

* ``eager``: the backward as usual (the reference the others are compared with);
* ``compile_forward``: ``torch.compile(model, backend="eager")`` for the forward, the backward
  eager (no compiled autograd): must stay silent and equal ``eager``;
* ``compiled_autograd``: ``with compiled_autograd._enable(torch.compile(backend="eager")):
  loss.backward()`` (the bug: fp32);
* ``compiled_autograd_bf16``: the same with bf16 parameters and fp32 reduce.

Each records the steps it finished, the ``foreach_reduce`` calls it made, the registry's
``fired`` count of the guard after it, its error and (when it finished) the local shards of the
sharded parameters the optimizer updates (after a compiled-autograd backward the modules still
hold the unsharded ones). See ``test_dist_compiled_autograd_guard.py``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from _dist_common import Ctx, _mp_policy, _randn
from _registry import scenario

PATCH = "compiled_autograd_guard"
STEPS, LR = 3, 0.1
BATCH_SEED = 1708
MODEL_SEED = 0
CASES = ("eager", "compile_forward", "compiled_autograd", "compiled_autograd_bf16")


def build() -> nn.Module:
    torch.manual_seed(MODEL_SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def rank_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    seed = BATCH_SEED + 100 * step + rank
    return _randn(seed, 4, 8), _randn(seed + 50, 4, 4)


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x).float(), y)


def compile_unavailable() -> str | None:
    """Why ``torch.compile`` cannot run here, or None (a tiny function, eager backend)."""
    try:
        torch.compile(lambda t: t + 1, backend="eager")(torch.ones(1))
    except Exception as e:  # noqa: BLE001 - the reason is what the test skips with
        return f"{type(e).__name__}: {e}"[:300]
    return None


def _count_reduces() -> dict[str, int]:
    """Count FSDP2's ``foreach_reduce`` calls (outside whatever the plugin put there)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    counts = {"foreach_reduce": 0}
    inner = group_module.foreach_reduce

    def counting(*args, **kwargs):
        counts["foreach_reduce"] += 1
        return inner(*args, **kwargs)

    group_module.foreach_reduce = counting
    return counts


def _fired() -> int:
    import fsdp_autopatch

    return next(p.fired for p in fsdp_autopatch.status().patches if p.name == PATCH)


def _train(ctx: Ctx, rec: dict, case: str) -> None:
    from torch.distributed.fsdp import fully_shard

    model = build()
    kwargs = {"mesh": ctx.mesh, **({"mp_policy": _mp_policy("bf16")} if case.endswith("bf16") else {})}
    for unit in (model[0], model[2], model):
        fully_shard(unit, **kwargs)
    forward = torch.compile(model, backend="eager") if case == "compile_forward" else model
    sharded = dict(model.named_parameters())  # what the optimizer updates (the module may hold others)
    opt = torch.optim.SGD(sharded.values(), lr=LR)
    for step in range(STEPS):
        out = loss(forward, *rank_batch(ctx.rank, step))
        if case.startswith("compiled_autograd"):
            from torch._dynamo import compiled_autograd

            with compiled_autograd._enable(torch.compile(backend="eager")):
                out.backward()
        else:
            out.backward()
        opt.step()
        opt.zero_grad()
        rec["steps"] = step + 1
    rec["weights"] = {name: param.to_local().detach().clone() for name, param in sharded.items()}


@scenario("compiled_autograd_guard")
def sc_compiled_autograd(ctx: Ctx) -> None:
    reason = compile_unavailable()
    ctx.data["compile_unavailable"] = reason
    if reason is not None:
        ctx.save()
        return
    counts = _count_reduces()
    for case in CASES:
        with ctx.case(case, continue_on_error=True) as rec:
            rec["steps"], counts["foreach_reduce"] = 0, 0
            try:
                _train(ctx, rec, case)
            finally:
                rec["reduces"] = counts["foreach_reduce"]
                rec["fired_after"] = _fired()
