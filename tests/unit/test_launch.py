"""The shared rank launcher (``_launch``) and its rank side (``_rank_side``) on torch-free ranks, and
the demo package's import contract.

The launcher's timeout and port retry through ``tests/distributed/_dist_launcher.run_ranks`` are in
``tests/distributed/test_dist_launcher.py``; here: what only the demo uses (the grace after a
failed rank, merged output, a kept variable) and the environment every rank gets.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from fsdp_autopatch import _launch, _rank_side

pytestmark = pytest.mark.timeout(60)

DUMP_ENV = "import json, os, sys; print(json.dumps(dict(os.environ)))"


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_rank_gets_only_the_variables_the_caller_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_AUTOPATCH_ENABLED", "0")  # a developer's shell
    monkeypatch.setenv("FSDP_AUTOPATCH_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer-job")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    run = _launch.launch(
        lambda rank: _python(DUMP_ENV), world_size=2, port=12345, logs=tmp_path, timeout_s=30,
        env={"FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED": "0"}, rank_env={1: {"EXTRA": "1"}},
        keep=("FSDP_AUTOPATCH_LOG_LEVEL",))
    assert [r.returncode for r in run.ranks] == [0, 0] and not run.timed_out and run.killed == []
    envs = [json.loads(r.stdout) for r in run.ranks]
    for rank, env in enumerate(envs):
        ours = {k: v for k, v in env.items() if k.startswith("FSDP_AUTOPATCH_")}
        assert ours == {"FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED": "0", "FSDP_AUTOPATCH_LOG_LEVEL": "DEBUG"}
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "12345")
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "1"
        assert "TORCHELASTIC_RUN_ID" not in env
    assert "EXTRA" not in envs[0] and envs[1]["EXTRA"] == "1"


def test_after_a_failed_rank_its_waiting_peer_is_killed_after_the_grace(tmp_path):
    commands = {
        0: _python("import sys; print('line 1'); print('line 2'); sys.exit(3)"),
        1: _python("import time; time.sleep(600)"),
    }
    start = time.monotonic()
    run = _launch.launch(commands.__getitem__, world_size=2, port=1, logs=tmp_path, timeout_s=50,
                         fail_grace_s=1.0, merge_stderr=True, tail_chars=None, tail_lines=1)
    elapsed = time.monotonic() - start
    assert elapsed < 20, elapsed  # the grace, not the 50 s timeout
    assert not run.timed_out and run.killed == [1]
    assert run.ranks[0].returncode == 3 and run.ranks[1].returncode == -9
    assert run.ranks[0].stdout == "line 2" and run.ranks[0].stderr == ""


def test_merged_output_has_stderr_and_split_output_does_not(tmp_path):
    code = "import sys; print('out'); sys.stdout.flush(); print('err', file=sys.stderr)"
    (tmp_path / "merged").mkdir()
    (tmp_path / "split").mkdir()
    merged = _launch.launch(lambda rank: _python(code), world_size=1, port=1,
                            logs=tmp_path / "merged", timeout_s=30, merge_stderr=True)
    split = _launch.launch(lambda rank: _python(code), world_size=1, port=1,
                           logs=tmp_path / "split", timeout_s=30)
    assert (merged.ranks[0].stdout.split(), merged.ranks[0].stderr) == (["out", "err"], "")
    assert (split.ranks[0].stdout.split(), split.ranks[0].stderr.split()) == (["out"], ["err"])


def test_a_taken_port_is_retried_on_a_new_one_until_the_attempts_run_out():
    ports = iter([1001, 1002, 1003])
    seen = []

    def attempt(port):
        seen.append(port)
        return "ok" if port == 1003 else "OSError: [Errno 98] Address already in use"

    assert _launch.retry_on_taken_port(attempt, _launch.port_taken, attempts=3,
                                       port_source=lambda: next(ports)) == "ok"
    assert seen == [1001, 1002, 1003]
    seen.clear()
    ports = iter([2001, 2002])
    assert _launch.retry_on_taken_port(attempt, _launch.port_taken, attempts=2,
                                       port_source=lambda: next(ports)).endswith("in use")
    assert seen == [2001, 2002]


RANK_SIDE = (
    "import os, sys, time; from pathlib import Path; from fsdp_autopatch import _rank_side as side\n"
    "side.start_watchdog(float(sys.argv[1]))\n"
    "result = {'rank': int(os.environ['RANK'])}\n"
    "def work():\n"
    "    if result['rank'] == 1: raise ValueError('rank 1 failed')\n"
    "    time.sleep(30)\n"
    "side.run_then_exit(work, result, lambda code: side.write_json(Path(f'rank{result[\"rank\"]}.json'), result),\n"
    "                   lambda exc: side.error_record(exc, where='work'))\n"
)


def test_a_rank_that_raises_reports_it_and_one_that_overstays_is_ended_by_its_watchdog(tmp_path):
    started = time.monotonic()
    run = _launch.launch(lambda rank: [sys.executable, "-c", RANK_SIDE, "2"], world_size=2,
                         port=_launch.free_port(), logs=tmp_path, timeout_s=40, cwd=tmp_path)
    assert time.monotonic() - started < 20 and not run.timed_out and not run.killed
    assert [r.returncode for r in run.ranks] == [_rank_side.WATCHDOG_EXIT, _rank_side.FAILED_EXIT], run
    watched, failed = _launch.rank_results(tmp_path, 2)
    assert watched is None  # ended by its watchdog: no result, the parent says so
    error = failed["error"]
    assert list(error) == ["type", "message", "where", "traceback"]
    assert (error["type"], error["message"], error["where"]) == ("ValueError", "rank 1 failed", "work")
    # the frame that raised, then the error (Python 3.11+ may put a line of carets between them)
    assert ", in work\n" in error["traceback"] and error["traceback"].endswith("ValueError: rank 1 failed\n")
    assert not list(tmp_path.glob("*.tmp"))


def test_the_demo_imports_without_torch_and_its_cli_is_unchanged():
    code = (
        "import sys, fsdp_autopatch.demo, fsdp_autopatch._launch\n"
        "print('torch' in sys.modules, 'fsdp_autopatch.demo._worker' in sys.modules)"
    )
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert probe.stdout.split() == ["False", "False"], probe.stderr
    helps = [
        subprocess.run([sys.executable, "-m", *module, "--help"], capture_output=True, text=True,
                       timeout=60)
        for module in (["fsdp_autopatch", "demo"], ["fsdp_autopatch.demo"])
    ]
    for result in helps:
        assert result.returncode == 0, result.stderr
        usage = " ".join(result.stdout.split("\n\n")[0].split())
        assert usage == "usage: fsdp-autopatch demo [-h] [--without-patches] [--bug NAME] [--timeout TIMEOUT]"


def test_the_demo_says_which_inherited_settings_its_ranks_will_not_see():
    from fsdp_autopatch.demo import ignored_settings_note

    assert ignored_settings_note({"FSDP_AUTOPATCH_LOG_LEVEL": "INFO", "PATH": "/bin"}) == ""
    note = ignored_settings_note({"FSDP_AUTOPATCH_DISABLED": "*", "FSDP_AUTOPATCH_ENABLED": "0"})
    assert "ignoring FSDP_AUTOPATCH_DISABLED, FSDP_AUTOPATCH_ENABLED from your environment" in note
