"""What the plugin costs every interpreter in the environment, measured side by side.

Runs ``python -c pass`` (and ``import torch``) alternately with the plugin armed (default) and with
``FSDP_AUTOPATCH_ENABLED=0`` (the .pth still runs but arms nothing) and with ``-S`` (no site at all,
for scale), interleaved so machine noise hits all variants alike, and prints medians and ratios.

    .venv/bin/python bench/startup.py [--rounds 20] [--torch]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def run_once(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--torch", action="store_true", help="also time `import torch.distributed.fsdp`")
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_AUTOPATCH_")}
    programs = {"python -c pass": "pass"}
    if args.torch:
        programs["import torch.distributed.fsdp"] = "import torch.distributed.fsdp"
    for label, code in programs.items():
        variants = {
            "plugin armed": ([sys.executable, "-c", code], base),
            "FSDP_AUTOPATCH_ENABLED=0": ([sys.executable, "-c", code], {**base, "FSDP_AUTOPATCH_ENABLED": "0"}),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        rounds = args.rounds if code == "pass" else max(3, args.rounds // 5)
        for _ in range(rounds):
            for name, (argv, env) in variants.items():
                times[name].append(run_once(argv, env))
        medians = {name: statistics.median(values) for name, values in times.items()}
        reference = medians["FSDP_AUTOPATCH_ENABLED=0"]
        print(f"{label} ({rounds} interleaved rounds)")
        for name, median in medians.items():
            print(f"  {name:<28} median {median * 1e3:8.1f} ms   ratio {median / reference:5.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
