"""Environment variables -> settings, with a clear warning for every bad value.

Stdlib only and cheap: the bootstrap imports this module at interpreter start when the kill
switch variable is set; everything else here runs when torch's FSDP2 is imported, so a launcher can set the
variables after the interpreter started.

Precedence for one patch: ``FSDP_AUTOPATCH_ENABLED`` (kill switch) > ``FSDP_AUTOPATCH_<NAME>_ENABLED``
> ``FSDP_AUTOPATCH_DISABLED`` (list, ``*`` = all) > default (on).
"""

import os
import sys

# The bootstrap imports this module at interpreter start when FSDP_AUTOPATCH_ENABLED is set, where
# it may load nothing outside this package: so no `typing` (TYPE_CHECKING is False at run time) and no `from __future__ import
# annotations` (that statement imports the `__future__` module, ~0.3 ms and one more entry in
# sys.modules; bench/startup.py). Annotations that Python 3.9 cannot evaluate are strings instead.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Mapping

PREFIX = "FSDP_AUTOPATCH_"
KILL_SWITCH = "FSDP_AUTOPATCH_ENABLED"
DISABLED_LIST = "FSDP_AUTOPATCH_DISABLED"
STRICT = "FSDP_AUTOPATCH_STRICT"
LOG_LEVEL = "FSDP_AUTOPATCH_LOG_LEVEL"
REDUCE_SCATTER_UNUSED_PARAMS = "FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS"
CROSS_RANK_CHECK = "FSDP_AUTOPATCH_CROSS_RANK_CHECK"

# Kept here (not imported from .patches) so that the bootstrap and the registry can name the
# patches without importing any patch code. The order is the order in which they are applied.
PATCH_NAMES = (
    "accumulated_grad_guard",
    "unused_param_reduction",
    "uniform_reduce_dtype",
    "restore_unused_param_grads",
)

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# One warning per variable per process, however often the settings are read.
_warned: "set[str]" = set()


class ConfigWarning(UserWarning):
    """A ``FSDP_AUTOPATCH_*`` variable has a value or name that fsdp-autopatch does not understand."""


def patch_env_var(name: str) -> str:
    """The variable that switches one patch on or off, e.g. ``FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED``."""
    return f"{PREFIX}{name.upper()}_ENABLED"


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


def warn(variable: str, message: str) -> None:
    """Warn once per variable on stderr; a ``-W error`` filter must not turn this into a crash."""
    if variable in _warned:
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


class Settings:
    """Everything the ``FSDP_AUTOPATCH_*`` variables decide, read once per activation.

    A plain class rather than a dataclass: ``dataclasses`` imports ``inspect``, and this module
    is on the interpreter start-up path.
    """

    def __init__(
        self,
        enabled: bool = True,
        patches: "Mapping[str, tuple[bool, str]] | None" = None,
        strict: bool = False,
        log_level: "str | None" = None,
        reduce_scatter_unused_params: bool = False,
        cross_rank_check: bool = True,
    ) -> None:
        self.enabled = enabled
        # patch name -> (enabled?, why: the variable and value that decided, or "default")
        self.patches = dict(patches or {})
        self.strict = strict
        self.log_level = log_level
        self.reduce_scatter_unused_params = reduce_scatter_unused_params
        self.cross_rank_check = cross_rank_check

    def __repr__(self) -> str:
        return f"Settings({self.__dict__!r})"

    def patch_enabled(self, name: str) -> tuple[bool, str]:
        return self.patches.get(name, (self.enabled, "default"))


def read_settings(
    environ: "Mapping[str, str]" = os.environ,
    warn: "Callable[[str, str], None]" = warn,
) -> Settings:
    """Read every ``FSDP_AUTOPATCH_*`` variable; bad values keep their default and warn once."""
    enabled = _read_bool(environ, KILL_SWITCH, True, warn)
    disabled_list = _read_disabled_list(environ, warn)
    patches = {}
    for name in PATCH_NAMES:
        patches[name] = _decide_patch(environ, name, enabled, disabled_list, warn)
    _warn_unknown_variables(environ, warn)
    return Settings(
        enabled=enabled,
        patches=patches,
        strict=_read_bool(environ, STRICT, False, warn),
        log_level=_read_log_level(environ, warn),
        reduce_scatter_unused_params=_read_bool(environ, REDUCE_SCATTER_UNUSED_PARAMS, False, warn),
        cross_rank_check=_read_bool(environ, CROSS_RANK_CHECK, True, warn),
    )


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


def _read_disabled_list(environ, warn) -> frozenset[str]:
    raw = environ.get(DISABLED_LIST, "")
    names = {part.strip().lower() for part in raw.split(",") if part.strip()}
    unknown = sorted(names - set(PATCH_NAMES) - {"*"})
    if unknown:
        warn(
            DISABLED_LIST,
            f"{DISABLED_LIST} names unknown patch(es) {', '.join(_shown(name) for name in unknown)}; "
            f"known patches: {', '.join(PATCH_NAMES)} (or '*' for all)",
        )
    if "*" in names:
        return frozenset(PATCH_NAMES)
    return frozenset(names & set(PATCH_NAMES))


def _decide_patch(environ, name, enabled, disabled_list, warn) -> tuple[bool, str]:
    variable = patch_env_var(name)
    if not enabled:
        return False, f"{KILL_SWITCH}={_shown(environ.get(KILL_SWITCH))}"
    own = _read_bool(environ, variable, None, warn) if variable in environ else None
    if own is not None:
        return own, f"{variable}={_shown(environ[variable])}"
    if name in disabled_list:
        return False, f"{DISABLED_LIST}={_shown(environ.get(DISABLED_LIST))}"
    return True, "default"


def _read_log_level(environ, warn) -> "str | None":
    raw = environ.get(LOG_LEVEL)
    if raw is None or raw.strip() == "":
        return None
    level = raw.strip().upper()
    if level not in _LOG_LEVELS:
        warn(LOG_LEVEL, f"{LOG_LEVEL}={_quoted(raw)} is not one of {', '.join(_LOG_LEVELS)}; logging stays off")
        return None
    return level


def _known_variables() -> frozenset[str]:
    return frozenset(
        {KILL_SWITCH, DISABLED_LIST, STRICT, LOG_LEVEL, REDUCE_SCATTER_UNUSED_PARAMS, CROSS_RANK_CHECK}
        | {patch_env_var(name) for name in PATCH_NAMES}
    )


def _warn_unknown_variables(environ, warn) -> None:
    known = _known_variables()
    for variable in environ:
        if not variable.startswith(PREFIX) or variable in known:
            continue
        import difflib

        close = difflib.get_close_matches(variable, known, n=1, cutoff=0.8)
        hint = f"; did you mean {close[0]}?" if close else ""
        warn(variable, f"unknown variable {_shown(variable)} is ignored{hint}")
