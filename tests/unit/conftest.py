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
