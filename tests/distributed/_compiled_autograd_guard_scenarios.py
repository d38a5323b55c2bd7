"""compiled_autograd_guard scenarios: around its case (an fp32 backward under compiled autograd), on
the case's model, batch and SGD steps (both Linears and the root ``fully_shard``ed). Variants, in
this order (``args["cases"]`` runs a subset):

* ``eager``: the backward as usual (the reference the others are compared with);
* ``compile_forward``: ``torch.compile(model, backend="eager")`` for the forward, the backward
  eager (no compiled autograd): must stay silent and equal ``eager``;
* ``compiled_autograd_bf16``: ``with compiled_autograd._enable(torch.compile(backend="eager")):
  loss.backward()`` with bf16 parameters and fp32 reduce.

Each records the steps it finished, the ``foreach_reduce`` calls it made, the registry's
``fired`` count of the guard after it, its error and (when it finished) the local shards of the
sharded parameters the optimizer updates (after a compiled-autograd backward the modules still
hold the unsharded ones). See ``test_dist_compiled_autograd_guard.py``.
"""

from __future__ import annotations

import torch

from _dist_common import Ctx, _mp_policy
from _registry import scenario
from fsdp_autopatch.cases import compiled_autograd_guard as case
from fsdp_autopatch.cases._common import rank_batch

PATCH = "compiled_autograd_guard"
CASES = ("eager", "compile_forward", "compiled_autograd_bf16")


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


def _train(ctx: Ctx, rec: dict, variant: str) -> None:
    from torch.distributed.fsdp import fully_shard

    model = case._model()
    kwargs = {"mesh": ctx.mesh, **({"mp_policy": _mp_policy("bf16")} if variant.endswith("bf16") else {})}
    for unit in (model[0], model[2], model):
        fully_shard(unit, **kwargs)
    forward = torch.compile(model, backend="eager") if variant == "compile_forward" else model
    sharded = dict(model.named_parameters())  # what the optimizer updates (the module may hold others)
    opt = torch.optim.SGD(sharded.values(), lr=case.LR)
    for step in range(case.STEPS):
        out = forward(rank_batch(ctx.rank)).float().pow(2).sum()  # the case's sum_loss, in fp32
        if variant.startswith("compiled_autograd"):
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
    for variant in ctx.args.get("cases", CASES):
        with ctx.case(variant, continue_on_error=True) as rec:
            rec["steps"], counts["foreach_reduce"] = 0, 0
            try:
                _train(ctx, rec, variant)
            finally:
                rec["reduces"] = counts["foreach_reduce"]
                rec["fired_after"] = _fired()
