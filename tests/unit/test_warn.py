"""Our warnings as a user reads them (``_warn``): the plugin named once, at the user's own line,
printed by the first rank of each node only (``FSDP_AUTOPATCH_WARN_ALL_RANKS=1``: every rank)."""

from __future__ import annotations

import inspect
import warnings

import pytest

from fsdp_autopatch import _config, _warn
from fsdp_autopatch.patches import _pending_grads


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv(_config.WARN_ALL_RANKS, raising=False)
    _pending_grads.forget()
    yield
    _pending_grads.forget()


def _caught(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return caught


def test_the_pending_grads_warning_names_the_plugin_once_at_the_users_line():
    line = inspect.currentframe().f_lineno + 1
    caught = _caught(lambda: _pending_grads.warn_once("zero_grad", "SGD.zero_grad() left ..."))
    (warning,) = caught
    # the lambda above is the user's call site (its zero_grad()): the warning passes through our module
    assert (warning.filename, warning.lineno) == (__file__, line)
    text = warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno, "")
    assert text.startswith(f"{__file__}:{line}: UserWarning: fsdp-autopatch: SGD.zero_grad() left ...")
    assert text.count("fsdp-autopatch") == 1 and "fsdp-autopatch:0" not in text


@pytest.mark.parametrize("local_rank", ["1", "7"])
def test_a_second_rank_stays_silent_unless_every_rank_may_print(monkeypatch, local_rank):
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    caught = _caught(lambda: _pending_grads.warn_once("step", "SGD.step() ran ..."))
    assert caught == []
    caught = _caught(lambda: _config.warn("FSDP_AUTOPATCH_TEST_SILENT", "a bad value"))
    assert caught == []
    monkeypatch.setenv(_config.WARN_ALL_RANKS, "1")
    _pending_grads.forget()
    caught = _caught(lambda: _pending_grads.warn_once("step", "SGD.step() ran ..."))
    assert [str(w.message) for w in caught] == ["fsdp-autopatch: SGD.step() ran ..."]


def test_the_first_rank_and_a_process_without_a_launcher_print():
    assert _config.prints_here({}) and _config.prints_here({"LOCAL_RANK": "0"})
    assert not _config.prints_here({"LOCAL_RANK": "1"})
    assert _config.prints_here({"LOCAL_RANK": "1", _config.WARN_ALL_RANKS: "1"})


def test_warnings_as_errors_still_never_raise(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn.warn("fsdp-autopatch: under -W error")
    assert "UserWarning: fsdp-autopatch: under -W error" in capsys.readouterr().err


def test_parameter_names_are_sorted():
    from fsdp_autopatch import _events

    class P:
        def __init__(self, name):
            self._param_fqn = name

    assert _events.param_names([P("b.weight"), P("a.weight"), P("a.bias")]) == "a.bias, a.weight, b.weight"
