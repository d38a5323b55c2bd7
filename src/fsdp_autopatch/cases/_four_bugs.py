"""The four-bug training of (a) - (d), used by the demo and by ``gpu-check``'s training flavours: a
tiny vision-language MoE, its data and loss, ``fully_shard`` of its units, the training loop, the
one-process reference and the invariants checked against it.

    tokens ─► embed ─► [+ vision(pixels) when the micro-batch has images] ─► mixer ─► moe ─► head

``vision`` and ``moe`` are FSDP units of their own (the root holds the rest). Which parts each rank
reaches, and the bug each part hits:

* the vision tower runs only in the micro-batch with images, the last one: text-only micro-batches
  skip it with gradient sync off (bug (a));
* the experts a rank runs are its *route*, a tuple passed to ``forward`` (static for
  ``torch.compile``): rank 0 runs experts 0 and 1, every other rank expert 0 only (bugs (b), (c));
* expert 2 is in no rank's route: its parameters get no gradient anywhere (bug (d)).

Inside the route a token's id picks its expert (``id // TOKENS_PER_EXPERT``), as a mask, so the
routing is deterministic and free of data-dependent branches. torch is imported inside functions:
the demo's parent process reads the constants without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ._common import full_grad_tensors, full_param_tensors, relative_diff

WORLD_SIZE = 2
STEPS = 4
MICRO_BATCHES = 3
IMAGE_MICRO_BATCH = MICRO_BATCHES - 1  # only the last micro-batch of each step has images
SEQUENCES = 2  # sequences per micro-batch per rank
SEQ_LEN = 8
VOCAB = 24
DIM = 16
PATCHES = 4
PATCH_DIM = 12
NUM_EXPERTS = 3
TOKENS_PER_EXPERT = VOCAB // NUM_EXPERTS  # hash routing: expert = token_id // 8
SHARED_EXPERT, RANK0_EXPERT, UNUSED_EXPERT = 0, 1, 2
SEED = 1234
LR = 1e-2
WEIGHT_DECAY = 0.1
GRAD_TOLERANCE = 1e-2  # max |fsdp - ref| <= tol * max |ref| per tensor (bf16 eps is 7.8e-3)

UNUSED_EXPERT_PREFIX = f"moe.experts.{UNUSED_EXPERT}."
EVERY_EXPERT = tuple(range(NUM_EXPERTS))


def route(rank: int) -> tuple[int, ...]:
    """The experts ``rank`` runs: 0 and 1 on rank 0, 0 on every other rank, 2 on none."""
    return (SHARED_EXPERT, RANK0_EXPERT) if rank == 0 else (SHARED_EXPERT,)


@dataclass(frozen=True)
class Micro:
    """One micro-batch of one rank: which (its seed), whether it has images, the experts it runs."""

    rank: int
    index: int
    image: bool
    experts: tuple[int, ...]


def plan(world_size: int = WORLD_SIZE, micro_batches: int = MICRO_BATCHES, *, every_expert: bool = False,
         images: Callable[[int], bool] = lambda index: index == IMAGE_MICRO_BATCH) -> list[list[Micro]]:
    """Every rank's micro-batches of one step (the same every step): by default the four bugs' routes
    and images in the last micro-batch only; ``every_expert``: every rank runs every expert."""
    return [[Micro(rank, index, images(index), EVERY_EXPERT if every_expert else route(rank))
             for index in range(micro_batches)] for rank in range(world_size)]


def build_model():
    """The tiny vision-language MoE, initialised identically on every rank (fixed seed)."""
    import torch
    from torch import nn

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
                for _ in range(NUM_EXPERTS)
            )

        def forward(self, hidden, tokens, experts: tuple[int, ...]):
            flat = hidden.reshape(-1, DIM)
            expert_ids = (tokens // TOKENS_PER_EXPERT).reshape(-1, 1)
            out = torch.zeros_like(flat)
            # An expert outside the route does not run, so its parameters get no gradient on this
            # rank: the situation bugs (b), (c) and (d) are about.
            for index in experts:
                out = out + self.experts[index](flat) * (expert_ids == index).to(flat.dtype)
            return out.reshape(hidden.shape)

    class VisionLanguageMoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.vision = nn.Sequential(nn.Linear(PATCH_DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))
            self.mixer = nn.Linear(DIM, DIM)
            self.moe = MoE()
            self.head = nn.Linear(DIM, VOCAB)

        def forward(self, tokens, pixels=None, experts: tuple[int, ...] = EVERY_EXPERT):
            hidden = self.embed(tokens)
            if pixels is not None:  # text-only batches skip the vision tower entirely (bug (a)'s trigger)
                image = self.vision(pixels).mean(dim=1)
                hidden = hidden + image[:, None, :]
            hidden = hidden + torch.tanh(self.mixer(hidden))
            hidden = hidden + self.moe(hidden, tokens, experts)
            return self.head(hidden)

    torch.manual_seed(SEED)
    return VisionLanguageMoE()


def micro_batch(micro: Micro, device: Any = "cpu", pixel_dtype: Any = None):
    """(tokens, pixels or None, targets) of ``micro``: drawn on the CPU (the same numbers on every
    device), then moved; tokens reach only the experts of its route."""
    import torch

    gen = torch.Generator().manual_seed(SEED + 100 * micro.rank + micro.index)
    tokens = torch.randint(0, TOKENS_PER_EXPERT * (max(micro.experts) + 1), (SEQUENCES, SEQ_LEN), generator=gen)
    if len(micro.experts) > 1:
        # Every expert of the route gets tokens in every micro-batch, so that without the fill the
        # ranks hold uniformly fp32-accumulated gradients and bug (b) shows on its own.
        for slot, expert in enumerate(micro.experts):
            tokens[0, slot] = expert * TOKENS_PER_EXPERT
    targets = (tokens * 5 + 3) % VOCAB  # a learnable token -> token mapping
    pixels = torch.randn(SEQUENCES, PATCHES, PATCH_DIM, generator=gen) if micro.image else None
    if pixels is not None:
        pixels = pixels.to(device=device, dtype=pixel_dtype or pixels.dtype)
    return tokens.to(device), pixels, targets.to(device)


def loss_of(model, micro: Micro, device: Any = "cpu", pixel_dtype: Any = None):
    """Cross-entropy of ``model`` on ``micro`` (fp32 logits)."""
    import torch.nn.functional as F

    tokens, pixels, targets = micro_batch(micro, device, pixel_dtype)
    logits = model(tokens, pixels, micro.experts)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def shard(model, mesh, *, mixed: bool = True, offload: bool = False, compile_backend: str | None = None,
          fullgraph: bool = False):
    """``fully_shard`` vision, moe, then the root (bf16 params / fp32 reduce when ``mixed``), as real
    VLM/MoE recipes do; with ``compile_backend``, ``torch.compile`` of vision and moe before sharding
    (torchtitan's order), with ``fullgraph``."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options: dict[str, Any] = {"mesh": mesh}
    if mixed:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    if compile_backend:
        model.vision = torch.compile(model.vision, backend=compile_backend, fullgraph=fullgraph)
        model.moe = torch.compile(model.moe, backend=compile_backend, fullgraph=fullgraph)
    fully_shard(model.vision, **options)
    fully_shard(model.moe, **options)
    fully_shard(model, **options)
    return model


def gather_grads(model, device: Any = None) -> dict[str, Any]:
    """Full gradients of the parameters that have one (collective: every rank calls it); a ``None``
    gradient is left out, once the ranks agree on which are ``None`` (else: RuntimeError)."""
    import torch
    import torch.distributed as dist

    # Gathering would deadlock if the ranks disagree on which gradients exist: compare first
    # (with tensors; all_gather_object would need numpy).
    has_grad = torch.tensor([p.grad is not None for p in model.parameters()], dtype=torch.int32, device=device)
    anywhere, everywhere = has_grad.clone(), has_grad.clone()
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    if not torch.equal(anywhere, everywhere):
        names = [n for (n, _), a, e in zip(model.named_parameters(), anywhere, everywhere) if a != e]
        raise RuntimeError(f"ranks disagree on which parameters have a gradient: {names}")
    return full_grad_tensors(model, device)


def train(model, micros: list[Micro], steps: int, device: Any = "cpu",
          at: Callable[[str], None] = lambda where: None) -> dict[str, Any]:
    """``steps`` AdamW steps of this rank's ``micros``, gradient sync on the last only; returns the
    global mean loss per step and, gathered in full, the weights before each step, the gradients of
    each step and the final weights. ``at`` hears where the rank is (for a report when it hangs)."""
    import torch
    import torch.distributed as dist

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    run: dict[str, Any] = {"losses": [], "params": [], "grads": []}
    for step in range(1, steps + 1):
        run["params"].append(full_param_tensors(model, device))
        step_loss = torch.zeros((), device=device)
        for micro in micros:
            # Accumulate without communication; reduce-scatter only after the last micro-batch.
            model.set_requires_gradient_sync(micro.index == len(micros) - 1)
            where = f"step {step}, micro-batch {micro.index + 1}/{len(micros)} " \
                    f"({'text+images' if micro.image else 'text-only'})"
            at(f"{where} forward")
            loss = loss_of(model, micro, device)
            at(f"{where} backward")
            (loss / len(micros)).backward()
            step_loss += loss.detach()
        at(f"step {step}, gathering gradients")
        run["grads"].append(gather_grads(model, device))
        at(f"step {step}, optimizer step")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(step_loss)
        run["losses"].append(step_loss.item() / (dist.get_world_size() * len(micros)))
    at("gathering final weights")
    run["final"] = full_param_tensors(model, device)
    return run


def reference_grads(params: dict[str, Any], plan: list[list[Micro]], device: Any = "cpu",
                    mixed: bool = True) -> dict[str, Any]:
    """One process: the same weights, every rank's micro-batches, FSDP2's arithmetic (bf16 compute
    and fp32 accumulation when ``mixed``, floating inputs cast as FSDP casts them), averaged over ranks."""
    import torch

    dtype = torch.bfloat16 if mixed else torch.float32
    model = build_model()
    model.load_state_dict(params)
    model.to(device=device, dtype=dtype)
    acc: dict[str, Any] = {}
    for micros in plan:
        for micro in micros:
            model.zero_grad(set_to_none=True)
            (loss_of(model, micro, device, dtype) / len(micros)).backward()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    acc[name] = acc.get(name, 0) + p.grad.float()
    return {name: grad / len(plan) for name, grad in acc.items()}


def check_gradients(run: dict[str, Any], plan: list[list[Micro]], device: Any = "cpu",
                    mixed: bool = True) -> dict[str, Any]:
    """Invariant (1): every gradient the reference has matches FSDP's, within bf16 tolerance; one
    the reference has and FSDP's run has not (``None`` there) is a problem, named. ``one_side``: the
    names with a gradient on one side only (either side)."""
    worst = {"error": 0.0, "name": "", "step": 0}
    compared, problems, one_side = 0, [], []
    for step, (params, grads) in enumerate(zip(run["params"], run["grads"]), start=1):
        ref = reference_grads(params, plan, device, mixed)
        one_side += [n for n in sorted(set(grads) ^ set(ref)) if n not in one_side]
        problems += [f"step {step}: {n} has no gradient (reference has one)" for n in ref if n not in grads]
        for name in [n for n in ref if n in grads]:
            error = relative_diff(grads[name], ref[name])
            compared += 1
            if not worst["name"] or error > worst["error"]:
                worst = {"error": error, "name": name, "step": step}
            if error > GRAD_TOLERANCE:
                problems.append(f"step {step}: {name} off by {error:.2e} (relative)")
    return {"ok": not problems and compared > 0, "compared": compared, "worst": worst,
            "problems": problems[:5], "one_side": one_side}


def check_unused_expert(run: dict[str, Any]) -> dict[str, Any]:
    """Invariant (2): the expert no rank used has grad None every step and unchanged weights."""
    grad_states = []  # per step: "None" (all expert tensors), "zero" or "nonzero"
    for grads in run["grads"]:
        expert_grads = [g for name, g in grads.items() if name.startswith(UNUSED_EXPERT_PREFIX)]
        if not expert_grads:
            grad_states.append("None")
        else:
            grad_states.append("nonzero" if any(g.any() for g in expert_grads) else "zero")
    initial, final = run["params"][0], run["final"]
    names = [n for n in initial if n.startswith(UNUSED_EXPERT_PREFIX)]
    max_change = max(float((final[n] - initial[n]).abs().max()) for n in names)
    bitwise = all(initial[n].equal(final[n]) for n in names)
    return {"ok": bitwise and all(s == "None" for s in grad_states),
            "grad_states": grad_states, "bitwise_unchanged": bitwise, "max_change": max_change}


def check_loss(losses: list[float], steps: int = STEPS) -> dict[str, Any]:
    """Invariant (3): training on a fixed batch must lower the loss."""
    return {"ok": len(losses) == steps and losses[-1] < losses[0], "losses": losses}
