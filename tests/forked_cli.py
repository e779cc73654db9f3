"""``lit-grpo`` runs for the tests, in processes forked from one that has imported lit_grpo and warmed up.

An interpreter here spends seconds importing torch, Lightning and transformers before a tiny run starts, most of the
run; a fork of a process that did so already spends none. :func:`run` is one ``lit-grpo`` process, as
``subprocess.run`` of the command would be (its exit status, its output); :func:`run_ranks` the two ranks of a
2-node launch. The fork server imports lit_grpo and tests/forkserver_warmup.py once, when the first run starts.

A forked run is ``lit_grpo.cli.main`` in a fresh process, with the given working folder, environment and
``sys.argv`` (so Lightning's own launcher can start further ranks, as real ``lit-grpo`` processes); what it cannot
show is the console script itself and an interpreter's start, which tests/test_packaging.py and the real
launches of tests/test_ddp.py and tests/test_rank_failures.py run.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["lit_grpo.cli", "forkserver_warmup"])
    return _context


def _main(argv: list[str], cwd: str, env: dict[str, str], stdout: str, stderr: str) -> None:
    """One ``lit-grpo`` process (in a fork): ``argv`` run in ``cwd`` with ``env``, its output in two files."""
    sys.path[:] = [os.path.abspath(entry) for entry in sys.path]  # "" meant the server's folder, not cwd
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out if stderr == stdout else os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    sys.argv = [shutil.which("lit-grpo") or "lit-grpo", *argv]
    from lit_grpo.cli import main

    main(argv)


def _start(argv: list[str], cwd: Path, env: dict[str, str] | None, outputs: tuple[Path, Path]):
    process = _forkserver().Process(target=_main, args=(list(argv), str(cwd), dict(os.environ if env is None else env),
                                                        str(outputs[0]), str(outputs[1])))
    process.start()
    return process


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
        ) -> subprocess.CompletedProcess:
    """``lit-grpo ARGV`` in ``cwd`` with ``env`` (default: this process's), as ``subprocess.run(..., capture_output=
    True, text=True, timeout=timeout)`` would run it; past ``timeout`` the process is killed and
    ``subprocess.TimeoutExpired`` raised."""
    with tempfile.TemporaryDirectory() as folder:
        outputs = (Path(folder) / "stdout", Path(folder) / "stderr")
        process = _start(argv, cwd, env, outputs)
        process.join(timeout)
        if process.is_alive():
            _kill(process)
            raise subprocess.TimeoutExpired(["lit-grpo", *argv], timeout, _read(outputs[0]), _read(outputs[1]))
        return subprocess.CompletedProcess(["lit-grpo", *argv], process.exitcode, *(_read(path) for path in outputs))


def _kill(process) -> None:
    """Kill a forked run and the processes it started (the ranks Lightning's launcher starts as its children)."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
    process.kill()
    process.join()


def run_ranks(argv: list[str], folder: Path, port: int, timeout: float,
              env: dict[str, str] | None = None) -> list[tuple[int | None, str, float]]:
    """Rank 0 and rank 1 of ``lit-grpo ARGV`` as 2 nodes x 1 process (Lightning's ``LightningEnvironment``: each
    process given its ``NODE_RANK`` and one ``MASTER_ADDR`` / ``MASTER_PORT``), in ``folder``; waits for both, at
    most ``timeout`` seconds from their start. Returns per rank its exit status (None: still running at the
    timeout, then killed), its output (stdout and stderr together) and the seconds it ran."""
    base = {**(os.environ if env is None else env), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1"}
    for name in ("LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE"):  # a launcher's, which would say who starts the ranks
        base.pop(name, None)
    logs = [folder / f"rank{rank}.log" for rank in (0, 1)]
    ranks = [_start(argv, folder, {**base, "NODE_RANK": str(rank)}, (logs[rank], logs[rank])) for rank in (0, 1)]
    started, ended = time.monotonic(), {}
    while len(ended) < 2 and time.monotonic() - started < timeout:
        for rank, process in enumerate(ranks):
            if rank not in ended and not process.is_alive():
                ended[rank] = time.monotonic() - started
        time.sleep(0.1)
    for process in ranks:
        if process.is_alive():
            _kill(process)
        process.join()
    return [(ranks[rank].exitcode if rank in ended else None, _read(logs[rank]), ended.get(rank, timeout))
            for rank in (0, 1)]
