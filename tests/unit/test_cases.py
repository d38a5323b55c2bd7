"""The case machinery (``fsdp_autopatch.cases``) and the rows it is judged by, without torch.

Cases are run for real by ``tests/distributed/test_dist_cases.py``; here, with stand-in case
modules: what ``run_case`` records (an exception is the record, a record that is not JSON is
refused), what the demo and the GPU check print of a record (``verdict``), that every case module
is importable without torch (the demo's parent reads ``WORLD_SIZE`` and ``WHAT``), and that a
``case_rows`` row with a typo is refused instead of checking nothing.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

import expected as ex
from fsdp_autopatch import cases

CASES_DIR = Path(cases.__file__).parent


def _stand_in(monkeypatch, run, reference=lambda world_size: {}, **extra):
    module = types.SimpleNamespace(WORLD_SIZE=2, WHAT="a stand-in", run=run, reference=reference, **extra)
    monkeypatch.setattr(cases, "load", lambda name: module)
    return module


class Stopped(BaseException):  # as DCP's CheckpointException: not an Exception
    pass


def test_an_exception_of_the_run_is_its_record(monkeypatch):
    def run(rank, world_size, device="cpu"):
        raise RuntimeError("setStorage: ... out of bounds")

    _stand_in(monkeypatch, run)
    assert cases.run_case("x", 0, 2) == {"error": {"type": "RuntimeError", "message": "setStorage: ... out of bounds"}}


def test_a_base_exception_is_recorded_but_not_an_interrupt(monkeypatch):
    raised = {"error": Stopped("rank 1 failed")}

    def run(rank, world_size, device="cpu"):
        raise raised["error"]

    _stand_in(monkeypatch, run)
    assert cases.run_case("x", 0, 2)["error"] == {"type": "Stopped", "message": "rank 1 failed"}
    raised["error"] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        cases.run_case("x", 0, 2)


def test_a_record_that_is_not_json_is_refused_by_name(monkeypatch):
    _stand_in(monkeypatch, lambda rank, world_size, device="cpu": {"values": {"kept": {"a", "b"}}})
    error = cases.run_case("my_entry", 0, 2)["error"]
    assert error["type"] == "CaseError" and "'my_entry' returned a record that is not JSON" in error["message"]


def test_a_json_record_gets_error_none(monkeypatch):
    _stand_in(monkeypatch, lambda rank, world_size, device="cpu": {"values": {"groups": 2}})
    assert cases.run_case("x", 1, 2) == {"values": {"groups": 2}, "error": None}


def test_a_case_without_needs_runs_anywhere(monkeypatch):
    _stand_in(monkeypatch, run=None)
    assert cases.unmet("x") is None and cases.unmet("x", "cuda") is None


def test_a_cuda_case_is_unmet_off_cuda_and_a_missing_package_is_named(monkeypatch):
    _stand_in(monkeypatch, run=None, NEEDS=("cuda", "json", "no_such_package_fsdp_autopatch"))
    off_cuda = cases.unmet("x", "cpu")
    assert "CUDA device" in off_cuda and "'no_such_package_fsdp_autopatch'" in off_cuda
    assert "'json'" not in off_cuda  # an importable module is met
    on_cuda = cases.unmet("x", "cuda")
    assert "CUDA" not in on_cuda and "pip install no_such_package_fsdp_autopatch" in on_cuda


def test_a_case_without_strikes_at_strikes_and_runs_at_every_size(monkeypatch):
    _stand_in(monkeypatch, run=None)
    assert cases.at_world_size("x", 1) == cases.at_world_size("x", 8) == (True, True, "")


def test_a_cases_strikes_at_decides_where_it_runs_and_none_means_the_default(monkeypatch):
    def strikes_at(world_size):
        return (False, False, "2 ranks") if world_size < 2 else None

    _stand_in(monkeypatch, run=None, strikes_at=strikes_at)
    assert cases.at_world_size("x", 1) == (False, False, "2 ranks")
    assert cases.at_world_size("x", 2) == (True, True, "")


def test_the_world_size_rules_the_cases_declare():
    """The GPU check runs at the machine's world size; these cases say where their bug strikes."""
    assert cases.at_world_size("unused_param_reduction", 1)[:2] == (False, True)
    assert "ranks cannot disagree" in cases.at_world_size("unused_param_reduction", 1)[2]
    assert cases.at_world_size("clip_grad_norm_cpu_offload", 1)[:2] == (False, True)
    assert cases.at_world_size("restore_unused_param_grads", 1)[:2] == (True, True)
    assert "on_forced_sync" in cases.at_world_size("restore_unused_param_grads", 1)[2]
    for size in (1, 2, 3, 5):  # 1 < reshard_after_forward=2 < shard size on an even mesh only
        can, runs, why = cases.at_world_size("post_forward_mesh_cache", size)
        assert (can, runs) == (False, False) and why.endswith(f"4 or more ranks (k=2), not {size}: not run")
    for name in cases.NAMES:  # two ranks suffice for every other bug; 4 for all
        assert cases.at_world_size(name, 4) == cases.at_world_size(name, 6) == (True, True, ""), name
        assert cases.at_world_size(name, 2) == (True, True, "") or name == "post_forward_mesh_cache"


def test_the_gpu_checks_plan_names_no_entry():
    """Where a bug strikes is its case's data (``strikes_at``), not a branch of the GPU check's plan."""
    from fsdp_autopatch._gpu_check import _plan

    source = Path(_plan.__file__).read_text()
    assert [name for name in cases.NAMES if f'"{name}"' in source] == []


def test_verdict_prints_a_guard_error_whole_and_a_crash_as_wrong(monkeypatch):
    _stand_in(monkeypatch, None)
    message = "fsdp-autopatch guard g: ...\nset FSDP_AUTOPATCH_G_ENABLED=0."
    stopped = cases.verdict("g", {"error": {"type": "GuardError", "message": message}}, 2)
    assert stopped["right"] and stopped["guard_error"] == f"GuardError: {message}"
    crashed = cases.verdict("x", {"error": {"type": "AttributeError", "message": "no _unsharded_param"}}, 2)
    assert crashed == {"right": False, "value": "AttributeError: no _unsharded_param"}


def test_verdict_uses_the_cases_own_judge_against_its_reference(monkeypatch):
    seen = {}

    def judge(record, reference):
        seen.update(record=record, reference=reference)
        return True, "measured"

    _stand_in(monkeypatch, None, reference=lambda world_size: {"values": {"world": world_size}}, judge=judge)
    assert cases.verdict("x", {"values": {"groups": 2}, "error": None}, 4) == {"right": True, "value": "measured"}
    assert seen["reference"] == {"values": {"world": 4}}


@pytest.mark.parametrize("name", cases.NAMES)
def test_a_case_module_names_its_size_and_run_as_literals_and_imports_no_torch_at_module_level(name):
    tree = ast.parse((CASES_DIR / f"{name}.py").read_text())
    assigned = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name)}
    assert isinstance(ast.literal_eval(assigned["WORLD_SIZE"]), int)
    assert isinstance(ast.literal_eval(assigned["WHAT"]), str)
    top_imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = {alias.name for node in top_imports for alias in node.names} | {
        node.module for node in top_imports if isinstance(node, ast.ImportFrom) and node.module}
    assert not any(n == "torch" or n.startswith("torch.") for n in names), (name, sorted(names))
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    imported = {alias.asname or alias.name for node in top_imports for alias in node.names}
    assert {"run", "reference"} <= functions | imported, name


@pytest.mark.parametrize("row, problem", [
    ({"eror": None}, "unknown key 'eror'"),
    ({"grad": ex.WRONG}, "unknown key 'grad'"),
    ({}, "non-empty"),
    ({"grads": "close"}, "none of REFERENCE, BF16, WRONG"),
    ({"values": {}}, "values: a non-empty dict"),
    ({"error": 3}, "error: None, a string or a tuple"),
])
def test_a_row_that_would_check_nothing_or_the_wrong_thing_is_refused(row, problem):
    problems = ex.check_case_row(row)
    assert any(problem in p for p in problems), problems


def test_the_rows_of_every_release_are_well_formed():
    for release in ex.MEASURED:
        for name, rows in ex.case_rows(release).items():
            for which, row in rows.items():
                assert ex.check_case_row(row) == [], (ex.release_text(release), name, which)
