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
    # post_forward_mesh_cache needs 4 or more ranks; a case whose NEEDS the CPU lacks (CUDA) is skipped
    assert launches[0].cases == [n for n in names if n != "post_forward_mesh_cache" and cases.unmet(n, "cpu") is None]
    on_cuda = _plan.plan("cuda", 2, {"cases": []})[0].cases
    assert on_cuda == [n for n in names if n != "post_forward_mesh_cache"]
    assert "clip_grad_norm_cpu_offload" in on_cuda and "clip_grad_norm_cpu_offload" not in launches[0].cases
    off = next(x for x in launches if x.name == "uniform_reduce_dtype off")
    assert off.cases == ["uniform_reduce_dtype"] and off.env == {_catalogue.toggle_for("uniform_reduce_dtype"): "0"}
    assert [x.name for x in launches[-3:]] == ["plugin on: training", "plugin off: training", "step cost"]
    assert _plan.plan("cpu", 2, {}, ["keep_param_attributes"])[0].cases == ["keep_param_attributes"]


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
