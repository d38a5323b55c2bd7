"""What the plugin costs at interpreter start and at ``import torch.distributed.fsdp``, side by side.

Builds the wheel from this checkout and keeps two venvs made from the same base interpreter, with
the same torch, wrapt and packaging: ``with-plugin`` (the wheel installed, so its .pth runs) and
``without-plugin`` (no fsdp-autopatch at all, so no .pth). Then, alternating the two venvs run by
run (machine noise hits both alike), it measures:

  start-up     ``python -c pass``: medians and their ratio; the modules the .pth adds to
               ``sys.modules``; the bootstrap's own import time (``-X importtime``).
  activation   ``import torch.distributed.fsdp``: medians and their ratio (wall clock, noisy); and,
               inside the with-plugin interpreter, the time of the hook itself: arming (import wrapt,
               register the post-import hook, at ``import torch``) plus firing (import the patches
               and packaging, check and apply), "gross" as it happens and "net" with the standard
               library modules that torch.distributed.fsdp imports anyway loaded beforehand (they
               are moved earlier by the hook, not added), and its split by package.

    python3 bench/startup.py [--rounds 40] [--torch-rounds 10] [--probe-rounds 5] [--json out.json]

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
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, ROOT])
    (wheel,) = out.glob("fsdp_autopatch-*.whl")
    return wheel


def default_torch_spec() -> str:
    try:
        from importlib.metadata import version

        return f"torch=={version('torch').split('+')[0]}"
    except Exception:
        return "torch==2.13.0"


def venv_python(path: Path) -> Path:
    return path / "bin" / "python"


def ensure_venvs(root: Path, torch_spec: str) -> tuple[Path, Path]:
    base = getattr(sys, "_base_executable", None) or sys.executable
    wheel = build_wheel(root / "dist")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    with_dir, without_dir = root / "with-plugin", root / "without-plugin"
    for path in (with_dir, without_dir):
        stamp = path / "bench-torch-spec"
        if not (stamp.exists() and stamp.read_text() == torch_spec):
            if path.exists():
                shutil.rmtree(path)
            print(f"creating {path} ({torch_spec}) ...", flush=True)
            sh([base, "-m", "venv", path])
            # torch without compiling its ~4000 modules; the warm-up below compiles what is imported
            sh([venv_python(path), "-m", "pip", "install", "-q", "--no-compile", torch_spec])
            stamp.write_text(torch_spec)
    plugin_stamp = with_dir / "bench-plugin-sha256"
    if not (plugin_stamp.exists() and plugin_stamp.read_text() == digest):
        sh([venv_python(with_dir), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", wheel])
        sh([venv_python(with_dir), "-m", "pip", "install", "-q", wheel])  # wrapt, packaging
        plugin_stamp.write_text(digest)
    # the same wrapt and packaging (and nothing else) in the venv without the plugin
    versions = json.loads(sh([venv_python(with_dir), "-c",
                              "import json, importlib.metadata as m; "
                              "print(json.dumps({p: m.version(p) for p in ('wrapt', 'packaging')}))"]).stdout)
    sh([venv_python(without_dir), "-m", "pip", "install", "-q", *(f"{p}=={v}" for p, v in versions.items())])
    for path in (with_dir, without_dir):  # compile what the programs below import, once
        sh([venv_python(path), "-c", "import torch.distributed.fsdp"])
    return venv_python(with_dir), venv_python(without_dir)


# --- measurements -----------------------------------------------------------------------------


def wall(argv) -> float:
    start = time.perf_counter()
    subprocess.run([str(a) for a in argv], env=ENV, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def side_by_side(pythons: dict[str, Path], code: str, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in pythons}
    names = list(pythons)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(wall([pythons[name], "-c", code]))
    return times


def modules_after(python: Path, code: str) -> list[str]:
    out = sh([python, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"]).stdout
    return json.loads(out.strip().splitlines()[-1])


def bootstrap_import_ms(python: Path, rounds: int) -> float:
    """Cumulative -X importtime of the top-level modules the .pth imports (fsdp_autopatch*)."""
    values = []
    for _ in range(rounds):
        err = sh([python, "-X", "importtime", "-c", "pass"]).stderr
        ours = []  # (indent, cumulative us) of our modules; the least indented ones hold the rest
        for line in err.splitlines():
            m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)$", line)
            if m and m.group(3).startswith("fsdp_autopatch"):
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
    hooks = importer._post_import_hooks.get(_bootstrap.HOOK_TARGET, [])
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
    times = side_by_side(pythons, code, args.torch_rounds)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venvs", type=Path, default=ROOT / ".artifacts" / "bench")
    parser.add_argument("--torch-spec", default=default_torch_spec())
    parser.add_argument("--rounds", type=int, default=40, help="python -c pass runs per venv")
    parser.add_argument("--torch-rounds", type=int, default=10, help="import torch.distributed.fsdp runs per venv")
    parser.add_argument("--probe-rounds", type=int, default=5, help="in-process hook timings (gross and net each)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    with_py, without_py = ensure_venvs(args.venvs, args.torch_spec)
    pythons = {"with plugin": with_py, "without plugin": without_py}
    out: dict = {"torch_spec": args.torch_spec, "python": sys.version.split()[0]}

    # start-up
    added = sorted(set(modules_after(with_py, "pass")) - set(modules_after(without_py, "pass")))
    times = side_by_side(pythons, "pass", args.rounds)
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    out["startup"] = {"median_ms": med, "ratio": med["with plugin"] / med["without plugin"],
                      "added_ms": med["with plugin"] - med["without plugin"], "rounds": args.rounds,
                      "modules_added": added, "bootstrap_import_ms": bootstrap_import_ms(with_py, 9)}
    s = out["startup"]
    print(f"python -c pass ({args.rounds} alternating runs each)")
    for name, value in med.items():
        print(f"  {name:<16} median {value:7.2f} ms")
    print(f"  ratio {s['ratio']:.3f} ({s['added_ms']:+.2f} ms); bootstrap's own import (-X importtime) "
          f"{s['bootstrap_import_ms']:.2f} ms")
    print(f"  modules the .pth adds to sys.modules: {', '.join(added) or 'none'}")

    out["activation"] = activation(pythons, "torch.distributed.fsdp", args)
    out["import_torch_only"] = activation(pythons, "torch", args)  # a process that never uses FSDP
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
