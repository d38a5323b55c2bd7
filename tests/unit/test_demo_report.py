"""What the demo prints, without running it: the registry table lines up for every catalogue name."""

from __future__ import annotations

from fsdp_autopatch import _catalogue
from fsdp_autopatch._columns import WIDTH
from fsdp_autopatch.demo._report import _print_registry

STATUSES = ("applied", "not_needed", "unsupported", "disabled")


def test_registry_table_lines_up_for_every_catalogue_name(capsys):
    names = [entry.name for entry in _catalogue.ENTRIES if entry.kind != _catalogue.POLICY]
    patches = [{"name": name, "status": STATUSES[i % len(STATUSES)],
                "reason": f"torch 2.13.0: the reason of {name}, long enough to be cut at the edge " * 2}
               for i, name in enumerate(names)]
    _print_registry({"registry": {"version": "0.2.0", "torch": "2.13.0+cpu", "bootstrap": "pth", "patches": patches}})
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == len(names)
    longest = max(map(len, names))
    for line, patch in zip(lines, patches):
        assert len(line) <= WIDTH, line
        assert line.startswith(f"  {patch['name']} ")  # whole names, in order
        assert line[2 + longest + 2:].startswith(patch["status"] + " ")  # one status column for all
        assert line.endswith("...") and "torch 2.13.0: the reason of" in line


def test_guard_demo_prints_the_guard_error_whole(monkeypatch, capsys):
    """``demo --bug <guard>`` shows the guard's whole message: what the user's own run will print."""
    from fsdp_autopatch import cases
    from fsdp_autopatch._events import stop
    from fsdp_autopatch.demo import _bugs
    from fsdp_autopatch.demo._scenarios import Scenario
    from fsdp_autopatch.demo._subrun import RunResult

    name = "optimizer_unsharded_params_guard"
    error = stop(name, "the optimizer holds " + ", ".join(f"layer{i}.weight [8, 8]" for i in range(12)),
                 "build the optimizer before the first forward, or pass reshard_after_forward=True")
    stopped = cases.verdict(name, {"error": cases.error_record(error)}, 2)

    def fake_run(show, patched, timeout_s):
        rank0 = stopped if patched else {"right": False, "value": "the head did not move"}
        return RunResult(Scenario("bug", "t"), 1.0, [0, 0], [rank0, {}], ["", ""], [], ["", ""], False, 60.0)

    monkeypatch.setattr(_bugs, "_run", fake_run)
    assert _bugs.demo_bug(name) == 0
    out = capsys.readouterr().out
    assert f"    GuardError: {error}\n" in out and len(str(error)) > 400
    assert f"set FSDP_AUTOPATCH_{name.upper()}_ENABLED=0." in out  # the message's last words
