"""The package as a user installs it, not as the editable install shows it.

The editable install maps whole source folders, so a module left out of the wheel still imports here. So the wheel
is built from a copy of the sources and installed into a fresh environment that cannot see them; there every
module must import, ``import lit_grpo.cli`` must leave the opt-in length-aware scheduler unloaded, and
``lit-grpo fit`` must train a step. A cheap check beside it: setup.py's package list is every package folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement  # transformers' dependency

if sys.version_info >= (3, 11):
    import tomllib
else:  # the docs extra brings tomli on Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
#: Installed package -> its source folder (the design's package-dir mapping: nothing lands in site-packages under a
#: generic name such as ``callbacks``).
SOURCES = {"lit_grpo": "lit_grpo", "lit_grpo.callbacks": "callbacks", "lit_grpo.datamodules": "datamodules"}
#: What a build reads besides the package folders (missing ones are skipped: a clone may have no LICENSE).
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "MANIFEST.in")
#: Seconds each step may take; a step that hangs fails with its output instead of stalling the suite.
TIMEOUT = 300
#: Run inside the installed environment: imports what ``lit-grpo`` runs (``lit_grpo.cli.command``), notes the
#: length-aware modules that loaded, then imports every module of the package and prints one JSON report as its last
#: line.
IMPORT_CHECK = r"""
import importlib, json, os, pkgutil, sys, traceback
import lit_grpo, lit_grpo.cli.command
report = {"file": lit_grpo.__file__,
          "length_aware": sorted(m for m in sys.modules if m.startswith("lit_grpo.scheduling.length_aware"))}
modules, failed = [], {}
for info in pkgutil.walk_packages(lit_grpo.__path__, "lit_grpo."):
    modules.append(info.name)
    try:
        importlib.import_module(info.name)
    except Exception:
        failed[info.name] = traceback.format_exc()
prefix = os.path.realpath(sys.prefix) + os.sep
report.update(modules=["lit_grpo", *modules], failed=failed,
              outside=sorted(name for name, module in sys.modules.items() if name.startswith("lit_grpo")
                             and not os.path.realpath(getattr(module, "__file__", None) or prefix).startswith(prefix)))
print(json.dumps(report))
"""


def _load_setup_script():
    """setup.py as a module (its ``setup()`` call runs only as ``__main__``, i.e. in a build)."""
    spec = importlib.util.spec_from_file_location("lit_grpo_setup_script", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _source_packages() -> set[str]:
    """Every folder with an ``__init__.py`` under the source folders, by its installed name."""
    packages = set()
    for name, folder in SOURCES.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            packages.add(".".join((name, *init.parent.relative_to(ROOT / folder).parts)))
    return packages


def _source_modules() -> set[str]:
    """Every ``.py`` file under the source folders, by its installed module name."""
    modules = set()
    for name, folder in SOURCES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            modules.add(".".join((name, *parts)).removesuffix(".__init__"))
    return modules


def _text(output: str | bytes | None) -> str:
    """A process's output as text (a timeout leaves the partial output as bytes)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _run(cmd: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    """Run a step of the build and install; a failure or a timeout fails the test with the step's output."""
    command = " ".join(map(str, cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, **kwargs)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{what} ran past {TIMEOUT} s ({command}):\n{_text(error.stdout)[-4000:]}\n"
                    f"{_text(error.stderr)[-8000:]}")
    assert proc.returncode == 0, f"{what} failed ({command}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def _unmet_build_requirements() -> list[str]:
    """pyproject's build requirements this environment does not meet: the wheel is built offline, without build
    isolation, so with this environment's backend (a fresh venv's setuptools is too old)."""
    unmet = []
    for text in tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            found = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            found = None
        if found is None or not requirement.specifier.contains(found, prereleases=True):
            unmet.append(f"{text} (found: {found or 'not installed'})")
    return unmet


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the sources: a build/ folder in the tree could carry modules of an earlier build into
    this wheel, and several runs may build at once."""
    unmet = _unmet_build_requirements()
    assert not unmet, (f"this environment lacks pyproject's build requirements {unmet}, which the offline build "
                       "uses; `pip install -e '.[dev]'` brings them")
    src = tmp_path / "src"
    src.mkdir()
    for name in BUILD_FILES:
        if (ROOT / name).is_file():
            shutil.copy(ROOT / name, src / name)
    for folder in SOURCES.values():
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index",
          "--disable-pip-version-check", "-q", "-w", str(dist)], "building the wheel", cwd=src)
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, f"the build left {wheels} in {dist}; expected one wheel"
    return wheels[0]


def _fresh_environment(tmp_path: Path, wheel: Path) -> Path:
    """A venv holding the wheel that finds this interpreter's other packages (torch, lightning, ...) but not the
    sources: its ``.pth`` lists their site-packages as plain paths, and plain path lines do not run the ``.pth``
    files inside them, where the editable install's finder of lit_grpo is hooked in."""
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], "creating the venv")
    python = venv / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                   "asking the venv for its site-packages").stdout.strip()
    outer = [*site.getsitepackages(), sysconfig.get_path("purelib")]
    if site.ENABLE_USER_SITE:
        outer.append(site.getusersitepackages())
    paths = dict.fromkeys(path for path in outer if os.path.isdir(path))
    (Path(purelib) / "outer_site_packages.pth").write_text("".join(f"{path}\n" for path in paths))
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
          "--disable-pip-version-check", "-q", str(wheel)], "installing the wheel into the venv")
    return venv


def test_setup_installs_every_package_folder_under_its_installed_name():
    setup_script = _load_setup_script()
    assert setup_script.package_dirs() == SOURCES
    packages = setup_script.packages()
    assert "lit_grpo.scheduling.length_aware" in packages
    missing, extra = _source_packages() - set(packages), set(packages) - _source_packages()
    # a package folder below a folder without __init__.py is not found: the missing name says which
    assert not missing and not extra, f"setup.py misses {sorted(missing)} and adds {sorted(extra)}"


def test_a_bad_package_dir_is_named(tmp_path):
    setup_script = _load_setup_script()
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"lit_grpo" = "nowhere"\n')
    with pytest.raises(ValueError, match=r"maps 'lit_grpo' to 'nowhere', which is not a package folder"):
        setup_script.packages(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    with pytest.raises(ValueError, match=r"has no \[tool.setuptools.package-dir\]"):
        setup_script.packages(tmp_path)


def test_the_wheel_installed_apart_from_the_sources_imports_every_module_and_fits(tmp_path):
    venv = _fresh_environment(tmp_path, _build_wheel(tmp_path))
    work, run_dir = tmp_path / "work", tmp_path / "run"
    work.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", PYTHONNOUSERSITE="1")
    # Both start at once: each spends most of its time importing lit_grpo.cli.
    jobs = {
        "the import check": subprocess.Popen([str(venv / "bin" / "python"), "-c", IMPORT_CHECK], cwd=work, env=env,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        "lit-grpo fit": subprocess.Popen([str(venv / "bin" / "lit-grpo"), "fit", "--config",
                                          str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_steps", "1",
                                          "--trainer.default_root_dir", str(run_dir)], cwd=work, env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
    }
    outputs = {}
    try:
        for what, proc in jobs.items():
            try:
                out, err = proc.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                pytest.fail(f"{what} ran past {TIMEOUT} s:\n{out[-4000:]}\n{err[-8000:]}")
            assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-4000:]}\n{err[-8000:]}"
            outputs[what] = out
    finally:
        for proc in jobs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    report = json.loads(outputs["the import check"].strip().splitlines()[-1])
    venv_prefix = os.path.realpath(venv) + os.sep
    assert os.path.realpath(report["file"]).startswith(venv_prefix), f"lit_grpo came from {report['file']}, not {venv}"
    assert report["outside"] == [], f"modules loaded from outside the venv: {report['outside']}"
    assert report["failed"] == {}, "modules that fail to import:\n" + "\n".join(report["failed"].values())
    missing = sorted(_source_modules() - set(report["modules"]))
    assert not missing, f"modules missing from the wheel: {missing}"
    assert report["length_aware"] == [], \
        f"import lit_grpo.cli.command loaded the opt-in scheduler: {report['length_aware']}"

    checkpoints = list(run_dir.rglob("last.ckpt"))
    assert len(checkpoints) == 1, f"the fit left {checkpoints}; expected one last.ckpt\n{outputs['lit-grpo fit']}"
    assert torch.load(checkpoints[0], map_location="cpu", weights_only=False)["global_step"] == 1
