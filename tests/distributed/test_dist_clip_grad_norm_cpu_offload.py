"""clip_grad_norm_cpu_offload on 2 gloo ranks with a CPU stand-in (``_clip_grad_norm_cpu_offload_scenarios``):
a group with a backend for ``cuda`` only, a mesh labelled ``"cuda"`` over it, gradients as FSDP2's CPU
offload leaves them (DTensors whose local shards are CPU tensors). The real run (NCCL, a GPU) is its
case's, which the GPU check runs.

* without the fix every case fails with the bug's exact error, on every rank;
* with it the total norm and the clipped gradients equal the one-process reference (norm 2, inf, 1;
  foreach None / True / False; fp32 and bf16 biases; a (1, 2) HSDP mesh; two meshes with
  clip_grad_norm_multi_mesh), NaN with ``error_if_nonfinite`` raises torch's message;
* and they equal bitwise torch's own results on a group that serves the CPU (the control), which the
  fix leaves alone (it does not fire there, and the control is bitwise the same with the fix off);
* only the 0-dim partial norms move, to the mesh's ``device_type``; the total comes back replicated
  onto the gradients' device (the CPU), where torch puts it.
"""

from __future__ import annotations

import math

import pytest
import torch

import _clip_grad_norm_cpu_offload_scenarios as sc
import _dist_checks as ck

pytestmark = pytest.mark.timeout(300)

PATCH = "clip_grad_norm_cpu_offload"
BUG = ck.ex.BUG_OF[PATCH]
SYMPTOM = "No backend type associated with device type cpu"
NONFINITE = "The total norm of order 2.0 for gradients from `parameters` is non-finite, so it cannot be clipped."
FINITE = tuple(c for c in sc.CASES if not sc.parse(c)["nan"])
NAN = tuple(c for c in sc.CASES if sc.parse(c)["nan"])

unpatched, patched = ck.off_and_on("clip_grad_norm_cpu_offload", PATCH, timeout=150.0)


def _rec(rank, case):
    rec = rank.cases.get(case)
    assert rec is not None, f"rank {rank.rank} did not reach case {case!r}"
    return rec


def test_registry(patched):
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})


def test_without_the_fix_every_case_fails_with_the_bugs_error(unpatched):
    for rank in unpatched.ranks:
        for case in sc.CASES:
            error = _rec(rank, case)["error"]
            assert error is not None and (error["type"], error["message"]) == ("RuntimeError", SYMPTOM), (case, error)
    ck.expect_unpatched(BUG, ck.ex.REPRODUCES, f"RuntimeError: {SYMPTOM} (CPU stand-in)", unpatched)


@pytest.mark.parametrize("case", FINITE)
def test_with_the_fix_values_equal_the_reference(patched, case):
    ref = sc.reference(case)
    bf16 = sc.parse(case)["mixed"]
    for rank in patched.ranks:
        rec = _rec(rank, case)
        assert rec["error"] is None, (case, rec["error"])
        # bf16 biases: each rank's partial norm is rounded to bf16 (torch's own too: the control)
        assert rec["total"] == pytest.approx(ref["total"], rel=4e-3 if bf16 else 1e-6), case
        for name, want in ref["grads"].items():
            tol = {"rtol": 1.6e-2, "atol": 1e-3} if bf16 and name.endswith("bias") else {"rtol": 1e-5, "atol": 1e-6}
            torch.testing.assert_close(rec["grads"][name], want, **tol, msg=lambda m, n=name: f"{case} {n}: {m}")


@pytest.mark.parametrize("case", NAN)
def test_nonfinite_raises_torchs_message(patched, case):
    for rank in patched.ranks:
        error = _rec(rank, case)["error"]
        assert error is not None and error["type"] == "RuntimeError" and error["message"].startswith(NONFINITE), error


@pytest.mark.parametrize("case", sc.CASES)
def test_bitwise_torchs_result_where_the_group_serves_the_cpu(patched, unpatched, case):
    for on, off in zip(patched.ranks, unpatched.ranks):
        fixed, control, control_off = _rec(on, case), _rec(on, f"{case}/control"), _rec(off, f"{case}/control")
        if sc.parse(case)["nan"]:  # torch's own error, with and without the fix
            assert all(c["error"]["message"].startswith(NONFINITE) for c in (control, control_off))
            continue
        assert control["fired"] == 0, case  # the fix leaves torch's own path alone
        for got in (fixed, control_off):
            assert got["total_bits"] == control["total_bits"], (case, got["total_bits"], control["total_bits"])
            for name in sc.SHAPES:
                assert torch.equal(got["grads"][name], control["grads"][name]), (case, name)


@pytest.mark.parametrize("case", FINITE)
def test_only_the_0dim_partial_norms_move_and_the_total_comes_home(patched, case):
    meshes = 2 if sc.parse(case)["layout"] == "multi" else 1
    for rank in patched.ranks:
        rec = _rec(rank, case)
        norms = [m for m in rec["moves"] if m["what"] == "norm"]
        totals = [m for m in rec["moves"] if m["what"] == "total"]
        assert len(norms) == len(sc.SHAPES) and all((m["shape"], m["from"], m["to"]) == ([], "cpu", "cuda")
                                                    for m in norms), rec["moves"]
        assert len(totals) == meshes and all(m["shape"] == [] and m["to"] == "cpu" for m in totals), rec["moves"]
        assert all(set(m["placements"]) == {"R"} for m in totals), rec["moves"]
        assert rec["total_device"] == "cpu"  # torch puts the total on the first gradient's device
        if meshes == 1:  # a replicated DTensor: clipping and full_tensor() need no collective
            assert rec["total_type"] == "DTensor" and set(rec["total_placements"]) == {"R"}, rec
        assert rec["fired"] == meshes, rec["fired"]


def test_a_total_of_inf_is_the_max_over_ranks(patched):
    # the fix returns the inf-norm total reduced: the max over the ranks
    want = sc.reference("1d/clip/inf/none/fp32")["total"]
    assert not math.isnan(want)
    for rank in patched.ranks:
        # torch's own total on a served group: partial (2.13 "P(max)", 2.8 "P") or already reduced (2.10 "R")
        (placement,) = _rec(rank, "1d/clip/inf/none/fp32/control")["total_placements"]
        assert placement in ("P(max)", "P", "R"), placement
        assert _rec(rank, "1d/clip/inf/none/fp32")["total"] == pytest.approx(want)
