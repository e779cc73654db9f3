"""Resettable memory peaks: the CUDA allocator's, and the process's resident-set (RSS) peak on CPU;
``release_freed_host_memory``, the CPU's counterpart of ``torch.cuda.empty_cache``; and ``fix_mmap_threshold``,
which keeps a CPU step's resident memory from growing with its micro-batches.

A tracker answers "what was the most memory held since my last ``reset()``", which is what a per-phase peak
needs (lit_grpo.callbacks.PeakMemoryMonitor, tools/bench_*.py). On CPU there are three ways (``CpuMethod``):

- ``"auto"`` (:class:`SampledHighWaterMark`): leaves the process's counters alone. Linux keeps the process's RSS
  high-water mark (``VmHWM``, also ``getrusage().ru_maxrss`` and what ``/usr/bin/time -v`` reports); it is read,
  never reset. A phase that raised it above everything the process held before gets it as its peak, exactly,
  however short the peak was; a phase that stayed below an earlier peak gets the maximum of a thread sampling RSS
  every few milliseconds. Where VmHWM cannot be read (not Linux), the sampling thread alone.
- ``"sampling"`` (:class:`SampledRss`): the sampling thread alone.
- ``"hwm"`` (:class:`KernelHighWaterMark`, opt-in): resets the kernel's mark at every ``reset()`` by writing ``5``
  to ``/proc/self/clear_refs``, so every phase's peak is exact. The reset is process-wide: anything else reading
  VmHWM, ``ru_maxrss`` or ``/usr/bin/time -v`` afterwards sees only what the process held since the last reset,
  less than it held over its life.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Literal, Protocol, get_args

import torch

CpuMethod = Literal["auto", "hwm", "sampling"]
CPU_METHODS: tuple[str, ...] = get_args(CpuMethod)

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"
_STATM = "/proc/self/statm"
# "5" resets the kernel's resident-set high-water mark (VmHWM) of the process to its current RSS (Linux >= 4.0).
_RESET_HWM = "5"
_PROBE_BYTES = 32 << 20


class PeakTracker(Protocol):
    """A resettable peak: ``read()`` gives ``{key suffix: peak bytes since the last reset()}``, ``current()`` the
    bytes held right now (``"peak_bytes"``'s measure: allocated on CUDA, resident on CPU)."""

    name: str

    def reset(self) -> None: ...

    def read(self) -> dict[str, int]: ...

    def current(self) -> int: ...

    def close(self) -> None: ...


class CudaPeak:
    """The CUDA caching allocator's peak allocated and reserved bytes on one device."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> dict[str, int]:
        return {
            "peak_bytes": torch.cuda.max_memory_allocated(self.device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
        }

    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def close(self) -> None:
        pass


class KernelHighWaterMark:
    """The kernel's RSS high-water mark of this process (Linux VmHWM), reset through /proc/self/clear_refs.

    Exact, and process-wide: after a ``reset()`` every reader of VmHWM, ``getrusage().ru_maxrss`` or
    ``/usr/bin/time -v`` sees the mark of this process since that reset, not of its life (``cpu_method="hwm"``).
    """

    name = "hwm"

    def reset(self) -> None:
        with open(_CLEAR_REFS, "w") as f:
            f.write(_RESET_HWM)

    def read(self) -> dict[str, int]:
        return {"peak_bytes": read_status_bytes("VmHWM")}

    def current(self) -> int:
        return read_status_bytes("VmRSS")

    def close(self) -> None:
        pass


class SampledRss:
    """A daemon thread polling RSS every ``interval_s`` and keeping the maximum since the last reset."""

    name = "sampling"

    def __init__(self, read_rss: Callable[[], int], interval_s: float) -> None:
        self._read_rss = read_rss
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._peak = read_rss()
        self._resets = 0  # a sample read before a reset must not count after it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="PeakMemoryMonitor-rss", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self._interval_s):
            resets = self._resets
            self._observe(self._read_rss(), resets)

    def _observe(self, rss: int, resets: int) -> None:
        with self._lock:
            if resets == self._resets:
                self._peak = max(self._peak, rss)

    def reset(self) -> None:
        rss = self._read_rss()
        with self._lock:
            self._peak, self._resets = rss, self._resets + 1

    def read(self) -> dict[str, int]:
        # Include the value right now: a phase shorter than one interval still gets a reading.
        resets = self._resets
        self._observe(self._read_rss(), resets)
        with self._lock:
            return {"peak_bytes": self._peak}

    def current(self) -> int:
        return self._read_rss()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class SampledHighWaterMark:
    """RSS peaks without touching the process's counters (``cpu_method="auto"``): the kernel's high-water mark
    (VmHWM), read and never reset, where the phase raised it; else a :class:`SampledRss` thread's maximum.

    VmHWM is the most the process ever held. When it is higher at ``read()`` than at the last ``reset()``, the
    process held more during this phase than ever before, and that mark is the phase's peak, exact whatever its
    duration. When it did not rise, the phase stayed below an earlier peak and only the sampling thread saw it
    (peaks shorter than ``interval_s`` can be missed, as with ``"sampling"``).
    """

    name = "hwm+sampling"

    def __init__(self, read_rss: Callable[[], int], interval_s: float) -> None:
        self._mark = read_status_bytes("VmHWM")
        self._sampled = SampledRss(read_rss, interval_s)

    def reset(self) -> None:
        self._mark = read_status_bytes("VmHWM")
        self._sampled.reset()

    def read(self) -> dict[str, int]:
        sampled = self._sampled.read()["peak_bytes"]
        mark = read_status_bytes("VmHWM")
        return {"peak_bytes": max(mark, sampled) if mark > self._mark else sampled}

    def current(self) -> int:
        return self._sampled.current()

    def close(self) -> None:
        self._sampled.close()


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """``(free_bytes, total_bytes)`` of a CUDA device, or None on any other device (a CPU has no budget to read).

    Free counts the driver's free memory (``torch.cuda.mem_get_info``) and the blocks torch's caching allocator
    holds unused (reserved but not allocated): a new tensor takes those first.
    """
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(cached, 0)), int(total)


def trainable_bytes(parameters) -> int:
    """Bytes of the trainable parameters, this process's shards of sharded ones: what each of an update's gradients
    and AdamW's two moments takes (each in the parameter's dtype)."""
    total = 0
    for param in parameters:
        if param.requires_grad:
            local = param.to_local() if hasattr(param, "to_local") else param
            total += local.numel() * local.element_size()
    return total


def read_status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (e.g. VmHWM, VmRSS) in bytes."""
    with open(_STATUS) as f:
        match = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    if match is None:
        raise OSError(f"{field} not found in {_STATUS}")
    return int(match.group(1)) * 1024


def host_peak_bytes() -> int:
    """This process's resident-set high-water mark over its life (Linux VmHWM, unless a ``cpu_method="hwm"``
    tracker reset it; ``getrusage``'s ``ru_maxrss`` where /proc is absent)."""
    try:
        return read_status_bytes("VmHWM")
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def read_statm_rss() -> int:
    """Current RSS from /proc/self/statm (resident pages x page size): cheap enough to poll every few ms."""
    with open(_STATM) as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _libc_function(name: str) -> Callable[..., int] | None:
    """The C library's function ``name`` (glibc's ``malloc_trim``, ``mallopt``), or None where it has none (musl,
    macOS, Windows)."""
    try:
        return getattr(ctypes.CDLL(None), name, None)
    except OSError:
        return None


#: ``mallopt``'s parameter number for the mmap threshold (glibc's ``M_MMAP_THRESHOLD``).
_M_MMAP_THRESHOLD = -3
#: The largest threshold glibc takes on 64-bit Linux (half its heap size, ``HEAP_MAX_SIZE / 2``).
MMAP_THRESHOLD_MAX = 32 << 20
#: What ``lit-grpo`` fixes the threshold at (its ``--malloc_mmap_threshold``; figures in docs/training.md).
DEFAULT_MMAP_THRESHOLD = 4 << 20


def fix_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for the rest of the process: a heap request of that size or more
    gets a mapping of its own, which goes back to the kernel when it is freed. True where it was set; False where
    the C library is not glibc or the environment's ``MALLOC_MMAP_THRESHOLD_`` already fixed it (that choice wins).

    Why: by default glibc raises the threshold each time a mapped block is freed (up to 32 MiB), after which an
    update's freed activations stay in the heap, and a later micro-batch does not always fit the holes they leave:
    a CPU step's resident memory then grows with its number of micro-batches, so with G. A fixed threshold keeps
    the large blocks mapped and returns them at once; a few MiB keeps the many small blocks in the heap, where
    reuse costs no page faults.
    """
    if not 1 <= nbytes <= MMAP_THRESHOLD_MAX:
        raise ValueError(f"malloc_mmap_threshold={nbytes} must be between 1 and {MMAP_THRESHOLD_MAX} bytes "
                         "(glibc's largest), or null for glibc's own threshold")
    mallopt = _libc_function("mallopt")
    if mallopt is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, nbytes))


def release_freed_host_memory() -> bool:
    """Give the pages of freed heap memory back to the kernel (glibc ``malloc_trim(0)``); True where it could.

    glibc keeps freed blocks for reuse, and a freed block below a live one (a gradient allocated mid-backward)
    stays resident: after an update on CPU, the freed activations of its micro-batches still count in the
    process's memory while the optimizer allocates its state on top. Live tensors are not touched; a freed page
    that is needed again costs one page fault.
    """
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def hwm_reset_problem() -> str | None:
    """Why the kernel's high-water mark cannot serve as a per-phase peak here, or None when it can. The probe
    resets the process's mark itself (it is asked only for ``cpu_method="hwm"``, which resets it anyway).

    Writing clear_refs can succeed and still not reset VmHWM (old kernels, gVisor-like sandboxes), so this
    proves the reset: raise the mark with a touched anonymous mapping (``mmap`` so the pages surely go back to
    the kernel on close, unlike a malloc heap), drop it, reset, and check the mark fell back.
    """
    try:
        KernelHighWaterMark().reset()
        with mmap.mmap(-1, _PROBE_BYTES) as block:
            for offset in range(0, _PROBE_BYTES, mmap.PAGESIZE):
                block[offset] = 1
        raised = read_status_bytes("VmHWM")
        KernelHighWaterMark().reset()
        after = read_status_bytes("VmHWM")
    except OSError as error:
        return f"cannot reset the kernel's RSS high-water mark ({error})"
    if raised - after < _PROBE_BYTES // 2:
        return f"writing {_RESET_HWM!r} to {_CLEAR_REFS} does not reset VmHWM on this kernel"
    return None


def rss_reader() -> Callable[[], int] | None:
    """A function returning the current RSS: /proc/self/statm, else psutil, else None."""
    try:
        read_statm_rss()
        return read_statm_rss
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    process = psutil.Process()
    return lambda: process.memory_info().rss


def make_peak_tracker(
    device: torch.device, cpu_method: CpuMethod, sample_interval_s: float
) -> tuple[PeakTracker | None, str | None]:
    """The tracker for this device and platform (the module docstring), and a message for the user when it is
    less than exact."""
    if device.type == "cuda":
        return CudaPeak(device), None
    note = None
    if device.type != "cpu":
        note = (f"'{device.type}' has no resettable peak-memory counter, so device memory is not measured; "
                "memory/* are the host process's resident (RSS) peaks.")
    if cpu_method == "hwm":
        problem = hwm_reset_problem()
        if problem is None:
            return KernelHighWaterMark(), note
        return None, _join(note, f"{problem}; memory/* are not logged (use cpu_method='auto' to sample RSS).")
    read_rss = rss_reader()
    if read_rss is None:
        return None, _join(note, "cannot read the process RSS (no /proc/self/statm and psutil is not installed); "
                                 "memory/* are not logged.")
    if cpu_method == "auto":
        try:
            return SampledHighWaterMark(read_rss, sample_interval_s), note
        except OSError as error:
            note = _join(note, f"cannot read the kernel's RSS high-water mark ({error}); sampling RSS every "
                               f"{sample_interval_s * 1000:g} ms instead, so peaks shorter than that can be missed.")
    return SampledRss(read_rss, sample_interval_s), note


def _join(first: str | None, second: str) -> str:
    return f"{first} {second}" if first else second
