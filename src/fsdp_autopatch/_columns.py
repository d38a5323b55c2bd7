"""Tables for a terminal: ``status`` and the demo's registry table. Standard library only.

Every column is as wide as its longest cell (names are never cut: a third-party patch's name can be
long), and the last column, the free text, gets what is left of :data:`WIDTH` columns, cut at a
word with ``...``; when the other columns leave it too little room, it goes on its own indented
line below its row instead.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence

WIDTH = 100  # what a user's terminal shows without wrapping (80- and 120-column terminals alike)
NARROWEST = 40  # below this a wrapped line holds too few words to read: wrap as if this wide
MIN_TEXT = 24  # the least room worth giving the free-text column beside the others
GAP = "  "
ELLIPSIS = "..."


def terminal_width() -> int:
    """The columns of the terminal the output goes to (``COLUMNS`` when set, as ``shutil`` reads
    it); :data:`WIDTH` when it goes to a pipe or a file, where nothing wraps it for us."""
    columns = shutil.get_terminal_size(fallback=(WIDTH, 24)).columns
    return max(columns, NARROWEST)


def wrap(text: str, width: int, first: str = "", rest: str = "    ") -> list[str]:
    """``text`` wrapped at ``width`` columns, ``first`` before its first line and ``rest`` before
    each continuation line. Paths, module names and variables are never split (a word longer than
    the room stays whole on its own line)."""
    return textwrap.wrap(
        text, width, initial_indent=first, subsequent_indent=rest, break_long_words=False, break_on_hyphens=False
    ) or [first.rstrip()]


def shorten(text: str, width: int) -> str:
    """``text`` on one line in at most ``width`` characters: whitespace collapsed, cut at a word
    (or mid-word when a single word is longer than half the room) and ended with ``...``."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    if width <= len(ELLIPSIS):
        return text[:width]
    cut = text[: width - len(ELLIPSIS) + 1]
    space = cut.rfind(" ")
    cut = cut[:space] if space > width // 2 else cut[:-1]
    return cut.rstrip(" ,;:") + ELLIPSIS


def table(
    rows: Sequence[Sequence[str]],
    right: frozenset[int] = frozenset(),
    indent: str = "",
    width: int = WIDTH,
) -> list[str]:
    """One line per row (two where the text goes below): ``rows[i][:-1]`` are the fixed columns
    (right-aligned where their index is in ``right``), ``rows[i][-1]`` the free text."""
    if not rows:
        return []
    columns = len(rows[0]) - 1
    sizes = [max(len(row[i]) for row in rows) for i in range(columns)]
    room = width - len(indent) - sum(sizes) - len(GAP) * columns
    lines = []
    for row in rows:
        cells = [cell.rjust(size) if i in right else cell.ljust(size) for i, (cell, size) in enumerate(zip(row, sizes))]
        head = indent + GAP.join(cells)
        if room >= MIN_TEXT:
            lines.append(f"{head}{GAP}{shorten(row[-1], room)}".rstrip())
        else:  # the names are too long for the text beside them: the text goes below, indented
            lines.append(head.rstrip())
            if row[-1]:
                lines.append(f"{indent}    {shorten(row[-1], width - len(indent) - 4)}")
    return lines
