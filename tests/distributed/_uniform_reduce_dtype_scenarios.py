"""uniform_reduce_dtype scenarios: bf16 params, fp32 reduce, the unused-param fill's bf16 zero next to
fp32 accumulated gradients at the reduce (its case shows a parameter first used in the reducing
micro-batch). See ``test_dist_uniform_reduce_dtype.py``.
"""

from __future__ import annotations

from _dist_common import (
    Ctx,
    _mp_policy,
    _run_step,
    build_model,
    grads_full,
    grads_local,
    params_local,
    plan_uniform_fill_zero,
)
from _registry import scenario


@scenario("uniform_reduce_dtype")
def sc_uniform_dtype(ctx: Ctx) -> None:
    """Case "fill_zero": bf16 params, fp32 reduce, accumulation; the unused-param fill gives rank 1 a
    bf16 zero for expert 1 while its other gradients are fp32 accumulations (unpatched: the
    assertion fires on rank 1 only)."""
    from torch.distributed.fsdp import fully_shard

    model = build_model("experts", n_experts=2)
    fully_shard(model, mesh=ctx.mesh, mp_policy=_mp_policy("bf16"))
    model.set_reduce_scatter_unused_params(True)
    with ctx.case("fill_zero") as rec:
        rec["init_params"] = params_local(model)
        _run_step(ctx, model, plan_uniform_fill_zero, step=0, n_mb=2)
        rec["grads"] = grads_local(model)
        rec["full_grads"] = grads_full(model)
