"""An unmodified Accelerate + FSDP2 training script: it never imports fsdp_autopatch.

The tiny vision-language mixture-of-experts of ``train_vlm_moe.py``, trained with Hugging Face
Accelerate's gradient accumulation (``with accelerator.accumulate(model):``,
``gradient_accumulation_steps=2``) on CPU/gloo:

* the vision tower is its own FSDP unit and the first step's micro-batches are text-only, with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and the no-sync micro-batch of
  gradient accumulation -> bug (a);
* each rank routes its tokens to its own expert (``set_reduce_scatter_unused_params(True)``)
  -> bug (b), first used in the last micro-batch next to fp32 accumulated gradients -> bug (c);
* expert 2 is used by no rank, and AdamW has weight decay -> bug (d).

Why the script calls ``fully_shard`` itself: Accelerate 1.15 never reaches FSDP2 on CPU. The
``FullyShardedDataParallelPlugin(fsdp_version=2)`` passed below is honoured only when the process
group runs on an accelerator (``DistributedType.FSDP`` is chosen only from ``MULTI_GPU``-like
types, accelerate/state.py:986-1016); on CPU the job is ``DistributedType.MULTI_CPU`` and
``prepare(model)`` wraps the model in ``DistributedDataParallel`` (accelerator.py:2058-2062), which
rejects an already sharded model. So on CPU the model is sharded here and only the optimizer goes
through ``prepare``; Accelerate's ``no_sync`` maps to ``set_requires_gradient_sync`` only under
``DistributedType.FSDP`` (accelerator.py:1166-1171), so the script follows
``accelerator.sync_gradients`` itself. Where Accelerate does reach FSDP2 (``accelerator.is_fsdp2``),
``prepare(model, optimizer)`` keeps the already sharded model (utils/fsdp_utils.py:763-767) and
``accumulate`` drives gradient sync. See docs/guides/accelerate.md.

Run it with torchrun, or with ``accelerate launch`` (which starts torchrun itself)::

    torchrun --standalone --nproc-per-node 2 examples/accelerate_fsdp2.py
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 examples/accelerate_fsdp2.py

Every rank also trains a single-process reference (plain PyTorch, the same bf16 compute and fp32
accumulation as the policy) on all ranks' micro-batches and compares the gradients after every
accumulation window and the weights after the last step. It prints one JSON line per rank
(``{"rank", "ok", "problems", ...}``) and exits 0 when the run is healthy. Without fsdp-autopatch
(``FSDP_AUTOPATCH_ENABLED=0``) the first backward crashes on torch 2.13 - 2.14 (bug (a)); before
2.13 the ``set_reduce_scatter_unused_params`` call in ``shard`` already raises AttributeError.
"""

import copy
import json
import os
import sys
from datetime import timedelta

import accelerate
import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import InitProcessGroupKwargs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

N_EXPERTS = 3  # expert 2 is routed no token by any rank
STEPS, MICRO_BATCHES = 3, 2
LR, WEIGHT_DECAY = 1e-2, 0.1
# The reference repeats FSDP2's arithmetic (bf16 compute, fp32 sums); only the order of the
# fp32 sums differs, and those sums are exact here (a few bf16 summands of close magnitudes).
# Measured on torch 2.13: 0.0 for both (see the guide); the tolerances leave room for rounding.
GRAD_REL_TOL, WEIGHT_ABS_TOL = 1e-5, 1e-5


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


def mse(output, target):
    return (output.float() - target).pow(2).mean()


def make_accelerator() -> Accelerator:
    # (InitProcessGroupKwargs leaves out a timeout equal to its own default, 600 s: gloo then waits 30 min)
    pg_timeout = timedelta(seconds=int(os.environ.get("EXAMPLE_PG_TIMEOUT_S", "60")))
    return Accelerator(
        cpu=True,  # MULTI_CPU on gloo (without it: DistributedType.NO, each rank alone); drop on GPU
        gradient_accumulation_steps=MICRO_BATCHES,
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),  # what a GPU job passes
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=pg_timeout)],
    )


def shard(model: TinyVLMoE) -> TinyVLMoE:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model.tower, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.set_reduce_scatter_unused_params(True)  # torch >= 2.13, or fsdp-autopatch's backport
    return model


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_grads(model) -> dict:
    """Every parameter's full gradient (None where ``grad is None``): a collective per gradient,
    so first make sure all ranks agree on which gradients exist (else ``full_tensor`` would hang)."""
    params = list(model.named_parameters())
    present = torch.tensor([p.grad is not None for _, p in params], dtype=torch.int32)
    lowest, highest = present.clone(), present.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    if not torch.equal(lowest, highest):
        raise RuntimeError("ranks disagree on which parameters have a gradient")
    return {n: None if p.grad is None else full(p.grad).detach().clone() for n, p in params}


def reference_run(initial: dict, world_size: int):
    """Single process, all ranks' micro-batches: bf16 forward/backward (the policy's param_dtype),
    gradients summed in fp32 (its reduce_dtype) and averaged over ranks, Accelerate's loss scaling
    (1 / gradient_accumulation_steps), AdamW. Returns the gradients per step and the final weights."""
    model = TinyVLMoE()
    model.load_state_dict(initial)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    grads_per_step = []
    for step in range(STEPS):
        summed: dict = {}
        for rank in range(world_size):
            for mb in range(MICRO_BATCHES):
                compute = copy.deepcopy(model).to(torch.bfloat16)
                tokens, target, image, experts = batch(rank, step, mb)
                image = None if image is None else image.to(torch.bfloat16)
                loss = mse(compute(tokens.to(torch.bfloat16), image, experts), target) / MICRO_BATCHES
                loss.backward()
                for name, p in compute.named_parameters():
                    if p.grad is not None:
                        summed[name] = summed.get(name, 0) + p.grad.float()
        for name, p in model.named_parameters():
            p.grad = summed[name] / world_size if name in summed else None
        grads_per_step.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads_per_step, {n: p.detach().clone() for n, p in model.named_parameters()}


def compare_grads(step: int, got: dict, want: dict, problems: list) -> float:
    worst = 0.0
    for name, g in got.items():
        w = want[name]
        if (g is None) != (w is None):
            problems.append(f"step {step}: {name}.grad is {'None' if g is None else 'set'}, reference "
                            f"{'None' if w is None else 'set'}")
            continue
        if g is not None:
            worst = max(worst, float((g - w).norm() / w.norm().clamp_min(1e-12)))
    if worst > GRAD_REL_TOL:
        problems.append(f"step {step}: gradients differ from the single-process reference (rel {worst:.2e})")
    return worst


def applied_by_the_plugin() -> list[str] | None:
    """The patches fsdp-autopatch applied in this process (None: not loaded). Not an import: if it is
    installed, its .pth armed it at interpreter start and it loaded when this script imported torch."""
    plugin = sys.modules.get("fsdp_autopatch")
    return None if plugin is None else list(plugin.applied())


def main() -> int:
    accelerator = make_accelerator()
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = TinyVLMoE()
    initial = copy.deepcopy(model.state_dict())
    model = shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    if accelerator.is_fsdp2:  # Accelerate's FSDP2 path keeps an already sharded model
        model, optimizer = accelerator.prepare(model, optimizer)
    else:  # DistributedType.MULTI_CPU: prepare(model) would wrap the sharded model in DDP
        optimizer = accelerator.prepare(optimizer)
    ref_grads, ref_weights = reference_run(initial, accelerator.num_processes)

    unused = model.experts[2].weight
    before = full(unused).detach().clone()
    losses, problems, sync_pattern, grad_rel = [], [], [], 0.0
    for step in range(STEPS):
        total = 0.0
        for mb in range(MICRO_BATCHES):
            with accelerator.accumulate(model):
                if not accelerator.is_fsdp2:  # Accelerate drives FSDP2's sync only under DistributedType.FSDP
                    model.set_requires_gradient_sync(accelerator.sync_gradients)
                sync_pattern.append(accelerator.sync_gradients)
                tokens, target, image, experts = batch(rank, step, mb)
                loss = mse(model(tokens, image, experts), target)
                accelerator.backward(loss)  # divides by gradient_accumulation_steps
                total += loss.item()
                if accelerator.sync_gradients:
                    grad_rel = max(grad_rel, compare_grads(step, full_grads(model), ref_grads[step], problems))
                    if unused.grad is not None:
                        problems.append(f"step {step}: never-used expert got a gradient")
                    if step == 0 and model.tower[0].weight.grad is not None:
                        problems.append("step 0: the skipped vision tower got a gradient")
                optimizer.step()  # Accelerate skips it on the no-sync micro-batch
                optimizer.zero_grad()
        losses.append(total / MICRO_BATCHES)

    weight_diff = max(float((full(p).detach() - ref_weights[n]).abs().max()) for n, p in model.named_parameters())
    if weight_diff > WEIGHT_ABS_TOL:
        problems.append(f"weights differ from the single-process reference by {weight_diff:.2e}")
    moved = float((full(unused).detach() - before).abs().max())
    if moved != 0.0:
        problems.append(f"AdamW moved the never-used expert by {moved:.2e}")
    mean_losses = torch.tensor(losses)  # global mean loss, so that every rank judges the same numbers
    dist.all_reduce(mean_losses)
    mean_losses /= accelerator.num_processes
    if not mean_losses[-1] < mean_losses[1]:  # step 0 has no images, later steps do
        problems.append(f"loss did not decrease: {mean_losses.tolist()}")
    print(json.dumps({
        "rank": rank,
        "ok": not problems,
        "problems": problems,
        "distributed_type": accelerator.distributed_type.value,
        "is_fsdp2": accelerator.is_fsdp2,
        "model_is_fsdp_module": isinstance(model, FSDPModule),
        "sync_pattern": sync_pattern,
        "max_grad_rel_diff": grad_rel,
        "max_weight_abs_diff": weight_diff,
        "unused_expert_grad_is_none": unused.grad is None,
        "unused_expert_moved": moved,
        "loss": [round(x, 4) for x in mean_losses.tolist()],
        # the plugin arrived through the .pth, not through this script
        "fsdp_autopatch_applied": applied_by_the_plugin(),  # via the .pth, never imported here
        "accelerate": accelerate.__version__,
        "torch": torch.__version__,
    }), flush=True)
    # Every rank past its last collective before any leaves: a peer still waiting on a rank that has
    # exited fails with gloo's 'Connection closed by peer'. (A rare abort at exit, 'terminate called
    # without an active exception', is another thing: docs/troubleshooting.md.)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
