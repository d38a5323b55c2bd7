"""Per-step cost of the patches on a healthy FSDP2 model, measured side by side.

Two gloo ranks on CPU train a small MLP stack (each layer its own FSDP unit, bf16 params with fp32
reduce, the unused-param fill on so that ``restore_unused_param_grads`` does its extra all-reduce,
two micro-batches per step). Nothing is unused, so the patched and unpatched runs do the same math.
Runs alternate between plugin on and ``FSDP_AUTOPATCH_ENABLED=0`` and the script prints median
step times and their ratio. Timings are informative only; no test depends on them.

    .venv/bin/python bench/step_overhead.py [--pairs 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker(steps: int, out: str) -> None:
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.set_reduce_scatter_unused_params(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for micro, batch in enumerate(data):
            model.set_requires_gradient_sync(micro == len(data) - 1)
            model(batch).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(times[3:], handle)  # drop warm-up steps
    dist.destroy_process_group()


def run(env_extra: dict[str, str], steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_AUTOPATCH_")}
        env.update(env_extra, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                   CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen([sys.executable, __file__, "--worker", str(steps), out], env={**env, "RANK": str(r)})
            for r in range(2)
        ]
        try:
            for proc in procs:
                if proc.wait(timeout=300) != 0:
                    raise RuntimeError("a rank failed")
        finally:
            for proc in procs:
                proc.kill()
        with open(out) as handle:
            return json.load(handle)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    patched, unpatched = [], []
    for _ in range(args.pairs):  # interleaved: noise hits both variants alike
        patched += run({}, args.steps)
        unpatched += run({"FSDP_AUTOPATCH_ENABLED": "0"}, args.steps)
    on, off = statistics.median(patched), statistics.median(unpatched)
    print(f"median step: patched {on * 1e3:.2f} ms, unpatched {off * 1e3:.2f} ms, ratio {on / off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
