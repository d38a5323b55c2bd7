"""The pending-gradients policies in one process (``patches._pending_grads``): the settings that
decide them, the warning that never raises, and the loop that keeps nothing. Their behaviour on
gloo ranks: ``tests/distributed/test_dist_pending_grads.py``."""

from __future__ import annotations

import warnings

from fsdp_autopatch import _config
from fsdp_autopatch.patches import _pending_grads

WARNING, DISCARD = _pending_grads.WARNING, _pending_grads.DISCARD


def policies(**environ):
    return _config.read_settings(environ=environ, warn=lambda *_: None).policies


def test_the_warning_is_on_and_the_discarding_off_by_default():
    assert (policies()[WARNING], policies()[DISCARD]) == (True, False)
    got = policies(FSDP_AUTOPATCH_PENDING_GRADS_WARNING="0", FSDP_AUTOPATCH_ZERO_GRAD_DISCARDS_PENDING="1")
    assert (got[WARNING], got[DISCARD]) == (False, True)


def test_the_kill_switch_turns_the_warning_off_but_not_the_cross_rank_check_or_a_variable_set():
    off = _config.read_settings(environ={"FSDP_AUTOPATCH_ENABLED": "0"}, warn=lambda *_: None)
    assert off.policies[WARNING] is False and off.policies["cross_rank_check"] is True
    assert off.decision(WARNING).describe() == "FSDP_AUTOPATCH_ENABLED=0"
    asked = policies(FSDP_AUTOPATCH_ENABLED="0", FSDP_AUTOPATCH_ZERO_GRAD_DISCARDS_PENDING="1",
                     FSDP_AUTOPATCH_PENDING_GRADS_WARNING="1")
    assert asked[DISCARD] and asked[WARNING]


def test_the_warning_is_given_once_per_kind_and_never_raises_under_w_error(capsys):
    _pending_grads.forget()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _pending_grads.warn_once("zero_grad", "kept gradients")
        _pending_grads.warn_once("zero_grad", "kept gradients")
    assert capsys.readouterr().err.count("UserWarning: fsdp-autopatch: kept gradients") == 1  # the plugin named once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _pending_grads.warn_once("step", "sync left off")
    assert [str(w.message) for w in caught] == ["fsdp-autopatch: sync left off"]
    _pending_grads.forget()


def test_nothing_kept_means_nothing_looked_up():
    _pending_grads.forget()

    class Params:
        def __iter__(self):
            raise AssertionError("iterated although no unit keeps gradients")

    assert _pending_grads.pending_in(Params()) == []
