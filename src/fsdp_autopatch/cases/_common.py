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


# The full-value contract of the wheel (the cases, the demo, the GPU check): gathered in full, fp32,
# by the parameter's uncompiled name; a ``None`` gradient is left out (never a zero), and what a missing
# one means is each caller's to say: :func:`max_diff` counts it as a difference.


def full(tensor, device=None):
    """A DTensor's full value, detached (a collective: every rank calls it); a plain tensor as it is.
    On ``device`` when given: CPU-offloaded shards move there first, to gather on its backend."""
    if not hasattr(tensor, "full_tensor"):
        return tensor.detach() if device is None else tensor.detach().to(device)
    local = tensor.to_local()
    if device is not None and local.device != device:
        from torch.distributed.tensor import DTensor

        tensor = DTensor.from_local(local.to(device), tensor.device_mesh, tensor.placements,
                                    shape=tensor.shape, stride=tensor.stride())
    return tensor.full_tensor().detach()


def _uncompiled(name: str) -> str:
    return name.replace("_orig_mod.", "")  # what torch.compile's wrapper adds to the names


def full_param_tensors(model, device=None) -> dict[str, Any]:
    """Every parameter in full, fp32 (a collective)."""
    return {_uncompiled(n): full(p, device).float().clone() for n, p in model.named_parameters()}


def full_grad_tensors(model, device=None) -> dict[str, Any]:
    """Every gradient that exists, in full, fp32 (a collective: the ranks must agree on which exist)."""
    return {_uncompiled(n): full(p.grad, device).float().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def full_grads(model) -> dict[str, Any]:
    """:func:`full_grad_tensors` as lists (a JSON value)."""
    return listed(full_grad_tensors(model))


def full_params(model) -> dict[str, Any]:
    """:func:`full_param_tensors` as lists (a JSON value)."""
    return listed(full_param_tensors(model))


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


def relative_diff(got: Any, ref: Any) -> float:
    """``max |got - ref| / max |ref|`` of one tensor or list, in fp32 (an all-zero ``ref``: / 1e-12)."""
    import torch

    g, r = torch.as_tensor(got).float(), torch.as_tensor(ref).float()
    return float((g - r).abs().max() / r.abs().max().clamp_min(1e-12))


def max_diff(got: dict[str, Any], ref: dict[str, Any]) -> float:
    """Largest :func:`relative_diff` over the tensors or lists; inf if the names differ (a gradient
    one side has and the other has not, ``None`` there, is a difference)."""
    if set(got) != set(ref):
        return float("inf")
    return max([0.0, *(relative_diff(got[name], ref[name]) for name in ref)])


def judge_against_reference(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Whether the record's gradients and weights equal the reference's (those it has), and by how much."""
    parts, right = [], True
    for key, what in (("grads", "grad"), ("params", "weight")):
        if key in reference:
            diff = max_diff(record.get(key, {}), reference[key])
            right = right and diff <= TOLERANCE
            parts.append(f"max relative |{what} - reference| {diff:.1e}")
    return right, "; ".join(parts) or "completed"

