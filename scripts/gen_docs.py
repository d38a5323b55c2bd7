#!/usr/bin/env python3
"""Write the tables that list the patches from their declarations (``PATCH`` in each module).

    python3 scripts/gen_docs.py          # rewrite the generated blocks in place
    python3 scripts/gen_docs.py --check  # exit 1 and show the difference if one is stale

Generated blocks sit between ``<!-- generated: NAME -->`` and ``<!-- end generated -->`` (in the
package docstring: ``.. generated: NAME`` and ``.. end generated``):

* README.md ``patches``: the table of fixes and guards; ``demo-bugs``: the ``demo --bug`` names;
* docs/configuration.md ``toggles``: one row per fix and guard variable;
* docs/how-it-works.md ``ordering``: the catalogue's order, each entry's kind and ``after``;
* docs/compatibility.md ``expected``: each fix's and guard's registry status per measured release,
  from ``tests/expected.py``; ``added-since``: the fixes and guards the last full matrix run (its
  report's registry header) did not have;
* CHANGELOG.md ``entries``: the fixes and guards added since 0.2.0, one line each;
* src/fsdp_autopatch/__init__.py ``patches``: the docstring's list.

The matrix report's header comes from ``tests/expected.py`` (the hand-written oracle), which
tests/unit/test_docs_generated.py compares with the catalogue. Needs torch (the patch modules
import it); run it in the project's venv.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from packaging.specifiers import SpecifierSet  # noqa: E402

from fsdp_autopatch import _catalogue, cases, patches  # noqa: E402


def torch_range(affected: str) -> str:
    """``>=2.6,<2.15`` -> ``2.6 – 2.14``; ``>=2.6`` -> ``2.6 and later`` (releases are minor versions)."""
    low = high = None
    for spec in SpecifierSet(affected):
        if spec.operator == ">=":
            low = spec.version
        elif spec.operator == "<":
            major, minor = (int(part) for part in spec.version.split(".")[:2])
            high = f"{major}.{minor - 1}"
    if low and high:
        return f"{low} – {high}"
    return f"{low} and later" if low else f"up to {high}"


def _fixes():
    """Every fix and guard (the entries with a registry record and a toggle of their own)."""
    return [patches.load_patch(name) for name in _catalogue.PATCH_NAMES]


SHORT = 90  # a README cell: one line on a screen; the page has the rest


def one_line(text: str, limit: int = SHORT) -> str:
    """The symptom's first clause, cut at a word boundary to ``limit`` characters."""
    first = text.split("; ")[0]
    if len(first) <= limit:
        return first
    return first[: first.rfind(" ", 0, limit - 1)].rstrip(",:") + " …"


def readme_table() -> str:
    lines = ["| entry | kind | without it | torch |", "|---|---|---|---|"]
    for patch in _fixes():
        lines.append(
            f"| [`{patch.name}`](docs/patches/{patch.name}.md) | {patch.kind} | "
            f"{_code_if_error(one_line(patch.symptom))} | {torch_range(patch.affected)} |"
        )
    return "\n".join(lines)


def demo_bugs() -> str:
    return "`NAME` one of " + ", ".join(f"`{name}`" for name in cases.NAMES)


def ordering() -> str:
    """The order the entries apply in, with the third-party patches where they go."""
    lines = ["| # | entry | kind | applied after |", "|---|---|---|---|"]
    number = 0
    for entry in _catalogue.ENTRIES:
        if entry.kind == _catalogue.POLICY and number == len(_catalogue.PATCH_NAMES):
            lines.append("| | third-party patches, by distribution then entry-point name | fix or guard | |")
        number += 1
        after = ", ".join(f"`{name}`" for name in patches.load_patch(entry.name).after)
        lines.append(f"| {number} | `{entry.name}` | {entry.kind} | {after} |")
    return "\n".join(lines)


def _code_if_error(symptom: str) -> str:
    # An exception message reads best as code, a described wrong value as prose; a symptom that
    # starts with the message and goes on after "; " is both (only the message in code).
    if not re.match(r"^[A-Z]\w*Error:", symptom):
        return symptom
    message, sep, prose = symptom.partition("; ")
    return f"`{message}`{sep}{prose}"


def toggle_rows() -> str:
    header = "| Variable | Values | Default | Effect |\n|---|---|---|---|\n"
    return header + "\n".join(
        f"| `{patch.toggle}` | boolean | on | [`{patch.name}`](patches/{patch.name}.md) on/off: {patch.summary}. |"
        for patch in _fixes()
    )


LINE_LENGTH = 120  # pyproject.toml [tool.ruff] line-length: the docstring list is source code too


def init_list() -> str:
    width = max(len(name) for name in _catalogue.PATCH_NAMES) + 4
    items = []
    for patch in _fixes():
        bullet = f"* {('``' + patch.name + '``').ljust(width)} – "
        # continuation lines start under the summary's first word (reST list item)
        items.append(textwrap.fill(
            f"{patch.summary}.", width=LINE_LENGTH, initial_indent=bullet, subsequent_indent=" " * len(bullet),
            break_long_words=False, break_on_hyphens=False,
        ))
    return "\n".join(items)


# The fixes and guards fsdp-autopatch 0.2.0 shipped; the changelog lists every later one (``entries``).
IN_0_2_0 = frozenset({
    "accumulated_grad_guard", "unused_param_reduction", "uniform_reduce_dtype", "restore_unused_param_grads",
    "post_forward_mesh_cache", "grouped_module_reuse", "keep_param_attributes", "clip_grad_norm_multi_mesh",
})


def changelog_entries() -> str:
    """One line per fix and guard added since 0.2.0: what a release note says of it, from its
    declaration (its page holds the rest: symptom, versions, measurements)."""
    lines = ["Fixes and guards added since 0.2.0 (each on by default; its page says what it fixes and where):", ""]
    for patch in _fixes():
        if patch.name in IN_0_2_0:
            continue
        upstream = f"; {', '.join(patch.upstream)}" if patch.upstream else ""
        lines.append(f"- [`{patch.name}`](docs/patches/{patch.name}.md) ({patch.kind}, torch "
                     f"{torch_range(patch.affected)}{upstream}): {patch.summary}.")
    return "\n".join(lines)


def expected_rows() -> str:
    """Per fix and guard, the registry status each measured release must report (tests/expected.py,
    which the tests and the matrix runner check): the rows the next full matrix run writes."""
    sys.path.insert(0, str(ROOT / "tests"))
    import expected

    releases = [release for release in expected.MEASURED if release >= expected.OLDEST_RUNNABLE]
    lines = ["| entry | " + " | ".join(expected.release_text(r) for r in releases) + " |",
             "|---|" + "---|" * len(releases)]
    statuses = {release: expected.expected_status(release) for release in releases}
    for name in expected.PATCHES:
        lines.append(f"| [`{name}`](patches/{name}.md) | " + " | ".join(statuses[r][name] for r in releases) + " |")
    return "\n".join(lines)


def added_since() -> str:
    """The fixes and guards the last full matrix run did not have (its registry header does not name
    them): their measurements are on their pages, from their own tests per release."""
    text = (ROOT / "docs" / "compatibility.md").read_text()
    block = text[text.index("<!-- matrix:begin -->"):text.index("<!-- matrix:end -->")]
    header = next(line for line in block.splitlines() if line.startswith("| torch | Python | run |"))
    in_the_run = {cell.strip() for cell in header.split("|")}
    newer = [patch for patch in _fixes() if patch.name not in in_the_run]
    if not newer:
        return "Every fix and guard was in that run."
    lines = ["Added since that run, not yet in its table (each page says on which releases its own tests measured",
             "it, and which were read, not run):", ""]
    lines += [f"- [`{patch.name}`](patches/{patch.name}.md) ({patch.kind}, torch {torch_range(patch.affected)})"
              for patch in newer]
    return "\n".join(lines)


# file -> [(block name, generator, comment style)]
TARGETS = {
    ROOT / "README.md": [("patches", readme_table, "html"), ("demo-bugs", demo_bugs, "html")],
    ROOT / "docs" / "configuration.md": [("toggles", toggle_rows, "html")],
    ROOT / "docs" / "how-it-works.md": [("ordering", ordering, "html")],
    ROOT / "docs" / "compatibility.md": [("expected", expected_rows, "html"), ("added-since", added_since, "html")],
    ROOT / "CHANGELOG.md": [("entries", changelog_entries, "html")],
    ROOT / "src" / "fsdp_autopatch" / "__init__.py": [("patches", init_list, "rst")],
}
_MARKERS = {
    "html": ("<!-- generated: {name} -->", "<!-- end generated -->"),
    "rst": (".. generated: {name}", ".. end generated"),
}


def render(text: str, name: str, body: str, style: str) -> str:
    begin, end = (marker.format(name=name) for marker in _MARKERS[style])
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"gen_docs: marker {begin!r} not found")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text, count=1)


def expected_files() -> dict[Path, str]:
    result = {}
    for path, blocks in TARGETS.items():
        text = path.read_text()
        for name, generate, style in blocks:
            text = render(text, name, generate(), style)
        result[path] = text
    return result


def stale() -> list[str]:
    """Unified diffs of every generated block that differs from the declarations."""
    diffs = []
    for path, text in expected_files().items():
        current = path.read_text()
        if current != text:
            name = str(path.relative_to(ROOT))
            diffs.append("".join(difflib.unified_diff(current.splitlines(True), text.splitlines(True), name, name)))
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a generated block is stale")
    args = parser.parse_args(argv)
    if args.check:
        diffs = stale()
        sys.stdout.write("".join(diffs))
        return 1 if diffs else 0
    changed = []
    for path, text in expected_files().items():
        if path.read_text() != text:
            path.write_text(text)
            changed.append(str(path.relative_to(ROOT)))
    print(f"gen_docs: rewrote {', '.join(changed)}" if changed else "gen_docs: every generated block is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
