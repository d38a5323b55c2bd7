"""FSDP2 source files of another torch, served in place of the installed ones (stdlib only).

``scripts/next_torch.py`` copies this module into a temporary directory, beside a two-line
``sitecustomize.py`` that calls :func:`install`, and puts that directory first on ``PYTHONPATH``.
Every interpreter started with that environment (pytest, its rank processes) then imports
``torch.distributed.fsdp._fully_shard.<name>`` from the overlay folder's ``<name>.py`` where the
folder has one, and the rest of torch as installed: the installed torch is neither copied nor
modified. The package's ``__init__`` stays torch's unless the folder has an ``__init__.py``; a
file of the folder that torch does not have (a new module) is served when something imports it.

``relabel`` makes ``torch.__version__`` read another release (``2.16.0.dev``): ``torch.version``
is executed as installed, then its ``__version__`` replaced, before ``torch`` reads it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

PACKAGE = "torch.distributed.fsdp._fully_shard"
VERSION_MODULE = "torch.version"


class _RelabelLoader(importlib.abc.Loader):
    """torch.version's own loader, then ``__version__`` replaced."""

    def __init__(self, loader: importlib.abc.Loader, version: str) -> None:
        self._loader = loader
        self._version = version

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        module.__version__ = self._version


class OverlayFinder(importlib.abc.MetaPathFinder):
    """Serves FSDP2's modules from ``folder`` where it has them; says nothing about any other."""

    def __init__(self, folder: str | None, relabel: str | None = None) -> None:
        self.folder = os.path.abspath(folder) if folder else None  # None: only the relabel
        self.relabel = relabel

    def find_spec(self, fullname, path=None, target=None):
        if fullname == VERSION_MODULE and self.relabel:
            return self._relabelled(fullname, path, target)
        if fullname == PACKAGE:
            return self._package(fullname, path, target)
        package, _, name = fullname.rpartition(".")
        if package != PACKAGE or self.folder is None:
            return None
        overlay_file = os.path.join(self.folder, f"{name}.py")
        return importlib.util.spec_from_file_location(fullname, overlay_file) if os.path.isfile(overlay_file) else None

    def _package(self, fullname, path, target):
        """The overlay's ``__init__.py``, searching torch's folder for the submodules it lacks."""
        overlay_file = os.path.join(self.folder or "", "__init__.py")
        if self.folder is None or not os.path.isfile(overlay_file):
            return None
        installed = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        locations = installed.submodule_search_locations if installed else [self.folder]
        return importlib.util.spec_from_file_location(fullname, overlay_file, submodule_search_locations=locations)

    def _relabelled(self, fullname, path, target):
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _RelabelLoader(spec.loader, self.relabel)
        return spec


def install(folder: str | None, relabel: str | None = None) -> OverlayFinder:
    """Put the overlay first on ``sys.meta_path`` (before torch is imported, at interpreter start)."""
    finder = OverlayFinder(folder, relabel)
    sys.meta_path.insert(0, finder)
    return finder


def run_shadowed_sitecustomize(own_dir: str) -> None:
    """Run the ``sitecustomize`` ours hides (a venv's or the system's), as Python would have."""
    others = [entry for entry in sys.path if os.path.abspath(entry or ".") != os.path.abspath(own_dir)]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def overlaid_modules(folder: str) -> list[str]:
    """The FSDP2 modules of this process that were loaded from ``folder`` (a probe's evidence)."""
    folder = os.path.abspath(folder)
    loaded = []
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None) or ""
        if (name == PACKAGE or name.startswith(PACKAGE + ".")) and os.path.dirname(os.path.abspath(where)) == folder:
            loaded.append(name.rpartition(".")[2] if name != PACKAGE else "__init__")
    return sorted(loaded)
