"""restore_unused_param_grads scenarios: a parameter no rank used keeps ``grad is None``.

2-rank gloo jobs, the unused-param fill on (see ``test_dist_restore_unused_param_grads.py``,
``test_dist_restore_hsdp_window.py``, ``test_dist_restore_collectives.py`` and
``test_dist_restore_finalization.py``):

- ``restore_unused``: the experts model, AdamW(weight_decay>0); a warm-up step (the AdamW state its
  case's fresh optimizer lacks), then expert 2 used by no rank;
- ``restore_hsdp_window``: an HSDP mesh (2 replicas x 1 shard), the all-reduce deferred on the
  first micro-batch;
- ``restore_collectives``: how many all-reduces the patch adds per backward, and of what size;
- ``finalization``: every way a backward is finalized (below).

Finalization models (``block`` holds ``l`` and ``spare``):
- ``one_unit``: issue 16's smallest input, one FSDP unit (the root) holding ``l`` and ``spare``;
  its input does not require grad, so its ``post_backward`` runs in the final callback
  (automatic) or in ``finalize_backward`` (manual);
- ``two_units``: ``first`` (root unit) feeds ``block`` (its own unit): ``block``'s
  ``post_backward`` runs inside autograd, the root's at finalization. A restore that ran at the
  final callback of a manual backward would see one probe there and another later.

Step 0: no rank uses ``spare``. Step 1: rank 0 uses ``spare``. Every case records the gradients
(local shards), whether a usage probe is left on any group, and the sizes of the all-reduces the
restore patch issued in each backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import _dist_common as sc
from _registry import scenario


@scenario("restore_unused_param_grads")
def sc_restore_unused(ctx: sc.Ctx) -> None:
    """Fill on, AdamW(weight_decay>0); warm-up step, then expert 2 used by no rank."""
    from torch.distributed.fsdp import fully_shard

    model = sc.build_model("experts", n_experts=3)
    fully_shard(model, mesh=ctx.mesh)
    model.set_reduce_scatter_unused_params(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ctx.data["init_params"] = sc.params_local(model)
    with ctx.case("warmup") as rec:
        sc._run_step(ctx, model, sc.plan_restore_unused, step=0, n_mb=1, accumulate=False)
        rec["grads"] = sc.grads_local(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["steps_after"] = sc.adam_steps(model, opt)
        rec["params_after"] = sc.params_local(model)
    with ctx.case("partial") as rec:
        rec["params_before"] = sc.params_local(model)
        rec["steps_before"] = sc.adam_steps(model, opt)
        rec["exp_avg_before"] = {n: sc._local(opt.state[p]["exp_avg"]) for n, p in model.named_parameters()}
        sc._run_step(ctx, model, sc.plan_restore_unused, step=1, n_mb=1, accumulate=False)
        rec["grads"] = sc.grads_local(model)
        rec["full_grads"] = sc.grads_full(model)
        opt.step()
        rec["params_after"] = sc.params_local(model)
        rec["steps_after"] = sc.adam_steps(model, opt)


@scenario("restore_unused_param_grads:hsdp_window")
def sc_restore_hsdp_window(ctx: sc.Ctx) -> None:
    """HSDP mesh (2 replicas x 1 shard), fill on, all-reduce deferred on the first micro-batch.

    Micro-batch 0: both replicas use expert 0 (its gradient goes into the pending partial reduce).
    Micro-batch 1: no replica uses expert 0 (the fill's zero folds into that partial reduce).
    Expert 0's final gradient holds micro-batch 0's contribution and must survive; expert 2 is
    used in no micro-batch of the window.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ctx.world_size, 1), mesh_dim_names=("replicate", "shard"))
    model = sc.build_model("experts", n_experts=3)
    fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)
    with ctx.case("window") as rec:
        for mb, experts in enumerate(((0, 1), (1,))):
            model.set_requires_all_reduce(mb == 1)
            x = sc._randn(100 + 10 * ctx.rank + mb, sc.ROWS_PER_RANK, sc.DIM)
            model(x, experts=experts).pow(2).mean().backward()
        rec["grads"] = {
            n: (None if p.grad is None else p.grad.full_tensor()) for n, p in model.named_parameters()
        }


def count_restore_all_reduces() -> list[int]:
    """The sizes of the all-reduces restore_unused_param_grads issues (only the patch's own)."""
    calls: list[int] = []
    try:
        from fsdp_autopatch.patches import restore_unused_param_grads as restore
    except ImportError:
        return calls
    real_dist = restore.dist

    class CountingDist:
        def __getattr__(self, name: str) -> Any:
            return getattr(real_dist, name)

        def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(tensor.numel())
            return real_dist.all_reduce(tensor, *args, **kwargs)

    restore.dist = CountingDist()
    return calls


@scenario("restore_unused_param_grads:collectives")
def sc_restore_collectives(ctx: sc.Ctx) -> None:
    """How many all-reduces restore_unused_param_grads adds per backward, and of what size.

    MLP with 3 FSDP units (2 blocks + root holding the head), all on one process group. Cases:
    fill off everywhere; fill on one block only (recurse=False); fill on every unit.
    """
    from torch.distributed.fsdp import fully_shard

    calls = count_restore_all_reduces()
    for name in ("fill_off", "fill_one_unit", "fill_all"):
        model = sc.build_model("mlp")
        for b in model.blocks:
            fully_shard(b, mesh=ctx.mesh)
        fully_shard(model, mesh=ctx.mesh)
        if name == "fill_one_unit":
            model.blocks[0].set_reduce_scatter_unused_params(True, recurse=False)
        elif name == "fill_all":
            model.set_reduce_scatter_unused_params(True)
        with ctx.case(name) as rec:
            del calls[:]
            for step in range(2):
                sc._run_step(ctx, model, sc.plan_mlp, step=step, n_mb=1, accumulate=False)
            rec["all_reduce_numels"] = list(calls)
            rec["grads"] = sc.grads_local(model)


# --- finalization ----------------------------------------------------------------------------------

PROBE = "_fsdp_autopatch_usage_probe"  # FSDPParamGroup attribute of restore_unused_param_grads
STEPS = 2
MICRO_BATCHES = 2  # pipelining and the manual no-sync window


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(sc.DIM, sc.DIM)
        self.spare = nn.Linear(sc.DIM, sc.DIM)

    def forward(self, x: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        y = self.l(x)
        return y + self.spare(x) if use_spare else y


class OneUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        return self.block(x, use_spare)


class TwoUnits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(sc.DIM, sc.DIM)
        self.block = Block()

    def forward(self, x: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        return self.block(torch.tanh(self.first(x)), use_spare)


MODELS = {"one_unit": OneUnit, "two_units": TwoUnits}
SPARE = ("block.spare.weight", "block.spare.bias")


def build(kind: str) -> nn.Module:
    torch.manual_seed(sc.MODEL_SEED)
    return MODELS[kind]()


def plan(rank: int, step: int, mb: int) -> dict[str, Any]:
    """Rows of the global batch; ``spare`` is used by rank 0 in step 1 only."""
    seed = 20_000 + 1000 * step + 100 * mb + rank
    return {
        "x": sc._randn(seed, sc.ROWS_PER_RANK, sc.DIM),
        "target": sc._randn(seed + 50_000, sc.ROWS_PER_RANK, sc.DIM),
        "use_spare": step == 1 and rank == 0,
    }


def loss_of(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    kw = dict(inputs)
    target = kw.pop("target")
    return F.mse_loss(model(**kw), target)


def has_manual_finalization() -> bool:
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "finalize_backward")


def has_synchronize_gradients() -> bool:
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "synchronize_gradients")


def available(path: str) -> bool:
    """Whether this torch offers ``path``'s way of finalizing (manual: 2.15; synchronize: the rewrite)."""
    if path in MANUAL_PATHS:
        return has_manual_finalization()
    return path not in SYNCHRONIZE_PATHS or has_synchronize_gradients()


def shard(ctx: sc.Ctx, kind: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = build(kind)
    if kind == "two_units":
        fully_shard(model.block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    model.set_reduce_scatter_unused_params(True)
    return model


def probes_left(model: nn.Module) -> list[str]:
    """The units that still carry a usage probe after their backward was finalized."""
    from torch.distributed.fsdp import FSDPModule

    left = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
            left += [name or "<root>" for g in groups if g is not None and PROBE in vars(g)]
    return left


# --- one backward, finalized each way ------------------------------------------------------


def backward_automatic(ctx, model, step, rec) -> None:
    loss_of(model, plan(ctx.rank, step, 0)).backward()


def backward_automatic_not_last(ctx, model, step, rec) -> None:
    """Gradient sync on, but not the last backward (2.15 then does not reach _end_backward_iteration)."""
    model.set_is_last_backward(step == STEPS - 1)
    loss_of(model, plan(ctx.rank, step, 0)).backward()


def backward_manual_sync(ctx, model, step, rec) -> None:
    model.set_manual_backward_finalization(True)
    loss_of(model, plan(ctx.rank, step, 0)).backward()
    model.finalize_backward()


def backward_manual_async(ctx, model, step, rec) -> None:
    model.set_manual_backward_finalization(True)
    loss_of(model, plan(ctx.rank, step, 0)).backward()
    handle = model.finalize_backward(async_op=True)
    # the restore belongs after the reductions were waited for, i.e. inside wait()
    rec[f"probe_before_wait_{step}"] = probes_left(model)
    handle.wait()


def backward_manual_no_sync_window(ctx, model, step, rec) -> None:
    """torch's documented pattern: sync off for each backward, back on for the finalization."""
    model.set_manual_backward_finalization(True)
    for mb in range(MICRO_BATCHES):
        model.set_requires_gradient_sync(False)
        loss_of(model, plan(ctx.rank, step, mb)).backward()
    model.set_requires_gradient_sync(True)
    model.finalize_backward()


def backward_no_sync_then_synchronize(ctx, model, step, rec) -> None:
    """The pending-gradient rewrite's pattern: sync off for each backward, then
    ``synchronize_gradients()`` reduces outside any backward (no final callback after it)."""
    model.set_requires_gradient_sync(False)
    for mb in range(MICRO_BATCHES):
        loss_of(model, plan(ctx.rank, step, mb)).backward()
    model.synchronize_gradients()
    model.set_requires_gradient_sync(True)


PATHS = {
    "automatic": backward_automatic,
    "automatic_not_last": backward_automatic_not_last,
    "manual_sync": backward_manual_sync,
    "manual_async": backward_manual_async,
    "manual_no_sync_window": backward_manual_no_sync_window,
    "synchronize": backward_no_sync_then_synchronize,
}
MANUAL_PATHS = ("manual_sync", "manual_async", "manual_no_sync_window")
SYNCHRONIZE_PATHS = ("synchronize",)


def micro_batches_of(path: str) -> int:
    return MICRO_BATCHES if path in ("manual_no_sync_window", "synchronize", "pipelining") else 1


@scenario("restore_unused_param_grads:finalization")
def sc_finalization(ctx: sc.Ctx) -> None:
    """Each path x model: two steps, gradients and probes after each finalized backward."""
    calls = count_restore_all_reduces()
    ctx.data["has_manual_finalization"] = has_manual_finalization()
    ctx.data["has_synchronize_gradients"] = has_synchronize_gradients()
    paths = [p for p in PATHS if available(p)]
    for path in paths:
        for kind in MODELS:
            model = shard(ctx, kind)
            with ctx.case(f"{path}/{kind}") as rec:
                rec["init_params"] = sc.params_local(model)
                for step in range(STEPS):
                    model.zero_grad(set_to_none=True)
                    del calls[:]
                    PATHS[path](ctx, model, step, rec)
                    rec[f"all_reduce_numels_{step}"] = list(calls)
                    rec[f"probes_left_{step}"] = probes_left(model)
                    rec[f"grads_{step}"] = sc.grads_local(model)
    if has_manual_finalization():
        with ctx.case("manual_reset/two_units") as rec:
            _reset_before_finalizing(ctx, rec)
    ctx.data["pipelining_runs"] = pipelining_runs()
    if ctx.data["pipelining_runs"]:
        with ctx.case("pipelining/one_unit") as rec:
            _pipelining(ctx, rec, calls)


def pipelining_runs() -> bool:
    """False where torch's pipelining calls an FSDP2 finalization method this FSDP2 lacks: FSDP2 files
    of another torch overlaid (scripts/next_torch.py), e.g. the pending-gradient rewrite on 2.15."""
    import inspect

    from torch.distributed.pipelining import stage

    return has_manual_finalization() or "set_manual_backward_finalization" not in inspect.getsource(stage)


def _reset_before_finalizing(ctx: sc.Ctx, rec: dict[str, Any]) -> None:
    """A backward abandoned before finalization: ``reset_iter_state()`` must drop its probe too."""
    model = shard(ctx, "two_units")
    model.set_manual_backward_finalization(True)
    loss_of(model, plan(ctx.rank, 0, 0)).backward()  # block reduced inside autograd: probed
    rec["probes_before_reset"] = probes_left(model)
    model.reset_iter_state()
    rec["probes_after_reset"] = probes_left(model)


def _pipelining(ctx: sc.Ctx, rec: dict[str, Any], calls: list[int]) -> None:
    """torch.distributed.pipelining with one stage per rank, FSDP over both ranks.

    2.8 - 2.14: ``perform_reduce_grad`` calls ``post_backward`` and the final callback by hand;
    2.15: the stage uses manual finalization (``finalize_backward(async_op=True)`` + ``wait``).
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pp_groups = [dist.new_group([r]) for r in range(ctx.world_size)]  # every rank makes each group
    model = shard(ctx, "one_unit")
    rec["init_params"] = sc.params_local(model)

    for step in range(STEPS):
        inputs = [plan(ctx.rank, step, mb) for mb in range(MICRO_BATCHES)]
        use_spare = inputs[0]["use_spare"]
        model.zero_grad(set_to_none=True)
        original_forward = model.forward  # the schedule passes tensors only: bind use_spare
        model.forward = lambda x, _f=original_forward, _u=use_spare: _f(x, _u)  # type: ignore[method-assign]
        stage = PipelineStage(model, 0, 1, torch.device("cpu"), group=pp_groups[ctx.rank])
        schedule = ScheduleGPipe(stage, n_microbatches=MICRO_BATCHES, loss_fn=F.mse_loss, scale_grads=False)
        del calls[:]
        schedule.step(
            torch.cat([i["x"] for i in inputs]),
            target=torch.cat([i["target"] for i in inputs]),
        )
        model.forward = original_forward  # type: ignore[method-assign]
        rec[f"all_reduce_numels_{step}"] = list(calls)
        rec[f"probes_left_{step}"] = probes_left(model)
        rec[f"grads_{step}"] = sc.grads_local(model)

