"""Per-step cost of the patches on an FSDP2 model, patched vs unpatched side by side in one run.

Two gloo ranks on CPU train a small mixture-of-experts stack: 8 blocks, each its own FSDP unit
(LayerNorm, 4 expert Linears, an output Linear: 12 parameters), plus a root unit with the head,
so 9 FSDP units and 98 parameters. bf16 parameters with fp32 reduction. The model, its data, the
step and the alternation are the wheel's step-cost module (``fsdp_autopatch._gpu_check._cost``),
which ``fsdp-autopatch gpu-check`` times on a GPU; this script adds its CPU probes and the report.
Two cases:

  fill_off  nothing unused, no ``set_reduce_scatter_unused_params``; 2 micro-batches per step
            (gradient accumulation), so every wrapper the patches install is on the hot path.
  fill_on   ``set_reduce_scatter_unused_params(True)``; rank 0 routes to experts {0, 1}, rank 1 to
            {0, 2}, expert 3 is used by no rank; 1 micro-batch per step (with accumulation the
            *unpatched* run would hit the uniform-dtype assertion and could not be timed).

Both variants run in the same two rank processes, alternating in blocks of steps: "patched" is the
plugin as installed; "unpatched" is the same process after ``fsdp_autopatch._activate.revert_all()``
(torch's original functions put back), re-patched with ``_activate.activate()`` for the next
patched block. ``--mode env`` instead alternates whole launches with ``FSDP_AUTOPATCH_ENABLED=0``.

Also measured, per variant: every ProcessGroup collective issued in backward (the ProcessGroup
methods are wrapped in the rank processes), and the bytes the patches hold on FSDP objects (the
``restore_unused_param_grads`` usage probe at its peak, just before the final callback frees it,
and what is left after each step). Timings are informative only; no test depends on them.

    .venv/bin/python bench/step_overhead.py [--blocks 16] [--steps 5] [--cases fill_off fill_on]
    .venv/bin/python bench/step_overhead.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

# the model, data, step and alternation: the wheel's step-cost module (fsdp_autopatch._gpu_check._cost)
SPEC = {"dim": 128, "experts": 4, "blocks": 8, "tokens": 64}
_COLLECTIVES = (  # ProcessGroup methods that torch.distributed's collectives end up in
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
    "all_gather_single", "all_gather_single_coalesced", "allgather_into_tensor_coalesced",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "broadcast", "reduce", "gather", "scatter", "alltoall",
    "alltoall_base", "all_to_all_single", "barrier",
)


# --- inside a rank ------------------------------------------------------------------------------


class _Counter:
    """Counts ProcessGroup collective calls while ``active``: {method: {process group: calls}}."""

    def __init__(self) -> None:
        self.active = False
        self.calls: dict[str, dict[str, int]] = {}

    def install(self) -> None:
        import torch.distributed as dist

        for name in _COLLECTIVES:
            original = getattr(dist.ProcessGroup, name, None)
            if original is not None:
                setattr(dist.ProcessGroup, name, self._wrap(name, original))

    def _wrap(self, name, original):
        counter = self

        def counted(pg, *args, **kwargs):
            if counter.active:
                per_pg = counter.calls.setdefault(name, {})
                key = f"pg{pg.size()}:{pg.group_name}"
                per_pg[key] = per_pg.get(key, 0) + 1
            return original(pg, *args, **kwargs)

        return counted


def _probe_bytes(groups) -> tuple[int, int]:
    """Bytes of the usage probes attached to ``groups`` and the parameters they cover."""
    from fsdp_autopatch.patches import restore_unused_param_grads as restore

    total = params = 0
    for group in groups:
        probe = vars(group).get(restore._PROBE)
        if probe is not None:
            # the probe, its two lists (bools are shared singletons: 8 bytes a slot), the dict slot
            total += sys.getsizeof(probe) + sys.getsizeof(probe.used) + sys.getsizeof(probe.grad_existed)
            params += len(probe.used)
    return total, params


def _leftover_attributes(model) -> list[str]:
    """Attributes the patches left on FSDP objects after a step (should be none)."""
    from fsdp_autopatch._compat import state_param_groups

    left = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        for group in state_param_groups(state()):
            left += [f"FSDPParamGroup.{a}" for a in vars(group) if "autopatch" in a]
            for fsdp_param in group.fsdp_params:
                left += [f"FSDPParam.{a}" for a in vars(fsdp_param) if "autopatch" in a]
    return sorted(set(left))


def _fired_counts() -> dict[str, int]:
    """Per patch, how often it changed what torch would have done in this process so far (0 for all
    on a plugin without ``PatchRecord.fired``)."""
    import fsdp_autopatch

    return {record.name: getattr(record, "fired", 0) for record in fsdp_autopatch.status().patches}


# The wrappers whose cost is estimated: name -> (patch, the end of its target's path). Chosen from the
# declarations (``PATCH.targets``) by what they wrap, so a renamed function of ours changes nothing here.
_TIMED = {
    "accumulated_grad_guard": ("accumulated_grad_guard", ":FSDPParam.to_accumulated_grad_if_needed"),
    "uniform_reduce_dtype": ("uniform_reduce_dtype", ":foreach_reduce"),
    "restore_unused_param_grads.post_backward": ("restore_unused_param_grads", ":FSDPParamGroup.post_backward"),
    "restore_unused_param_grads.final_callback": (
        "restore_unused_param_grads", ":FSDPState._root_post_backward_final_callback"),
}


def _target(patch_name: str, path_end: str):
    """``(PATCH, the Wrap target)`` of ``patch_name`` whose path ends with ``path_end``."""
    from fsdp_autopatch._spec import Wrap
    from fsdp_autopatch.patches import load_patch

    patch = load_patch(patch_name)
    (target,) = [t for t in patch.targets if isinstance(t, Wrap) and t.path.endswith(path_end)]
    return patch, target


def _wrapper_cost(model, one_step, case: str) -> dict:
    """A low-noise estimate of what the patches add to a step (patched variant active).

    Counts, during one step under ``sys.setprofile``, the calls of each patch's wrapper function,
    then times each wrapper around a no-op on the real FSDP objects of this model (``timeit``,
    best of 5) against the no-op alone; the estimate is the sum of calls x extra time per call.
    For ``fill_on`` it adds the median time of the one int32 all-reduce of the usage flags. Where a
    patch acts in the step (``PatchRecord.fired`` grew), it adds fires x the time of one fire.
    """
    import threading
    import timeit

    import torch

    from fsdp_autopatch import _compat, _patching

    targets = {name: _target(*where) for name, where in _TIMED.items()}
    wrappers = {name: target.wrapper for name, (_, target) in targets.items()}
    by_code = {func.__code__: name for name, func in wrappers.items()}
    calls = dict.fromkeys(wrappers, 0)

    def profiler(frame, event, arg):
        if event == "call":
            name = by_code.get(frame.f_code)
            if name is not None:
                calls[name] += 1

    fired_before = _fired_counts()
    sys.setprofile(profiler)
    threading.setprofile(profiler)
    try:
        one_step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    fired_after = _fired_counts()
    fires = {name: fired_after[name] - fired_before.get(name, 0) for name in fired_after
             if fired_after[name] > fired_before.get(name, 0)}

    root = model._get_fsdp_state()
    group = _compat.state_param_groups(model.blocks[0]._get_fsdp_state())[0]
    fsdp_param = group.fsdp_params[0]
    grads = [torch.zeros(4, dtype=torch.float32) for _ in group.fsdp_params]

    def noop(*args, **kwargs):
        return None

    def per_call(func) -> float:
        number = 2000
        return min(timeit.repeat(func, number=number, repeat=5)) / number

    def noop_reduce(fsdp_params, unsharded_grads, *args, **kwargs):  # foreach_reduce's parameters
        return None

    # installed as the patches install them: isolated at call time, arguments bound by name
    owners = {
        "accumulated_grad_guard": (type(fsdp_param), noop),
        "uniform_reduce_dtype": (None, noop_reduce),
        "restore_unused_param_grads.post_backward": (type(group), noop),
        "restore_unused_param_grads.final_callback": (type(root), noop),
    }
    method_wrapper = {
        name: _patching.replacement_for(targets[name][0].name, targets[name][1], owner, original)
        for name, (owner, original) in owners.items()
    }
    cost = {
        "accumulated_grad_guard": per_call(
            lambda: method_wrapper["accumulated_grad_guard"].__get__(fsdp_param, type(fsdp_param))()
        )
        - per_call(lambda: noop.__get__(fsdp_param, type(fsdp_param))()),
        "uniform_reduce_dtype": per_call(lambda: method_wrapper["uniform_reduce_dtype"](group.fsdp_params, grads))
        - per_call(lambda: noop(group.fsdp_params, grads)),
        "restore_unused_param_grads.final_callback": per_call(
            lambda: method_wrapper["restore_unused_param_grads.final_callback"].__get__(root, type(root))())
        - per_call(lambda: noop.__get__(root, type(root))()),
    }
    if case == "fill_off":  # with the fill off the post_backward wrapper only checks two flags
        cost["restore_unused_param_grads.post_backward"] = per_call(
            lambda: method_wrapper["restore_unused_param_grads.post_backward"].__get__(group, type(group))()
        ) - per_call(lambda: noop.__get__(group, type(group))())
    else:  # with it on, it builds this group's usage probe (removed again here)
        torch_attributes = set(vars(group))

        def probe_once():
            method_wrapper["restore_unused_param_grads.post_backward"].__get__(group, type(group))()
            for name in set(vars(group)) - torch_attributes:  # the probe it attached
                del vars(group)[name]

        reduce_grads = group.reduce_grads
        group.reduce_grads = True
        try:
            cost["restore_unused_param_grads.post_backward"] = per_call(probe_once) - per_call(
                lambda: noop.__get__(group, type(group))())
        finally:
            group.reduce_grads = reduce_grads
    total = sum(calls[name] * max(cost[name], 0.0) for name in wrappers)
    result = {"calls_per_step": calls, "us_per_call": {k: v * 1e6 for k, v in cost.items()}}
    # What a fire adds where a patch acts (the wrappers' timings above never reach that branch):
    # the fired count, the logger's level check, and the "where" text the patch builds.
    result["fires_per_step"] = fires
    if fires:
        from fsdp_autopatch import _events

        one_fire = per_call(lambda: _events.fired(
            "restore_unused_param_grads", "an exact-zero gradient", f"parameter {_events.param_names([fsdp_param])}"))
        result["us_per_fire"] = one_fire * 1e6
        total += sum(fires.values()) * one_fire
    if case == "fill_on":  # plus the one packed all-reduce of the usage flags (both ranks run this)
        import time

        import torch.distributed as dist

        flags = torch.ones(sum(len(g.fsdp_params) for s in root._state_ctx.all_states
                               for g in _compat.state_param_groups(s)), dtype=torch.int32)
        dist.barrier()
        times = []
        for _ in range(30):
            start = time.perf_counter()
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group.mesh_info.shard_process_group)
            times.append(time.perf_counter() - start)
        result["flag_all_reduce_us"] = statistics.median(times) * 1e6
        total += statistics.median(times)
    result["us_per_step"] = total * 1e6
    return result


def worker(case: str, mode: str, blocks: int, steps: int, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_autopatch
    from fsdp_autopatch import _activate
    from fsdp_autopatch._gpu_check import _cost as cost
    from fsdp_autopatch.patches import restore_unused_param_grads as restore

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    model = cost.build_stack(SPEC, mesh, "cpu", fill=case == "fill_on")
    n_params = sum(1 for _ in model.parameters())
    n_units = sum(1 for m in model.modules() if hasattr(m, "_get_fsdp_state"))
    counter = _Counter()
    counter.install()

    peak = {"bytes": 0, "params": 0}
    original_restore = restore.restore_unused

    def measuring_restore(groups):  # runs inside the final callback, before the probes are popped
        size, params = _probe_bytes(groups)
        if size > peak["bytes"]:
            peak.update(bytes=size, params=params)
        return original_restore(groups)

    restore.restore_unused = measuring_restore

    def counted_backward(loss) -> None:
        counter.active = True
        loss.backward()
        counter.active = False

    one_step = cost.make_step(SPEC, case, model, rank, world_size, "cpu", backward=counted_backward)
    variants = ["patched", "unpatched"] if mode == "inprocess" else [mode]
    results = {v: {"times": [], "calls": {}, "steps_counted": 0, "leftover": []} for v in variants}

    def set_variant(variant: str) -> None:
        if mode != "inprocess":
            return
        if variant == "patched":
            _activate.activate()
        else:
            _activate.revert_all()

    def run_block(_: int, variant: str) -> None:
        set_variant(variant)
        one_step()  # warm-up after a switch: not timed, not counted
        dist.barrier()
        counter.calls = {}
        timed = cost.timed_steps(one_step, steps, cuda=False)
        times, cpu_times = [t / 1e3 for t in timed["host"]], [t / 1e3 for t in timed["cpu"]]
        res = results[variant]
        res["times"] += times
        res.setdefault("cpu_times", []).extend(cpu_times)
        res.setdefault("block_medians", []).append(statistics.median(times))
        res.setdefault("cpu_block_medians", []).append(statistics.median(cpu_times))
        for name, per_pg in counter.calls.items():
            for pg, calls in per_pg.items():
                res["calls"].setdefault(name, {}).setdefault(pg, 0)
                res["calls"][name][pg] += calls
        res["steps_counted"] += steps
        res["leftover"] = sorted(set(res["leftover"]) | set(_leftover_attributes(model)))

    cost.alternate(variants, blocks, run_block)
    set_variant("patched")
    wrapper_cost = _wrapper_cost(model, one_step, case)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(
                {
                    "torch": torch.__version__,
                    "applied": list(fsdp_autopatch.applied()) if mode != "unpatched" else [],
                    "params": n_params,
                    "units": n_units,
                    "micro_batches": cost.MICRO_BATCHES[case],
                    "probe_peak": peak,
                    "wrapper_cost": wrapper_cost,
                    "variants": results,
                },
                handle,
            )
    # Every rank past its last collective before any leaves: a peer still waiting on a rank that has
    # exited fails with gloo's 'Connection closed by peer'. (A rare abort at exit, 'terminate called
    # without an active exception', is another thing: docs/troubleshooting.md.)
    dist.barrier()
    dist.destroy_process_group()


# --- the launcher -----------------------------------------------------------------------------


def launch(case: str, mode: str, blocks: int, steps: int, env_extra: dict[str, str], timeout: float) -> dict:
    """Both ranks of one run through the package's launcher (``fsdp_autopatch._launch``: a fresh
    port, retried if taken; no inherited ``FSDP_AUTOPATCH_*``; bounded, every rank killed after)."""
    from fsdp_autopatch import _launch

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, os.path.abspath(__file__), "--worker", case, mode, str(blocks), str(steps), out]

        def attempt(port: int) -> _launch.Launch:
            return _launch.launch(lambda rank: argv, world_size=2, port=port, logs=Path(tmp), timeout_s=timeout,
                                  env=env_extra, fail_grace_s=30, merge_stderr=True, tail_lines=20)

        job = _launch.retry_on_taken_port(attempt, lambda job: any(_launch.port_taken(r.stdout) for r in job.ranks))
        if job.timed_out or any(r.returncode != 0 for r in job.ranks):
            tails = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.stdout}" for r in job.ranks)
            why = f"timed out after {timeout:g} s" if job.timed_out else "a rank failed"
            raise RuntimeError(f"{why} (case {case}, mode {mode})\n{tails}")
        with open(out) as handle:
            return json.load(handle)


def _per_step(calls: dict[str, dict[str, int]], steps: int) -> dict[str, float]:
    return {name: sum(per_pg.values()) / steps for name, per_pg in sorted(calls.items())}


def summarize(case: str, result: dict) -> dict:
    variants = result["variants"]
    patched, unpatched = variants["patched"], variants["unpatched"]
    on, off = statistics.median(patched["times"]), statistics.median(unpatched["times"])
    # paired: each patched block against the unpatched block next to it in time
    pairs = [a / b for a, b in zip(patched.get("block_medians", []), unpatched.get("block_medians", []))]
    cpu_on, cpu_off = (statistics.median(v.get("cpu_times") or [float("nan")]) for v in (patched, unpatched))
    cpu_pairs = [a / b for a, b in zip(patched.get("cpu_block_medians", []), unpatched.get("cpu_block_medians", []))]
    calls_on = _per_step(patched["calls"], patched["steps_counted"])
    calls_off = _per_step(unpatched["calls"], unpatched["steps_counted"])
    extra = {n: calls_on.get(n, 0) - calls_off.get(n, 0) for n in sorted(set(calls_on) | set(calls_off))}
    extra_pgs = {  # process groups on which the patched run issued more all-reduces
        pg for pg, calls in patched["calls"].get("allreduce", {}).items()
        if calls > unpatched["calls"].get("allreduce", {}).get(pg, 0)
    }
    peak = result["probe_peak"]
    return {
        "case": case,
        "torch": result["torch"],
        "applied": result["applied"],
        "units": result["units"],
        "params": result["params"],
        "micro_batches": result["micro_batches"],
        "steps_timed": [len(patched["times"]), len(unpatched["times"])],
        "median_ms": [on * 1e3, off * 1e3],
        "ratio": on / off,
        "paired_block_ratio_median": statistics.median(pairs) if pairs else None,
        "paired_block_ratio_quartiles": statistics.quantiles(pairs, n=4) if len(pairs) > 1 else None,
        "cpu_median_ms": [cpu_on * 1e3, cpu_off * 1e3],
        "cpu_ratio": cpu_on / cpu_off,
        "cpu_paired_block_ratio_median": statistics.median(cpu_pairs) if cpu_pairs else None,
        "cpu_paired_block_ratio_quartiles": statistics.quantiles(cpu_pairs, n=4) if len(cpu_pairs) > 1 else None,
        "collectives_per_step_in_backward": {"patched": calls_on, "unpatched": calls_off, "extra": extra},
        "process_groups_with_extra_all_reduce": len(extra_pgs),
        "wrapper_cost": result.get("wrapper_cost"),
        "wrapper_cost_fraction": (
            (result["wrapper_cost"]["us_per_step"] / 1e3 / (off * 1e3)) if result.get("wrapper_cost") else None
        ),
        "probe_peak_bytes": peak["bytes"],
        "probe_peak_bytes_per_param": peak["bytes"] / peak["params"] if peak["params"] else 0.0,
        "left_after_step": patched["leftover"],
    }


def _fires_text(w: dict) -> str:
    fires = w.get("fires_per_step")
    if not fires:
        return ""
    per_patch = ", ".join(f"{name} {count}" for name, count in fires.items())
    return f", fires {sum(fires.values())} x {w['us_per_fire']:.2f} ({per_patch})"


def print_summary(s: dict) -> None:
    on, off = s["median_ms"]
    print(f"{s['case']}: {s['units']} FSDP units, {s['params']} parameters, {s['micro_batches']} micro-batch(es)/step, "
          f"torch {s['torch']}, applied: {', '.join(s['applied'])}")
    print(f"  median step: patched {on:.2f} ms, unpatched {off:.2f} ms, ratio {s['ratio']:.4f} "
          f"({s['steps_timed'][0]} + {s['steps_timed'][1]} steps)")
    if s["paired_block_ratio_quartiles"]:
        q1, q2, q3 = s["paired_block_ratio_quartiles"]
        print(f"  paired blocks: median ratio {s['paired_block_ratio_median']:.4f} (quartiles {q1:.4f} / {q3:.4f})")
    cpu_on, cpu_off = s["cpu_median_ms"]
    print(f"  CPU time per step (rank 0, all threads): patched {cpu_on:.2f} ms, unpatched {cpu_off:.2f} ms, "
          f"ratio {s['cpu_ratio']:.4f}")
    if s["cpu_paired_block_ratio_quartiles"]:
        q1, _, q3 = s["cpu_paired_block_ratio_quartiles"]
        print(f"  CPU, paired blocks: median ratio {s['cpu_paired_block_ratio_median']:.4f} "
              f"(quartiles {q1:.4f} / {q3:.4f})")
    if s.get("wrapper_cost"):
        w = s["wrapper_cost"]
        print(f"  estimate (calls/step x us/call): {w['us_per_step']:.1f} us per step = "
              f"{s['wrapper_cost_fraction']:.3%} of the unpatched step; "
              + ", ".join(f"{k} {w['calls_per_step'][k]} x {w['us_per_call'][k]:.2f}" for k in w["calls_per_step"])
              + (f", flag all-reduce 1 x {w['flag_all_reduce_us']:.0f}" if "flag_all_reduce_us" in w else "")
              + _fires_text(w))
    calls = s["collectives_per_step_in_backward"]
    for name in sorted(calls["extra"]):
        print(f"  {name:<22} per step in backward: patched {calls['patched'].get(name, 0):5.1f}  "
              f"unpatched {calls['unpatched'].get(name, 0):5.1f}  extra {calls['extra'][name]:+.1f}")
    print(f"  process groups with an extra all-reduce: {s['process_groups_with_extra_all_reduce']}")
    print(f"  usage probe at its peak: {s['probe_peak_bytes']} bytes "
          f"({s['probe_peak_bytes_per_param']:.1f} per parameter); "
          f"left on FSDP objects after a step: {s['left_after_step'] or 'nothing'}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        case, mode, blocks, steps, out = sys.argv[2:7]
        worker(case, mode, int(blocks), int(steps), out)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["fill_off", "fill_on"], choices=["fill_off", "fill_on"])
    parser.add_argument("--blocks", type=int, default=16, help="alternations of patched/unpatched blocks")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
    parser.add_argument("--mode", choices=["inprocess", "env"], default="inprocess",
                        help="inprocess: revert/re-apply in the same ranks; env: alternate launches "
                        "with FSDP_AUTOPATCH_ENABLED=0 (--blocks launches of each)")
    parser.add_argument("--timeout", type=float, default=900, help="outer timeout per launch (s)")
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()
    summaries = []
    for case in args.cases:
        if args.mode == "inprocess":
            result = launch(case, "inprocess", args.blocks, args.steps, {}, args.timeout)
        else:
            merged: dict = {}
            for block in range(args.blocks):
                order = ("patched", "unpatched") if block % 2 == 0 else ("unpatched", "patched")
                for variant in order:
                    env = {"FSDP_AUTOPATCH_ENABLED": "0"} if variant == "unpatched" else {}
                    res = launch(case, variant, 1, args.steps, env, args.timeout)
                    base = merged.setdefault("result", {**res, "variants": {}})
                    if variant == "patched":
                        base.update(
                            applied=res["applied"], probe_peak=res["probe_peak"], wrapper_cost=res["wrapper_cost"]
                        )
                    got = res["variants"][variant]
                    have = base["variants"].setdefault(
                        variant, {"times": [], "calls": {}, "steps_counted": 0, "leftover": []}
                    )
                    have["times"] += got["times"]
                    have.setdefault("block_medians", []).extend(got.get("block_medians", []))
                    have.setdefault("cpu_times", []).extend(got.get("cpu_times", []))
                    have.setdefault("cpu_block_medians", []).extend(got.get("cpu_block_medians", []))
                    have["steps_counted"] += got["steps_counted"]
                    have["leftover"] = sorted(set(have["leftover"]) | set(got["leftover"]))
                    for name, per_pg in got["calls"].items():
                        for pg, calls in per_pg.items():
                            have["calls"].setdefault(name, {}).setdefault(pg, 0)
                            have["calls"][name][pg] += calls
            result = merged["result"]
        summary = summarize(case, result)
        summary["mode"] = args.mode
        summaries.append(summary)
        print_summary(summary)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summaries, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
