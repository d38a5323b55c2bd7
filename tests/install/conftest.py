"""Install tests: the real wheel (built once per session) in fresh venvs; an editable install.

Session-scoped, built on first use and shared by every test that needs them:

* ``wheel``        - ``python -m build --wheel`` of this repository, into a tmp dir.
* ``torch_venv``   - a fresh venv with ``FSDP_TEST_TORCH`` (``torch==2.13.0``, from local disk) and the wheel.
* ``plain_venv``   - a fresh venv with the wheel and no torch.
* ``editable_venv`` - a fresh venv with ``pip install -e`` of a copy of this repository.

The venvs are made from ``FSDP_TEST_PYTHON`` and get ``FSDP_TEST_TORCH`` when those are set
(see ``_install_support``), e.g. to run these tests on Python 3.12 with torch from PyPI.

The helper module ``_install_support`` is imported by name, so this folder goes on ``sys.path``
whatever pytest's import mode.
"""

from __future__ import annotations

import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _wrap_points  # noqa: E402
from _install_support import (  # noqa: E402
    REPO,
    T_PIP_TORCH,
    T_TORCH,
    TORCH_RELEASE,
    TORCH_REQUIREMENT,
    Venv,
    build_wheel,
    describe,
    ex,
)

VENV_NAMES = ("torch", "plain", "editable")


@pytest.fixture(scope="session")
def install_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Where the wheel, the checkout copy and the venvs go. Removed at the end of a session without
    failures (a torch venv is ~1 GB); kept for inspection otherwise."""
    root = tmp_path_factory.mktemp("install")
    failed_before = request.session.testsfailed
    yield root
    if request.session.testsfailed == failed_before:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def _bare_venvs(install_root: Path):
    """``python -m venv`` for every venv of the session, side by side, as soon as one is needed
    (each costs 10-20 s, mostly ensurepip); meanwhile the wheel builds."""
    pool = ThreadPoolExecutor(max_workers=len(VENV_NAMES), thread_name_prefix="venv")
    futures = {name: pool.submit(Venv.create, install_root / f"venv-{name}") for name in VENV_NAMES}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def wheel(install_root: Path) -> Path:
    """The real wheel, built the way a release is built (isolated build env, hatchling backend)."""
    return build_wheel(REPO, install_root / "dist")


@pytest.fixture(scope="session")
def torch_venv(_bare_venvs: dict[str, Future], wheel: Path) -> Venv:
    """torch + the wheel. ``--no-compile``: byte-compiling all of torch takes minutes here; the warm-up
    import below compiles (and caches) only the modules that ``import torch.distributed.fsdp`` needs."""
    venv = _bare_venvs["torch"].result()
    venv.install_plugin(wheel, also=("--no-compile", TORCH_REQUIREMENT), timeout=T_PIP_TORCH)
    warm = venv.py("import torch.distributed.fsdp; print(torch.__version__)", timeout=T_TORCH)
    assert warm.returncode == 0, describe(warm)
    # the expectations are TORCH_RELEASE's (tests/expected.py): the venv must hold that release
    installed = warm.stdout.split()[-1]
    assert ex.release_of(installed) == TORCH_RELEASE, f"{TORCH_REQUIREMENT!r} installed torch {installed}"
    _wrap_points.learn(venv, timeout=T_TORCH)  # where the patches wrap this torch (the probes' points)
    return venv


@pytest.fixture(scope="session")
def _plain_venv(_bare_venvs: dict[str, Future], wheel: Path) -> Venv:
    venv = _bare_venvs["plain"].result()
    venv.install_plugin(wheel)
    return venv


@pytest.fixture
def plain_venv(_plain_venv: Venv) -> Venv:
    """The wheel (with wrapt and packaging) and no torch."""
    _plain_venv.ensure_installed()
    return _plain_venv


@pytest.fixture(scope="session")
def editable_source(install_root: Path) -> Path:
    """A copy of what an editable install needs, so the test cannot touch the working tree."""
    copy = install_root / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO / "src", copy / "src", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, copy / name)
    for license_file in REPO.glob("LICEN[CS]E*"):
        shutil.copy2(license_file, copy / license_file.name)
    return copy


@pytest.fixture(scope="session")
def _editable_venv(_bare_venvs: dict[str, Future], editable_source: Path) -> Venv:
    venv = _bare_venvs["editable"].result()
    venv.install_plugin("-e", editable_source)
    return venv


@pytest.fixture
def editable_venv(_editable_venv: Venv) -> Venv:
    """``pip install -e <copy of the repo>`` (hatchling's editable wheel) and no torch."""
    _editable_venv.ensure_installed()
    return _editable_venv
