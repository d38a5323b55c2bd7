"""What PyPI and a user's tools read from the built wheel: the description, the license, the changelog."""

from __future__ import annotations

import email
import re
import zipfile
from email.message import Message
from pathlib import Path

import pytest

pytestmark = [pytest.mark.install, pytest.mark.timeout(900)]  # includes building the wheel

REPOSITORY = "https://github.com/fsdp-autopatch/fsdp-autopatch"
# a link target: markdown inline ](target), a reference definition [label]: target, an HTML attribute
_LINK_TARGETS = (
    re.compile(r"\]\(\s*<?([^)\s>]+)"),
    re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M),
    re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.I),
)


def _dist_info(archive: zipfile.ZipFile) -> str:
    (name,) = {n.split("/", 1)[0] for n in archive.namelist() if n.split("/", 1)[0].endswith(".dist-info")}
    return name


def _metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as archive:
        return email.message_from_string(archive.read(f"{_dist_info(archive)}/METADATA").decode("utf-8"))


def _link_targets(markdown: str) -> list[str]:
    return [match.group(1) for pattern in _LINK_TARGETS for match in pattern.finditer(markdown)]


def test_the_description_has_no_relative_link(wheel: Path) -> None:
    """PyPI renders the description away from the repository: docs/... would lead nowhere."""
    description = _metadata(wheel).get_payload()
    assert "](docs/" in Path(__file__).resolve().parents[2].joinpath("README.md").read_text()  # what is rewritten
    targets = _link_targets(description)
    assert any("/docs/" in target for target in targets), targets  # the README's links are there
    relative = [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]
    assert relative == [], relative
    assert all(t.startswith(f"{REPOSITORY}/") for t in targets if "github.com/fsdp-autopatch" in t), targets


def test_license_changelog_and_typing_marker_are_in_the_wheel(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        dist_info = _dist_info(archive)
        names = set(archive.namelist())
        license_text = archive.read(f"{dist_info}/licenses/LICENSE").decode("utf-8")
        changelog = archive.read(f"{dist_info}/extra_metadata/CHANGELOG.md").decode("utf-8")
    assert "fsdp_autopatch/py.typed" in names
    assert license_text.startswith("BSD 3-Clause License") and "fsdp-autopatch developers" in license_text
    version = _metadata(wheel)["Version"]
    assert f"## [{version}] - " in changelog and "## [0.1.0]" in changelog  # this release and the first


def test_metadata_declares_license_urls_and_classifiers(wheel: Path) -> None:
    metadata = _metadata(wheel)
    assert metadata["License-Expression"] == "BSD-3-Clause"
    assert metadata.get_all("License-File") == ["LICENSE"]
    classifiers = metadata.get_all("Classifier") or []
    # PEP 639: with a License-Expression, "License ::" classifiers are deprecated
    assert not [c for c in classifiers if c.startswith("License ::")], classifiers
    assert {"Typing :: Typed", "Operating System :: POSIX :: Linux"} <= set(classifiers), classifiers
    urls = dict(entry.split(", ", 1) for entry in metadata.get_all("Project-URL") or [])
    assert set(urls) == {"Homepage", "Documentation", "Changelog", "Issues"}, urls
    assert all(url.startswith(REPOSITORY) for url in urls.values()), urls


def test_the_link_finder_sees_every_kind_of_link() -> None:
    markdown = '[a](docs/a.md) [b](docs/b.md#part)\n[c]: docs/c.md\n<a href="docs/d.md">d</a> [e](#anchor) [f](https://x.org/f)'
    found = _link_targets(markdown)
    assert found == ["docs/a.md", "docs/b.md#part", "#anchor", "https://x.org/f", "docs/c.md", "docs/d.md"], found
