"""unused_param_reduction scenarios: ranks that use different parameters of one FSDP unit.

``expert_routing``: the experts model in one unit, rank r uses expert r, expert 2 both, expert 3
none (fp32); ``args["modes"]`` picks torch's API, the plugin's backport (forced on a torch that has
the API), nothing set, or the environment policy. See ``test_dist_unused_param_reduction.py``.
"""

from __future__ import annotations

from typing import Any

from _dist_common import (
    Ctx,
    _run_step,
    build_model,
    grads_full,
    grads_local,
    group_flags,
    params_local,
    plan_expert_routing,
    plan_expert_routing_uneven,
)
from _registry import scenario


@scenario("unused_param_reduction")
def sc_expert_routing(ctx: Ctx) -> None:
    """Rank r uses expert r inside one FSDP unit; expert 2 both ranks, expert 3 none (fp32).

    args["modes"]: the cases to run, each on a fresh model, in order:
    "native" (torch's public API); "flag_off" (nothing set: the ranks reduce different
    parameter lists of equal total size); "flag_off_uneven" (nothing set, rank 0 uses
    one expert more than rank 1: different sizes, gloo aborts, so it must come last);
    "backport" (public API deleted, the plugin's backport forced; alone in its job);
    "env_policy" (nothing in code; the launcher sets
    FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS=1).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    modes = ctx.args["modes"]
    if "backport" in modes:
        assert modes == ["backport"], "the backport changes torch for the whole process"
        method = FSDPModule.__dict__.get("set_reduce_scatter_unused_params")
        if method is not None and not getattr(method, "__fsdp_autopatch__", False):
            del FSDPModule.set_reduce_scatter_unused_params  # simulate torch < 2.13
        ctx.data["backport"] = _force_unused_param_backport()
    native_fill_calls = _count_native_fill()
    for mode in modes:
        with ctx.case(mode) as rec:
            model = build_model("experts", n_experts=4)
            fully_shard(model, mesh=ctx.mesh)
            if mode in ("native", "backport"):
                model.set_reduce_scatter_unused_params(True)
            rec["group_flags"] = group_flags(model)
            rec["init_params"] = params_local(model)
            before = native_fill_calls[0]
            plan = plan_expert_routing_uneven if mode == "flag_off_uneven" else plan_expert_routing
            _run_step(ctx, model, plan, step=0, n_mb=1, accumulate=False)
            rec["native_fill_calls"] = native_fill_calls[0] - before
            rec["grads"] = grads_local(model)
            if not mode.startswith("flag_off"):  # flag off: a grad may be None on one rank only
                rec["full_grads"] = grads_full(model)


def _count_native_fill() -> list[int]:
    """Count torch 2.13's own zero fill (``FSDPParam.unsharded_zero_grad_data``).

    With the backport forced, its fill runs first, so torch's never has to: the count
    stays 0 and the gradients are right only because of the backport.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    calls = [0]
    prop = FSDPParam.__dict__.get("unsharded_zero_grad_data")
    if isinstance(prop, property):

        def counted(self):
            calls[0] += 1
            return prop.fget(self)

        FSDPParam.unsharded_zero_grad_data = property(counted)
    return calls


def _force_unused_param_backport() -> dict[str, Any]:
    """Apply the plugin's ``unused_param_reduction`` backport on a torch that has the API.

    Run after ``del FSDPModule.set_reduce_scatter_unused_params``. The patch order of
    a torch < 2.13 process is kept: ``restore_unused_param_grads`` (applied at import)
    is reverted, the backport applied, then the restore patch applied again on top, so
    its usage probe runs before the backport's zero fill as it would on torch 2.12.
    """
    from torch.distributed.fsdp import FSDPModule

    import fsdp_autopatch.patches.restore_unused_param_grads as restore
    import fsdp_autopatch.patches.unused_param_reduction as upr
    from fsdp_autopatch import _activate, _patching

    info: dict[str, Any] = {"check": repr(_activate.verdict_of(upr.PATCH))}
    _patching.revert(restore.PATCH.name)
    info["apply"] = _patching.apply(upr.PATCH)
    info["restore_check"] = repr(_activate.verdict_of(restore.PATCH))
    info["restore_apply"] = _patching.apply(restore.PATCH)
    method = getattr(FSDPModule, "set_reduce_scatter_unused_params", None)
    info["has_method"] = method is not None
    info["method_is_backport"] = bool(getattr(method, "__fsdp_autopatch__", False))
    return info
