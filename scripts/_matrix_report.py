"""The compatibility matrix's tables: markdown from the runs' results, and docs/compatibility.md.

Split from scripts/matrix.py (which runs the releases); ``--report-only`` merges earlier runs'
``matrix.json`` files through here. Stdlib only.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"
PY_BEGIN, PY_END = "<!-- python-matrix:begin -->", "<!-- python-matrix:end -->"


def load_expected():
    spec = importlib.util.spec_from_file_location("fsdp_autopatch_expected", ROOT / "tests" / "expected.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXPECTED = load_expected()


def log(message: str) -> None:
    sys.stdout.write(f"[{dt.datetime.now():%H:%M:%S}] {message}\n")  # one write: two threads log
    sys.stdout.flush()


SHORT = {
    "applied": "applied", "not_needed": "not needed", "disabled": "disabled", "unsupported": "UNSUPPORTED",
    "failed": "FAILED",
}


def status_cell(result: dict, patch: str) -> str:
    reg = result.get("registry", {})
    got = reg.get("patches", {}).get(patch, {}).get("status")
    if got is None:
        return "—"
    text = SHORT.get(got, got)
    return text if got == reg.get("expected", {}).get(patch) else f"**{text}** (expected {reg['expected'][patch]})"


def one_line(text: str) -> str:
    """A measured text fit for a table cell or a note line: error messages carry newlines (which
    end a markdown row) and ``|`` (which ends a cell, as in ``max |diff|``)."""
    return " ".join(text.split()).replace("|", "\\|")


def bug_cell(result: dict, bug: str) -> str:
    """``off: reproduces (the symptom) ✓ · on: correct``; ✓ / ✗: the *off* outcome against tests/expected.py."""
    if "tests" not in result:
        return "not run (gloo lacks AVG)"
    cell = result["tests"]["bugs"].get(bug)
    if not cell:
        return "not observed"
    off = "; ".join(cell.get("off", ["—"]))
    if "expected_off" not in cell:
        mark = ""
    else:
        mark = " ✓" if off.startswith(cell["expected_off"]) else f" ✗ (expected {cell['expected_off']})"
    all_correct = cell.get("on") and all(o.startswith("correct") for o in cell["on"])
    on = "correct" if all_correct else "; ".join(cell.get("on", ["—"]))
    return one_line(f"off: {off}{mark}") + "<br>" + one_line(f"on: {on}")


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        f"Measured {meta['date']} on {meta['machine']} by `python3 scripts/matrix.py` "
        f"(fsdp-autopatch {meta['plugin']}, wheel built from commit `{meta['commit']}`); "
        f"total wall time {meta['wall_minutes']} min, largest venv {meta['max_venv_mb']} MB.",
        "",
        "**Registry** (status of each patch after `import torch.distributed.fsdp`, defaults on):",
        "",
        "| torch | Python | run | " + " | ".join(EXPECTED.PATCHES) + " | tests (passed / failed / skipped) |",
        "|---|---|---|" + "---|" * len(EXPECTED.PATCHES) + "---|",
    ]
    for r in results:
        reg = r.get("registry", {})
        tests = r.get("tests")
        t = f"{tests['passed']} / {tests['failed']} / {tests['skipped']}" if tests else "—"
        lines.append(
            f"| {reg.get('torch', r['release'] + ' (install failed)')} | {row_python(r)} | {r['mode']} | "
            + " | ".join(status_cell(r, p) for p in EXPECTED.PATCHES)
            + f" | {t} |"
        )
    lines += [
        "",
        "**Bugs** (what each patch's 2-rank gloo scenario gives with that patch disabled (*off*; ✓: as "
        "`tests/expected.py` says for the release) and with the plugin active (*on*; *correct*: the values "
        "equal a single-process reference, `grad is None` and weights unchanged where they must be)):",
        "",
    ]
    for patches in _columns_of(EXPECTED.PATCHES, BUG_COLUMNS_PER_TABLE):
        lines += bug_table(results, patches)
    for r in results:
        for text in r.get("tests", {}).get("bugs", {}).get("note", {}).get("on", []):
            lines += ["", f"Note on torch {r.get('registry', {}).get('torch', r['release'])}: {one_line(text)}"]
    problems = [r for r in results if not r["ok"]]
    lines += ["", "All releases match their expectations." if not problems else
              "Releases that do NOT match: " + ", ".join(r["release"] for r in problems)]
    return "\n".join(lines) + "\n"


BUG_COLUMNS_PER_TABLE = 4  # eight bugs side by side would not fit a page: tables of four


def _columns_of(items, width):
    return [items[i : i + width] for i in range(0, len(items), width)]


def bug_table(results: list[dict], patches) -> list[str]:
    """One markdown table: a row per release, a column per patch's bug (``(a) accumulated_grad_guard``)."""
    bugs = [EXPECTED.BUG_OF[p] for p in patches]
    lines = [
        "| torch | " + " | ".join(f"({EXPECTED.BUG_OF[p]}) `{p}`" for p in patches) + " |",
        "|---|" + "---|" * len(patches),
    ]
    for r in results:
        torch_version = r.get("registry", {}).get("torch", r["release"])
        lines.append(f"| {torch_version} | " + " | ".join(bug_cell(r, b) for b in bugs) + " |")
    return lines + [""]


def update_docs(table: str, begin: str = BEGIN, end: str = END) -> None:
    doc = ROOT / "docs" / "compatibility.md"
    text = doc.read_text()
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{begin}\n{table}{end}{tail}")
    log(f"updated {doc.relative_to(ROOT)}")


def row_python(result: dict) -> str:
    return result.get("python") or result.get("registry", {}).get("python", "?")


def python_markdown(results: list[dict]) -> str:
    """One row per interpreter x torch: did the registry match, the tests' counts, the minutes."""
    lines = [
        "| Python | torch | registry | tests (passed / failed / skipped) | minutes (install + tests) | measured |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (_version_key(row_python(r)), EXPECTED.release_of(r["release"]))):
        reg, tests = r.get("registry", {}), r.get("tests")
        registry = "install failed" if not r["install"]["ok"] else ("matches" if reg.get("ok") else "**MISMATCH**")
        no_tests = "— (structural checks only)"
        counts = f"{tests['passed']} / {tests['failed']} / {tests['skipped']}" if tests else no_tests
        test_s = reg.get("seconds", 0) + (tests["seconds"] if tests else 0)
        lines.append(
            f"| {row_python(r)} | {reg.get('torch', r['release'])} | {registry} | {counts} | "
            f"{r['install']['seconds'] / 60:.1f} + {test_s / 60:.1f} | {r.get('measured', '')} |"
        )
    return "\n".join(lines) + "\n"


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def report_only(files: list[Path], out: Path, docs: bool, python_docs: bool = False) -> int:
    by_row: dict[tuple[str, str], dict] = {}
    metas = []
    for path in files:
        data = json.loads(path.read_text())
        metas.append(data["meta"])
        for result in data["results"]:
            result.setdefault("measured", f"{data['meta']['date']}, commit {data['meta']['commit']}")
            # a later file's row replaces an earlier one's for the same torch on the same Python
            by_row[(result["release"], row_python(result))] = result
    results = [by_row[k] for k in sorted(by_row, key=lambda k: (EXPECTED.release_of(k[0]), _version_key(k[1])))]
    commits = sorted({m["commit"] for m in metas})
    meta = {
        **metas[-1],
        "commit": " + ".join(commits),
        "wall_minutes": round(sum(m["wall_minutes"] for m in metas), 1),  # the merged runs together
        "max_venv_mb": max(m["max_venv_mb"] for m in metas),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    table = markdown(results, meta)
    if len({r["measured"] for r in results}) > 1:
        table += "\nRows merged from several runs: " + "; ".join(
            f"torch {r.get('registry', {}).get('torch', r['release'])}: {r['measured']}" for r in results
        ) + ".\n"
    (out / "matrix.md").write_text(table)
    (out / "python.md").write_text(python_markdown(results))
    if docs:
        update_docs(table)
    if python_docs:
        update_docs(python_markdown(results), PY_BEGIN, PY_END)
    log(f"results: {out / 'matrix.json'}, {out / 'matrix.md'}, {out / 'python.md'}")
    return 0 if all(r["ok"] for r in results) else 1
