"""Rank side of ``fsdp-autopatch gpu-check``: dynamo's counters per compile mode, one case per mode,
run with the plugin on and, in a separate launch, off (``FSDP_AUTOPATCH_ENABLED=0``), as the
training flavours are. The modes (``_plan.COMPILE_MODES``), on the training flavours' MoE network
(the demo's, ``cases._four_bugs``: vision, moe, root; bf16 params, fp32 reduce):

* ``compile_whole``: ``torch.compile(model)`` after ``fully_shard``: Dynamo traces the units' FSDP2
  hooks, where torch hides its own functions (``_hiding``: a wrapper of ours there must be hidden the
  same way, or it adds graph breaks and recompiles);
* ``compile_units``: each block (vision, moe: the units below the root) ``.compile()``d after
  ``fully_shard`` (``nn.Module.compile``: the unit's hooks run inside its compiled call, so a wrapper
  of ours there that Dynamo does not skip is compiled as a frame of its own); the root stays eager
  (compiling it too gives the whole model's counts, measured);
* ``compile_torchtitan``: torchtitan's order, each block ``torch.compile(fullgraph=True)`` and then
  ``fully_shard`` (the hooks stay outside the compiled region; a graph break raises).

Each mode trains ``_plan.COMPILE_STEPS`` AdamW steps of 2 micro-batches (gradient accumulation) in
which every rank uses every parameter, so no bug of the catalogue strikes: a fix changes nothing
there, and the final weights with the plugin off and on must be bitwise equal (the parent compares
rank 0's digests). Per mode, from ``torch._dynamo.reset()`` on, on rank 0: the graph breaks (and
their most frequent reasons), the recompiles (and their reasons), the graphs and the distinct frames
compiled (``torch._dynamo.utils.counters`` and ``get_compilation_metrics``). Where torch.compile
cannot run here (Dynamo unsupported on this Python, the backend missing, inductor without triton on
CUDA), the case says why and is not an error.
"""

from __future__ import annotations

import hashlib
import platform
import re
from collections import Counter
from typing import Any, Callable

import torch

from ..cases import _four_bugs as four_bugs
from ._net import Ctx
from ._plan import COMPILE_MODES, COMPILE_STEPS

REASONS = 5  # the most frequent graph-break and recompile reasons kept per mode


def unavailable(ctx: Ctx) -> str | None:
    """Why ``torch.compile`` with ``ctx.compile_backend`` cannot run here, or None."""
    try:
        import torch._dynamo as dynamo
    except Exception as exc:  # a broken or partial build: recorded, never raised
        return f"torch._dynamo does not import here: {type(exc).__name__}: {exc}"
    try:
        supported = getattr(dynamo, "is_dynamo_supported", None)
        if supported is not None and not supported():
            return (f"torch.compile is not supported with torch {torch.__version__} on Python "
                    f"{platform.python_version()} ({platform.system()})")
        try:
            dynamo.lookup_backend(ctx.compile_backend)  # entry-point backends too
        except Exception:
            backends = ", ".join(sorted(dynamo.list_backends(exclude_tags=())))
            return f"backend {ctx.compile_backend!r} is not registered here (torch has: {backends})"
        if ctx.compile_backend == "inductor" and ctx.device.type == "cuda":
            from torch.utils._triton import has_triton

            if not has_triton():
                return "inductor on CUDA needs triton, which this environment lacks"
    except Exception as exc:
        return f"asking torch whether torch.compile runs here failed: {type(exc).__name__}: {exc}"
    return None


def _reset() -> None:
    """Dynamo's caches and counters as in a fresh process (another mode ran before in this one)."""
    import torch._dynamo as dynamo
    from torch._dynamo import utils

    dynamo.reset()
    utils.counters.clear()
    if hasattr(utils, "clear_compilation_metrics"):
        utils.clear_compilation_metrics()
    if hasattr(utils, "set_compilation_metrics_limit"):
        utils.set_compilation_metrics_limit(4096)  # 64 by default: every compile of the mode is kept


def _short(reason: Any, limit: int = 200) -> str:
    text = " ".join(str(reason).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _frames_and_recompiles() -> tuple[int | None, int | None, list[str]]:
    """(frames compiled, recompiles, the recompiles' most frequent reasons) since the reset, from
    torch's compilation metrics (one record per frame compile; AOT's backward compiles, which have no
    frame, are not counted); Nones where this torch keeps no such record."""
    from torch._dynamo import utils

    if not hasattr(utils, "get_compilation_metrics"):
        return None, None, []
    frames, reasons = set(), Counter()
    for metrics in utils.get_compilation_metrics():
        found = re.search(r"(\d+)/(\d+)", str(getattr(metrics, "compile_id", "")))
        if getattr(metrics, "co_name", None) is None or not found:
            continue
        frames.add(found.group(1))
        reason = getattr(metrics, "recompile_reason", None)
        if reason is None and int(found.group(2)) > 0:  # a torch without the field
            reason = "(no reason recorded)"
        if reason is not None:
            reasons[_short(reason)] += 1
    return len(frames), sum(reasons.values()), [f"{n}x {r}" for r, n in reasons.most_common(REASONS)]


def counters() -> dict[str, Any]:
    """What Dynamo counted since :func:`_reset`. ``graph_breaks``: per trace, as Dynamo counts them
    (a frame recompiled meets its break again); ``frames``: the distinct frames compiled (Dynamo's
    ``counters["frames"]`` misses ``fullgraph=True``, whose frames skip the counting path)."""
    from torch._dynamo.utils import counters as dynamo_counters

    breaks = Counter({_short(reason): n for reason, n in dynamo_counters["graph_break"].items()})
    frames, recompiles, recompile_reasons = _frames_and_recompiles()
    return {
        "graph_breaks": sum(breaks.values()),
        "recompiles": recompiles,
        "unique_graphs": dynamo_counters["stats"]["unique_graphs"],
        "frames": frames if frames is not None else dynamo_counters["frames"]["ok"],
        "frames_converted": dynamo_counters["frames"]["ok"],
        "break_reasons": [f"{n}x {r}" for r, n in breaks.most_common(REASONS)],
        "recompile_reasons": recompile_reasons,
    }


def digest(params: dict[str, Any]) -> str:
    """sha256 of the named tensors' bytes (in name order): equal digests, bitwise equal weights."""
    hasher = hashlib.sha256()
    for name in sorted(params):
        tensor = params[name].detach().cpu().contiguous().reshape(-1)
        hasher.update(f"{name}:{tensor.dtype}:{tensor.numel()};".encode())
        hasher.update(bytes(tensor.view(torch.uint8).tolist()))
    return hasher.hexdigest()


def _model(mode: str, ctx: Ctx):
    model = four_bugs.build_model()
    if mode == "compile_torchtitan":
        return four_bugs.shard(model, ctx.mesh(), compile_backend=ctx.compile_backend, fullgraph=True)
    four_bugs.shard(model, ctx.mesh())
    if mode == "compile_units":
        for unit in (model.vision, model.moe):
            unit.compile(backend=ctx.compile_backend)
        return model
    return torch.compile(model, backend=ctx.compile_backend)


def _case(mode: str) -> Callable[[Ctx], dict[str, Any]]:
    def run(ctx: Ctx) -> dict[str, Any]:
        why = unavailable(ctx)
        if why:
            return {"right": True, "value": f"not run: {why}", "unavailable": why}
        _reset()
        # every rank runs every expert and the vision tower in every micro-batch: no bug strikes
        plan = four_bugs.plan(ctx.world_size, 2, every_expert=True, images=lambda index: True)
        trained = four_bugs.train(_model(mode, ctx), plan[ctx.rank], COMPILE_STEPS, ctx.device)
        found = counters()
        value = (f"{found['graph_breaks']} graph breaks, {found['recompiles']} recompiles, "
                 f"{found['unique_graphs']} graphs, {found['frames']} frames")
        return {"right": True, "value": value, "backend": ctx.compile_backend, "steps": COMPILE_STEPS, **found,
                "losses": trained["losses"], "weights_sha256": digest(trained["final"])}

    run.__doc__ = f"{mode}: {COMPILE_MODES[mode]}"
    return run


CASES = {mode: _case(mode) for mode in COMPILE_MODES}
