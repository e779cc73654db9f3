"""Process memory high-water marks: CUDA allocator peaks and the CPU resident-set peak.

CPU: Linux keeps a per-process resident high-water mark (VmHWM in /proc/self/status) that writing "5" to
/proc/self/clear_refs resets, so a peak reached anywhere inside a region (another thread included) is caught,
not only the value at its end. Where the reset is not allowed (not Linux, or a restricted /proc), ``PeakRSS``
falls back to a thread that samples the resident size every few milliseconds.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATM = Path("/proc/self/statm")


def current_rss_bytes() -> int | None:
    """The process's resident set size now, or None where /proc is unavailable."""
    try:
        resident_pages = int(_STATM.read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _vm_hwm_bytes() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _reset_vm_hwm() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    # The reset only counts if the mark really dropped to (about) the current resident size.
    hwm, rss = _vm_hwm_bytes(), current_rss_bytes()
    return hwm is not None and rss is not None and hwm <= rss + (1 << 20)


class PeakRSS:
    """Measures the resident-set peak of a region: ``start()``, run the region, ``stop() -> bytes or None``.

    ``method`` says how: "vmhwm" (kernel high-water mark, exact), "sampling" (a 2 ms polling thread; can miss
    a spike shorter than that) or None when the platform offers neither (``unavailable_reason`` says why).
    """

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.method: str | None = None
        self.unavailable_reason = ""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._peak = 0

    def start(self) -> None:
        if _reset_vm_hwm():
            self.method = "vmhwm"
            return
        if current_rss_bytes() is None:
            self.method = None
            self.unavailable_reason = "/proc/self/statm is not readable on this platform"
            return
        self.method = "sampling"
        self._peak = current_rss_bytes() or 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="PeakRSS", daemon=True)
        self._thread.start()

    def stop(self) -> int | None:
        if self.method == "vmhwm":
            return _vm_hwm_bytes()
        if self.method == "sampling" and self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            return max(self._peak, current_rss_bytes() or 0)
        return None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, current_rss_bytes() or 0)
