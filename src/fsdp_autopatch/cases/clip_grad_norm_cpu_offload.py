"""clip_grad_norm_cpu_offload's case: CPUOffloadPolicy on an NCCL group, then clip_grad_norm_.

NCCL has a backend for ``cuda`` only: the partial norms of the CPU-offloaded gradients cannot be
reduced where they live (``No backend type associated with device type cpu``). The bug needs a CUDA
device and NCCL (``NEEDS``): the GPU check runs this case; the gloo tests skip it, and the fix's
logic is tested with a CPU stand-in (``tests/distributed/test_dist_clip_grad_norm_cpu_offload.py``).
It strikes from 2 ranks (one GPU each): DTensor reduces nothing over a mesh of one rank.
"""

from __future__ import annotations

from typing import Any

from ._common import DIM, TOLERANCE, fsdp_api, full_grads, judge_against_reference, rank_batch, sum_loss, sum_reduction

NEEDS = ("cuda",)
WORLD_SIZE = 2
WHAT = "two Linear units with CPUOffloadPolicy on an NCCL group (no CPU backend); clip_grad_norm_"

MAX_NORM = 0.1


def strikes_at(world_size: int) -> tuple[bool, bool, str] | None:
    """At one rank the bug cannot strike; the case runs all the same (what it shows there)."""
    if world_size < 2:
        return (False, True, "a mesh of one rank has no partial norm to reduce (DTensor skips its collective), "
                "so the missing CPU backend is never asked for; run instead: CPU-offloaded clipping on NCCL gives "
                "the one-process values and the fix leaves torch's path alone")
    return None


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))


def _gathered_grads(model) -> dict[str, Any]:
    """The full clipped gradients, gathered on the mesh's device (``from_local`` moves each CPU
    shard there): an all-gather of CPU tensors would meet the same missing backend."""
    from torch.distributed.tensor import DTensor

    from ._common import listed

    grads = {}
    for name, param in model.named_parameters():
        g = param.grad
        on_device = DTensor.from_local(g.to_local(), g.device_mesh, g.placements, run_check=False,
                                       shape=g.shape, stride=g.stride())
        grads[name] = on_device.full_tensor()
    return listed(grads)


def run(rank: int, world_size: int, device: str = "cuda") -> dict[str, Any]:
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy

    _, init_device_mesh, fully_shard = fsdp_api()
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("dp",))
    model = _model().to(device)
    offload = CPUOffloadPolicy(pin_memory=device.startswith("cuda"))
    sum_reduction(fully_shard(model[0], mesh=mesh, offload_policy=offload),
                  fully_shard(model, mesh=mesh, offload_policy=offload))
    sum_loss(model, rank_batch(rank, device=device)).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    local = total.to_local() if hasattr(total, "to_local") else total
    placements = getattr(total, "placements", ())
    full = total.full_tensor() if hasattr(total, "full_tensor") else total  # no collective: replicated
    return {"grads": _gathered_grads(model),
            "values": {"total_norm": float(full), "total_on": local.device.type,
                       "total_replicated": all(p.is_replicate() for p in placements)}}


def reference(world_size: int) -> dict[str, Any]:
    import torch

    model = _model()
    for rank in range(world_size):
        (sum_loss(model, rank_batch(rank)) / world_size).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return {"grads": full_grads(model), "values": {"total_norm": float(total)}}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the total norm and the clipped gradients equal the one-process clip's, and the total
    lives on the CPU (where torch puts it: the first gradient's device), replicated."""
    grads_right, grads_text = judge_against_reference(record, reference)
    values, ref_total = record["values"], reference["values"]["total_norm"]
    norm_right = abs(values["total_norm"] - ref_total) <= TOLERANCE * ref_total
    home = values["total_on"] == "cpu" and values["total_replicated"]
    text = (f"total norm {values['total_norm']:.6f} (reference {ref_total:.6f}) on {values['total_on']}"
            f"{', replicated' if values['total_replicated'] else ', partial'}; "
            f"{grads_text.replace('grad', 'clipped grad')}")
    return grads_right and norm_right and home, text
