"""Decode steps, tokens, time and predictor quality of every rollout, and the step's in the progress bar."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lit_grpo.rollout.metrics import ratio_weight, reduce_over_ranks
from lit_grpo.runtime.validation import check_bool
from lit_grpo.sampling.roofline import floor_ms, read_bandwidth
from lit_grpo.sampling.stats import RolloutStats, merge_stats
from lit_grpo.scheduling.base import DECISION_NAMES

from ._rollout import (CARRYING_ROLLOUTS, check_rollout_source, log_metrics, measured_kv_bytes, rank_rollouts,
                       rollout_stats, show_in_progress_bar, step_parts)
from .peak_memory import memory_peaks_paused

#: RolloutStats fields logged as ``rollout/<field>``.
ROLLOUT_FIELDS = (
    "decode_steps",
    "lower_bound_steps",
    "slot_utilization",
    "prefill_tokens",
    "generated_tokens",
    "tokens_per_s",
    "wall_s",
    "ms_per_step",
    "decode_ms_per_step",
    "prefill_ms_per_token",
    "capture_s",
    "peak_kv_bytes",
    "length_pred_kendall_tau",
    "length_pred_smape",
    "parked_samples",
    "parked_kv_bytes",
    "preempting",
)

#: The decode step against its floor (``lit_grpo.sampling.roofline``).
ROOFLINE_KEYS = ("rollout/floor_ms_per_step", "rollout/roofline_ratio")

#: The scheduling decisions' counts, ``rollout/decisions/<action>_<reason>`` (lit_grpo.scheduling.base.DECISION_NAMES):
#: every name is gathered over ranks, those no rank counted in the step are not logged.
DECISION_KEYS = tuple(f"rollout/decisions/{name}" for name in DECISION_NAMES)

#: Progress-bar names: short, since the bar is one line shared with the loss.
PROGRESS_BAR_NAMES = {"decode_steps": "steps", "lower_bound_steps": "bound", "slot_utilization": "util"}


class RolloutProfiler(Callback):
    r"""Logs what each training step's rollouts cost, from the RolloutStats a lit_grpo batch carries.

    **Logged keys** (once per training step, honouring ``log_every_n_steps``; under gradient accumulation once per
    optimizer step, after its last micro-batch, of the step's rollouts merged by
    ``lit_grpo.sampling.stats.merge_stats``: counts and times add, peaks are the largest, ratios are recomputed,
    ``preempting`` and the predictor's figures are means over the micro-batches that have them, as over ranks)

    - ``rollout/decode_steps``: forward passes of the decode loop.
    - ``rollout/lower_bound_steps``: ``max(ceil(sum L / slots), max L)``, the fewest steps any schedule needs.
    - ``rollout/slot_utilization``: ``generated_tokens / (decode_steps * slots)``.
    - ``rollout/prefill_tokens``, ``rollout/generated_tokens``: tokens run through prefill / produced.
    - ``rollout/tokens_per_s``, ``rollout/wall_s``: generation throughput and time.
    - ``rollout/ms_per_step``: milliseconds per decode step, the graph capture left out (on a GPU, a step well
      above the time to read the weights once means launch-bound steps).
    - ``rollout/decode_ms_per_step``: a decode step's own milliseconds (forward, draw, the copy to the host); what
      ``ms_per_step`` holds beyond it is the rollout's prefill and the scheduler's bookkeeping, spread over its steps.
    - ``rollout/prefill_ms_per_token``: prefill milliseconds per prompt token.
    - ``rollout/floor_ms_per_step``: the decode step's floor, the bytes it had to read (the rollout weights once,
      each running row's attended keys and values; ``RolloutStats.decode_read_bytes``, the mean over the steps)
      over this device's read bandwidth, measured once per process (``lit_grpo.sampling.roofline``).
    - ``rollout/roofline_ratio``: ``ms_per_step / floor_ms_per_step``, how far the rollout's steps are from what
      reading their bytes costs (1.0 would be the floor). Both skipped where the engine counted no bytes.
    - ``rollout/capture_s``: seconds spent capturing the decode step's CUDA graph (0 when the engine reused the
      last one, or runs eagerly): the price of freeing the slot cache between rollouts (``keep_kv_cache``).
    - ``rollout/peak_kv_bytes``: the most bytes the KV cache held at once (skipped if the engine did not count it).
    - ``rollout/length_pred_kendall_tau``, ``rollout/length_pred_smape``: the length predictor's quality
      (the length-aware method only, ``sampling.scheduler.length_aware``; skipped when the rollout has none).
    - ``rollout/parked_samples``, ``rollout/parked_kv_bytes``: samples the scheduler parked (at a preemption point,
      or after their length probe), and the most bytes their KV held at once.
    - ``rollout/preempting``: 1 when the default "infinite" scheduler preempted by least attained service in the
      step's rollout, 0 when it ran first come, first served (over several rounds of dynamic sampling, the share
      that preempted; skipped for the other strategies).
    - ``rollout/decisions/<action>_<reason>``: how many samples the scheduler started, resumed or parked for each
      reason (``lit_grpo.scheduling.base.DECISION_NAMES``), e.g. ``start_arrival``, ``start_least_attained``,
      ``park_preemption``, ``resume_least_attained``; only the names counted at least once in the step (the slot
      timeline draws the same decisions).

    **Progress bar** (not sent to the loggers): ``steps``, ``bound`` and ``util``, the step's decode steps,
    lower bound and slot utilization (all its rollouts); ``steps`` close to ``bound`` means the schedule left little
    on the table.

    **Several processes**, where the trainer's datamodule declares that its training batches are rollouts (its
    ``yields_rollouts`` is True, as ``RolloutDataModule``'s): every key is the whole step's, the same on every rank:
    every rank's RolloutStats are gathered once a step, every rank joining, and each key reduced by its rule in
    ``lit_grpo.rollout.metrics.ROLLOUT_REDUCTIONS``: the step waits for its slowest rank, so ``decode_steps``,
    ``lower_bound_steps``, ``wall_s``, ``ms_per_step``, ``decode_ms_per_step``, ``prefill_ms_per_token`` and
    ``capture_s`` are the largest rank's, and so is ``floor_ms_per_step``, with ``roofline_ratio`` the step's
    ``ms_per_step`` over it; ``prefill_tokens``, ``generated_tokens`` and ``parked_samples`` add up,
    as do the decision counts; ``tokens_per_s`` is all ranks' tokens over the slowest rank's ``wall_s`` (the ranks
    generate at once); ``peak_kv_bytes`` and ``parked_kv_bytes`` are the largest process's; ``slot_utilization``
    is every rank's tokens over every rank's slot-steps; ``preempting`` and the predictor's figures are means over
    ranks (a rank without a predictor left out).
    ``rollout/rank_skew`` is GRPOModule's. The progress bar shows the same whole-step values. Where the source
    does not declare it, no gather (another project pays no collective a step), and a rollout batch raises an error
    at that batch (``lit_grpo.callbacks._rollout.check_rollout_source``): its figures would be rank 0's alone.

    A batch is a lit_grpo rollout where its ``stats`` is a RolloutStats: ``RolloutEngine.generate``'s
    ``result.stats``, which a project of its own puts on the batches its data pipeline yields (a rollout generated
    inside ``training_step`` reaches no callback); nothing else of the batch is read. With batches that are not
    (any other LightningModule) it does nothing (no bandwidth probe) and says so once, on rank 0.

    Args:
        progress_bar: show the step's decode steps, lower bound and utilization in the progress bar.
        read_bytes_per_s: the device's read bandwidth for the floor (None: measured once per process, briefly,
            at the first step with a rollout, its buffer left out of PeakMemoryMonitor's peaks; never without
            rollouts).
    """

    def __init__(self, progress_bar: bool = True, read_bytes_per_s: float | None = None) -> None:
        check_bool("progress_bar", progress_bar)
        if read_bytes_per_s is not None:
            floor_ms(0, read_bytes_per_s)  # a bad value is refused here, naming it
        self.progress_bar = progress_bar
        self.read_bytes_per_s = read_bytes_per_s
        self._warned_no_rollout = False
        self._step_stats: list[RolloutStats] = []  # the rollouts of the step's micro-batches so far

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_stats = []  # a fit that ended mid-step leaves none to the next

    def bandwidth(self, trainer: pl.Trainer) -> float:
        """The read bandwidth the floor is taken at (bytes/s): ``read_bytes_per_s``, else the device's, measured
        once per process, where first asked (the first step with a rollout), outside PeakMemoryMonitor's peaks:
        the probe's buffer (hundreds of MiB) is no step's."""
        if self.read_bytes_per_s is not None:
            return self.read_bytes_per_s
        # the process's record (lit_grpo.sampling.roofline) says whether a probe runs: only then are peaks paused
        return read_bandwidth(trainer.strategy.root_device, around_probe=lambda: memory_peaks_paused(trainer))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = rollout_stats(batch)
        check_rollout_source(trainer, stats, "RolloutProfiler")
        if stats is None:
            self._warn_no_rollout()
        parts = step_parts(self._step_stats, stats, trainer, batch_idx)
        if parts is None:  # the step goes on to the micro-batch whose optimizer step ends it
            return
        # every step, logged or not, with a rollout or not: under several processes from a declared source every
        # rank joins the one gather of the step's stats (merged: the batch's own where it is the step's only one)
        ranks, counts = rank_rollouts(trainer, merge_stats(parts) if parts else None)
        if not ranks:  # no rank's step had a rollout
            return
        bandwidth = self.bandwidth(trainer)
        per_rank = [{**profile(rank, bandwidth), **decision_values(count)} for rank, count in zip(ranks, counts)]
        values = reduce_over_ranks(per_rank, [*(f"rollout/{name}" for name in ROLLOUT_FIELDS), *ROOFLINE_KEYS,
                                              *DECISION_KEYS])
        values = {key: value for key, value in values.items() if value or key not in DECISION_KEYS}
        log_metrics(trainer, values, self)
        if self.progress_bar:
            bar = {short: values[f"rollout/{name}"] for name, short in PROGRESS_BAR_NAMES.items()}
            show_in_progress_bar(pl_module, bar)

    def _warn_no_rollout(self) -> None:
        if not self._warned_no_rollout:
            self._warned_no_rollout = True
            rank_zero_warn("RolloutProfiler: a training batch carries no RolloutStats (batch.stats): the batches "
                           "without a rollout are left out of the profile (a module that has none logs nothing; "
                           f"{CARRYING_ROLLOUTS}).")


def profile(stats: RolloutStats, read_bytes_per_s: float | None = None) -> dict[str, float]:
    """One rank's ``rollout/<field>`` values of a rollout (None where not measured: no predictor, KV not counted),
    its floor and ratio at ``read_bytes_per_s`` (bytes/s; None: not computed), and the weight of
    ``slot_utilization`` over ranks, its slot-steps."""
    values = {f"rollout/{name}": getattr(stats, name) for name in ROLLOUT_FIELDS}
    values.update(roofline(stats, read_bytes_per_s))
    values["rollout/peak_kv_bytes"] = measured_kv_bytes(stats)
    values[ratio_weight("rollout/slot_utilization")] = stats.slot_steps
    return values


def decision_values(counts: dict[str, int]) -> dict[str, float]:
    """One rank's ``rollout/decisions/<name>`` values: every known name, 0 where it did not occur (the step logs a
    name only where some rank counted it)."""
    return {f"rollout/decisions/{name}": float(counts.get(name, 0)) for name in DECISION_NAMES}


def roofline(stats: RolloutStats, read_bytes_per_s: float | None) -> dict[str, float]:
    """``rollout/floor_ms_per_step`` and ``rollout/roofline_ratio`` of a rollout at ``read_bytes_per_s``
    (bytes/s); empty where its steps' bytes were not counted or no bandwidth is given."""
    if not stats.decode_read_bytes or not stats.decode_steps or read_bytes_per_s is None:
        return {}
    floor = floor_ms(stats.read_bytes_per_step, read_bytes_per_s)
    return {"rollout/floor_ms_per_step": floor, "rollout/roofline_ratio": stats.ms_per_step / floor}
