"""Rank 0's three invariants, computed from the weights and gradients gathered during training."""

from __future__ import annotations

from typing import Any

from ..cases._common import relative_diff
from ._model import (
    GRAD_TOLERANCE,
    MICRO_BATCHES,
    STEPS,
    UNUSED_EXPERT_PREFIX,
    WORLD_SIZE,
    build_model,
    loss_fn,
    make_micro_batch,
)


def _reference_grads(params: dict[str, Any]) -> dict[str, Any]:
    """Single-process gradients for one step, mirroring FSDP's arithmetic.

    FSDP computes each micro-batch's gradient in bf16 (param_dtype), accumulates micro-batches in
    fp32 (reduce_dtype) and averages over ranks; here the same model runs in bf16 on every rank's
    micro-batches of the global batch, accumulating in fp32 and dividing by the world size.
    """
    import torch

    model = build_model()
    model.load_state_dict(params)
    model.to(torch.bfloat16)
    acc: dict[str, Any] = {}
    for rank in range(WORLD_SIZE):
        for micro in range(MICRO_BATCHES):
            model.zero_grad(set_to_none=True)
            tokens, pixels, targets = make_micro_batch(rank, micro)
            if pixels is not None:
                pixels = pixels.to(torch.bfloat16)  # FSDP casts floating forward inputs too
            (loss_fn(model(tokens, pixels), targets) / MICRO_BATCHES).backward()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    acc[name] = acc.get(name, 0) + p.grad.float()
    return {name: grad / WORLD_SIZE for name, grad in acc.items()}


def check_gradients(run: dict[str, Any]) -> dict[str, Any]:
    """Invariant (1): every gradient the reference has matches FSDP's, within bf16 tolerance; one
    the reference has and FSDP's run has not (``None`` there) is a problem, named."""
    worst = {"error": 0.0, "name": "", "step": 0}
    compared, problems = 0, []
    for step, (params, grads) in enumerate(zip(run["params"], run["grads"]), start=1):
        for name, ref in _reference_grads(params).items():
            got = grads.get(name)
            if got is None:
                problems.append(f"step {step}: {name} has no gradient (reference has one)")
                continue
            error = relative_diff(got, ref)
            compared += 1
            if not worst["name"] or error > worst["error"]:
                worst = {"error": error, "name": name, "step": step}
            if error > GRAD_TOLERANCE:
                problems.append(f"step {step}: {name} off by {error:.2e} (relative)")
    return {"ok": not problems and compared > 0, "compared": compared, "worst": worst,
            "problems": problems[:5]}


def check_unused_expert(run: dict[str, Any]) -> dict[str, Any]:
    """Invariant (2): the expert no rank used has grad None every step and unchanged weights."""
    grad_states = []  # per step: "None" (all expert tensors), "zero" or "nonzero"
    for grads in run["grads"]:
        expert_grads = [g for name, g in grads.items() if name.startswith(UNUSED_EXPERT_PREFIX)]
        if not expert_grads:
            grad_states.append("None")
        else:
            grad_states.append("nonzero" if any(g.any() for g in expert_grads) else "zero")
    initial, final = run["params"][0], run["final"]
    names = [n for n in initial if n.startswith(UNUSED_EXPERT_PREFIX)]
    max_change = max((final[n] - initial[n]).abs().max().item() for n in names)
    bitwise = all(initial[n].equal(final[n]) for n in names)
    return {"ok": bitwise and all(s == "None" for s in grad_states),
            "grad_states": grad_states, "bitwise_unchanged": bitwise, "max_change": max_change}


def check_loss(losses: list[float]) -> dict[str, Any]:
    """Invariant (3): training on a fixed batch must lower the loss."""
    return {"ok": len(losses) == STEPS and losses[-1] < losses[0], "losses": losses}
