"""A simulated next torch: torch's own functions re-executed from their source with one change.

A real release changes torch's source; the plugin's structural checks read bytecode. So a change is
simulated by ``inspect.getsource`` of torch's function, an edit of that text (a parameter added to
the ``def`` line and passed at the call sites, a name changed at the definition and every
reference, a fix written in), ``compile`` + ``exec`` with the defining module's namespace as the
function's globals (``exec(code, module.__dict__, locals)``: the new function reads torch's globals
*live*, as a real release's would, so it sees the plugin's wrappers of other functions; a plain
copy of the namespace would not), the original's ``__module__`` / ``__qualname__``, then set back
on its module or class and rebound in every loaded ``torch.*`` module holding the original under
any name (``from x import f`` and ``from x import f as g``). Decorators are part of the source and
run again (``@_dynamo_disable``, ``@torch.no_grad()``, ``@contract(...)``, ``@property``); a method
using zero-argument ``super()`` gets its ``__class__`` cell from a factory function.

Every change is recorded in a :class:`Simulation` and undone exactly (:meth:`Simulation.undo`
puts back the very original objects, removes what it added), so one process runs many cases.
The text edits: ``_next_torch_edits``; the changes themselves, per patch: ``_next_torch_changes``;
what the plugin must report on each: ``_next_torch_expected``. One case in a process:
:func:`on_simulated_torch`.
"""

from __future__ import annotations
import __future__

import contextlib
import importlib
import inspect
import itertools
import linecache
import sys
import textwrap
import traceback
import types
from typing import Any, Callable

from _next_torch_edits import Unavailable, parse

NEW = "added_in_next_release"  # the keyword parameter a simulated release adds
RECEIVED = "_next_torch_received"  # module global: what the new parameters received, in call order
# where callers are looked for: FSDP2, gradient clipping, the pipelining schedules (when loaded)
SCOPE = ("torch.distributed.fsdp._fully_shard.", "torch.nn.utils.clip_grad", "torch.distributed.pipelining.")
NEXT_VERSION = "2.16.0"  # what torch.__version__ reads while the plugin decides
_MISSING = object()
_serial = itertools.count()
_FUTURE_FLAGS = [getattr(__future__, name).compiler_flag for name in __future__.all_feature_names]


def fsdp(name: str) -> types.ModuleType:
    return importlib.import_module(f"torch.distributed.fsdp._fully_shard.{name}")


def describe(owner: Any, attribute: str) -> str:
    return f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{attribute}"


def require(owner: Any, attribute: str) -> Any:
    if attribute not in vars(owner):
        import torch

        raise Unavailable(f"{describe(owner, attribute)} is not in torch {torch.__version__}")
    return vars(owner)[attribute]


# --- recompiling --------------------------------------------------------------------------------


def innermost(value: Any) -> types.FunctionType | None:
    """The plain function whose source is torch's (behind staticmethod, property, decorators)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    try:
        value = inspect.unwrap(value)
    except Exception:  # noqa: BLE001 - a cycle, or an object whose attribute lookup raises
        return None
    return value if isinstance(value, types.FunctionType) else None


def _layers(value: Any) -> list[Any]:
    first = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    first = first.fget if isinstance(first, property) else first
    layers = [first]
    while getattr(layers[-1], "__wrapped__", None) is not None and len(layers) < 10:
        layers.append(layers[-1].__wrapped__)
    return layers


def recompile(owner: Any, attribute: str, edits: list[Callable[[str], str]]) -> tuple[Any, str, str] | None:
    """``owner.attribute`` rebuilt from its edited source: (new object, its name, its file name);
    None when the edits leave the source as it was (the function stays torch's own object)."""
    raw = vars(owner)[attribute]
    inner = innermost(raw)
    text = original = textwrap.dedent(inspect.getsource(inner))
    for edit in edits:
        text = edit(text)
    if text == original:
        return None
    name = parse(text)[1].name
    needs_class = "__class__" in inner.__code__.co_freevars  # zero-argument super()
    source = (f"def __next_torch_factory__(__class__):\n{textwrap.indent(text, '    ')}    return {name}\n"
              if needs_class else text)
    filename = f"<next torch {next(_serial)}: {inner.__module__}.{inner.__qualname__}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    flags = sum(flag for flag in _FUTURE_FLAGS if inner.__code__.co_flags & flag)
    namespace: dict[str, Any] = {}
    exec(compile(source, filename, "exec", flags=flags, dont_inherit=True), inner.__globals__, namespace)
    new = namespace["__next_torch_factory__"](owner) if needs_class else namespace[name]
    if isinstance(raw, property):
        new = property(new.fget, raw.fset, raw.fdel, raw.__doc__)
    qualname = f"{owner.__qualname__}.{name}" if isinstance(owner, type) else name
    for layer in _layers(new):
        with contextlib.suppress(AttributeError, TypeError):
            layer.__qualname__ = qualname
    return new, name, filename


def torch_modules(prefixes: tuple[str, ...] = ("torch.", "torch")) -> list[types.ModuleType]:
    return [m for n, m in list(sys.modules.items()) if m is not None and (n == "torch" or n.startswith(prefixes))]


def definitions(module: types.ModuleType) -> list[tuple[Any, str]]:
    """(owner, attribute) of every function and method defined in ``module``."""
    found = []
    for attribute, value in list(vars(module).items()):
        if isinstance(value, type):  # its methods' module, not the class's: FSDPModule says torch.distributed.fsdp
            found += [(value, name) for name, member in list(vars(value).items())
                      if (f := innermost(member)) is not None and f.__module__ == module.__name__]
        elif (f := innermost(value)) is not None and f.__module__ == module.__name__:
            found.append((module, attribute))
    return found


def _reads(code: types.CodeType, name: str) -> bool:
    return name in code.co_names or any(isinstance(c, types.CodeType) and _reads(c, name) for c in code.co_consts)


def callers(name: str, modules: list[types.ModuleType] | None = None) -> list[tuple[Any, str]]:
    """Functions and methods of torch (in :data:`SCOPE`, or ``modules``) whose code reads ``name``."""
    modules = torch_modules(SCOPE) if modules is None else modules
    return [(owner, attribute) for module in modules for owner, attribute in definitions(module)
            if _reads(innermost(vars(owner)[attribute]).__code__, name)]


class Simulation:
    """One simulated release: edits scheduled with :meth:`edit`, made by :meth:`apply`; every
    assignment recorded, so :meth:`undo` restores the very original objects."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.received: list[tuple[str, Any]] = []  # (function, value of its new parameter) per call
        self.between_runs: list[Callable[[], None]] = []  # resets of torch state a change adds
        self._edits: dict[tuple[int, str], list[Any]] = {}
        self._undo: list[tuple[Any, str, Any]] = []
        self._files: list[str] = []

    def set(self, owner: Any, attribute: str, value: Any) -> None:
        self._undo.append((owner, attribute, vars(owner).get(attribute, _MISSING)))
        setattr(owner, attribute, value)

    def delete(self, owner: Any, attribute: str) -> None:
        self._undo.append((owner, attribute, vars(owner).get(attribute, _MISSING)))
        if attribute in vars(owner):
            delattr(owner, attribute)

    def define(self, module: types.ModuleType, source: str) -> None:
        """A new module-level function of torch (part of a fix), defined in ``module``'s namespace."""
        namespace: dict[str, Any] = {}
        filename = f"<next torch {next(_serial)}: {module.__name__}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        self._files.append(filename)
        exec(compile(textwrap.dedent(source), filename, "exec", dont_inherit=True), vars(module), namespace)
        for name, value in namespace.items():
            self.set(module, name, value)

    def edit(self, owner: Any, attribute: str, *edits: Callable[[str], str]) -> None:
        require(owner, attribute)
        self._edits.setdefault((id(owner), attribute), [owner, attribute, []])[2].extend(edits)

    def apply(self) -> Simulation:
        """Recompile every edited function (all before any is set), then install them."""
        built = []
        for owner, attribute, edits in self._edits.values():
            rebuilt = recompile(owner, attribute, edits)
            if rebuilt is None:
                continue
            new, name, filename = rebuilt
            self._files.append(filename)
            built.append((owner, attribute, vars(owner)[attribute], new, name))
        for owner, attribute, raw, new, name in built:
            self._install(owner, attribute, raw, new, name)
        return self

    def _install(self, owner: Any, attribute: str, raw: Any, new: Any, name: str) -> None:
        if name != attribute:
            self.delete(owner, attribute)
        self.set(owner, name, new)
        if not isinstance(owner, types.ModuleType):
            return
        for module in torch_modules():  # ``from x import f`` (and ``as g``) copied the reference
            for alias, value in list(vars(module).items()):
                if value is raw and not (module is owner and alias == attribute):
                    if alias == attribute and name != attribute:
                        self.delete(module, alias)
                        self.set(module, name, new)
                    else:
                        self.set(module, alias, new)

    def undo(self) -> None:
        while self._undo:
            owner, attribute, original = self._undo.pop()
            if original is _MISSING:
                if attribute in vars(owner):
                    delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)
        for filename in self._files:
            linecache.cache.pop(filename, None)
        self._files.clear()

    def __enter__(self) -> Simulation:
        return self.apply()

    def __exit__(self, *exc: Any) -> None:
        self.undo()


@contextlib.contextmanager
def torch_version(version: str | None):
    """``torch.__version__`` reads ``version`` (None: left alone) while the plugin decides."""
    import torch

    if version is None:
        yield
        return
    original = torch.__version__
    torch.__version__ = type(original)(version) if isinstance(original, str) else version
    try:
        yield
    finally:
        torch.__version__ = original


def error_record(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error),
            "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__))[-6000:]}


def outcome(scenario: Callable[[], dict[str, Any]] | None) -> dict[str, Any]:
    """What a run gave: its record, or the exception it raised."""
    if scenario is None:
        return {"error": None}
    try:
        return {"error": None, **scenario()}
    except Exception as error:  # noqa: BLE001 - the outcome is the measurement
        return {"error": error_record(error)}


def status() -> dict[str, dict[str, Any]]:
    import fsdp_autopatch

    return {p.name: {"status": p.status.value, "reason": p.reason, "fired": p.fired}
            for p in fsdp_autopatch.status().patches}


def on_simulated_torch(change: Callable[[Simulation], None], scenario: Callable[[], dict[str, Any]] | None = None,
                       version: str | None = NEXT_VERSION, label: str = "") -> dict[str, Any]:
    """One case: the plugin reverted, the change simulated, the plugin activated on it (``version``
    read as torch's), ``scenario`` run, the registry read; then the plugin reverted and ``scenario``
    run again on the same simulated torch; the change undone and the plugin activated again.

    Returns ``{"skipped": reason}`` where the change does not apply to this torch, else ``status``
    (per patch), ``on`` and ``off`` (the two runs), ``received_on`` / ``received_off`` (what new
    parameters received)."""
    import torch.distributed.fsdp  # noqa: F401 - the plugin's hook has run before it is reverted

    from fsdp_autopatch import _activate

    _activate.revert_all()
    sim = Simulation(label or getattr(change, "__name__", "change"))
    try:
        try:
            change(sim)
            sim.apply()
        except Unavailable as why:
            return {"skipped": str(why)}
        with torch_version(version):
            _activate.activate()
        result: dict[str, Any] = {"on": outcome(scenario), "status": status(), "received_on": list(sim.received)}
        _activate.revert_all()
        for reset in sim.between_runs:
            reset()
        del sim.received[:]
        result["off"] = outcome(scenario)
        result["received_off"] = list(sim.received)
        return result
    finally:
        _activate.revert_all()
        sim.undo()
        _activate.activate()
