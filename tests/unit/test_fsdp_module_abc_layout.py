"""fsdp_module_abc_layout in one process: which classes get a class of ours, and what it is like."""

from __future__ import annotations

import abc
import copy

import pytest
import torch.nn as nn

pytest.importorskip("torch.distributed.fsdp")

from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.fsdp._fully_shard import _fully_shard as torch_fully_shard  # noqa: E402

from fsdp_autopatch.patches import fsdp_module_abc_layout as patch  # noqa: E402


class AbcFirst(abc.ABC, nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        return super().__call__  # a super() call in the user's class keeps working (see below)


class ModuleFirst(nn.Module, abc.ABC):
    pass


def prepare(cls: type) -> dict:
    cache: dict = {}
    patch._prepare(cls, cache, FSDPModule, torch_fully_shard._unimplemented_deepcopy)
    return cache


def torch_class(cls: type) -> type:
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": torch_fully_shard._unimplemented_deepcopy})


def test_the_structural_check_finds_torchs_class_cache():
    assert patch._structural_check().status == "needed"


def test_an_abc_first_class_gets_a_class_with_torchs_mro_and_its_own_layout():
    cache = prepare(AbcFirst)
    ours = cache[AbcFirst]
    assert ours.__mro__[1:] == torch_class(AbcFirst).__mro__[1:]  # FSDPModule, AbcFirst, ABC, Module, object
    assert ours.__name__ == "FSDPAbcFirst"
    module = AbcFirst()
    with pytest.raises(TypeError, match="layout differs"):
        module.__class__ = torch_class(AbcFirst)  # the bug, as torch meets it
    module.__class__ = ours
    assert isinstance(module, FSDPModule) and isinstance(module, AbcFirst)
    assert module.fc.weight.shape == (2, 2)  # the instance is untouched
    with pytest.raises(AssertionError, match="deepcopy"):
        copy.deepcopy(module)  # torch's __deepcopy__


@pytest.mark.parametrize("cls", [nn.Linear, ModuleFirst], ids=["Linear", "ModuleFirst"])
def test_a_class_torch_handles_is_left_to_torch(cls):
    assert prepare(cls) == {}


def test_a_class_already_in_the_cache_or_already_fsdp_is_left_alone():
    cache = {AbcFirst: "torch's"}
    patch._prepare(AbcFirst, cache, FSDPModule, None)
    assert cache == {AbcFirst: "torch's"}
    assert prepare(patch._prepare.__class__) == {}  # not a module class: nothing to do
    assert prepare(torch_class(nn.Linear)) == {}  # an FSDP class already


def test_the_modules_of_a_call_are_one_module_or_a_list():
    first, second = nn.Linear(1, 1), nn.ReLU()
    assert patch._classes_of(first) == [nn.Linear]
    assert patch._classes_of([first, second, nn.Linear(2, 2)]) == [nn.Linear, nn.ReLU]


def test_revert_gives_the_public_re_export_torchs_function_back():
    """torch.distributed.fsdp copies fully_shard from the package our hook runs in, after we wrapped it."""
    import torch.distributed.fsdp as fsdp

    from fsdp_autopatch import _activate, _patching

    if not _patching.is_applied(patch.NAME):
        pytest.skip("the patch is not applied in this process")
    assert fsdp.fully_shard is torch_fully_shard.fully_shard  # one object: our wrapper, everywhere
    wrapper = fsdp.fully_shard
    try:
        _activate.revert_all()
        assert fsdp.fully_shard is torch_fully_shard.fully_shard is not wrapper
        assert not hasattr(fsdp.fully_shard, "__wrapped__") or fsdp.fully_shard.__wrapped__ is not wrapper
    finally:
        _activate.activate()
    assert fsdp.fully_shard is torch_fully_shard.fully_shard
