"""2-rank gloo CPU tests: each test module spawns fresh rank processes (see _dist_launcher).

The helper modules of this folder (``_dist_launcher``, ``_dist_common``, ``_registry``,
``_dist_checks``, the ``_*_scenarios`` modules) are imported by name, so this folder goes on ``sys.path`` whatever
pytest's import mode. Every test here gets the ``distributed`` marker (declared in
pyproject.toml): deselect the folder with ``-m "not distributed"``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().parent == Path(HERE):
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(scope="session", autouse=True)
def _require_gloo_fsdp2() -> None:
    from _dist_launcher import fsdp2_gloo_skip_reason

    reason = fsdp2_gloo_skip_reason()
    if reason:
        pytest.skip(reason)
