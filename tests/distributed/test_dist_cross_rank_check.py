"""The cross-rank check: ranks that disagree about the patches stop at the first forward.

Rank 1 gets a different environment, as a node with its own environment would. Every case
must end in an explicit error on the checking ranks (never a hang, never silently mixed
collectives), and a consistent job must pay one store comparison per process group.
"""

from __future__ import annotations

import pytest

import _dist_checks as ck
from _dist_launcher import run_ranks

pytestmark = pytest.mark.timeout(300)

SHORT_PG_TIMEOUT = "10"  # the silent-rank case waits for the store's (= the group's) timeout


@pytest.fixture(scope="module")
def consistent():
    return run_ranks("cross_rank_check")


@pytest.fixture(scope="module")
def one_patch_off_on_rank_1():
    return run_ranks("cross_rank_check", rank_env={1: {ck.ENV["restore_unused_param_grads"]: "0"}})


@pytest.fixture(scope="module")
def plugin_off_on_rank_1():
    return run_ranks(
        "cross_rank_check",
        env={"FSDP_DIST_PG_TIMEOUT_S": SHORT_PG_TIMEOUT},
        rank_env={1: {"FSDP_AUTOPATCH_ENABLED": "0"}},
    )


@pytest.fixture(scope="module")
def check_off():
    return run_ranks(
        "cross_rank_check",
        env={"FSDP_AUTOPATCH_CROSS_RANK_CHECK": "0"},
        rank_env={1: {ck.ENV["restore_unused_param_grads"]: "0"}},
    )


def test_consistent_job_checks_once_per_process_group(consistent):
    consistent.assert_clean()
    for rank in consistent.ranks:
        # two models and four forwards on one process group: one comparison
        assert rank.cases["first_model"]["checks"] == 1
        assert rank.cases["second_model"]["checks"] == 1
        assert "cross_rank_check" in rank.autopatch["policies"], rank.autopatch
    grads = ck.case_grads(consistent, "second_model")
    assert all(g is not None for g in grads.values())


def test_a_patch_disabled_on_one_rank_stops_every_rank(one_patch_off_on_rank_1):
    run = one_patch_off_on_rank_1
    assert not run.timed_out, run.describe()
    for rank in run.ranks:
        err = ck.error_of(rank, "first_model")
        assert err is not None and err["type"] == "CrossRankMismatch", run.describe()
        assert "ranks disagree" in err["message"], err["message"]
        assert "restore_unused_param_grads: applied on rank 0, disabled on rank 1" in err["message"], err["message"]
        assert "FSDP_AUTOPATCH_CROSS_RANK_CHECK=0" in err["message"]
        assert "_lazy_init" in err["traceback"]  # at the first forward, before any FSDP2 collective
        assert "second_model" not in rank.cases


def test_a_rank_without_the_plugin_is_named_after_the_group_timeout(plugin_off_on_rank_1):
    run = plugin_off_on_rank_1
    assert not run.timed_out, run.describe()
    err = ck.error_of(run[0], "first_model")
    assert err is not None and err["type"] == "CrossRankMismatch", run.describe()
    assert "rank 1 of process group" in err["message"] and "never reported" in err["message"], err["message"]
    assert "FSDP_AUTOPATCH_ENABLED=0" in err["message"]
    # rank 1 ran no check; its first all-gather loses its peer instead of hanging
    assert run[1].autopatch["bootstrap"] in ("pth", "not_run")
    err1 = ck.error_of(run[1], "first_model")
    assert err1 is not None, run.describe()


def test_check_switched_off_costs_nothing(check_off):
    """FSDP_AUTOPATCH_CROSS_RANK_CHECK=0: no comparison at all (here the collectives still match:
    the restore patch only adds one for units with the unused-param fill on)."""
    check_off.assert_clean()
    for rank in check_off.ranks:
        assert rank.cases["second_model"]["checks"] == 0
        assert "cross_rank_check" not in rank.autopatch["policies"]


def test_a_check_after_revert_and_activate_compares_fresh_fingerprints():
    """Reverting and activating again on every rank (another patch off) starts a new comparison:
    the store still holds the first round's keys, which must not end the second round's wait."""
    run = run_ranks("cross_rank_check:after_revert")
    run.assert_clean()
    for rank in run.ranks:
        assert rank.cases["first_model"]["checks"] == 1
        second = rank.cases["second_model"]
        assert second["error"] is None, second["error"]
        assert second["keep_param_attributes"] == "disabled"
        assert second["checks"] == 2  # compared again, and agreed
    grads = ck.case_grads(run, "second_model")
    assert all(g is not None for g in grads.values())
