"""Version parsing and the all-or-nothing, reversible attribute replacement."""

import types

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from fsdp_autopatch import _compat, _patching


@pytest.mark.parametrize(
    "raw, release",
    [
        ("2.13.0+cpu", "2.13.0"),
        ("2.9.0.dev20250801+cu128", "2.9.0"),
        ("2.8.0a0+git1234abc", "2.8.0"),
        ("2.15.0rc1", "2.15.0"),
        ("2.14.1", "2.14.1"),
    ],
)
def test_torch_versions_parse_to_their_release(raw, release):
    assert _compat.parse_torch_version(raw) == Version(release)


def test_unparsable_version_is_none_and_never_counts_as_before():
    version = _compat.parse_torch_version("not-a-version")
    assert version is None
    assert not _compat.before(version, "2.15")
    assert _compat.before(Version("2.14.1"), "2.15")
    assert not _compat.before(_compat.parse_torch_version("2.15.0.dev20260101"), "2.15")


AFFECTED = SpecifierSet(">=2.6,<2.15")


@pytest.mark.parametrize(
    "structural, version, status, decided_by",
    [
        # a measured release where structure and version range agree: both decided
        ("needed", "2.13.0", "needed", _compat.VERSION_AND_STRUCTURE),
        ("not_needed", "2.15.0", "not_needed", _compat.VERSION_AND_STRUCTURE),
        # 2.16 nightlies and unparsable versions: the structure alone
        ("needed", "2.16.0", "needed", _compat.STRUCTURE),
        ("not_needed", "2.16.0", "not_needed", _compat.STRUCTURE),
        ("needed", None, "needed", _compat.STRUCTURE),
        # buggy code on a release thought fixed: patch it, the structure decided
        ("needed", "2.15.0", "needed", _compat.STRUCTURE),
        # no bug found where the release has it (a vendor build): leave torch alone
        ("not_needed", "2.13.0", "unsupported", _compat.STRUCTURE),
        # internals missing: unsupported whatever the version
        ("unsupported", "2.13.0", "unsupported", _compat.STRUCTURE),
    ],
)
def test_decide_combines_structure_and_version_range(structural, version, status, decided_by):
    verdict = _compat.decide(
        _compat.Verdict(structural, "what the structure shows"),
        Version(version) if version else None,
        AFFECTED,
        "the bug",
    )
    assert (verdict.status, verdict.decided_by) == (status, decided_by)
    assert "what the structure shows" in verdict.reason
    assert verdict.reason.startswith(f"torch {version}" if version else "torch (unparsable version)")


class Target:
    def method(self):
        return "original"


def test_replace_all_is_atomic():
    module = types.SimpleNamespace(value=1)

    class Frozen:
        __slots__ = ()

    replacements = [(Target, "method", lambda self: "patched"), (module, "value", 2), (Frozen(), "x", 3)]
    with pytest.raises((AttributeError, TypeError)):
        _patching.replace_all("atomic-test", replacements)
    assert Target().method() == "original" and module.value == 1
    assert not _patching.is_applied("atomic-test")


def test_replace_all_is_idempotent_and_reversible():
    def wrapper(wrapped, instance, args, kwargs):
        return "wrapped " + wrapped(*args, **kwargs)

    _patching.replace_all("reversible", [(Target, "method", _patching.wrap(Target.__dict__["method"], wrapper))])
    _patching.replace_all("reversible", [(Target, "method", lambda self: "twice")])  # no-op
    assert Target().method() == "wrapped original"
    _patching.revert("reversible")
    assert Target().method() == "original"


def test_revert_deletes_attributes_the_patch_added():
    _patching.replace_all("adds", [(Target, "added", lambda self: 1)])
    assert Target().added() == 1
    _patching.revert("adds")
    assert not hasattr(Target, "added")


def test_code_inspection_sees_through_wrappers():
    import functools

    def inner(fsdp_params, unsharded_grads):
        return fsdp_params._unsharded_param, "expects uniform gradient dtype"

    @functools.wraps(inner)
    def outer(*args):
        return inner(*args)

    assert _compat.reads_names(outer, "_unsharded_param")
    assert _compat.has_string_constant(outer, "uniform gradient dtype")
    assert _compat.first_parameters(outer, 2) == ("fsdp_params", "unsharded_grads")


def test_state_param_groups_across_versions():
    new_style = types.SimpleNamespace(_fsdp_param_groups=["a", "b"])
    old_style = types.SimpleNamespace(_fsdp_param_group="a")
    old_empty = types.SimpleNamespace(_fsdp_param_group=None)
    assert _compat.state_param_groups(new_style) == ["a", "b"]
    assert _compat.state_param_groups(old_style) == ["a"]
    assert _compat.state_param_groups(old_empty) == []


@pytest.mark.parametrize(
    "raw, shown",
    [
        ("2.13.0a0+nv26.06", "torch 2.13.0a0+nv26.06 (counted as 2.13.0)"),  # NVIDIA's vendor builds
        ("2.8.0a0+5228986c39.nv25.05", "torch 2.8.0a0+5228986c39.nv25.05 (counted as 2.8.0)"),
        ("2.16.0.dev20261201+cpu", "torch 2.16.0.dev20261201+cpu (counted as 2.16.0)"),
        ("2.13.0+cpu", "torch 2.13.0"),  # a release build reads as its release
        ("2.15.0", "torch 2.15.0"),
    ],
)
def test_vendor_and_dev_versions_are_parsed_and_shown_as_they_call_themselves(raw, shown):
    assert _compat.version_text(_compat.parse_torch_version(raw), raw) == shown


def test_revert_all_restores_a_copy_of_a_wrapper_wrapped_again(monkeypatch):
    """A wraps ``torch.a.f``; ``torch.b`` copies ``f`` after that (as ``torch.distributed.fsdp`` re-exports
    ``fully_shard``); B wraps both places. One ``revert_all`` gives both places torch's object back."""
    import sys
    import types

    monkeypatch.setattr(_patching, "_applied", {})
    monkeypatch.setattr(_patching, "_ours", {})
    monkeypatch.setattr(_patching, "_forgetting", {})
    module_a, module_b = types.ModuleType("torch._autopatch_test_a"), types.ModuleType("torch._autopatch_test_b")
    monkeypatch.setitem(sys.modules, module_a.__name__, module_a)
    monkeypatch.setitem(sys.modules, module_b.__name__, module_b)

    def original():
        return "torch"

    def wrapper_a():
        return "A"

    def wrapper_b():
        return "B"

    module_a.f = original
    _patching.replace_all("A", [(module_a, "f", wrapper_a)])
    module_b.f = module_a.f
    _patching.replace_all("B", [(module_a, "f", wrapper_b), (module_b, "f", wrapper_b)])
    _patching.revert_all()
    assert (module_a.f, module_b.f) == (original, original)
