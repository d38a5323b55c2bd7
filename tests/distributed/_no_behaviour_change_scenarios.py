"""Every patch at once where no bug strikes: the plugin must not change FSDP2's numbers.

``no_change``: the MLP (every parameter used everywhere), fp32, bf16/fp32 MP and MP with the fill
on, two AdamW steps of two micro-batches each. See ``test_dist_no_behaviour_change.py``.
"""

from __future__ import annotations

import torch

from _dist_common import Ctx, _mp_policy, _run_step, adam_steps, build_model, grads_local, params_local, plan_mlp
from _registry import scenario


@scenario("no_change")
def sc_no_change(ctx: Ctx) -> None:
    """Nothing unused; fp32, bf16/fp32 MP, and MP with the fill on: 2 AdamW steps."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for name, mp_kind, fill in (("fp32", None, False), ("mp", "bf16", False), ("mp_fill", "bf16", True)):
        if fill and not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
            continue  # torch < 2.13 with the plugin off: no fill to compare
        model = build_model("mlp")
        mp = _mp_policy(mp_kind)
        for b in model.blocks:
            fully_shard(b, mesh=ctx.mesh, mp_policy=mp)
        fully_shard(model, mesh=ctx.mesh, mp_policy=mp)
        if fill:
            model.set_reduce_scatter_unused_params(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        with ctx.case(name) as rec:
            rec["init_params"] = params_local(model)
            for step in range(2):
                _run_step(ctx, model, plan_mlp, step=step, n_mb=2)
                rec[f"grads_{step}"] = grads_local(model)
                opt.step()
                opt.zero_grad(set_to_none=True)
            rec["params_after"] = params_local(model)
            rec["steps_after"] = adam_steps(model, opt)
