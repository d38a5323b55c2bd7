"""The compatibility matrix's tables: markdown from the runs' results, and docs/compatibility.md.

Split from scripts/matrix.py (which runs the releases); ``--report-only`` merges earlier runs'
``matrix.json`` files through here. A release that tests/expected.py has not measured (torch 2.16
on its first run) is shown as measured and marked "first measurement": its cells are not compared
with expectations (there are none), only what is wrong on any release is marked (``FAILED``, a
failing test). Stdlib only.
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


FIRST = "first measurement"


def torch_cell(result: dict) -> str:
    """The row's torch: the installed version, marked where tests/expected.py has no expectations."""
    if not result["install"]["ok"]:
        return f"{result['release']} (install failed)"  # nothing measured, first or not
    text = result.get("registry", {}).get("torch") or result["release"]
    return f"{text} ({FIRST})" if result.get("first_measurement") else text


def status_cell(result: dict, patch: str) -> str:
    reg = result.get("registry", {})
    got = reg.get("patches", {}).get(patch, {}).get("status")
    if got is None:
        return "—"
    text = SHORT.get(got, got)
    want = reg.get("expected", {}).get(patch)
    if want in (None, EXPECTED.NOT_MEASURED):  # a first measurement: what was measured, no verdict
        return f"**{text}**" if got in EXPECTED.ALWAYS_WRONG else text
    return text if got == want else f"**{text}** (expected {want})"


def one_line(text: str) -> str:
    """A measured text fit for a table cell or a note line: error messages carry newlines (which
    end a markdown row) and ``|`` (which ends a cell, as in ``max |diff|``)."""
    return " ".join(text.split()).replace("|", "\\|")


def bug_cell(result: dict, bug: str) -> str:
    """``off: reproduces (the symptom) ✓ · on: correct``; ✓ / ✗: the *off* outcome against what the
    test expected (tests/expected.py; on a first measurement what the patch's own status claims,
    and no mark where it claims nothing)."""
    if "tests" not in result:
        if not result["install"]["ok"]:
            return "not run (install failed)"
        return "not run (gloo lacks AVG)" if result.get("mode") != "full" else "not run"
    cell = result["tests"]["bugs"].get(bug)
    if not cell:
        return "not observed"
    off = "; ".join(cell.get("off", ["—"]))
    if cell.get("expected_off") in (None, EXPECTED.NOT_MEASURED):
        mark = ""
    else:
        mark = " ✓" if off.startswith(cell["expected_off"]) else f" ✗ (expected {cell['expected_off']})"
    all_correct = cell.get("on") and all(o.startswith("correct") for o in cell["on"])
    on = "correct" if all_correct else "; ".join(cell.get("on", ["—"]))
    return one_line(f"off: {off}{mark}") + "<br>" + one_line(f"on: {on}")


def recorded_patches(results: list[dict]) -> list[str]:
    """The patches of tests/expected.py that some release of this run recorded (a run made before
    a patch existed renders as it was; one whose registry recorded nothing shows every column)."""
    seen = {name for r in results for name in r.get("registry", {}).get("patches", {})}
    return [p for p in EXPECTED.PATCHES if p in seen] if seen else list(EXPECTED.PATCHES)


def markdown(results: list[dict], meta: dict) -> str:
    patches = recorded_patches(results)
    lines = [
        f"Measured {meta['date']} on {meta['machine']} by `python3 scripts/matrix.py` "
        f"(fsdp-autopatch {meta['plugin']}, wheel built from commit `{meta['commit']}`); "
        f"total wall time {meta['wall_minutes']} min, largest venv {meta['max_venv_mb']} MB.",
        "",
        "**Registry** (status of each patch after `import torch.distributed.fsdp`, defaults on):",
        "",
        "| torch | Python | run | " + " | ".join(patches) + " | tests (passed / failed / skipped) |",
        "|---|---|---|" + "---|" * len(patches) + "---|",
    ]
    for r in results:
        tests = r.get("tests")
        t = f"{tests['passed']} / {tests['failed']} / {tests['skipped']}" if tests else "—"
        lines.append(
            f"| {torch_cell(r)} | {row_python(r)} | {r['mode']} | "
            + " | ".join(status_cell(r, p) for p in patches)
            + f" | {t} |"
        )
    first = " (on a first measurement: as the patch's own status claims)" if any(
        r.get("first_measurement") for r in results) else ""
    lines += [
        "",
        "**Bugs** (what each patch's 2-rank gloo scenario gives with that patch disabled (*off*; ✓: as "
        f"`tests/expected.py` says for the release{first}) and with the plugin active (*on*; *correct*: the values "
        "equal a single-process reference, `grad is None` and weights unchanged where they must be)):",
        "",
    ]
    for columns in _columns_of(patches, BUG_COLUMNS_PER_TABLE):
        lines += bug_table(results, columns)
    for r in results:
        for text in r.get("tests", {}).get("bugs", {}).get("note", {}).get("on", []):
            lines += ["", f"Note on torch {r.get('registry', {}).get('torch', r['release'])}: {one_line(text)}"]
    return "\n".join(lines + [""] + verdict_lines(results)) + "\n"


def verdict_lines(results: list[dict]) -> list[str]:
    """The table's last lines: first measurements, problems, or that every release matches."""
    lines = []
    for r in results:
        if r.get("first_measurement") and r["ok"]:
            unsupported = ", ".join(r.get("registry", {}).get("unsupported") or [])
            lines.append(
                f"torch {r['registry'].get('torch', r['release'])}: {FIRST}. tests/expected.py has no "
                "expectations for this release, so the structural checks decided alone and nothing above "
                "is compared with a guess; no patch failed and every test passed."
                + (f" Unsupported (torch left untouched, not protected): {unsupported}." if unsupported else "")
                + " Review the row, then add the release to tests/expected.py."
            )
    problems = [r for r in results if not r["ok"]]
    for r in problems:
        reg = r.get("registry", {})
        found = [r["error"]] if "error" in r else []
        found += reg.get("problems", []) + ([reg["error"]] if "error" in reg else [])
        found += [f"{n} is {m['got']}, expected {m['expected']}" for n, m in reg.get("mismatches", {}).items()]
        tests = r.get("tests") or {}
        found += [f"test failed: {f}" for f in tests.get("failures", [])[:5]]
        label = " (not in tests/expected.py)" if r.get("first_measurement") else ""
        lines.append(f"**Problem on torch {reg.get('torch', r['release'])}**{label}: " + one_line("; ".join(found)))
    if not problems and not any(r.get("first_measurement") for r in results):
        lines.append("All releases match their expectations.")
    elif problems:
        lines.append("Releases that do NOT pass: " + ", ".join(r["release"] for r in problems))
    return lines


def docs_refusal(results: list[dict]) -> str | None:
    """Why these results must not go into docs/compatibility.md, or None: a row that did not
    even install measured nothing."""
    failed = [r["release"] for r in results if not r["install"]["ok"]]
    return f"torch {', '.join(failed)} did not install (no row measured)" if failed else None


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
        lines.append(f"| {torch_cell(r)} | " + " | ".join(bug_cell(r, b) for b in bugs) + " |")
    return lines + [""]


MATRIX_JSON = ROOT / "docs" / "compatibility-matrix.json"


def update_docs(table: str, begin: str = BEGIN, end: str = END, source: dict | None = None) -> None:
    """Rewrite one table in docs/compatibility.md; with ``source`` (the runs' merged JSON) also
    docs/compatibility-matrix.json, the file the unit tests render the table from: writing one
    without the other let the committed table and its JSON drift apart (a red CI, 2026-12-02)."""
    doc = ROOT / "docs" / "compatibility.md"
    text = doc.read_text()
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{begin}\n{table}{end}{tail}")
    log(f"updated {doc.relative_to(ROOT)}; now run scripts/gen_docs.py in the project's venv: its "
        "'added-since' block lists the entries this table lacks")
    if source is not None:
        MATRIX_JSON.write_text(json.dumps(source, indent=2) + "\n")
        log(f"updated {MATRIX_JSON.relative_to(ROOT)}")


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
        if not r["install"]["ok"]:
            registry = "install failed"
        elif r.get("first_measurement"):
            registry = FIRST if reg.get("ok") else f"**{FIRST}: problem**"
        else:
            registry = "matches" if reg.get("ok") else "**MISMATCH**"
        no_tests = "— (structural checks only)" if r["install"]["ok"] and r.get("mode") != "full" else "—"
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
    merged = {"meta": meta, "results": results}
    (out / "matrix.json").write_text(json.dumps(merged, indent=2))
    table = markdown(results, meta)
    if len({r["measured"] for r in results}) > 1:
        table += "\nRows merged from several runs: " + "; ".join(
            f"torch {r.get('registry', {}).get('torch', r['release'])}: {r['measured']}" for r in results
        ) + ".\n"
    (out / "matrix.md").write_text(table)
    (out / "python.md").write_text(python_markdown(results))
    refusal = docs_refusal(results) if docs or python_docs else None
    if refusal:
        log(f"docs/compatibility.md left as it is: {refusal}")
    if docs and not refusal:
        update_docs(table, source=merged)
    if python_docs and not refusal:
        update_docs(python_markdown(results), PY_BEGIN, PY_END)
    log(f"results: {out / 'matrix.json'}, {out / 'matrix.md'}, {out / 'python.md'}")
    return 0 if all(r["ok"] for r in results) else 1
