"""``lit-grpo`` runs for the tests, in processes forked from one that has imported lit_grpo and warmed up.

An interpreter here spends seconds importing torch, Lightning and transformers before a tiny run starts, most of the
run; a fork of a process that did so already spends none. :func:`run` is one ``lit-grpo`` process, as
``subprocess.run`` of the command would be (its exit status, its output); :func:`run_ranks` the two ranks of a
2-node launch (or of a Lightning script of its own, not the CLI); :func:`run_command` and :class:`Popen` stand in
for ``subprocess`` in a tool that starts its own runs (:func:`run_command` its own workers too); :func:`start_script` a
Lightning script of its own in a session of its own.
The fork server imports lit_grpo and tests/forkserver_warmup.py once, when the first run starts.

A forked run is ``lit_grpo.cli.main`` in a fresh process, with the given working folder, environment and
``sys.argv`` (so Lightning's own launcher can start further ranks, as real ``lit-grpo`` processes); what it cannot
show is the console script itself and an interpreter's start, which tests/test_packaging.py and the real
launch of tests/test_rank_failures.py run.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import psutil
import torch

_context = None


def forkserver():
    """The multiprocessing context whose processes fork from the warmed-up server (started on first use): also for
    tests that start processes of their own."""
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["lit_grpo.cli.command", "forkserver_warmup"])
        # The server imports its preloads from its own sys.path, where Python 3.11's leaves out the tests' folder
        # (it ignores the sys_path it is given), and skips any it cannot import without a word.
        path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
        with mock.patch.dict(os.environ, PYTHONPATH=path):
            multiprocessing.forkserver.ensure_running()
        _context = context
    return _context


def _main(argv: list[str], cwd: str, env: dict[str, str], stdout: str, stderr: str, new_session: bool,
          console_script: str, script: str | None = None, module: str | None = None) -> None:
    """One ``lit-grpo`` process (in a fork): ``argv`` run in ``cwd`` with ``env``, its output in two files, in a
    session of its own where ``new_session``, as ``console_script`` (its ``sys.argv[0]``, which Lightning's launcher
    starts further ranks with); with ``script``, ``python SCRIPT ARGV`` instead (not the CLI); with ``module``,
    ``python -m MODULE ARGV``."""
    if new_session:
        os.setsid()
    sys.path[:] = [os.path.abspath(entry) for entry in sys.path]  # "" meant the server's folder, not cwd
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # as torch takes it when an interpreter starts
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out if stderr == stdout else os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    if script is not None or module is not None:
        if module is not None:  # as an interpreter starting `-m` puts them: the folder, then PYTHONPATH's
            sys.path[:0] = [cwd, *(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
        sys.argv = [script or module, *argv]
        try:
            if module is not None:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
        except Exception:  # the interpreter hands a script's uncaught error to sys.excepthook, then exits with 1
            sys.excepthook(*sys.exc_info())
            sys.exit(1)
        return
    sys.argv = [console_script, *argv]
    from lit_grpo.cli import main

    main(argv)


def _start(argv: list[str], cwd: Path, env: dict[str, str] | None, outputs: tuple[Path, Path],
           new_session: bool = False, script: str | None = None, module: str | None = None):
    from tools.harness import lit_grpo_script

    process = forkserver().Process(target=_main, args=(list(argv), str(cwd), dict(os.environ if env is None else env),
                                                        str(outputs[0]), str(outputs[1]), new_session,
                                                        str(lit_grpo_script()), script, module))
    process.start()
    return process


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300,
        script: str | None = None, module: str | None = None) -> subprocess.CompletedProcess:
    """``lit-grpo ARGV`` (with ``script``: ``python SCRIPT ARGV``; with ``module``: ``python -m MODULE ARGV``) in
    ``cwd`` with ``env`` (default: this process's), as ``subprocess.run(..., capture_output=True, text=True,
    timeout=timeout)`` would run it; past ``timeout`` the process is killed and ``subprocess.TimeoutExpired``
    raised."""
    with tempfile.TemporaryDirectory() as folder:
        outputs = (Path(folder) / "stdout", Path(folder) / "stderr")
        process = _start(argv, cwd, env, outputs, script=script, module=module)
        process.join(timeout)
        command = ["python", "-m", module, *argv] if module else ["lit-grpo", *argv]
        if process.is_alive():
            _kill(process)
            raise subprocess.TimeoutExpired(command, timeout, _read(outputs[0]), _read(outputs[1]))
        return subprocess.CompletedProcess(command, process.exitcode, *(_read(path) for path in outputs))


def run_command(command: list[str], env: dict[str, str] | None = None, timeout: float = 300,
                **_: object) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, env=env)`` of a ``lit-grpo`` command
    (``tools.harness.lit_grpo_command()`` and its arguments) or of a tool's (``tools.harness.tool_command``:
    ``python -m tools.NAME ...``) run as :func:`run` runs it, in the current folder: a stand-in for
    ``subprocess.run`` in a tool that starts runs or workers of its own. A forked worker's interpreter has started
    already, so what it reads only then (glibc's ``MALLOC_*`` variables) is the server's, not ``env``'s."""
    if command[:2] == [sys.executable, "-m"] and command[2] != "lit_grpo.cli":
        return run(command[3:], Path.cwd(), env, timeout, module=command[2])
    return run(_lit_grpo_arguments(command), Path.cwd(), env, timeout)


class Popen:
    """What a tool uses of ``subprocess.Popen`` (``pid``, ``poll``, ``wait``) for a forked ``lit-grpo`` command in a
    session of its own, as ``Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
    start_new_session=True)`` would start it: a stand-in in a tool that starts and signals runs of its own."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str], log: Path):
        self.args = command
        self._process = _start(_lit_grpo_arguments(command), cwd, env, (log, log), new_session=True)
        self.pid = self._process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode


def start_script(script: str, argv: list[str], cwd: Path, env: dict[str, str], log: Path):
    """``python SCRIPT ARGV`` (a Lightning script of its own) forked in a session of its own, as
    ``Popen([sys.executable, script, *argv], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
    start_new_session=True)`` would start it: the started process (its ``pid`` leads the session). Ranks that
    Lightning's own launcher starts from it are real interpreters of the script, in that session."""
    return _start(argv, cwd, env, (log, log), new_session=True, script=script)


def _lit_grpo_arguments(command: list[str]) -> list[str]:
    """The arguments of a ``lit-grpo`` command: ``tools.harness.lit_grpo_command()`` or ``python -m lit_grpo.cli``,
    then these."""
    from tools.harness import lit_grpo_command

    for prefix in (lit_grpo_command(), [sys.executable, "-m", "lit_grpo.cli"]):
        if command[:len(prefix)] == prefix:
            return command[len(prefix):]
    raise ValueError(f"{command[:3]} does not start a lit-grpo command")


def _kill(process) -> None:
    """Kill a forked run and the processes it started (the ranks Lightning's launcher starts as its children)."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
    process.kill()
    process.join()


def run_ranks(argv: list[str], folder: Path, port: int, timeout: float, env: dict[str, str] | None = None,
              rank_folders: tuple[Path, Path] | None = None, script: str | None = None, torchrun_nodes: int = 0
              ) -> list[tuple[int | None, str, float]]:
    """Rank 0 and rank 1 of ``lit-grpo ARGV`` (with ``script``: of ``python SCRIPT ARGV``, a Lightning script of
    its own) as 2 nodes x 1 process (Lightning's ``LightningEnvironment``: each process given its ``NODE_RANK`` and
    one ``MASTER_ADDR`` / ``MASTER_PORT``; with ``torchrun_nodes`` 2 or 1, torchrun's environment instead, of 2
    nodes x 1 process or 1 node x 2, whose rank 0 runs the store as under ``env://``), in ``folder`` (or each in
    its own of ``rank_folders``: nodes without a shared file system, for relative paths; the logs stay in
    ``folder``); waits for both, at most ``timeout`` seconds from their start. Returns per rank its exit status
    (None: still running at the timeout, then killed), its output (stdout and stderr together) and the seconds it
    ran."""
    base = {**(os.environ if env is None else env), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1"}
    for name in ("LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE"):  # a launcher's, which would say who starts the ranks
        base.pop(name, None)
    logs = [folder / f"rank{rank}.log" for rank in (0, 1)]
    cwds = rank_folders or (folder, folder)
    per_node = 2 // max(torchrun_nodes, 1)
    launched = [{"RANK": str(rank), "GROUP_RANK": str(rank // per_node), "LOCAL_RANK": str(rank % per_node),
                 "LOCAL_WORLD_SIZE": str(per_node), "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "test"}
                if torchrun_nodes else {"NODE_RANK": str(rank)} for rank in (0, 1)]
    ranks = [_start(argv, cwds[rank], {**base, **launched[rank]}, (logs[rank], logs[rank]), script=script)
             for rank in (0, 1)]
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
