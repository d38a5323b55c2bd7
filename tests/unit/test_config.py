"""Environment variables -> settings: spelling, precedence, and a warning for every bad value."""

import pytest

from fsdp_autopatch import _config
from fsdp_autopatch._config import Decision, parse_bool, patch_env_var, read_settings
from fsdp_autopatch.patches import PATCH_NAMES


class Warnings:
    """Collects (variable, message) pairs instead of writing to stderr."""

    def __init__(self):
        self.seen = []

    def __call__(self, variable, message):
        self.seen.append((variable, message))

    @property
    def variables(self):
        return [variable for variable, _ in self.seen]


def settings_for(**environ):
    warnings = Warnings()
    return read_settings(environ, warn=warnings), warnings


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", " yes ", "On"])
def test_truthy_spellings(raw):
    assert parse_bool(raw) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "no", " OFF "])
def test_falsy_spellings(raw):
    assert parse_bool(raw) is False


@pytest.mark.parametrize("raw", ["", "2", "enable", "y", "nope", None])
def test_other_values_are_not_booleans(raw):
    assert parse_bool(raw) is None


def test_defaults_enable_every_patch_and_nothing_else():
    settings, warnings = settings_for()
    assert settings.enabled and not settings.strict and settings.log_level is None
    assert not settings.decision("reduce_scatter_unused_params_default_on").enabled
    assert all(settings.decision(name) == Decision(True) for name in PATCH_NAMES)
    assert warnings.seen == []


def test_per_patch_variable_disables_only_that_patch():
    settings, _ = settings_for(FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED="off")
    assert settings.decision("uniform_reduce_dtype") == Decision(
        False, "FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED", "off"
    )
    assert settings.decision("uniform_reduce_dtype").describe() == "FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED=off"
    assert settings.decision("accumulated_grad_guard").enabled is True


def test_disabled_list_and_star():
    settings, _ = settings_for(FSDP_AUTOPATCH_DISABLED="accumulated_grad_guard, restore_unused_param_grads")
    enabled = {name: settings.decision(name).enabled for name in PATCH_NAMES}
    off = ("accumulated_grad_guard", "restore_unused_param_grads")
    assert enabled == {name: name not in off for name in PATCH_NAMES}
    settings, _ = settings_for(FSDP_AUTOPATCH_DISABLED="*")
    assert not any(settings.decision(name).enabled for name in PATCH_NAMES)


def test_precedence_kill_switch_over_per_patch_over_list():
    settings, _ = settings_for(
        FSDP_AUTOPATCH_ENABLED="0", FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED="1"
    )
    assert settings.decision("uniform_reduce_dtype") == Decision(False, "FSDP_AUTOPATCH_ENABLED", "0")
    settings, _ = settings_for(
        FSDP_AUTOPATCH_DISABLED="uniform_reduce_dtype", FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED="yes"
    )
    assert settings.decision("uniform_reduce_dtype").enabled is True
    settings, _ = settings_for(FSDP_AUTOPATCH_DISABLED="*", FSDP_AUTOPATCH_ACCUMULATED_GRAD_GUARD_ENABLED="1")
    assert settings.decision("accumulated_grad_guard").enabled is True
    assert settings.decision("uniform_reduce_dtype").enabled is False


def test_bad_boolean_keeps_default_and_warns_naming_the_variable():
    variable = patch_env_var("accumulated_grad_guard")
    settings, warnings = settings_for(**{variable: "maybe"})
    assert settings.decision("accumulated_grad_guard").enabled is True
    assert warnings.variables == [variable]
    assert "maybe" in warnings.seen[0][1]


def test_bad_per_patch_value_falls_back_to_the_list():
    settings, warnings = settings_for(
        FSDP_AUTOPATCH_DISABLED="uniform_reduce_dtype", FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED="perhaps"
    )
    assert settings.decision("uniform_reduce_dtype").enabled is False
    assert warnings.variables == ["FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED"]


def test_bad_kill_switch_keeps_everything_on():
    settings, warnings = settings_for(FSDP_AUTOPATCH_ENABLED="disable")
    assert settings.enabled and all(settings.decision(n).enabled for n in PATCH_NAMES)
    assert warnings.variables == ["FSDP_AUTOPATCH_ENABLED"]


def test_strict_and_policy_and_log_level():
    settings, warnings = settings_for(
        FSDP_AUTOPATCH_STRICT="1", FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS="true", FSDP_AUTOPATCH_LOG_LEVEL="debug"
    )
    assert settings.strict and settings.log_level == "DEBUG"
    assert settings.decision("reduce_scatter_unused_params_default_on").enabled
    assert warnings.seen == []
    settings, warnings = settings_for(FSDP_AUTOPATCH_LOG_LEVEL="loud")
    assert settings.log_level is None and warnings.variables == ["FSDP_AUTOPATCH_LOG_LEVEL"]


def test_unknown_patch_name_in_list_warns():
    settings, warnings = settings_for(FSDP_AUTOPATCH_DISABLED="uniform_reduce_dtype,unifrom_reduce_dtype")
    assert settings.decision("uniform_reduce_dtype").enabled is False
    assert warnings.variables == ["FSDP_AUTOPATCH_DISABLED"]
    assert "unifrom_reduce_dtype" in warnings.seen[0][1]
    assert "did you mean uniform_reduce_dtype?" in warnings.seen[0][1]
    _, warnings = settings_for(FSDP_AUTOPATCH_DISABLED="bogus")
    assert "did you mean" not in warnings.seen[0][1]  # nothing close: no guess


def test_the_known_names_in_a_warning_stay_bounded_as_the_catalogue_grows():
    """Third-party entries add names without limit: the warning lists what fits and points to status."""
    names = tuple(f"vendor_patch_number_{i:02d}" for i in range(40))
    listed = _config._bounded_list(names)
    assert listed.startswith("vendor_patch_number_00, vendor_patch_number_01")
    assert len(listed) < 400 and "more (python -m fsdp_autopatch status lists all)" in listed
    assert _config._bounded_list(names[:3]) == ", ".join(names[:3])  # short lists are shown whole


def test_unknown_variable_warns_with_a_suggestion():
    settings, warnings = settings_for(FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLE="0")
    assert settings.decision("uniform_reduce_dtype").enabled is True  # the typo changes nothing
    assert warnings.variables == ["FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLE"]
    assert "did you mean FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED" in warnings.seen[0][1]


def test_real_warning_is_emitted_once_per_variable(monkeypatch, recwarn):
    monkeypatch.setattr(_config, "_warned", set())
    environ = {"FSDP_AUTOPATCH_STRICT": "sometimes"}
    read_settings(environ)
    read_settings(environ)
    messages = [str(w.message) for w in recwarn if issubclass(w.category, _config.ConfigWarning)]
    assert len(messages) == 1 and "FSDP_AUTOPATCH_STRICT" in messages[0]


def test_warning_never_raises_under_warnings_as_errors(monkeypatch, capsys):
    import warnings

    monkeypatch.setattr(_config, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_settings({"FSDP_AUTOPATCH_STRICT": "sometimes"})
    assert "FSDP_AUTOPATCH_STRICT" in capsys.readouterr().err


def test_kill_switch_off_is_silent_and_strict():
    assert _config.kill_switch_off({"FSDP_AUTOPATCH_ENABLED": "0"})
    assert _config.kill_switch_off({"FSDP_AUTOPATCH_ENABLED": "No"})
    assert not _config.kill_switch_off({"FSDP_AUTOPATCH_ENABLED": "garbage"})
    assert not _config.kill_switch_off({})


def test_unknown_name_next_to_star_still_warns():
    settings, warnings = settings_for(FSDP_AUTOPATCH_DISABLED="*,bogus")
    assert not any(settings.decision(name).enabled for name in PATCH_NAMES)
    assert warnings.variables == ["FSDP_AUTOPATCH_DISABLED"] and "bogus" in warnings.seen[0][1]
