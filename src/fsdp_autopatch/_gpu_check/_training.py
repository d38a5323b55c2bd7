"""Rank side of ``fsdp-autopatch gpu-check``: the training flavours (eager, per-block ``torch.compile``,
CPU offload with pinned memory), the first four bugs at once in the MoE model they share. The entries'
bug cases are their case modules (``_entries.py``).

Every flavour takes the rank's :class:`._net.Ctx` and returns, on every rank,
``{"right": bool, "value": str}`` (rank 0's verdict is the one reported): what was measured against
a one-process reference (gradients), ``grad is None`` and unchanged weights for the expert no rank
used, a falling loss. An exception is the case's outcome (the rank program records it).
"""

from __future__ import annotations

from typing import Any

from . import _net as net
from ._net import Ctx, Micro

UNUSED = "moe.experts.2."  # the expert no rank routes to


def _seed(rank: int, micro: int) -> int:
    return 100 + 10 * rank + micro


def _route_some_unused(ctx: Ctx, rank: int) -> tuple[int, ...]:
    """Rank 0 runs experts 0 and 1, every other rank expert 0 only; nobody runs expert 2."""
    return (0, 1) if rank == 0 else (0,)


def _grads_text(run: dict[str, Any]) -> str:
    text = f"max relative |grad - reference| {run['worst']:.1e}"
    if run["mismatched"]:
        text += f"; gradient on one side only: {', '.join(run['mismatched'][:4])}"
    return text


def _grads_right(run: dict[str, Any]) -> bool:
    return not run["mismatched"] and run["worst"] <= net.BF16_TOLERANCE


def _unused_text(run: dict[str, Any]) -> tuple[bool, str]:
    none_always, unchanged = net.untouched(run, UNUSED)
    moved = max(float((run["final"][n] - run["params"][0][n]).abs().max()) for n in run["final"]
                if n.startswith(UNUSED))
    text = (f"expert 2 (used by no rank): grad {'None' if none_always else 'a tensor (zero)'} after each backward, "
            f"weights {'bitwise unchanged' if unchanged else f'moved by {moved:.1e}'}")
    return none_always and unchanged, text


def _train_flavour(ctx: Ctx, *, compiled: bool = False, offload: bool = False) -> dict[str, Any]:
    """The first four bugs at once, as the demo's model meets them: a tower skipped by the text-only
    micro-batch (a), ranks with different experts (b, from 2 ranks), fp32-accumulated gradients
    next to bf16 zeros of the fill (c), an expert no rank used (d); bf16 params, fp32 reduce."""
    plan = [[Micro(_seed(r, 0), False, _route_some_unused(ctx, r)),
             Micro(_seed(r, 1), True, _route_some_unused(ctx, r))]
            for r in range(ctx.world_size)]
    model = net.shard(net.build(True), ctx, compiled=compiled, offload=offload)
    run = net.train(model, ctx, plan, 2, fill=True, tower=True)
    unused_right, unused_text = _unused_text(run)
    falls = run["losses"][-1] < run["losses"][0]
    value = f"{unused_text}; others: {_grads_text(run)}; loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}"
    if offload:
        where = {p.to_local().device.type for p in model.parameters()}
        pinned = all(p.to_local().is_pinned() for p in model.parameters())
        value += f"; sharded parameters on {', '.join(sorted(where))}, pinned: {pinned}"
        unused_right = unused_right and where == {"cpu"} and pinned
    return {"right": unused_right and _grads_right(run) and falls, "value": value}


def case_train_eager(ctx: Ctx) -> dict[str, Any]:
    return _train_flavour(ctx)


def case_train_compile(ctx: Ctx) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    counters.clear()
    result = _train_flavour(ctx, compiled=True)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    result["value"] = (f"torch.compile(backend={ctx.compile_backend!r}) of the tower and MoE blocks: {graphs} "
                       f"graphs compiled, {breaks} graph breaks; " + result["value"])
    result["right"] = result["right"] and graphs > 0
    return result


def case_train_offload(ctx: Ctx) -> dict[str, Any]:
    result = _train_flavour(ctx, offload=True)
    result["value"] = "CPUOffloadPolicy(pin_memory=True); " + result["value"]
    return result


CASES = {
    "train_eager": case_train_eager,
    "train_compile": case_train_compile,
    "train_offload": case_train_offload,
}
