"""Rank side of ``fsdp-autopatch gpu-check``: the training flavours (eager, per-block ``torch.compile``,
CPU offload with pinned memory), the first four bugs at once in the demo's model and training
(``fsdp_autopatch.cases._four_bugs``). The entries' bug cases are their case modules (``_entries.py``).

Every flavour takes the rank's :class:`._net.Ctx` and returns
``{"right": bool, "value": str}`` (rank 0's verdict is the one reported): what was measured against
a one-process reference (gradients), ``grad is None`` and unchanged weights for the expert no rank
used, a falling loss. An exception is the case's outcome (the rank program records it).
"""

from __future__ import annotations

from typing import Any

from ..cases import _four_bugs as four_bugs
from ._net import Ctx

STEPS = 2


def _grads_text(grads: dict[str, Any]) -> str:
    text = f"max relative |grad - reference| {grads['worst']['error']:.1e}"
    if grads["one_side"]:
        text += f"; gradient on one side only: {', '.join(grads['one_side'][:4])}"
    return text


def _unused_text(unused: dict[str, Any]) -> str:
    grad = "None" if all(state == "None" for state in unused["grad_states"]) else "a tensor (zero)"
    weights = "bitwise unchanged" if unused["bitwise_unchanged"] else f"moved by {unused['max_change']:.1e}"
    return f"expert {four_bugs.UNUSED_EXPERT} (used by no rank): grad {grad} after each backward, weights {weights}"


def _train_flavour(ctx: Ctx, *, compiled: bool = False, offload: bool = False) -> dict[str, Any]:
    """The first four bugs at once, as the demo's model meets them: a vision tower skipped by the text-only
    micro-batches (a), ranks with different experts (b, from 2 ranks), fp32-accumulated gradients
    next to bf16 zeros of the fill (c), an expert no rank used (d); bf16 params, fp32 reduce."""
    plan = four_bugs.plan(ctx.world_size)
    model = four_bugs.shard(four_bugs.build_model(), ctx.mesh(), offload=offload,
                            compile_backend=ctx.compile_backend if compiled else None)
    model.set_reduce_scatter_unused_params(True)  # AttributeError on torch < 2.13 without the backport
    run = four_bugs.train(model, plan[ctx.rank], STEPS, ctx.device)
    if ctx.rank != 0:
        return {"right": True, "value": ""}
    grads = four_bugs.check_gradients(run, plan, ctx.device)
    unused = four_bugs.check_unused_expert(run)
    loss = four_bugs.check_loss(run["losses"], STEPS)
    unused_right = unused["ok"]
    value = (f"{_unused_text(unused)}; others: {_grads_text(grads)}; "
             f"loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}")
    if offload:
        where = {p.to_local().device.type for p in model.parameters()}
        pinned = all(p.to_local().is_pinned() for p in model.parameters())
        value += f"; sharded parameters on {', '.join(sorted(where))}, pinned: {pinned}"
        unused_right = unused_right and where == {"cpu"} and pinned
    return {"right": unused_right and not grads["one_side"] and grads["ok"] and loss["ok"], "value": value}


def case_train_eager(ctx: Ctx) -> dict[str, Any]:
    return _train_flavour(ctx)


def case_train_compile(ctx: Ctx) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    counters.clear()
    result = _train_flavour(ctx, compiled=True)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    result["value"] = (f"torch.compile(backend={ctx.compile_backend!r}) of the vision and MoE blocks: {graphs} "
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
