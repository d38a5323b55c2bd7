"""An unmodified FSDP2 training script: it never imports fsdp_autopatch.

A tiny vision-language mixture-of-experts trained with ``fully_shard`` on CPU/gloo, written the
way the bug reports describe real jobs:

* the vision tower is its own FSDP unit and the first step's micro-batches are text-only (the
  tower never runs forward), with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
  and gradient accumulation through ``set_requires_gradient_sync`` -> bug (a);
* the experts share one unit and each rank routes its tokens to its own expert, with
  ``set_reduce_scatter_unused_params(True)`` (torch >= 2.13, or the backport) -> bug (b);
* a rank's expert is first used in the last micro-batch, next to fp32 accumulated gradients -> (c);
* expert 2 is used by no rank, and AdamW has weight decay -> bug (d).

Run it with torchrun (one or several "nodes")::

    torchrun --standalone --nproc-per-node 2 examples/train_vlm_moe.py

It prints one JSON line per rank (``{"rank", "ok", "loss", ...}``) and exits 0 when the run
is healthy: no crash, the never-used expert keeps ``grad is None`` and its weights, the tower
keeps ``grad is None`` on text-only steps, the loss decreases. Without fsdp-autopatch
(``FSDP_AUTOPATCH_ENABLED=0``) the first backward crashes on torch 2.7 - 2.14.
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

N_EXPERTS = 3  # expert 2 is routed no token by any rank
STEPS, MICRO_BATCHES = 4, 2


class TinyVLMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.tower = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16))
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(N_EXPERTS))
        self.head = nn.Linear(16, 4)

    def forward(self, tokens, image=None, experts=()):
        h = torch.tanh(self.embed(tokens))
        if image is not None:
            h = h + self.tower(image)
        for e in experts:
            h = h + torch.tanh(self.experts[e](h))
        return self.head(h)


def batch(rank: int, step: int, mb: int):
    g = torch.Generator().manual_seed(10 * mb + rank)  # the same data every step: the loss must fall
    tokens, target = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    image = torch.randn(4, 12, generator=g) if step > 0 and mb == MICRO_BATCHES - 1 else None
    experts = (rank % 2,) if mb == MICRO_BATCHES - 1 else ()  # first used in the last micro-batch
    return tokens, target, image, experts


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def applied_by_the_plugin() -> list[str] | None:
    """The patches fsdp-autopatch applied in this process (None: not loaded). Not an import: if it is
    installed, its .pth armed it at interpreter start and it loaded when this script imported torch."""
    plugin = sys.modules.get("fsdp_autopatch")
    return None if plugin is None else list(plugin.applied())


def main() -> int:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("EXAMPLE_PG_TIMEOUT_S", "60"))))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = TinyVLMoE()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model.tower, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    assert isinstance(model, FSDPModule)
    model.set_reduce_scatter_unused_params(True)  # torch >= 2.13, or fsdp-autopatch's backport
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    unused = model.experts[2].weight
    before = local(unused).detach().clone()
    losses, problems = [], []
    for step in range(STEPS):
        total = 0.0
        for mb in range(MICRO_BATCHES):
            model.set_requires_gradient_sync(mb == MICRO_BATCHES - 1)
            tokens, target, image, experts = batch(rank, step, mb)
            loss = (model(tokens, image, experts).float() - target).pow(2).mean()
            loss.backward()
            total += loss.item()
        if unused.grad is not None:
            problems.append(f"step {step}: never-used expert got a gradient")
        if step == 0 and model.tower[0].weight.grad is not None:
            problems.append("step 0: the skipped vision tower got a gradient")
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(total / MICRO_BATCHES, 4))
    moved = float((local(unused).detach() - before).abs().max())
    if moved != 0.0:
        problems.append(f"AdamW moved the never-used expert by {moved:.2e}")
    # global mean loss, so that every rank judges the same numbers
    mean_losses = torch.tensor(losses)
    dist.all_reduce(mean_losses)
    mean_losses /= dist.get_world_size()
    if not mean_losses[-1] < mean_losses[1]:  # step 0 has no images, later steps do
        problems.append(f"loss did not decrease: {mean_losses.tolist()}")
    print(json.dumps({
        "rank": rank,
        "ok": not problems,
        "problems": problems,
        "loss": [round(x, 4) for x in mean_losses.tolist()],
        "unused_expert_moved": moved,
        # the plugin arrived through the .pth, not through this script: what it applied
        "fsdp_autopatch_applied": applied_by_the_plugin(),
        "torch": torch.__version__,
    }), flush=True)
    # Every rank past its last collective before any leaves: a peer still waiting on a rank that has
    # exited fails with gloo's 'Connection closed by peer'. (A rare abort at exit, 'terminate called
    # without an active exception', is another thing: docs/troubleshooting.md.)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
