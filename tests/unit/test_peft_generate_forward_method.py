"""peft_generate_forward_method in one process: the structural check on this torch, and which modules
get an instance ``generate`` at ``fully_shard`` (stand-in classes: one whose ``generate`` is defined in
the ``peft`` package, one whose is not). The routing itself needs a process group: 2 gloo ranks in
``tests/distributed/test_dist_peft_generate_forward_method.py`` and the case."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.fsdp  # noqa: E402,F401,F811  (fires the post-import hook if the .pth is active)

from fsdp_autopatch.patches import peft_generate_forward_method as patch  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _generate(self, *args, **kwargs):
    """A stand-in for PEFT's generate: calls the wrapped model's."""
    return self.wrapped.generate(*args, **kwargs)


_peft_generate = type(_generate)(_generate.__code__, globals(), "generate")
_peft_generate.__module__ = "peft.peft_model"  # what makes it PEFT's own


class PeftLike(torch.nn.Module):
    generate = _peft_generate


class PeftSubclass(PeftLike):  # a user's subclass that keeps PEFT's generate
    pass


class PlainModel(torch.nn.Module):
    def generate(self, x):  # a transformers-like generate: calls the module itself
        return self(x)


def test_the_check_finds_fsdp2_forward_method_machinery_here():
    verdict = patch._structural_check()
    assert verdict.status == "needed", verdict


@pytest.mark.parametrize(("cls", "peft"), [(PeftLike, True), (PeftSubclass, True), (PlainModel, False)])
def test_only_a_peft_generate_is_taken(cls, peft):
    module = cls()
    assert (patch.peft_generate(module) is _peft_generate) is peft
    if peft:
        module.generate = lambda *a, **k: None  # registered by hand, or installed already: left alone
        assert patch.peft_generate(module) is None


def test_an_installed_generate_passes_through_where_the_patch_is_not_active(monkeypatch):
    """Reverted or failed: PEFT's generate as it came, no FSDP2 state touched (a stand-in state that
    would raise if its hooks ran)."""

    class Wrapped:
        def generate(self, *args, **kwargs):
            return ("wrapped", args, kwargs)

    class NoHooks:
        def __getattr__(self, name):
            raise AssertionError(f"the state's {name} was read")

    module = PeftLike()
    module.wrapped = Wrapped()
    patch.install(module, NoHooks(), _peft_generate)
    assert module.generate.__name__ == "generate" and module.generate.__fsdp_autopatch_patch__ == patch.NAME
    monkeypatch.setattr(patch, "is_active", lambda: False)
    assert module.generate(1, max_new_tokens=2) == ("wrapped", (1,), {"max_new_tokens": 2})
