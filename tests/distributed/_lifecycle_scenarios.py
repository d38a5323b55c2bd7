"""Lifecycle scenario (issue 29, item 3): a whole run as users run it, checkpoint and resume included.

``lifecycle`` (2 gloo ranks), one launch per phase (``args["phase"]``):

* ``save``: per case (``args["cases"]``, names of :data:`CASES`), the uninterrupted run: a fresh
  :class:`LifecycleModel` (an FSDP2 unit per block, the root over the rest), AdamW with weight
  decay, before the first step an evaluation under ``no_grad`` and one under ``inference_mode``
  (in this order; the other for the ``/im`` cases: their first forward is under ``inference_mode``),
  :data:`STEPS` steps of 2 micro-batches (gradient sync only on the last), gradient clipping,
  after each step an evaluation under ``inference_mode`` and one under ``no_grad``, and
  after step :data:`K` ``dcp.save({"model", "optim"})`` of ``get_state_dict`` (a checkpointing
  loop that goes on). For each case of ``args["step0"]`` a second fresh model and optimizer are
  saved before any step (the step-0 checkpoint). Recorded: every evaluation's loss, the local
  shards of the parameters and of the optimizer state at the end, and the round trip
  ``get_model_state_dict`` / ``set_model_state_dict`` (``full_state_dict=True, cpu_offload=True``;
  the set broadcasts rank 0's dict) into a fresh, differently initialised model.
* ``resume`` (fresh processes): per ``[tag, case, step]`` of ``args["runs"]``, a new model
  (another seed) and optimizer, ``get_state_dict`` as the load template, ``dcp.load`` of the
  checkpoint the save phase ``tag`` wrote after ``step``, ``set_state_dict``, the evaluations before
  the first step, then the remaining steps: the same records.

Parameters: ``spare`` is used by no rank; with the unused-param fill (``fill``) ``solo`` is used
by rank 0 only (without it by no rank: torch needs the fill for a parameter one rank uses).
Meshes: ``fsdp`` (1-D over both ranks), ``hsdp`` (2-D (2, 1): replicate over both ranks, shards
of one), ``offload`` (1-D, ``CPUOffloadPolicy(pin_memory=False)``: pinning needs an accelerator).
Checkpoints go to ``args["dir"]/<tag>/<case>/step<k>`` (pytest's tmp_path). Every case runs in
``ctx.case(..., continue_on_error=True)``: what torch raises (the missing key, the inference
tensor) is recorded, and the next case runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

import _dist_common as sc
from _registry import scenario

STEPS = 3  # the uninterrupted run's optimizer steps
K = 1  # the checkpoint is written after this step (and one before the first: step 0)
N_MB = 2
LR, WEIGHT_DECAY, MAX_NORM = 1e-2, 0.1, 1.0
RESUME_SEED = 4321  # the resumed model starts elsewhere: the load must bring every value
EVAL_MODES = ("inference_mode", "no_grad")
# name -> (mesh, unused-param fill, mode of the first evaluation before the first step: the first forward)
CASES = {
    "fsdp/fill": ("fsdp", True, "no_grad"),
    "fsdp/nofill": ("fsdp", False, "no_grad"),
    "hsdp/fill": ("hsdp", True, "no_grad"),
    "offload/fill": ("offload", True, "no_grad"),
    "offload/nofill": ("offload", False, "no_grad"),
    "fsdp/fill/im": ("fsdp", True, "inference_mode"),
}


class LifecycleModel(nn.Module):
    """Two blocks (a unit each), then ``solo`` (used by rank 0 only), ``spare`` (never) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(sc.Block() for _ in range(2))
        self.solo = nn.Linear(sc.DIM, sc.DIM)
        self.spare = nn.Linear(sc.DIM, sc.DIM)
        self.head = nn.Linear(sc.DIM, sc.OUT)

    def forward(self, x: torch.Tensor, solo: bool = False) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        if solo:
            x = x + torch.tanh(self.solo(x))
        return self.head(x)


def plan(fill: bool, rank: int, step: int, mb: int) -> dict[str, Any]:
    return sc.batch(rank, step, mb, solo=fill and rank == 0)


def _mesh(ctx: sc.Ctx, kind: str) -> Any:
    if kind != "hsdp":
        return ctx.mesh
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ctx.world_size, 1), mesh_dim_names=("replicate", "shard"))


def build(ctx: sc.Ctx, case: str, seed: int = sc.MODEL_SEED) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    kind, fill, _ = CASES[case]
    torch.manual_seed(seed)
    model = LifecycleModel()
    offload = CPUOffloadPolicy(pin_memory=False) if kind == "offload" else OffloadPolicy()
    mesh = _mesh(ctx, kind)
    for unit in (*model.blocks, model):
        fully_shard(unit, mesh=mesh, offload_policy=offload)
    if fill:
        model.set_reduce_scatter_unused_params(True)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def evaluate(ctx: sc.Ctx, model: nn.Module, mode: str, after_step: int) -> float:
    """The global mean loss of an evaluation batch (the same on every rank)."""
    import torch.distributed as dist

    manager = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with manager:
        loss = sc.loss_fn(model, sc.batch(ctx.rank, 100 + after_step, 0))
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / ctx.world_size


def train(ctx: sc.Ctx, case: str, model: nn.Module, opt: torch.optim.Optimizer, first: int, rec: dict,
          save: str | None = None) -> None:
    """Steps ``first`` .. STEPS-1 (evaluations under both modes before and after each step); the records."""
    _, fill, first_mode = CASES[case]
    rec["evals"] = {}
    for mode in (first_mode, *(m for m in EVAL_MODES if m != first_mode)):  # the first forward's mode first
        rec["evals"][f"{first}/{mode}"] = evaluate(ctx, model, mode, first)
    for step in range(first, STEPS):
        sc._run_step(ctx, model, functools.partial(plan, fill), step, N_MB)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        for mode in EVAL_MODES:
            rec["evals"][f"{step + 1}/{mode}"] = evaluate(ctx, model, mode, step + 1)
        if step + 1 == K and save is not None:
            checkpoint(model, opt, f"{save}/step{K}")
    # the root stays unsharded after an evaluation (a forward without backward): its module
    # attributes are then the unsharded tensors, not the optimizer's sharded parameters
    model.reshard()
    rec["params"] = sc.params_local(model)
    rec["optim"] = optim_local(model, opt)
    rec["steps"] = sc.adam_steps(model, opt)


def optim_local(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's optimizer state by name, as this rank's local shards."""
    return {n: {key: sc._local(value) for key, value in opt.state[p].items()}
            for n, p in model.named_parameters() if p in opt.state}


def checkpoint(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def round_trip(ctx: sc.Ctx, case: str, model: nn.Module, rec: dict) -> None:
    """``get_model_state_dict`` (full, to CPU: rank 0 holds it) into a fresh model, broadcast from rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rec["full_keys"] = sorted(full)
    # rank 0's (empty elsewhere); copied first: set_model_state_dict puts its own values in the dict
    rec["round_trip_full"] = {n: v.detach().clone() for n, v in full.items()}
    fresh, _ = build(ctx, case, seed=RESUME_SEED)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True)
    set_model_state_dict(fresh, full, options=options)
    rec["round_trip"] = sc.params_local(fresh)


def save_phase(ctx: sc.Ctx) -> None:
    root = f"{ctx.args['dir']}/{ctx.args['tag']}"
    for case in ctx.args["cases"]:
        with ctx.case(case, continue_on_error=True) as rec:
            model, opt = build(ctx, case)
            train(ctx, case, model, opt, 0, rec, save=f"{root}/{case}")
            round_trip(ctx, case, model, rec)
    for case in ctx.args["step0"]:
        with ctx.case(f"{case}/step0", continue_on_error=True):
            model, opt = build(ctx, case)
            checkpoint(model, opt, f"{root}/{case}/step0")


def resume_phase(ctx: sc.Ctx) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for tag, case, step in ctx.args["runs"]:
        with ctx.case(f"{tag}/{case}/step{step}", continue_on_error=True) as rec:
            model, opt = build(ctx, case, seed=RESUME_SEED)
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            try:
                dcp.load(state, checkpoint_id=f"{ctx.args['dir']}/{tag}/{case}/step{step}")
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as error:  # DCP's CheckpointException is a BaseException: ctx.case misses it
                rec["error"] = sc._error_record(error)
                continue
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            rec["loaded_steps"] = sc.adam_steps(model, opt)
            train(ctx, case, model, opt, step, rec)


@scenario("lifecycle")
def sc_lifecycle(ctx: sc.Ctx) -> None:
    (save_phase if ctx.args["phase"] == "save" else resume_phase)(ctx)
