"""Peak memory of each training step, split into the rollout (data fetch) and the update (training_step) phase."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lit_grpo.runtime.memory import CPU_METHODS, CpuMethod, PeakTracker, make_peak_tracker
from lit_grpo.runtime.validation import check_choice, check_real

from ._rollout import accumulating, log_metrics, rollout_stats, whole_step

#: The phases of a training step, as they appear in the logged keys.
PHASES = ("rollout", "update", "optimizer", "step")
#: Every key this callback may log, in the order ranks gather them.
MEMORY_KEYS = tuple(f"memory/{phase}_{suffix}" for phase in PHASES
                    for suffix in ("peak_bytes", "peak_reserved_bytes", "peak_delta_bytes"))


class PeakMemoryMonitor(Callback):
    r"""Logs the peak memory of every training step, and of its rollout and update phases for lit_grpo.

    **Logged keys** (bytes, once per training step, honouring ``log_every_n_steps``; under gradient accumulation once
    per optimizer step, after its last micro-batch, each phase's peak the largest over the step's micro-batches)

    - ``memory/step_peak_bytes``: peak of the whole step, from the end of the previous step (or the epoch start)
      to the end of this one: data fetch, forward, backward and optimizer step (under gradient accumulation, of
      all its micro-batches; logged once, after the last). Any LightningModule.
    - ``memory/rollout_peak_bytes``: peak while the batch was fetched, i.e. while the rollout was generated
      (previous ``on_train_batch_end`` -> ``on_train_batch_start``). lit_grpo batches only.
    - ``memory/update_peak_bytes``: peak during the update (``on_train_batch_start`` -> ``on_train_batch_end``).
      lit_grpo batches only.
    - ``memory/optimizer_peak_bytes``: peak during the optimizer step, the last part of the update
      (``on_before_optimizer_step`` -> ``on_train_batch_end``), so the forward and backward passes and the optimizer
      state each show their own peak. lit_grpo batches whose update stepped the optimizer only.
    - ``memory/{rollout,update,optimizer,step}_peak_delta_bytes``: the same peaks minus what was held when the phase
      started: what the phase itself added. On CPU the absolute peaks are resident-set sizes, which carry over
      what the previous phase left in the allocator (a rollout with a small KV cache reads the whole footprint
      the update left); the delta is the figure to compare across phases and settings. It can be 0 when a phase
      only reused memory the process already held. The step's on any LightningModule, each phase's where its
      peak above is logged.
    - on CUDA also ``memory/{step,rollout,update,optimizer}_peak_reserved_bytes``: the same peaks of the allocator's
      reserved memory (allocated plus cached blocks); the keys above are then allocated bytes.

    "lit_grpo batches" are those whose ``stats`` is a RolloutStats (``RolloutEngine.generate``'s ``result.stats``),
    which a project of its own gets by generating in its data pipeline: the fetch is then the rollout.

    **What is measured**

    - CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of the root device, reset at every phase
      boundary with ``torch.cuda.reset_peak_memory_stats`` (other readers of those peak counters see them reset).
    - CPU: the process's resident set size (RSS) peak, without changing what any other reader sees (the default,
      ``cpu_method="auto"``). On Linux the kernel's RSS high-water mark (``VmHWM`` in ``/proc/self/status``, the
      figure ``getrusage().ru_maxrss`` and ``/usr/bin/time -v`` report) is read and never reset: a phase that
      raised it above all the process held before gets it as its peak, exact however short the peak was; a phase
      that stayed below an earlier peak gets the maximum of a background thread sampling RSS every
      ``sample_interval_s`` (peaks shorter than that can be missed). ``cpu_method="hwm"`` instead resets the
      kernel's mark at each boundary (writing ``5`` to ``/proc/self/clear_refs``), exact in every phase, with a
      process-wide side effect: afterwards VmHWM, ``ru_maxrss`` and ``/usr/bin/time -v`` read only what the
      process held since the last boundary, less than it held over the run; compare such a run's peak from
      outside the process with the callback's ``memory/step_peak_bytes``, not with those readers. Memory of
      DataLoader worker processes is not included.
    - Other accelerators (MPS, XLA, ...) have no resettable peak counter; the host RSS peak is logged instead.

    The KV cache's own peak, ``rollout/peak_kv_bytes``, is the engine's count and RolloutProfiler's key alone
    (one writer per key); this callback measures the process (or the CUDA allocator) around it.

    **Several processes**: every key is the whole step's, the same on every rank: the largest process's peak (and
    the largest of what a phase added), gathered once a step (rule ``memory/*`` in
    ``lit_grpo.rollout.metrics.RANK_REDUCTION_FAMILIES``); ``max_logged`` holds those values. A rank that cannot
    measure still joins the gather and is left out of it.

    When a figure cannot be measured it is not logged (never as 0) and a warning says which and why.
    Validation runs are excluded: the rollout window restarts when validation ends.

    Args:
        cpu_method: ``"auto"`` (the kernel's high-water mark, read without a reset, with the sampling thread for
            phases below an earlier peak; the sampling thread alone where there is no such mark), ``"sampling"``
            (always the sampling thread) or ``"hwm"`` (the kernel's mark reset at each boundary: exact, and
            process-wide, see above).
        sample_interval_s: polling interval of the sampling thread.
    """

    def __init__(self, cpu_method: CpuMethod = "auto", sample_interval_s: float = 0.005) -> None:
        check_choice("cpu_method", cpu_method, CPU_METHODS)
        self.cpu_method = cpu_method
        self.sample_interval_s = check_real("sample_interval_s", sample_interval_s, low=0, high=60, low_open=True)
        self._tracker: PeakTracker | None = None
        self._method: str | None = None
        self._rollout_peaks: dict[str, int] = {}
        self._accumulated: dict[str, int] = {}  # the peaks of a step's earlier micro-batches (gradient accumulation)
        self._before_optimizer: dict[str, int] | None = None  # the update's peaks up to its optimizer step
        self._started: dict[str, int] = {}  # bytes held when each phase started
        self._held: dict[str, int] = {}  # the open window's peaks before a pause (``paused``), kept past its reset
        #: The largest value of every logged key over the fit so far (what a summary reports).
        self.max_logged: dict[str, int] = {}
        self._warned_prefetch = False

    @property
    def method(self) -> str | None:
        """How memory is measured in the (last) fit: ``"cuda"``, ``"hwm+sampling"`` (``cpu_method="auto"`` on
        Linux), ``"sampling"`` or ``"hwm"``; None if it cannot be."""
        return self._method

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._tracker is not None:
            return
        self.max_logged = {}  # this fit's, not an earlier fit's of the same callback object
        self._tracker, problem = make_peak_tracker(trainer.strategy.root_device, self.cpu_method,
                                                   self.sample_interval_s)
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
        self._start("rollout", "step")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation runs between one step's end and the next fetch; keep it out of the next rollout peak.
        self._start("rollout", "step")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._tracker is None:
            return
        self._rollout_peaks = self._read()
        self._before_optimizer = None
        self._start("update")
        if rollout_stats(batch) is not None:
            self._check_fetch_order(trainer)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._tracker is None:
            return
        # The optimizer phase restarts the tracker; the update's peak so far is kept for the whole update's.
        self._before_optimizer = _larger(self._before_optimizer or {}, self._read())
        self._start("optimizer")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if accumulating(trainer, batch_idx):  # the step goes on to the micro-batch whose optimizer step ends it
            if self._tracker is not None:
                self._accumulated = _larger(self._accumulated, self._batch_peaks(batch))
                self._start("rollout")  # the next micro-batch is fetched after this hook: its rollout window
            return
        metrics = self._step_peaks(batch) if self._tracker is not None else {}
        # every step, measured or not: under several processes every rank joins the one gather of the peaks
        metrics = whole_step(trainer, metrics, MEMORY_KEYS)
        for key, value in metrics.items():
            self.max_logged[key] = max(self.max_logged.get(key, value), value)
        log_metrics(trainer, metrics, self)

    def _step_peaks(self, batch: Any) -> dict[str, int]:
        """This process's peaks of the step that just ended, by logged key (under gradient accumulation each the
        largest over its micro-batches); restarts the next step's phases."""
        metrics = _larger(self._accumulated, self._batch_peaks(batch))
        self._accumulated = {}
        self._start("rollout", "step")  # the next batch is fetched after this hook
        return metrics

    def _batch_peaks(self, batch: Any) -> dict[str, int]:
        """This process's peaks of the training batch that just ended, by logged key: its rollout, update and
        optimizer phases (lit_grpo batches), and the step's so far (its delta from the step's start)."""
        last = self._read()
        peaks = {"rollout": self._rollout_peaks, "update": _larger(self._before_optimizer or {}, last)}
        if self._before_optimizer is not None:
            peaks["optimizer"] = last
        peaks["step"] = _larger(self._rollout_peaks, peaks["update"])
        phases = [phase for phase in PHASES if phase in peaks] if rollout_stats(batch) is not None else ["step"]
        metrics: dict[str, int] = {}
        for phase in phases:
            for suffix, value in peaks[phase].items():
                metrics[f"memory/{phase}_{suffix}"] = value
            if phase in self._started and "peak_bytes" in peaks[phase]:
                metrics[f"memory/{phase}_peak_delta_bytes"] = max(0, peaks[phase]["peak_bytes"] - self._started[phase])
        return metrics

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Memory used inside is left out of every phase's peak (a measurement's own buffer, as RolloutProfiler's
        bandwidth probe): the open window's peaks so far are kept, and its tracker restarts after."""
        if self._tracker is None:
            yield
            return
        self._held = _larger(self._held, self._tracker.read())
        try:
            yield
        finally:
            self._tracker.reset()

    def _read(self) -> dict[str, int]:
        """The open window's peaks, what it held before a pause included."""
        return _larger(self._held, self._tracker.read())

    def _start(self, *phases: str) -> None:
        """Mark the start of ``phases``: reset the peak and remember what is held now."""
        if self._tracker is None:
            return
        self._held = {}
        self._tracker.reset()
        held = self._tracker.current()
        for phase in phases:
            self._started[phase] = held

    def _check_fetch_order(self, trainer: pl.Trainer) -> None:
        """Warn when Lightning fetches the next batch ahead of time, which moves rollouts across phases.

        For a dataloader without ``__len__`` Lightning's fetcher pre-fetches one batch, so the rollout fetched
        before step i is the one of step i+1: memory/rollout_peak_bytes is then a step late (and the rollout was
        generated with the policy of one update before). Private attributes, read defensively.
        """
        if self._warned_prefetch:
            return
        self._warned_prefetch = True
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)  # private: no public view of the prefetch
        if getattr(fetcher, "prefetch_batches", 0) > 0 and getattr(fetcher, "length", 0) is None:
            rank_zero_warn(
                "PeakMemoryMonitor: the train dataloader has no __len__, so Lightning pre-fetches one batch: the "
                "rollout measured before step i is the rollout of step i+1. Give the dataloader a __len__."
            )


@contextmanager
def memory_peaks_paused(trainer: pl.Trainer) -> Iterator[None]:
    """Every PeakMemoryMonitor of ``trainer`` leaves out what is used inside (``PeakMemoryMonitor.paused``)."""
    with ExitStack() as stack:
        for callback in trainer.callbacks:
            if isinstance(callback, PeakMemoryMonitor):
                stack.enter_context(callback.paused())
        yield


def _larger(first: dict[str, int], second: dict[str, int]) -> dict[str, int]:
    """Per key, the larger of two sets of peaks (every key of either: a phase read or not yet)."""
    return {key: max(first.get(key, 0), second.get(key, 0)) for key in first.keys() | second.keys()}
