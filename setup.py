"""The wheel's package list, found rather than written down: every package under each source folder of
pyproject's ``[tool.setuptools.package-dir]``, under its installed name. pyproject.toml declares everything else.

Why a setup.py: ``[tool.setuptools.packages.find]`` names a package after its folder, so it cannot install the
top-level ``callbacks/`` and ``datamodules/`` as ``lit_grpo.callbacks`` and ``lit_grpo.datamodules``, and a
hand-written list misses any subpackage added later (the wheel then fails on import, while the editable install,
which maps whole folders, hides it). The mapping itself stays in pyproject.toml, its one declaration (the docs'
griffe extension reads it there too).
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import find_packages, setup

if sys.version_info >= (3, 11):
    import tomllib
else:  # pyproject's build requirements bring tomli on Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """Installed package name -> its source folder relative to ``root``, from ``root``/pyproject.toml."""
    setuptools_table = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    mapping = setuptools_table.get("package-dir")
    if not mapping:
        raise ValueError(f"{root / 'pyproject.toml'} has no [tool.setuptools.package-dir]; it must map each installed "
                         "top-level package to its folder, e.g. lit_grpo = \"lit_grpo\"")
    return dict(mapping)


def packages(root: Path = ROOT) -> list[str]:
    """Every package the wheel installs: each mapped folder and each package folder below it (one with an
    ``__init__.py``, reached through package folders), named as installed."""
    found = set()
    for name, folder in package_dirs(root).items():
        if not (root / folder / "__init__.py").is_file():
            raise ValueError(f"[tool.setuptools.package-dir] maps {name!r} to {folder!r}, which is not a package "
                             f"folder of {root} (no __init__.py); allowed: a folder with an __init__.py")
        found.add(name)
        found.update(f"{name}.{sub}" for sub in find_packages(str(root / folder)))
    return sorted(found)


if __name__ == "__main__":  # the build backend runs this file as __main__; tests import packages() without building
    setup(packages=packages())
