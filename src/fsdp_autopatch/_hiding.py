"""Hidden from Dynamo where torch hides: what a wrapper of ours looks like to ``torch.compile``.

[Note: hidden as torch hides]
Torch keeps FSDP2's hooks out of Dynamo's reach (``_fsdp_common._dynamo_disable`` on
``FSDPState._pre_forward`` / ``_post_forward`` / ``_pre_backward`` / the final callback and
``FSDPParamGroup.pre_backward`` / ``post_backward``; ``torch._disable_dynamo`` on
``Optimizer.zero_grad``; ``disable_if_config_true`` on older releases, which hides only while
``torch._dynamo.config.skip_fsdp_hooks``). Each is a ``functools.wraps`` wrapper that calls
``torch._dynamo.disable(func, recursive=True)(...)``: Dynamo, tracing a compiled model, meets one
opaque call (one graph break where torch has one) and everything below it runs eagerly.

A wrapper of ours in the same place must not undo that. A wrapt proxy there is a C ``__call__`` that
Dynamo cannot trace (a graph break of its own), and the Python code behind it a frame that Dynamo
then compiles, guarding on its arguments' types (recompiles: measured, 20 - 23 graph breaks where
torch has 0 - 1, and ``recompile_limit`` hit in ``isolated_wrapper``). So where torch's function is
hidden, our replacement is hidden the same way: it *is* torch's wrapper (its code object and
globals), with our function in the closure cell where torch's held its own, so it calls
``torch._dynamo.disable(ours, recursive=True)(...)`` as torch's calls it for torch's function.
Dynamo meets the same code and breaks where it broke
(``torch._dynamo.disable(ours, ...)`` written by hand is traced differently: one more graph break
per hook, measured). Inside, ours calls torch's function itself (``__wrapped__``): the region is
already hidden, hiding it twice would only cost a second disable per call. Under
``disable_if_config_true`` with ``skip_fsdp_hooks=False`` (traceable FSDP2) the copy lets Dynamo
trace ours, as torch's lets it trace torch's, and ours then steps aside while Dynamo traces
(``torch.compiler.is_compiling()``).

A function torch decorates with ``torch._dynamo.disable`` itself (no wrapper of its own around the
call: a form the next torch may take) gets ``torch._dynamo.disable(ours, recursive=True)`` once, at
apply time: the same opaque call to Dynamo.

Where torch does not hide a function, the wrapper steps aside while Dynamo traces it (the isolation
calls torch's function directly), unless its target is declared ``dynamo=TRACED``: then Dynamo
traces the wrapper itself (the clip functions, which a compiled step calls), and the structural
check makes sure torch does not hide that function and that the replacement is a plain function.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

from . import _tracebacks
from ._compat import names_read

ALWAYS = "always"  # torch._dynamo.disable at every call
WHILE_SKIPPING_FSDP_HOOKS = "while torch._dynamo.config.skip_fsdp_hooks"  # disable_if_config_true
DISABLED = "disabled"  # the function is torch._dynamo.disable(fn, recursive=True)'s own result

_HIDING = "__fsdp_autopatch_hiding__"  # on our hidden replacement: how torch hid what it replaced
_INNER = "__fsdp_autopatch_unhidden__"  # on our hidden replacement: what runs inside the hidden region


def hiding_of(function: Any) -> str | None:
    """How torch hides ``function`` from Dynamo: :data:`ALWAYS`, :data:`WHILE_SKIPPING_FSDP_HOOKS`,
    :data:`DISABLED` (``torch._dynamo.disable``'s own result), or None (it does not, or it is not a
    plain ``functools.wraps`` wrapper whose ``__wrapped__`` we can call inside the hidden region: a
    third party's proxy over torch's is left as it is, and stepped aside while Dynamo traces)."""
    ours = getattr(function, _HIDING, None)
    if ours is not None:
        return ours
    if (getattr(function, "_torchdynamo_disable", False) is True and callable(_disabled_original(function))
            and getattr(function, "_torchdynamo_disable_recursive", True) is True):
        return DISABLED  # decorated with torch._dynamo.disable itself (a form torch may take next)
    if type(function) is not types.FunctionType or not callable(getattr(function, "__wrapped__", None)):
        return None
    inner = function.__wrapped__
    cells = [cell.cell_contents for cell in function.__closure__ or () if _filled(cell)]
    if not any(held is inner for held in cells):
        return None  # __wrapped__ is not what this function calls
    names = names_read(function.__code__)
    if not {"_dynamo", "disable"} <= names:
        return None
    return WHILE_SKIPPING_FSDP_HOOKS if "skip_fsdp_hooks" in names else ALWAYS


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _disabled_original(function: Any) -> Any:
    return getattr(function, "_torchdynamo_orig_callable", None)


def unhidden(function: Any) -> Any:
    """What ``function`` (hidden, :func:`hiding_of`) runs inside its hidden region."""
    return getattr(function, _INNER, None) or _disabled_original(function) or function.__wrapped__


def hidden_replacement(original: Any, isolated_wrapper: Callable[..., Any], method: bool, hiding: str) -> Any:
    """A plain function in place of ``original`` (hidden by torch as ``hiding`` says) that Dynamo
    meets as it met torch's: ``isolated_wrapper`` (wrapt's signature) runs inside the hidden region,
    with torch's function itself as ``wrapped``. ``method``: a function on a class (bound per call)."""
    inner = unhidden(original)
    # torch's error passing through: one frame of ours above torch's, its line saying whose it is
    ours = _tracebacks.plain_caller(inner, isolated_wrapper, method)
    functools.update_wrapper(ours, inner)  # the name a wrapper over it sees as ``wrapped.__name__``

    if hiding == DISABLED:
        # torch._dynamo is loaded (torch's own decoration used it): disabled once, as torch's is
        replacement = sys.modules["torch"]._dynamo.disable(ours, recursive=True)
    else:
        replacement = _same_hiding(original, ours)
    own = {k: v for k, v in vars(replacement).items() if k.startswith("_torchdynamo")}
    functools.update_wrapper(replacement, original)
    vars(replacement).update(own)  # Dynamo's marks stay those of our disabled function, not torch's
    replacement.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(replacement, _HIDING, hiding)
    setattr(replacement, _INNER, ours)
    replacement.__fsdp_autopatch_replacement__ = True  # type: ignore[attr-defined]
    replacement.__fsdp_autopatch_wrapper__ = isolated_wrapper  # type: ignore[attr-defined]
    return replacement


def hidden(callback: Callable[..., Any]) -> Callable[..., Any]:
    """A callback of ours that torch calls where Dynamo's frame evaluation may be on (an autograd
    hook registered on a tensor: ``backward()`` inside a compiled function runs it), hidden from
    Dynamo as torch hides its FSDP2 hooks: it runs eagerly, never compiled as a frame of its own.
    ``torch._dynamo`` is loaded by then (FSDP2's hidden hooks load it at their first call)."""
    return sys.modules["torch"]._dynamo.disable(callback, recursive=True)


def _same_hiding(original: Any, ours: Callable[..., Any]) -> Any:
    """Torch's hiding wrapper itself, holding ``ours`` where it held torch's function: the same code
    object and globals, a closure whose cell for torch's function holds ``ours`` (every other cell a
    copy). Dynamo then traces it exactly as it traces torch's (the same graph break, no more), and
    ``skip_fsdp_hooks`` means what it means to torch."""
    inner = unhidden(original)  # torch's function, or an earlier patch's hidden wrapper of it
    closure = tuple(
        types.CellType(ours if _filled(cell) and cell.cell_contents is inner else cell.cell_contents)
        if _filled(cell) else types.CellType()
        for cell in original.__closure__
    )
    clone = types.FunctionType(original.__code__, original.__globals__, original.__name__,
                               original.__defaults__, closure)
    clone.__kwdefaults__ = original.__kwdefaults__
    return clone
