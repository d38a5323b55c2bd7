"""unused_param_reduction's case: ranks that use different parameters of one unit, with
set_reduce_scatter_unused_params(True) (PyTorch issue 158719, PyTorch PR 174862, torchtitan issue 2747)."""

from __future__ import annotations

from typing import Any

from ._common import experts, fsdp_api, full_grads, rank_batch, routed_loss, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "fully_shard(2 Linear experts), set_reduce_scatter_unused_params(True); rank r runs expert r only; "
    "one backward"
)


def strikes_at(world_size: int) -> tuple[bool, bool, str] | None:
    """At one rank the bug cannot strike; the case runs all the same (what it shows there)."""
    if world_size < 2:
        return (False, True, "one rank issues the only reduce-scatter, so ranks cannot disagree; run instead: "
                "the fill's method exists (torch's from 2.13, the backport before) and gives the right gradients")
    return None


def _model():
    return experts(2)


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)  # before torch 2.13: the backport's, or AttributeError
    sum_reduction(model)
    routed_loss(model, rank_batch(rank, device=device), rank).backward()
    return {"grads": full_grads(model)}


def reference(world_size: int) -> dict[str, Any]:
    model = _model()  # one process: the mean of every rank's loss, each rank with its own expert
    for rank in range(world_size):
        (routed_loss(model, rank_batch(rank), rank) / world_size).backward()
    return {"grads": full_grads(model)}
