"""What the cases share: the batch of each rank, one-process references, records as JSON values.

torch is imported inside functions: the demo's parent process imports the case modules
(``fsdp_autopatch.cases``) for their names and world sizes, without torch.
"""

from __future__ import annotations

from typing import Any, Callable

TOLERANCE = 1e-5  # the cases' own verdict (demo, GPU check); the tests keep their own tolerances
DIM = 8


def fsdp_api():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    return dist, init_device_mesh, fully_shard


def sum_reduction(*units) -> bool:
    """Reduce by SUM, then divide by the world size, on every unit: torch 2.8's gloo reduce-scatter
    sums even for ``ReduceOp.AVG`` (PyTorch issue 162338), so AVG would differ between releases."""
    for unit in units:
        unit.set_force_sum_reduction_for_comms(True)
    return True


def rank_batch(rank: int, rows: int = 4, device: str = "cpu"):
    """Rank ``rank``'s batch: drawn on the CPU (the same numbers on every device), then moved."""
    import torch

    return torch.randn(rows, DIM, generator=torch.Generator().manual_seed(100 + rank)).to(device)


def sum_loss(model, batch):
    return model(batch).pow(2).sum()


def experts(count: int):
    """A module of ``count`` Linear experts; ``forward(x, used)`` sums the experts in ``used``."""
    import torch
    from torch import nn

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(count))

        def forward(self, x, used: tuple[int, ...]):
            return sum(self.experts[e](x) for e in used)

    torch.manual_seed(0)
    return Experts()


def routed_loss(model, batch, rank: int):
    """Rank r routes its batch to expert ``r % 2`` only: ranks use different parameters of the unit."""
    return model(batch, used=(rank % 2,)).pow(2).sum()


def listed(tensors: dict[str, Any]) -> dict[str, Any]:
    """``{name: tensor}`` as a JSON value: fp32 nested lists, read on the CPU."""
    return {name: t.detach().float().cpu().tolist() for name, t in tensors.items()}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_grads(model) -> dict[str, Any]:
    """The unsharded gradients as lists (a collective: every rank calls it); a ``None`` grad is left out."""
    return listed({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})


def full_params(model) -> dict[str, Any]:
    """The unsharded weights as lists (a collective: every rank calls it)."""
    return listed({n: _full(p) for n, p in model.named_parameters()})


def one_process_grads(build: Callable[[], Any], loss_of: Callable, world_size: int) -> dict[str, Any]:
    """One process: the mean of every rank's loss, the gradient FSDP2's reduce-scatter gives."""
    model = build()
    for rank in range(world_size):
        (loss_of(model, rank_batch(rank)) / world_size).backward()
    return full_grads(model)


def sgd_steps(model, steps: int, lr: float, world_size: int) -> Any:
    """One process: ``steps`` SGD steps on the mean of every rank's :func:`sum_loss` (what FSDP2 with
    a sum-then-divide reduction trains to); returns ``model``."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        for rank in range(world_size):
            (sum_loss(model, rank_batch(rank)) / world_size).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def max_diff(got: dict[str, Any], ref: dict[str, Any]) -> float:
    """Largest ``max |got - ref| / max |ref|`` over the tensors or lists (inf if the names differ)."""
    import torch

    if set(got) != set(ref):
        return float("inf")
    diffs = [0.0]
    for name in ref:
        g, r = torch.as_tensor(got[name]).float(), torch.as_tensor(ref[name]).float()
        diffs.append(float((g - r).abs().max() / r.abs().max().clamp_min(1e-12)))
    return max(diffs)


def judge_against_reference(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Whether the record's gradients and weights equal the reference's (those it has), and by how much."""
    parts, right = [], True
    for key, what in (("grads", "grad"), ("params", "weight")):
        if key in reference:
            diff = max_diff(record.get(key, {}), reference[key])
            right = right and diff <= TOLERANCE
            parts.append(f"max relative |{what} - reference| {diff:.1e}")
    return right, "; ".join(parts) or "completed"

