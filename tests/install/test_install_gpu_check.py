"""``scripts/gpu_check.py --device cpu`` end to end: it builds the wheel, installs it into a
throwaway venv over the test run's interpreter (so that venv's torch is used and the ``.pth``
activates the plugin as for a user), and runs that venv's ``fsdp-autopatch gpu-check --expected
tests/expected.py``, which probes its interpreter and runs every bug case on 2 gloo ranks
(``python -m fsdp_autopatch._gpu_check._rank``, from the wheel) with the plugin on, the bug with its
patch off for the three entries of ``OFF_RUNS`` (``--off-runs``), the training flavours, the compile
modes' counters and the step cost, and writes its JSON report; the report is checked here against
``tests/expected.py`` for this torch. About 50 s on 2 cores (small models).

Every entry's off-run is its case's, which ``tests/distributed/test_dist_cases.py`` runs once per
suite; here three show that the check launches, judges and reports one: a fix, a guard, and bug (a),
whose outcome without its patch differs between releases (``tests/expected.py``).

The same command, unchanged, is what runs on a CUDA machine (``--device cuda``); this test keeps its
logic working where CI runs (no GPU). Its options and the exits without ranks:
``tests/unit/test_cli_gpu_check.py``.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest

from _install_support import REPO, clean_env, describe, ex, run

pytestmark = [pytest.mark.install, pytest.mark.timeout(600)]

SCRIPT = REPO / "scripts" / "gpu_check.py"
OFF_RUNS = ("accumulated_grad_guard", "inplace_view_output", "optimizer_unsharded_params_guard")


def _torch_release() -> tuple[int, int] | None:
    try:
        return ex.release_of(importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.fixture(scope="module")
def gpu_check_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    release = _torch_release()
    if release is None or release < ex.OLDEST_RUNNABLE:
        pytest.skip(f"FSDP2 on gloo needs torch >= 2.8 in the test run's environment (found {release})")
    out = tmp_path_factory.mktemp("gpu-check")
    result = run([sys.executable, SCRIPT, "--device", "cpu", "--out", out, "--off-runs", *OFF_RUNS], env=clean_env(),
                 timeout=420)
    assert result.returncode == 0, describe(result)
    assert "gpu check: OK" in result.stdout, describe(result)
    report = json.loads((Path(out) / "report.json").read_text())
    report["_stdout"] = result.stdout
    return report


def test_the_plugin_came_from_the_wheel_through_the_pth(gpu_check_report: dict) -> None:
    plugin = gpu_check_report["plugin"]
    assert plugin["bootstrap"] == "pth" and "expected.py" in gpu_check_report["expected_source"]
    assert plugin["wheel"].startswith("fsdp_autopatch-") and plugin["wheel"].endswith(".whl")
    assert "site-packages" in plugin["file"] and str(REPO / "src") not in plugin["file"]
    where = (gpu_check_report["device"], gpu_check_report["backend"], gpu_check_report["world_size"])
    assert where == ("cpu", "gloo", 2)
    for launch in gpu_check_report["launches"]:  # rank 0 of every launch: started by the .pth
        assert launch["plugin"]["loaded_by_startup"] and launch["plugin"]["bootstrap"] == "pth", launch
        patch = launch["name"][: -len(" off")] if launch["name"].endswith(" off") else None
        if patch:  # that patch's variable switched that patch off, and only it
            disabled = [n for n, status in launch["plugin"]["statuses"].items() if status == "disabled"]
            assert disabled == [patch], launch


def test_every_patch_is_right_with_the_plugin_on(gpu_check_report: dict) -> None:
    rows = gpu_check_report["patches"]
    # every fix and guard runs its case module (fsdp_autopatch.cases), so no entry's model is written twice
    assert list(rows) == list(ex.PATCHES) and gpu_check_report["not_in_gpu_check"] == []
    assert [row["source"] for row in rows.values()] == [f"fsdp_autopatch.cases.{name}" for name in ex.PATCHES]
    statuses = gpu_check_report["plugin"]["statuses"]
    for name, row in rows.items():
        # not run at this world size (its case's strikes_at: post_forward_mesh_cache needs 4 or more ranks)
        # or here at all (its NEEDS: CUDA, a package the check's venv lacks): said why
        if row["note"].endswith(": not run"):
            assert "on" not in row and not row["strikes_at_this_world_size"], (name, row)
            continue
        assert row["on"]["ran"], (name, row)
        if statuses[name] == "unsupported":  # torch left as it is: recorded, not judged
            assert row["on"]["judged"] is False and "not judged" in row["note"], (name, row)
            continue
        assert row["on"]["right"], (name, row)
    assert gpu_check_report["ok"] and not gpu_check_report["problems"]


def test_the_bug_shows_with_its_patch_off_where_expected_says_so(gpu_check_report: dict) -> None:
    release = ex.release_of(gpu_check_report["machine"]["torch"])
    outcome = ex.unpatched_outcome(release)
    off_rows = [name for name, row in gpu_check_report["patches"].items() if "off" in row]
    assert off_rows == [name for name in ex.PATCHES if name in OFF_RUNS], off_rows
    for name, row in gpu_check_report["patches"].items():
        if "off" not in row:
            continue
        expected = outcome[ex.BUG_OF[name]]
        assert row["expected_off"] == expected
        if expected == ex.NOT_MEASURED:
            continue
        assert row["off"]["ran"], (name, row)
        assert row["bug_seen_off"] is (expected == ex.REPRODUCES), (name, expected, row["off"])
        assert row["off_agrees"] is True
    if ex.is_measured(release):
        assert gpu_check_report["findings"] == []


def test_training_flavours(gpu_check_report: dict) -> None:
    training = gpu_check_report["training"]
    for flavour in ("train_eager", "train_compile"):
        assert training[flavour]["on"]["right"], training[flavour]
        # plugin off: at least the restore's bug (d) shows on every measured release
        assert training[flavour]["off"]["ran"] and not training[flavour]["off"]["right"], training[flavour]
    assert "graphs compiled" in training["train_compile"]["on"]["text"]
    assert gpu_check_report["compile"]["backend"] == "aot_eager"
    assert "CUDA" in training["train_offload"]["skipped"]


def test_compile_counters_plugin_on_and_off(gpu_check_report: dict) -> None:
    compiled = gpu_check_report["compile"]
    if "unavailable" in compiled or "skipped" in compiled:  # said why, and the check is OK all the same
        assert (compiled.get("unavailable") or compiled["skipped"]) in gpu_check_report["_stdout"]
        return
    assert compiled["steps"] >= 2 and "Dynamo's counters on rank 0, plugin off -> on" in gpu_check_report["_stdout"]
    for mode, row in compiled["modes"].items():
        for side in ("on", "off"):
            assert row[side]["ran"] and isinstance(row[side]["graph_breaks"], int), (mode, row)
        # every parameter used on every rank: no bug strikes, the plugin must change nothing
        assert row["weights_bitwise_equal"] is True, (mode, row)
    # torch's FSDP2 hooks, hidden from Dynamo, break the whole model's graph; the plugin adds no break
    assert compiled["modes"]["compile_whole"]["off"]["graph_breaks"] >= 1
    assert compiled["modes"]["compile_torchtitan"]["on"]["graph_breaks"] == 0


def test_step_cost_numbers(gpu_check_report: dict) -> None:
    cost = gpu_check_report["cost"]
    assert cost["timer"] == "time.perf_counter"
    for case in ("fill_off", "fill_on"):
        variants = cost["cases"][case]["variants"]
        assert set(variants) == {"off", "on"}  # on_forced_sync only at one rank
        for variant in variants.values():
            assert variant["step_ms"] > 0 and variant["steps_timed"] > 0 and variant["peak_mib"] is None
        assert variants["on"]["ratio_to_off"] > 0
    # the flag all-reduce and its tolist run once per backward with the fill on, never with it off
    assert cost["cases"]["fill_on"]["variants"]["on"]["tolist_calls_per_step"] == 1
    assert cost["cases"]["fill_on"]["variants"]["on"]["restore_us_per_step"] > 0
    assert cost["cases"]["fill_off"]["variants"]["on"]["tolist_calls_per_step"] == 0
    assert "step cost (time.perf_counter" in gpu_check_report["_stdout"]


def test_the_report_says_what_cannot_strike_at_one_rank(gpu_check_report: dict) -> None:
    one = gpu_check_report["world_size_1"]
    assert not one["unused_param_reduction"]["can_strike"] and one["unused_param_reduction"]["runs"]
    assert not one["post_forward_mesh_cache"]["can_strike"] and not one["post_forward_mesh_cache"]["runs"]
    # every other entry strikes at one rank, or its row says why not (its case's strikes_at, its NEEDS)
    assert list(one) == list(gpu_check_report["patches"])
    assert all(row["can_strike"] or row["note"] for row in one.values())
