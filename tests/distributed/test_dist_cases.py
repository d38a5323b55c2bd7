"""Every entry's case (``fsdp_autopatch.cases``, found by listing the package) on gloo ranks: with
its entry disabled by its variable, and with the plugin as installed.

One launch per world size runs every case of that size with the plugin as installed; one launch per
entry runs its case with only that entry off. Each rank's raw record is judged here, never by the
case: against ``tests/expected.py``'s ``case_rows`` for this torch (an error, or none; gradients and
weights against the case's one-process reference with the tolerances below; measured values), and
with the entry off against what ``unpatched_outcome`` says (the bug reproduces, or this torch is
right without the patch), which is recorded for the compatibility matrix. A new entry with a case
is tested here with no line written: its rows in ``tests/expected.py`` are all it adds.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch

import _dist_checks as ck
import expected as ex
from _dist_launcher import RunResult, run_ranks
from fsdp_autopatch import cases
from fsdp_autopatch.cases._common import max_diff

pytestmark = pytest.mark.timeout(600)

# FSDP_TEST_CASES=a,b runs only those cases (a developer's loop); unset: every case of the package
NAMES = tuple(n for n in cases.NAMES if n in os.environ.get("FSDP_TEST_CASES", n).split(","))
# a case whose NEEDS this machine lacks (a CUDA device, a package) is skipped, its rows still checked
RUNNABLE = tuple(n for n in NAMES if cases.unmet(n) is None)
ROWS = ex.case_rows(ck.RELEASE)
LAUNCH_TIMEOUT_S = 240.0  # 4 ranks on a busy 2-core machine: torch's import x 4 is most of it
FP32_REL, FP32_ABS = 1e-5, 1e-6  # fp32: summation order only
BF16_REL = ck.BF16_REL


def world_size(name: str) -> int:
    return cases.load(name).WORLD_SIZE


@functools.cache
def reference(name: str) -> dict[str, Any]:
    return cases.load(name).reference(world_size(name))


@pytest.fixture(scope="module")
def plugin_on() -> dict[int, RunResult]:
    """Per world size, one launch running every case of that size, the plugin as installed."""
    sizes = sorted({world_size(name) for name in RUNNABLE})
    return {size: run_ranks("cases", args={"names": [n for n in RUNNABLE if world_size(n) == size]},
                            world_size=size, timeout=LAUNCH_TIMEOUT_S) for size in sizes}


def run_with_entry_off(name: str) -> RunResult:
    return run_ranks("cases", env={ck.ENV[name]: "0"}, args={"names": [name]},
                     world_size=world_size(name), timeout=LAUNCH_TIMEOUT_S)


def record_of(run: RunResult, name: str) -> dict[str, Any]:
    """Rank 0's raw record of case ``name``; every rank must have run it and agree on its error. A
    failure names each rank's own error: the rank that raised first is the one to read."""
    records = []
    for rank in run.ranks:
        case = rank.cases.get(name)
        assert case is not None and case["error"] is None, (
            f"rank {rank.rank} (exit {rank.returncode}): {name} not run or its scenario failed: "
            f"{case and case['error']}\n{run.describe()}")
        records.append(case["record"])
    errors = [record["error"] and cases.error_text(record["error"]) for record in records]
    each_rank = "; ".join(f"rank {r}: {error}" for r, error in enumerate(errors))
    types = {error and error.split(":")[0] for error in errors}
    assert len(types) == 1, f"{name}: the ranks differ: {each_rank}\n{run.describe()}"
    return {**records[0], "each_rank": each_rank} if any(errors) else records[0]


def _why(record: dict[str, Any], found: list[str]) -> str:
    return f"{found}" + (f" (each rank's error: {record['each_rank']})" if "each_rank" in record else "")


def _far(got: dict[str, Any], ref: dict[str, Any], bf16: bool = False) -> str | None:
    """Why ``got`` is not within tolerance of ``ref`` (None where it is)."""
    if set(got) != set(ref):
        return f"tensors {sorted(set(got) ^ set(ref))} on one side only"
    for name in ref:
        g, r = torch.as_tensor(got[name]), torch.as_tensor(ref[name])
        bound = BF16_REL * float(r.abs().max()) if bf16 else FP32_ABS + FP32_REL * float(r.abs().max())
        if g.shape != r.shape or float((g - r).abs().max()) > bound:
            return f"{name}: max |got - reference| {float((g - r).abs().max()):.2e} > {bound:.2e}"
    return None


def mismatches(record: dict[str, Any], ref: dict[str, Any], row: dict[str, Any]) -> list[str]:
    """How ``record`` differs from ``row`` (an empty list where it meets it)."""
    found = []
    error = record["error"] and cases.error_text(record["error"])
    if "error" in row:
        want = row["error"]
        if want is None and error is not None:
            found.append(f"raised {error}")
        elif want is not None and not (error and error.startswith(want if isinstance(want, tuple) else (want,))):
            found.append(f"expected an error starting {want!r}, got {error!r}")
    for key in ("grads", "params"):
        if key in row:
            far = _far(record.get(key, {}), ref[key], bf16=row[key] == ex.BF16)
            if row[key] == ex.WRONG and far is None:
                found.append(f"{key} equal the reference (expected wrong ones)")
            elif row[key] != ex.WRONG and far is not None:
                found.append(f"{key}: {far}")
    for key, want in row.get("values", {}).items():
        got = record.get("values", {}).get(key)
        if got != want:
            found.append(f"values[{key!r}] = {got!r}, expected {want!r}")
    return found


def row_of(name: str, which: str) -> dict[str, Any]:
    """The entry's ``case_rows`` row, checked before anything is launched: a missing or misspelled
    row fails here by name (``tests/expected.py``'s ``check_case_row`` says what a row holds)."""
    if name not in ROWS:
        pytest.fail(f"tests/expected.py case_rows has no rows for {name!r}: add its 'on' and 'off' rows")
    problems = ex.check_case_row(ROWS[name].get(which))
    if problems:
        pytest.fail(f"tests/expected.py case_rows[{name!r}][{which!r}]: {'; '.join(problems)}")
    return ROWS[name][which]


def skip_if_unmet(name: str) -> None:
    why = cases.unmet(name)
    if why:
        pytest.skip(f"{why}: not run here")


def test_every_case_has_rows_and_every_entry_a_case():
    every = set(cases.NAMES)
    assert set(ROWS) == every, (sorted(every - set(ROWS)), sorted(set(ROWS) - every))
    assert every <= set(ex.PATCHES), sorted(every - set(ex.PATCHES))


@pytest.mark.parametrize("name", NAMES)
def test_case_with_the_plugin(name, request):
    row = row_of(name, "on")
    skip_if_unmet(name)
    run = request.getfixturevalue("plugin_on")[world_size(name)]
    record = record_of(run, name)
    ck.assert_registry(run, {name: ck.EXPECTED_STATUS[name]})
    if ck.EXPECTED_STATUS[name] == "unsupported":
        pytest.skip(f"{name} is unsupported on this torch: torch left as it is (record: {record['error']})")
    found = mismatches(record, reference(name), row)
    assert not found, f"{name} with the plugin: {_why(record, found)}\n{run.describe()}"
    ck.observe_patched(ex.BUG_OF[name], f"case: {cases.load(name).WHAT}")


@pytest.mark.parametrize("name", NAMES)
def test_case_with_its_entry_off(name):
    off_row, on_row = row_of(name, "off"), row_of(name, "on")
    skip_if_unmet(name)
    run = run_with_entry_off(name)
    record = record_of(run, name)
    ck.assert_registry_with_disabled(run, name)
    off = mismatches(record, reference(name), off_row)
    on = mismatches(record, reference(name), on_row)
    if not off:
        outcome = ex.REPRODUCES
    elif not on:
        outcome = ex.FIXED
    else:
        outcome = f"neither row (off row: {_why(record, off)}; on row: {on})"
    ck.expect_unpatched(ex.BUG_OF[name], outcome, f"case: {measured(record, reference(name))}", run)


def measured(record: dict[str, Any], ref: dict[str, Any]) -> str:
    """What a record shows, in one line for the matrix: the error, or the values and the distances."""
    if record["error"]:
        return " ".join(cases.error_text(record["error"]).split())[:240]
    parts = [f"{key} {value}" for key, value in sorted(record.get("values", {}).items())]
    for key in ("grads", "params"):
        if key in ref:
            diff = max_diff(record.get(key, {}), ref[key])  # described only: the verdict is _far's
            parts.append(f"{key} {diff:.1e} off the reference" if diff else f"{key} equal to the reference")
    return ", ".join(parts) or "completed"
