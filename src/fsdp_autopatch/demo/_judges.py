"""``--without-patches``: whether each sub-run reproduced its bug, judged from what the ranks reported.

One judge per bug scenario (:data:`JUDGES`, keyed like ``_scenarios.BUG_SCENARIOS``); each returns
a :class:`Judgement` with a headline and the evidence, or says what it expected and what happened.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cases._four_bugs import RANK0_EXPERT, SHARED_EXPERT, STEPS, UNUSED_EXPERT, WEIGHT_DECAY
from ._subrun import Failure, RunResult, describe_failure


@dataclass(frozen=True)
class Judgement:
    reproduced: bool
    headline: str  # what happened, in a few words
    detail: str  # why, and what each rank reported


def _first_failure(result: RunResult) -> Failure | None:
    failures = result.failures()
    return failures[0] if failures else None


def _not_reproduced(expected: str, result: RunResult) -> Judgement:
    return Judgement(False, f"expected {expected}", "got: " + _outcome(result))


def _judge_a(result: RunResult) -> Judgement:
    first = _first_failure(result)
    if first and first.error_type == "AttributeError" and "_unsharded_param" in first.text:
        return Judgement(
            True, f"AttributeError '_unsharded_param' in {first.where}",
            "the vision tower never ran forward (text-only micro-batch, gradient sync off), yet "
            "FSDP's root post-backward callback ran its post_backward: " + describe_failure(result))
    return _not_reproduced("AttributeError '_unsharded_param'", result)


def _judge_b(result: RunResult) -> Judgement:
    first = _first_failure(result)
    why = (f"expert {RANK0_EXPERT} has a gradient on rank 0 only, so rank 0 reduce-scatters "
           f"experts {SHARED_EXPERT}+{RANK0_EXPERT} and rank 1 expert {SHARED_EXPERT} only: ")
    other_bug = first is not None and (
        "_unsharded_param" in first.text or "uniform gradient dtype" in first.text)
    if first is not None and first.kind == "crash":
        return Judgement(True, f"mismatched reduce-scatter, rank {first.rank} aborted in gloo",
                       why + describe_failure(result))
    if first is not None and first.kind == "exception" and "backward" in first.where \
            and not other_bug:
        return Judgement(True, f"mismatched reduce-scatter, {first.error_type} in {first.where}",
                       why + describe_failure(result))
    if result.timed_out and not other_bug:
        return Judgement(True, "mismatched reduce-scatter hung", why + describe_failure(result))
    checks = result.rank0.get("checks")
    if checks and not checks["gradients"]["ok"]:
        return Judgement(True, "silently wrong gradients",
                       why + "the run completed but gradients differ from the reference: "
                       + "; ".join(checks["gradients"]["problems"][:2]))
    return _not_reproduced("a reduce-scatter mismatch or wrong gradients", result)


def _judge_c(result: RunResult) -> Judgement:
    first = _first_failure(result)
    if first and "uniform gradient dtype" in first.text:
        return Judgement(
            True, f"AssertionError 'uniform gradient dtype' in {first.where}",
            f"expert {SHARED_EXPERT}'s gradient was accumulated in fp32 over the earlier "
            "micro-batches, the fill's zeros for the unused experts are bf16: "
            + describe_failure(result))
    return _not_reproduced("AssertionError 'uniform gradient dtype'", result)


def _judge_d(result: RunResult) -> Judgement:
    checks = result.rank0.get("checks")
    if not checks:
        return _not_reproduced("a completed run with a zero gradient", result)
    unused = checks["unused_expert"]
    moved = unused["max_change"]
    if any(state != "None" for state in unused["grad_states"]) and moved > 0:
        return Judgement(
            True, f"never-used expert got grad 0 instead of None, AdamW moved it by {moved:.1e}",
            f"expert {UNUSED_EXPERT} got no token on any rank, yet its grad after each backward "
            f"was {unused['grad_states']} instead of None, so AdamW (weight_decay={WEIGHT_DECAY}) "
            f"changed its weights by up to {moved:.2e} in {STEPS} steps")
    return Judgement(False, "expected a zero gradient and moved weights",
                   f"grad after each backward {unused['grad_states']}, max |change| {moved:.1e}")


JUDGES = {"a": _judge_a, "b": _judge_b, "c": _judge_c, "d": _judge_d}


def _outcome(result: RunResult) -> str:
    if result.failures() or not result.rank0.get("checks"):
        return describe_failure(result)
    return "the run completed normally"
