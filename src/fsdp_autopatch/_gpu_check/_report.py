"""``fsdp-autopatch gpu-check``'s verdicts, JSON report and printed table, from what the launches'
ranks wrote. Standard library only.
"""

from __future__ import annotations

import re
from typing import Any

from ._plan import COMPILE_MODES, COMPILE_STEPS, PATCHES, TRAINING, agrees, strikes


def _first_line(text: str, limit: int = 110) -> str:
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    line = re.sub(r"^\[(enforce fail at )?/[^\]]*\]\s*", "", line)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _native_error(tail: str) -> str:
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for line in reversed(lines):
        if line.startswith("what():"):
            return line[len("what():"):].strip()
    return lines[-1] if lines else "no output"


def outcome(launch: dict[str, Any] | None, case: str) -> dict[str, Any]:
    """One case of one launch: right or not, and what happened (rank 0's value, else the first error)."""
    if launch is None:
        return {"ran": False, "right": False, "text": "not run"}
    if launch.get("skipped"):
        return {"ran": False, "right": False, "text": f"not run: {launch['skipped']}"}
    entries = [(rank, (r or {}).get("cases", {}).get(case)) for rank, r in enumerate(launch["ranks"])]
    errors = [(rank, e["error"]) for rank, e in entries if e and e.get("error")]
    rank0 = entries[0][1] if entries else None
    if errors:
        rank, error = errors[0]
        text = f"{error['type']}: {_first_line(error['message'])} (rank {rank})"
        return {"ran": True, "right": False, "text": text, "error": error["type"],
                "seconds": (rank0 or {}).get("seconds")}
    if rank0 is not None and all(e is not None for _, e in entries):
        return {"ran": True, "right": bool(rank0["right"]), "text": rank0.get("value", ""),
                "seconds": rank0.get("seconds"), **({"process_groups": rank0["process_groups"]}
                                                    if "process_groups" in rank0 else {})}
    # a rank died or was killed before it recorded the case
    for rank, code in enumerate(launch["returncodes"]):
        if rank in launch["killed"]:
            continue
        if code not in (0, None) and not (launch["ranks"][rank] or {}).get("cases", {}).get(case):
            return {"ran": True, "right": False, "error": f"exit {code}",
                    "text": f"rank {rank} aborted (exit {code}): {_first_line(_native_error(launch['tails'][rank]))}"}
    where = "; ".join(f"rank {r}: {(launch['ranks'][r] or {}).get('where', '?')}" for r in launch["killed"])
    return {"ran": True, "right": False, "error": "timeout",
            "text": f"killed after {launch['seconds']:.0f} s (outer timeout or a peer failed): {where}"}


UNSUPPORTED_NOTE = ("unsupported on this torch: the plugin leaves torch as it is, so both runs show torch's own "
                    "behaviour; recorded, not judged")


def patch_rows(launches: dict[str, dict], world_size: int, expected: dict[str, str],
               statuses: dict[str, str] | None = None, letters: dict[str, str] | None = None,
               device: str = "cpu") -> dict[str, Any]:
    """Per patch its case with the plugin on and with that patch off. ``expected``: per entry what
    its case shows with its patch off (``--expected``; empty: the off-runs are recorded, not judged);
    ``letters``: per entry its bug's letter there. ``statuses``: the plugin's own record on this torch
    (the probe's); where a patch is ``unsupported`` its on-run is recorded, not judged (torch is left
    untouched there)."""
    rows, statuses, letters = {}, statuses or {}, letters or {}
    planned = (launches.get("plugin on: bug cases") or {}).get("cases") or []
    for patch in PATCHES:
        can, ran, why = strikes(patch.name, world_size, device)
        row: dict[str, Any] = {"bug": letters.get(patch.name, "-"), "case": patch.what,
                               "strikes_at_this_world_size": can,
                               "note": why, "expected_off": expected.get(patch.name, "no expectation"),
                               "kind": patch.kind, "source": f"fsdp_autopatch.cases.{patch.name}"}
        if ran and patch.name not in planned:
            row["note"] = "not run (not selected with --only)"
        elif ran:
            row["on"] = outcome(launches.get("plugin on: bug cases"), patch.name)
            if statuses.get(patch.name) == "unsupported":
                row["on"]["judged"], row["note"] = False, UNSUPPORTED_NOTE
            if f"{patch.name} off" not in launches:  # its off-run not selected (--off-runs): no "off"
                row["off_agrees"] = None
                rows[patch.name] = row
                continue
            row["off"] = outcome(launches[f"{patch.name} off"], patch.name)
            row["bug_seen_off"] = row["off"]["ran"] and not row["off"]["right"]
            row["off_agrees"] = agrees(row["expected_off"], row["bug_seen_off"]) if row["off"]["ran"] else None
        rows[patch.name] = row
    return rows


def training_rows(launches: dict[str, dict], device: str) -> dict[str, Any]:
    rows = {}
    for flavour, what in TRAINING.items():
        if flavour == "train_offload" and device != "cuda":
            rows[flavour] = {"what": what, "skipped": "CPU offload needs a CUDA device: there is nothing to offload "
                                                      "from on a CPU run (and pinned memory needs CUDA)"}
            continue
        rows[flavour] = {"what": what, "on": outcome(launches.get("plugin on: training"), flavour),
                         "off": outcome(launches.get("plugin off: training"), flavour)}
    return rows


COMPILE_FIELDS = ("unavailable", "graph_breaks", "recompiles", "unique_graphs", "frames", "frames_converted",
                  "break_reasons", "recompile_reasons", "losses", "weights_sha256", "seconds")
COUNTERS = ("graph_breaks", "recompiles", "unique_graphs", "frames")


def _compile_side(launch: dict[str, Any] | None, mode: str) -> dict[str, Any]:
    result = outcome(launch, mode)
    side = {"ran": result["ran"], "text": result["text"]}
    if "error" in result:
        return {**side, "error": result["error"]}
    if result["ran"]:
        entry = launch["ranks"][0]["cases"][mode]  # type: ignore[index]
        side.update({k: entry[k] for k in COMPILE_FIELDS if k in entry})
    return side


def compile_rows(launches: dict[str, dict]) -> dict[str, Any]:
    """Per compile mode rank 0's counters with the plugin on and off, and whether the final weights
    are bitwise equal; ``unavailable`` where torch.compile cannot run here, ``skipped`` where the
    time guard left no time for it."""
    on, off = launches.get("plugin on: compile"), launches.get("plugin off: compile")
    modes = {}
    for mode, what in COMPILE_MODES.items():
        row = {"what": what, "on": _compile_side(on, mode), "off": _compile_side(off, mode)}
        digests = (row["on"].get("weights_sha256"), row["off"].get("weights_sha256"))
        row["weights_bitwise_equal"] = digests[0] == digests[1] if all(digests) else None
        modes[mode] = row
    out: dict[str, Any] = {"steps": COMPILE_STEPS, "modes": modes}
    skipped = [launch["skipped"] for launch in (on, off) if launch and launch.get("skipped")]
    if skipped or on is None or off is None:
        out["skipped"] = skipped[0] if skipped else "not planned"
    why = {side.get("unavailable") for row in modes.values() for side in (row["on"], row["off"])}
    if len(why) == 1 and None not in why:
        out["unavailable"] = why.pop()
    return out


def _compile_verdict(compiled: dict[str, Any], problems: list[str], findings: list[str]) -> None:
    """A mode the plugin-off run compiled and trained that raised (or aborted) with the plugin on is a
    problem; a timeout there, more graph breaks, recompiles, graphs or frames with the plugin on, and
    final weights that are not bitwise equal are findings."""
    for mode, row in compiled.get("modes", {}).items():
        on, off = row["on"], row["off"]
        if on.get("error") and "graph_breaks" in off:
            (findings if on["error"] == "timeout" else problems).append(
                f"compile {mode} with the plugin on: {on['text']} (plugin off: it ran)")
        more = [f"{k.replace('_', ' ')} {off[k]} -> {on[k]}" for k in COUNTERS
                if on.get(k) is not None and off.get(k) is not None and on[k] > off[k]]
        if more:
            findings.append(f"compile {mode}: more with the plugin on (off -> on): {', '.join(more)}")
        if row["weights_bitwise_equal"] is False:
            findings.append(f"compile {mode}: the final weights differ, plugin on vs off (losses on "
                            f"{on.get('losses')}, off {off.get('losses')})")


def cost_summary(launch: dict[str, Any] | None) -> dict[str, Any]:
    if launch is None or launch.get("skipped"):
        return {"error": (launch or {}).get("skipped", "not run")}
    rank0 = launch["ranks"][0] or {}
    cost = rank0.get("cost")
    if cost and "error" in cost:  # where it stopped, and what was raised, in one line
        error = cost["error"]
        return {"error": f"{error['type']}: {_first_line(error['message'], 160)} (rank 0, at {cost.get('where')})"}
    if not cost:
        return {"error": outcome(launch, "cost")["text"] if launch["returncodes"][0] else "no cost reported"}
    return cost


def verdict(report: dict[str, Any]) -> tuple[bool, list[str], list[str]]:
    """(ok, problems, findings): ok when every run case is right with the plugin on, the cost was
    measured, and no compile mode fails with the plugin on where it runs with it off; findings are
    plugin-off results that differ from ``--expected``, and compile modes where the plugin changes
    Dynamo's counters or the final weights."""
    problems, findings = [], []
    for name, row in report["patches"].items():
        if "on" in row and not row["on"]["right"] and row["on"].get("judged", True):
            problems.append(f"{name} with the plugin on: {row['on']['text']}")
        if row.get("off_agrees") is False:
            findings.append(f"{name} off: expected '{row['expected_off']}', got: {row['off']['text']}")
    for name, row in report["training"].items():
        if "on" in row and not row["on"]["right"]:
            problems.append(f"{name} with the plugin on: {row['on']['text']}")
    cost = report["cost"]
    if "skipped" in cost:
        pass
    elif "error" in cost or not all("off" in c["variants"] and "on" in c["variants"] for c in cost["cases"].values()):
        problems.append(f"step cost: {cost.get('error', 'a variant is missing')}")
    _compile_verdict(report.get("compile", {}), problems, findings)
    return not problems, problems, findings


def _cell(result: dict[str, Any] | None, off: bool) -> str:
    if result is None:
        return "-"
    if not result["ran"]:
        return result["text"]
    if result["right"]:
        return "right"
    if not result.get("judged", True):
        return "recorded: " + result["text"]
    return ("BUG: " if off else "WRONG: ") + result["text"]


def table(report: dict[str, Any]) -> str:
    m = report["machine"]
    out = [f"fsdp-autopatch GPU check: {report['device']} ({', '.join(m.get('device_names') or ['CPU'])}), "
           f"torch {m.get('torch')}, {report['backend']}, world size {report['world_size']}, "
           f"{report['seconds']:.0f} s; plugin {report['plugin'].get('version')} from "
           f"{report['plugin'].get('wheel') or report['plugin'].get('file')}, bootstrap "
           f"{report['plugin'].get('bootstrap')}", ""]
    out.append(f"{'patch':<34} {'bug':<3} {'hits':<5} {'plugin on':<10} {'off agrees':<10} "
               "plugin off (that patch's variable =0)")
    if not any(row["bug"] != "-" for row in report["patches"].values()):
        out.append("(bug letters and 'off agrees' come from --expected tests/expected.py; hits: the bug can "
                   "strike at this world size)")
    for name, row in report["patches"].items():
        if "on" not in row:
            here = "yes" if row["strikes_at_this_world_size"] else "no"
            out.append(f"{name:<34} {row['bug']:<3} {here:<5} {'-':<10} {'-':<10} {row['note']}")
            continue
        agree = {True: "yes", False: "NO", None: "-"}[row["off_agrees"]]
        here = "yes" if row["strikes_at_this_world_size"] else "no"
        out.append(f"{name:<34} {row['bug']:<3} {here:<5} {_cell(row['on'], False)[:10]:<10} {agree:<10} "
                   f"{_cell(row['off'], True) if 'off' in row else 'not run (--off-runs)'}")
        if row["note"] and (row["strikes_at_this_world_size"] is False or not row["on"].get("judged", True)):
            out.append(f"{'':<38}({row['note']})")
    out += ["", "training, the first four bugs at once (bf16 params, fp32 reduce, accumulation, fill on):"]
    for row in report["training"].values():
        if "skipped" in row:
            out.append(f"  {row['what']:<36} skipped: {row['skipped']}")
            continue
        out.append(f"  {row['what']:<36} on: {_cell(row['on'], False)}")
        out.append(f"  {'':<36} off (FSDP_AUTOPATCH_ENABLED=0): {_cell(row['off'], True)}")
    out += ["", _compile_table(report["compile"]), "", _cost_table(report["cost"])]
    ok, problems, findings = report["ok"], report["problems"], report["findings"]
    out.append("")
    out += [f"PROBLEM: {p}" for p in problems] + [f"finding: {f}" for f in findings]
    out.append(f"gpu check: {'OK' if ok else 'FAILED'} (report: {report['report_path']})")
    return "\n".join(out)


def _cost_table(cost: dict[str, Any]) -> str:
    if "error" in cost or "skipped" in cost:
        return f"step cost: {cost.get('error') or 'not run (' + cost['skipped'] + ')'}"
    lines = [f"step cost ({cost['timer']}; ~{cost['parameters_approx']:,} parameters, "
             f"{cost['spec']['rounds']} rounds x {cost['spec']['steps']} steps per variant, medians):",
             f"  {'case':<9} {'variant':<15} {'step ms':>9} {'ratio':>7} {'paired':>7} {'host ms':>8} "
             f"{'restore us':>10} {'tolist us':>9} {'tolist/st':>9} {'syncs':>5} {'peak MiB':>9}"]
    for case, summary in cost["cases"].items():
        for variant, v in summary["variants"].items():
            ratio = f"{v['ratio_to_off']:.3f}" if "ratio_to_off" in v else "-"
            paired = f"{v['paired_block_ratio']:.3f}" if "paired_block_ratio" in v else "-"
            peak = f"{v['peak_mib']:.0f}" if v["peak_mib"] is not None else "n/a"
            syncs = "n/a" if v.get("host_syncs_per_restore") is None else str(v["host_syncs_per_restore"])
            lines.append(f"  {case:<9} {variant:<15} {v['step_ms']:>9.2f} {ratio:>7} {paired:>7} {v['host_ms']:>8.2f} "
                         f"{v['restore_us_per_step']:>10.1f} {v['tolist_us_per_step']:>9.1f} "
                         f"{v['tolist_calls_per_step']:>9.1f} {syncs:>5} {peak:>9}")
    lines.append("  (step ms: CUDA events around each step, the GPU's timeline with its idle gaps; restore us: "
                 "time in the restore after backward; tolist us: blocked in its packed.tolist(); syncs: host syncs "
                 "in one restore, as torch.cuda.set_sync_debug_mode reports them)" if cost["timer"] == "cuda events"
                 else "  (step ms: time.perf_counter around each step; restore us: time in the restore after "
                      "backward; tolist us: blocked in its packed.tolist(); no peak memory or sync count on CPU)")
    return "\n".join(lines)


def _side_text(side: dict[str, Any]) -> str:
    if side.get("unavailable"):
        return f"not run: {side['unavailable']}"
    return side["text"] if "error" in side or not side["ran"] else "ran"


def _compile_table(compiled: dict[str, Any]) -> str:
    """The compile modes, at most 100 columns: dynamo's counters off -> on, the weights on vs off."""
    head = f"torch.compile ({compiled['backend']})"
    if "unavailable" in compiled or "skipped" in compiled:
        return f"{head}: not run: {compiled.get('unavailable') or compiled['skipped']}"
    lines = [f"{head}, {compiled['steps']} steps: Dynamo's counters on rank 0, plugin off -> on",
             f"  {'mode':<40} {'breaks':>9} {'recompiles':>10} {'graphs':>9} {'frames':>9}  weights on/off"]
    for row in compiled["modes"].values():
        on, off = row["on"], row["off"]
        if not all(k in side for k in COUNTERS for side in (on, off)):
            lines.append(f"  {row['what']:<40} off: {_side_text(off)}"[:100])
            lines.append(f"  {'':<40} on: {_side_text(on)}"[:100])
            continue
        cells = [f"{off[k]} -> {on[k]}" for k in COUNTERS]
        same = {True: "bitwise equal", False: "DIFFER", None: "-"}[row["weights_bitwise_equal"]]
        lines.append(f"  {row['what']:<40} {cells[0]:>9} {cells[1]:>10} {cells[2]:>9} {cells[3]:>9}  {same}")
        for key, reasons in (("graph_breaks", "break_reasons"), ("recompiles", "recompile_reasons")):
            if on[key] != off[key] and on.get(reasons):  # the most frequent, without Dynamo's explanation
                reason = on[reasons][0].split(" Explanation:")[0]
                lines.append(f"      on, {reasons.replace('_', ' ')[:-1]}: {reason}"[:100])
    lines.append("  (frames: distinct frames compiled; weights: rank 0's after the steps, in which every rank uses\n"
                 "   every parameter, so no bug strikes; the reasons and losses: report.json)")
    return "\n".join(lines)
