"""The registry and its JSON form."""

import importlib.util
import json

import pytest

from fsdp_autopatch import _bootstrap
from fsdp_autopatch._registry import PatchStatus, Registry, StatusReport
from fsdp_autopatch.patches import PATCH_NAMES

# Without torch a patch can never leave "pending", so the snapshot reports it as unsupported
# ("torch is not installed"); scripts/interpreters.py runs these tests in venvs without torch.
needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="pending reads as unsupported without torch"
)


@needs_torch
def test_every_patch_starts_pending_in_order():
    report = Registry().snapshot()
    assert [r.name for r in report.patches] == list(PATCH_NAMES)
    assert {r.status for r in report.patches} == {PatchStatus.PENDING}
    assert report.patches[0].env == "FSDP_AUTOPATCH_ACCUMULATED_GRAD_GUARD_ENABLED"


def test_json_form_has_the_documented_keys():
    registry = Registry()
    registry.record("uniform_reduce_dtype", PatchStatus.APPLIED, "because")
    data = json.loads(json.dumps(registry.snapshot().to_dict()))
    assert set(data) == {"version", "torch", "bootstrap", "patches", "policies", "policy_records"}
    fields = {"name", "status", "reason", "env", "decided_by", "variable", "value", "fired", "provider"}
    assert set(data["patches"][0]) == fields
    assert data["patches"][2] == {
        "name": "uniform_reduce_dtype",
        "status": "applied",
        "reason": "because",
        "env": "FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED",
        "decided_by": "",
        "variable": None,
        "value": None,
        "fired": 0,
        "provider": None,
    }


def test_status_is_a_str_enum():
    assert PatchStatus.NOT_NEEDED == "not_needed"
    assert str(PatchStatus.APPLIED) == "applied"
    assert PatchStatus("failed") is PatchStatus.FAILED


def test_pending_under_kill_switch_reads_as_disabled(monkeypatch):
    monkeypatch.setattr(_bootstrap, "disabled_at_start", "0")
    report = Registry().snapshot()
    assert {r.status for r in report.patches} == {PatchStatus.DISABLED}
    assert "FSDP_AUTOPATCH_ENABLED=0" in report.patches[0].reason


def test_report_lookup_by_name_and_torch_version_recorded():
    registry = Registry()
    registry.record_torch_version("2.13.0+cpu")
    report = registry.snapshot()
    assert isinstance(report, StatusReport)
    assert report.torch == "2.13.0+cpu"
    assert report["restore_unused_param_grads"].status is PatchStatus.PENDING


@needs_torch
def test_reset_returns_everything_to_pending():
    registry = Registry()
    registry.record("accumulated_grad_guard", PatchStatus.FAILED, "x")
    registry.record_policy("p", "on")
    registry.reset()
    report = registry.snapshot()
    assert report["accumulated_grad_guard"].status is PatchStatus.PENDING and report.policies == {}
