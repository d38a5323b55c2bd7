"""What each two-rank sub-run of the demo disables, and how long a sub-run may take."""

from __future__ import annotations

from dataclasses import dataclass, field

PG_TIMEOUT_S = 20.0  # gloo collectives give up after this
RUN_TIMEOUT_S = 50.0  # the parent kills a sub-run's ranks after this
FAIL_GRACE_S = 5.0  # after one rank failed, how long its peer may take to fail too


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    env: dict[str, str] = field(default_factory=dict)
    fill: bool = True  # call model.set_reduce_scatter_unused_params(True)
    patch: str = ""  # the patch that fixes this scenario's bug
    upstream: str = ""
    symptom: str = ""  # what the user sees without the patch
    fix_note: str = ""


PATCHED = Scenario("patched", "all patches on")

BUG_SCENARIOS = (
    Scenario(
        "a",
        "no patches at all (FSDP_AUTOPATCH_ENABLED=0)",
        env={"FSDP_AUTOPATCH_ENABLED": "0"},
        patch="accumulated_grad_guard",
        upstream="PyTorch PR 194058 (also verl PR 7475, NeMo Automodel PR 2744)",
        symptom="a vision tower skipped by text-only micro-batches crashes backward",
    ),
    Scenario(
        "b",
        "unused-param fill off (FSDP_AUTOPATCH_UNUSED_PARAM_REDUCTION_ENABLED=0, "
        "set_reduce_scatter_unused_params not called)",
        env={"FSDP_AUTOPATCH_UNUSED_PARAM_REDUCTION_ENABLED": "0"},
        fill=False,
        patch="unused_param_reduction",
        upstream="PyTorch issue 158719 / PR 174862 (also torchtitan 2747)",
        symptom="ranks whose experts got different tokens issue mismatched reduce-scatters",
        fix_note=" (from torch 2.13 torch's own set_reduce_scatter_unused_params, which the "
                 "demo turns on; the patch backports it to older torch)",
    ),
    Scenario(
        "c",
        "uniform_reduce_dtype off (FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED=0)",
        env={"FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED": "0"},
        patch="uniform_reduce_dtype",
        upstream="PyTorch issue 196996 / PR 160279 (also NeMo Automodel PR 3540)",
        symptom="bf16 zero fill next to fp32 accumulated gradients trips an assertion",
    ),
    Scenario(
        "d",
        "restore_unused_param_grads off (FSDP_AUTOPATCH_RESTORE_UNUSED_PARAM_GRADS_ENABLED=0)",
        env={"FSDP_AUTOPATCH_RESTORE_UNUSED_PARAM_GRADS_ENABLED": "0"},
        patch="restore_unused_param_grads",
        upstream="same class as PyTorch issue 28294 (DDP); documented by Megatron-LM",
        symptom="an expert no rank used gets a zero gradient and AdamW moves it",
    ),
)

SCENARIOS = {s.key: s for s in (PATCHED, *BUG_SCENARIOS)}
