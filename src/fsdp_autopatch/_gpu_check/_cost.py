"""The step cost of the plugin, off against on, side by side in one process, alternating blocks of
steps (the order flips every round): the rank side of ``fsdp-autopatch gpu-check``'s cost, and the
model, data, step and alternation that ``bench/step_overhead.py`` (2 gloo ranks on CPU) measures with.

The model is an MoE stack at a size the caller picks (:func:`build_stack`; tens of milliseconds per
step on a GPU): blocks of LayerNorm, experts and an output Linear, each block an FSDP unit, bf16
parameters with fp32 reduction, AdamW. Two cases:

* ``fill_off``: every expert used, 2 micro-batches per step (gradient accumulation);
* ``fill_on``: ``set_reduce_scatter_unused_params(True)``, ranks use different experts and the last
  is used by no rank, 1 micro-batch per step (with accumulation the plugin-off run would trip the
  uniform-dtype assertion).

Variants: ``off`` is ``_activate.revert_all()`` then ``activate()`` with ``FSDP_AUTOPATCH_DISABLED``
naming every fix (on torch < 2.13 the ``fill_on`` case keeps ``unused_param_reduction``: without its
backported method there is no fill to time); ``on`` is the plugin as installed. With one rank the
restore's usage flags have no process group to be reduced over, so its all-reduce and host sync never
run; ``on_forced_sync`` then makes its reduction domain the 1-rank shard group, which runs exactly the
code 2 or more ranks run (tensor of flags, all-reduce, ``packed.tolist()``), to show that sync's cost.

Per variant: step time (CUDA events around each step on a GPU: the GPU's timeline, idle gaps
included; ``perf_counter`` on CPU), host time per step, the time spent in the restore and, within
it, blocked in ``Tensor.tolist`` (calls counted), and peak memory (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ._net import Ctx

COST_CASES = ("fill_off", "fill_on")
MICRO_BATCHES = {"fill_off": 2, "fill_on": 1}  # fill_on: with accumulation the plugin-off run would assert


def build_stack(spec: dict[str, Any], mesh, device, fill: bool):
    """The MoE stack of ``spec`` (``dim``, ``experts``, ``blocks``) on ``device``, each block an FSDP
    unit and the root one more, bf16 params / fp32 reduce; the fill on when ``fill``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dim, experts = spec["dim"], spec["experts"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
            self.out = nn.Linear(dim, dim)

        def forward(self, x, used):
            h = self.norm(x)
            return x + self.out(torch.relu(sum(self.experts[e](h) for e in used)))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(spec["blocks"]))
            self.head = nn.Linear(dim, dim)

        def forward(self, x, used):
            for block in self.blocks:
                x = block(x, used)
            return self.head(x)

    torch.manual_seed(0)
    with torch.device(device):
        model = Model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if fill:
        model.set_reduce_scatter_unused_params(True)
    return model


def route(case: str, rank: int, world_size: int, experts: int) -> tuple[int, ...]:
    """The experts ``rank`` uses in every block: all of them with the fill off; with it on, rank 0
    {0, 1}, rank 1 {0, 2}, the others {0}: the last expert is used by no rank (with 4 or more)."""
    if case == "fill_off":
        return tuple(range(experts))
    if world_size == 1:
        return (0, 1)
    return {0: (0, 1), 1: (0, 2)}.get(rank, (0,))


def make_step(spec: dict[str, Any], case: str, model, rank: int, world_size: int, device,
              backward: Callable[[Any], None] = lambda loss: loss.backward()) -> Callable[[], None]:
    """One training step of ``case`` on this rank's micro-batches (sync on the last), then AdamW's;
    ``backward`` runs each micro-batch's backward (a bench wraps it to count collectives)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    micro = MICRO_BATCHES[case]
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randn(spec["tokens"], spec["dim"], generator=gen).to(device) for _ in range(micro)]
    used = route(case, rank, world_size, spec["experts"])

    def step() -> None:
        for index, batch in enumerate(data):
            model.set_requires_gradient_sync(index == micro - 1)
            backward(model(batch, used).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def alternate(variants: list[str], rounds: int, run_block: Callable[[int, str], None]) -> None:
    """``run_block(round, variant)`` for every variant, ``rounds`` times, the order flipping every
    round, so that a drift of the machine weighs on every variant alike."""
    for round_index in range(rounds):
        for variant in variants if round_index % 2 == 0 else variants[::-1]:
            run_block(round_index, variant)


def timed_steps(step: Callable[[], None], steps: int, cuda: bool) -> dict[str, list[float]]:
    """``steps`` calls of ``step``, in ms each: ``host`` (wall clock around the call), ``cpu`` (this
    process's CPU time, all threads: leaves out waiting for a core, on a loaded machine), ``device``
    (CUDA events around the call: the GPU's timeline, idle gaps included; the host time on CPU)."""
    events, host, cpu = [], [], []
    for _ in range(steps):
        begin, cpu_begin = time.perf_counter(), time.process_time()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        step()
        if cuda:
            end.record()
            events.append((start, end))
        host.append((time.perf_counter() - begin) * 1e3)
        cpu.append((time.process_time() - cpu_begin) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    return {"host": host, "cpu": cpu, "device": [s.elapsed_time(e) for s, e in events] if cuda else host}


class _Probe:
    """Times the restore (``restore_unused``) and the ``Tensor.tolist`` calls made inside it; with
    ``watch_syncs`` (an untimed step, CUDA), counts the synchronizing CUDA operations in the restore
    as ``torch.cuda.set_sync_debug_mode("warn")`` reports them."""

    def __init__(self, restore_module, cuda: bool) -> None:
        self.module, self.original = restore_module, restore_module.restore_unused
        self.cuda, self.watch_syncs, self.syncs = cuda, False, []
        self.inside = False
        self.restore_s = self.tolist_s = 0.0
        self.restores = self.tolists = 0
        self.had_tolist = "tolist" in vars(torch.Tensor)
        self.tensor_tolist = torch.Tensor.tolist

    def reset(self) -> None:
        self.restore_s = self.tolist_s = 0.0
        self.restores = self.tolists = 0

    def install(self) -> None:
        probe = self

        def restore_unused(groups):
            if probe.watch_syncs and probe.cuda:
                return probe.count_syncs(groups)
            start = time.perf_counter()
            probe.inside = True
            try:
                return probe.original(groups)
            finally:
                probe.inside = False
                probe.restore_s += time.perf_counter() - start
                probe.restores += 1

        def tolist(tensor):
            if not probe.inside:
                return probe.tensor_tolist(tensor)
            start = time.perf_counter()
            try:
                return probe.tensor_tolist(tensor)
            finally:
                probe.tolist_s += time.perf_counter() - start
                probe.tolists += 1

        self.module.restore_unused = restore_unused
        torch.Tensor.tolist = tolist

    def count_syncs(self, groups):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return self.original(groups)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                self.syncs.append(sum("synchroniz" in str(w.message) for w in caught))

    def remove(self) -> None:
        self.module.restore_unused = self.original
        if self.had_tolist:
            torch.Tensor.tolist = self.tensor_tolist
        else:
            del torch.Tensor.tolist


def _set_variant(variant: str, case: str, native_fill: bool) -> None:
    from .. import _activate, _compat
    from ..patches import PATCH_NAMES as FIXES

    _activate.revert_all()
    if variant == "off":
        keep = () if native_fill or case == "fill_off" else ("unused_param_reduction",)
        os.environ["FSDP_AUTOPATCH_DISABLED"] = ",".join(n for n in FIXES if n not in keep)
    else:
        os.environ.pop("FSDP_AUTOPATCH_DISABLED", None)
    _activate.activate()
    original = getattr(_compat.reduction_domain, "_gpu_check_original", _compat.reduction_domain)
    if variant == "on_forced_sync":
        def forced(group):  # one rank: reduce the flags over the 1-rank shard group all the same
            return original(group) or (group.mesh_info.shard_process_group,)

        forced._gpu_check_original = original
        _compat.reduction_domain = forced
    else:
        _compat.reduction_domain = original


def _quartiles(values: list[float]) -> list[float]:
    return statistics.quantiles(values, n=4) if len(values) > 1 else list(values) * 3


def _time_case(ctx: Ctx, spec: dict[str, Any], case: str, native_fill: bool, at) -> dict[str, Any]:
    from ..patches import restore_unused_param_grads as restore

    cuda = ctx.device.type == "cuda"
    model = build_stack(spec, ctx.mesh(), ctx.device, fill=case == "fill_on")
    step = make_step(spec, case, model, ctx.rank, ctx.world_size, ctx.device)
    variants = ["off", "on"] + (["on_forced_sync"] if case == "fill_on" and ctx.world_size == 1 else [])
    out = {v: {"step_ms": [], "host_ms": [], "block_ms": [], "restore_us": [], "tolist_us": [],
               "tolists": [], "peak_mib": 0.0} for v in variants}
    probe = _Probe(restore, cuda)

    def run_block(round_index: int, variant: str) -> None:
        at(f"cost {case} round {round_index} {variant}")
        _set_variant(variant, case, native_fill)
        probe.install()
        probe.watch_syncs, probe.syncs = True, []
        try:
            step()  # after a switch: not timed; the restore's host syncs counted here
        finally:
            probe.watch_syncs = False
            probe.remove()
        out[variant]["syncs"] = out[variant].get("syncs", []) + probe.syncs
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if ctx.world_size > 1:
            dist.barrier()
        probe.reset()
        probe.install()
        try:
            times = timed_steps(step, spec["steps"], cuda)
        finally:
            probe.remove()
        row, steps = out[variant], spec["steps"]
        row["step_ms"] += times["device"]
        row["host_ms"] += times["host"]
        row["block_ms"].append(statistics.median(times["device"]))
        row["restore_us"].append(probe.restore_s * 1e6 / steps)
        row["tolist_us"].append(probe.tolist_s * 1e6 / steps)
        row["tolists"].append(probe.tolists / steps)
        if cuda:
            row["peak_mib"] = max(row["peak_mib"], torch.cuda.max_memory_allocated() / 2**20)

    alternate(variants, spec["rounds"], run_block)
    _set_variant("on", case, native_fill)
    used = route(case, ctx.rank, ctx.world_size, spec["experts"])
    summary: dict[str, Any] = {"micro_batches": MICRO_BATCHES[case], "experts_used": list(used), "variants": {}}
    for variant, row in out.items():
        summary["variants"][variant] = {
            "step_ms": statistics.median(row["step_ms"]),
            "step_ms_quartiles": _quartiles(row["step_ms"]),
            "host_ms": statistics.median(row["host_ms"]),
            "restore_us_per_step": statistics.median(row["restore_us"]),
            "tolist_us_per_step": statistics.median(row["tolist_us"]),
            "tolist_calls_per_step": statistics.median(row["tolists"]),
            "peak_mib": round(row["peak_mib"], 1) if cuda else None,
            "host_syncs_per_restore": (max(row["syncs"]) if row.get("syncs") else 0) if cuda else None,
            "steps_timed": len(row["step_ms"]),
        }
    off = out["off"]["block_ms"]
    for variant in variants[1:]:
        pairs = [a / b for a, b in zip(out[variant]["block_ms"], off)]
        summary["variants"][variant]["ratio_to_off"] = (
            summary["variants"][variant]["step_ms"] / summary["variants"]["off"]["step_ms"])
        summary["variants"][variant]["paired_block_ratio"] = statistics.median(pairs)
    return summary


def run_cost(ctx: Ctx, spec: dict[str, Any], at) -> dict[str, Any]:
    from ..patches import unused_param_reduction

    native_fill = unused_param_reduction.has_native_api()
    params = spec["blocks"] * (spec["experts"] + 1) * (spec["dim"] + 1) * spec["dim"]
    result: dict[str, Any] = {"spec": spec, "parameters_approx": params, "timer": "cuda events"
                              if ctx.device.type == "cuda" else "time.perf_counter", "cases": {}}
    for case in spec["cases"]:
        result["cases"][case] = _time_case(ctx, spec, case, native_fill, at)
        if ctx.device.type == "cuda":  # the case's model and optimizer are gone: give their memory back
            torch.cuda.empty_cache()
    return result
