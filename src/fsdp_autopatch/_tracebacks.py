"""Torch's errors read as torch's. Standard library only.

An error torch's function raises under a wrapper of ours would show every frame it passed: the
replacement, the isolation, the patch's wrapper, :class:`~fsdp_autopatch._isolation.Call`. Users
file such an error against the wrapper they see. :func:`as_torchs` drops those frames; the one
frame of ours left, the outermost (the line that re-raises it), says in its source line that the
error below is torch's own, which fsdp-autopatch ran unchanged.
"""

from __future__ import annotations

from typing import Any

ORIGIN = "__fsdp_autopatch_origin__"  # attribute on an exception: "torch" or "deliberate"
_PACKAGE = __name__.rpartition(".")[0]
_CALL_MODULE = f"{_PACKAGE}._isolation"  # Call.__call__: the frame that calls torch's function


def tag(error: BaseException, origin: str) -> None:
    try:
        setattr(error, ORIGIN, origin)
    except (AttributeError, TypeError):  # an exception type with __slots__: it stays untagged
        pass


def as_torchs(error: BaseException) -> BaseException:
    """Torch's ``error`` with its traceback starting at torch's frame: the frames it passed between
    the caller and torch's function (the patch's wrapper, ``Call``, an inner replacement of ours)
    are dropped. Marks it as torch's for the outer layers of ours (:func:`raised_by_torch`)."""
    tag(error, "torch")
    start = error.__traceback__
    node = start
    while node is not None:  # torch's function is what the outermost Call called
        if _calls_torch(node.tb_frame):
            start = node.tb_next
            break
        node = node.tb_next
    while start is not None and _is_ours(start.tb_frame):
        start = start.tb_next
    return error if start is None else error.with_traceback(start)


def raised_by_torch(error: BaseException) -> bool:
    """Whether ``error`` is torch's own, marked so by :func:`as_torchs` in a layer below."""
    return getattr(error, ORIGIN, None) == "torch"


def _calls_torch(frame: Any) -> bool:
    return frame.f_code.co_name == "__call__" and frame.f_globals.get("__name__") == _CALL_MODULE


def _is_ours(frame: Any) -> bool:
    module = frame.f_globals.get("__name__", "")
    return module == _PACKAGE or module.startswith(_PACKAGE + ".")


def plain_caller(function: Any, wrapper: Any, method: bool) -> Any:
    """A plain function that calls ``wrapper`` (wrapt's signature) with ``function`` as ``wrapped``
    (bound to the instance per call where ``method``), and lets torch's own error out from this one
    frame, its traceback starting at torch's (:func:`as_torchs`). The caller names it
    (``functools.wraps``): ``_patching``'s plain replacement, ``_hiding``'s hidden one."""
    def replacement(*args, **kwargs):
        instance, wrapped = None, function
        if method:  # bound per call, as wrapt binds a method for its wrapper
            instance, args = args[0], args[1:]
            wrapped = function.__get__(instance, type(instance))
        try:
            return wrapper(wrapped, instance, args, kwargs)
        except Exception as error:
            if not raised_by_torch(error):
                raise
            error = as_torchs(error)  # its traceback from torch's frame on
            raise error  # torch's own code raised below: fsdp-autopatch ran it unchanged
    return replacement
