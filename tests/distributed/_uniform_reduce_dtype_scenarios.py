"""uniform_reduce_dtype scenarios: bf16 params, fp32 reduce, mixed gradient dtypes at the reduce.

Scenario ``uniform_reduce_dtype``: cases ``late_param`` and ``fill_zero`` (see the scenario's docstring and
``test_dist_uniform_reduce_dtype.py``).
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
    plan_uniform_late_param,
)
from _registry import scenario


@scenario("uniform_reduce_dtype")
def sc_uniform_dtype(ctx: Ctx) -> None:
    """bf16 params, fp32 reduce, accumulation; mixed gradient dtypes at the reduce.

    Case "late_param": expert 1 is first used in the last micro-batch on every rank
    (the upstream assertion, when unpatched, fires on every rank before any collective,
    so the job can go on). Case "fill_zero": the unused-param fill gives rank 1 a bf16
    zero for expert 1 while its other gradients are fp32 accumulations (unpatched: the
    assertion fires on rank 1 only).
    """
    from torch.distributed.fsdp import fully_shard

    mp = _mp_policy("bf16")
    for name, plan, fill in (
        ("late_param", plan_uniform_late_param, False),
        ("fill_zero", plan_uniform_fill_zero, True),
    ):
        model = build_model("experts", n_experts=2)
        fully_shard(model, mesh=ctx.mesh, mp_policy=mp)
        if fill:
            model.set_reduce_scatter_unused_params(True)
        with ctx.case(name, continue_on_error=(name == "late_param")) as rec:
            rec["init_params"] = params_local(model)
            _run_step(ctx, model, plan, step=0, n_mb=2)
            rec["grads"] = grads_local(model)
            rec["full_grads"] = grads_full(model)
