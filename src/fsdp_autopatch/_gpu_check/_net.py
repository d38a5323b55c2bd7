"""Rank side of ``fsdp-autopatch gpu-check``: the small models, data, training loop and one-process
references that the bug cases and the training flavours share. Imports torch (rank processes only).

The shape of the MoE network, and which bug each part reaches:

    x ─► [+ tanh(tower(image)) when the micro-batch has an image] ─► moe(h, experts) ─► head(relu(h))

``tower`` and ``moe`` are FSDP units of their own (the root holds ``head``); the experts a rank
runs are a Python tuple, so the routing is static for ``torch.compile`` and the same model runs on
every rank with a different route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..cases._common import full_grad_tensors, full_param_tensors, relative_diff

DIM = 16
ROWS = 4
N_EXPERTS = 3
SEED = 1234
BF16_TOLERANCE = 1e-2  # max |fsdp - ref| / max |ref| per tensor (bf16 eps is 7.8e-3), as the demo
LR, WEIGHT_DECAY = 1e-2, 0.1


@dataclass
class Ctx:
    rank: int
    world_size: int
    device: torch.device
    compile_backend: str

    def mesh(self, names: tuple[str, ...] | None = None):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=names)


class Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(N_EXPERTS))

    def forward(self, h, experts: tuple[int, ...]):
        out = h
        for index in experts:  # an expert this rank does not route to gets no gradient here
            out = out + self.experts[index](h)
        return out


class Net(nn.Module):
    def __init__(self, tower: bool) -> None:
        super().__init__()
        self.tower = nn.Linear(DIM, DIM) if tower else None
        self.moe = Moe()
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x, image=None, experts: tuple[int, ...] = (0,)):
        h = x
        if image is not None:  # text-only micro-batches skip the tower (bug a's trigger)
            h = h + torch.tanh(self.tower(image))
        h = self.moe(h, experts)
        return self.head(torch.relu(h))


def build(tower: bool) -> Net:
    torch.manual_seed(SEED)
    return Net(tower)


@dataclass(frozen=True)
class Micro:
    """One micro-batch of one rank: its seed, whether it carries an image, the experts it routes to."""

    seed: int
    image: bool
    experts: tuple[int, ...]


def inputs(micro: Micro, device, dtype=None):
    gen = torch.Generator().manual_seed(micro.seed)
    x = torch.randn(ROWS, DIM, generator=gen)
    image = torch.randn(ROWS, DIM, generator=gen) if micro.image else None
    move = (lambda t: t.to(device=device, dtype=dtype)) if dtype else (lambda t: t.to(device))
    return move(x), (move(image) if image is not None else None)


def loss_of(model, micro: Micro, device, count: int, dtype=None):
    x, image = inputs(micro, device, dtype)
    return model(x, image, micro.experts).float().pow(2).mean() / count


def shard(model: Net, ctx: Ctx, *, mixed: bool = True, offload: bool = False, compiled: bool = False,
          fullgraph: bool = False):
    """``fully_shard`` tower, moe, root (bf16 params / fp32 reduce when ``mixed``); per-block
    ``torch.compile`` before sharding (torchtitan's order) when ``compiled``, with ``fullgraph``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options: dict[str, Any] = {"mesh": ctx.mesh()}
    if mixed:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    if compiled:
        if model.tower is not None:
            model.tower = torch.compile(model.tower, backend=ctx.compile_backend, fullgraph=fullgraph)
        model.moe = torch.compile(model.moe, backend=ctx.compile_backend, fullgraph=fullgraph)
    if model.tower is not None:
        fully_shard(model.tower, **options)
    fully_shard(model.moe, **options)
    fully_shard(model, **options)
    return model


def reference_grads(params: dict[str, Any], plan: list[list[Micro]], device, mixed: bool, tower: bool):
    """One process: the same weights, every rank's micro-batches, FSDP2's arithmetic (bf16 compute
    and fp32 accumulation when ``mixed``), each rank's loss divided by the world size."""
    model = build(tower)
    model.load_state_dict(params)
    model.to(device=device, dtype=torch.bfloat16 if mixed else torch.float32)
    acc: dict[str, Any] = {}
    for micros in plan:
        for micro in micros:
            model.zero_grad(set_to_none=True)
            loss_of(model, micro, device, len(micros), torch.bfloat16 if mixed else None).backward()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    acc[name] = acc.get(name, 0) + p.grad.float()
    return {name: grad / len(plan) for name, grad in acc.items()}


def train(model, ctx: Ctx, plan: list[list[Micro]], steps: int, *, fill: bool, mixed: bool = True,
          tower: bool = False, reference: bool = True) -> dict[str, Any]:
    """``steps`` AdamW steps of this rank's micro-batches (``plan[rank]``), gradient sync only on
    the last; per step the full gradients, checked on rank 0 against :func:`reference_grads`."""
    if fill:
        model.set_reduce_scatter_unused_params(True)  # AttributeError on torch < 2.13 without the backport
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    micros = plan[ctx.rank]
    out: dict[str, Any] = {"grads": [], "params": [], "losses": [], "worst": 0.0, "mismatched": []}
    for _ in range(steps):
        out["params"].append(full_param_tensors(model, ctx.device))
        total = 0.0
        for index, micro in enumerate(micros):
            model.set_requires_gradient_sync(index == len(micros) - 1)
            loss = loss_of(model, micro, ctx.device, len(micros))
            loss.backward()
            total += float(loss.detach())
        out["losses"].append(total)
        out["grads"].append(full_grad_tensors(model, ctx.device))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out["final"] = full_param_tensors(model, ctx.device)
    if reference and ctx.rank == 0:
        for params, grads in zip(out["params"], out["grads"]):
            ref = reference_grads(params, plan, ctx.device, mixed, tower)
            # a gradient only one side has (None on the other) is named, not counted in the worst
            both = set(grads) & set(ref)
            out["worst"] = max([out["worst"], *(relative_diff(grads[n], ref[n]) for n in both)])
            out["mismatched"] += [n for n in sorted(set(grads) ^ set(ref)) if n not in out["mismatched"]]
    return out


def untouched(run: dict[str, Any], prefix: str) -> tuple[bool, bool]:
    """(``grad is None`` in every step, weights bitwise unchanged) for the parameters under ``prefix``."""
    none_always = all(not any(n.startswith(prefix) for n in grads) for grads in run["grads"])
    first, last = run["params"][0], run["final"]
    unchanged = all(torch.equal(first[n], last[n]) for n in first if n.startswith(prefix))
    return none_always, unchanged
