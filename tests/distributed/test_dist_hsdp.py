"""HSDP on 4 gloo CPU ranks: a (2 replicate x 2 shard) mesh, every patch over the whole reduction domain.

``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))`` and
``fully_shard(..., mesh=mesh)``: FSDP2 reduce-scatters over the shard group ({0, 1}, {2, 3}) and
all-reduces over the replicate group ({0, 2}, {1, 3}). Three 4-rank launches (see
``_hsdp_scenarios``):

* plugin on: (a) skipped vision tower, (b) experts used on one rank each, (c) late parameter and
  fill zero under bf16/fp32, (d) experts used on one replica only and by no rank, and a deferred
  all-reduce window; every value equals the single-process reference over the 4 ranks' global batch;
* patches (a), (c) and (d) off: the upstream failures on this torch (``tests/expected.py``);
* global rank 3 with a patch switched off: the cross-rank check per process group.
"""

from __future__ import annotations

import re

import pytest
import torch

import _dist_checks as ck
import _dist_common as sc
import _hsdp_scenarios as hs
from _dist_launcher import RunResult, run_ranks

pytestmark = pytest.mark.timeout(600)

LAUNCH_TIMEOUT_S = 240.0  # 4 ranks on a busy 2-core machine: torch import x 4 is most of it
SHORT_PG_TIMEOUT = "15"  # launches where ranks are expected to lose their peers

OFF = ("accumulated_grad_guard", "uniform_reduce_dtype", "restore_unused_param_grads")
ALL_CASES = ["grad_guard", "routing", "late_param", "restore", "window", "fill_zero"]
# off: the aborting fill_zero last, the crashing grad_guard after the cases whose values we read
OFF_CASES = ["restore", "window", "late_param", "grad_guard", "fill_zero"]

TOWER = ("tower.0.weight", "tower.0.bias", "tower.2.weight", "tower.2.bias")
GUARD_MESSAGE = "'FSDPParam' object has no attribute '_unsharded_param'"
DTYPE_ASSERT = re.compile(
    r"FSDP reduce-scatter expects uniform gradient dtype but got "
    r"\{torch\.(bfloat16|float32), torch\.(bfloat16|float32)\}"
)


def E(i: int) -> tuple[str, str]:
    return (f"experts.{i}.weight", f"experts.{i}.bias")


@pytest.fixture(scope="module")
def patched() -> RunResult:
    return run_ranks("hsdp", args={"cases": ALL_CASES}, world_size=hs.WORLD, timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def unpatched() -> RunResult:
    env = {ck.ENV[name]: "0" for name in OFF}
    env["FSDP_DIST_PG_TIMEOUT_S"] = SHORT_PG_TIMEOUT
    return run_ranks(
        "hsdp", args={"cases": OFF_CASES}, env=env, world_size=hs.WORLD, timeout=LAUNCH_TIMEOUT_S
    )


@pytest.fixture(scope="module")
def rank3_differs() -> RunResult:
    return run_ranks(
        "hsdp_cross_rank",
        env={"FSDP_DIST_PG_TIMEOUT_S": SHORT_PG_TIMEOUT},
        rank_env={3: {ck.ENV["restore_unused_param_grads"]: "0"}},
        world_size=hs.WORLD,
        timeout=LAUNCH_TIMEOUT_S,
    )


# --- HSDP shards -> full tensors ----------------------------------------------------------------


def records(run: RunResult, case: str) -> list[dict]:
    out = []
    for rank in run.ranks:
        rec = rank.cases.get(case)
        assert rec is not None, f"rank {rank.rank} did not run case {case!r}\n{run.describe()}"
        err = rec["error"]
        assert err is None, f"rank {rank.rank} case {case!r}: {err['type']}: {err['message']}\n{run.describe()}"
        out.append(rec)
    return out


def gather_hsdp(run: RunResult, case: str, key: str = "grads") -> dict[str, torch.Tensor | None]:
    """Full tensors from replica 0's shards; replica 1 must hold bitwise the same shards."""
    per_rank = [rec[key] for rec in records(run, case)]
    full: dict[str, torch.Tensor | None] = {}
    for name in per_rank[0]:
        parts = [d[name] for d in per_rank]
        if all(p is None for p in parts):
            full[name] = None
            continue
        missing = [r for r, p in enumerate(parts) if p is None]
        assert not missing, f"{case} {name}: None on ranks {missing} only"
        for rank in range(hs.SHARD, hs.WORLD):  # replica 1 == replica 0, shard by shard
            twin = rank - hs.SHARD
            assert torch.equal(parts[rank], parts[twin]), f"{case} {name}: rank {rank} differs from replica twin {twin}"
        full[name] = torch.cat(parts[: hs.SHARD], dim=0)
    return full


def assert_full_grads_consistent(run: RunResult, case: str, full: dict) -> None:
    """``grad.full_tensor()`` on every rank equals the gathered shards."""
    for rank, rec in enumerate(records(run, case)):
        assert set(rec["full_grads"]) == {n for n, g in full.items() if g is not None}, rank
        for name, g in rec["full_grads"].items():
            assert torch.equal(g, full[name]), f"rank {rank} {name}: full_tensor() != shards"


def reference_model(kind: str, run: RunResult, case: str, key: str = "init_params", **kw):
    """The single-process model holding the weights the ranks held in ``case``."""
    model = sc.build_model(kind, **kw)
    ck.load_weights(model, gather_hsdp(run, case, key), must_equal=key == "init_params")
    return model


def error_of(run: RunResult, rank: int, case: str) -> dict | None:
    return ck.error_of(run[rank], case)


# --- plugin on ------------------------------------------------------------------------------------


def test_mesh_registry_and_one_check_per_process_group(patched):
    patched.assert_clean()
    ck.assert_registry(patched, ck.EXPECTED_STATUS)
    for rank in patched.ranks:
        replica, shard = hs.replica_of(rank.rank), hs.shard_of(rank.rank)
        assert rank.data["mesh"] == {
            "shard_group": [hs.SHARD * replica + i for i in range(hs.SHARD)],
            "replicate_group": [hs.SHARD * i + shard for i in range(hs.REPLICATE)],
        }, rank.data["mesh"]
        # 6 models on one mesh: one store comparison for the shard group, one for the replicate group
        assert rank.data["store_checks"] == 2, rank.data["store_checks"]


def test_a_skipped_tower_patched(patched):
    grads = gather_hsdp(patched, "grad_guard_text_only")
    model = reference_model("text_vision", patched, "grad_guard_text_only")
    ref = hs.reference_grads(model, sc.plan_grad_guard, step=0, n_micro_batches=2)
    for name in TOWER:
        assert ref[name] is None and grads[name] is None, name
    ck.assert_grads_match(grads, ref, [n for n in ref if n not in TOWER], bf16=True)
    # next step: text-only, then images on every rank: the tower gets its first gradients
    grads = gather_hsdp(patched, "grad_guard_image_last")
    ref = hs.reference_grads(model, sc.plan_grad_guard, step=1, n_micro_batches=2)
    assert all(ref[n] is not None for n in ref)
    ck.assert_grads_match(grads, ref, bf16=True)


def test_b_experts_used_on_one_rank_each(patched):
    """Torch's own fill (2.13+; the backport before): expert r used by global rank r only."""
    for rec in records(patched, "routing"):
        assert rec["group_flags"] and all(rec["group_flags"].values()), rec["group_flags"]
    grads = gather_hsdp(patched, "routing")
    model = reference_model("experts", patched, "routing", n_experts=hs.ROUTING_EXPERTS)
    ref = hs.reference_grads(model, hs.plan_routing, step=0, n_micro_batches=1)
    ck.assert_grads_match(grads, ref)
    for r in range(hs.WORLD):  # an expert used on one rank: that rank's gradient / 4, on every rank
        share = sc.reference_grads(model, hs.plan_routing, 0, 1, ranks=(r,), world_size=hs.WORLD)
        for name in E(r):
            torch.testing.assert_close(grads[name], share[name], rtol=ck.FP32_RTOL, atol=ck.FP32_ATOL)


UNIFORM_CASES = [("late_param", sc.plan_uniform_late_param), ("fill_zero", sc.plan_uniform_fill_zero)]


@pytest.mark.parametrize("case,plan", UNIFORM_CASES)
def test_c_uniform_reduce_dtype_patched(patched, case, plan):
    grads = gather_hsdp(patched, case)
    model = reference_model("experts", patched, case, n_experts=2)
    ref = hs.reference_grads(model, plan, step=0, n_micro_batches=2)
    assert all(ref[n] is not None for n in ref)
    ck.assert_grads_match(grads, ref, bf16=True)  # includes dtype == float32
    for name in E(1):
        assert grads[name].abs().sum() > 0, name


def test_d_usage_reduced_over_shard_and_replicate_groups(patched):
    """Expert 0 used only on global rank 0, expert 3 only on rank 3: gradient on all 4 ranks."""
    recs = records(patched, "restore_partial")
    grads = gather_hsdp(patched, "restore_partial")
    assert_full_grads_consistent(patched, "restore_partial", grads)
    model = reference_model("experts", patched, "restore_partial", "params_before", n_experts=hs.RESTORE_EXPERTS)
    ref = hs.reference_grads(model, hs.plan_restore, step=1, n_micro_batches=1)
    assert ref[E(2)[0]] is None
    ck.assert_grads_match(grads, ref)  # experts 0, 1, 3 and the shared layers equal; expert 2 None
    for rank, rec in enumerate(recs):
        for name in E(0) + E(1) + E(3):
            assert rec["grads"][name] is not None, f"rank {rank} {name}: used on one replica, reset to None"
            assert rec["steps_after"][name] == 2.0, (rank, name)
            assert not torch.equal(rec["params_after"][name], rec["params_before"][name]), (rank, name)


def test_d_param_used_nowhere_untouched_on_every_rank(patched):
    for rank, rec in enumerate(records(patched, "restore_partial")):
        for name in E(2):
            assert rec["grads"][name] is None, f"rank {rank} {name}: {rec['grads'][name]}"
            assert torch.equal(rec["params_after"][name], rec["params_before"][name]), (rank, name)  # bitwise
            assert rec["steps_before"][name] == rec["steps_after"][name] == 1.0, (rank, name)
            assert rec["exp_avg_before"][name].abs().sum() > 0  # AdamW had momentum to move it with


def test_deferred_all_reduce_window(patched, unpatched):
    """``set_requires_all_reduce(False)`` on micro-batch 0 of 2, fill on (spec: HSDP paragraph).

    (i) expert 0, used by global rank 0 in micro-batch 0 and by no rank in the last: keeps its
    real gradient, equal to torch's own (patch off) and to the reference. (ii) expert 2, used by no
    rank in any micro-batch of the window: keeps torch's reduced zero (the documented limit).
    """
    got = gather_hsdp(patched, "window")
    torch_own = gather_hsdp(unpatched, "window")
    assert_full_grads_consistent(patched, "window", got)
    model = reference_model("experts", patched, "window", n_experts=hs.WINDOW_EXPERTS)
    ref = hs.reference_grads(model, hs.plan_window, step=0, n_micro_batches=2)
    for name in got:  # the patch changes nothing in this window
        assert torch.equal(got[name], torch_own[name]), f"{name} differs from torch's own gradient"
    used = [n for n in ref if ref[n] is not None]
    assert set(E(0)) <= set(used) and set(E(3)) <= set(used)
    ck.assert_grads_match(got, ref, used)  # (i) expert 0 and every used parameter
    for rank, rec in enumerate(records(patched, "window")):
        for name in E(2):  # (ii) the limit: a zero tensor, not None, on every rank
            assert ref[name] is None
            g = rec["grads"][name]
            assert g is not None and torch.count_nonzero(g) == 0, f"rank {rank} {name}: {g}"


# --- patches (a), (c), (d) off --------------------------------------------------------------------


def test_unpatched_registry(unpatched):
    assert not unpatched.timed_out, unpatched.describe()
    ck.assert_registry(unpatched, {**ck.EXPECTED_STATUS, **{name: "disabled" for name in OFF}})


def test_a_unpatched(unpatched):
    """2.7-2.14: the first no-sync backward crashes on every rank; 2.15: right gradients."""
    errors = [error_of(unpatched, r, "grad_guard_text_only") for r in range(hs.WORLD)]
    crashed = all(e is not None and (e["type"], e["message"]) == ("AttributeError", GUARD_MESSAGE) for e in errors)
    outcome = ck.ex.REPRODUCES if crashed else ck.ex.FIXED
    assert ck.unpatched_agrees(ck.ex.BUG_OF["accumulated_grad_guard"], outcome), unpatched.describe()
    if crashed:
        for e in errors:
            assert "to_accumulated_grad_if_needed" in e["traceback"], e["traceback"]
            assert "_root_post_backward_final_callback" in e["traceback"], e["traceback"]
        return
    grads = gather_hsdp(unpatched, "grad_guard_image_last")
    model = reference_model("text_vision", unpatched, "grad_guard_text_only")
    ck.assert_grads_match(grads, hs.reference_grads(model, sc.plan_grad_guard, 1, 2), bf16=True)


def _dtype_assertion(err: dict | None) -> bool:
    return err is not None and err["type"] == "AssertionError" and bool(DTYPE_ASSERT.fullmatch(err["message"]))


def test_c_unpatched(unpatched):
    """<= 2.14: the uniform-dtype assertion (late param: every rank; fill zero: ranks 1-3, whose
    gradients mix the bf16 zero with fp32 accumulations; rank 0 then loses its peer)."""
    late = [_dtype_assertion(error_of(unpatched, r, "late_param")) for r in range(hs.WORLD)]
    fill = [_dtype_assertion(error_of(unpatched, r, "fill_zero")) for r in range(hs.WORLD)]
    reproduces = all(late) and not fill[0] and all(fill[1:])
    outcome = ck.ex.REPRODUCES if reproduces else ck.ex.FIXED
    assert ck.unpatched_agrees(ck.ex.BUG_OF["uniform_reduce_dtype"], outcome), unpatched.describe()
    if reproduces:
        err0 = error_of(unpatched, 0, "fill_zero")
        assert err0 is not None and err0["type"] in ("RuntimeError", "DistBackendError"), err0
        return
    for case, plan in UNIFORM_CASES:
        model = reference_model("experts", unpatched, case, n_experts=2)
        ck.assert_grads_match(gather_hsdp(unpatched, case), hs.reference_grads(model, plan, 0, 2), bf16=True)


def test_d_unpatched_param_used_nowhere_gets_zero_and_moves(unpatched):
    assert ck.UNPATCHED[ck.ex.BUG_OF["restore_unused_param_grads"]] == ck.ex.REPRODUCES
    moved = []
    for rank, rec in enumerate(records(unpatched, "restore_partial")):
        for name in E(2):
            g = rec["grads"][name]
            assert g is not None and torch.count_nonzero(g) == 0, f"rank {rank} {name}: {g}"
            assert rec["steps_before"][name] == 1.0 and rec["steps_after"][name] == 2.0, (rank, name)
        moved.append(float((rec["params_after"][E(2)[0]] - rec["params_before"][E(2)[0]]).abs().max()))
    assert min(moved) > 1e-4, moved  # decoupled weight decay + leftover momentum
    # the experts some rank used are right without the patch too
    model = reference_model("experts", unpatched, "restore_partial", key="params_before", n_experts=hs.RESTORE_EXPERTS)
    ref = hs.reference_grads(model, hs.plan_restore, step=1, n_micro_batches=1)
    grads = gather_hsdp(unpatched, "restore_partial")
    ck.assert_grads_match(grads, ref, [n for n in ref if ref[n] is not None])


# --- cross-rank check: global rank 3 has restore_unused_param_grads off ---------------------------

# the check's own error, or a peer lost meanwhile
STOPPED = ("CrossRankMismatch", "RuntimeError", "DistBackendError", "DistNetworkError", "DistStoreError")
MISMATCH = "restore_unused_param_grads: applied on rank {peer}, disabled on rank 3"


def test_rank3_named_by_its_process_groups(rank3_differs):
    """Ranks 2 and 3 share rank 3's shard group {2, 3}: the check names rank 3, no hang."""
    run = rank3_differs
    assert not run.timed_out, run.describe()
    for rank in run.ranks:  # every rank stops with an error (no rank trains on)
        err = error_of(run, rank.rank, "first_forward")
        # rank 0 hosts the c10d store: a rank still waiting on it when rank 0 exits gets "Broken pipe"
        assert err is not None and err["type"] in STOPPED, run.describe()
    for r in (2, 3):
        err = error_of(run, r, "first_forward")
        assert "ranks disagree" in err["message"] and MISMATCH.format(peer=2) in err["message"], err["message"]
        assert "_lazy_init" in err["traceback"]  # at the first forward, before any FSDP2 collective


def test_ranks_outside_rank3s_shard_group_fail_fast_without_misdiagnosis(rank3_differs):
    """Ranks 0 and 1 run the plugin: they must not wait for the group timeout nor be told that
    rank 2 or 3 has no plugin. Rank 1 shares replicate group {1, 3} with rank 3 and must name it;
    rank 0 shares no group with rank 3 and may instead lose its peer in the first all-gather."""
    run = rank3_differs
    assert not run.timed_out, run.describe()
    for r in (0, 1):
        msg = error_of(run, r, "first_forward")["message"]
        assert "never reported" not in msg, f"rank {r}: {msg}"
    msg1 = error_of(run, 1, "first_forward")["message"]
    assert MISMATCH.format(peer=1) in msg1, msg1
    msg3 = error_of(run, 3, "first_forward")["message"]  # both of rank 3's groups, in one error
    assert MISMATCH.format(peer=2) in msg3 and MISMATCH.format(peer=1) in msg3, msg3
