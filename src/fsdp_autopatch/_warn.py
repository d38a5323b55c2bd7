"""Our warnings as a user reads them: one line per job, at the user's own line. Standard library only.

A warning of ours is raised from inside a hook or a wrapper, several frames below the user's call
(torch's ``zero_grad``, wrapt, our wrapper). Shown at our frame it reads as a bug of the plugin;
shown at a fake place (``fsdp-autopatch:0``) it names the plugin twice. :func:`warn` attributes it
to the first frame outside fsdp-autopatch, torch, wrapt and the import machinery: the user's
``optimizer.zero_grad()`` (or the ``import`` that armed us), as ``warnings.warn(stacklevel=...)``
would with the right level.

On a job of 64 ranks the same warning would print 64 times: by default only the first rank of
each node prints (``LOCAL_RANK`` 0, or no launcher at all); ``FSDP_AUTOPATCH_WARN_ALL_RANKS=1``
lets every rank print (the ranks differ: a warning on rank 5 only). The other ranks still count
the fire (``status``): only the printing is skipped.
"""

import os
import sys

from ._config import prints_here

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _not_the_users() -> tuple:
    """Directories whose frames are never the user's call site."""
    skipped = [_PACKAGE_DIR]
    for name in ("torch", "wrapt"):
        module = sys.modules.get(name)
        if getattr(module, "__file__", None):
            skipped.append(os.path.dirname(os.path.abspath(module.__file__)))
    return tuple(directory + os.sep for directory in skipped)


def user_frame():
    """The innermost frame outside fsdp-autopatch, torch, wrapt and importlib; the outermost frame
    (the program) when every frame is one of those."""
    skipped = _not_the_users()
    frame = sys._getframe(1)
    outermost = frame
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith("<frozen") and not os.path.abspath(filename).startswith(skipped):
            return frame
        outermost = frame
        frame = frame.f_back
    return outermost


def warn(message: str, category: type = UserWarning) -> None:
    """Warn at the user's call site, on the ranks that print; never raise (``-W error`` included)."""
    if not prints_here():
        return
    try:
        import warnings

        frame = user_frame()
        module_globals = frame.f_globals
        warnings.warn_explicit(
            message, category, frame.f_code.co_filename, frame.f_lineno,
            module=module_globals.get("__name__"), registry=module_globals.setdefault("__warningregistry__", {}),
            module_globals=module_globals,
        )
    except Exception:  # python -W error: still tell the user, never raise into the training step
        try:
            sys.stderr.write(f"{category.__name__}: {message}\n")
        except Exception:
            pass
