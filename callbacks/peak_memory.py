"""Peak memory of each training step, split into the rollout (data fetch) and the update (training_step) phase."""

from __future__ import annotations

import mmap
import os
import re
import threading
from collections.abc import Callable
from typing import Any, Literal, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from ._rollout import log_metrics, measured_kv_bytes, rollout_stats

CpuMethod = Literal["auto", "hwm", "sampling"]

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"
_STATM = "/proc/self/statm"
# "5" resets the kernel's resident-set high-water mark (VmHWM) of the process to its current RSS (Linux >= 4.0).
_RESET_HWM = "5"
_PROBE_BYTES = 32 << 20


class PeakMemoryMonitor(Callback):
    r"""Logs the peak memory of every training step, and of its rollout and update phases for lit_grpo.

    **Logged keys** (bytes, once per training batch, honouring ``log_every_n_steps``)

    - ``memory/step_peak_bytes``: peak of the whole step, from the end of the previous step (or the epoch start)
      to the end of this one: data fetch, forward, backward and optimizer step. Any LightningModule.
    - ``memory/rollout_peak_bytes``: peak while the batch was fetched, i.e. while the rollout was generated
      (previous ``on_train_batch_end`` -> ``on_train_batch_start``). lit_grpo batches only.
    - ``memory/update_peak_bytes``: peak during the update (``on_train_batch_start`` -> ``on_train_batch_end``).
      lit_grpo batches only.
    - ``rollout/peak_kv_bytes``: the engine's own KV-cache peak, from the batch's RolloutStats. lit_grpo only.
    - on CUDA also ``memory/{step,rollout,update}_peak_reserved_bytes``: the same peaks of the allocator's
      reserved memory (allocated plus cached blocks); the keys above are then allocated bytes.

    **What is measured**

    - CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of the root device, reset at every phase
      boundary with ``torch.cuda.reset_peak_memory_stats`` (other readers of those peak counters see them reset).
    - CPU: the process's resident set size (RSS) high-water mark. On Linux the kernel's own mark (``VmHWM`` in
      ``/proc/self/status``) is reset at each boundary by writing ``5`` to ``/proc/self/clear_refs``, so a peak
      anywhere inside the phase is caught exactly (the reset is process-wide: other readers of VmHWM or
      ``getrusage().ru_maxrss`` in this process see it too). Where that write is refused or does not reset the mark, a
      background thread samples RSS every ``sample_interval_s`` instead (peaks shorter than that can be missed).
      Memory of DataLoader worker processes is not included.
    - Other accelerators (MPS, XLA, ...) have no resettable peak counter; the host RSS peak is logged instead.

    When a figure cannot be measured it is not logged (never as 0) and a warning says which and why.
    Validation runs are excluded: the rollout window restarts when validation ends.

    Args:
        cpu_method: ``"auto"`` (kernel high-water mark when it resets, else sampling), ``"hwm"`` (kernel mark
            only) or ``"sampling"`` (always the sampling thread).
        sample_interval_s: polling interval of the sampling thread.
    """

    def __init__(self, cpu_method: CpuMethod = "auto", sample_interval_s: float = 0.005) -> None:
        if cpu_method not in ("auto", "hwm", "sampling"):
            raise ValueError(f"cpu_method must be 'auto', 'hwm' or 'sampling', got {cpu_method!r}")
        if sample_interval_s <= 0:
            raise ValueError(f"sample_interval_s must be > 0, got {sample_interval_s}")
        self.cpu_method = cpu_method
        self.sample_interval_s = sample_interval_s
        self._tracker: _PeakTracker | None = None
        self._method: str | None = None
        self._rollout_peaks: dict[str, int] = {}
        self._warned_kv = False
        self._warned_prefetch = False

    @property
    def method(self) -> str | None:
        """How memory is measured in the (last) fit: ``"cuda"``, ``"hwm"`` or ``"sampling"``; None if it cannot be."""
        return self._method

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._tracker is not None:
            return
        self._tracker, problem = _make_tracker(trainer.strategy.root_device, self.cpu_method, self.sample_interval_s)
        self._method = self._tracker.name if self._tracker is not None else None
        if problem:
            rank_zero_warn(f"PeakMemoryMonitor: {problem}")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()  # a failed fit may skip teardown; do not leave the sampling thread polling

    def _close(self) -> None:
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The first batch of the epoch is fetched after this hook: its rollout window starts here.
        self._reset()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation runs between one step's end and the next fetch; keep it out of the next rollout peak.
        self._reset()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._tracker is None:
            return
        self._rollout_peaks = self._tracker.read()
        self._tracker.reset()
        if rollout_stats(batch) is not None:
            self._check_fetch_order(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = rollout_stats(batch)
        metrics: dict[str, float] = {}
        if self._tracker is not None:
            update_peaks = self._tracker.read()
            self._tracker.reset()
            for suffix, update_bytes in update_peaks.items():
                rollout_bytes = self._rollout_peaks.get(suffix, 0)
                metrics[f"memory/step_{suffix}"] = max(rollout_bytes, update_bytes)
                if stats is not None:
                    metrics[f"memory/rollout_{suffix}"] = rollout_bytes
                    metrics[f"memory/update_{suffix}"] = update_bytes
        if stats is not None:
            kv_bytes = measured_kv_bytes(stats)
            if kv_bytes is not None:
                metrics["rollout/peak_kv_bytes"] = kv_bytes
            elif not self._warned_kv:
                self._warned_kv = True
                rank_zero_warn("PeakMemoryMonitor: the rollout engine reported no KV bytes; rollout/peak_kv_bytes "
                               "is not logged.")
        log_metrics(trainer, metrics)

    def _reset(self) -> None:
        if self._tracker is not None:
            self._tracker.reset()

    def _check_fetch_order(self, trainer: pl.Trainer) -> None:
        """Warn when Lightning fetches the next batch ahead of time, which moves rollouts across phases.

        For a dataloader without ``__len__`` Lightning's fetcher pre-fetches one batch, so the rollout fetched
        before step i is the one of step i+1: memory/rollout_peak_bytes is then a step late (and the rollout was
        generated with the policy of one update before). Private attributes, read defensively.
        """
        if self._warned_prefetch:
            return
        self._warned_prefetch = True
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if getattr(fetcher, "prefetch_batches", 0) > 0 and getattr(fetcher, "length", 0) is None:
            rank_zero_warn(
                "PeakMemoryMonitor: the train dataloader has no __len__, so Lightning pre-fetches one batch: the "
                "rollout measured before step i is the rollout of step i+1. Give the dataloader a __len__."
            )


class _PeakTracker(Protocol):
    """A resettable peak: ``read()`` gives ``{key suffix: peak bytes since the last reset()}``."""

    name: str

    def reset(self) -> None: ...

    def read(self) -> dict[str, int]: ...

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

    def close(self) -> None:
        pass


class KernelHighWaterMark:
    """The kernel's RSS high-water mark of this process (Linux VmHWM), reset through /proc/self/clear_refs."""

    name = "hwm"

    def reset(self) -> None:
        with open(_CLEAR_REFS, "w") as f:
            f.write(_RESET_HWM)

    def read(self) -> dict[str, int]:
        return {"peak_bytes": read_status_bytes("VmHWM")}

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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="PeakMemoryMonitor-rss", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._observe(self._read_rss())

    def _observe(self, rss: int) -> None:
        with self._lock:
            self._peak = max(self._peak, rss)

    def reset(self) -> None:
        rss = self._read_rss()
        with self._lock:
            self._peak = rss

    def read(self) -> dict[str, int]:
        # Include the value right now: a phase shorter than one interval still gets a reading.
        self._observe(self._read_rss())
        with self._lock:
            return {"peak_bytes": self._peak}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def read_status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (e.g. VmHWM, VmRSS) in bytes."""
    with open(_STATUS) as f:
        match = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    if match is None:
        raise OSError(f"{field} not found in {_STATUS}")
    return int(match.group(1)) * 1024


def read_statm_rss() -> int:
    """Current RSS from /proc/self/statm (resident pages x page size): cheap enough to poll every few ms."""
    with open(_STATM) as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm_reset_problem() -> str | None:
    """Why the kernel's high-water mark cannot serve as a per-phase peak here, or None when it can.

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


def _make_tracker(
    device: torch.device, cpu_method: CpuMethod, sample_interval_s: float
) -> tuple[_PeakTracker | None, str | None]:
    """The tracker for this device and platform, and a message for the user when it is less than exact."""
    if device.type == "cuda":
        return CudaPeak(device), None
    note = None
    if device.type != "cpu":
        note = (f"'{device.type}' has no resettable peak-memory counter, so device memory is not measured; "
                "memory/* are the host process's resident (RSS) peaks.")
    problem = hwm_reset_problem() if cpu_method in ("auto", "hwm") else None
    if cpu_method in ("auto", "hwm") and problem is None:
        return KernelHighWaterMark(), note
    if cpu_method == "hwm":
        return None, _join(note, f"{problem}; memory/* are not logged (use cpu_method='auto' to sample RSS).")
    read_rss = rss_reader()
    if read_rss is None:
        return None, _join(note, "cannot read the process RSS (no /proc/self/statm and psutil is not installed); "
                                 "memory/* are not logged.")
    if problem is not None:
        note = _join(note, f"{problem}; sampling RSS every {sample_interval_s * 1000:g} ms instead, so peaks "
                           "shorter than that can be missed.")
    return SampledRss(read_rss, sample_interval_s), note


def _join(first: str | None, second: str) -> str:
    return f"{first} {second}" if first else second
