"""Unmodified user scripts under torchrun: the plugin arrives through the .pth alone.

``examples/train_vlm_moe.py`` never imports fsdp_autopatch. It is run under
``torchrun --standalone --nproc-per-node 2`` and as two single-process "nodes"
(``--nnodes 2 --nproc-per-node 1``, static rendezvous on localhost), each agent with its own
environment, the way a cluster starts one agent per node.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import _dist_checks as ck
from _dist_launcher import base_env, free_port, run_agents

pytestmark = [pytest.mark.timeout(600), pytest.mark.launcher]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_vlm_moe.py"
AGENT_TIMEOUT_S = 180


def torchrun(node_envs: list[dict[str, str]], nproc_per_node: int, script: Path = SCRIPT, args: tuple[str, ...] = (),
             timeout: float = AGENT_TIMEOUT_S) -> list[subprocess.CompletedProcess]:
    """One torchrun agent per entry of ``node_envs`` running ``script args``; all killed on timeout."""
    port = free_port()
    jobs = []
    for node_rank, extra in enumerate(node_envs):
        if len(node_envs) == 1:
            topology = ["--standalone"]
        else:
            topology = [f"--nnodes={len(node_envs)}", f"--node-rank={node_rank}",
                        "--master-addr=127.0.0.1", f"--master-port={port}"]
        env = base_env({"EXAMPLE_PG_TIMEOUT_S": "30", **extra})
        cmd = [sys.executable, "-m", "torch.distributed.run", *topology,
               f"--nproc-per-node={nproc_per_node}", str(script), *args]
        jobs.append((cmd, env))
    return run_agents(jobs, timeout, ranks=len(node_envs) * nproc_per_node)


def rank_reports(results: list[subprocess.CompletedProcess]) -> dict[int, dict]:
    """Every rank's JSON report. Ranks share the agent's stdout, so two reports can land on one
    line: decode objects one after another instead of line by line."""
    reports = {}
    decoder = json.JSONDecoder()
    for result in results:
        text, at = result.stdout, result.stdout.find('{"rank"')
        while at != -1:
            report, end = decoder.raw_decode(text, at)
            reports[report["rank"]] = report
            at = text.find('{"rank"', end)
    return reports


def describe(results) -> str:
    return "\n".join(f"--- agent exit {r.returncode}\n{r.stdout}\n{r.stderr[-2500:]}" for r in results)


def test_standalone_two_ranks_are_protected():
    results = torchrun([{}], nproc_per_node=2)
    assert results[0].returncode == 0, describe(results)
    reports = rank_reports(results)
    assert sorted(reports) == [0, 1], describe(results)
    for report in reports.values():
        assert report["ok"], report
        # through the .pth alone
        assert ck.applied_with_fsdp2(report["fsdp_autopatch_applied"]) == ck.EXPECTED_APPLIED, report
        assert report["unused_expert_moved"] == 0.0


@pytest.mark.parametrize(
    "patch, bug, symptom",
    [
        ("accumulated_grad_guard", "a", "AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'"),
        ("uniform_reduce_dtype", "c", "AssertionError: FSDP reduce-scatter expects uniform gradient dtype"),
        ("restore_unused_param_grads", "d", "AdamW moved the never-used expert"),
    ],
)
def test_each_patch_off_the_script_fails_where_the_bug_exists(patch, bug, symptom):
    results = torchrun([{ck.ENV[patch]: "0"}], nproc_per_node=2)
    output = results[0].stdout + results[0].stderr
    if ck.UNPATCHED[bug] == ck.ex.REPRODUCES:
        assert results[0].returncode != 0, describe(results)
        assert symptom in output, describe(results)
    else:  # this torch fixed it: the script is healthy without the patch
        assert results[0].returncode == 0, describe(results)


def test_two_nodes_with_the_same_environment():
    results = torchrun([{}, {}], nproc_per_node=1)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    reports = rank_reports(results)
    assert sorted(reports) == [0, 1] and all(r["ok"] for r in reports.values()), describe(results)


def test_two_nodes_with_different_toggles_stop_with_the_cross_rank_error():
    results = torchrun([{}, {ck.ENV["restore_unused_param_grads"]: "0"}], nproc_per_node=1)
    assert all(r.returncode != 0 for r in results), describe(results)
    for result in results:
        assert "ranks disagree" in result.stderr, describe(results)
        assert "restore_unused_param_grads: applied on rank 0, disabled on rank 1" in result.stderr
