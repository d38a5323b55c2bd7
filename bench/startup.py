"""What the plugin costs at interpreter start and at ``import torch.distributed.fsdp``, side by side.

Builds the wheel from this checkout and keeps two venvs made from the same base interpreter, with
the same torch, wrapt and packaging: ``with-plugin`` (the wheel installed, so its .pth runs) and
``without-plugin`` (no fsdp-autopatch at all, so no .pth). Then, alternating the two venvs run by
run (machine noise hits both alike), it measures:

  start-up     ``python -c pass``: wall clock and CPU time (user + system of the child, which a
               loaded machine inflates much less than the wall clock), and ``site.main()``'s CPU
               time inside the interpreter; medians, 10th percentiles and ratios; the modules the
               .pth adds to ``sys.modules``; the bootstrap's own import time (``-X importtime``).
               ``--baseline-wheel`` adds a third venv (e.g. an earlier commit's wheel) to the
               alternation; ``--startup-only`` skips the activation part.
  activation   ``import torch.distributed.fsdp``: medians and their ratio (wall clock, noisy); and,
               inside the with-plugin interpreter, the time of the hook itself: arming (import wrapt,
               register the post-import hook, at ``import torch``) plus firing (import the patches
               and packaging, check and apply), "gross" as it happens and "net" with the standard
               library modules that torch.distributed.fsdp imports anyway loaded beforehand (they
               are moved earlier by the hook, not added), and its split by package.

    python3 bench/startup.py [--rounds 40] [--torch-rounds 10] [--probe-rounds 5] [--json out.json]
                             [--startup-only] [--baseline-wheel old.whl]

The venvs live in ``.artifacts/bench/`` (``--venvs``) and are reused; the plugin is reinstalled
whenever the wheel built from the checkout changes. First run: a few minutes (installs torch twice,
``--torch-spec``, default ``torch==<this interpreter's torch>`` or ``torch==2.13.0``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import _wheel  # noqa: E402  (scripts/_wheel.py: the wheel builder the tests and scripts share)

_DROP = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV", "PYTHONSAFEPATH",
         "PYTHONNOUSERSITE", "PYTHONVERBOSE", "PYTHONDEVMODE", "PYTHONWARNINGS"}


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_AUTOPATCH_") and k not in _DROP}
    env.update(CUDA_VISIBLE_DEVICES="", PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


ENV = clean_env()


def sh(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], env=ENV, check=True, text=True, capture_output=True,
                          timeout=kw.pop("timeout", 1800), **kw)


# --- the two venvs --------------------------------------------------------------------------


def build_wheel(out: Path) -> Path:
    return _wheel.build_wheel(out, timeout=1800, env=ENV, fresh=True)


def default_torch_spec() -> str:
    try:
        from importlib.metadata import version

        return f"torch=={version('torch').split('+')[0]}"
    except Exception:
        return "torch==2.13.0"


def venv_python(path: Path) -> Path:
    return path / "bin" / "python"


VENV_DIRS = {"with plugin": "with-plugin", "with baseline plugin": "with-baseline-plugin", "without plugin": "without-plugin"}


def ensure_venvs(root: Path, torch_spec: str, baseline_wheel: Path | None = None) -> dict[str, Path]:
    """The venvs' pythons: "with plugin" (this checkout's wheel), "with baseline plugin" (only with
    ``--baseline-wheel``, e.g. a wheel built from an earlier commit) and "without plugin"."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    wheels = {"with plugin": build_wheel(root / "dist")}
    if baseline_wheel is not None:
        wheels["with baseline plugin"] = baseline_wheel.resolve()
    dirs = {name: root / VENV_DIRS[name] for name in [*wheels, "without plugin"]}
    for path in dirs.values():
        stamp = path / "bench-torch-spec"
        if not (stamp.exists() and stamp.read_text() == torch_spec):
            if path.exists():
                shutil.rmtree(path)
            print(f"creating {path} ({torch_spec}) ...", flush=True)
            sh([base, "-m", "venv", path])
            # torch without compiling its ~4000 modules; the warm-up below compiles what is imported
            sh([venv_python(path), "-m", "pip", "install", "-q", "--no-compile", torch_spec])
            stamp.write_text(torch_spec)
    for name, wheel in wheels.items():
        path = dirs[name]
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        plugin_stamp = path / "bench-plugin-sha256"
        if not (plugin_stamp.exists() and plugin_stamp.read_text() == digest):
            sh([venv_python(path), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", wheel])
            sh([venv_python(path), "-m", "pip", "install", "-q", wheel])  # wrapt, packaging
            plugin_stamp.write_text(digest)
    # the same wrapt and packaging (and nothing else) in the venv without the plugin
    versions = json.loads(sh([venv_python(dirs["with plugin"]), "-c",
                              "import json, importlib.metadata as m; "
                              "print(json.dumps({p: m.version(p) for p in ('wrapt', 'packaging')}))"]).stdout)
    sh([venv_python(dirs["without plugin"]), "-m", "pip", "install", "-q", *(f"{p}=={v}" for p, v in versions.items())])
    for path in dirs.values():  # compile what the programs below import, once
        sh([venv_python(path), "-c", "import torch.distributed.fsdp"])
    return {name: venv_python(path) for name, path in dirs.items()}


# --- measurements -----------------------------------------------------------------------------


def timed_run(argv) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one run. CPU is the child's user + system time as the kernel
    accounted it: unlike the wall clock, it does not count the time the child waited for a core,
    which dominates a 20 ms process on a loaded machine."""
    start = time.perf_counter()
    child = subprocess.Popen([str(a) for a in argv], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    elapsed = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, [str(a) for a in argv])
    return elapsed, usage.ru_utime + usage.ru_stime


def alternating(names: list[str], rounds: int):
    """Each round runs every venv once, the order rotating, so that machine noise hits all alike."""
    for i in range(rounds):
        k = i % len(names)
        yield from names[k:] + names[:k]


def side_by_side(pythons: dict[str, Path], code: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    """{"wall": {venv: seconds per run}, "cpu": {venv: seconds per run}}."""
    times: dict[str, dict[str, list[float]]] = {"wall": {n: [] for n in pythons}, "cpu": {n: [] for n in pythons}}
    for name in alternating(list(pythons), rounds):
        elapsed, cpu = timed_run([pythons[name], "-c", code])
        times["wall"][name].append(elapsed)
        times["cpu"][name].append(cpu)
    return times


# Everything site does at start-up (find the venv, add site-packages, read and run every .pth),
# timed inside the interpreter in CPU time (the wall clock of 2 ms jumps to 10 ms whenever the
# process is preempted on a loaded machine): what a .pth costs, without process creation and exit.
SITE_MAIN = "import site, time; start = time.process_time(); site.main(); print(time.process_time() - start)"


def site_main_times(pythons: dict[str, Path], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in pythons}
    for name in alternating(list(pythons), rounds):
        times[name].append(float(sh([pythons[name], "-S", "-c", SITE_MAIN]).stdout.strip().splitlines()[-1]))
    return times


def instructions(python: Path, runs: int = 3) -> int | None:
    """User-space instructions of ``python -c pass`` (valgrind's cachegrind, median of ``runs``,
    ``PYTHONHASHSEED=0``): the same count run after run however loaded the machine is, where CPU
    time on a busy machine moves by more than the plugin costs. Kernel time is not in it."""
    if shutil.which("valgrind") is None:
        return None
    counts = []
    for _ in range(runs):
        err = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                              str(python), "-c", "pass"], env={**ENV, "PYTHONHASHSEED": "0"}, text=True,
                             capture_output=True, timeout=600).stderr
        m = re.search(r"I\s+refs:\s+([\d,]+)", err)
        if m:
            counts.append(int(m.group(1).replace(",", "")))
    return int(statistics.median(counts)) if counts else None


def modules_after(python: Path, code: str) -> list[str]:
    out = sh([python, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"]).stdout
    return json.loads(out.strip().splitlines()[-1])


def bootstrap_import_ms(python: Path, rounds: int) -> float:
    """Cumulative -X importtime of the top-level modules the .pth imports (fsdp_autopatch*,
    _fsdp_autopatch*)."""
    values = []
    for _ in range(rounds):
        err = sh([python, "-X", "importtime", "-c", "pass"]).stderr
        ours = []  # (indent, cumulative us) of our modules; the least indented ones hold the rest
        for line in err.splitlines():
            m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)$", line)
            if m and m.group(3).lstrip("_").startswith("fsdp_autopatch"):
                ours.append((len(m.group(2)), int(m.group(1))))
        top = min((indent for indent, _ in ours), default=0)
        values.append(sum(us for indent, us in ours if indent == top) / 1e3)
    return statistics.median(values)


# Runs in the with-plugin venv: times the bootstrap's register_hook (import wrapt, register) and the
# post-import hook it registers (import _activate, the patches, packaging; check; apply).
PROBE = r"""
import json, sys, time
preload, target = json.loads(sys.argv[1]), sys.argv[2]
for name in preload:
    __import__(name)
from fsdp_autopatch import _bootstrap
phase = {}
def timed(label, func):
    def run(*args):
        before = set(sys.modules)
        start = time.perf_counter()
        try:
            return func(*args)
        finally:
            phase[label] = {"s": time.perf_counter() - start, "loaded": sorted(set(sys.modules) - before)}
    return run
original_register = _bootstrap.register_hook
def register_then_wrap_hook():
    original_register()
    import wrapt.importer as importer  # benchmark only: wrap the hook wrapt will call
    from fsdp_autopatch._process import HOOK_TARGET
    hooks = importer._post_import_hooks.get(HOOK_TARGET, [])
    hooks[:] = [timed("fire", hook) for hook in hooks]
_bootstrap.register_hook = timed("arm", register_then_wrap_hook)
import importlib
start = time.perf_counter()
importlib.import_module(target)
total = time.perf_counter() - start
import fsdp_autopatch
print(json.dumps({"total": total, "phase": phase, "applied": list(fsdp_autopatch.applied())}))
"""


PLAIN = "import sys, time, importlib; t = time.perf_counter(); importlib.import_module(sys.argv[1]); print(time.perf_counter() - t)"


def probe(python: Path, target: str, preload: list[str], importtime: bool = False) -> dict:
    argv = [python] + (["-X", "importtime"] if importtime else []) + ["-c", PROBE, json.dumps(preload), target]
    result = sh(argv)
    data = json.loads(result.stdout.strip().splitlines()[-1])
    if importtime:
        data["self_us"] = {}
        for line in result.stderr.splitlines():
            m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)$", line)
            if m:
                data["self_us"][m.group(2)] = int(m.group(1))
    return data


def hook_seconds(data: dict) -> float:
    return sum(p["s"] for p in data["phase"].values())


def split_by_package(data: dict) -> dict[str, float]:
    """ms of the hook spent importing each top-level package's modules, and the rest (our logic)."""
    split: dict[str, float] = {}
    loaded = [m for p in data["phase"].values() for m in p["loaded"]]
    for name in loaded:
        top = name.split(".")[0]
        key = top if top in ("wrapt", "packaging", "fsdp_autopatch") else "other modules"
        split[key] = split.get(key, 0.0) + data["self_us"].get(name, 0) / 1e3
    split["check + apply (no imports)"] = hook_seconds(data) * 1e3 - sum(split.values())
    return split


def activation(pythons: dict[str, Path], target: str, args) -> dict:
    with_py, without_py = pythons["with plugin"], pythons["without plugin"]
    code = f"import {target}"
    # wall clock, alternating
    times = side_by_side(pythons, code, args.torch_rounds)["wall"]
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    baseline = set(modules_after(without_py, code))
    # in-process: the hook's time, gross (as it happens) and net (with the standard library modules
    # it loads that the same import loads anyway preloaded: the hook moves them earlier, it does not
    # add them), against the time of the same import measured in-process without the plugin
    moved = sorted({m for p in probe(with_py, target, [])["phase"].values() for m in p["loaded"]
                    if m in baseline and not m.startswith("torch")})
    plain, gross, net = [], [], []
    for _ in range(args.probe_rounds):
        plain.append(float(sh([without_py, "-c", PLAIN, target]).stdout.strip().splitlines()[-1]))
        gross.append(probe(with_py, target, []))
        net.append(probe(with_py, target, moved))
    timed_run = probe(with_py, target, moved, importtime=True)
    split = split_by_package(timed_run)
    hook_modules = {m: timed_run["self_us"].get(m, 0) / 1e3 for p in timed_run["phase"].values() for m in p["loaded"]}
    import_ms = statistics.median(plain) * 1e3
    gross_ms = statistics.median(hook_seconds(d) for d in gross) * 1e3
    net_ms = statistics.median(hook_seconds(d) for d in net) * 1e3
    phases = {name: statistics.median(d["phase"].get(name, {"s": 0.0})["s"] for d in net) * 1e3 for name in ("arm", "fire")}
    a = {
        "median_ms": med, "ratio": med["with plugin"] / med["without plugin"], "rounds": args.torch_rounds,
        "import_in_process_ms": import_ms, "probe_rounds": args.probe_rounds,
        "hook_gross_ms": gross_ms, "hook_net_ms": net_ms, "arm_net_ms": phases["arm"], "fire_net_ms": phases["fire"],
        "net_fraction": net_ms / import_ms, "gross_fraction": gross_ms / import_ms,
        "moved_not_added": moved, "net_split_ms": split, "net_module_self_ms": hook_modules, "applied": gross[0]["applied"],
        "hook_loaded": {k: v["loaded"] for k, v in gross[0]["phase"].items()},
    }
    print(f"{code} ({args.torch_rounds} alternating runs each)")
    for name, value in med.items():
        print(f"  {name:<16} median {value:7.1f} ms")
    print(f"  ratio {a['ratio']:.3f} ({med['with plugin'] - med['without plugin']:+.1f} ms, wall clock)")
    print(f"  in-process ({args.probe_rounds} alternating runs each): the import without the plugin {import_ms:.0f} ms; "
          f"the hook gross {gross_ms:.1f} ms ({a['gross_fraction']:.2%}), "
          f"net {net_ms:.1f} ms = arm {phases['arm']:.1f} + fire {phases['fire']:.1f} ({a['net_fraction']:.2%})")
    print("  net split (-X importtime self times): " + ", ".join(f"{k} {v:.1f} ms" for k, v in split.items()))
    print(f"  standard library modules the hook loads early that this import loads anyway: {len(moved)}")
    print(f"  patches applied: {', '.join(a['applied']) or 'none (FSDP2 not imported)'}")
    return a


def startup(pythons: dict[str, Path], args) -> dict:
    """``python -c pass`` in every venv, alternating: wall clock, CPU time, and ``site.main()``."""
    without = pythons["without plugin"]
    baseline_modules = set(modules_after(without, "pass"))
    added = {name: sorted(set(modules_after(py, "pass")) - baseline_modules) for name, py in pythons.items() if py != without}
    times = side_by_side(pythons, "pass", args.rounds)
    times["site.main() cpu"] = site_main_times(pythons, args.rounds)
    result: dict = {"rounds": args.rounds, "modules_added": added,
                    "bootstrap_import_ms": {name: bootstrap_import_ms(pythons[name], 9) for name in added}}
    print(f"python -c pass ({args.rounds} alternating runs per venv; site.main() timed in-process under -S)")
    for metric, per_venv in times.items():
        result[metric] = {}
        print(f"  {metric}")
        for stat, of in (("median", statistics.median), ("p10", lambda v: statistics.quantiles(v, n=10)[0])):
            # p10: the runs least disturbed by the rest of the machine
            value = {name: of(values) * 1e3 for name, values in per_venv.items()}
            base = value["without plugin"]
            result[metric][stat] = {"ms": value, "ratio": {n: v / base for n, v in value.items()},
                                    "added_us": {n: (v - base) * 1e3 for n, v in value.items()}}
            for name, ms in value.items():
                versus = "" if name == "without plugin" else f"  ratio {ms / base:.3f} ({(ms - base) * 1e3:+.0f} µs)"
                print(f"    {stat:<6} {name:<21} {ms:7.2f} ms{versus}")
    counts = {name: instructions(py) for name, py in pythons.items()}
    if all(counts.values()):
        result["instructions"] = counts
        print("  instructions (valgrind, deterministic; user space only)")
        for name, count in counts.items():
            base = counts["without plugin"]
            versus = "" if name == "without plugin" else f"  ratio {count / base:.4f} ({count - base:+,})"
            print(f"    {name:<28} {count:>12,}{versus}")
    for name in added:
        print(f"  {name}: the .pth adds {', '.join(added[name]) or 'no module'} to sys.modules; "
              f"their -X importtime {result['bootstrap_import_ms'][name] * 1e3:.0f} µs")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venvs", type=Path, default=ROOT / ".artifacts" / "bench")
    parser.add_argument("--torch-spec", default=default_torch_spec())
    parser.add_argument("--rounds", type=int, default=40, help="python -c pass runs per venv")
    parser.add_argument("--torch-rounds", type=int, default=10, help="import torch.distributed.fsdp runs per venv")
    parser.add_argument("--probe-rounds", type=int, default=5, help="in-process hook timings (gross and net each)")
    parser.add_argument("--startup-only", action="store_true", help="measure python -c pass only (~1 min)")
    parser.add_argument("--baseline-wheel", type=Path,
                        help="a third venv with this wheel (e.g. built from an earlier commit), measured alongside")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    pythons = ensure_venvs(args.venvs, args.torch_spec, args.baseline_wheel)
    out: dict = {"torch_spec": args.torch_spec, "python": sys.version.split()[0]}
    out["startup"] = startup(pythons, args)
    two = {name: pythons[name] for name in ("with plugin", "without plugin")}
    if not args.startup_only:
        out["activation"] = activation(two, "torch.distributed.fsdp", args)
        out["import_torch_only"] = activation(two, "torch", args)  # a process that never uses FSDP
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
