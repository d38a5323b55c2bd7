"""``fsdp-autopatch gpu-check``: its options, that nothing of it loads unless it runs, what it plans,
and the exits that need no rank (no CUDA device, an unreadable ``--expected``). The whole check on 2
gloo ranks, from a wheel: ``tests/install/test_install_gpu_check.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_autopatch import _catalogue, _cli

EXPECTED = Path(__file__).resolve().parents[1] / "expected.py"


def test_the_options_parse_without_importing_the_check() -> None:
    code = (
        "import sys; from fsdp_autopatch import _cli\n"
        "args = _cli._build_parser().parse_args(['gpu-check', '--device', 'cpu', '--only', 'uniform_reduce_dtype',\n"
        "                                        '--expected', 'x.py', '--world-size', '1'])\n"
        "assert (args.command, args.device, args.only, args.expected, args.world_size) == \\\n"
        "    ('gpu-check', 'cpu', ['uniform_reduce_dtype'], 'x.py', 1), args\n"
        "print(sorted(m for m in sys.modules if m.startswith('fsdp_autopatch._gpu_check') or m == 'torch'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_help_lists_it_and_only_takes_fixes_and_guards(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _cli.main(["--help"])
    assert "gpu-check" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        _cli.main(["gpu-check", "--only", "cross_rank_check"])  # a policy has no bug case
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        _cli.main(["gpu-check", "--help"])
    assert "--expected" in capsys.readouterr().out


def test_the_plan_runs_every_case_by_entry_name() -> None:
    from fsdp_autopatch import cases
    from fsdp_autopatch._gpu_check import _plan

    names = [e.name for e in _catalogue.ENTRIES if e.kind != _catalogue.POLICY and e.name in cases.NAMES]
    assert [p.name for p in _plan.PATCHES] == names
    launches = _plan.plan("cpu", 2, {"cases": []})
    # a case whose world-size rule (strikes_at: post_forward_mesh_cache needs 4 or more ranks) or whose
    # NEEDS the CPU lacks (CUDA) says so is skipped
    at_two = [n for n in names if cases.at_world_size(n, 2)[1]]
    assert "post_forward_mesh_cache" not in at_two
    assert launches[0].cases == [n for n in at_two if cases.unmet(n, "cpu") is None]
    on_cuda = _plan.plan("cuda", 2, {"cases": []})[0].cases
    assert on_cuda == [n for n in at_two if cases.unmet(n, "cuda") is None]  # peft, transformers: where installed
    assert "clip_grad_norm_cpu_offload" in on_cuda and "clip_grad_norm_cpu_offload" not in launches[0].cases
    off = next(x for x in launches if x.name == "uniform_reduce_dtype off")
    assert off.cases == ["uniform_reduce_dtype"] and off.env == {_catalogue.toggle_for("uniform_reduce_dtype"): "0"}
    assert [x.name for x in launches[-5:]] == ["plugin on: training", "plugin off: training", "plugin on: compile",
                                               "plugin off: compile", "step cost"]
    on, off = launches[-3:-1]  # every compile mode, plugin on and (a launch of its own) off
    assert on.cases == off.cases == list(_plan.COMPILE_MODES) and on.kind == off.kind == "compile"
    assert on.env == {} and off.env == {"FSDP_AUTOPATCH_ENABLED": "0"}
    only = _plan.plan("cpu", 2, {}, ["keep_param_attributes"])
    assert only[0].cases == ["keep_param_attributes"] and not any(x.kind == "compile" for x in only)
    # --off-runs: every case still runs with the plugin on, the off-runs only for the patches named
    some = _plan.plan("cpu", 2, {}, off_runs=["uniform_reduce_dtype"])
    assert some[0].cases == launches[0].cases
    assert [x.name for x in some if x.name.endswith(" off")] == ["uniform_reduce_dtype off"]
    assert [x.name for x in some[-5:]] == [x.name for x in launches[-5:]]


def test_expected_gives_letters_and_off_outcomes_by_entry() -> None:
    from fsdp_autopatch._gpu_check import _plan

    expected = _plan.load_expected(EXPECTED)
    letters, outcome = _plan.expected_off(expected, "2.13.0+cpu")
    assert letters["uniform_reduce_dtype"] == expected.BUG_OF["uniform_reduce_dtype"]
    assert outcome["uniform_reduce_dtype"] == expected.unpatched_outcome((2, 13))[letters["uniform_reduce_dtype"]]
    assert _plan.expected_off(None, "2.13.0") == ({}, {})


def test_no_cuda_device_says_so_and_exits_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_autopatch._gpu_check import _main

    monkeypatch.setattr(_main, "_cuda_devices", lambda timeout: (0, "torch sees no CUDA device here"))
    assert _cli.main(["gpu-check", "--out", str(tmp_path)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert json.loads((tmp_path / "report.json").read_text())["device"] == "auto"


def test_an_unreadable_expected_is_a_setup_failure(tmp_path: Path) -> None:
    code = _cli.main(["gpu-check", "--device", "cpu", "--out", str(tmp_path), "--expected", str(tmp_path / "no.py")])
    assert code == 2
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["device"] == "cpu" and "--expected" in report["setup_failed"]


def test_the_compile_launches_are_bounded_by_the_time_guard() -> None:
    from fsdp_autopatch._gpu_check import _main, _plan

    assert _main.launch_timeout("compile", "cpu", 1000.0, 45.0) == (_plan.TIMEOUTS["cpu"]["compile"], "")
    assert _main.launch_timeout("compile", "cuda", 200.0, 120.0)[0] == 80.0
    timeout, why = _main.launch_timeout("compile", "cuda", 200.0, 120.0)  # 80 s left: under its 90
    assert timeout == 80.0 and why.startswith("the overall time guard left too little time (80 s of the 90 s")
    assert _main.launch_timeout("bugs", "cpu", 70.0, 45.0) == (25.0, "")  # the others: 20 s at least


def _mode(**changes) -> dict:
    """One compile mode as rank 0 records it (``_compile``)."""
    return {"right": True, "value": "", "graph_breaks": 2, "recompiles": 0, "unique_graphs": 3, "frames": 4,
            "frames_converted": 6, "break_reasons": ["2x Attempted to call function marked as skipped"],
            "recompile_reasons": [], "losses": [0.5, 0.4], "weights_sha256": "a" * 64, "seconds": 1.5, **changes}


def _launch(name: str, modes: dict) -> dict:
    """A launch as ``_env.launch_ranks`` returns it: rank 0 with ``modes``, rank 1 with plain records."""
    return {"name": name, "cases": list(modes), "seconds": 9.0, "timed_out": False, "killed": [],
            "returncodes": [0, 0], "tails": ["", ""],
            "ranks": [{"cases": modes}, {"cases": {m: {"right": True, "value": ""} for m in modes}}]}


def _compile_report(on: dict, off: dict) -> dict:
    from fsdp_autopatch._gpu_check import _plan, _report

    launches = {f"plugin {side}: compile": _launch(f"plugin {side}: compile",
                                                   {m: modes.get(m, _mode()) for m in _plan.COMPILE_MODES})
                for side, modes in (("on", on), ("off", off))}
    report = {"patches": {}, "training": {}, "cost": {"skipped": "--only"},
              "compile": {"backend": "aot_eager", **_report.compile_rows(launches)}}
    report["ok"], report["problems"], report["findings"] = _report.verdict(report)
    return report


def test_the_compile_counters_off_and_on_are_reported_per_mode() -> None:
    from fsdp_autopatch._gpu_check import _plan, _report

    report = _compile_report({}, {})
    compiled = report["compile"]
    assert list(compiled["modes"]) == list(_plan.COMPILE_MODES) and compiled["steps"] == _plan.COMPILE_STEPS
    row = compiled["modes"]["compile_whole"]
    assert row["weights_bitwise_equal"] is True and row["on"]["graph_breaks"] == row["off"]["graph_breaks"] == 2
    assert {"recompiles", "unique_graphs", "frames", "break_reasons", "losses"} <= set(row["on"])
    assert report["ok"] and not report["problems"] and not report["findings"]
    text = _report._compile_table(compiled)
    assert "torch.compile (aot_eager), 3 steps" in text and "bitwise equal" in text and "DIFFER" not in text
    assert "torch.compile(model) after fully_shard      2 -> 2     0 -> 0" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_the_plugin_changing_a_compile_mode_is_a_finding_and_breaking_one_a_problem() -> None:
    from fsdp_autopatch._gpu_check import _report

    failed = {"right": False, "error": {"type": "Unsupported", "message": "graph break in a fullgraph region",
                                        "traceback": ""}}
    on = {"compile_whole": _mode(graph_breaks=20, recompiles=16, weights_sha256="b" * 64,
                                 break_reasons=["12x a wrapper of ours"]),
          "compile_torchtitan": failed}
    report = _compile_report(on, {})
    rows = report["compile"]["modes"]
    assert rows["compile_whole"]["weights_bitwise_equal"] is False
    assert rows["compile_torchtitan"]["weights_bitwise_equal"] is None
    assert not report["ok"]
    assert report["problems"] == ["compile compile_torchtitan with the plugin on: Unsupported: graph break in a "
                                  "fullgraph region (rank 0) (plugin off: it ran)"]
    assert len(report["findings"]) == 2
    assert report["findings"][0].startswith("compile compile_whole: more with the plugin on (off -> on): graph "
                                            "breaks 2 -> 20, recompiles 0 -> 16")
    assert "final weights differ" in report["findings"][1]
    text = _report._compile_table(report["compile"])
    assert "DIFFER" in text and "on, break reason: 12x a wrapper of ours" in text and "on: Unsupported" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_compile_unavailable_or_out_of_time_is_said_and_never_fails_the_check() -> None:
    from fsdp_autopatch._gpu_check import _plan, _report

    why = "torch.compile is not supported with torch 2.8.0 on Python 3.14.0 (Linux)"
    unavailable = {m: {"right": True, "value": f"not run: {why}", "unavailable": why} for m in _plan.COMPILE_MODES}
    report = _compile_report(unavailable, unavailable)
    assert report["compile"]["unavailable"] == why and report["ok"] and not report["findings"]
    assert _report._compile_table(report["compile"]) == f"torch.compile (aot_eager): not run: {why}"
    skipped = {"name": "plugin on: compile", "cases": list(_plan.COMPILE_MODES),
               "skipped": "the overall time guard left too little time (12 s of the 30 s it needs)"}
    compiled = _report.compile_rows({"plugin on: compile": skipped, "plugin off: compile": skipped})
    assert compiled["skipped"] == skipped["skipped"]
    assert compiled["modes"]["compile_whole"]["on"]["text"].startswith("not run: the overall time guard")
    report = {"patches": {}, "training": {}, "cost": {"skipped": "--only"}, "compile": compiled}
    assert _report.verdict(report) == (True, [], [])


def test_the_rank_side_counts_graph_breaks_recompiles_and_frames() -> None:
    torch = pytest.importorskip("torch")
    from fsdp_autopatch._gpu_check import _compile
    from fsdp_autopatch._gpu_check._net import Ctx

    cpu = Ctx(0, 1, torch.device("cpu"), "no-such-backend")
    assert "backend 'no-such-backend' is not registered" in _compile.unavailable(cpu)
    assert _compile.unavailable(Ctx(0, 1, torch.device("cpu"), "eager")) is None

    def step(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    _compile._reset()
    compiled = torch.compile(step, backend="eager")
    compiled(torch.ones(3))
    compiled(torch.ones(3, dtype=torch.float64))  # another dtype: both frames recompile
    found = _compile.counters()
    # Dynamo counts a graph break per trace: the recompile of the first frame meets it again
    assert found["graph_breaks"] == 2 and found["frames"] == 2 and found["recompiles"] == 2, found
    assert found["unique_graphs"] == 4 and len(found["recompile_reasons"]) >= 1, found
    _compile._reset()
    assert _compile.counters()["graph_breaks"] == 0
    one = {"w": torch.zeros(2)}
    assert _compile.digest(one) == _compile.digest({"w": torch.zeros(2)}) != _compile.digest({"w": -torch.zeros(2)})
