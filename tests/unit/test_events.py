"""Fire counts and the first-fire log line (``_events``), and ``--version``."""

import logging
import subprocess
import sys

import pytest

from fsdp_autopatch import _events, _registry
from fsdp_autopatch._registry import Registry


@pytest.fixture
def registry(monkeypatch):
    fresh = Registry()
    monkeypatch.setattr(_events, "REGISTRY", fresh)
    return fresh


def test_counts_start_at_zero_and_go_to_the_json_form(registry):
    assert {record.fired for record in registry.snapshot().patches} == {0}
    _events.fired("uniform_reduce_dtype", "AssertionError: ...")
    _events.fired("uniform_reduce_dtype", "AssertionError: ...")
    report = registry.snapshot()
    assert report["uniform_reduce_dtype"].fired == 2
    assert report.to_dict()["patches"][2]["fired"] == 2
    assert report["accumulated_grad_guard"].fired == 0


def test_the_first_fire_logs_once_at_info_and_later_ones_at_debug(registry, caplog):
    caplog.set_level(logging.DEBUG, logger="fsdp_autopatch")
    for _ in range(3):
        _events.fired("restore_unused_param_grads", "an exact-zero gradient", "parameter experts.2.weight")
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    debugs = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert [r.getMessage() for r in infos] == [
        "restore_unused_param_grads fired: an exact-zero gradient (parameter experts.2.weight)"
    ]
    assert len(debugs) == 2


def test_reset_clears_the_counts(registry):
    _events.fired("accumulated_grad_guard", "AttributeError")
    registry.reset()
    assert registry.snapshot()["accumulated_grad_guard"].fired == 0


def test_long_places_are_shortened():
    class Param:
        def __init__(self, fqn):
            self._param_fqn = fqn

    names = _events.param_names([Param(f"layers.{i}.weight") for i in range(10)])
    assert names == "layers.0.weight, layers.1.weight, layers.2.weight, layers.3.weight, +6 more"
    assert _events.shorten("x" * 500).endswith("[500 characters]")


@pytest.mark.parametrize("command", [["-m", "fsdp_autopatch", "--version"]])
def test_version_flag(command):
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"fsdp-autopatch {_registry.__version__}"
