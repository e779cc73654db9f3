"""A griffe extension: subpackages that live outside their parent's folder, for the API reference.

pyproject's ``[tool.setuptools.package-dir]`` installs ``callbacks/`` as ``lit_grpo.callbacks`` and ``datamodules/``
as ``lit_grpo.datamodules``. griffe reads packages from their folders, so it would not find those two inside
``lit_grpo/``; this extension loads each mapped folder and attaches it to its parent under its installed name.
The mapping is read from pyproject.toml, so it is declared once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import griffe

if sys.version_info >= (3, 11):
    import tomllib
else:  # the docs extra installs tomli on Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Path]:
    """Installed dotted name -> source folder, for every subpackage mapped away from its parent's folder."""
    mapping = tomllib.loads(pyproject.read_text())["tool"]["setuptools"].get("package-dir", {})
    return {name: ROOT / folder for name, folder in mapping.items()
            if "." in name and (ROOT / folder).resolve() != (ROOT / name.replace(".", "/")).resolve()}


class PackageDirs(griffe.Extension):
    """Attach each mapped folder to its parent package when griffe loads that parent."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        for name, folder in package_dirs().items():
            parent, _, child = name.rpartition(".")
            if parent != pkg.path:
                continue
            module = loader.load(folder, try_relative_path=True)
            pkg.set_member(child, module)
