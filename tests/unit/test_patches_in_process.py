"""The real patches against the installed torch, in this process (no process group needed)."""

import inspect

import pytest

pytest.importorskip("torch")
import torch.distributed.fsdp  # noqa: E402  (fires the post-import hook if the .pth is active)

import expected  # noqa: E402
import fsdp_autopatch  # noqa: E402
from fsdp_autopatch import _activate, _compat, _patching  # noqa: E402
from fsdp_autopatch.patches import load_patches  # noqa: E402


def _fsdp_param_class():
    return _compat.fsdp_class("_fsdp_param", "FSDPParam")


@pytest.fixture
def activated():
    """Patches applied by the hook (the .pth of this environment, or explicitly)."""
    fsdp_autopatch.install()
    yield fsdp_autopatch.status()


def never_unsharded_fsdp_param():
    """An FSDPParam whose unit never ran forward: no _unsharded_param, a reduce_dtype set."""
    fsdp_param = object.__new__(_fsdp_param_class())
    fsdp_param.reduce_dtype = torch.float32
    return fsdp_param


def test_guard_returns_early_for_a_never_unsharded_param(activated):
    if "to_accumulated_grad_if_needed" not in vars(_fsdp_param_class()):
        pytest.skip("this torch has no FSDPParam.to_accumulated_grad_if_needed (2.15 removed it)")
    method = _fsdp_param_class().to_accumulated_grad_if_needed
    with pytest.raises(AttributeError, match="_unsharded_param"):
        method.__wrapped__(never_unsharded_fsdp_param())  # torch's own method: the bug
    assert method(never_unsharded_fsdp_param()) is None  # patched: nothing to upcast


def test_expected_statuses_for_this_torch(activated):
    """tests/expected.py's statuses; on a release it has not measured (2.16+: NOT_MEASURED) any
    status but ``failed`` / ``pending``, the structural checks decide there."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401  (dcp_optimizer_state_init waits for it)

    report = fsdp_autopatch.status()
    status = {p.name: p.status.value for p in report.patches}
    want = expected.expected_status(expected.release_of(torch.__version__))
    for name in expected.PATCHES:
        assert expected.status_agrees(want[name], status[name]), (name, status[name], want[name], report[name].reason)
    assert fsdp_autopatch.applied() == tuple(n for n, s in status.items() if s == "applied")


def test_foreach_reduce_is_wrapped_at_every_import_site(activated):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group

    if activated["uniform_reduce_dtype"].status.value != "applied":
        pytest.skip("uniform_reduce_dtype not applied on this torch")
    assert _fsdp_param_group.foreach_reduce is _fsdp_collectives.foreach_reduce
    assert hasattr(_fsdp_collectives.foreach_reduce, "__wrapped__")


def test_revert_then_activate_restores_the_same_state(activated):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    before = {p.name: p.status for p in activated.patches}
    patched_post_backward = FSDPParamGroup.__dict__["post_backward"]
    _activate.revert_all()
    assert FSDPParamGroup.__dict__["post_backward"] is not patched_post_backward
    assert {p.status.value for p in fsdp_autopatch.status().patches} == {"pending"}
    _activate.activate()
    assert {p.name: p.status for p in fsdp_autopatch.status().patches} == before


def test_applying_twice_changes_nothing(activated):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    post_backward = FSDPParamGroup.__dict__["post_backward"]
    for patch in load_patches():
        if _activate.verdict_of(patch).status == "needed":
            _patching.apply(patch)
    assert FSDPParamGroup.__dict__["post_backward"] is post_backward


def _post_backward_collects_grads_itself() -> bool:
    """The 2.6 - 2.14 shape the backport's zero fill relies on: ``post_backward``'s own code reads
    each parameter's unsharded ``.grad`` (2.15 moved that loop into a helper)."""
    post_backward = inspect.unwrap(vars(_compat.fsdp_class("_fsdp_param_group", "FSDPParamGroup"))["post_backward"])
    return "unsharded_param.grad" in inspect.getsource(post_backward)


def test_backport_is_needed_where_the_public_api_is_missing(activated, monkeypatch):
    """A torch without FSDPModule.set_reduce_scatter_unused_params (< 2.13, simulated where torch
    has it): the backport judges a post_backward that collects the gradients itself as needed (not
    unsupported); where that loop moved out of post_backward (2.15) the backport could not work,
    and says so. Decided by the code's shape, whatever the release number reads."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp_autopatch.patches import unused_param_reduction

    native = unused_param_reduction.has_native_api()
    if native:
        monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    verdict = _activate.verdict_of(unused_param_reduction.PATCH)
    if _post_backward_collects_grads_itself():
        assert verdict.status == "needed", verdict.reason
        if native:  # the version range (where measured) says "has the method": the structure decided
            assert verdict.decided_by == _compat.STRUCTURE, verdict
    else:
        assert verdict.status == "unsupported", verdict.reason


def test_internals_of_another_shape_are_unsupported_and_untouched(activated, monkeypatch):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from fsdp_autopatch.patches import uniform_reduce_dtype

    def foreach_reduce(params, grads):  # a torch whose signature changed
        return None

    monkeypatch.setattr(_fsdp_collectives, "foreach_reduce", foreach_reduce)
    assert _activate.verdict_of(uniform_reduce_dtype.PATCH).status == "unsupported"


def test_default_on_policy_uses_torchs_own_fill_even_with_the_backport_switched_off(activated, monkeypatch):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from fsdp_autopatch.patches import unused_param_reduction

    if not unused_param_reduction.has_native_api():
        pytest.skip("torch < 2.13: the policy needs the backport")
    monkeypatch.setenv("FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS", "1")
    monkeypatch.setenv("FSDP_AUTOPATCH_UNUSED_PARAM_REDUCTION_ENABLED", "0")
    _activate.revert_all()
    try:
        _activate.activate()
        report = fsdp_autopatch.status()
        assert report["unused_param_reduction"].status.value == "disabled"
        assert report.policies["reduce_scatter_unused_params_default_on"].startswith("every FSDP unit")
        assert hasattr(FSDPParamGroup.__dict__["__init__"], "__wrapped__")
    finally:
        monkeypatch.delenv("FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS")
        monkeypatch.delenv("FSDP_AUTOPATCH_UNUSED_PARAM_REDUCTION_ENABLED")
        _activate.revert_all()
        _activate.activate()
    assert not hasattr(FSDPParamGroup.__dict__["__init__"], "__wrapped__")
