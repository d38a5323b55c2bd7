"""Edits of one function's source text, for ``_next_torch``: each ``edit(text) -> text``.

``text`` is the dedented source of one function (decorators included), as ``inspect.getsource``
gives it; positions come from ``ast`` (columns in UTF-8 bytes, lines at ``\\n``), so comments,
strings and formatting stay torch's. An edit that finds nothing to change where it must fails the
simulation (an assertion: the simulation is wrong, not the plugin); ``replace_text`` raises
``Unavailable`` (this torch's function differs from the one the change was written for).
"""

from __future__ import annotations

import ast
import itertools
import textwrap
from typing import Any, Callable


class Unavailable(Exception):
    """The internal a change edits is not in this torch: the case does not apply here."""


def _locator(text: str) -> Callable[[int, int], int]:
    lines = [line + "\n" for line in text.split("\n")]  # ast counts lines at "\n" only
    starts = list(itertools.accumulate((len(line) for line in lines), initial=0))
    return lambda lineno, col: starts[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode())


def _splice(text: str, replacements: list[tuple[int, int, str]]) -> str:
    for start, end, new in sorted(replacements, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def parse(text: str) -> tuple[ast.AST, Any, Callable[[int, int], int]]:
    tree = ast.parse(text)
    node = tree.body[0]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), node
    return tree, node, _locator(text)


def _end(node: ast.AST) -> tuple[int, int]:
    return node.end_lineno, node.end_col_offset


def add_parameter(name: str, default: str = "None", keyword_only: bool = True) -> Callable[[str], str]:
    """``def f(a, b)`` -> ``def f(a, b, *, name=default)`` (after ``*args`` / keyword-only ones,
    before ``**kwargs``); ``keyword_only=False``: a last positional-or-keyword parameter."""

    def edit(text: str) -> str:
        _, fn, at = parse(text)
        a = fn.args
        star = "" if (a.vararg or a.kwonlyargs or not keyword_only) else "*, "
        assert keyword_only or not (a.vararg or a.kwonlyargs), "a positional parameter after *"
        if a.kwarg is not None:
            position = text.rindex("**", 0, at(a.kwarg.lineno, a.kwarg.col_offset))
            return _splice(text, [(position, position, f"{star}{name}={default}, ")])
        nodes = [*a.posonlyargs, *a.args, *a.defaults, *a.kwonlyargs, *filter(None, a.kw_defaults)]
        nodes += [a.vararg] if a.vararg else []
        if not nodes:
            position = text.index("(", at(fn.lineno, fn.col_offset)) + 1
            return _splice(text, [(position, position, f"{star}{name}={default}")])
        position = at(*max(_end(node) for node in nodes))
        return _splice(text, [(position, position, f", {star}{name}={default}")])

    return edit


def _calls(tree: ast.AST, callee: str, receivers: tuple[str, ...] | None) -> list[ast.Call]:
    def matches(func: ast.AST) -> bool:
        if isinstance(func, ast.Name):
            return func.id == callee and receivers is None
        return isinstance(func, ast.Attribute) and func.attr == callee and (
            receivers is None or ast.unparse(func.value) in receivers)

    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and matches(node.func)]


def pass_argument(callee: str, name: str, value: str, receivers: tuple[str, ...] | None = None,
                  required: bool = True) -> Callable[[str], str]:
    """Every call ``callee(...)`` (``x.callee(...)`` with ``x`` one of ``receivers``, if given)
    gets ``name=value`` as its last argument."""

    def edit(text: str) -> str:
        tree, _, at = parse(text)
        replacements = []
        for call in _calls(tree, callee, receivers):
            parts = [*call.args, *call.keywords]
            if parts:
                position = at(*max(_end(part) for part in parts))
                replacements.append((position, position, f", {name}={value}"))
            else:
                position = at(*_end(call)) - 1  # the closing parenthesis
                replacements.append((position, position, f"{name}={value}"))
        assert replacements or not required, f"no call of {callee} in:\n{text}"
        return _splice(text, replacements)

    return edit


def wrap_argument(callee: str, index: int, wrapper: str) -> Callable[[str], str]:
    """The ``index``-th positional argument of every call ``callee(...)`` becomes ``wrapper(arg)``."""

    def edit(text: str) -> str:
        tree, _, at = parse(text)
        replacements = []
        for call in _calls(tree, callee, None):
            arg = call.args[index]
            start, end = at(arg.lineno, arg.col_offset), at(*_end(arg))
            replacements.append((start, end, f"{wrapper}({text[start:end]})"))
        assert replacements, f"no call of {callee}"
        return _splice(text, replacements)

    return edit


def rename(old: str, new: str, definition: bool = True) -> Callable[[str], str]:
    """The function's own name (``definition``) and every reference ``old`` / ``x.old`` become ``new``."""

    def edit(text: str) -> str:
        tree, fn, at = parse(text)
        replacements = []
        if definition and fn.name == old:
            start = text.index(old, at(fn.lineno, fn.col_offset))
            replacements.append((start, start + len(old), new))
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == old:
                start = at(node.lineno, node.col_offset)
                replacements.append((start, start + len(old), new))
            elif isinstance(node, ast.Attribute) and node.attr == old:
                end = at(*_end(node))
                replacements.append((end - len(old), end, new))
        assert replacements, f"no {old} in:\n{text}"
        return _splice(text, replacements)

    return edit


def rename_parameter(old: str, new: str) -> Callable[[str], str]:
    """The function's parameter ``old`` and every name ``old`` read in its body (nested functions
    included) become ``new``: its callers, passing it by position, are unchanged."""

    def edit(text: str) -> str:
        tree, fn, at = parse(text)
        replacements = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.arg, ast.Name)) and getattr(node, "arg", getattr(node, "id", None)) == old:
                start = at(node.lineno, node.col_offset)
                replacements.append((start, start + len(old), new))
        assert any(a.arg == old for a in fn.args.args), f"no parameter {old} in:\n{text}"
        return _splice(text, replacements)

    return edit


def replace_text(old: str, new: str) -> Callable[[str], str]:
    """A written-in change: ``old`` must occur exactly once (else the release differs: Unavailable)."""

    def edit(text: str) -> str:
        if text.count(old) != 1:
            raise Unavailable(f"{old.strip()[:60]!r} occurs {text.count(old)} times in this torch's function")
        return text.replace(old, new)

    return edit


def _statements(code: str, indent: int) -> str:
    return textwrap.indent(textwrap.dedent(code).strip("\n") + "\n", " " * indent)


def insert_first(code: str) -> Callable[[str], str]:
    """Statements run first in the body (after the docstring)."""

    def edit(text: str) -> str:
        _, fn, at = parse(text)
        body = fn.body
        docstring = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
        anchor = body[1] if docstring and len(body) > 1 else body[0]
        position = at(anchor.lineno, 0)
        return _splice(text, [(position, position, _statements(code, anchor.col_offset))])

    return edit


def append_last(code: str) -> Callable[[str], str]:
    """Statements run last in the body (after its last statement)."""

    def edit(text: str) -> str:
        _, fn, at = parse(text)
        last = fn.body[-1]
        text = text if text.endswith("\n") else text + "\n"
        position = at(last.end_lineno + 1, 0)
        return _splice(text, [(position, position, _statements(code, last.col_offset))])

    return edit
