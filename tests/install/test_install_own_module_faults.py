"""The real wheel and a real torch (FSDP_TEST_TORCH): one of our modules raising at import never breaks the user's
import.

The installed file in the venv's site-packages gets a ``raise TypeError`` at its top (restored
afterwards), as Python 3.9 raised for a ``str | None`` annotation inside the FSDP2 import hook. A
fresh interpreter then imports torch's FSDP2 like a training script: it must succeed, print nothing,
leave torch untouched by the patches that did not apply, and ``status``/``doctor`` must name the module.
"""

from __future__ import annotations

import json

import pytest

from _install_support import T_TORCH, Venv, describe, run, statuses_with

pytestmark = [pytest.mark.install, pytest.mark.timeout(900)]

INJECTED = "injected by the test"
USER_PROGRAM = r"""
import json, sys
import torch.distributed.fsdp
from torch.distributed.fsdp._fully_shard import _fsdp_collectives
plugin = sys.modules.get("fsdp_autopatch")
try:
    report = plugin.status().to_dict()
except Exception as error:
    report = {"error": f"{type(error).__name__}: {error}"}
wrapped = type(_fsdp_collectives.foreach_reduce).__module__.startswith("wrapt")
print(json.dumps({"report": report, "foreach_reduce_wrapped": wrapped}))
"""
# torch warns on import without numpy (these venvs have none); that line is torch's, not ours.
TORCH_NOISE = {"PYTHONWARNINGS": "ignore:Failed to initialize NumPy"}


class broken_module:
    """Make ``module`` of the installed package raise ``TypeError`` at import, within a ``with``."""

    def __init__(self, venv: Venv, module: str) -> None:
        parts = module.split(".")[1:]
        path = venv.site_packages.joinpath("fsdp_autopatch", *parts)
        self.path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")

    def __enter__(self) -> None:
        self.original = self.path.read_bytes()
        text = self.original.decode()
        marker = "from __future__ import annotations\n"
        head, sep, tail = text.partition(marker) if marker in text else ("", "", text)
        self.path.write_text(f"{head}{sep}raise TypeError({INJECTED!r})\n{tail}")

    def __exit__(self, *exc: object) -> None:
        self.path.write_bytes(self.original)


def user_run(venv: Venv) -> dict:
    result = venv.py(USER_PROGRAM, env=TORCH_NOISE, timeout=T_TORCH)
    assert result.returncode == 0 and result.stderr == "", describe(result)
    (line,) = result.stdout.splitlines()
    return json.loads(line)


def cli(venv: Venv, *args: str):
    return run([venv.bin("fsdp-autopatch"), *args], timeout=T_TORCH)


def statuses(report: dict) -> dict:
    return {p["name"]: p["status"] for p in report["patches"]}


def test_a_patch_module_that_raises_costs_only_that_patch(torch_venv: Venv) -> None:
    module = "fsdp_autopatch.patches.uniform_reduce_dtype"
    with broken_module(torch_venv, module):
        data = user_run(torch_venv)
        status = cli(torch_venv, "status", "--json")
    got = statuses(data["report"])
    assert got == statuses_with(uniform_reduce_dtype="failed")
    assert data["foreach_reduce_wrapped"] is False  # torch left untouched by the failed patch
    assert status.returncode == 1, describe(status)
    (record,) = [p for p in json.loads(status.stdout)["patches"] if p["status"] == "failed"]
    assert module in record["reason"] and f"TypeError: {INJECTED}" in record["reason"]


def test_the_hook_module_raising_fails_every_patch_and_doctor_names_it(torch_venv: Venv) -> None:
    module = "fsdp_autopatch._activate"
    with broken_module(torch_venv, module):
        data = user_run(torch_venv)
        doctor = cli(torch_venv, "doctor")
    assert set(statuses(data["report"]).values()) == {"failed"}
    assert data["foreach_reduce_wrapped"] is False
    assert doctor.returncode == 1, describe(doctor)
    problem = (
        f"[problem] hook: fsdp-autopatch's own code raised in the FSDP2 import hook ({module}: TypeError: {INJECTED})"
    )
    assert problem in " ".join(doctor.stdout.split()), describe(doctor)  # doctor wraps its lines to the width


@pytest.mark.parametrize("module", ["fsdp_autopatch._config", "fsdp_autopatch._registry"])
def test_the_registry_not_importing_still_leaves_the_import_working(torch_venv: Venv, module: str) -> None:
    with broken_module(torch_venv, module):
        data = user_run(torch_venv)
        results = [cli(torch_venv, command) for command in ("status", "doctor")]
    assert data == {"report": {"error": f"TypeError: {INJECTED}"}, "foreach_reduce_wrapped": False}
    for result in results:
        assert result.returncode == 2, describe(result)
        assert f"its module {module} cannot be imported" in result.stderr, describe(result)
