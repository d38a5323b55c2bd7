"""What a patch is: one declaration, as data. Standard library only.

A patch module states the bug, the torch releases measured to have it, a structural check
("are the internals I wrap here, and do they still have the bug?") and its targets by dotted path.
Everything else is shared (``_activate``, ``_patching``, ``_isolation``): the environment toggle
derived from the name, "needed here?" from the version range and the structural check, atomic apply
and revert, call-time isolation, the registry record.

Example (``patches/accumulated_grad_guard.py``)::

    PATCH = Patch(
        name="accumulated_grad_guard",
        summary="a unit that never ran forward does not crash post-backward",
        symptom="AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'",
        trigger="gradient accumulation with reduce_dtype and a unit that skipped forward",
        upstream=("pytorch/pytorch#194058",),
        affected=">=2.6,<2.15",
        check=_structural_check,
        targets=(Wrap(f"{FSDP2}._fsdp_param:FSDPParam.to_accumulated_grad_if_needed", _skip),),
        changes="it returns early for parameters that were never unsharded",
    )
"""

import enum
from typing import Any, Callable, NamedTuple, Optional

from ._catalogue import FIX, GUARD, POLICY, toggle_for

__all__ = ["FIX", "GUARD", "POLICY", "Add", "Patch", "Verdict", "Wrap", "needed", "not_needed", "unsupported"]

# Which check decided a verdict (``Verdict.decided_by``).
STRUCTURE = "structural check"
VERSION_AND_STRUCTURE = "version range and structural check"


class Need(str, enum.Enum):
    """A structural check's answer (``Verdict.status``); equal to its string, as ``PatchStatus``."""

    NEEDED = "needed"
    NOT_NEEDED = "not_needed"  # also a PatchStatus: the record says it as it is
    UNSUPPORTED = "unsupported"  # also a PatchStatus

    def __str__(self) -> str:
        return self.value


class Verdict(NamedTuple):
    """A patch's answer to "needed here?".

    ``status`` is a :class:`Need` (a plain "needed", "not_needed" or "unsupported" compares equal);
    ``decided_by`` says which check decided it. ``conclusive``: the structural check saw something
    no version can overrule (torch's own fix is there, or there is nothing for the patch to act
    on), so it stands on any release.
    """

    status: Need
    reason: str
    decided_by: str = STRUCTURE
    conclusive: bool = False


def needed(reason: str) -> Verdict:
    return Verdict(Need.NEEDED, reason)


def not_needed(reason: str, conclusive: bool = False) -> Verdict:
    return Verdict(Need.NOT_NEEDED, reason, STRUCTURE, conclusive)


def unsupported(reason: str) -> Verdict:
    return Verdict(Need.UNSUPPORTED, reason)


# What a wrapper's guard does when our code raises *after* torch's original ran
# (``Wrap.after_torch``; see ``_isolation`` for the whole call-time isolation):
KEEP_RESULT = "keep torch's result"  # return what torch's original returned (our follow-up is skipped)
CALL_AGAIN = "call torch again"  # call torch's original again with the caller's arguments (pure functions)

# What ``torch.compile`` sees of a wrapper (``Wrap.dynamo``; [Note: hidden as torch hides] in ``_hiding``):
AS_TORCH = "as torch"  # hidden from Dynamo where torch hides the function; elsewhere, aside while Dynamo traces
TRACED = "traced"  # Dynamo traces the wrapper itself (torch lets it trace the function: the clip functions)


class Wrap(NamedTuple):
    """Replace the callable at ``path`` by a wrapper around it.

    ``path`` is ``"module:Qualified.name"`` (wrapt's ``resolve_path`` spelling). ``wrapper`` has
    wrapt's signature ``(wrapped, instance, args, kwargs)``; ``wrapped`` is a
    :class:`fsdp_autopatch._isolation.Call`: calling it runs torch's original,
    ``wrapped.argument(name)`` / ``wrapped.again(name=value)`` read and replace arguments by name
    (names declared in ``reads``), and every other attribute is torch's function's (``__name__``,
    ``__qualname__``, ``__wrapped__``...), as on wrapt's ``wrapped``.

    ``when``: apply this target only if it returns True (an internal that only some releases have).
    ``everywhere``: also replace it in every loaded ``torch.*`` module that holds the same function
    object, under any name (``from x import f as g`` copies the reference, so wrapping only the
    defining module would miss those callers).
    ``reads``: the parameters the wrapper reads or replaces, by name. They are bound against the
    signature of the function actually wrapped (computed once, when applying); a torch whose
    function lacks one of them makes the patch ``unsupported``. Every other argument is forwarded
    exactly as it came; reading or replacing one raises ``UndeclaredArgument`` (a ``KeyError``
    naming it and ``reads``: the patch's failure at call time).
    ``proxy``: True: a ``wrapt.FunctionWrapper``; False: a plain ``functools.wraps`` function (what
    ``torch.compile`` must trace through in user code: dynamo fails on a proxy's closure guard).
    ``after_torch``: :data:`KEEP_RESULT` or :data:`CALL_AGAIN`, what happens when our code raises
    after torch's original already ran (the decision is documented in each patch's docstring).
    ``dynamo``: :data:`AS_TORCH` (the default): where torch hides the function from Dynamo
    (``torch._dynamo.disable``: FSDP2's hooks, ``Optimizer.zero_grad``) the replacement is hidden the
    same way, so a compiled model meets one opaque call where it met one; anywhere else the wrapper
    steps aside while Dynamo traces (torch's function is called as it came, nothing of ours in the
    graph). :data:`TRACED`: Dynamo traces the wrapper (it must trace without a graph break; a plain
    function, ``proxy=False``, of a function torch does not hide: the structural check verifies both).
    """

    path: str
    wrapper: Callable[..., Any]
    when: Optional[Callable[[], bool]] = None
    everywhere: bool = False
    reads: tuple[str, ...] = ()
    proxy: bool = True
    after_torch: str = KEEP_RESULT
    dynamo: str = AS_TORCH


class Add(NamedTuple):
    """Add an attribute torch lacks: ``owner.name = factory(owner)`` (a backported method)."""

    path: str
    factory: Callable[[Any], Any]
    when: Optional[Callable[[], bool]] = None


class Patch(NamedTuple):
    """One fix, guard or policy, declared once (its name, kind and order: ``_catalogue``).

    name       -- identifier, also the toggle ``FSDP_AUTOPATCH_<NAME>_ENABLED`` and the registry key
    summary    -- one line: what the user gets (README table, ``__init__`` docstring, status)
    symptom    -- what happens without it: the exact error, or the wrong value
    trigger    -- when it happens
    upstream   -- references, e.g. ``("pytorch/pytorch#194058", "verl PR 7475")``
    affected   -- ``packaging`` specifiers: the releases measured to have the bug
    check      -- the structural check, ``() -> Verdict``; it may raise ImportError/AttributeError
                  when torch's internals differ (recorded as unsupported)
    targets    -- what is replaced, all or nothing (:class:`Wrap`, :class:`Add`)
    changes    -- what applying it changed, for the registry's reason
    kind       -- :data:`FIX`, :data:`GUARD` or :data:`POLICY` (the catalogue's entry says the same)
    variable   -- the toggle; derived from the name unless given (policies keep their own names)
    after      -- entries whose targets must be wrapped before this one's (so this wrapper runs
                  outside theirs); the catalogue's order respects it (tests/unit/test_catalogue.py)
    """

    name: str
    summary: str
    symptom: str
    trigger: str
    upstream: tuple[str, ...]
    affected: str
    check: Callable[[], Verdict]
    targets: tuple[Any, ...]
    changes: str
    kind: str = FIX
    variable: Optional[str] = None
    after: tuple[str, ...] = ()

    @property
    def toggle(self) -> str:
        return self.variable or toggle_for(self.name)
