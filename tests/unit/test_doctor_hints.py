"""doctor's hints: FSDP2 pitfalls of the installed torch that no patch fixes (bf16 accumulation).

The hint is read from how ``FSDPParam.init_dtype_attrs`` resolves ``reduce_dtype``: stand-in
classes give each known shape, and an unknown one; the real torch gives its own. A hint never turns
the verdict: the numbers it states are measured in tests/distributed/test_dist_bf16_accumulation.py.
"""

from __future__ import annotations

import pytest

from fsdp_autopatch import _compat, _doctor  # the hint imports _compat when it runs


class ReduceInParamDtype:  # torch <= 2.14: reduce_dtype=None reduces in param_dtype
    def init_dtype_attrs(self, mp_policy):
        param_dtype, reduce_dtype = mp_policy.param_dtype, mp_policy.reduce_dtype
        if reduce_dtype == param_dtype:
            reduce_dtype = None
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype


class FollowGradDtype:  # torch >= 2.15: reduce_dtype=None follows the parameter's grad_dtype
    def init_dtype_attrs(self, mp_policy):
        self.sharded_grad_dtype = self.orig_dtype
        self.param_dtype, self.reduce_dtype = mp_policy.param_dtype, mp_policy.reduce_dtype


class AccumulateInReduceOrParamDtype:  # the pending-gradient rewrite (acf70b43): reduce_dtype or param_dtype
    def init_dtype_attrs(self, mp_policy):
        self.sharded_grad_dtype = self.orig_dtype
        self.param_dtype, self.reduce_dtype = mp_policy.param_dtype, mp_policy.reduce_dtype
        self.unsharded_grad_dtype = self.reduce_dtype or self.param_dtype or self.orig_dtype


class Unknown:
    def init_dtype_attrs(self, policy):
        self.something_else = policy


def _with_fsdp_param(monkeypatch, cls):
    monkeypatch.setattr(_compat, "fsdp_class", lambda module, name: cls)


def test_reduce_in_param_dtype_names_the_policy_without_reduce_dtype(monkeypatch):
    _with_fsdp_param(monkeypatch, ReduceInParamDtype)
    hint = _doctor.bf16_accumulation_hint()
    assert hint.level == _doctor.HINT and hint.check == "bf16 gradient accumulation"
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16) without reduce_dtype" in hint.message
    assert "3x" in hint.message and "64 micro-batches" in hint.message
    assert hint.action == "pass reduce_dtype=torch.float32 when you accumulate gradients over micro-batches"


def test_follow_grad_dtype_names_only_an_explicit_bf16_reduce_dtype(monkeypatch):
    _with_fsdp_param(monkeypatch, FollowGradDtype)
    hint = _doctor.bf16_accumulation_hint()
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)" in hint.message
    assert "without reduce_dtype" not in hint.message


def test_the_rewrites_pending_gradients_in_param_dtype_name_the_policy_without_reduce_dtype(monkeypatch):
    _with_fsdp_param(monkeypatch, AccumulateInReduceOrParamDtype)
    hint = _doctor.bf16_accumulation_hint()
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16) without reduce_dtype" in hint.message


@pytest.mark.parametrize("fsdp_class", [lambda module, name: Unknown, "raises"])
def test_no_hint_when_the_shape_is_unknown_or_fsdp2_missing(monkeypatch, fsdp_class):
    def missing(module, name):
        raise ImportError("No module named 'torch'")

    monkeypatch.setattr(_compat, "fsdp_class", missing if fsdp_class == "raises" else fsdp_class)
    assert _doctor.bf16_accumulation_hint() is None
    assert _doctor.hints() == []


def test_installed_torch_gets_the_hint_of_its_shape():
    torch = pytest.importorskip("torch")
    from packaging.version import Version

    hint = _doctor.bf16_accumulation_hint()
    assert hint is not None
    release = Version(Version(torch.__version__.split("+")[0]).base_version)
    without_reduce_dtype = "without reduce_dtype" in hint.message
    # read in the wheels: 2.15 resolves reduce_dtype=None from the parameter's grad_dtype; the
    # pending-gradient rewrite (counted as 2.16 when overlaid) accumulates in param_dtype again
    resolve = _compat.class_attr(_compat.fsdp_class("_fsdp_param", "FSDPParam"), "init_dtype_attrs")
    in_param_dtype = release < Version("2.15") or _compat.reads_names(resolve, "unsharded_grad_dtype")
    assert without_reduce_dtype == in_param_dtype, (torch.__version__, hint.message)


def test_a_hint_never_turns_the_verdict(monkeypatch):
    _with_fsdp_param(monkeypatch, ReduceInParamDtype)
    findings = [_doctor.Finding("torch", _doctor.OK, "torch 2.13.0"), *_doctor.hints()]
    protected = not any(f.level == _doctor.PROBLEM for f in findings)
    text = _doctor.format_findings(findings, protected)
    assert protected
    assert "[hint] bf16 gradient accumulation: on this torch, MixedPrecisionPolicy(" in text
    assert "    -> pass reduce_dtype=torch.float32" in text
    assert text.endswith("verdict: runs started like this one are protected")
    assert findings[-1].to_dict()["level"] == "hint"


def test_diagnose_ends_with_the_hints(monkeypatch):
    _with_fsdp_param(monkeypatch, ReduceInParamDtype)
    monkeypatch.setattr(_doctor, "_torch_and_patches", lambda: [])
    findings = _doctor.diagnose()
    assert findings[-1].level == _doctor.HINT
    assert [f.level for f in findings].count(_doctor.HINT) == 1


def test_a_reader_that_leaves_early_does_not_turn_doctor_into_a_failure():
    """`fsdp-autopatch doctor | head -1` under `set -o pipefail`: exit 1 would read "not protected"."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written: every write breaks the pipe
    try:
        result = subprocess.run([sys.executable, "-m", "fsdp_autopatch", "doctor"], stdout=write_end,
                                stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write_end)
    # 141: as a shell tool killed by SIGPIPE; never 1, doctor's "not protected"
    assert result.returncode == 141 and b"BrokenPipeError" not in result.stderr, result.stderr.decode()[-2000:]
