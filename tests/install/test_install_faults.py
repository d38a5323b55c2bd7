"""Fault injection against the real wheel in fresh venvs, with a real torch (FSDP_TEST_TORCH) where it matters.

Every case asserts the four promises of "costs nothing when idle, never breaks a run":

1. the interpreter starts;
2. ``import torch.distributed.fsdp`` succeeds (or, without torch, fails exactly as it would without
   the plugin; or, under ``FSDP_AUTOPATCH_STRICT=1``, raises the patch's error: that is what was asked);
3. the registry says what happened, and torch is wrapped exactly where the registry says ``applied``;
4. nothing is printed unless asked: stdout holds only the program's JSON, stderr is empty (or holds
   only the documented ``ConfigWarning`` lines for bad values).

The faults are injected by the program itself before FSDP2 is imported (the way a user's
``sitecustomize`` or launcher could): wrapt post-import hooks on FSDP2's submodules rename or
re-sign torch internals before our hook on ``torch.distributed.fsdp._fully_shard`` runs, or a patch
module's ``PATCH.apply`` is replaced by one that raises. The fast fake-torch variants of these
cases: ``tests/unit/test_fault_injection.py``.

The single-process torch cases of the three big groups (internals, a patch raising, malformed
values) run two at a time in one module fixture (``batch``); the tests check the results.
Every child is bounded (``_install_support.run``: own process group, killed on timeout, a timeout
is a failure with the output so far); children that may hang also arm ``faulthandler`` so that a
hang prints every thread's stack before the watchdog exits.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import subprocess
import textwrap
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from _install_support import (
    DEFAULT_STATUSES,
    DEPTH,
    NATIVE_UNUSED_PARAM_API,
    PATCH_NAMES,
    T_PY,
    T_TORCH,
    WAITING,
    Venv,
    applied_entries,
    base_python,
    clean_env,
    config_warnings,
    describe,
    expected_wrappers,
    reasons,
    run,
    statuses,
    statuses_with,
    wrap_points,
)

# Generous: the first test to use the shared torch venv also builds the wheel and installs torch.
pytestmark = [pytest.mark.install, pytest.mark.timeout(1800)]

WATCHDOG = T_TORCH - 30  # the child dumps its stacks and exits before run() would have to kill it

# --- the program every torch case runs ----------------------------------------------------------

PROGRAM = r'''
import faulthandler, json, sys
faulthandler.dump_traceback_later({watchdog}, exit=True)
{pre}
try:
    import torch.distributed.fsdp
    error = None
except Exception as exc:  # only FSDP_AUTOPATCH_STRICT=1 may get here
    error = f"{{type(exc).__name__}}: {{exc}}"
{post}
print(json.dumps(state(error)))
'''


def state_code() -> str:
    """Source of ``state()``, shared by every program (also the DataLoader workers): what this
    process looks like. It never imports wrapt or fsdp_autopatch itself: it reads what the .pth put
    into sys.modules. The points are this torch's (``_wrap_points``; learned with ``torch_venv``)."""
    return STATE.replace("_POINTS = None", f"_POINTS = {wrap_points()!r}").replace("# DEPTH", DEPTH)


STATE = r'''
import sys as _sys

_POINTS = None
# DEPTH


def _point(module, owner, attribute):
    found = _sys.modules.get(module)
    if found is not None and owner is not None:
        found = vars(found).get(owner)
    obj = vars(found).get(attribute) if found is not None else None
    return None if obj is None else _depth(obj)


def state(error=None):
    import os
    plugin = _sys.modules.get("fsdp_autopatch")
    boot = _sys.modules.get("_fsdp_autopatch_bootstrap")
    return {
        "pid": os.getpid(),
        "error": error,
        "report": plugin.status().to_dict() if plugin is not None else None,
        "patched": {name: _point(*where) for name, where in _POINTS.items()},
        # points in modules not (or no longer) loaded: a failed import of FSDP2 drops its packages
        "unloaded": sorted(name for name, where in _POINTS.items() if where[0] not in _sys.modules),
        "triggers": sum(f is boot for f in _sys.meta_path) if boot else 0,
        "wrapt_loaded": "wrapt" in _sys.modules,
    }
'''


# torch 2.13 itself warns on import when numpy is not installed (these venvs have none):
# "UserWarning: Failed to initialize NumPy: No module named 'numpy'". That line is torch's, not
# ours; this filter hides exactly it, so that "stderr is empty" means fsdp-autopatch said nothing.
TORCH_NOISE = {"PYTHONWARNINGS": "ignore:Failed to initialize NumPy"}


def py(venv: Venv, code: str, *, env: dict | None = None, flags: tuple = (), timeout: float = T_TORCH):
    return venv.py(code, env={**TORCH_NOISE, **(env or {})}, flags=flags, timeout=timeout)


def program(pre: str = "", post: str = "", watchdog: int = WATCHDOG) -> str:
    return state_code() + PROGRAM.format(pre=textwrap.dedent(pre), post=textwrap.dedent(post), watchdog=watchdog)


def result_of(result: subprocess.CompletedProcess, *, allow_warnings: bool = False) -> dict:
    """The program's JSON; asserts the interpreter started and printed nothing else."""
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    assert len(lines) == 1, describe(result)  # nothing but the program's own line on stdout
    if allow_warnings:
        assert result.stderr.splitlines() == config_warnings(result.stderr), describe(result)
    else:
        assert result.stderr == "", describe(result)
    return json.loads(lines[0])


def assert_patched_as_registered(data: dict, *, missing: tuple = ()) -> None:
    """Each torch attribute carries one wrapper per applied patch that replaces it, and no other;
    ``missing`` are the attributes the fault renamed away; where the import of FSDP2 failed
    (``FSDP_AUTOPATCH_STRICT=1``), also those in the modules it dropped from ``sys.modules``."""
    status = applied_entries(data["report"])
    gone = (*missing, *(data["unloaded"] if data["error"] else ()))
    assert data["patched"] == expected_wrappers(status, gone), (status, data["patched"])


def expect(**changes: str) -> dict:
    return statuses_with(**changes)


# --- torch not installed -------------------------------------------------------------------------


def test_torch_not_installed(plain_venv: Venv) -> None:
    result = py(plain_venv,
        """
        import json, sys
        try:
            import torch.distributed.fsdp
            missing = None
        except ModuleNotFoundError as error:
            missing = error.name
        import fsdp_autopatch as plugin
        print(json.dumps({"missing": missing, "report": plugin.status().to_dict(),
                          "wrapt_loaded": "wrapt" in sys.modules}))
        """
    )
    data = result_of(result)
    assert data["missing"] == "torch"  # the same error as without the plugin, nothing else
    report = data["report"]
    assert report["bootstrap"] == "pth" and report["torch"] is None
    assert set(statuses(report).values()) == {"unsupported"}
    assert all("torch is not installed" in r for r in reasons(report).values()), report
    assert not data["wrapt_loaded"]


# --- wrapt not installed or broken -------------------------------------------------------------


@pytest.fixture(scope="module")
def venv_without_wrapt(torch_venv: Venv, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh venv that has everything the torch venv has (symlinked, so no second torch install)
    except wrapt: what a user gets with ``pip install --no-deps fsdp-autopatch``."""
    path = tmp_path_factory.mktemp("no-wrapt") / "venv"
    run([base_python(), "-m", "venv", "--without-pip", path], timeout=T_PY, check=True)
    venv = Venv(path)
    for entry in torch_venv.site_packages.iterdir():
        if not entry.name.lower().startswith("wrapt"):
            (venv.site_packages / entry.name).symlink_to(entry)
    return venv


def test_wrapt_not_installed(venv_without_wrapt: Venv) -> None:
    data = result_of(py(venv_without_wrapt, program(), timeout=T_TORCH))
    assert data["error"] is None
    report = data["report"]
    assert report["bootstrap"] == "pth"
    assert set(statuses(report).values()) == {"unsupported"}, report
    missing = "wrapt could not be imported (ModuleNotFoundError: No module named 'wrapt')"
    assert all(r == missing for r in reasons(report).values()), report
    assert_patched_as_registered(data)  # torch untouched
    # the CLI says the same, and exits 0 (unsupported is not a failure)
    cli = run(
        [venv_without_wrapt.python, "-m", "fsdp_autopatch", "status", "--json"],
        env=clean_env(TORCH_NOISE), timeout=T_TORCH,
    )
    assert cli.returncode == 0 and cli.stderr == "", describe(cli)
    assert statuses(json.loads(cli.stdout)) == statuses(report)


BROKEN_WRAPT = {
    "raises-on-import": (
        "raise ImportError('wrapt is half-uninstalled')\n",
        "wrapt could not be imported (ImportError: wrapt is half-uninstalled)",
    ),
    "no-hook-api": ("__version__ = '0.0'\n", "wrapt could not register the import hook (AttributeError:"),
}


@pytest.mark.parametrize("variant", list(BROKEN_WRAPT))
def test_wrapt_broken(torch_venv: Venv, tmp_path: Path, variant: str) -> None:
    source, reason = BROKEN_WRAPT[variant]
    (tmp_path / "wrapt").mkdir()
    (tmp_path / "wrapt" / "__init__.py").write_text(source)
    data = result_of(py(torch_venv, program(), env={"PYTHONPATH": str(tmp_path)}, timeout=T_TORCH))
    assert data["error"] is None
    report = data["report"]
    assert set(statuses(report).values()) == {"unsupported"}, report  # never "pending" forever
    assert all(r.startswith(reason) for r in reasons(report).values()), report
    assert_patched_as_registered(data)


# --- the single-process torch cases below, run two at a time -----------------------------------


@pytest.fixture(scope="module")
def batch(torch_venv: Venv) -> dict:
    """Every parametrized case of the three groups below (internals renamed, a patch raising in
    apply, malformed values), each one fresh interpreter importing torch's FSDP2, two at a time
    (2 cores; an import is seconds of CPU and file system). The tests only read the results."""
    cases = {f"internals:{fault}": (program(pre=inject_after(f[0], f[1])), f[2]) for fault, f in INTERNALS.items()}
    cases.update({f"raise:{n}:{s}": raising_program(n, s) for n in PATCH_NAMES for s in (False, True)})
    cases.update({f"malformed:{case}": (program(), c[0]) for case, c in MALFORMED.items()})
    with ThreadPoolExecutor(max_workers=2) as pool:  # each child is bounded by run()'s timeout
        futures = {key: pool.submit(py, torch_venv, code, env=env) for key, (code, env) in cases.items()}
        return {key: future.result() for key, future in futures.items()}


# --- the internals a patch wraps renamed, or with another signature ------------------------------

# Each fault: (the FSDP2 submodule whose import it follows, its code, the env, expected statuses,
# the attributes (or owners) it renames away, what the reason of the affected patch says).
P = "torch.distributed.fsdp._fully_shard."
INTERNALS = {
    "guard-method-renamed": (
        "_fsdp_param",
        """
        cls = module.FSDPParam
        cls.to_accumulated_grad_if_needed_v2 = vars(cls)["to_accumulated_grad_if_needed"]
        del cls.to_accumulated_grad_if_needed
        """,
        {},
        expect(accumulated_grad_guard="unsupported"),
        ("FSDPParam.to_accumulated_grad_if_needed",),
        {"accumulated_grad_guard": "FSDPParam has no to_accumulated_grad_if_needed"},
    ),
    "guard-method-other-code": (
        "_fsdp_param",
        """
        def to_accumulated_grad_if_needed(self, *args, **kwargs):
            return None  # a rewrite that does not read the lazily created attribute
        module.FSDPParam.to_accumulated_grad_if_needed = to_accumulated_grad_if_needed
        """,
        {},
        expect(accumulated_grad_guard="unsupported"),
        (),
        {"accumulated_grad_guard": "does not read _unsharded_param"},
    ),
    "foreach-reduce-other-signature": (
        "_fsdp_collectives",
        """
        original = module.foreach_reduce
        def foreach_reduce(params, grads, *args, **kwargs):  # renamed parameters, no __wrapped__
            return original(params, grads, *args, **kwargs)
        module.foreach_reduce = foreach_reduce  # _fsdp_param_group imports this one by name
        """,
        {},
        expect(uniform_reduce_dtype="unsupported"),
        (),
        {"uniform_reduce_dtype": "foreach_reduce(fsdp_params, unsharded_grads, ...) not found"},
    ),
    "final-callback-renamed": (
        "_fsdp_state",
        """
        cls = module.FSDPState
        cls._root_post_backward_final_callback_v2 = vars(cls)["_root_post_backward_final_callback"]
        del cls._root_post_backward_final_callback
        """,
        {},
        expect(restore_unused_param_grads="unsupported"),
        ("FSDPState._root_post_backward_final_callback",),
        {"restore_unused_param_grads": "do not look as expected"},
    ),
    # after every FSDP2 module imported it by name: the patches' lookup raises AttributeError
    "param-group-class-gone": (
        "_fully_shard",
        f"""
        del sys.modules[{P + "_fsdp_param_group"!r}].FSDPParamGroup
        """,
        {},
        expect(unused_param_reduction="unsupported", restore_unused_param_grads="unsupported"),
        ("FSDPParamGroup",),  # every FSDPParamGroup.* point
        {
            "unused_param_reduction": "torch internals differ: AttributeError",
            "restore_unused_param_grads": "torch internals differ: AttributeError",
        },
    ),
    # ... and the policy that needs the same class does not break the import either
    "param-group-class-gone-with-policy": (
        "_fully_shard",
        f"""
        del sys.modules[{P + "_fsdp_param_group"!r}].FSDPParamGroup
        """,
        {"FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS": "1"},
        expect(unused_param_reduction="unsupported", restore_unused_param_grads="unsupported"),
        ("FSDPParamGroup",),  # every FSDPParamGroup.* point
        {"unused_param_reduction": "torch internals differ: AttributeError"},
    ),
}


def inject_after(submodule: str, body: str) -> str:
    """Code that runs ``body`` (with ``module`` bound) right after ``submodule`` of FSDP2 executed,
    before our hook on the FSDP2 package runs."""
    return (
        "import wrapt\n"
        "def _fault(module):\n"
        + textwrap.indent(textwrap.dedent(body).strip() + "\n", "    ")
        + f"wrapt.register_post_import_hook(_fault, {P + submodule!r})\n"
    )


@pytest.mark.parametrize("fault", list(INTERNALS))
def test_internals_renamed_or_resigned(batch: dict, fault: str) -> None:
    _, _, env, expected, missing, why = INTERNALS[fault]
    data = result_of(batch[f"internals:{fault}"])
    assert data["error"] is None
    report = data["report"]
    assert report["bootstrap"] == "pth"
    got, default = statuses(report), statuses_with()
    # the patches the fault is about step aside as listed; any other entry that reads the same
    # internal may step aside too (a later entry's structural check), never anything else
    assert {n: got[n] for n in expected if expected[n] != default[n]} == {
        n: s for n, s in expected.items() if s != default[n]}, reasons(report)
    assert all(got[n] in (default[n], "unsupported") for n in default), reasons(report)
    for name, fragment in why.items():
        assert fragment in reasons(report)[name], reasons(report)[name]
    assert_patched_as_registered(data, missing=missing)
    if env:
        policy = report["policies"]["reduce_scatter_unused_params_default_on"]
        assert policy.startswith("not armed: AttributeError"), policy


# --- each patch raising during apply ------------------------------------------------------------

RAISE_IN_APPLY = """
import importlib
from fsdp_autopatch._spec import Add
_patch_module = importlib.import_module("fsdp_autopatch.patches.{name}")
def _boom(owner):
    raise RuntimeError("injected failure in {name}.apply")
# one more target whose value cannot be made: the patch fails as a whole, torch untouched
_boom_target = Add("torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._fsdp_autopatch_boom", _boom)
_patch_module.PATCH = _patch_module.PATCH._replace(targets=_patch_module.PATCH.targets + (_boom_target,))
"""


def raising_program(name: str, strict: bool) -> tuple[str, dict]:
    if name == "unused_param_reduction" and NATIVE_UNUSED_PARAM_API:
        # not needed from torch 2.13 (never applied): make it needed by hiding torch's own method
        pre = inject_after(
            "_fully_shard",
            """
            cls = module.FSDPModule
            cls._native_setter = vars(cls)["set_reduce_scatter_unused_params"]
            del cls.set_reduce_scatter_unused_params
            """,
        )
    else:
        pre = ""
    pre += RAISE_IN_APPLY.format(name=name)
    return program(pre=pre), ({"FSDP_AUTOPATCH_STRICT": "1"} if strict else {})


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
# the probe imports FSDP2 only: an entry that waits for DCP's state_dict is never tried there (its
# apply failing is isolated by the same code: tests/unit/test_activate.py)
@pytest.mark.parametrize("name", [name for name in PATCH_NAMES if name not in WAITING])
def test_patch_raises_during_apply(batch: dict, name: str, strict: bool) -> None:
    data = result_of(batch[f"raise:{name}:{strict}"])
    report = data["report"]
    message = f"RuntimeError: injected failure in {name}.apply"
    got = statuses(report)
    assert got[name] == "failed" and reasons(report)[name] == message, report
    assert_patched_as_registered(data)  # the failed patch left torch untouched
    position = PATCH_NAMES.index(name)
    before, after = PATCH_NAMES[:position], PATCH_NAMES[position + 1 :]
    baseline = statuses_with(**{name: "failed"})
    if name == "unused_param_reduction":
        # no fill (torch's is hidden from 2.13, absent before), the backport failed: nothing to restore
        baseline.update(restore_unused_param_grads="not_needed")
    assert {n: got[n] for n in before} == {n: baseline[n] for n in before}
    if strict:
        assert data["error"] == message  # the import that triggered the hook raised it
        assert {got[n] for n in after} <= {"pending"}  # not attempted
    else:
        assert data["error"] is None
        assert {n: got[n] for n in after} == {n: baseline[n] for n in after}  # the others still apply


# --- the .pth executed twice (and more) ---------------------------------------------------------


def test_pth_executed_again(torch_venv: Venv) -> None:
    pre = f"""
    import site
    import fsdp_autopatch._activate as _activate_module
    calls = []
    _real_activate = _activate_module.activate
    def _counting(module=None):
        calls.append(getattr(module, "__name__", None))
        return _real_activate(module)
    _activate_module.activate = _counting  # the hook names "fsdp_autopatch._activate:activate"
    for _ in range(2):  # site already ran it (twice in a venv, CPython issue 75723); twice more
        site.addpackage({str(torch_venv.site_packages)!r}, "fsdp_autopatch.pth", set())
    """
    post = """
    _state = state
    def state(error):
        return {**_state(error), "calls": calls}
    """
    data = result_of(py(torch_venv, program(pre=pre, post=post), timeout=T_TORCH))
    assert data["error"] is None
    assert data["triggers"] == 1
    assert data["calls"] == ["torch.distributed.fsdp._fully_shard"]  # one activation
    assert data["report"]["bootstrap"] == "pth"
    assert statuses(data["report"]) == DEFAULT_STATUSES
    assert_patched_as_registered(data)  # wrapped once, not three times


# --- two threads importing torch at once ---------------------------------------------------------


def test_threads_importing_torch_at_once(torch_venv: Venv) -> None:
    """Two threads race to the first ``import torch`` (one via FSDP2), a third imports modules that
    wrapt needs at the same moment. No deadlock, no error, patched once."""
    pre = f"""
    import threading
    statements = ["import torch.distributed.fsdp", "from torch.distributed.fsdp import fully_shard",
                  "import logging, inspect, asyncio"]
    barrier = threading.Barrier(len(statements))
    thread_errors = []
    def _job(statement):
        try:
            barrier.wait()
            exec(statement, {{}})
        except BaseException as exc:
            thread_errors.append(f"{{statement}}: {{exc!r}}")
    threads = [threading.Thread(target=_job, args=(s,), daemon=True) for s in statements]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join({WATCHDOG - 10})
    hung = [s for s, t in zip(statements, threads) if t.is_alive()]
    """
    post = """
    _state = state
    def state(error):
        return {**_state(error), "thread_errors": thread_errors, "hung": hung}
    """
    data = result_of(py(torch_venv, program(pre=pre, post=post), timeout=T_TORCH))
    assert data["hung"] == [] and data["thread_errors"] == [] and data["error"] is None, data
    assert data["triggers"] == 1
    assert statuses(data["report"]) == DEFAULT_STATUSES
    assert_patched_as_registered(data)


# --- python -S, then fsdp_autopatch.install() ----------------------------------------------------


@pytest.mark.parametrize("order", ["install-then-torch", "torch-then-install"])
def test_dash_S_then_install(torch_venv: Venv, order: str) -> None:
    setup = f"sys.path.append({str(torch_venv.site_packages)!r})  # what an embedding application does\n"
    if order == "install-then-torch":
        pre, post = setup + "import fsdp_autopatch; fsdp_autopatch.install()\n", ""
    else:
        pre, post = setup, "import fsdp_autopatch; fsdp_autopatch.install(); fsdp_autopatch.install()\n"
    data = result_of(py(torch_venv, program(pre=pre, post=post), flags=("-S",), timeout=T_TORCH))
    assert data["error"] is None
    assert data["report"]["bootstrap"] == "explicit"
    assert statuses(data["report"]) == DEFAULT_STATUSES
    assert_patched_as_registered(data)


# --- DataLoader workers under spawn --------------------------------------------------------------

DATALOADER = r'''
import json
import torch
import torch.distributed.fsdp  # also runs in every spawned worker (it re-imports this file)
from torch.utils.data import DataLoader, Dataset


class Probe(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return json.dumps(state())


def as_list(batch):
    return batch


if __name__ == "__main__":
    import faulthandler
    faulthandler.dump_traceback_later(WATCHDOG, exit=True)
    loader = DataLoader(Probe(), batch_size=1, num_workers=2, multiprocessing_context="spawn",
                        collate_fn=as_list, timeout=WATCHDOG - 20)
    workers = [json.loads(item) for batch in loader for item in batch]
    print(json.dumps({"parent": state(), "workers": workers}))
'''


def test_dataloader_workers_under_spawn(torch_venv: Venv, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(state_code() + DATALOADER.replace("WATCHDOG", str(WATCHDOG)))
    result = run([torch_venv.python, script], env=clean_env(TORCH_NOISE), timeout=T_TORCH, cwd=tmp_path)
    data = result_of(result)
    parent, workers = data["parent"], data["workers"]
    pids = {w["pid"] for w in workers}
    assert len(pids) == 2 and parent["pid"] not in pids, pids
    for process in [parent, *workers]:
        assert process["report"]["bootstrap"] == "pth", process
        assert process["triggers"] == 1, process
        assert statuses(process["report"]) == DEFAULT_STATUSES, process
        assert_patched_as_registered(process)  # each process patched once, by itself
    for pid in pids:  # the workers are gone (or zombies waiting for a reaper)
        assert not _running(pid), f"DataLoader worker {pid} survived its parent"


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# --- malformed values against the real torch (the full table runs against a fake torch) ----------

MALFORMED = {
    "kill-switch-mixed-case-padded": ({"FSDP_AUTOPATCH_ENABLED": " FaLsE "}, {n: "disabled" for n in PATCH_NAMES}, 0),
    "kill-switch-unicode": ({"FSDP_AUTOPATCH_ENABLED": "\uff2f\uff26\uff26"}, DEFAULT_STATUSES, 1),
    "kill-switch-very-long": ({"FSDP_AUTOPATCH_ENABLED": "0" * 100_000}, DEFAULT_STATUSES, 1),
    "per-patch-empty": ({"FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED": ""}, DEFAULT_STATUSES, 0),
    "list-star-and-names": (
        {"FSDP_AUTOPATCH_DISABLED": " *, Uniform_Reduce_Dtype ,bogus"},
        {n: "disabled" for n in PATCH_NAMES},
        1,
    ),
    "list-unicode-and-spaces": (
        {"FSDP_AUTOPATCH_DISABLED": " accumulated_grad_guard , \u00fcber "},
        expect(accumulated_grad_guard="disabled"),
        1,
    ),
    "unknown-names": ({"FSDP_AUTOPATCH_ENABLE": "0", "FSDP_AUTOPATCH_STRICT": "yes please"}, DEFAULT_STATUSES, 2),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_values_with_real_torch(batch: dict, case: str) -> None:
    env, expected, warning_count = MALFORMED[case]
    result = batch[f"malformed:{case}"]
    data = result_of(result, allow_warnings=True)
    assert data["error"] is None
    assert statuses(data["report"]) == expected
    assert_patched_as_registered(data)
    warnings = config_warnings(result.stderr)
    assert len(warnings) == warning_count, describe(result)
    assert all(len(w) < 600 for w in warnings), [len(w) for w in warnings]


# --- security: the .pth runs no code chosen by the environment -----------------------------------

# The bootstrap; what it imports when FSDP_AUTOPATCH_ENABLED is set (the package, _config); and
# the package's name for the bootstrap, which an earlier install's .pth imports.
START_UP_MODULES = ("_fsdp_autopatch_bootstrap.py", "fsdp_autopatch/__init__.py", "fsdp_autopatch/_version.py",
                    "fsdp_autopatch/_bootstrap.py", "fsdp_autopatch/_config.py")


def _wheel_text(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(name).decode("utf-8")


def test_pth_line_runs_only_a_literal(wheel: Path) -> None:
    """The ``.pth`` is one line, ``import _fsdp_autopatch_bootstrap``, and nothing else: no name,
    attribute, call or string in it can reach the environment, a path, or any other module."""
    text = _wheel_text(wheel, "fsdp_autopatch.pth")
    assert text.count("\n") <= 1 and len(text.splitlines()) == 1, text
    (statement,) = ast.parse(text).body
    assert isinstance(statement, ast.Import)
    assert [(a.name, a.asname) for a in statement.names] == [("_fsdp_autopatch_bootstrap", None)]


FORBIDDEN_AT_START = {"eval", "exec", "compile", "__import__", "open", "importlib", "import_module",
                      "runpy", "subprocess", "system", "popen", "execv", "ctypes", "getenv", "putenv"}


@pytest.mark.parametrize("module", START_UP_MODULES)
def test_start_up_modules_run_no_code_or_paths_from_the_environment(wheel: Path, module: str) -> None:
    """What the ``.pth`` imports at interpreter start, as shipped in the wheel: no dynamic code
    (eval/exec/compile/__import__/importlib), no file access, no processes, no ``sys.path`` or
    ``os.path``; the bootstrap reads exactly one variable, the kill switch (``in``, then ``.get``)."""
    tree = ast.parse(_wheel_text(wheel, module))
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    imports = (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
    used |= {a.name.split(".")[0] for n in imports for a in n.names}
    used |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not used & FORBIDDEN_AT_START, sorted(used & FORBIDDEN_AT_START)
    paths = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path"]
    assert not paths, paths  # neither sys.path nor os.path: no import location, no file is computed
    environ_uses = [
        ast.unparse(parent)
        for parent in ast.walk(tree)
        for child in ast.iter_child_nodes(parent)
        if isinstance(child, ast.Attribute) and child.attr == "environ"
    ]
    if module == "_fsdp_autopatch_bootstrap.py":
        # a membership test first (unset, the usual case, costs no import), then the value
        assert sorted(environ_uses) == ["KILL_SWITCH in os.environ", "os.environ.get"], environ_uses
        calls = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call)]
        calls = [call for call in calls if call.startswith("os.environ.get(")]
        assert calls == ["os.environ.get(KILL_SWITCH)"], calls


def test_installed_start_up_files_match_the_wheel_and_record(torch_venv: Venv, wheel: Path) -> None:
    """What ``docs/security.md`` tells users to check: the installed files are the wheel's, and pip's
    RECORD holds their sha256."""
    (dist_info,) = torch_venv.site_packages.glob("fsdp_autopatch-*.dist-info")
    record = {}
    for line in (dist_info / "RECORD").read_text().splitlines():
        path, digest, _ = line.rsplit(",", 2)
        record[path] = digest
    for name in ("fsdp_autopatch.pth", "fsdp_autopatch.start", "_fsdp_autopatch_bootstrap.py",
                 "fsdp_autopatch/_bootstrap.py", "fsdp_autopatch/_config.py"):
        data = (torch_venv.site_packages / name).read_bytes()
        assert data.decode("utf-8") == _wheel_text(wheel, name), name
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert record[name] == f"sha256={digest}", name


def test_code_in_environment_values_is_never_executed(torch_venv: Venv, tmp_path: Path) -> None:
    """Every variable fsdp-autopatch reads holds Python that would create a file if evaluated: at
    interpreter start, at ``import torch`` and when the hook reads them. Nothing runs it."""
    marker = tmp_path / "evaluated"
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch() or '1'"
    variables = ["FSDP_AUTOPATCH_ENABLED", "FSDP_AUTOPATCH_DISABLED", "FSDP_AUTOPATCH_STRICT",
                 "FSDP_AUTOPATCH_LOG_LEVEL", "FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS",
                 *(f"FSDP_AUTOPATCH_{n.upper()}_ENABLED" for n in PATCH_NAMES)]
    env = {name: payload for name in variables}
    result = py(torch_venv, program(), env=env, timeout=T_TORCH)
    data = result_of(result, allow_warnings=True)
    assert not marker.exists(), "an environment value was executed"
    assert data["error"] is None
    assert statuses(data["report"]) == DEFAULT_STATUSES  # every value ignored, defaults kept
    assert len(config_warnings(result.stderr)) == len(variables)
