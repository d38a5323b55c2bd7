"""Evidence that a patch changed what torch would have done: per-patch counts and a first-fire log.

A patch calls :func:`fired` only where it acts (a post-backward that skipped a never-unsharded
parameter, a reduce-scatter whose gradient dtypes it widened, a gradient it put back to ``None``,
a unit it zero-filled), never on the common path: no collective, no device sync, no allocation.
The count goes to the registry (``PatchRecord.fired``). The first fire of a patch in a process
logs one INFO record on the ``fsdp_autopatch`` logger, ``<patch> fired: <what would have happened
without it> (<where>)``; later fires log at DEBUG only. The logger is silent unless
``FSDP_AUTOPATCH_LOG_LEVEL`` is set.
"""

from __future__ import annotations

import logging

from ._catalogue import toggle_for
from ._registry import REGISTRY

logger = logging.getLogger("fsdp_autopatch")
_MAX_WHERE = 160  # a unit can hold hundreds of parameters: the log line names the first few


# torch.compiler.is_compiling once a patch is applied (``_isolation.isolate``): a fire inside a traced
# wrapper (``Wrap.dynamo=TRACED``, while Dynamo traces) counts and logs nothing: no lock, no logging,
# no string formatting in a compiled path, where each would be a graph break.
_is_compiling = [lambda: False]


def fired(name: str, without: str, where: str = "") -> None:
    """Record one fire of patch ``name``: ``without`` says what torch would have done instead."""
    if _is_compiling[0]():
        return
    count = REGISTRY.count_fire(name)
    level = logging.INFO if count == 1 else logging.DEBUG
    if logger.isEnabledFor(level):
        logger.log(level, "%s fired: %s%s", name, without, f" ({shorten(where)})" if where else "")


_noted: set[tuple[str, str]] = set()


def left_to_torch(name: str, case: str, why: str) -> None:
    """Say once per process and ``case`` (INFO) that patch ``name`` saw a call it does not cover and
    left it to torch: ``status`` says ``applied`` there, and a user whose run still fails must be
    able to see why. No count: nothing was changed."""
    if (name, case) in _noted or not logger.isEnabledFor(logging.INFO):
        return
    _noted.add((name, case))
    logger.info("%s left to torch: %s", name, why)


class CrossRankMismatch(RuntimeError):
    """The cross-rank check's finding (``patches/cross_rank_check``): ranks of a process group run
    different patches, or some never reported theirs. Raised on purpose, for the user."""


class GuardError(RuntimeError):
    """A guard stopped a run that torch would train silently wrong.

    ``patch`` is the guard's name; the message says what was found, what to do, and the variable
    that lets the run go on anyway (``FSDP_AUTOPATCH_<NAME>_ENABLED=0``). Raised by a wrapper (a
    built-in guard's or a third party's), it reaches the user: call-time isolation lets every
    ``GuardError`` through, and counts it as one fire of the patch whose wrapper raised it.
    """

    _counted = False  # one fire recorded for it already (``stop``, or the isolation it passed)

    def __init__(self, patch: str, message: str) -> None:
        super().__init__(message)
        self.patch = patch


def stop(name: str, found: str, remedy: str) -> GuardError:
    """The error guard ``name`` raises (one fire): ``found`` what torch would do, ``remedy`` what to
    do about it. Raise what it returns: call-time isolation lets it through to the user."""
    fired(name, f"stopped: {found}")
    message = (
        f"fsdp-autopatch guard {name}: {found}. {remedy}. "
        f"To let the run go on as torch would run it, set {toggle_for(name)}=0."
    )
    error = GuardError(name, message)
    error._counted = True
    return error


def shorten(text: str) -> str:
    return text if len(text) <= _MAX_WHERE else f"{text[:_MAX_WHERE]}... [{len(text)} characters]"


def param_names(fsdp_params, limit: int = 4) -> str:
    """``layer.bias, layer.weight, +3 more`` from FSDPParams (their fully qualified names), sorted:
    the same message on every rank, whatever order each rank met them in."""
    names = sorted(str(getattr(p, "_param_fqn", None) or "?") for p in fsdp_params)
    shown = ", ".join(names[:limit])
    return shown + (f", +{len(names) - limit} more" if len(names) > limit else "")
