"""What the ``demo --bug`` shows share: the batch of each rank, one-process references, verdicts.

torch is imported inside functions: the parent process of the demo imports the show modules
(``fsdp_autopatch.demo.bugs``) for their names and world sizes, without torch.
"""

from __future__ import annotations

from typing import Any

TOLERANCE = 1e-5
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


def full_grads(model) -> dict[str, Any]:
    """The unsharded gradients, on the CPU, where the one-process references are computed."""
    return {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters() if p.grad is not None}


def max_diff(got: dict[str, Any], ref: dict[str, Any]) -> float:
    """Largest ``max |got - ref| / max |ref|`` over the tensors (inf if the names differ)."""
    if set(got) != set(ref):
        return float("inf")
    return max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)) for n in ref)


def backward_every_rank(model, loss_of, world_size: int) -> None:
    """One process: the mean of every rank's loss, the gradient FSDP2's reduce-scatter gives."""
    for rank in range(world_size):
        (loss_of(model, rank_batch(rank)) / world_size).backward()


def reference_grads(build, loss_of, world_size: int) -> dict[str, Any]:
    model = build()
    backward_every_rank(model, loss_of, world_size)
    return {n: p.grad for n, p in model.named_parameters()}


def grads_verdict(model, build, loss_of, world_size: int, rank: int) -> tuple[float, bool]:
    grads = full_grads(model)  # collective: every rank
    if rank != 0:
        return 0.0, True
    diff = max_diff(grads, reference_grads(build, loss_of, world_size))
    return diff, diff <= TOLERANCE


def sum_loss(model, batch):
    return model(batch).pow(2).sum()


def guard_stopped(error: BaseException, what: str) -> dict[str, Any]:
    """A guard show's result when ``error`` stopped the run: the guard's whole ``GuardError``, as the
    user's own run would print it (anything else is re-raised: the worker reports it)."""
    if type(error).__name__ != "GuardError":
        raise error
    return {"right": True, "value": f"{what} with the guard's error:", "guard_error": f"GuardError: {error}"}
