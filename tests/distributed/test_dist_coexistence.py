"""The frameworks' own FSDP2 patches next to ours (issue 29, item 4): one 2-rank gloo launch.

Scenario ``coexist`` (``_coexistence_scenarios``): per framework, its patch applied after ours,
alone (ours reverted), and, for a process-wide patch, before ours (ours activated over it). Every
step's values equal a one-process reference; our registry says what is in force; a revert of ours
never undoes theirs.

Sources followed:

* NeMo Automodel 0.7.0 (PyPI ``nemo-automodel``): ``components/distributed/fsdp_patches.py``,
  the real file from the wheel (``pip download --no-deps``; loaded alone by path), called where
  ``components/distributed/parallelizer.py`` (the guard, before ``fully_shard``),
  ``components/moe/parallelizer.py`` (guard, then uniform reduce dtype) and
  ``parallelizer_utils.configure_fsdp_unused_param_reduction`` (uniform reduce dtype, then the
  public ``set_reduce_scatter_unused_params`` or, where torch lacks it, the backport) call them.
  No network: skipped, with the reason.
* verl PR 3072: ``verl/utils/fsdp_utils.py`` ``maybe_patch_fsdp_module``, re-created.
* Megatron-LM: ``megatron/core/distributed/torch_fully_sharded_data_parallel.py``
  ``_clone_fsdp_output_views`` (``TorchFullyShardedDataParallelConfig.clone_output_views``),
  registered with ``register_forward_hook`` before ``fully_shard``, re-created.
* accelerate PR 4219: ``Accelerator.clip_grad_norm_`` on FSDP2, DTensor gradients apart from
  plain ones (the excerpt read shows the split; the two totals are combined as a p-norm here).
* torchtitan: ``torchtitan/distributed/utils.py`` ``_clip_grad_norm_with_ep``, re-created.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import _clip_grad_norm_multi_mesh_scenarios as clip_sc
import _coexistence_scenarios as co
import _dist_checks as ck
import _dist_common as sc
import _fsdp_module_abc_layout_scenarios as abc_sc
import _inplace_view_output_scenarios as view_sc
from _dist_launcher import RunResult, run_ranks

pytestmark = pytest.mark.timeout(420)

NEMO = "nemo-automodel==0.7.0"
NEMO_FILE = "nemo_automodel/components/distributed/fsdp_patches.py"
CACHE = Path(os.environ.get("FSDP_AUTOPATCH_ARTIFACTS", Path(__file__).resolve().parents[2] / ".artifacts"))


def nemo_fsdp_patches() -> tuple[Path | None, str]:
    """NeMo Automodel's fsdp_patches.py from its wheel (downloaded once, without dependencies)."""
    target = CACHE / "nemo-automodel-0.7.0" / "fsdp_patches.py"
    if target.exists():
        return target, ""
    wheels = CACHE / "wheels"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(wheels)]
    command.append(NEMO)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return None, f"pip download {NEMO} timed out (no network?)"
    found = sorted(wheels.glob("nemo_automodel-0.7.0-*.whl"))
    if done.returncode != 0 or not found:
        return None, f"pip download {NEMO} failed (no network?): {done.stderr.strip()[-300:]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[0]) as wheel:
        target.write_bytes(wheel.read(NEMO_FILE))
    return target, ""


@pytest.fixture(scope="module")
def run() -> RunResult:
    path, why = nemo_fsdp_patches()
    result = run_ranks("coexist", args={"nemo_file": str(path) if path else ""}, timeout=240)
    result.nemo_skip = why  # type: ignore[attr-defined]
    return result


def _cases(run: RunResult, framework: str) -> list[str]:
    return [case for case in run.ranks[0].cases if case.startswith(framework + "/")]


def _fired(run: RunResult, case: str) -> dict[str, int]:
    """Per entry, the most any rank fired in the step (rank 1 alone reduces the fill's zero)."""
    names = run.ranks[0].cases[case]["fired"]
    return {name: max(rank.cases[case]["fired"][name] for rank in run.ranks) for name in names}


def _no_error(run: RunResult, case: str) -> None:
    for rank in run.ranks:
        assert ck.error_of(rank, case) is None, (case, ck.error_of(rank, case))


def test_launch_clean(run):
    run.assert_clean()


def _skip_nemo_where_not_measured(run) -> None:
    if run.nemo_skip:
        pytest.skip(run.nemo_skip)
    if not ck.NATIVE_UNUSED_PARAM_API:
        # torch < 2.13: NeMo replaces post_backward with its own unconditional zero fill, which our
        # restore_unused_param_grads would meet; not measured yet (the 2.8 / 2.9 matrix rows)
        pytest.skip("NeMo next to ours is measured on torch >= 2.13 only")


def test_nemo_values_right_in_every_order(run):
    _skip_nemo_where_not_measured(run)
    assert set(_cases(run, "nemo")) == {"nemo/after", "nemo/theirs", "nemo/before"}
    reduce_model = sc.build_model("experts", n_experts=2)
    ref_reduce = sc.reference_grads(reduce_model, sc.plan_uniform_fill_zero, step=0, n_micro_batches=2)
    guard_model = sc.build_model("text_vision")
    ref_guard = sc.reference_grads(guard_model, sc.plan_grad_guard, step=0, n_micro_batches=2)
    ref_guard = {n: g for n, g in ref_guard.items() if not n.startswith("tower.")}
    for case in _cases(run, "nemo"):
        _no_error(run, case)
        rec = run.ranks[0].cases[case]
        ck.assert_grads_match(rec["reduce"], ref_reduce, bf16=True)
        ck.assert_grads_match(rec["guard"], ref_guard, bf16=True)
        assert all(rank.cases[case]["guard_tower_grad_none"] for rank in run.ranks), case


def test_nemo_applied_as_on_this_torch(run):
    _skip_nemo_where_not_measured(run)
    errors = run.ranks[0].data["apply_errors"]["nemo"]
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    if hasattr(FSDPParam, "to_accumulated_grad_if_needed"):
        assert errors == {}
        # foreach_reduce at both modules, the guard; post_backward untouched (torch has the public API)
        assert run.ranks[0].data["theirs_installed"]["nemo"] == [True, True, True, False]
    else:  # torch >= 2.15: NeMo's guard reads a method torch removed
        assert list(errors) == ["patch_fsdp_accumulated_grad_guard"]
        assert errors["patch_fsdp_accumulated_grad_guard"].startswith("AttributeError")


def test_nemo_status_says_what_is_in_force(run):
    """After ours: NeMo's foreach_reduce and guard replaced ours, and hold ours (each runs once:
    widening is idempotent, ours sees a uniform list). Before ours: ours wraps theirs, nothing displaced."""
    _skip_nemo_where_not_measured(run)
    after = run.ranks[0].cases["nemo/after"]["records"]
    before = run.ranks[0].cases["nemo/before"]["records"]
    installed = run.ranks[0].data["theirs_installed"]["nemo"]
    if after["uniform_reduce_dtype"]["status"] == "applied":
        displaced = after["uniform_reduce_dtype"]["displaced"]
        assert [place.rsplit(".", 2)[-2] for place, _, _ in displaced] == ["_fsdp_collectives", "_fsdp_param_group"]
        assert all("foreach_reduce_uniform_dtype" in what and holds for _, what, holds in displaced)
        assert "replaced after us by" in after["uniform_reduce_dtype"]["reason"]
        assert before["uniform_reduce_dtype"]["displaced"] == [] and before["uniform_reduce_dtype"]["in_force"]
    if after["accumulated_grad_guard"]["status"] == "applied" and installed[2]:
        assert after["accumulated_grad_guard"]["in_force"], after["accumulated_grad_guard"]
        guard = before["accumulated_grad_guard"]
        assert guard["status"] == "applied" and not guard["displaced"]
    for records in (after, before):
        assert records["restore_unused_param_grads"]["displaced"] == []  # our own wrappers over it are not "someone"


def test_nemo_revert_of_ours_keeps_theirs(run):
    """Every place NeMo set still holds NeMo's after our revert; where ours was under theirs
    (2.13: foreach_reduce at two modules, the guard) the revert says it left theirs in place."""
    _skip_nemo_where_not_measured(run)
    data = run.ranks[0].data
    installed, kept = data["theirs_installed"]["nemo"], data["theirs_kept"]["nemo"]
    assert all(k for k, i in zip(kept, installed) if i), (installed, kept)
    left = data["left_in_place"]["nemo"]
    assert all("nemo_automodel_fsdp_patches" in entry for entry in left), left
    records = run.ranks[0].cases["nemo/after"]["records"]
    expected = 2 * (records["uniform_reduce_dtype"]["status"] == "applied") + (
        records["accumulated_grad_guard"]["status"] == "applied" and installed[2]
    )
    assert len(left) == expected, left


def test_verl_abc_swap_with_and_without_ours(run):
    model = abc_sc.build()
    for rank in range(sc.WORLD_SIZE):
        (abc_sc.loss(model, abc_sc.rank_batch(rank)) / sc.WORLD_SIZE).backward()
    ref = {n: p.grad for n, p in model.named_parameters()}
    for case in ("verl/after", "verl/theirs"):
        _no_error(run, case)
        rec = run.ranks[0].cases[case]
        assert rec["is_fsdp_module"] and rec["verl_class_kept"] and rec["torch_class_back"], rec
        ck.assert_grads_match(rec["grads"], ref)
    assert run.ranks[0].cases["verl/after"]["records"]["fsdp_module_abc_layout"]["in_force"]


def test_megatron_clone_hooks_with_and_without_ours(run):
    model = view_sc.build(co.VIEW_CASE)
    for rank in range(sc.WORLD_SIZE):
        (view_sc.loss(model, view_sc.rank_batch(co.VIEW_CASE, rank)) / sc.WORLD_SIZE).backward()
    ref = {n: p.grad for n, p in model.named_parameters()}
    for case in ("megatron/after", "megatron/theirs"):
        _no_error(run, case)
        ck.assert_grads_match(run.ranks[0].cases[case]["grads"], ref)
    # Megatron's clone leaves no view for ours to act on: ours does not fire (nothing done twice)
    assert _fired(run, "megatron/after") == {"inplace_view_output": 0}


@pytest.mark.parametrize("framework", ["accelerate", "torchtitan"])
def test_per_mesh_clipping_with_ours(run, framework):
    ref = clip_sc.reference(co.CLIP_CASES[framework])
    _no_error(run, f"{framework}/after")
    rec = run.ranks[0].cases[f"{framework}/after"]
    assert rec["total"] == pytest.approx(ref["total"], rel=1e-5)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(rec["grads"][name], grad, rtol=1e-5, atol=1e-6)
    assert run.ranks[0].cases[f"{framework}/after"]["records"]["clip_grad_norm_multi_mesh"]["in_force"]


def test_torchtitan_alone_equals_with_ours_and_ours_steps_aside(run):
    """torchtitan hands torch one mesh at a time: ours passes through, bitwise the same values."""
    alone, with_ours = run.ranks[0].cases["torchtitan/theirs"], run.ranks[0].cases["torchtitan/after"]
    _no_error(run, "torchtitan/theirs")
    assert alone["total"] == with_ours["total"]
    assert all(torch.equal(alone["grads"][n], g) for n, g in with_ours["grads"].items())
    assert _fired(run, "torchtitan/after") == {"clip_grad_norm_multi_mesh": 0}


def test_accelerate_alone_needs_ours(run):
    """accelerate's split keeps DTensors of two meshes in one get_total_norm: torch alone raises."""
    error = ck.error_of(run.ranks[0], "accelerate/theirs")
    if error is not None:
        assert "must have the same mesh" in error["message"] or "Sharding propagation failed" in error["message"]
    assert _fired(run, "accelerate/after")["clip_grad_norm_multi_mesh"] > 0
