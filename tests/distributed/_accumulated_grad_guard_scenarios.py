"""accumulated_grad_guard scenarios: a unit that never runs forward in a whole accumulation step
(its case's unit runs in the last micro-batch), and the step after.

``accumulated_grad_guard``: the vision tower of ``TextVisionModel`` (its own unit, as is ``shared``), bf16
params / fp32 reduce, two micro-batches with sync on the last only. Variant ``text_only`` (step 0):
the tower never runs forward; ``image_last`` (step 1): text-only, then images. See
``test_dist_accumulated_grad_guard.py``.
"""

from __future__ import annotations

from _dist_common import Ctx, _mp_policy, _run_step, build_model, grads_full, grads_local, params_local, plan_grad_guard
from _registry import scenario


@scenario("accumulated_grad_guard")
def sc_grad_guard(ctx: Ctx) -> None:
    """Vision tower skipped by text-only micro-batches, bf16/fp32 MP, accumulation."""
    from torch.distributed.fsdp import fully_shard

    model = build_model("text_vision")
    mp = _mp_policy("bf16")
    fully_shard(model.tower, mesh=ctx.mesh, mp_policy=mp)
    fully_shard(model.shared, mesh=ctx.mesh, mp_policy=mp)
    fully_shard(model, mesh=ctx.mesh, mp_policy=mp)
    ctx.data["init_params"] = params_local(model)
    with ctx.case("text_only") as rec:  # step 0: the tower has never run forward
        _run_step(ctx, model, plan_grad_guard, step=0, n_mb=2)
        rec["grads"] = grads_local(model)
        rec["full_grads"] = grads_full(model)
    model.zero_grad(set_to_none=True)
    with ctx.case("image_last") as rec:  # step 1: text-only, then images
        _run_step(ctx, model, plan_grad_guard, step=1, n_mb=2)
        rec["grads"] = grads_local(model)
        rec["full_grads"] = grads_full(model)
