"""restore_unused_param_grads's case: the unused-parameter fill on, a parameter no rank used, one
AdamW step (same class as DDP's PyTorch issue 28294; Megatron-LM documents it)."""

from __future__ import annotations

from typing import Any

from ._common import experts, fsdp_api, full_grads, judge_against_reference, rank_batch, routed_loss, sum_reduction

WORLD_SIZE = 2
WHAT = (
    "fully_shard(3 Linear experts), set_reduce_scatter_unused_params(True); rank r runs expert r, no rank "
    "expert 2; one backward, one AdamW(weight_decay=0.1) step"
)

UNUSED = "experts.2."  # the expert no rank runs


def strikes_at(world_size: int) -> tuple[bool, bool, str] | None:
    """It strikes at every size; at one rank part of the fix's cost does not run (said, for the step cost)."""
    if world_size < 2:
        return (True, True, "strikes (the fill zero-fills at any size); at one rank the usage flags have no peer, "
                "so the flag all-reduce and its host sync do not run (see the cost's on_forced_sync)")
    return None


def _model():
    return experts(3)


def _unused_full(model) -> dict[str, Any]:
    """Expert 2's full weights (a collective: every rank calls it)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if n.startswith(UNUSED)}


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    model = _model().to(device)
    fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)  # the fill: ranks run different experts
    sum_reduction(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    routed_loss(model, rank_batch(rank, device=device), rank).backward()
    grad_is_none = all(p.grad is None for n, p in model.named_parameters() if n.startswith(UNUSED))
    grads = {n: g for n, g in full_grads(model).items() if not n.startswith(UNUSED)}  # the used experts'
    before = _unused_full(model)
    opt.step()
    after = _unused_full(model)
    moved = max(float((after[n] - before[n]).abs().max()) for n in before)
    return {"grads": grads, "values": {
        "unused_grad_is_none": grad_is_none,
        "unused_unchanged": all(torch.equal(after[n], before[n]) for n in before),
        "unused_moved_by": moved,
    }}


def _reference_grads(world_size: int) -> dict[str, Any]:
    """One process: the mean of every rank's loss, each rank with its own expert."""
    model = _model()
    for rank in range(world_size):
        (routed_loss(model, rank_batch(rank), rank) / world_size).backward()
    return full_grads(model)


def reference(world_size: int) -> dict[str, Any]:
    grads = _reference_grads(world_size)
    return {"grads": grads, "values": {"unused_grad_is_none": True, "unused_unchanged": True, "unused_moved_by": 0.0}}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: expert 2's grad None and its weights bitwise unchanged by AdamW; the others' the reference's."""
    grads_right, grads_text = judge_against_reference(record, reference)
    values = record["values"]
    none, unchanged = values["unused_grad_is_none"], values["unused_unchanged"]
    moved = "bitwise unchanged" if unchanged else f"moved by {values['unused_moved_by']:.1e}"
    text = (f"expert 2 (used by no rank): grad {'None' if none else 'a tensor (zero)'} after the backward, "
            f"weights {moved} by the AdamW step; others: {grads_text}")
    return grads_right and none and unchanged, text
