"""Environment variables -> settings, with a clear warning for every bad value.

Stdlib only and cheap: the bootstrap imports this module at interpreter start when the kill
switch variable is set; everything else here runs when torch's FSDP2 is imported, so a launcher can set the
variables after the interpreter started.

Precedence for one patch: ``FSDP_AUTOPATCH_ENABLED`` (kill switch) > ``FSDP_AUTOPATCH_<NAME>_ENABLED``
> ``FSDP_AUTOPATCH_DISABLED`` (list, ``*`` = all) > default (on).
"""

import os
import sys

from . import _catalogue

# The bootstrap imports this module at interpreter start when FSDP_AUTOPATCH_ENABLED is set, where
# it may load nothing outside this package: so no `typing` (TYPE_CHECKING is False at run time) and
# no `from __future__ import annotations` (that statement imports the `__future__` module, ~0.3 ms and one more entry in
# sys.modules; bench/startup.py). Annotations that Python 3.9 cannot evaluate are strings instead.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Callable

PREFIX = _catalogue.PREFIX
KILL_SWITCH = "FSDP_AUTOPATCH_ENABLED"
DISABLED_LIST = "FSDP_AUTOPATCH_DISABLED"
STRICT = "FSDP_AUTOPATCH_STRICT"
LOG_LEVEL = "FSDP_AUTOPATCH_LOG_LEVEL"
THIRD_PARTY = "FSDP_AUTOPATCH_THIRD_PARTY"
# By default only the first rank of each node (LOCAL_RANK 0) prints our warnings; 1: every rank.
WARN_ALL_RANKS = "FSDP_AUTOPATCH_WARN_ALL_RANKS"

# Each policy's own switch (a policy keeps the variable users know; fixes and guards derive theirs),
# from the catalogue.
POLICY_VARIABLES = {name: _catalogue.BY_NAME[name].toggle for name in _catalogue.POLICIES}
REDUCE_SCATTER_UNUSED_PARAMS = POLICY_VARIABLES["reduce_scatter_unused_params_default_on"]
CROSS_RANK_CHECK = POLICY_VARIABLES["cross_rank_check"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# One warning per variable per process, however often the settings are read.
_warned: "set[str]" = set()


class ConfigWarning(UserWarning):
    """A ``FSDP_AUTOPATCH_*`` variable has a value or name that fsdp-autopatch does not understand."""


def patch_env_var(name: str) -> str:
    """The variable that switches one patch on or off, e.g. ``FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED``."""
    return _catalogue.toggle_for(name)


def parse_bool(value: "str | None") -> "bool | None":
    """``1/true/yes/on`` -> True, ``0/false/no/off`` -> False (any case, stripped); else None."""
    if value is None:
        return None
    value = value.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    return None


def kill_switch_off(environ: "Mapping[str, str]" = os.environ) -> bool:  # noqa: B008
    """Whether ``FSDP_AUTOPATCH_ENABLED`` explicitly turns everything off. Never warns (start-up path)."""
    return parse_bool(environ.get(KILL_SWITCH)) is False


def prints_here(environ: "Mapping[str, str]" = os.environ) -> bool:  # noqa: B008
    """Whether this process prints our warnings: the first rank of its node (``LOCAL_RANK`` 0, or no
    launcher), unless ``FSDP_AUTOPATCH_WARN_ALL_RANKS=1`` lets every rank print (64 ranks, one copy)."""
    if parse_bool(environ.get(WARN_ALL_RANKS)):
        return True
    return environ.get("LOCAL_RANK", "0").strip() in ("", "0")


def warn(variable: str, message: str) -> None:
    """Warn once per variable on stderr (on the ranks that print: :func:`prints_here`); a ``-W error``
    filter must not turn this into a crash."""
    if variable in _warned or not prints_here():
        return
    _warned.add(variable)
    try:
        import warnings

        # warn_explicit: the location shown is the plugin, not a line of our source. Users can
        # silence these with warnings.filterwarnings("ignore", category=ConfigWarning).
        warnings.warn_explicit(message, ConfigWarning, filename="fsdp-autopatch", lineno=0)
    except Exception:  # e.g. python -W error: still tell the user, never raise
        try:
            sys.stderr.write(f"fsdp-autopatch: ConfigWarning: {message}\n")
        except Exception:
            pass


# Values are echoed in warnings and registry reasons. An environment value can be ~128 KiB: without
# a cap, one bad value printed a 100 KB warning line on every rank (tests/unit/test_fault_injection.py).
_SHOWN_MAX = 64


def _shown(value: "str | None") -> str:
    """``value`` as given, or its start and its length if it is longer than ``_SHOWN_MAX``."""
    if value is None or len(value) <= _SHOWN_MAX:
        return str(value)
    return f"{value[:_SHOWN_MAX]}...[{len(value)} characters]"


def _quoted(value: str) -> str:
    """``repr(value)``, shortened like :func:`_shown`."""
    if len(value) <= _SHOWN_MAX:
        return repr(value)
    return f"{value[:_SHOWN_MAX]!r}...[{len(value)} characters]"


class Decision:
    """Whether one patch or policy is on, and what decided it: ``variable`` (None for the default)
    and the ``value`` it had. A plain class: no ``typing``/``collections`` on the start-up path."""

    __slots__ = ("enabled", "variable", "value")

    def __init__(self, enabled: bool, variable: "str | None" = None, value: "str | None" = None) -> None:
        self.enabled = enabled
        self.variable = variable
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Decision):
            return NotImplemented
        return (self.enabled, self.variable, self.value) == (other.enabled, other.variable, other.value)

    def __repr__(self) -> str:
        return f"Decision(enabled={self.enabled}, variable={self.variable!r}, value={self.value!r})"

    def describe(self) -> str:
        """``FSDP_AUTOPATCH_DISABLED=uniform_reduce_dtype`` (shortened when long), or ``default``."""
        return f"{self.variable}={_shown(self.value)}" if self.variable else "default"


class Settings:
    """Everything the ``FSDP_AUTOPATCH_*`` variables decide, read once per activation.

    A plain class rather than a dataclass: ``dataclasses`` imports ``inspect``, and this module
    is on the interpreter start-up path.
    """

    def __init__(
        self,
        enabled: bool = True,
        patches: "Mapping[str, Decision] | None" = None,
        strict: bool = False,
        log_level: "str | None" = None,
        third_party: bool = True,
        policies: "Mapping[str, bool] | None" = None,
    ) -> None:
        self.enabled = enabled
        # patch name -> Decision (enabled?, and the variable and value that decided it)
        self.patches = dict(patches or {})
        self.strict = strict
        self.log_level = log_level
        self.third_party = third_party  # patches other installed distributions declare
        # policy name -> on? (each policy follows its own variable, or its catalogue default)
        self.policies = {name: _catalogue.BY_NAME[name].default for name in _catalogue.POLICIES}
        self.policies.update(policies or {})

    def __repr__(self) -> str:
        return f"Settings({self.__dict__!r})"

    def decision(self, name: str) -> Decision:
        """Whether a patch or policy is on, and why. A policy follows its own variable (the list names
        patches); at its default it follows the kill switch too, unless its entry says otherwise (the
        cross-rank check); a patch read_settings did not know follows the kill switch."""
        if name in self.patches:
            return self.patches[name]
        if name in self.policies:
            return Decision(self.policies[name])
        return Decision(True) if self.enabled else Decision(False, KILL_SWITCH, "0")


def read_settings(
    environ: "Mapping[str, str]" = os.environ,
    warn: "Callable[[str, str], None]" = warn,
    names: "tuple[str, ...] | None" = None,
) -> Settings:
    """Read every ``FSDP_AUTOPATCH_*`` variable; bad values keep their default and warn once.

    ``names``: every patch to decide, the built-in ones and those other distributions declare
    (default: the built-in ones).
    """
    if names is None:
        names = _catalogue.PATCH_NAMES
    enabled = _read_bool(environ, KILL_SWITCH, True, warn)
    disabled_list = _read_disabled_list(environ, warn, names)
    patches = {}
    for name in names:
        patches[name] = _decide_patch(environ, name, enabled, disabled_list, warn)
    _warn_unknown_variables(environ, warn, names)
    settings = Settings(
        enabled=enabled,
        patches=patches,
        strict=_read_bool(environ, STRICT, False, warn),
        log_level=_read_log_level(environ, warn),
        third_party=_read_bool(environ, THIRD_PARTY, True, warn),
        policies={
            name: _read_bool(environ, variable, _catalogue.BY_NAME[name].default, warn)
            for name, variable in POLICY_VARIABLES.items()
        },
    )
    for name, variable in POLICY_VARIABLES.items():
        on = settings.policies[name]
        decided = parse_bool(environ.get(variable)) is not None  # a malformed value left the default
        if not decided and on and not enabled and _catalogue.BY_NAME[name].kill_switch:
            settings.policies[name] = False  # at its default, it follows the kill switch
            settings.patches[name] = Decision(False, KILL_SWITCH, environ.get(KILL_SWITCH))
            continue
        settings.patches[name] = Decision(on, variable, environ[variable]) if decided else Decision(on)
    return settings


def _read_bool(environ, variable, default, warn) -> bool:
    raw = environ.get(variable)
    if raw is None or raw.strip() == "":
        return default
    value = parse_bool(raw)
    if value is None:
        warn(
            variable,
            f"{variable}={_quoted(raw)} is not a boolean (use 1/true/yes/on or 0/false/no/off); "
            f"ignoring it ({_describe_default(default)})",
        )
        return default
    return value


def _describe_default(default) -> str:
    if default is None:
        return f"{DISABLED_LIST} or the default decides"
    return f"default: {'on' if default else 'off'}"


def _read_disabled_list(environ, warn, known) -> "frozenset[str]":
    raw = environ.get(DISABLED_LIST, "")
    names = {part.strip().lower() for part in raw.split(",") if part.strip()}
    unknown = sorted(names - set(known) - {"*"})
    if unknown:
        warn(
            DISABLED_LIST,
            f"{DISABLED_LIST} names unknown patch(es) {', '.join(_with_hint(name, known) for name in unknown)}; "
            f"known patches (or '*' for all): {_bounded_list(known)}",
        )
    if "*" in names:
        return frozenset(known)
    return frozenset(names & set(known))


_LISTED_NAMES_CHARS = 300  # third-party entries grow the catalogue; a warning stays a line or two


def _bounded_list(names) -> str:
    """The names, comma-separated, cut to a bounded length with a pointer to the full list."""
    shown, length = [], 0
    for name in names:
        length += len(name) + 2
        if length > _LISTED_NAMES_CHARS:
            more = len(names) - len(shown)
            return f"{', '.join(shown)} and {more} more (python -m fsdp_autopatch status lists all)"
        shown.append(name)
    return ", ".join(shown)


def _with_hint(name, known) -> str:
    """An unknown name as warnings show it, with the closest known one (a typo's likely intent)."""
    import difflib

    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    return _shown(name) + (f" (did you mean {close[0]}?)" if close else "")


def _decide_patch(environ, name, enabled, disabled_list, warn) -> Decision:
    variable = patch_env_var(name)
    if not enabled:
        return Decision(False, KILL_SWITCH, environ.get(KILL_SWITCH))
    own = _read_bool(environ, variable, None, warn) if variable in environ else None
    if own is not None:
        return Decision(own, variable, environ[variable])
    if name in disabled_list:
        return Decision(False, DISABLED_LIST, environ.get(DISABLED_LIST))
    return Decision(True)


def _read_log_level(environ, warn) -> "str | None":
    raw = environ.get(LOG_LEVEL)
    if raw is None or raw.strip() == "":
        return None
    level = raw.strip().upper()
    if level not in _LOG_LEVELS:
        warn(LOG_LEVEL, f"{LOG_LEVEL}={_quoted(raw)} is not one of {', '.join(_LOG_LEVELS)}; logging stays off")
        return None
    return level


def _known_variables(names) -> "frozenset[str]":
    return frozenset(
        {KILL_SWITCH, DISABLED_LIST, STRICT, LOG_LEVEL, THIRD_PARTY, WARN_ALL_RANKS, *POLICY_VARIABLES.values()}
        | {patch_env_var(name) for name in names}
    )


def _warn_unknown_variables(environ, warn, names) -> None:
    known = _known_variables(names)
    for variable in environ:
        if not variable.startswith(PREFIX) or variable in known:
            continue
        import difflib

        close = difflib.get_close_matches(variable, known, n=1, cutoff=0.8)
        hint = f"; did you mean {close[0]}?" if close else ""
        warn(variable, f"unknown variable {_shown(variable)} is ignored{hint}")
