"""Assertion helpers shared by the 2-rank tests (run in the pytest process)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any, Callable

import torch

import _dist_common as sc
import expected as ex
from _dist_launcher import RankResult, RunResult

PATCHES = ex.PATCHES
ENV = {name: f"FSDP_AUTOPATCH_{name.upper()}_ENABLED" for name in PATCHES}

RELEASE = ex.release_of(torch.__version__)


def _own_verdicts() -> dict[str, str]:
    """The status each patch gets on this torch with the defaults, from its own check (this process)."""
    import torch.distributed.fsdp  # noqa: F401  (the FSDP2 modules the checks read)

    from fsdp_autopatch import _activate
    from fsdp_autopatch.patches import load_patch

    verdicts = {}
    for name in PATCHES:
        try:
            status = _activate.verdict_of(load_patch(name)).status
        except Exception:  # a bug of ours: the ranks must then show it as failed
            status = "failed"
        verdicts[name] = "applied" if status == "needed" else status
    return verdicts


if ex.is_measured(RELEASE):
    EXPECTED_STATUS = ex.expected_status(RELEASE)
    # what each bug's scenario gives on this torch with its patch disabled (tests/expected.py)
    UNPATCHED = ex.unpatched_outcome(RELEASE)
else:
    # a release tests/expected.py has not measured (2.16+): the structural checks decide there, so
    # the tests check the plugin against its own verdicts (applied: the bug reproduces without the
    # patch; not_needed: torch is right without it; NOT_MEASURED where a verdict claims nothing)
    EXPECTED_STATUS, UNPATCHED = ex.claimed_by(_own_verdicts())
# What a run that imports FSDP2 has applied: the entries that wait for another module (DCP's
# state_dict) are left out on both sides (applied_with_fsdp2), whether or not the run imported it.
EXPECTED_APPLIED = sorted(n for n, status in EXPECTED_STATUS.items() if status == "applied" and n not in ex.WAITS_FOR)


def applied_with_fsdp2(applied) -> list[str]:
    """``fsdp_autopatch.applied()`` of a run, without the entries that wait for another module."""
    return sorted(name for name in applied if name not in ex.WAITS_FOR)


def statuses_with_fsdp2(statuses: dict[str, str]) -> dict[str, str]:
    """A run's ``{name: status}`` as :data:`EXPECTED_STATUS` has it: an entry that waits for another
    module (DCP's state_dict) and is still ``pending`` is taken as expected, since whether the run
    imported that module is the libraries' business (transformers' Trainer does or not by version)."""
    return {
        name: EXPECTED_STATUS.get(name, got) if got == "pending" and name in ex.WAITS_FOR else got
        for name, got in statuses.items()
    }


NATIVE_UNUSED_PARAM_API = ex.has_native_unused_param_api(RELEASE)

# Tolerances. fp32 runs differ from the single-process reference only by summation
# order; bf16 parameters (MixedPrecisionPolicy(param_dtype=bf16)) give ~3 significant
# digits: compare with a norm-relative error.
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
BF16_REL = 2e-2  # measured max 7.7e-3 (tower.0.weight, image_last)


# --- observations for the compatibility matrix (scripts/matrix.py) -----------------------------


def observe(bug: str, plugin: str, outcome: str, detail: str) -> None:
    """Record what a scenario showed: ``plugin`` is "off" (the bug's patch disabled) or "on".

    Written as one JSON line to ``$FSDP_MATRIX_RECORD`` when the matrix runner sets
    it; a no-op otherwise. "off" records are written before the test asserts, so a torch that
    surprises us still shows up in the table.
    """
    path = os.environ.get("FSDP_MATRIX_RECORD")
    if not path:
        return
    record = {"bug": bug, "plugin": plugin, "outcome": f"{outcome}: {detail}" if detail else outcome}
    if plugin == "off":
        record["kind"], record["expected"] = outcome, UNPATCHED[bug]
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


def expect_unpatched(bug: str, outcome: str, detail: str, run: RunResult) -> None:
    """Record, then check, what the scenario gave with the bug's patch disabled."""
    observe(bug, "off", outcome, detail)
    assert unpatched_agrees(bug, outcome), (
        f"bug ({bug}) without its patch on torch {torch.__version__}: expected {UNPATCHED[bug]!r}, "
        f"saw {outcome!r} ({detail})\n{run.describe()}"
    )


def unpatched_agrees(bug: str, outcome: str) -> bool:
    """``outcome`` (REPRODUCES / FIXED) is what this torch should give with the bug's patch off;
    anything is, where nothing is expected (``NOT_MEASURED``: recorded for the matrix, not judged)."""
    return UNPATCHED[bug] in (ex.NOT_MEASURED, outcome)


def note(text: str) -> None:
    """Something about this torch the matrix table should say (not a bug of ours)."""
    observe("note", "on", text, "")


def observe_patched(bug: str, detail: str) -> None:
    """Record a passing "with the plugin" check (call it after the assertions)."""
    observe(bug, "on", "correct", detail)


def off_and_on(scenario: str, patch: str, **launch: Any):
    """The module-scoped fixtures ``unpatched`` (``patch`` disabled by its variable) and ``patched``
    (the plugin as installed) of a variants test: one launch of ``scenario`` each, with ``launch``'s
    ``run_ranks`` arguments. ``unpatched, patched = ck.off_and_on("my_scenario", PATCH)``."""
    import pytest

    from _dist_launcher import run_ranks

    env = launch.pop("env", {})

    @pytest.fixture(scope="module")
    def unpatched() -> RunResult:
        return run_ranks(scenario, env={**env, ENV[patch]: "0"}, **launch)

    @pytest.fixture(scope="module")
    def patched() -> RunResult:
        return run_ranks(scenario, env=env, **launch)

    return unpatched, patched


# --- registry ---------------------------------------------------------------------------


def statuses(rank: RankResult) -> dict[str, dict[str, str]]:
    ap = rank.autopatch
    assert ap is not None, f"rank {rank.rank} recorded no fsdp_autopatch status"
    assert "import_error" not in ap, f"rank {rank.rank}: fsdp_autopatch not importable: {ap['import_error']}"
    assert "status_error" not in ap, f"rank {rank.rank}: fsdp_autopatch.status() failed: {ap['status_error']}"
    return {p["name"]: p for p in ap["patches"]}


def assert_registry(run: RunResult, expected: dict[str, str]) -> None:
    """Every rank's ``fsdp_autopatch.status()`` has the expected status per patch."""
    seen: dict[str, set[str]] = {}
    for rank in run.ranks:
        st = statuses(rank)
        assert rank.autopatch["bootstrap"] == "pth", rank.autopatch
        for name, want in expected.items():
            assert st[name]["env"] == ENV[name], st[name]
            got = st[name]["status"]
            if got == "pending" and ex.WAITS_FOR.get(name) and ex.WAITS_FOR[name] in st[name]["reason"]:
                continue  # this scenario never imported the module the entry waits for (DCP's)
            assert ex.status_agrees(want, got), (
                f"rank {rank.rank}: patch {name} is {got!r} ({st[name]['reason']}), expected {want!r}"
            )
            seen.setdefault(name, set()).add(got)
    differ = {name: sorted(found) for name, found in seen.items() if len(found) > 1}
    assert not differ, f"the ranks' statuses differ: {differ}"  # one torch, one environment


def assert_plugin_off(run: RunResult) -> None:
    """A run with ``FSDP_AUTOPATCH_ENABLED=0``: the plugin imported, nothing applied on any rank."""
    for rank in run.ranks:
        ap = rank.autopatch
        assert "import_error" not in ap, ap
        assert ap["applied"] == [], ap
        assert not any(p["status"] == "applied" for p in ap["patches"]), ap


def run_compiling(scenario: str, env: dict[str, str], timeout: float, **launch: Any) -> RunResult:
    """``run_ranks`` of a scenario that compiles (``launch``: its other arguments): the test skips,
    saying why, where torch.compile cannot run (the scenario saves ``compile_unavailable``)."""
    import pytest

    from _dist_launcher import run_ranks

    run = run_ranks(scenario, env=env, timeout=timeout, **launch)
    reason = next((r.data.get("compile_unavailable") for r in run.ranks if r.data), None)
    if reason:
        pytest.skip(f"torch.compile is unavailable here: {reason}")
    return run


def fired(run: RunResult, name: str) -> list[int]:
    """``PatchRecord.fired`` of patch ``name`` on each rank, after the scenario trained."""
    return [statuses(rank)[name]["fired"] for rank in run.ranks]


def assert_fired_where_applied(run: RunResult, name: str) -> None:
    """The patch acted on every rank if it applied here (the bug would have hit), never otherwise."""
    counts = fired(run, name)
    if EXPECTED_STATUS[name] == "applied":
        assert all(count > 0 for count in counts), f"{name} applied but never fired: {counts}"
    else:
        assert counts == [0] * len(counts), f"{name} is {EXPECTED_STATUS[name]} but fired: {counts}"


def assert_registry_with_disabled(run: RunResult, disabled: str) -> None:
    """``disabled`` reports disabled by its own variable; the other patches are unaffected."""
    expected = dict(EXPECTED_STATUS)
    expected[disabled] = "disabled"
    if disabled == "unused_param_reduction" and not NATIVE_UNUSED_PARAM_API:
        expected["restore_unused_param_grads"] = "not_needed"  # no fill left to undo
    assert_registry(run, expected)
    for rank in run.ranks:
        reason = statuses(rank)[disabled]["reason"]
        assert ENV[disabled] in reason, reason


# --- shards -> full tensors ---------------------------------------------------------------


def gather(run: RunResult, get: Callable[[RankResult], dict[str, torch.Tensor | None]]) -> dict[str, Any]:
    """Full tensors from every rank's Shard(0) local tensors (None if None on all ranks)."""
    per_rank = [get(r) for r in run.ranks]
    out: dict[str, Any] = {}
    for name in per_rank[0]:
        parts = [d[name] for d in per_rank]
        if all(p is None for p in parts):
            out[name] = None
        elif any(p is None for p in parts):
            raise AssertionError(
                f"{name}: gradient None on ranks {[i for i, p in enumerate(parts) if p is None]} only"
            )
        else:
            out[name] = torch.cat(parts, dim=0)
    return out


def case_grads(run: RunResult, case: str, key: str = "grads") -> dict[str, Any]:
    for r in run.ranks:
        rec = r.cases.get(case)
        assert rec is not None, f"rank {r.rank} did not run case {case!r}\n{run.describe()}"
        assert rec["error"] is None, (
            f"rank {r.rank} case {case!r} raised {rec['error']['type']}: {rec['error']['message']}\n"
            + run.describe()
        )
    return gather(run, lambda r: r.cases[case][key])


def assert_full_grads_consistent(run: RunResult, case: str, full: dict[str, Any]) -> None:
    """``grad.full_tensor()`` on every rank equals the concatenated local shards."""
    for r in run.ranks:
        fg = r.cases[case]["full_grads"]
        assert set(fg) == {n for n, g in full.items() if g is not None}, (r.rank, sorted(fg))
        for n, g in fg.items():
            assert torch.equal(g, full[n]), f"rank {r.rank} {n}: full_tensor() != shards"


# --- numbers ------------------------------------------------------------------------------


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12))


def assert_grads_match(
    got: dict[str, Any],
    ref: dict[str, Any],
    names: Iterable[str] | None = None,
    *,
    bf16: bool = False,
) -> None:
    """Each named gradient is fp32 and equals the reference (``None`` where it is None)."""
    names = list(ref) if names is None else list(names)
    assert names
    for n in names:
        g, r = got[n], ref[n]
        if r is None:
            assert g is None, f"{n}: expected grad None, got {g}"
            continue
        assert g is not None, f"{n}: grad is None, expected {r}"
        assert g.dtype == torch.float32, f"{n}: grad dtype {g.dtype}"
        assert g.shape == r.shape, (n, g.shape, r.shape)
        assert r.norm() > 0, f"{n}: reference gradient is zero, the check would be vacuous"
        if bf16:
            e = rel_err(g, r)
            assert e < BF16_REL, f"{n}: relative error {e:.3g} vs reference (bf16 tolerance {BF16_REL})"
        else:
            torch.testing.assert_close(g, r, rtol=FP32_RTOL, atol=FP32_ATOL, msg=lambda m, n=n: f"{n}: {m}")


def reference_model(
    kind: str, run: RunResult | None = None, params_key: str = "init_params", case: str | None = None, **kw: Any
):
    """The single-process model; checks (or loads) the weights the ranks had."""
    model = sc.build_model(kind, **kw)
    if run is not None:
        if case is None:
            full = gather(run, lambda r: r.data[params_key])
        else:
            full = gather(run, lambda r: r.cases[case][params_key])
        load_weights(model, full, must_equal=params_key == "init_params")
    return model


def load_weights(model: torch.nn.Module, full: dict[str, torch.Tensor], *, must_equal: bool) -> None:
    """Copy the ranks' full weights into ``model``; ``must_equal``: they must be its initial ones."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if must_equal:
                assert torch.equal(p, full[n]), f"{n}: ranks started from different weights"
            p.copy_(full[n])


def error_of(rank: RankResult, case: str) -> dict[str, str] | None:
    rec = rank.cases.get(case)
    assert rec is not None, f"rank {rank.rank} did not reach case {case!r}"
    return rec["error"]


def assert_stopped_on_every_rank(run: RunResult, case: str, stop: str) -> list[dict[str, str]]:
    """Every rank's ``case`` ended in a guard's ``GuardError`` whose message starts with ``stop``;
    returns the ranks' errors."""
    errors = [error_of(rank, case) for rank in run.ranks]
    assert all(e is not None and e["type"] == "GuardError" and e["message"].startswith(stop) for e in errors), errors
    return errors
