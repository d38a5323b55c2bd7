"""The hook: fixed order, isolation of a patch that raises, idempotence, strict mode, toggles."""

import types

import pytest
from packaging.version import Version

import fsdp_autopatch.patches as patches_package
from fsdp_autopatch import _activate, _compat, _patching, _process
from fsdp_autopatch._catalogue import WAITED_FOR
from fsdp_autopatch._registry import PatchStatus, Registry
from fsdp_autopatch._spec import Add, Patch, needed, not_needed, unsupported
from fsdp_autopatch.patches import PATCH_NAMES


class Internals:
    """Stands in for torch's internals: each fake patch adds one attribute here."""


class FakePatch:
    """A patch whose check and apply are scripted, and which records calls into a shared log.

    Its one target is an ``Add`` on :class:`Internals` whose factory is the "apply" step, so the
    fakes go through the same ``_patching.apply`` as the real patches.
    """

    def __init__(self, name, log, verdict=None, apply_error=None, check_error=None):
        self.name, self.log = name, log
        self.verdict = verdict or needed("needed in this fake torch")
        self.apply_error, self.check_error = apply_error, check_error
        self.applied = 0

    def check(self):
        self.log.append(("check", self.name))
        if self.check_error:
            raise self.check_error
        return self.verdict

    def apply(self, owner):
        self.log.append(("apply", self.name))
        if self.apply_error:
            raise self.apply_error
        self.applied += 1
        return object()

    def as_patch(self):
        # The version range agrees with the scripted verdict, so the verdict stands as scripted.
        affected = ">=0" if self.verdict.status == "needed" else "<0"
        return Patch(
            name=self.name, summary="fake", symptom="", trigger="", upstream=(), affected=affected,
            check=self.check, targets=(Add(f"{__name__}:Internals.{self.name}", self.apply),), changes="changed",
        )


@pytest.fixture
def registry(monkeypatch):
    fresh = Registry()
    monkeypatch.setattr(_activate, "REGISTRY", fresh)
    # The real patches may be applied in this process already; the fakes start from none.
    monkeypatch.setattr(_patching, "_applied", {})
    monkeypatch.setattr(_patching, "_ours", {})  # kept beside _applied: what each patch set where
    # A measured release, whether or not torch is installed here (scripts/interpreters.py runs
    # this file without torch): the fakes' version ranges then agree with their verdicts.
    monkeypatch.setattr(_compat, "torch_release", lambda: Version("2.13.0"))
    for name in PATCH_NAMES:
        monkeypatch.delattr(Internals, name, raising=False)
    # The entries that wait for another module than FSDP2 (DCP's state_dict) are tried as if it had
    # arrived too; test_an_entry_waits_for_its_own_module covers the wait.
    monkeypatch.setattr(_process, "arrived", set(WAITED_FOR))
    for variable in list(__import__("os").environ):
        if variable.startswith("FSDP_AUTOPATCH_"):
            monkeypatch.delenv(variable)
    return fresh


def install_fakes(monkeypatch, fakes):
    by_name = {fake.name: fake.as_patch() for fake in fakes}
    monkeypatch.setattr(patches_package, "load_patch", by_name.__getitem__)


def statuses(registry):
    return {record.name: record.status for record in registry.snapshot().patches}


def test_patches_apply_in_the_fixed_order(monkeypatch, registry):
    log = []
    fakes = [FakePatch(name, log) for name in PATCH_NAMES]
    install_fakes(monkeypatch, fakes)
    _activate.activate()
    assert [name for action, name in log if action == "apply"] == list(PATCH_NAMES)
    assert set(statuses(registry).values()) == {PatchStatus.APPLIED}


def test_a_patch_that_raises_is_recorded_and_the_others_still_apply(monkeypatch, registry):
    log = []
    fakes = [FakePatch(name, log) for name in PATCH_NAMES]
    fakes[1].apply_error = RuntimeError("boom inside the patch")
    fakes[2].check_error = ValueError("bad check")
    install_fakes(monkeypatch, fakes)
    _activate.activate()  # must not raise
    got = statuses(registry)
    assert got["unused_param_reduction"] is PatchStatus.FAILED
    assert got["uniform_reduce_dtype"] is PatchStatus.FAILED
    assert got["accumulated_grad_guard"] is PatchStatus.APPLIED
    assert got["restore_unused_param_grads"] is PatchStatus.APPLIED
    reason = registry.snapshot()["unused_param_reduction"].reason
    assert "RuntimeError: boom inside the patch" in reason


def test_missing_internals_during_check_mean_unsupported(monkeypatch, registry):
    log = []
    fakes = [FakePatch(name, log) for name in PATCH_NAMES]
    fakes[0].check_error = ImportError("No module named 'torch.distributed.fsdp._fully_shard._fsdp_param'")
    install_fakes(monkeypatch, fakes)
    _activate.activate()
    assert statuses(registry)["accumulated_grad_guard"] is PatchStatus.UNSUPPORTED
    assert ("apply", "accumulated_grad_guard") not in log


def test_strict_mode_reraises(monkeypatch, registry):
    monkeypatch.setenv("FSDP_AUTOPATCH_STRICT", "1")
    fakes = [FakePatch(name, []) for name in PATCH_NAMES]
    fakes[0].apply_error = RuntimeError("boom")
    install_fakes(monkeypatch, fakes)
    with pytest.raises(RuntimeError, match="boom"):
        _activate.activate()
    assert statuses(registry)["accumulated_grad_guard"] is PatchStatus.FAILED


def test_activation_is_idempotent(monkeypatch, registry):
    fakes = [FakePatch(name, []) for name in PATCH_NAMES]
    install_fakes(monkeypatch, fakes)
    _activate.activate()
    _activate.activate()
    assert [fake.applied for fake in fakes] == [1] * len(fakes)


def test_a_policy_takes_the_same_steps_and_is_recorded_under_policies(monkeypatch, registry):
    """Off: no record. On: applied once, described by its ``changes``. Failed at call time: a second
    activation leaves it failed, as it leaves a patch (``_isolation``: its wrappers pass through)."""
    from fsdp_autopatch import _isolation
    from fsdp_autopatch._catalogue import POLICIES

    fakes = [FakePatch(name, []) for name in PATCH_NAMES + POLICIES]
    install_fakes(monkeypatch, fakes)
    monkeypatch.setenv("FSDP_AUTOPATCH_CROSS_RANK_CHECK", "0")
    monkeypatch.setenv("FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS", "1")
    _activate.activate()
    policy = "reduce_scatter_unused_params_default_on"
    records = {record.name: record for record in registry.snapshot().policy_records}
    assert "cross_rank_check" not in records
    assert (records[policy].status, records[policy].description) == (PatchStatus.APPLIED, "changed")
    monkeypatch.setitem(_isolation._failed, policy, "boom")
    registry.record_call_failure(policy, "failed at call time: boom")
    _activate.activate()
    assert registry.status_of(policy) is PatchStatus.FAILED
    assert [fake.applied for fake in fakes if fake.name == policy] == [1]


def test_verdicts_become_statuses(monkeypatch, registry):
    log = []
    fakes = [FakePatch(name, log) for name in PATCH_NAMES]
    fakes[1].verdict = not_needed("torch has it")
    fakes[2].verdict = unsupported("internals differ")
    install_fakes(monkeypatch, fakes)
    _activate.activate()
    report = registry.snapshot()
    assert report["unused_param_reduction"].status is PatchStatus.NOT_NEEDED
    reason = report["unused_param_reduction"].reason
    assert reason.endswith(": torch has it; the version range agrees (the bug: torch <0)")
    assert report["unused_param_reduction"].decided_by == "version range and structural check"
    assert report["uniform_reduce_dtype"].status is PatchStatus.UNSUPPORTED
    assert ("apply", "unused_param_reduction") not in log and ("apply", "uniform_reduce_dtype") not in log


def test_env_toggles_are_read_when_the_hook_runs(monkeypatch, registry):
    fakes = [FakePatch(name, []) for name in PATCH_NAMES]
    install_fakes(monkeypatch, fakes)
    monkeypatch.setenv("FSDP_AUTOPATCH_DISABLED", "accumulated_grad_guard")
    monkeypatch.setenv("FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED", "0")
    _activate.activate()
    report = registry.snapshot()
    assert report["accumulated_grad_guard"].status is PatchStatus.DISABLED
    assert "FSDP_AUTOPATCH_DISABLED" in report["accumulated_grad_guard"].reason
    assert (report["accumulated_grad_guard"].variable, report["accumulated_grad_guard"].value) == (
        "FSDP_AUTOPATCH_DISABLED", "accumulated_grad_guard")
    assert report["uniform_reduce_dtype"].status is PatchStatus.DISABLED
    assert "FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED=0" in report["uniform_reduce_dtype"].reason
    assert report["uniform_reduce_dtype"].variable == "FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED"
    assert report["restore_unused_param_grads"].variable is None  # the default decided
    assert [fake.applied for fake in fakes] == [0, 1, 0] + [1] * (len(fakes) - 3)


def test_broken_patch_package_fails_every_patch_without_raising(monkeypatch, registry):
    def explode(name):
        raise ImportError("wrapt is broken")

    monkeypatch.setattr(patches_package, "load_patch", explode)
    _activate.activate()
    assert set(statuses(registry).values()) == {PatchStatus.FAILED}


def test_a_patch_module_that_does_not_import_costs_only_that_patch(monkeypatch, registry):
    log = []
    fakes = {name: FakePatch(name, log).as_patch() for name in PATCH_NAMES}
    broken = PATCH_NAMES[1]

    def load(name):
        if name == broken:
            raise TypeError("unsupported operand type(s) for |: 'type' and 'NoneType'")
        return fakes[name]

    monkeypatch.setattr(patches_package, "load_patch", load)
    _activate.activate()
    got = statuses(registry)
    assert got.pop(broken) is PatchStatus.FAILED
    assert set(got.values()) == {PatchStatus.APPLIED}
    assert "TypeError: unsupported operand" in registry.snapshot()[broken].reason


def test_a_patch_module_that_does_not_import_raises_under_strict(monkeypatch, registry):
    monkeypatch.setenv("FSDP_AUTOPATCH_STRICT", "1")

    def explode(name):
        raise TypeError("injected")

    monkeypatch.setattr(patches_package, "load_patch", explode)
    with pytest.raises(TypeError, match="injected"):
        _activate.activate()
    assert registry.snapshot()[PATCH_NAMES[0]].status is PatchStatus.FAILED


def test_an_entry_waits_for_its_own_module(monkeypatch, registry):
    """An entry whose module (``Entry.waits_for``) is importable but not imported stays pending at
    FSDP2's activation, naming that module; the module's own hook applies it and nothing else."""
    log = []
    install_fakes(monkeypatch, [FakePatch(name, log) for name in PATCH_NAMES])
    monkeypatch.setattr(_process, "arrived", set())
    monkeypatch.setattr(_process, "imported", lambda name: False)
    monkeypatch.setattr(_process, "importable", lambda name: True)
    monkeypatch.setattr(_process, "torch_version", lambda: "2.13.0")  # pending, not "torch is not installed"
    waiting = [name for name in PATCH_NAMES if _process.trigger_of(name) != _process.HOOK_TARGET]
    assert waiting, "no entry waits for another module: this test has nothing to test"
    _activate.activate()
    assert [name for action, name in log if action == "apply"] == [n for n in PATCH_NAMES if n not in waiting]
    for record in registry.snapshot().patches:
        if record.name in waiting:
            assert record.status is PatchStatus.PENDING
            assert f"waiting for {_process.trigger_of(record.name)}" in record.reason
    log.clear()
    trigger = types.SimpleNamespace(__name__=_process.trigger_of(waiting[0]))  # what the hook passes
    _activate.activate(trigger)
    applied = [name for action, name in log if action == "apply"]
    assert applied == [n for n in waiting if _process.trigger_of(n) == trigger.__name__]
    assert set(statuses(registry).values()) == {PatchStatus.APPLIED}, statuses(registry)


def test_an_entry_whose_module_this_torch_lacks_is_decided_at_once(monkeypatch, registry):
    """No such module in this torch (a stand-in, a build without DCP): its check runs and says so."""
    log = []
    install_fakes(monkeypatch, [FakePatch(name, log) for name in PATCH_NAMES])
    monkeypatch.setattr(_process, "arrived", set())
    monkeypatch.setattr(_process, "imported", lambda name: False)
    monkeypatch.setattr(_process, "importable", lambda name: False)
    _activate.activate()
    assert PatchStatus.PENDING not in set(statuses(registry).values())
