"""Fault injection on the start-up path, in fresh interpreters against a tiny fake torch (fast).

Each case asserts the four promises of "costs nothing when idle, never breaks a run":

1. the interpreter starts (exit status 0, no traceback);
2. ``import torch.distributed.fsdp`` succeeds (the fake torch has the FSDP2 module the hook waits
   for, but none of the internals the patches wrap, so every enabled patch ends ``unsupported``);
3. the registry says what happened (exact status per patch, and the reason);
4. nothing is printed unless asked: stdout holds only the program's JSON, stderr is empty except for
   the documented one-line ``ConfigWarning`` per bad variable or the log lines
   ``FSDP_AUTOPATCH_LOG_LEVEL`` asks for.

The same faults against the real wheel and a real torch 2.13: ``tests/install/test_install_faults.py``.
Every child runs in its own process group, bounded by a timeout; a timeout kills the group and
fails the test with whatever the child printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from fsdp_autopatch.patches import PATCH_NAMES

pytestmark = pytest.mark.timeout(300)

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "src"))
# PATCH_NAMES: the catalogue's fixes and guards, standard library only
ALL = frozenset(PATCH_NAMES)

FAKE_TORCH = {
    "torch/__init__.py": "__version__ = '2.13.0+fake'\n",
    "torch/distributed/__init__.py": "",
    "torch/distributed/fsdp/__init__.py": "from . import _fully_shard\n",
    "torch/distributed/fsdp/_fully_shard/__init__.py": "",
}


@pytest.fixture
def fake_torch(tmp_path):
    root = tmp_path / "fake_torch"
    for relative, text in FAKE_TORCH.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


# --- bounded children ----------------------------------------------------------------------------


def run_child(code, *, path=(), env=None, flags=(), timeout=60.0):
    """``python [flags] -c code`` in its own process group with ``path`` on PYTHONPATH (before our
    ``src``) and ``env`` added to a copy of this environment without ``FSDP_AUTOPATCH_*``.

    A timeout kills the whole group and fails the test, showing the output so far. Afterwards no
    process of the group may be left (a child that leaves a grandchild behind fails the test)."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("FSDP_AUTOPATCH_") and k not in ("PYTHONWARNINGS", "PYTHONSTARTUP", "PYTHONDEVMODE")
    }
    environ["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in path), SRC])
    environ.update(env or {})  # values may be bytes (not valid UTF-8): Popen encodes str, passes bytes
    argv = [sys.executable, *flags, "-c", textwrap.dedent(code)]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=environ,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"timed out after {timeout} s (process group killed): {argv[:3]}...\n"
            f"--- stdout ---\n{stdout.decode(errors='replace')}\n--- stderr ---\n{stderr.decode(errors='replace')}",
            pytrace=False,
        )
    except BaseException:  # pytest-timeout, Ctrl-C: leave nothing behind
        _kill_group(process.pid)
        process.communicate()
        raise
    leftovers = _group_alive(process.pid)
    if leftovers:
        _kill_group(process.pid)
        pytest.fail(f"the child left processes of its group running: {leftovers}", pytrace=False)
    return subprocess.CompletedProcess(
        argv, process.returncode, stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace")
    )


def _kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid):
    """Live (not zombie) processes of the group, from /proc."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            alive.append(int(entry))
    return alive


def describe(result):
    return f"--- exit {result.returncode} ---\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


def json_of(result):
    """The program's single stdout line: nothing else may be printed there."""
    assert result.returncode == 0, describe(result)
    assert "Traceback" not in result.stderr, describe(result)
    lines = result.stdout.splitlines()
    assert len(lines) == 1, describe(result)
    return json.loads(lines[0])


def config_warnings(stderr):
    return [line for line in stderr.splitlines() if line.startswith("fsdp-autopatch") and "ConfigWarning" in line]


def warned_about(line):
    """The variable a ConfigWarning line is about (its first 64 characters, as the warning shows it)."""
    message = line.split("ConfigWarning: ", 1)[1]
    if message.startswith("unknown variable "):
        message = message[len("unknown variable ") :]
    for stop in ("=", " ", "..."):
        message = message.split(stop, 1)[0]
    return message[:64]


def statuses(report):
    return {p["name"]: p["status"] for p in report["patches"]}


def reasons(report):
    return {p["name"]: p["reason"] for p in report["patches"]}


# The user program: the start-up call the .pth makes (idempotent if this environment's .pth already
# made it), then the import every training script makes, then the registry.
PROGRAM = """
    import json, sys
    import _fsdp_autopatch_bootstrap as bootstrap
    bootstrap.install("pth")
    {pre}
    import torch.distributed.fsdp
    import fsdp_autopatch
    print(json.dumps({{
        "report": fsdp_autopatch.status().to_dict(),
        "triggers": sum(f is bootstrap for f in sys.meta_path),
    }}))
"""


def program(pre=""):
    return PROGRAM.format(pre=pre)


# --- at least 20 malformed environment values ---------------------------------------------------

LONG = "x" * 100_000  # a single environment string may be up to 128 KiB on Linux


def V(name):
    return f"FSDP_AUTOPATCH_{name.upper()}_ENABLED"


# id -> (environment, patches disabled, variables that must warn once each)
ENV_CASES = {
    "kill-empty": ({"FSDP_AUTOPATCH_ENABLED": ""}, set(), []),
    "kill-spaces": ({"FSDP_AUTOPATCH_ENABLED": "   "}, set(), []),
    "kill-padded-zero": ({"FSDP_AUTOPATCH_ENABLED": " \t0 \n"}, ALL, []),
    "kill-mixed-case": ({"FSDP_AUTOPATCH_ENABLED": "FaLsE"}, ALL, []),
    "kill-nbsp-padded": ({"FSDP_AUTOPATCH_ENABLED": "\u00a0off\u00a0"}, ALL, []),  # str.strip() strips NBSP
    "kill-fullwidth": ({"FSDP_AUTOPATCH_ENABLED": "\uff2f\uff26\uff26"}, set(), ["FSDP_AUTOPATCH_ENABLED"]),
    "kill-zero-width": ({"FSDP_AUTOPATCH_ENABLED": "0\u200b"}, set(), ["FSDP_AUTOPATCH_ENABLED"]),
    "kill-very-long": ({"FSDP_AUTOPATCH_ENABLED": LONG}, set(), ["FSDP_AUTOPATCH_ENABLED"]),
    "kill-not-utf8": ({"FSDP_AUTOPATCH_ENABLED": b"\xff\xfe0"}, set(), ["FSDP_AUTOPATCH_ENABLED"]),
    "kill-code": ({"FSDP_AUTOPATCH_ENABLED": "__import__('os')._exit(3)"}, set(), ["FSDP_AUTOPATCH_ENABLED"]),
    "patch-mixed-case": ({V("accumulated_grad_guard"): "oFf"}, {"accumulated_grad_guard"}, []),
    "patch-empty": ({V("uniform_reduce_dtype"): ""}, set(), []),
    "patch-spaces": ({V("uniform_reduce_dtype"): "  "}, set(), []),
    "patch-two-words": ({V("uniform_reduce_dtype"): "1 0"}, set(), [V("uniform_reduce_dtype")]),
    "patch-unicode": ({V("restore_unused_param_grads"): "n\u00f6"}, set(), [V("restore_unused_param_grads")]),
    "patch-long-padded-off": (
        {V("restore_unused_param_grads"): " " * 50_000 + "off"}, {"restore_unused_param_grads"}, []
    ),
    "list-empty": ({"FSDP_AUTOPATCH_DISABLED": ""}, set(), []),
    "list-only-commas": ({"FSDP_AUTOPATCH_DISABLED": " , ,, "}, set(), []),
    "list-mixed-case-spaces": ({"FSDP_AUTOPATCH_DISABLED": "  Uniform_Reduce_DTYPE ,"}, {"uniform_reduce_dtype"}, []),
    "list-star-padded": ({"FSDP_AUTOPATCH_DISABLED": " * "}, ALL, []),
    "list-star-and-name": ({"FSDP_AUTOPATCH_DISABLED": "*,accumulated_grad_guard"}, ALL, []),
    "list-star-and-unknown": ({"FSDP_AUTOPATCH_DISABLED": "*,bogus"}, ALL, ["FSDP_AUTOPATCH_DISABLED"]),
    "list-double-star": ({"FSDP_AUTOPATCH_DISABLED": "**"}, set(), ["FSDP_AUTOPATCH_DISABLED"]),
    "list-wrong-separator": (
        {"FSDP_AUTOPATCH_DISABLED": "uniform_reduce_dtype;restore_unused_param_grads"},
        set(),
        ["FSDP_AUTOPATCH_DISABLED"],
    ),
    "list-unicode-name": (
        {"FSDP_AUTOPATCH_DISABLED": "\u00fcnused,uniform_reduce_dtype"},
        {"uniform_reduce_dtype"},
        ["FSDP_AUTOPATCH_DISABLED"],
    ),
    "list-very-long": (
        {"FSDP_AUTOPATCH_DISABLED": "uniform_reduce_dtype," + LONG},
        {"uniform_reduce_dtype"},
        ["FSDP_AUTOPATCH_DISABLED"],
    ),
    "list-not-utf8": (
        {"FSDP_AUTOPATCH_DISABLED": b"\xff,accumulated_grad_guard"},
        {"accumulated_grad_guard"},
        ["FSDP_AUTOPATCH_DISABLED"],
    ),
    "unknown-variable": ({"FSDP_AUTOPATCH_ENABLE": "0"}, set(), ["FSDP_AUTOPATCH_ENABLE"]),
    "unknown-variable-very-long": ({"FSDP_AUTOPATCH_" + "Y" * 5_000: "1"}, set(), ["FSDP_AUTOPATCH_" + "Y" * 5_000]),
    "lowercase-variable-name": ({"fsdp_autopatch_enabled": "0"}, set(), []),  # names are case-sensitive
    "strict-unicode": ({"FSDP_AUTOPATCH_STRICT": "\u2713"}, set(), ["FSDP_AUTOPATCH_STRICT"]),
    "strict-on-with-unsupported": ({"FSDP_AUTOPATCH_STRICT": " TRUE "}, set(), []),  # unsupported never raises
    "log-level-unknown": ({"FSDP_AUTOPATCH_LOG_LEVEL": "verbose"}, set(), ["FSDP_AUTOPATCH_LOG_LEVEL"]),
    "policy-mixed-case": ({"FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS": "Yes"}, set(), []),
    "policy-garbage": (
        {"FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS": "y e s"}, set(), ["FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS"]
    ),
    "everything-at-once": (
        {
            "FSDP_AUTOPATCH_ENABLED": "maybe",
            V("accumulated_grad_guard"): "",
            V("unused_param_reduction"): "\u00a0No",
            "FSDP_AUTOPATCH_DISABLED": "*, x",
            "FSDP_AUTOPATCH_STRICT": "2",
            "FSDP_AUTOPATCH_LOG_LEVEL": " ",
            "FSDP_AUTOPATCH_TYPO": "",
        },
        ALL,
        ["FSDP_AUTOPATCH_ENABLED", "FSDP_AUTOPATCH_DISABLED", "FSDP_AUTOPATCH_STRICT", "FSDP_AUTOPATCH_TYPO"],
    ),
}


def test_there_are_at_least_20_malformed_values():
    assert len(ENV_CASES) >= 20


@pytest.mark.parametrize("case", list(ENV_CASES))
def test_malformed_environment_value(fake_torch, case):
    env, disabled, warned = ENV_CASES[case]
    result = run_child(program(), path=[fake_torch], env=env)
    data = json_of(result)
    report = data["report"]
    killed_at_start = any("at interpreter start (nothing armed)" in r for r in reasons(report).values())
    assert data["triggers"] == (0 if killed_at_start else 1), data  # armed once, or not at all
    expected = {name: "disabled" if name in disabled else "unsupported" for name in PATCH_NAMES}
    assert statuses(report) == expected, (report, describe(result))
    for name in PATCH_NAMES:
        reason = reasons(report)[name]
        if name in disabled:
            assert "disabled by FSDP_AUTOPATCH_" in reason, reason
        else:  # enabled: the hook ran and found the fake torch's internals missing
            assert "torch internals differ" in reason, reason
        assert len(reason) < 400, f"an environment value leaks unbounded into the registry: {len(reason)} chars"
    # Nothing on stderr but one warning per bad variable, each naming it, each short.
    lines = result.stderr.splitlines()
    warnings = config_warnings(result.stderr)
    assert lines == warnings, describe(result)
    assert len(warnings) == len(warned), describe(result)
    assert sorted(warned_about(w) for w in warnings) == sorted(v[:64] for v in warned), warnings
    assert all(len(w) < 600 for w in warnings), [len(w) for w in warnings]


def test_log_level_prints_only_what_was_asked(fake_torch):
    """``FSDP_AUTOPATCH_LOG_LEVEL`` (mixed case, padded) is the one way to ask for output."""
    result = run_child(program(), path=[fake_torch], env={"FSDP_AUTOPATCH_LOG_LEVEL": " info "})
    data = json_of(result)
    assert set(statuses(data["report"]).values()) == {"unsupported"}
    lines = result.stderr.splitlines()
    assert len(lines) == 1, describe(result)  # INFO: one summary line per process (each entry's: DEBUG)
    assert lines[0].startswith("fsdp-autopatch INFO: active on torch "), describe(result)
    assert f"{len(PATCH_NAMES)} unsupported" in lines[0], describe(result)


def test_code_in_environment_values_is_never_executed(fake_torch, tmp_path):
    """Every variable fsdp-autopatch reads, set to Python that would leave a file behind if anything
    evaluated it, at interpreter start (kill switch) and when the hook reads the rest."""
    marker = tmp_path / "evaluated"
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch() or '1'"
    env = {
        name: payload
        for name in (
            "FSDP_AUTOPATCH_ENABLED",
            "FSDP_AUTOPATCH_DISABLED",
            "FSDP_AUTOPATCH_STRICT",
            "FSDP_AUTOPATCH_LOG_LEVEL",
            "FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS",
            *(V(name) for name in PATCH_NAMES),
        )
    }
    env["FSDP_AUTOPATCH_" + payload.upper()] = payload  # an unknown variable whose *name* is code
    result = run_child(program(), path=[fake_torch], env=env)
    data = json_of(result)
    assert not marker.exists(), "an environment value was executed"
    assert set(statuses(data["report"]).values()) == {"unsupported"}  # every bad value kept its default
    assert result.stderr.splitlines() == config_warnings(result.stderr), describe(result)


# --- wrapt not installed or broken ---------------------------------------------------------------

BROKEN_WRAPT = {
    # id -> (wrapt/__init__.py, the reason the registry must give)
    "raises-on-import": (
        "raise RuntimeError('wrapt is broken')\n", "wrapt could not be imported (RuntimeError: wrapt is broken)"
    ),
    "no-hook-api": ("__version__ = '0.0'\n", "wrapt could not register the import hook (AttributeError:"),
    "hook-api-raises": (
        "def register_post_import_hook(hook, name):\n    raise OSError('read-only registry')\n",
        "wrapt could not register the import hook (OSError: read-only registry)",
    ),
}


@pytest.mark.parametrize("variant", list(BROKEN_WRAPT))
def test_broken_wrapt(fake_torch, tmp_path, variant):
    source, reason = BROKEN_WRAPT[variant]
    shadow = tmp_path / "shadow" / "wrapt"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(source)
    result = run_child(program(), path=[shadow.parent, fake_torch])
    data = json_of(result)
    assert result.stderr == "", describe(result)
    report = data["report"]
    # not "pending" forever: the registry says why nothing could be armed
    assert set(statuses(report).values()) == {"unsupported"}, report
    assert all(r.startswith(reason) for r in reasons(report).values()), report


def test_wrapt_not_installed(fake_torch):
    # None in sys.modules is how the import system spells "not importable" (ModuleNotFoundError).
    result = run_child(program(pre="sys.modules['wrapt'] = None"), path=[fake_torch])
    data = json_of(result)
    assert result.stderr == "", describe(result)
    report = data["report"]
    assert set(statuses(report).values()) == {"unsupported"}, report
    assert all(r.startswith("wrapt could not be imported (ModuleNotFoundError") for r in reasons(report).values())


# --- the policy on a torch whose internals differ ------------------------------------------------


def test_policy_on_different_internals_does_not_break_the_import(fake_torch):
    """``FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS=1`` where FSDP2 has no ``FSDPModule``: the policy
    is recorded as not armed; the import succeeds and nothing is printed."""
    result = run_child(program(), path=[fake_torch], env={"FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS": "1"})
    data = json_of(result)
    assert result.stderr == "", describe(result)
    report = data["report"]
    assert set(statuses(report).values()) == {"unsupported"}
    assert report["policies"]["reduce_scatter_unused_params_default_on"].startswith("not armed: "), report


def test_policy_on_different_internals_raises_under_strict(fake_torch):
    code = program().replace(
        "import torch.distributed.fsdp\n",
        "try:\n        import torch.distributed.fsdp\n        error = None\n"
        "    except Exception as e:\n        error = type(e).__name__\n    print(error)\n",
    )
    env = {"FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS": "1", "FSDP_AUTOPATCH_STRICT": "1"}
    result = run_child(code, path=[fake_torch], env=env)
    assert result.returncode == 0 and result.stderr == "", describe(result)
    error, report_line = result.stdout.splitlines()
    assert error != "None"
    report = json.loads(report_line)["report"]
    assert report["policies"]["reduce_scatter_unused_params_default_on"].startswith("not armed: "), report


# --- the .pth executed again and again --------------------------------------------------------------


def test_pth_line_executed_three_times_arms_and_activates_once(fake_torch):
    """``site`` runs a venv's ``.pth`` files twice (CPython issue 75723); here ``site.addpackage``
    runs the real line twice more. One trigger, one activation, nothing printed."""
    code = f"""
        import json, site, sys
        import fsdp_autopatch._activate as activate_module
        calls = []
        real = activate_module.activate
        def counting(module=None):
            calls.append(getattr(module, "__name__", None))
            return real(module)
        activate_module.activate = counting  # the hook is "fsdp_autopatch._activate:activate", resolved when it fires
        for _ in range(2):
            site.addpackage({SRC!r}, "fsdp_autopatch.pth", set())
        import _fsdp_autopatch_bootstrap as bootstrap
        import torch.distributed.fsdp
        import fsdp_autopatch
        print(json.dumps({{
            "calls": calls,
            "report": fsdp_autopatch.status().to_dict(),
            "triggers": sum(f is bootstrap for f in sys.meta_path),
        }}))
    """
    result = run_child(code, path=[fake_torch])
    data = json_of(result)
    assert result.stderr == "", describe(result)
    assert data["triggers"] == 1
    assert data["calls"] == ["torch.distributed.fsdp._fully_shard"]
    assert data["report"]["bootstrap"] == "pth"
    assert set(statuses(data["report"]).values()) == {"unsupported"}


# --- the harness itself: a hang fails with a message and leaves nothing behind ---------------------


def test_a_hanging_child_fails_with_a_message_and_leaves_no_process(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(600)
    """
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"(?s)timed out after 3 s.*started"):
        run_child(code, timeout=3)
    assert time.monotonic() - started < 30
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and grandchild in _live_pids():
        time.sleep(0.1)
    assert grandchild not in _live_pids(), "the hanging child's own child survived"


def _live_pids():
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                        pids.add(int(entry))
            except OSError:
                pass
    return pids
