"""tools/setup.sh's choice of torch build when told which one (LIT_GRPO_TORCH_BUILD), with pip replaced by echo.

Detection itself (nvidia-smi present or not) is tested in test_tools.py.
"""

import os
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "tools" / "setup.sh"


def _dry_run(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LIT_GRPO_SETUP_DRY_RUN": "1", **env})


def _torch_line(proc: subprocess.CompletedProcess) -> str:
    return next(line for line in proc.stdout.splitlines() if line.startswith("pip install torch=="))


def test_a_cuda_build_can_be_asked_for_on_a_machine_without_a_gpu():
    proc = _dry_run(LIT_GRPO_TORCH_BUILD="cuda", LIT_GRPO_TORCH_VERSION="2.9.1")
    assert proc.returncode == 0, proc.stderr
    assert "setup: LIT_GRPO_TORCH_BUILD=cuda: torch==2.9.1 from PyPI (CUDA build)" in proc.stdout
    assert _torch_line(proc) == "pip install torch==2.9.1"


def test_a_cpu_build_can_be_asked_for_whatever_is_detected():
    proc = _dry_run(LIT_GRPO_TORCH_BUILD="cpu")
    assert proc.returncode == 0, proc.stderr
    assert "setup: LIT_GRPO_TORCH_BUILD=cpu" in proc.stdout and "CUDA build" not in proc.stdout
    # the CPU index when it answers, else the configured one (this project's machines cannot reach it)
    assert ("--index-url https://download.pytorch.org/whl/cpu" in _torch_line(proc)) == (
        "not reachable" not in proc.stdout)


def test_skip_torch_installs_no_torch():
    proc = _dry_run(LIT_GRPO_SKIP_TORCH="1")
    assert proc.returncode == 0, proc.stderr
    assert "keeping the installed torch" in proc.stdout and "pip install torch" not in proc.stdout


@pytest.mark.parametrize("build", ["gpu", "CPU"])
def test_an_unknown_build_is_refused_by_name(build):
    proc = _dry_run(LIT_GRPO_TORCH_BUILD=build)
    assert proc.returncode == 2
    assert f"LIT_GRPO_TORCH_BUILD={build} is not one of auto, cpu, cuda" in proc.stderr
    assert "pip install" not in proc.stdout
