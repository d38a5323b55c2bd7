"""The rank side of ``demo --bug NAME``: the smallest training that shows one bug, and its check.

Each ``show_<bug>(rank, world_size)`` builds its model with FSDP2 on CPU ranks (gloo), runs it and,
on rank 0, returns ``{"right": bool, "value": str}``: what was measured (process groups, gradients
against a one-process reference, attribute names, norms) and whether that is the right value.
Every rank returns; an exception is reported by the worker. torch is imported inside functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOLERANCE = 1e-5
DIM = 8


def _fsdp():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    return dist, init_device_mesh, fully_shard


def _sum_reduction(*units) -> bool:
    """Reduce by SUM, then divide by the world size, on every unit: torch 2.8's gloo reduce-scatter
    sums even for ``ReduceOp.AVG`` (PyTorch issue 162338), so AVG would differ between releases."""
    for unit in units:
        unit.set_force_sum_reduction_for_comms(True)
    return True


def _rank_batch(rank: int, rows: int = 4):
    import torch

    return torch.randn(rows, DIM, generator=torch.Generator().manual_seed(100 + rank))


def _full_grads(model) -> dict[str, Any]:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def _max_diff(got: dict[str, Any], ref: dict[str, Any]) -> float:
    """Largest ``max |got - ref| / max |ref|`` over the tensors (inf if the names differ)."""
    if set(got) != set(ref):
        return float("inf")
    return max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)) for n in ref)


def _backward_every_rank(model, loss_of, world_size: int) -> None:
    """One process: the mean of every rank's loss, the gradient FSDP2's reduce-scatter gives."""
    for rank in range(world_size):
        (loss_of(model, _rank_batch(rank)) / world_size).backward()


def _reference_grads(build, loss_of, world_size: int) -> dict[str, Any]:
    model = build()
    _backward_every_rank(model, loss_of, world_size)
    return {n: p.grad for n, p in model.named_parameters()}


def _grads_verdict(model, build, loss_of, world_size: int, rank: int) -> tuple[float, bool]:
    grads = _full_grads(model)  # collective: every rank
    if rank != 0:
        return 0.0, True
    diff = _max_diff(grads, _reference_grads(build, loss_of, world_size))
    return diff, diff <= TOLERANCE


# -- post_forward_mesh_cache: process groups per unit with an int reshard_after_forward -------------

MESH_UNITS = 8


def _linear_stack():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(MESH_UNITS)))


def _sum_loss(model, batch):
    return model(batch).pow(2).sum()


def show_post_forward_mesh_cache(rank: int, world_size: int) -> dict[str, Any]:
    dist, init_device_mesh, fully_shard = _fsdp()
    mesh = init_device_mesh("cpu", (world_size,))
    model = _linear_stack()
    groups_before = len(dist.distributed_c10d._world.pg_map)
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)  # the root as most scripts leave it: the count is the units'
    created = len(dist.distributed_c10d._world.pg_map) - groups_before
    _sum_reduction(model, *model)
    _sum_loss(model, _rank_batch(rank)).backward()
    diff, grads_right = _grads_verdict(model, _linear_stack, _sum_loss, world_size, rank)
    value = (f"{MESH_UNITS} units with reshard_after_forward=2 (and the root) on {world_size} ranks created "
             f"{created} process groups; max relative |grad - reference| {diff:.1e}")
    return {"right": grads_right and created <= 2, "value": value}


# -- grouped_module_reuse: a grouped unit's head called again inside the root's forward ------------


def _mtp_model():
    import torch
    from torch import nn

    class Mtp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(DIM, DIM)
            self.aux = None

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.norm = nn.Linear(DIM, DIM), nn.LayerNorm(DIM)
            self.head, self.mtp = nn.Linear(DIM, 4, bias=False), Mtp()

        def forward(self, x):
            h = torch.relu(self.layer(x))
            logits = self.head(self.norm(h))
            self.mtp.aux = self.head(self.mtp.proj(h))  # kept aside, not returned (MTP-style)
            return logits

    torch.manual_seed(0)
    return Model()


def _mtp_loss(model, batch):
    logits = model(batch)
    return logits.pow(2).sum() + model.mtp.aux.pow(2).sum()


def show_grouped_module_reuse(rank: int, world_size: int) -> dict[str, Any]:
    _, init_device_mesh, fully_shard = _fsdp()
    mesh = init_device_mesh("cpu", (world_size,))
    model = _mtp_model()
    fully_shard(model.layer, mesh=mesh)
    fully_shard([model.norm, model.head], mesh=mesh)  # one unit over two modules
    fully_shard(model, mesh=mesh)
    _sum_reduction(model, model.layer, model.norm)
    _mtp_loss(model, _rank_batch(rank)).backward()
    diff, right = _grads_verdict(model, _mtp_model, _mtp_loss, world_size, rank)
    return {"right": right, "value": f"backward completed; max relative |grad - reference| {diff:.1e}"}


# -- keep_param_attributes: user attributes on parameters across fully_shard -----------------------

WEIGHT_DECAY = 0.5


def _tagged_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, DIM))
    for param in (model[0].bias, model[1].weight, model[1].bias, model[2].bias):
        param.no_weight_decay = True
    model[2].weight.tag = "expert"
    return model


def _user_attributes(model) -> dict[str, list[str]]:
    return {n: sorted(k for k in vars(p) if not k.startswith("_")) for n, p in model.named_parameters()}


def _adamw_step(model) -> None:
    import torch

    params = list(model.parameters())
    no_decay = [p for p in params if getattr(p, "no_weight_decay", False)]
    decay = [p for p in params if not getattr(p, "no_weight_decay", False)]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=0.1).step()


def show_keep_param_attributes(rank: int, world_size: int) -> dict[str, Any]:
    _, init_device_mesh, fully_shard = _fsdp()
    mesh = init_device_mesh("cpu", (world_size,))
    model, reference = _tagged_model(), _tagged_model()
    expected = _user_attributes(reference)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kept = _user_attributes(model)
    _sum_reduction(model, *model)
    _sum_loss(model, _rank_batch(rank)).backward()
    _adamw_step(model)
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective
    if rank != 0:
        return {"right": True, "value": ""}
    _backward_every_rank(reference, _sum_loss, world_size)
    _adamw_step(reference)
    diff = _max_diff(weights, dict(reference.named_parameters()))
    marked = sorted(n for n in expected if expected[n])
    lost = [n for n in marked if kept[n] != expected[n]]
    value = (f"{len(marked) - len(lost)} of {len(marked)} marked parameters keep their attributes"
             + (f" (lost: {', '.join(lost)})" if lost else "")
             + f"; max relative |weight - reference| after an AdamW step {diff:.1e}")
    return {"right": not lost and diff <= TOLERANCE, "value": value}


# -- clip_grad_norm_multi_mesh: dense parameters on ("dp",), experts on ("edp",) -------------------

MAX_NORM = 0.1


def _dense_and_expert():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))


def show_clip_grad_norm_multi_mesh(rank: int, world_size: int) -> dict[str, Any]:
    import torch

    _, init_device_mesh, fully_shard = _fsdp()
    dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    edp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("edp",))
    model = _dense_and_expert()
    _sum_reduction(fully_shard(model[1], mesh=edp), fully_shard(model, mesh=dp))
    _sum_loss(model, _rank_batch(rank)).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    total = total.full_tensor() if hasattr(total, "full_tensor") else total
    grads = _full_grads(model)  # collective
    if rank != 0:
        return {"right": True, "value": ""}
    reference = _dense_and_expert()
    _backward_every_rank(reference, _sum_loss, world_size)
    ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    diff = _max_diff(grads, {n: p.grad for n, p in reference.named_parameters()})
    norm_diff = float((total - ref_total).abs())
    value = (f"total norm {float(total):.6f} (reference {float(ref_total):.6f}); "
             f"max relative |clipped grad - reference| {diff:.1e}")
    return {"right": norm_diff <= TOLERANCE * float(ref_total) and diff <= TOLERANCE, "value": value}


SHOWS = {
    "post_forward_mesh_cache": show_post_forward_mesh_cache,
    "grouped_module_reuse": show_grouped_module_reuse,
    "keep_param_attributes": show_keep_param_attributes,
    "clip_grad_norm_multi_mesh": show_clip_grad_norm_multi_mesh,
}


def bug_worker_main(bug: str, rank: int, out_dir: str, deadline_s: float) -> int:
    """One rank of ``demo --bug``: write ``<out_dir>/rank<r>.json`` (result or error), then exit."""
    from ._worker import Progress, run_reported, start_watchdogs

    start_watchdogs(deadline_s)
    progress = Progress(Path(out_dir) / f"rank{rank}.where")
    return run_reported(lambda result: result.update(_show(bug, rank, progress)), rank, out_dir, progress)


def _show(bug: str, rank: int, progress) -> dict[str, Any]:
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401  -- the patches are applied on this import

    from ._scenarios import PG_TIMEOUT_S

    torch.set_num_threads(1)  # the ranks share the machine's cores
    progress.at("init_process_group")
    dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    progress.at(bug)
    out = SHOWS[bug](rank, int(os.environ["WORLD_SIZE"]))
    progress.at("barrier")
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        out.update(_what_the_plugin_says(bug))
    return out


def _what_the_plugin_says(bug: str) -> dict[str, Any]:
    """The patch's registry record and declaration, so that the demo never repeats them."""
    try:
        import fsdp_autopatch
        from fsdp_autopatch.patches import load_patch

        records = fsdp_autopatch.status().to_dict()["patches"]
        declared = load_patch(bug)
        return {
            "status": next((r for r in records if r["name"] == bug), {}),
            "declared": {"symptom": declared.symptom, "upstream": ", ".join(declared.upstream),
                         "summary": declared.summary},
        }
    except Exception as exc:  # informative only: the run's value stands without it
        return {"status": {"status": "unknown", "reason": f"{type(exc).__name__}: {exc}"}}
