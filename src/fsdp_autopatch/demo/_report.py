"""What the demo prints: the model, the patch registry, the invariants, each bug's verdict."""

from __future__ import annotations

import time
from typing import Any

from .._columns import table
from ..cases._four_bugs import (
    GRAD_TOLERANCE,
    IMAGE_MICRO_BATCH,
    MICRO_BATCHES,
    RANK0_EXPERT,
    SHARED_EXPERT,
    STEPS,
    UNUSED_EXPERT,
    WEIGHT_DECAY,
    WORLD_SIZE,
)
from ._judges import JUDGES
from ._scenarios import BUG_SCENARIOS, PATCHED, RUN_TIMEOUT_S
from ._subrun import RunResult, describe_failure, run_scenario


def _print_registry(rank0: dict[str, Any]) -> None:
    registry = rank0.get("registry") or {}
    if "error" in registry or not registry:
        print(f"Patch registry: unavailable ({registry.get('error', 'no report from rank 0')})")
        return
    print(f"Patch registry (rank 0): fsdp_autopatch {registry.get('version')}, "
          f"torch {registry.get('torch')}, bootstrap={registry.get('bootstrap')}")
    # columns sized from the names, the reason cut to what is left of 100 columns (as `status` does)
    rows = [(p["name"], p["status"], p.get("reason") or "") for p in registry.get("patches", [])]
    for line in table(rows, indent="  "):
        print(line)
    if rank0.get("install_note"):
        print(f"  note: {rank0['install_note']}")


def _registry_line(rank0: dict[str, Any]) -> str:
    registry = rank0.get("registry") or {}
    patches = registry.get("patches")
    if not patches:
        return "registry unavailable"
    return ", ".join(f"{p['name']}={p['status']}" for p in patches)



def _print_unexpected(result: RunResult) -> None:
    for rank, report in enumerate(result.ranks):
        if report and report.get("error"):
            print(f"  rank {rank} traceback (tail):")
            for line in report["error"]["traceback"].strip().splitlines()[-8:]:
                print(f"    {line}")
        elif result.output_tails[rank]:
            print(f"  rank {rank} output (tail):")
            for line in result.output_tails[rank].splitlines():
                print(f"    {line}")


def _mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _print_invariants(checks: dict[str, Any]) -> bool:
    grads, unused, loss = checks["gradients"], checks["unused_expert"], checks["loss"]
    worst = grads["worst"]
    print(f"  {_mark(grads['ok'])}  (1) gradients of all used parameters match a single-process "
          f"bf16 reference: {grads['compared']} tensors over {STEPS} steps, worst relative error "
          f"{worst['error']:.1e} ({worst['name']}, step {worst['step']}; tolerance {GRAD_TOLERANCE:g})")
    for problem in grads["problems"]:
        print(f"        {problem}")
    print(f"  {_mark(unused['ok'])}  (2) never-used expert {UNUSED_EXPERT}: grad after each backward "
          f"{unused['grad_states']}, weights bitwise unchanged={unused['bitwise_unchanged']} "
          f"(max |change| {unused['max_change']:.1e})")
    losses = " -> ".join(f"{value:.4f}" for value in loss["losses"])
    print(f"  {_mark(loss['ok'])}  (3) loss decreases: {losses}")
    return grads["ok"] and unused["ok"] and loss["ok"]


def _print_model() -> None:
    print(f"Model: tiny vision-language MoE on {WORLD_SIZE} CPU ranks (gloo), "
          f"bf16 params / fp32 reduce, AdamW(weight_decay={WEIGHT_DECAY}), {STEPS} steps x "
          f"{MICRO_BATCHES} micro-batches (sync on the last only; images in micro-batch "
          f"{IMAGE_MICRO_BATCH + 1} only).")
    print("  vision tower: own FSDP unit, skipped by text-only micro-batches      -> bug (a)")
    print(f"  MoE experts: expert {SHARED_EXPERT} on both ranks, expert {RANK0_EXPERT} on rank 0 only, "
          f"expert {UNUSED_EXPERT} on no rank -> bugs (b), (c), (d)")


def demo_patched(timeout_s: float = RUN_TIMEOUT_S) -> int:
    print("fsdp-autopatch demo (patches on)")
    _print_model()
    result = run_scenario(PATCHED, timeout_s)
    rank0 = result.rank0
    _print_registry(rank0)
    print(f"Unused-param fill (set_reduce_scatter_unused_params): {rank0.get('fill', '?')}")
    checks = rank0.get("checks")
    if not checks:
        print(f"FAIL: the run did not complete: {describe_failure(result)}")
        _print_unexpected(result)
        print(f"Demo took {result.seconds:.1f} s.")
        return 1
    for step, value in enumerate(checks["loss"]["losses"], start=1):
        print(f"  step {step}  loss {value:.4f}")
    print("Invariants:")
    ok = _print_invariants(checks)
    timings = ", ".join(f"{phase} {sec:.1f} s" for phase, sec in rank0.get("seconds", {}).items())
    print(f"Result: {_mark(ok)} ({result.seconds:.1f} s; rank 0: {timings})")
    return 0 if ok else 1


def demo_without_patches(timeout_s: float = RUN_TIMEOUT_S) -> int:
    print("fsdp-autopatch demo --without-patches: one two-rank sub-run per bug, "
          "with that bug's patch disabled")
    _print_model()
    start = time.monotonic()
    verdicts = []
    for scenario in BUG_SCENARIOS:
        result = run_scenario(scenario, timeout_s)
        verdict = JUDGES[scenario.key](result)
        verdicts.append(verdict.reproduced)
        print(f"\n({scenario.key}) {scenario.symptom}")
        print(f"    sub-run: {scenario.title} [{result.seconds:.1f} s]")
        print(f"    patches: {_registry_line(result.rank0)}")
        print(f"    what happened: {verdict.detail}")
        if not verdict.reproduced:
            _print_unexpected(result)
        label = "REPRODUCED" if verdict.reproduced else "NOT REPRODUCED"
        print(f"==> ({scenario.key}) {label}: {verdict.headline}. Known upstream bug: "
              f"{scenario.upstream}. Fixed by patch '{scenario.patch}'{scenario.fix_note}.")
    total = time.monotonic() - start
    print(f"\n{sum(verdicts)}/{len(verdicts)} bugs reproduced without their patch ({total:.1f} s). "
          "The same command without --without-patches (fsdp-autopatch demo; scripts/demo.sh in a checkout) "
          "shows the same training succeed with the patches.")
    return 0 if all(verdicts) else 1
