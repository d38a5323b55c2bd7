"""Fixtures shared by the unit tests."""

import pytest


@pytest.fixture
def registry(monkeypatch):
    """A fresh registry where patches count their fires (``_events``) and call-time failures
    (``_isolation``), so that a test reads only its own. A test module may define its own."""
    from fsdp_autopatch import _events, _isolation
    from fsdp_autopatch._registry import Registry

    fresh = Registry()
    monkeypatch.setattr(_events, "REGISTRY", fresh)
    monkeypatch.setattr(_isolation, "REGISTRY", fresh)
    return fresh


@pytest.fixture
def fake_mesh():
    """FSDP2 on the fake backend in this process: 4 fake ranks and their 1-D CPU mesh (its
    collectives return no peer's data). Skipped where a process group already exists."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def apply_patch(registry):
    """``apply_patch(module)``: the patch module's ``PATCH`` applied (by the .pth hook already, or
    here), its fires and call-time failures counted in the test's fresh ``registry`` (returned);
    reverted afterwards if applied here."""
    from fsdp_autopatch import _isolation, _patching

    used: dict[str, bool] = {}  # patch name -> applied here (to revert)

    def apply(module):
        used[module.NAME] = not _patching.is_applied(module.NAME)
        if used[module.NAME]:
            _patching.apply(module.PATCH)
        return registry

    try:
        yield apply
    finally:
        for name, applied_here in used.items():
            if applied_here:
                _patching.revert(name)
            _isolation.forget(name)
