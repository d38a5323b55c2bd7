"""The rank side of the demo: one rank of a sub-run, started by the parent as
``python -m fsdp_autopatch.demo --worker --scenario <key> --rank <r> --out <dir> --deadline <s>``.

The rank trains, rank 0 checks the invariants, and every rank writes ``<dir>/rank<r>.json`` (its
result or its error) and keeps ``<dir>/rank<r>.where`` up to date, so that the parent can say
where a rank was when it had to kill it. torch is imported inside functions only, after the
patches are installed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, NoReturn

from .. import _rank_side as rank_side
from ..cases._common import full_grad_tensors, full_param_tensors
from ._checks import check_gradients, check_loss, check_unused_expert
from ._model import (
    LR,
    MICRO_BATCHES,
    STEPS,
    WEIGHT_DECAY,
    WORLD_SIZE,
    build_model,
    loss_fn,
    make_micro_batch,
)
from ._scenarios import PG_TIMEOUT_S, SCENARIOS, Scenario


class Progress:
    """Where the rank is, e.g. 'step 1, micro-batch 1/3 (text-only) backward'.

    Kept in memory for exception reports and mirrored to a file, so that the parent can still say
    where a rank was stuck when it has to kill it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.at("startup")

    def at(self, where: str) -> None:
        self.where = where
        self.path.write_text(where)


def _ensure_installed() -> str:
    """Install the patches if this interpreter did not run the .pth (e.g. PYTHONPATH checkout)."""
    try:
        import fsdp_autopatch

        if fsdp_autopatch.status().bootstrap == "not_run":
            fsdp_autopatch.install()
            return "the .pth did not run in the ranks; the demo called fsdp_autopatch.install()"
    except Exception as exc:
        return f"fsdp_autopatch unavailable in the ranks: {type(exc).__name__}: {exc}"
    return ""


def _shard(model, mesh):
    """Vision tower and MoE get their own FSDP units (as in real VLM/MoE recipes), then the root."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model.vision, mesh=mesh, mp_policy=policy)
    fully_shard(model.moe, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _enable_fill(model, scenario: Scenario) -> str:
    if not scenario.fill:
        return "off (not called)"
    if not hasattr(model, "set_reduce_scatter_unused_params"):
        # torch < 2.13 with the backport disabled: nothing can turn the fill on.
        return "unavailable (torch < 2.13 and the backport is off)"
    model.set_reduce_scatter_unused_params(True)
    return "on"


def _gather_grads(model) -> dict[str, Any]:
    """Full gradients of the parameters that have one (collective: every rank calls it); a ``None``
    gradient is left out, once the ranks agree on which are ``None`` (else: RuntimeError)."""
    import torch
    import torch.distributed as dist

    # Gathering would deadlock if the ranks disagree on which gradients exist: compare first
    # (with tensors; all_gather_object would need numpy).
    has_grad = torch.tensor([p.grad is not None for p in model.parameters()], dtype=torch.int32)
    anywhere, everywhere = has_grad.clone(), has_grad.clone()
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    if not torch.equal(anywhere, everywhere):
        names = [n for (n, _), a, e in zip(model.named_parameters(), anywhere, everywhere) if a != e]
        raise RuntimeError(f"ranks disagree on which parameters have a gradient: {names}")
    return full_grad_tensors(model)


def _train(model, rank: int, progress: Progress) -> dict[str, Any]:
    """The training loop; returns what the checks need (losses, per-step weights and gradients)."""
    import torch
    import torch.distributed as dist

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, params_per_step, grads_per_step = [], [], []
    for step in range(1, STEPS + 1):
        params_per_step.append(full_param_tensors(model))
        step_loss = torch.zeros(())
        for micro in range(MICRO_BATCHES):
            last = micro == MICRO_BATCHES - 1
            # Accumulate without communication; reduce-scatter only after the last micro-batch.
            model.set_requires_gradient_sync(last)
            tokens, pixels, targets = make_micro_batch(rank, micro)
            kind = "text+images" if pixels is not None else "text-only"
            progress.at(f"step {step}, micro-batch {micro + 1}/{MICRO_BATCHES} ({kind}) forward")
            loss = loss_fn(model(tokens, pixels), targets)
            progress.at(f"step {step}, micro-batch {micro + 1}/{MICRO_BATCHES} ({kind}) backward")
            (loss / MICRO_BATCHES).backward()
            step_loss += loss.detach()
        progress.at(f"step {step}, gathering gradients")
        grads_per_step.append(_gather_grads(model))
        progress.at(f"step {step}, optimizer step")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / (WORLD_SIZE * MICRO_BATCHES))
    progress.at("gathering final weights")
    final_params = full_param_tensors(model)
    return {"losses": losses, "params": params_per_step, "grads": grads_per_step, "final": final_params}


def _run_rank(scenario: Scenario, rank: int, progress: Progress, result: dict[str, Any]) -> None:
    clock = time.monotonic()
    timings = result["seconds"] = {}

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.monotonic()
        timings[phase] = round(now - clock, 2)
        clock = now

    result["install_note"] = _ensure_installed()  # before torch, like the .pth would
    import torch
    import torch.distributed.fsdp  # noqa: F401  -- the patches are applied on this import
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # two ranks share two cores
    rank_side.ignore_view_output_warning()  # no output is modified in place here
    if rank == 0:
        result["registry"] = rank_side.registry_snapshot()
        result["torch"] = torch.__version__
    lap("import")
    progress.at("init_process_group")
    rank_side.init_process_group(PG_TIMEOUT_S)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    progress.at("fully_shard")
    model = _shard(build_model(), mesh)
    result["fill"] = _enable_fill(model, scenario)
    lap("setup")
    run = _train(model, rank, progress)
    rank_side.end_process_group()
    lap("train")
    if rank == 0:
        progress.at("checking invariants")
        result["checks"] = {
            "gradients": check_gradients(run),
            "unused_expert": check_unused_expert(run),
            "loss": check_loss(run["losses"]),
        }
        lap("check")


def worker_main(scenario_key: str, rank: int, out_dir: str, deadline_s: float) -> NoReturn:
    """Run one rank of ``scenario_key`` and write its report; exits the process (never returns)."""
    scenario = SCENARIOS[scenario_key]
    run_rank_process(lambda result, progress: _run_rank(scenario, rank, progress, result), rank, out_dir, deadline_s)


def run_rank_process(body: Callable[[dict[str, Any], Progress], None], rank: int, out_dir: str,
                     deadline_s: float) -> NoReturn:
    """One demo rank: a watchdog, ``body(result, progress)``, then ``<out_dir>/rank<r>.json`` (its
    result or its error, with where the rank was and when) and the exit."""
    rank_side.start_watchdog(deadline_s, name="demo-watchdog")
    progress = Progress(Path(out_dir) / f"rank{rank}.where")
    result: dict[str, Any] = {"rank": rank, "error": None}
    path = Path(out_dir) / f"rank{rank}.json"
    rank_side.run_then_exit(lambda: body(result, progress), result,
                            lambda code: rank_side.write_json(path, result),
                            lambda exc: rank_side.error_record(exc, where=progress.where, time=time.time()))
