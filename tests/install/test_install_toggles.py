"""Environment toggles and bad values, in the installed wheel, through the real start-up path.

Each case is one fresh interpreter of the torch venv running the probe (it imports torch's FSDP2,
never fsdp_autopatch). The toggles are read when the hook runs, so every case needs its own
process; ``import torch.distributed.fsdp`` costs seconds, so the cases run side by side once per
module (``runs``) and the tests below only check the results.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest

from _install_support import (
    DEFAULT_STATUSES,
    PATCH_NAMES,
    T_TORCH,
    Venv,
    applied_entries,
    assert_torch_matches_registry,
    config_warnings,
    describe,
    expected_wrappers,
    json_from,
    probe_code,
    reasons,
    statuses,
    statuses_with,
)

pytestmark = [pytest.mark.install, pytest.mark.timeout(2400)]  # first use may build the torch venv


def var(name: str) -> str:
    return f"FSDP_AUTOPATCH_{name.upper()}_ENABLED"


class Case(NamedTuple):
    env: Mapping[str, str]
    pre: str = ""  # code the program runs before importing torch


# Booleans are spelled differently on purpose: 1/true/yes/on, 0/false/no/off, any case, stripped;
# the patches take them in turn (the catalogue's order), so a new patch gets one too.
OFF_VALUES = ("0", "false", "No", " off ", "FALSE", "oFf", " 0", "NO ")
OFF_SPELLINGS = {name: OFF_VALUES[i % len(OFF_VALUES)] for i, name in enumerate(PATCH_NAMES)}

CASES = {
    **{f"off:{name}": Case({var(name): OFF_SPELLINGS[name]}) for name in PATCH_NAMES},
    "list": Case({"FSDP_AUTOPATCH_DISABLED": "accumulated_grad_guard, restore_unused_param_grads"}),
    "list-star": Case({"FSDP_AUTOPATCH_DISABLED": "*"}),
    "kill-switch": Case({"FSDP_AUTOPATCH_ENABLED": "0"}),
    # precedence: kill switch > per-patch variable > list > default
    "per-patch-beats-list": Case(
        {"FSDP_AUTOPATCH_DISABLED": "uniform_reduce_dtype", var("uniform_reduce_dtype"): "1"}
    ),
    "per-patch-beats-star": Case({"FSDP_AUTOPATCH_DISABLED": "*", var("accumulated_grad_guard"): "TRUE"}),
    "kill-switch-beats-per-patch": Case(
        {"FSDP_AUTOPATCH_ENABLED": "off", var("accumulated_grad_guard"): "1", var("uniform_reduce_dtype"): "on"}
    ),
    # read when torch's FSDP2 is imported, so a launcher can still set them after start-up
    "kill-switch-set-late": Case({}, pre="import os; os.environ['FSDP_AUTOPATCH_ENABLED'] = '0'"),
    "per-patch-set-late": Case({}, pre=f"import os; os.environ[{var('uniform_reduce_dtype')!r}] = 'no'"),
    # bad values: warn once each, keep the default, raise nothing
    "bad-values": Case(
        {
            var("accumulated_grad_guard"): "maybe",
            "FSDP_AUTOPATCH_DISABLED": "uniform_reduce_dtype,no_such_patch",
            "FSDP_AUTOPATCH_FOO": "1",
            "FSDP_AUTOPATCH_ENABLED": "perhaps",
        }
    ),
    # ... even when the user turns warnings into errors
    # (a filter in the program rather than `python -W error`: torch's own import warns here, no numpy)
    "bad-values-warnings-as-errors": Case(
        {var("accumulated_grad_guard"): "maybe"},
        pre="import warnings; warnings.filterwarnings('error', message='.*FSDP_AUTOPATCH_')",
    ),
}


@pytest.fixture(scope="module")
def runs(torch_venv: Venv) -> dict[str, subprocess.CompletedProcess]:
    def one(case: Case) -> subprocess.CompletedProcess:
        return torch_venv.py(probe_code(case.pre), env=case.env, timeout=T_TORCH)

    # 3 at a time: a torch import is part CPU, part file system; more would only queue on 2 cores.
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(one, case) for name, case in CASES.items()}
        return {name: future.result() for name, future in futures.items()}


def probe_of(runs: Mapping[str, subprocess.CompletedProcess], case: str) -> dict:
    result = runs[case]
    probe = json_from(result)
    assert probe["loaded"] and probe["status"]["bootstrap"] == "pth", probe
    assert "Traceback" not in result.stderr, describe(result)
    assert_torch_matches_registry(probe)  # torch is patched exactly where the registry says so
    return probe


def expect(**changes: str) -> dict[str, str]:
    return statuses_with(**changes)


def silent(result: subprocess.CompletedProcess) -> bool:
    return "fsdp-autopatch" not in result.stderr


@pytest.mark.parametrize("name", PATCH_NAMES)
def test_per_patch_variable_disables_only_that_patch(runs, name: str) -> None:
    probe = probe_of(runs, f"off:{name}")
    assert statuses(probe["status"]) == expect(**{name: "disabled"})
    assert var(name) in reasons(probe["status"])[name]
    assert silent(runs[f"off:{name}"]), describe(runs[f"off:{name}"])


def test_disabled_list(runs) -> None:
    probe = probe_of(runs, "list")
    assert statuses(probe["status"]) == expect(
        accumulated_grad_guard="disabled", restore_unused_param_grads="disabled"
    )
    assert "FSDP_AUTOPATCH_DISABLED" in reasons(probe["status"])["accumulated_grad_guard"]


def test_disabled_list_star(runs) -> None:
    probe = probe_of(runs, "list-star")
    assert set(statuses(probe["status"]).values()) == {"disabled"}


def test_kill_switch_disables_everything_and_leaves_torch_untouched(runs) -> None:
    probe = probe_of(runs, "kill-switch")
    assert set(statuses(probe["status"]).values()) == {"disabled"}
    assert all("FSDP_AUTOPATCH_ENABLED" in r for r in reasons(probe["status"]).values())
    assert set(probe["patched"].values()) == {0}
    assert not probe["wrapt_loaded"], "with the kill switch at start-up nothing may be armed"


def test_per_patch_variable_beats_the_list(runs) -> None:
    probe = probe_of(runs, "per-patch-beats-list")
    assert statuses(probe["status"]) == DEFAULT_STATUSES


def test_per_patch_variable_beats_the_star(runs) -> None:
    probe = probe_of(runs, "per-patch-beats-star")
    # "*" disables every patch but the one its own variable turns back on
    others = {name: "disabled" for name in PATCH_NAMES if name != "accumulated_grad_guard"}
    assert statuses(probe["status"]) == expect(**others)


def test_kill_switch_beats_per_patch_variables(runs) -> None:
    probe = probe_of(runs, "kill-switch-beats-per-patch")
    assert set(statuses(probe["status"]).values()) == {"disabled"}
    assert set(probe["patched"].values()) == {0}


def test_variables_are_read_when_fsdp2_is_imported(runs) -> None:
    late_kill = probe_of(runs, "kill-switch-set-late")
    assert set(statuses(late_kill["status"]).values()) == {"disabled"}
    # no fix or guard wraps anything; a policy follows its own variable only (_config's Settings.decision,
    # docs/configuration.md): the cross-rank check, on by default, keeps its wrapper of FSDPState._lazy_init
    assert late_kill["patched"] == expected_wrappers(applied_entries(late_kill["status"]))
    assert set(expected_wrappers(statuses(late_kill["status"])).values()) == {0}
    late_one = probe_of(runs, "per-patch-set-late")
    assert statuses(late_one["status"]) == expect(uniform_reduce_dtype="disabled")


def test_bad_values_warn_once_each_and_keep_the_default(runs) -> None:
    result = runs["bad-values"]
    probe = probe_of(runs, "bad-values")
    assert result.returncode == 0
    # the unparsable per-patch value is ignored: the default (on) stays; the known name in the
    # list still counts; the bad kill switch keeps its default (on)
    assert statuses(probe["status"]) == expect(uniform_reduce_dtype="disabled")
    warnings = config_warnings(result.stderr)
    guard = [w for w in warnings if var("accumulated_grad_guard") + "=" in w]
    assert len(guard) == 1 and "'maybe'" in guard[0], result.stderr
    assert len([w for w in warnings if "no_such_patch" in w]) == 1, result.stderr
    assert len([w for w in warnings if "FSDP_AUTOPATCH_FOO" in w]) == 1, result.stderr
    assert len([w for w in warnings if "FSDP_AUTOPATCH_ENABLED=" in w and "'perhaps'" in w]) == 1, result.stderr
    assert len(warnings) == 4, warnings


def test_bad_values_do_not_raise_under_warnings_as_errors(runs) -> None:
    result = runs["bad-values-warnings-as-errors"]
    probe = probe_of(runs, "bad-values-warnings-as-errors")
    assert statuses(probe["status"]) == DEFAULT_STATUSES
    warnings = config_warnings(result.stderr)
    assert len(warnings) == 1 and var("accumulated_grad_guard") in warnings[0], result.stderr
