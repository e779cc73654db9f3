"""The read-bandwidth probe: timed ``torch.sum`` calls over a float32 buffer, in this process or in a child.

A CPU's probe buffer is at least 4 x the last-level cache (``roofline.bandwidth_buffer_bytes``): GiBs where that
cache is hundreds of MiB. Filled in the process being measured, it would set that process's resident peak (VmHWM)
for the rest of its life, so ``roofline.measure_read_bandwidth`` runs a CPU's probe in a child process
(``sum_seconds_in_child``) with this process's thread count: the same code, buffer and threads, so the same
bandwidth. The child loads this file alone (stdlib and torch only), not the lit_grpo package, so it starts fast.

The probe is not this process's child when it fills its buffer: the process started forks it and exits at once, so
the probe is reparented (to init) and never reaped here. A reaped child's peak would count in this process's own
``ru_maxrss`` as its parent's ``wait4`` (or ``/usr/bin/time -v``) reads it, the largest of a process and of the
children it reaped. The probe reports through the pipes it inherits, and ends itself past ``CHILD_TIMEOUT_S``.
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch

__all__ = ["child_command", "median_seconds", "sum_seconds", "sum_seconds_in_child"]

#: The child's limit: importing torch on a loaded machine takes seconds, the probe itself a few.
CHILD_TIMEOUT_S = 300.0

#: The child's program: it forks the probe and exits (the probe, reparented, is never reaped by this process), then
#: the probe loads this file by its path (argv[1]) and runs its ``main`` on the rest of argv.
_CHILD_PROGRAM = """import os, sys
if os.fork():
    os._exit(0)
import importlib.util
spec = importlib.util.spec_from_file_location("read_probe", sys.argv[1])
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)
probe.main(sys.argv[2:])
"""


def median_seconds(run: Callable[[], Any], device: torch.device, budget_s: float, min_runs: int = 3,
                   max_runs: int = 30) -> float:
    """Median wall time of ``run()`` after one untimed warm-up call: at least ``min_runs`` timed calls, more while
    ``budget_s`` lasts. On CUDA each call is waited for (kernels run asynchronously)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    run()
    sync(device)
    times, started = [], time.perf_counter()
    while len(times) < min_runs or (len(times) < max_runs and time.perf_counter() - started < budget_s):
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def sum_seconds(device: torch.device, buffer_bytes: int, budget_s: float, inner: int) -> float:
    """Median seconds of one ``torch.sum`` over a float32 buffer of ``buffer_bytes`` on ``device``, a timed call
    being ``inner`` back-to-back sums (the buffer is freed on return)."""
    buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32, device=device)

    def run():
        for _ in range(inner):
            buffer.sum()

    return median_seconds(run, device, budget_s) / inner


def child_command(buffer_bytes: int, budget_s: float, inner: int, threads: int) -> list[str]:
    """The command that prints ``sum_seconds`` on the CPU with ``threads`` torch threads, in a child process."""
    return [sys.executable, "-c", _CHILD_PROGRAM, __file__, str(buffer_bytes), repr(float(budget_s)), str(inner),
            str(threads)]


def sum_seconds_in_child(buffer_bytes: int, budget_s: float, inner: int) -> float:
    """``sum_seconds`` on the CPU, run by a probe process (module docstring) with this process's torch thread
    count: the buffer is the probe's memory, never this process's, and its peak is no child's of this process.

    Raises:
        RuntimeError: the child did not start (or no interpreter is known to start it), or the probe printed no
            seconds (it failed, or ended itself past ``CHILD_TIMEOUT_S``): the message holds the end of what it wrote.
    """
    if not sys.executable:  # an embedded Python may name none: None would fail in subprocess with a TypeError
        raise RuntimeError(f"the read-bandwidth probe's child did not run: sys.executable={sys.executable!r} names "
                           "no Python interpreter to start")
    command = child_command(buffer_bytes, budget_s, inner, torch.get_num_threads())
    try:  # the output's end is the probe's: its pipes close when it ends
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S + 30)
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"the read-bandwidth probe's child did not run: {error}") from error
    try:
        return float(done.stdout.split()[-1])
    except (IndexError, ValueError) as error:
        # no exit status to show: the status is the starter's, which exits at once, not the probe's
        raise RuntimeError(f"the read-bandwidth probe printed no seconds: "
                           f"{(done.stderr.strip() or done.stdout.strip())[-2000:]}") from error


def main(argv: list[str]) -> None:
    """The child's entry: ``BUFFER_BYTES BUDGET_S INNER THREADS``; prints the seconds of one sum."""
    signal.alarm(int(CHILD_TIMEOUT_S))  # nobody waits for the probe: it ends itself
    buffer_bytes, budget_s, inner, threads = int(argv[0]), float(argv[1]), int(argv[2]), int(argv[3])
    torch.set_num_threads(threads)
    print(repr(sum_seconds(torch.device("cpu"), buffer_bytes, budget_s, inner)))
