"""A child process's memory, read from outside it: what the process itself does to its counters cannot change it.

:func:`watch` waits for a child (a ``subprocess.Popen``) up to a deadline and, every ``interval_s`` meanwhile, reads
its resident set size (``VmRSS``) and the kernel's high-water mark (``VmHWM``) from ``/proc/<pid>/status``; when
the child ends it is reaped with ``os.wait4``, whose ``ru_maxrss`` is the kernel's peak RSS over the child's whole
life (what ``/usr/bin/time -v`` reports as "Maximum resident set size"). A child that writes ``5`` to its own
``/proc/self/clear_refs`` lowers the last two (lit_grpo's ``PeakMemoryMonitor(cpu_method="hwm")`` does); the
samples are unaffected. :func:`window_peak` is the largest sample between two ``time.time()`` stamps, a step's
peak when the child reports when its steps began and ended.

Linux only (``/proc`` and ``os.wait4``); the RSS is the child's own, not its children's.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass, field

_FIELD = re.compile(r"^(VmRSS|VmHWM):\s+(\d+)\s+kB", re.MULTILINE)


@dataclass
class Watched:
    """What :func:`watch` saw of one child.

    Attributes:
        returncode: the exit status as ``Popen.returncode`` gives it (negative: killed by that signal).
        timed_out: the deadline passed and the child was killed (SIGKILL).
        stopped: the watch itself was interrupted (the watcher was told to stop) and the child killed.
        wall_s: seconds from the start of the watch to the child's end.
        samples: ``(time.time(), VmRSS bytes)``, one every ``interval_s``.
        peak_rss_bytes: the largest sample (0 when none was taken).
        hwm_bytes: the child's VmHWM at the last sample (None when none was read).
        maxrss_bytes: ``ru_maxrss`` from ``os.wait4``: the kernel's peak RSS over the child's life.
    """

    returncode: int | None = None
    timed_out: bool = False
    stopped: bool = False
    wall_s: float = 0.0
    samples: list[tuple[float, int]] = field(default_factory=list)
    hwm_bytes: int | None = None
    maxrss_bytes: int | None = None

    @property
    def peak_rss_bytes(self) -> int:
        return max((rss for _, rss in self.samples), default=0)


def read_status(pid: int) -> dict[str, int]:
    """``{"VmRSS": bytes, "VmHWM": bytes}`` of process ``pid`` (empty once it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return {}
    return {name: int(kb) * 1024 for name, kb in _FIELD.findall(text)}


def watch(process: subprocess.Popen, timeout_s: float | None = None, interval_s: float = 0.05,
          seen: Watched | None = None) -> Watched:
    """Sample ``process`` until it ends or ``timeout_s`` passes (then SIGKILL it), reap it, and return what was
    seen: ``seen``, filled in place where given, so that a caller interrupted meanwhile keeps the samples taken so
    far (and ends the child with :func:`kill_and_reap`). The caller must not ``wait()`` on it first: the exit status
    and ``ru_maxrss`` come from one ``wait4``."""
    seen = Watched() if seen is None else seen
    start = time.monotonic()
    while True:
        status = read_status(process.pid)
        if "VmRSS" in status:
            seen.samples.append((time.time(), status["VmRSS"]))
            seen.hwm_bytes = status.get("VmHWM", seen.hwm_bytes)
        seen.wall_s = time.monotonic() - start
        pid, wait_status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            _reaped(process, seen, wait_status, usage)
            break
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            seen.timed_out = True
            kill_and_reap(process, seen)
            break
        time.sleep(interval_s)
    seen.wall_s = time.monotonic() - start
    return seen


def kill_and_reap(process: subprocess.Popen, seen: Watched) -> Watched:
    """SIGKILL ``process`` where it has not been reaped yet, reap it, and put its exit status and ``ru_maxrss``
    into ``seen``."""
    if process.returncode is None:
        process.kill()
        _, wait_status, usage = os.wait4(process.pid, 0)
        _reaped(process, seen, wait_status, usage)
    return seen


def _reaped(process: subprocess.Popen, seen: Watched, wait_status: int, usage) -> None:
    seen.returncode = process.returncode = os.waitstatus_to_exitcode(wait_status)
    seen.maxrss_bytes = usage.ru_maxrss * 1024  # kilobytes on Linux


def window_peak(samples: list[tuple[float, int]], start: float, end: float) -> int | None:
    """The largest sample taken between ``start`` and ``end`` (``time.time()`` stamps); None when none was."""
    inside = [rss for stamp, rss in samples if start <= stamp <= end]
    return max(inside) if inside else None
