"""The plugin on a simulated next torch: per patch, the plausible upstream changes (``tests/_next_torch``).

Two launches (``_next_torch_scenarios``): every 2-rank case in one, the ``post_forward_mesh_cache``
cases on 4 ranks in the other. Each case simulates one change of torch's FSDP2 / clip_grad internals
(torch.__version__ reading 2.16.0 while the plugin decides, so its structural checks decide alone),
runs a scenario with the plugin and again without it on the same simulated torch. Per case and rank:

- the patch's status is one the table in ``_next_torch_expected.EXPECTED`` allows, with a reason; no
  patch ``failed`` or ``pending``;
- no exception of ours: where the bug does not strike without the plugin, the run with it gives the
  same result bit for bit (gradients, weights, norms, process groups, or the same exception); where it
  strikes, an ``applied`` patch gives the right values (a one-process reference within the tolerances
  of the patches' own tests), any other status gives what the run without the plugin gave;
- the new keyword parameter reaches torch on every call the plugin makes (it passes what torch's
  callers passed: no call of torch's function with it dropped).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import pytest
import torch

import _clip_grad_norm_multi_mesh_scenarios as cl
import _dist_checks as ck
import _dist_common as sc
import _grouped_module_reuse_scenarios as rs
import _keep_param_attributes_scenarios as ats
import _next_torch_expected as nx
import _post_forward_mesh_cache_scenarios as mc
from _dist_launcher import RunResult, run_ranks

pytestmark = pytest.mark.timeout(300)  # on every torch: the table is keyed on code shape, not release

# Every case re-activates the plugin in the same process; the cross-rank check compares once per
# process group through store keys it would then reuse. It is a policy, not a patch under test.
ENV = {"FSDP_AUTOPATCH_CROSS_RANK_CHECK": "0"}
CASES = (
    "accumulated_grad_guard/new_keyword:accum",
    "accumulated_grad_guard/renamed:accum",
    "uniform_reduce_dtype/new_keyword:late_param",
    "uniform_reduce_dtype/imported_as:late_param",
    "uniform_reduce_dtype/renamed:late_param",
    "uniform_reduce_dtype/subclass_grads:uniform",
    "uniform_reduce_dtype/subclass_grads:late_param",
    "uniform_reduce_dtype/lazy_grads:uniform",
    "uniform_reduce_dtype/lazy_grads:late_param",
    "restore_unused_param_grads/new_keyword:restore",
    "restore_unused_param_grads/renamed:restore",
    "restore_unused_param_grads/torch_fix:restore",
    "grouped_module_reuse/new_keyword:reuse",
    "grouped_module_reuse/renamed:reuse",
    "grouped_module_reuse/post_partial_forward:reuse",
    "keep_param_attributes/new_keyword:attrs",
    "keep_param_attributes/renamed:attrs",
    "clip_grad_norm_multi_mesh/dtype:clip",
    "clip_grad_norm_multi_mesh/new_keyword:clip",
    "clip_grad_norm_multi_mesh/new_keyword_total:clip",
    "clip_grad_norm_multi_mesh/torch_fix:clip",
    "clip_grad_norm_multi_mesh/renamed:clip",
    "unused_param_reduction/new_keyword:routing",
)
MESH_CASES = (  # the first applied run of its world: the plugin's shared meshes start empty
    "post_forward_mesh_cache/new_keyword:mesh",
    "post_forward_mesh_cache/renamed:mesh",
    "post_forward_mesh_cache/torch_fix:mesh",
)
# gradients of another kind: the spec is "no exception of ours, what torch does without the plugin"
STEPPING_ASIDE_IS_RIGHT = ("uniform_reduce_dtype/subclass_grads", "uniform_reduce_dtype/lazy_grads")
UNUSED = ("experts.2.weight", "experts.2.bias")
CLIP_GRAD_ATOL, CLIP_TOTAL_RTOL = 1e-6, 1e-5  # as test_dist_clip_grad_norm_multi_mesh


@pytest.fixture(scope="module")
def launch2() -> RunResult:
    return run_ranks("next_torch", args={"cases": list(CASES)}, env=ENV, timeout=150.0)


@pytest.fixture(scope="module")
def launch4() -> RunResult:
    return run_ranks("next_torch", args={"cases": list(MESH_CASES)}, env=ENV,
                     world_size=mc.WORLD, timeout=150.0)


# --- the right values, per run -----------------------------------------------------------------


def _experts_reference(n_experts: int, plan: Callable, step: int, micro: int, weights: dict | None = None):
    model = sc.build_model("experts", n_experts=n_experts)
    if weights is not None:
        ck.load_weights(model, weights, must_equal=False)
    return sc.reference_grads(model, plan, step=step, n_micro_batches=micro)


def right_accum(rec: dict) -> None:
    ref = sc.reference_grads(sc.build_model("text_vision"), sc.plan_grad_guard, step=0, n_micro_batches=2)
    ck.assert_grads_match(rec["grads"], ref, bf16=True)  # the tower's gradients None, like its reference


def right_uniform(micro: int) -> Callable[[dict], None]:
    def right(rec: dict) -> None:
        ref = _experts_reference(2, sc.plan_uniform_late_param, 0, micro)
        ck.assert_grads_match(rec["grads"], ref, bf16=True)

    return right


def right_restore(rec: dict) -> None:
    ref = _experts_reference(3, sc.plan_restore_unused, 1, 1, rec["params_before"])
    assert all(ref[n] is None for n in UNUSED)
    ck.assert_grads_match(rec["grads"], ref)  # used ones equal, the unused ones None
    for name in UNUSED:
        assert torch.equal(rec["params_after"][name], rec["params_before"][name]), f"AdamW moved {name}"


def right_routing(rec: dict) -> None:
    ck.assert_grads_match(rec["grads"], _experts_reference(3, sc.plan_expert_routing, 0, 1))


def right_reuse(rec: dict) -> None:
    ck.assert_grads_match(rec["grads"], rs.reference_grads(rs.build("mtp"), 0, 1))


def right_attrs(rec: dict) -> None:
    for stage, params in rec["stages"].items():
        for name, seen in params.items():
            assert seen["marks"] == ats.expected_carried(name), (stage, name, seen)


def right_clip(key: str) -> Callable[[dict], None]:
    layout, dtype = key.split("/")

    def right(rec: dict) -> None:
        ref = cl.reference(f"{layout}/clip/2/none/dtensors")  # torch's clip_grad_norm_ in one process
        total = rec["total"]
        assert str(total.dtype) == f"torch.{'float32' if dtype == 'None' else dtype}", total.dtype
        assert abs(float(total) - ref["total"]) <= CLIP_TOTAL_RTOL * ref["total"], (float(total), ref["total"])
        for name, want in ref["grads"].items():
            assert float((rec["grads"][name] - want).abs().max()) <= CLIP_GRAD_ATOL, name

    return right


def right_mesh(rec: dict) -> None:
    assert rec["post_forward_meshes"] == 1 and rec["pg_created"] <= 2, rec  # one shared post-forward mesh
    ck.assert_grads_match(rec["grads"], mc.reference_steps(mc.build(8), steps=1)[0])


RIGHT: dict[str, Callable[[dict], None]] = {
    "accum": right_accum, "late_param": right_uniform(2), "uniform": right_uniform(1), "restore": right_restore,
    "routing": right_routing, "reuse": right_reuse, "attrs": right_attrs, "mesh": right_mesh,
}
# compared bit for bit whenever both runs completed, bug or not: the patch never changes them
ALWAYS_EQUAL = {"attrs": ("grads",), "mesh": ("grads",)}


# --- comparisons ---------------------------------------------------------------------------------


def same(a: Any, b: Any, where: str = "") -> None:
    """Equal bit for bit (tensors: dtype and values; exceptions: type and message)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (where, type(a), type(b))
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) - {"traceback"}
        assert keys == set(b) - {"traceback"}, (where, sorted(keys), sorted(set(b)))
        for key in keys:
            same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _is_right(right: Callable[[dict], None], rec: dict) -> bool:
    if rec["error"] is not None:
        return False
    try:
        right(rec)
    except AssertionError:
        return False
    return True


def _error(rec: dict) -> str:
    error = rec["error"]
    return "completed" if error is None else f"{error['type']}: {error['message'][:300]}\n{error['traceback'][-1500:]}"


def check_outcome(case: str, status: str, on: dict, off: dict, right: Callable[[dict], None]) -> None:
    if _is_right(right, off):  # the bug does not strike: torch's result with the plugin, bit for bit
        same(on, off, "with the plugin vs without")
        return
    if status == "applied" and not case.startswith(STEPPING_ASIDE_IS_RIGHT):
        assert on["error"] is None, f"{case}: applied, but the run raised: {_error(on)}"
        right(on)
        return
    if _is_right(right, on) and status == "applied":
        return
    try:
        same(on, off, "with the plugin vs without")
    except AssertionError as e:
        raise AssertionError(f"{case} ({status}): with the plugin {_error(on)}; without {_error(off)}") from e


def check_received(case: str, rec: dict) -> None:
    """Every call the plugin made into a function with a new parameter passed what torch's caller
    passed (True): calls without it are only those torch makes itself (the autograd engine's)."""
    dropped = Counter(c for c in rec["received_on"] if c[1] is not True)
    dropped -= Counter(c for c in rec["received_off"] if c[1] is not True)
    assert not dropped, f"{case}: the plugin called torch without the new keyword argument: {dict(dropped)}"


def records(run: RunResult, case: str) -> list[dict]:
    """Every rank's record of the case; the procedure itself (simulate, activate, revert) raised nowhere."""
    assert not run.timed_out, run.describe()
    missing = [rank.rank for rank in run.ranks if case not in rank.cases]
    assert not missing, f"ranks {missing} did not reach {case}\n{run.describe()}"
    recs = [rank.cases[case] for rank in run.ranks]
    raised = [_error(rec) for rec in recs if rec["error"] is not None]
    assert not raised, f"{case}: the procedure raised {raised[0]}"
    return recs


@pytest.mark.parametrize("case", CASES + MESH_CASES)
def test_simulated_change(case: str, request: pytest.FixtureRequest) -> None:
    run = request.getfixturevalue("launch4" if case in MESH_CASES else "launch2")
    recs = records(run, case)
    if all("skipped" in rec for rec in recs):
        pytest.skip(recs[0]["skipped"])
    patch, kind = nx.patch_of(case), case.rsplit(":", 1)[1]
    for rank, rec in enumerate(recs):
        status = rec["status"][patch]
        problem = nx.status_problem(case, status)
        assert problem is None, f"rank {rank}: {patch}: {problem}"
        for other in nx.ALSO.get(case.split(":", 1)[0], {}):
            problem = nx.status_problem(case, rec["status"][other], other)
            assert problem is None, f"rank {rank}: {other}: {problem}"
        broken = {n: s["status"] for n, s in rec["status"].items() if s["status"] in ("failed", "pending")}
        broken.pop(patch, None)  # a call-time failure of the patch itself is judged above
        assert not broken, f"rank {rank}: {broken}"
        check_received(case, rec)
        on, off = rec["on"], rec["off"]
        if kind == "clip":
            for key in off["clips"]:
                check_outcome(f"{case} {key}", status["status"], on["clips"][key], off["clips"][key], right_clip(key))
            continue
        check_outcome(case, status["status"], on, off, RIGHT[kind])
        if on["error"] is None and off["error"] is None:
            for key in ALWAYS_EQUAL.get(kind, ()):
                same(on[key], off[key], key)
        if case == "restore_unused_param_grads/torch_fix:restore" and status["status"] == "applied":
            assert status["fired"] == 0, f"rank {rank}: torch put None back itself, yet the patch fired"


def test_mesh_groups_drop(launch4: RunResult) -> None:
    """A new keyword on _get_post_forward_mesh_info: 8 units make 2 process groups per rank, not 16."""
    for rec in records(launch4, "post_forward_mesh_cache/new_keyword:mesh"):
        if rec["status"]["post_forward_mesh_cache"]["status"] == "applied":
            groups = (rec["on"].get("pg_created"), rec["off"].get("pg_created"))
            assert groups == (2, 16), (groups, _error(rec["on"]), _error(rec["off"]))


def test_clip_dtype_on_one_mesh_and_two(launch2: RunResult) -> None:
    """PyTorch PR 194033 simulated: clip_grad_norm_(..., dtype=) was run on both layouts and dtypes."""
    case = "clip_grad_norm_multi_mesh/dtype:clip"
    for rec in records(launch2, case):
        assert sorted(rec["on"]["clips"]) == ["one_mesh/None", "one_mesh/float64", "two_1d/None", "two_1d/float64"]
