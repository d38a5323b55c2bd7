"""Rank side of ``scripts/gpu_check.py``: the bug cases of the first four patches and the training
flavours (eager, per-block ``torch.compile``, CPU offload with pinned memory).

Every case takes the rank's :class:`_gpu_check_net.Ctx` and returns, on every rank,
``{"right": bool, "value": str}`` (rank 0's verdict is the one reported): what was measured against
a one-process reference (gradients), ``grad is None`` and unchanged weights for the expert no rank
used, a falling loss. An exception is the case's outcome (the rank program records it).
"""

from __future__ import annotations

from typing import Any

import _gpu_check_net as net
from _gpu_check_net import Ctx, Micro

UNUSED = "moe.experts.2."  # the expert no rank routes to in cases d and train


def _seed(rank: int, micro: int) -> int:
    return 100 + 10 * rank + micro


def _route_some_unused(ctx: Ctx, rank: int) -> tuple[int, ...]:
    """Rank 0 runs experts 0 and 1, every other rank expert 0 only; nobody runs expert 2."""
    return (0, 1) if rank == 0 else (0,)


def _route_all_used(ctx: Ctx, rank: int) -> tuple[int, ...]:
    """Ranks run different experts and every expert runs somewhere (all three on one rank)."""
    if ctx.world_size == 1:
        return (0, 1, 2)
    return {0: (0, 1), 1: (0, 2)}.get(rank, (0,))


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


def case_a(ctx: Ctx) -> dict[str, Any]:
    """accumulated_grad_guard: the tower unit skips the first (text-only) micro-batch."""
    plan = [[Micro(_seed(r, 0), False, (0,)), Micro(_seed(r, 1), True, (0,))] for r in range(ctx.world_size)]
    run = net.train(net.shard(net.build(True), ctx), ctx, plan, 1, fill=False, tower=True)
    return {"right": _grads_right(run), "value": "backward completed; " + _grads_text(run)}


def case_b(ctx: Ctx) -> dict[str, Any]:
    """unused_param_reduction: ranks run different experts, the fill (torch's or the backport) on."""
    plan = [[Micro(_seed(r, 0), False, _route_all_used(ctx, r))] for r in range(ctx.world_size)]
    run = net.train(net.shard(net.build(False), ctx), ctx, plan, 1, fill=True)
    routes = "; ".join(f"rank {r}: experts {list(p[0].experts)}" for r, p in enumerate(plan))
    return {"right": _grads_right(run), "value": f"{routes}; " + _grads_text(run)}


def case_c(ctx: Ctx) -> dict[str, Any]:
    """uniform_reduce_dtype: expert 1 first used in the last micro-batch (bf16 next to fp32)."""
    plan = [[Micro(_seed(r, 0), False, (0,)), Micro(_seed(r, 1), False, (0, 1))] for r in range(ctx.world_size)]
    run = net.train(net.shard(net.build(False), ctx), ctx, plan, 1, fill=False)
    return {"right": _grads_right(run), "value": "reduce-scatter completed; " + _grads_text(run)}


def case_d(ctx: Ctx) -> dict[str, Any]:
    """restore_unused_param_grads: the fill on, expert 2 used by no rank, two AdamW steps."""
    plan = [[Micro(_seed(r, 0), False, _route_some_unused(ctx, r))] for r in range(ctx.world_size)]
    run = net.train(net.shard(net.build(False), ctx), ctx, plan, 2, fill=True)
    unused_right, unused_text = _unused_text(run)
    return {"right": unused_right and _grads_right(run), "value": f"{unused_text}; others: " + _grads_text(run)}


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
    "a": case_a,
    "b": case_b,
    "c": case_c,
    "d": case_d,
    "train_eager": case_train_eager,
    "train_compile": case_train_compile,
    "train_offload": case_train_offload,
}
