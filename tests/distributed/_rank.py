"""The one rank entry point of every 2-rank (and 4-rank, and one-process) job of ``tests/distributed``.

Every rank runs ``python _rank.py <scenario> <result file> <json args>`` (``_dist_launcher``).
The scenario is found by name in the scenario modules (``_registry.find``: only the module that
declares it is imported). A gloo scenario (the default) first gets the gloo process group (timeout
``FSDP_DIST_PG_TIMEOUT_S``) and a 1-D CPU mesh over the world (``ctx.mesh``), and the workaround of
torch 2.8's gloo ``ReduceOp.AVG`` bug where this torch has it; a ``gloo=False`` scenario makes its
own world in this one process (the fake backend, threaded process groups).

Whatever the scenario raises is recorded (``data["error"]``), the result file saved, and the rank
leaves with ``os._exit`` (no ``destroy_process_group``, no interpreter teardown): a peer may be
wedged in a collective, or a thread rank still waiting in one, and this rank must not wait for it.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch

import _registry
from _dist_common import Ctx, _error_record


def main() -> None:
    name, result_path, args_json = sys.argv[1], sys.argv[2], sys.argv[3]
    ctx = Ctx(result_path, json.loads(args_json))
    code = 0
    gloo = True
    try:
        found = _registry.find(name)
        gloo = found.gloo
        if gloo:
            _init_gloo(ctx)
        found.run(ctx)
    except BaseException as e:  # noqa: BLE001 - record everything, then leave
        ctx.data["error"] = _error_record(e)
        code = 3
    if gloo:
        ctx.data["fsdp_module_has_api"] = _has_public_api()
    try:
        ctx.save()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _init_gloo(ctx: Ctx) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    timeout = int(os.environ.get("FSDP_DIST_PG_TIMEOUT_S", "30"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    ctx.mesh = init_device_mesh("cpu", (ctx.world_size,))
    ctx.data["gloo_avg_sums"] = _gloo_reduce_scatter_avg_sums()
    if ctx.data["gloo_avg_sums"]:
        _force_sum_reduction_in_fully_shard()


def _gloo_reduce_scatter_avg_sums() -> bool:
    """Whether this torch's gloo reduce-scatter ignores ``ReduceOp.AVG`` and sums.

    torch 2.8 does (PyTorch issue 162338): FSDP2 reduce-scatters fp32/bf16 gradients with AVG,
    so on gloo every gradient comes out multiplied by the world size, with or without this
    plugin. Probed with one tiny collective rather than guessed from the version.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    inp = torch.full((world,), float(dist.get_rank() + 1))
    out = torch.empty(1)
    dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.AVG)
    mean = (world + 1) / 2
    return not torch.allclose(out, torch.tensor([mean]))


def _force_sum_reduction_in_fully_shard() -> None:
    """Work around the gloo AVG bug the way a user would: every ``fully_shard`` unit gets
    ``set_force_sum_reduction_for_comms(True)`` (SUM, then FSDP2 divides by the world size).
    The scenarios import ``fully_shard`` from ``torch.distributed.fsdp`` when they run, so they
    all get this wrapper."""
    import torch.distributed.fsdp as fsdp

    original = fsdp.fully_shard

    # wraps: keeps the contract's attributes, e.g. ``fully_shard.state``, which torch 2.8 - 2.14's
    # pipelining stage calls on the fully_shard it imports from torch.distributed.fsdp.
    @functools.wraps(original)
    def fully_shard(module, *args, **kwargs):
        result = original(module, *args, **kwargs)
        for m in result if isinstance(result, list) else [result]:
            m.set_force_sum_reduction_for_comms(True)
        return result

    fsdp.fully_shard = fully_shard


def _has_public_api() -> bool | None:
    mod = sys.modules.get("torch.distributed.fsdp")
    if mod is None:
        return None
    return hasattr(mod.FSDPModule, "set_reduce_scatter_unused_params")


if __name__ == "__main__":
    main()
