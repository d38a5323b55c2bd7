"""Scenarios of the cross-rank check (``fsdp_autopatch.patches.cross_rank_check``): once per process group.

``cross_rank``: two models on the same process group, two steps each. ``cross_rank_after_revert``:
the plugin reverted and activated again with another patch off, on every rank, between two models.
``count_cross_rank_checks`` is also used by the HSDP scenarios. See ``test_dist_cross_rank_check.py``.
"""

from __future__ import annotations

from typing import Any

from _dist_common import Ctx, _run_step, build_model, grads_local, params_local, plan_mlp
from _registry import scenario


def count_cross_rank_checks() -> list[int]:
    """``[n]``: how many process groups this rank's cross-rank check compared so far."""
    calls = [0]
    try:
        import fsdp_autopatch.patches.cross_rank_check as consistency
    except ImportError:
        return calls
    announce = consistency._announce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return announce(*args, **kwargs)

    consistency._announce = counted
    return calls


@scenario("cross_rank_check")
def sc_cross_rank(ctx: Ctx) -> None:
    """Two models on the same process group, two steps each: the check runs once per group.

    ``checks`` counts the process groups this rank compared (``count_cross_rank_checks``).
    """
    from torch.distributed.fsdp import fully_shard

    calls = count_cross_rank_checks()
    for name in ("first_model", "second_model"):
        with ctx.case(name) as rec:
            model = build_model("mlp")
            for b in model.blocks:
                fully_shard(b, mesh=ctx.mesh)
            fully_shard(model, mesh=ctx.mesh)
            rec["init_params"] = params_local(model)
            for step in range(2):
                _run_step(ctx, model, plan_mlp, step=step, n_mb=1, accumulate=False)
            rec["checks"] = calls[0]
            rec["grads"] = grads_local(model)


@scenario("cross_rank_check:after_revert")
def sc_cross_rank_after_revert(ctx: Ctx) -> None:
    """First model: the check compares (round 0). Then, on every rank alike, ``revert_all()``,
    ``keep_param_attributes`` off, ``activate()``: the second model's check must compare the new
    fingerprints with each other, not with the store's keys of the first round (before the fix:
    the first rank to arrive read the old round's "complete" and raised "ranks disagree")."""
    import os

    from torch.distributed.fsdp import fully_shard

    import fsdp_autopatch
    from fsdp_autopatch import _activate

    calls = count_cross_rank_checks()

    def train(rec: dict[str, Any]) -> None:
        model = build_model("mlp")
        for b in model.blocks:
            fully_shard(b, mesh=ctx.mesh)
        fully_shard(model, mesh=ctx.mesh)
        _run_step(ctx, model, plan_mlp, step=0, n_mb=1, accumulate=False)
        rec["checks"] = calls[0]
        rec["grads"] = grads_local(model)

    with ctx.case("first_model") as rec:
        train(rec)
    os.environ["FSDP_AUTOPATCH_DISABLED"] = "keep_param_attributes"
    try:
        _activate.revert_all()
        _activate.activate()
        with ctx.case("second_model", continue_on_error=True) as rec:
            rec["keep_param_attributes"] = fsdp_autopatch.status()["keep_param_attributes"].status.value
            train(rec)
    finally:
        os.environ.pop("FSDP_AUTOPATCH_DISABLED", None)
