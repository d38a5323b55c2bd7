"""Call-time isolation: what the import hook guarantees for ``import torch``, every wrapper
guarantees for each call.

Every wrapper a patch declares (``_spec.Wrap``) runs inside :func:`isolate`. Torch's original is
handed to it as a :class:`Call`, which records whether torch ran and what torch raised:

* our code raises *before* torch's original ran: the original runs with the caller's arguments,
  untouched, and its result (or its own exception) is what the caller gets;
* our code raises *after* torch's original returned: ``Wrap.after_torch`` decides, per wrapper, between
  returning torch's result (:data:`~fsdp_autopatch._spec.KEEP_RESULT`: the follow-up is skipped) and
  calling torch again (:data:`~fsdp_autopatch._spec.CALL_AGAIN`, for pure functions);
* either way the patch's record turns ``failed`` ("failed at call time: <exception> in <our
  function>"), one WARNING goes to the ``fsdp_autopatch`` logger (once per patch and process),
  and every later call of that patch's wrappers goes straight to torch;
* our code raises while torch's exception passes through it (a ``finally``): torch's exception
  reaches the caller, the failure is ours;
* exceptions torch raises (inside the original, or in a collective we call through
  :func:`torch_call`), a guard's ``GuardError`` (a built-in guard's or a third party's: counted
  as one fire of the patch whose wrapper raised it) and the errors we raise on purpose
  (:func:`for_the_user`, e.g. the cross-rank check) propagate unchanged: torch's errors are never
  swallowed;
* ``FSDP_AUTOPATCH_STRICT=1`` (:func:`set_strict`) records and then re-raises.

What such a failure can and cannot protect against across ranks: a failure of ours that is the
same on every rank (a torch whose internals changed: the common case) fails at the same point on
every rank, so every rank falls back alike. A failure on one rank only (out of memory inside our
code) makes that rank skip what its peers do; where our code issues a collective (the restore's
all-reduce, the cross-rank check's store reads) its peers then wait until the process group's
timeout. Each patch's docstring says where its code runs relative to torch's.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
from typing import Any, Callable

from . import _events
from ._events import GuardError, fired
from ._registry import CALL_TIME_FAILURE, REGISTRY
from ._spec import CALL_AGAIN, TRACED
from ._tracebacks import ORIGIN, as_torchs, tag

logger = logging.getLogger("fsdp_autopatch")

_PACKAGE = __name__.rpartition(".")[0]
_ORIGIN = ORIGIN
_lock = threading.Lock()
_failed: dict[str, str] = {}  # patch name -> why it failed at call time (later calls go to torch)
_strict = False  # FSDP_AUTOPATCH_STRICT=1 (set_strict)


def set_strict(strict: bool) -> None:
    """``FSDP_AUTOPATCH_STRICT=1``: a failure at call time is recorded, then raised."""
    global _strict
    _strict = bool(strict)


def is_strict() -> bool:
    return _strict


def has_failed(patch_name: str) -> bool:
    """Whether the patch failed at call time in this process (its wrappers now pass through)."""
    return patch_name in _failed


def forget(patch_name: str | None = None) -> None:
    """Forget call-time failures (tests; a reverted patch starts afresh)."""
    with _lock:
        if patch_name is None:
            _failed.clear()
        else:
            _failed.pop(patch_name, None)


# --- arguments, by name ----------------------------------------------------------------------


class Binder:
    """Where each parameter a wrapper reads sits in a call: computed once from the real signature.

    ``skip_self``: the wrapped callable is a method, and wrapt hands the wrapper the arguments
    without ``self``.
    """

    __slots__ = ("positions", "defaults", "missing", "names", "function")

    def __init__(self, function: Any, names: tuple[str, ...], skip_self: bool = False) -> None:
        parameters = list(inspect.signature(function).parameters.values())[1 if skip_self else 0:]
        self.names, self.function = frozenset(names), function
        self.positions: dict[str, int | None] = {}
        self.defaults: dict[str, Any] = {}
        positional = True
        for index, parameter in enumerate(parameters):
            if parameter.kind is parameter.VAR_POSITIONAL:
                positional = False
                continue
            if parameter.kind is parameter.VAR_KEYWORD:
                continue
            can_be_positional = positional and parameter.kind is not parameter.KEYWORD_ONLY
            self.positions[parameter.name] = index if can_be_positional else None
            if parameter.default is not parameter.empty:
                self.defaults[parameter.name] = parameter.default
        self.missing = tuple(name for name in names if name not in self.positions)

    def declared(self, name: str) -> None:
        """Raise :class:`UndeclaredArgument` unless the wrapper declared ``name`` in ``Wrap.reads``."""
        if name not in self.names:
            raise UndeclaredArgument(name, tuple(sorted(self.names)), self.function)

    def value(self, args: tuple, kwargs: dict, name: str) -> Any:
        self.declared(name)
        position = self.positions[name]
        if position is not None and position < len(args):
            return args[position]
        if name in kwargs:
            return kwargs[name]
        return self.defaults.get(name)

    def unread(self, args: tuple, kwargs: dict, names: tuple[str, ...]) -> tuple:
        """Every argument of the call other than ``names``: positional ones by position, keyword
        ones by name (sorted), as a tuple."""
        skipped = {self.positions[name] for name in names if self.positions.get(name) is not None}
        positional = tuple(value for index, value in enumerate(args) if index not in skipped)
        keywords = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
        return positional, keywords

    def replaced(self, args: tuple, kwargs: dict, changes: dict) -> tuple[tuple, dict]:
        """The same call with ``changes`` put where each argument came (or would come) from."""
        args, kwargs = list(args), dict(kwargs)
        for name, value in changes.items():
            self.declared(name)
            position = self.positions[name]
            if position is not None and position < len(args):
                args[position] = value
            else:
                kwargs[name] = value
        return tuple(args), kwargs


NO_BINDER = Binder(lambda: None, ())


class UndeclaredArgument(KeyError):
    """A wrapper read or replaced an argument it did not declare in ``Wrap.reads`` (a bug in the
    patch: recorded as its failure at call time, and torch's original runs)."""

    def __str__(self) -> str:
        name, reads, function = self.args
        owner = getattr(function, "__qualname__", None) or "the wrapped function"
        return f"the wrapper reads argument {name!r} of {owner}, which its Wrap.reads {reads!r} does not declare"


class _FromTorch(str):
    """A class attribute that is this text on the class (what ``Call.__doc__`` and ``__module__``
    say, as a ``str``: dynamo reads them) and, on a :class:`Call`, torch's function's attribute."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, call: Any, owner: Any = None) -> Any:
        return self if call is None else getattr(call.original, self.name)


class Call:
    __doc__ = _FromTorch("""Torch's original as a wrapper sees it (its ``wrapped``): one object per call.

    ``call(*args, **kwargs)`` runs torch's original and records that it ran (and what it raised).
    ``call.argument(name)`` reads an argument of the caller's call by name (one declared in
    ``Wrap.reads``); ``call.again(name=value, ...)`` runs torch's original with the caller's
    arguments, those named replaced, every other one forwarded exactly as it came.
    ``call.rebind(...)`` makes such a change the caller's call from now on (an iterator read into
    a list: torch, and any fallback, must see the list, not the spent iterator).

    Every other attribute is torch's function's, as on wrapt's ``wrapped``: ``__name__``,
    ``__qualname__``, ``__doc__``, ``__module__``, ``__self__``...; ``__wrapped__`` is the function.
    """)
    __module__ = _FromTorch(__name__)

    __slots__ = ("original", "args", "kwargs", "binder", "ran", "error", "result")

    def __init__(self, original: Any, args: tuple, kwargs: dict, binder: Binder = NO_BINDER) -> None:
        self.original, self.args, self.kwargs, self.binder = original, args, kwargs, binder
        self.ran, self.error, self.result = False, None, None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.ran = True
        try:
            self.result = self.original(*args, **kwargs)
        except BaseException as error:
            self.error = error
            raise
        return self.result

    def argument(self, name: str) -> Any:
        return self.binder.value(self.args, self.kwargs, name)

    def again(self, **changes: Any) -> Any:
        args, kwargs = self.binder.replaced(self.args, self.kwargs, changes)
        return self(*args, **kwargs)

    def rebind(self, **changes: Any) -> None:
        self.args, self.kwargs = self.binder.replaced(self.args, self.kwargs, changes)

    def fallback(self) -> Any:
        """Torch's original with the caller's arguments (as rebound), untracked."""
        return self.original(*self.args, **self.kwargs)

    __wrapped__ = property(lambda self: self.original)

    def __getattr__(self, name: str) -> Any:  # only for what the class lacks: __name__, __qualname__...
        # not set yet (a copy under construction): no recursion. And no __dict__: torch.compile
        # (2.9, matrix row of 2026-12-03) guarded on a forwarded one it then could not read back
        if name in Call.__slots__ or name == "__dict__":
            raise AttributeError(name)
        return getattr(self.original, name)

    def __repr__(self) -> str:
        return f"<fsdp_autopatch Call of {self.original!r}>"


# --- isolation --------------------------------------------------------------------------------


def isolate(patch_name: str, wrapper: Callable[..., Any], binder: Binder, after_torch: str,
            dynamo: str = TRACED) -> Callable[..., Any]:
    """``wrapper`` isolated at call time; wrapt's signature ``(wrapped, instance, args, kwargs)``.
    ``dynamo`` (``Wrap.dynamo``): while Dynamo traces a call, :data:`~fsdp_autopatch._spec.TRACED`
    traces ``wrapper``, anything else calls torch's function as it came."""
    compiling = _is_compiling_function()
    _events._is_compiling[0] = compiling
    traced = dynamo == TRACED
    module = getattr(wrapper, "__module__", None)  # a third-party patch's failure names its function

    retired = []  # non-empty once reverted: a caller that still holds us gets torch's code

    def isolated_wrapper(wrapped, instance, args, kwargs):
        if patch_name in _failed or retired:
            try:
                return wrapped(*args, **kwargs)
            except Exception as error:
                error = as_torchs(error)  # its traceback from torch's frame on
                raise error  # torch's own code raised below: fsdp-autopatch ran it unchanged
        if compiling():  # Dynamo traces this call: aside, or traced without try/except around user code
            if not traced:
                return wrapped(*args, **kwargs)
            return wrapper(Call(wrapped, args, kwargs, binder), instance, args, kwargs)
        call = Call(wrapped, args, kwargs, binder)
        try:
            return wrapper(call, instance, args, kwargs)
        except Exception as error:
            if error is call.error:  # shown from torch's frame, under this one line of ours
                error = as_torchs(error)  # its traceback from torch's frame on
                raise error  # torch's own code raised below: fsdp-autopatch ran it unchanged
            if _for_the_user(patch_name, error):
                raise  # a guard's, or one we raise for the user on purpose
            record_failure(patch_name, error, module)
            if _strict:
                raise
            if call.error is not None:  # ours raised while torch's exception was on its way out
                raise call.error from None
            if not call.ran or after_torch == CALL_AGAIN:
                return call.fallback()
            return call.result

    isolated_wrapper.__fsdp_autopatch_patch__ = patch_name  # type: ignore[attr-defined]
    isolated_wrapper.__fsdp_autopatch_retire__ = lambda: retired.append(True)  # type: ignore[attr-defined]
    return isolated_wrapper


def aside_while_compiling(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, one of ours that torch calls in the user's step (a global optimizer step pre-hook),
    stepping aside while Dynamo traces it: a compiled step (``torch.compile(optimizer.step)``) holds
    nothing of ours, no graph break, no guard on our state; it returns None there, as a hook that
    changes nothing does. [Note: hidden as torch hides] in ``_hiding``.

    [Note: a step hook only where needed] A hook that steps aside still costs a compiled step: on
    Python 3.13 (torch 2.13, measured) any optimizer step pre-hook, even ``lambda *a: None``, makes
    Dynamo give up resuming after the graph break torch puts in ``_use_grad`` ("Failed to handle
    graph break gracefully"): it skips the step's frame and compiles 35 frames where it compiled 8
    (3.11: no difference). So a guard installs its hook only once a run holds what it checks
    (an optimizer built with an unsharded parameter, an unmanaged trainable one), found by a wrapper
    of ``Optimizer.add_param_group``, which torch hides from Dynamo: a run without them compiles
    its step as it would without the plugin."""
    compiling = _is_compiling_function()

    def hook_outside_dynamo(*args, **kwargs):
        if compiling():
            return None
        return hook(*args, **kwargs)

    hook_outside_dynamo.__wrapped__ = hook  # type: ignore[attr-defined]
    return hook_outside_dynamo


def retire(isolated_wrapper: Any) -> None:
    """A reverted wrapper passes every call straight to what it wraps, for whoever still holds it
    (a framework that wrapped ours after us keeps calling it)."""
    retire_it = getattr(isolated_wrapper, "__fsdp_autopatch_retire__", None)
    if retire_it is not None:
        retire_it()


def isolated(patch_name: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run our own ``function`` (one that torch calls back, inside a hook we installed); on an
    exception of ours the failure is recorded and None returned. Skipped once the patch failed."""
    if patch_name in _failed:
        return None
    try:
        return function(*args, **kwargs)
    except Exception as error:
        if _for_the_user(patch_name, error):
            raise
        record_failure(patch_name, error, getattr(function, "__module__", None))
        if _strict:
            raise
        return None


def torch_call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, called from a wrapper (a collective of the patch's own,
    typically): what it raises reaches the caller unchanged, as torch's own errors do, instead of
    counting as the patch's failure (a peer's timeout is not a bug of the patch)."""
    try:
        return function(*args, **kwargs)
    except Exception as error:
        _tag(error, "torch")
        raise


def for_the_user(error: BaseException) -> BaseException:
    """Mark an error we raise on purpose (the cross-rank check's): the isolation lets it through."""
    _tag(error, "deliberate")
    return error


def _for_the_user(patch_name: str, error: BaseException) -> bool:
    """Whether ``error`` goes to the user: torch's, one raised on purpose, or a guard's ``GuardError``
    (counted as a fire of ``patch_name`` unless ``_events.stop`` made it, which counted it)."""
    if getattr(error, _ORIGIN, None) is not None:
        return True
    if not isinstance(error, GuardError):
        return False
    if not error._counted:
        error._counted = True
        fired(patch_name, f"stopped: {error}")
    return True


_tag = tag


def record_failure(patch_name: str, error: BaseException, module: str | None = None) -> None:
    """The patch failed at call time: registry ``failed``, one warning, later calls to torch.
    ``module``: the module that declares the wrapper (a third-party patch's), searched besides ours."""
    error_text = f"{type(error).__name__}: {error}"
    reason = f"{CALL_TIME_FAILURE}: {error_text} in {where(error, module)}; torch's own code runs from then on"
    with _lock:
        if patch_name in _failed:
            return
        _failed[patch_name] = reason
    REGISTRY.record_call_failure(patch_name, reason)
    logger.warning("%s %s", patch_name, reason, exc_info=error)


def where(error: BaseException, also: str | None = None) -> str:
    """The innermost function of this package (or of module ``also``, a third-party patch's) in
    ``error``'s traceback: ``module.function``."""
    found = also or _PACKAGE
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        module = frame.f_globals.get("__name__", "")
        ours = (module == _PACKAGE or module.startswith(_PACKAGE + ".")) and module != __name__
        if ours or (also is not None and module == also):
            code = frame.f_code
            found = f"{module}.{getattr(code, 'co_qualname', code.co_name)}"
        tb = tb.tb_next
    return found


def _is_compiling_function() -> Callable[[], bool]:
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    return is_compiling if callable(is_compiling) else (lambda: False)


def run_wrapper(wrapper, original, instance, args, kwargs, reads=(), signature_of=None, skip_self=False):
    """Call ``wrapper`` as its isolation would, without the isolation: for tests and benchmarks that
    drive a wrapper with a stand-in for torch's function. ``signature_of``: the function whose
    signature ``reads`` are bound against (default: ``original``)."""
    binder = Binder(signature_of or original, tuple(reads), skip_self) if reads else NO_BINDER
    return wrapper(Call(original, args, kwargs, binder), instance, args, kwargs)
