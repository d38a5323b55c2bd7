"""Step cost under ``torch.compile``, plugin off vs on side by side in one run (issue 37).

Two gloo ranks on CPU train a small MLP stack: 3 blocks (LayerNorm, Linear 4x up, GELU, Linear
down, residual), each its own FSDP unit, and a root unit with an input Linear (the embedding's place:
every block's input requires grad, so no block recompiles for that), the final norm and the head:
4 FSDP units, 24 parameters, fp32. One step is forward, ``pow(2).mean()`` loss, backward, ``AdamW.step``,
``zero_grad``. Modes (``--modes``):

  eager     fully_shard(blocks), fully_shard(root); no compile.
  whole     the same, then ``torch.compile(model, backend=B)``: Dynamo meets FSDP2's hooks, torch's
            hidden ones and ours where we wrap them (torch's hidden pre-forward hook in the root's
            loop over the blocks makes Dynamo skip the root's frame, off and on alike, and compile
            each block's forward as a frame of its own).
  per_unit  the same, then ``block.compile(backend=B)`` on each block unit after fully_shard (the
            root's own forward, a loop over the blocks plus norm and head, stays eager).
  titan     torchtitan's order: each block ``torch.compile(block, backend=B, fullgraph=True)``
            first, then fully_shard(compiled block), fully_shard(root): hooks outside the graphs.

Compile caches are per process, and inductor's are also on disk: so every setting is its own
launch (``FSDP_AUTOPATCH_ENABLED=0`` for "off"; the plugin as installed for "on";
``--baseline-src DIR``: "before", the plugin from another checkout's ``src`` on ``PYTHONPATH``),
each rank with a fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` (every first step compiles cold, as a
user's first run does) and ``TORCHINDUCTOR_COMPILE_THREADS=1`` (compilation in the rank process
and its reaped compiler children, so its CPU time is counted). Per round and configuration the
settings' launches are adjacent, their order alternating from round to round; the figures are
medians over rounds. Per launch, on rank 0: the first step (compile included) and the steady
state (median of steps 3..N), wall clock and CPU time (the process's threads plus its reaped
children, i.e. the C++ compiler); Dynamo's graph breaks (``counters["graph_break"]``), frames it
skipped (ran eagerly: a graph break in a loop skips the whole frame) and compiled, graphs,
recompiles (a frame compiled again because a guard failed) and recompile-limit hits; whether the
losses equal the "off" launch's, bitwise. Where patches are applied, 5 more steps after the timed
ones run under cProfile: the plugin's own code per step (its functions' tottime), an upper bound
that the machine's load does not move. Wall clock and CPU time are noisy on a shared machine: the
spread between launches of one setting (printed) is the noise level.

    .venv/bin/python bench/compile_cost.py [--rounds 3] [--steps 20] [--modes ...] [--backends ...]
    .venv/bin/python bench/compile_cost.py --json out.json [--baseline-src /tmp/old/src]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N_BLOCKS = 3
DIM = 128
TOKENS = 128
STEADY_FROM = 2  # steps 0 (compile) and 1 (where a guard on state set by the first step recompiles) left out
MODES = ("eager", "whole", "per_unit", "titan")
BACKENDS = ("aot_eager", "inductor")
WORKER_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


# --- inside a rank ------------------------------------------------------------------------------


def _build(mode: str, backend: str, mesh):
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.up = nn.Linear(DIM, 4 * DIM)
            self.down = nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
            self.inp = nn.Linear(DIM, DIM)
            self.norm = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, DIM)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    model = Model()
    if mode == "titan":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=backend, fullgraph=True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if mode == "per_unit":
        for block in model.blocks:
            block.compile(backend=backend)
    units = sum(1 for m in model.modules() if hasattr(m, "_get_fsdp_state"))
    params = sum(1 for _ in model.parameters())
    return (torch.compile(model, backend=backend) if mode == "whole" else model), units, params


class _Recompiles:
    """Counts Dynamo's recompiles (and recompile-limit hits) with their first reasons, by wrapping
    the two functions ``convert_frame._compile`` calls when it compiles a frame already compiled."""

    def __init__(self) -> None:
        self.count, self.limit_hits, self.reasons = 0, 0, []

    def install(self) -> None:
        from torch._dynamo import convert_frame

        reasons_of = convert_frame.get_and_maybe_log_recompilation_reasons
        exceeds = convert_frame.exceeds_recompile_limit

        def counted_reasons(*args, **kwargs):
            reasons = reasons_of(*args, **kwargs)
            self.count += 1
            if len(self.reasons) < 5:
                self.reasons.append(str(reasons[0] if reasons else "?")[:300])
            return reasons

        def counted_exceeds(*args, **kwargs):
            result = exceeds(*args, **kwargs)
            self.limit_hits += bool(result[0])
            return result

        convert_frame.get_and_maybe_log_recompilation_reasons = counted_reasons
        convert_frame.exceeds_recompile_limit = counted_exceeds


def _skipped(counters) -> int:
    """Frames Dynamo gave up on and ran eagerly (a graph break in a loop skips the whole frame)."""
    return counters["frames"]["total"] - counters["frames"]["ok"]


def _reasons(counter) -> list:
    """The most frequent reasons of a Dynamo counter: their first line and debug context, with counts."""
    def short(reason: str) -> str:
        lines = [line.strip() for line in reason.splitlines() if line.strip()]
        context = [line for line in lines if line.startswith("Developer debug context")]
        return " | ".join(lines[:1] + context[:1])[:300]

    return [[short(reason), n] for reason, n in sorted(counter.items(), key=lambda item: -item[1])[:5]]


def _profile_ours(one_step, plugin_dir: str, steps: int = 5) -> dict:
    """After the timed steps: ``steps`` more under cProfile, and the time spent in the plugin's own
    code (its functions' tottime) against the profiled steps' time. The profiler inflates both
    (Python calls most), so the share is a rough upper bound, but it does not move with the load."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    start = time.process_time()
    profiler.enable()
    for _ in range(steps):
        one_step()
    profiler.disable()
    total = time.process_time() - start
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    ours = [(calls, tottime) for (path, _, _), (_, calls, tottime, _, _) in stats.items()
            if path.startswith(plugin_dir)]
    return {"ms_per_step": sum(t for _, t in ours) / steps * 1e3, "profiled_step_ms": total / steps * 1e3,
            "calls_per_step": sum(c for c, _ in ours) / steps}


def worker(mode: str, backend: str, steps: int, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_autopatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    recompiles = _Recompiles()
    recompiles.install()
    counters.clear()
    model, units, params = _build(mode, backend, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(rank))
    walls, cpus, compiler, losses, trace = [], [], [], [], []

    def one_step():
        loss = model(data).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(steps):
        dist.barrier()
        wall, cpu, child = time.perf_counter(), time.process_time(), os.times()
        loss = one_step()
        walls.append(time.perf_counter() - wall)
        done = os.times()  # the C++ compiler's CPU time: children reaped during the step
        children = (done.children_user - child.children_user) + (done.children_system - child.children_system)
        cpus.append(time.process_time() - cpu + children)
        compiler.append(children)
        losses.append(loss.item())
        trace.append([sum(counters["graph_break"].values()), _skipped(counters), recompiles.count,
                      counters["stats"]["unique_graphs"]])
    result = {
        "torch": torch.__version__, "units": units, "params": params, "walls": walls, "cpus": cpus,
        "compiler_cpus": compiler, "losses": losses, "trace": trace,
        "graph_breaks": sum(counters["graph_break"].values()), "graph_break_reasons": _reasons(counters["graph_break"]),
        "frames_skipped": _skipped(counters), "skip_reasons": _reasons(counters["unimplemented"]),
        "frames_compiled": counters["frames"]["ok"],
        "graphs": counters["stats"]["unique_graphs"], "recompiles": recompiles.count,
        "recompile_reasons": recompiles.reasons, "recompile_limit_hits": recompiles.limit_hits,
        "applied": list(fsdp_autopatch.applied()), "plugin": os.path.dirname(fsdp_autopatch.__file__),
    }
    if fsdp_autopatch.applied():  # after the counts above: a recompile here is reported on its own
        result["ours"] = _profile_ours(one_step, os.path.dirname(fsdp_autopatch.__file__))
        result["ours"]["recompiles"] = recompiles.count - result["recompiles"]
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(result, handle)
    dist.barrier()  # no rank leaves while its peer still waits on it in a collective
    dist.destroy_process_group()


# --- the launcher -----------------------------------------------------------------------------


def launch(mode: str, backend: str, steps: int, env: dict[str, str], timeout: float) -> dict:
    """Both ranks of one launch through the package's launcher; rank 0's result, rank 1's as ``peer``."""
    from fsdp_autopatch import _launch

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, os.path.abspath(__file__), "--worker", mode, backend, str(steps), out]
        rank_env = {r: {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, f"inductor{r}")} for r in range(2)}

        def attempt(port: int):
            return _launch.launch(lambda rank: argv, world_size=2, port=port, logs=Path(tmp), timeout_s=timeout,
                                  env={**WORKER_ENV, **env}, rank_env=rank_env, fail_grace_s=30,
                                  merge_stderr=True, tail_lines=30)

        job = _launch.retry_on_taken_port(attempt, lambda job: any(_launch.port_taken(r.stdout) for r in job.ranks))
        if job.timed_out or any(r.returncode != 0 for r in job.ranks):
            tails = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.stdout}" for r in job.ranks)
            why = f"timed out after {timeout:g} s" if job.timed_out else "a rank failed"
            raise RuntimeError(f"{why} (mode {mode}, backend {backend}, env {env})\n{tails}")
        with open(f"{out}.0") as handle:
            result = json.load(handle)
        with open(f"{out}.1") as handle:
            result["peer"] = json.load(handle)
        result["launch_s"] = job.elapsed_s
        return result


def probe_inductor(timeout: float) -> str | None:
    """None when inductor compiles and runs a function on this CPU (fresh cache), else why not."""
    code = ("import torch\nf = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend='inductor')\n"
            "x = torch.randn(64)\nassert torch.allclose(f(x), torch.sin(x) * 2 + 1)\n")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, **WORKER_ENV, "TORCHINDUCTOR_CACHE_DIR": cache, "CUDA_VISIBLE_DEVICES": ""}
        try:
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"a one-line compile did not finish in {timeout:g} s"
    if done.returncode != 0:
        return "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
    return None


def _steady(values: list[float]) -> float:
    return statistics.median(values[STEADY_FROM:] or values)


def _spread(values: list) -> str:
    """'v' when every launch gave the same value, else 'min-max'."""
    low, high = min(values), max(values)
    return f"{low}" if low == high else f"{low}-{high}"


# per launch: figure -> its value (seconds)
_FIGURES = {
    "first": lambda r: r["walls"][0], "steady": lambda r: _steady(r["walls"]),
    "first_cpu": lambda r: r["cpus"][0], "steady_cpu": lambda r: _steady(r["cpus"]),
}
_COUNTS = ("graph_breaks", "frames_skipped", "frames_compiled", "graphs", "recompiles", "recompile_limit_hits")


def summarize(runs: dict[str, list[dict]]) -> dict:
    """One configuration: per setting the medians over its launches (ms), the counts (as 'v' or
    'min-max' over launches); per setting other than "off" the ratio of medians and the paired
    ratios (each launch against the "off" launch of its round, adjacent in time), sorted."""
    out: dict = {}
    for setting, launches in runs.items():
        s = {f"{name}_ms": statistics.median(f(r) for r in launches) * 1e3 for name, f in _FIGURES.items()}
        s.update({name: _spread([r[name] for r in launches]) for name in _COUNTS})
        s["compiler_first_cpu_ms"] = statistics.median(r["compiler_cpus"][0] for r in launches) * 1e3
        s["spread"] = {name: max(f(r) for r in launches) / min(f(r) for r in launches) for name, f in _FIGURES.items()}
        for key in ("graph_break_reasons", "skip_reasons", "recompile_reasons", "applied", "plugin"):
            s[key] = launches[0][key]
        s["launches"] = len(launches)
        profiled = [r["ours"] for r in launches if r.get("ours")]
        if profiled:
            s["ours"] = {key: statistics.median(p[key] for p in profiled) for key in profiled[0]}
            s["ours"]["share"] = statistics.median(p["ms_per_step"] / p["profiled_step_ms"] for p in profiled)
        out[setting] = s
    for setting, s in out.items():
        if setting == "off":
            continue
        pairs = list(zip(runs[setting], runs["off"]))
        for name, f in _FIGURES.items():
            s[f"{name}_ratio"] = s[f"{name}_ms"] / out["off"][f"{name}_ms"]
            s[f"{name}_paired"] = sorted(f(a) / f(b) for a, b in pairs)
        s["losses_equal_off"] = all(a["losses"] == b["losses"] for a, b in pairs)
    return out


def _cells(r: dict, settings: list[str], name: str, digits: int) -> str:
    """'off / on ms | on/off ratio (paired range)' of one figure of one configuration."""
    values = " / ".join(f"{r[x][f'{name}_ms']:.{digits}f}" for x in settings)
    ratios = " / ".join(f"{r[x][f'{name}_ratio']:.3f} ({min(r[x][f'{name}_paired']):.3f}-"
                        f"{max(r[x][f'{name}_paired']):.3f})" for x in settings if x != "off")
    return f"{values} | {ratios}"


def print_tables(results: dict, settings: list[str]) -> None:
    others = [x for x in settings if x != "off"]
    names = " / ".join(settings)
    for title, first, steady in (("wall clock", "first", "steady"), ("CPU time", "first_cpu", "steady_cpu")):
        print(f"{title} (rank 0; medians over launches; ratios {' / '.join(x + '/off' for x in others)}; "
              f"in brackets the paired ratios' range):")
        print(f"| mode | backend | first step ms {names} | ratio | steady ms {names} | ratio |")
        print("|---|---|---|---|---|---|")
        for key, r in results.items():
            mode, backend = key.split("/")
            print(f"| {mode} | {backend} | {_cells(r, settings, first, 0)} | {_cells(r, settings, steady, 2)} |")
        print()
    print(f"Dynamo, {names}:")
    print("| mode | backend | graph breaks | frames skipped | frames compiled | graphs | recompiles | "
          "recompile-limit hits | losses equal to off |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        mode, backend = key.split("/")
        counts = " | ".join(" / ".join(str(r[x][name]) for x in settings) for name in _COUNTS)
        equal = " / ".join(str(r[x]["losses_equal_off"]) for x in others)
        print(f"| {mode} | {backend} | {counts} | {equal} |")
    print()
    print("the plugin's own code per step, under cProfile (5 steps after the timed ones; medians over launches):")
    heads = [f"{x}: ms in ours / profiled step ms (share), calls" for x in others]
    print("| mode | backend | " + " | ".join(heads) + " |")
    print("|---|---|" + "---|" * len(others))
    for key, r in results.items():
        cells = [f"{o['ms_per_step']:.2f} / {o['profiled_step_ms']:.1f} ({o['share']:.1%}), {o['calls_per_step']:.0f}"
                 if (o := r[x].get("ours")) else "-" for x in others]
        print(f"| {' | '.join(key.split('/'))} | {' | '.join(cells)} |")
    print()
    for key, r in results.items():
        for x in settings:
            s = r[x]
            spread = ", ".join(f"{name} {value:.3f}" for name, value in s["spread"].items())
            print(f"{key} {x}: max/min over launches: {spread}; first step's compiler CPU "
                  f"{s['compiler_first_cpu_ms']:.0f} ms; {len(s['applied'])} patches applied from {s['plugin']}")
            for label in ("graph_break_reasons", "skip_reasons"):
                for reason, n in s[label][:3]:
                    print(f"    {label.split('_')[0]} x{n}: {reason[:200]}")
            for reason in s["recompile_reasons"][:2]:
                print(f"    recompile: {reason[:200]}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, backend, steps, out = sys.argv[2:6]
        worker(mode, backend, int(steps), out)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--rounds", type=int, default=3, help="launches per configuration and setting")
    parser.add_argument("--steps", type=int, default=20, help="steps per launch (steady state: steps 3..N)")
    parser.add_argument("--baseline-src", help="a third setting, 'before': the plugin from this src directory")
    parser.add_argument("--timeout", type=float, default=600, help="outer timeout per launch (s)")
    parser.add_argument("--json", help="also write everything here")
    args = parser.parse_args()
    started = time.monotonic()
    loads = [Path("/proc/loadavg").read_text().split()[:3]] if Path("/proc/loadavg").exists() else []
    backends = list(args.backends)
    inductor = None
    if "inductor" in backends and any(m != "eager" for m in args.modes):
        inductor = probe_inductor(300)
        print(f"inductor on this CPU: {'works' if inductor is None else 'fails: ' + inductor}")
        if inductor is not None:
            backends.remove("inductor")
    configs = [(m, "-") for m in args.modes if m == "eager"] + [
        (m, b) for b in backends for m in args.modes if m != "eager"]
    settings = {"off": {"FSDP_AUTOPATCH_ENABLED": "0"}, "on": {}}
    if args.baseline_src:
        settings["before"] = {"PYTHONPATH": os.path.abspath(args.baseline_src)}
    runs: dict[str, dict[str, list[dict]]] = {f"{m}/{b}": {s: [] for s in settings} for m, b in configs}
    for round_ in range(args.rounds):
        for mode, backend in configs:
            order = list(settings) if round_ % 2 == 0 else list(settings)[::-1]
            for setting in order:
                result = launch(mode, "aot_eager" if backend == "-" else backend, args.steps, settings[setting],
                                args.timeout)
                runs[f"{mode}/{backend}"][setting].append(result)
                print(f"round {round_} {mode}/{backend} {setting}: first {result['walls'][0] * 1e3:.0f} ms, steady "
                      f"{_steady(result['walls']) * 1e3:.2f} ms, breaks {result['graph_breaks']}, recompiles "
                      f"{result['recompiles']}, launch {result['launch_s']:.1f} s", flush=True)
        if Path("/proc/loadavg").exists():
            loads.append(Path("/proc/loadavg").read_text().split()[:3])
    results = {key: summarize(by_setting) for key, by_setting in runs.items()}
    elapsed = time.monotonic() - started
    any_run = next(iter(next(iter(runs.values())).values()))[0]
    print(f"\ntorch {any_run['torch']}, {any_run['units']} FSDP units, {any_run['params']} parameters, 2 gloo ranks; "
          f"{args.rounds} launches per setting, {args.steps} steps each; wall {elapsed:.0f} s; "
          f"load average (1/5/15 min) at start and after each round: {loads}")
    print(f"settings: {', '.join(settings)}; inductor: {'works' if inductor is None else 'skipped: ' + inductor}\n")
    print_tables(results, list(settings))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "elapsed_s": elapsed, "loadavg": loads, "inductor": inductor or "works",
                       "results": results, "runs": runs}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
