"""A validation pass before the first step, and a few lines at the end of ``fit`` saying what the run achieved."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lit_grpo.runtime.distributed import strategy_all_gather
from lit_grpo.runtime.memory import host_peak_bytes
from lit_grpo.runtime.sizes import disk_bytes, format_bytes
from lit_grpo.runtime.threads import ThreadTimes, busiest_threads, core_wait_advice, thread_times
from lit_grpo.runtime.validation import (
    CoreLimit,
    check_bool,
    check_int,
    check_real,
    check_state_keys,
    check_text,
    core_limit,
    integer_within,
    shown_setting,
)
from lit_grpo.sampling.stats import RolloutStats, merge_stats

from ._paths import shown_path
from ._rollout import accumulating, check_rollout_source, logger_step, rank_rollouts, rollout_stats
from .peak_memory import PeakMemoryMonitor
from .rollout_profiler import RolloutProfiler, roofline
from .run_checkpoint import RunCheckpoint, fit_resume, last_checkpoint_callback


#: The PeakMemoryMonitor keys the summary reports (their largest value over the run).
ROLLOUT_MEMORY_KEYS = ("memory/rollout_peak_bytes", "memory/rollout_peak_delta_bytes")
#: The share of a step's groups whose completions all got one reward (GRPOModule's, reduced over ranks): at 1.0
#: every advantage of the step is 0 and the reward gives no gradient.
NO_SPREAD_KEY = "reward/frac_zero_std"


class FitSummary(Callback):
    r"""Validates once before training starts and prints a summary when ``fit`` ends.

    **Before the first step** (a fresh run with validation, not a resume): one validation pass, logged at step 0
    like any other (``val/accuracy`` and ``val/reward`` for GRPOModule), so TensorBoard shows the policy before
    and after on one curve. Lightning's sanity check runs validation too, but logs nothing.

    **At the end of fit** (rank 0), for example::

        lit_grpo: 30 steps in 12 min 41 s (24.1 s per step, plus 40 s of validation)
          val/accuracy   0.250 -> 0.656   (before training -> after step 30)
          reward/mean    0.297 -> 0.734   (mean of the first 5 steps -> the last 5)
          rollout time   1.90 s a step (26% of it): 34.5 ms a decode step alone, 0.94 ms a prompt token's prefill
          decode floor   1.20 ms a step (its bytes at 2.0 TB/s): 36.1 ms a step is 30.1 x it; 3420 tokens/s
          rollout peak   KV cache 30.1 MiB; process 3.2 GiB (+41.0 MiB during the rollout)
          host peak      3.4 GiB resident (the process's high-water mark)
          logs           lightning_logs/version_0  ->  tensorboard --logdir lightning_logs
          checkpoint     lightning_logs/version_0/checkpoints/last.ckpt (1.6 GiB, 3 saves in 9.0 s; resume with
                         --ckpt_path last)

    Where at least half of the steps had no group whose completions got different rewards (``reward/frac_zero_std``
    1.0 at every batch of the step: every advantage 0, so the reward taught the step nothing; e.g. too hard a task, too
    short a ``max_new_tokens``, or a reward function that scores every completion alike), a ``no signal`` line after
    the reward's says how many, out of the steps that logged the key (all of them, or their count and share), and
    what to check::

          no signal      all 30 steps: no group's completions got different rewards (reward/frac_zero_std 1.0), so
                         every advantage was 0 and the reward taught nothing; check the reward functions against the
                         completions (too hard a task? too short a max_new_tokens?)

    On a CPU device, where torch's threads on rank 0 (as many of its threads as torch runs, those that ran most)
    spent at least ``CORE_WAIT_SHARE`` of their time since this fit's training started waiting for a core (a resume
    starts the count again) and torch runs several (``lit_grpo.runtime.threads``), a ``threads`` line after the first
    says so and what to do: one thread where other processes keep the cores busy, a thread a core where torch runs
    more threads than the cores the process may use (its affinity's, or its cgroup CPU quota's, named so; under
    several ranks on the node, its share of them, as the CLI's default thread count divides them, named so too); the
    first step that reaches the share says so at once, as a warning (once a fit)::

          threads        torch's threads waited for a core 64% of their time with 2 torch threads: other processes
                         keep the cores busy and every parallel op waits for its slowest thread; try
                         --torch_num_threads 1 (or OMP_NUM_THREADS=1)

    The checkpoint line's way back is ``lit-grpo``'s ``--ckpt_path last``, in a script of its own ``trainer.fit(...,
    ckpt_path=PATH)``. Another logger that writes to a folder (a CSVLogger) has a ``logs`` line of its own, its folder
    and its class. A line whose figure was never logged is left out. A step is a training step (a batch that ends an
    optimizer step; a GRPO batch with all its optimizer steps; the first line adds their count, ``trainer.global_step``,
    where it differs), and its time counts the training steps only (the validations in between are named apart); a
    step's rollout time is that of every batch's rollout in it (under gradient accumulation, all its micro-batches'),
    its share is of that time, and a decode step's and a prompt token's milliseconds are the whole run's
    (``RolloutStats.decode_ms_per_step`` and ``prefill_ms_per_token`` of the run's totals): the rest of a rollout is
    the scheduler's bookkeeping. The decode floor is the bytes a decode step
    read (the run's mean) at the device's read bandwidth (``RolloutProfiler``'s ``read_bytes_per_s``, else measured once
    per process; ``lit_grpo.sampling.roofline``), then ``rollout/ms_per_step`` over it (the run's, as
    ``rollout/roofline_ratio``) and the run's generated tokens per rollout second. Under several processes the figures
    are the whole run's: reward/mean, reward/frac_zero_std and val/accuracy as logged (GRPOModule reduces them over
    ranks; a module that logs a rank's own value, without ``sync_dist``, shows rank 0's, as its logger does), a step's
    rollout time its slowest rank's (which every rank waited for), the decode step's and prompt token's milliseconds
    over every rank's rollouts, the KV, process (on CUDA: device) and host peaks the largest rank's (the host peak
    gathered when training ends). The rollouts are gathered at every training batch, every rank joining, where the
    trainer's datamodule declares that its training batches are rollouts (its ``yields_rollouts`` is True, as
    ``RolloutDataModule``'s); where it does not, no gather a batch (another project pays none), and a rollout batch
    raises an error at that batch (``lit_grpo.callbacks._rollout.check_rollout_source``): its figures would be rank
    0's alone.

    **Through a resume** (``--ckpt_path``) the summary is the whole run's: its totals (steps, training and validation
    time, rollouts, the accuracy and reward curves, the steps without a reward spread, PeakMemoryMonitor's largest
    rollout peaks) are kept in the checkpoint (``state_dict``; checked whole before any is taken, a corrupt state
    refused naming the bad key or value) and go on from there, each fit's time counted (not the time between fits);
    a ``resumed`` line says at which step this fit started and how many steps it ran. The host peak and the
    checkpoint's save count are this fit's (an earlier process's were not kept); a resume from a checkpoint without
    this state says that the lines cover this fit's steps alone.

    TensorBoard draws a validation where Lightning logs it: before training at step 0, after step k at step k - 1
    (the x of step k's own scalars). Logs no keys of its own.

    Args:
        validate_before_training: run the validation pass before the first step.
        accuracy_key: the logged accuracy key summarised (before -> after).
        reward_key: the logged reward key summarised (before -> after).
        window: steps averaged at each end of the reward curve (one step's reward is noisy).
    """

    def __init__(self, validate_before_training: bool = True, accuracy_key: str = "val/accuracy",
                 reward_key: str = "reward/mean", window: int = 5) -> None:
        window = check_int("window", window, 1)
        check_bool("validate_before_training", validate_before_training)
        check_text("accuracy_key", accuracy_key)
        check_text("reward_key", reward_key)
        self.validate_before_training = validate_before_training
        self.accuracy_key, self.reward_key, self.window = accuracy_key, reward_key, window
        # keys said missing, once each; never the defaults, which a module other than GRPOModule may well not log
        self._said_missing = {"val/accuracy", "reward/mean"}
        self._start()

    def _start(self) -> None:
        """Nothing collected yet: at construction and when a fit starts (one instance may serve several; a resumed
        fit then loads its checkpoint's totals, ``load_state_dict``)."""
        self.steps = 0  # training steps: the batches that end an optimizer step, whatever their optimizer steps
        self.accuracy: list[tuple[int, float]] = []   # (step, value) after each validation
        self.rewards: list[float] = []
        self.spread_logged_steps = 0  # training steps whose every batch logged NO_SPREAD_KEY
        self.flat_steps = 0  # those of them in which no batch had a group with a reward spread
        self._step_flat: bool | None = None  # the step under way: None until a batch logged NO_SPREAD_KEY
        # The run's rollouts, every rank's, added up (merge_stats: times and counts add, the KV peak is the
        # largest); their timelines and decisions are left out, so the totals do not grow with the run.
        self.rollouts = 0  # training batches that carried a rollout (several a step under gradient accumulation)
        self.rollout_steps = 0  # training steps with a rollout
        self.rollout_totals = RolloutStats()
        self.rollout_s = 0.0  # the rollouts' seconds: each batch's slowest rank's, which every rank waited for
        # The step under way's rollouts (every rank's stats, the slowest rank's seconds), added to the totals when
        # the step ends: a checkpoint holds whole steps only, as the rest of the run's state does.
        self._step_rollouts: list[tuple[list[RolloutStats], float]] = []
        self._elapsed_before_s = 0.0  # the earlier fits' time since their training started (a resumed run)
        self._started_s: float | None = None  # when this fit's training steps started (after the first validation)
        self._validation_s = 0.0  # seconds of validation since the training steps started, earlier fits' included
        self._validation_started_s: float | None = None
        self._host_peak: int | None = None  # the ranks' largest resident high-water mark when training ended
        self._restored = False  # whether this fit goes on from a checkpoint's totals
        self.resumed_at: int | None = None  # the training steps done when this fit started; None: a fresh run
        self._fit_started_steps = 0  # self.steps when this fit's training started
        self._resuming = False  # a resumed fit without a checkpoint state whose first batch is still to come
        self._monitors: list[PeakMemoryMonitor] = []  # the fit's, whose largest logged peaks the summary reports
        self._earlier_memory_peaks: dict[str, dict[str, float]] = {}  # the checkpoint's (_memory_peaks)
        # rank 0's threads on a CPU device when this fit's training started (None: not read, or unreadable), and
        # what to do about their wait for cores since then, as of the last step ("" where nothing), and whether the
        # run was told so
        self._threads_at_start: ThreadTimes | None = None
        self._core_limit = CoreLimit(1)  # the cores the threads are judged by, read at train start
        self._local_processes = 1  # the processes on this node, which divide those cores
        self._threads_advice = ""
        self._told_core_wait = False

    # ------------------------------------------------------------------------------------------ collect
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._start()
            self._monitors = [cb for cb in trainer.callbacks if isinstance(cb, PeakMemoryMonitor)]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.validate_before_training and trainer.global_step == 0 and _has_validation(trainer):
            for checkpoint in trainer.checkpoint_callbacks:  # a stop during it stops the run as during training
                if isinstance(checkpoint, RunCheckpoint):
                    checkpoint.listen_for_stops()
            _validate_now(trainer)
        self._started_s = time.perf_counter()  # time per step: the training steps only
        self._fit_started_steps = self.steps
        if trainer.is_global_zero and trainer.strategy.root_device.type == "cpu":  # a GPU's step waits on no core
            self._threads_at_start = thread_times()
            self._core_limit = core_limit()
            self._local_processes = trainer.num_devices
        self._resuming = trainer.global_step > 0 and not self._restored  # its step is read at its first batch

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._resuming:  # a checkpoint without this state: the loop's count of training steps, which it
            # restores (global_step counts optimizer steps), is set right once the epoch loop has started
            self._resuming = False
            self.resumed_at = logger_step(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_started_s = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a trainer.validate of its own (after a fit, with the same callback) is no point of the fit's curve nor
        # part of its time
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if self._started_s is not None and self._validation_started_s is not None:
            self._validation_s += time.perf_counter() - self._validation_started_s
        value = self._logged(trainer, self.accuracy_key, "val/")
        if value is not None:
            # Training steps, as the summary counts them and TensorBoard draws them (after step k at k - 1), not
            # trainer.global_step: a GRPO step makes num_iterations x num_mini_batches optimizer steps.
            step = logger_step(trainer) + 1 if trainer.global_step else 0
            self.accuracy.append((step, float(value)))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        stats = rollout_stats(batch)
        check_rollout_source(trainer, stats, "FitSummary")
        # every batch's rollout, also one that only accumulates gradients (every rank's: one gather a batch under
        # several processes from a source that declares rollouts, which every rank joins)
        per_rank = [dataclasses.replace(rank, timeline=[], decisions=[]) for rank in rank_rollouts(trainer, stats)[0]]
        if per_rank:
            self._step_rollouts.append((per_rank, max(rank.wall_s for rank in per_rank)))
        spread = trainer.callback_metrics.get(NO_SPREAD_KEY)  # a module that logs none (not GRPOModule): no line
        if spread is not None:  # a step is flat where every one of its batches was
            flat = float(spread) >= 1.0 - 1e-6  # the ranks' weighted mean of 1.0s, in float32
            self._step_flat = flat if self._step_flat is None else self._step_flat and flat
        if accumulating(trainer, batch_idx):  # the step goes on to the batch whose optimizer step ends it
            return
        self.steps += 1
        if self._step_flat is not None:
            self.spread_logged_steps += 1
            self.flat_steps += self._step_flat
            self._step_flat = None
        if self._step_rollouts:
            self.rollouts += len(self._step_rollouts)
            self.rollout_steps += 1
            self.rollout_s += sum(seconds for _, seconds in self._step_rollouts)
            self.rollout_totals = merge_stats([self.rollout_totals, *(rank for per_rank, _ in self._step_rollouts
                                                                      for rank in per_rank)])
            self._step_rollouts = []
        value = self._logged(trainer, self.reward_key, "")
        if value is not None and math.isfinite(float(value)):
            self.rewards.append(float(value))
        self._read_threads(warn=True)

    def _read_threads(self, warn: bool) -> None:
        """The threads' time since training started; the first step at which they waited for busy cores
        (``core_wait_advice``) says so at once, as a warning, when ``warn``: the summary comes at the end only."""
        if self._threads_at_start is None:
            return
        now = thread_times()
        if now is None:
            return
        threads = torch.get_num_threads()
        self._threads_advice = core_wait_advice(*busiest_threads(now.since(self._threads_at_start), threads), threads,
                                                *self._core_limit, local_processes=self._local_processes)
        if warn and self._threads_advice and not self._told_core_wait:
            self._told_core_wait = True
            rank_zero_warn(f"FitSummary: {self._threads_advice}; the fit summary's 'threads' line gives the share "
                           "over the whole fit")

    def _logged(self, trainer: pl.Trainer, key: str, family: str) -> Any:
        """The value ``key`` was logged with; a key given and not logged where others of its ``family`` (prefix)
        were is said once (a misspelled ``accuracy_key`` would leave its line out of the summary without a word)."""
        metrics = trainer.callback_metrics
        if key not in metrics and key not in self._said_missing:
            others = sorted(name for name in metrics if name.startswith(family))
            if others:
                self._said_missing.add(key)
                rank_zero_warn(f"FitSummary: {key!r} was not logged, so the summary has no line for it; logged: "
                               f"{others[:12]}")
        return metrics.get(key)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._read_threads(warn=False)
        peak = host_peak_bytes()
        if trainer.world_size > 1:  # every rank is here at once, before the strategy's teardown
            peak = int(strategy_all_gather(trainer.strategy)(torch.tensor(peak)).max())
        self._host_peak = peak

    # ------------------------------------------------------------------------------------------ resume
    @property
    def state_key(self) -> str:
        """Unique per summarised keys, as ModelCheckpoint's: two summaries of different keys keep their own state."""
        return self._generate_state_key(accuracy_key=self.accuracy_key, reward_key=self.reward_key)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """A resume that summarises other keys finds no state under its own: the checkpoint's one FitSummary
        state gives the run's totals (its curves of other keys left out, ``load_state_dict``)."""
        saved = checkpoint.get("callbacks") or {}
        if self.state_key in saved:
            return
        summaries = [key for key in saved if str(key).startswith(f"{FitSummary.__qualname__}{{")]
        if len(summaries) == 1:
            self.load_state_dict(saved[summaries[0]])

    def state_dict(self) -> dict[str, Any]:
        """The run's totals up to the last completed step (a checkpoint is saved at a step boundary)."""
        return {"steps": self.steps, "accuracy_key": self.accuracy_key, "accuracy": [list(a) for a in self.accuracy],
                "reward_key": self.reward_key, "rewards": list(self.rewards), "flat_steps": self.flat_steps,
                "spread_logged_steps": self.spread_logged_steps, "rollouts": self.rollouts,
                "rollout_steps": self.rollout_steps, "rollout_s": self.rollout_s,
                "rollout_totals": self.rollout_totals.scalars(), "elapsed_s": self._elapsed(),
                "validation_s": self._validation_s, "memory_peaks": self._memory_peaks()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Go on from a checkpoint's totals, checked whole first (``_checked_state``: a corrupt or foreign state is
        refused naming the bad key or value, and leaves the summary as it was); a curve saved under another key is
        left out (said once)."""
        checked = self._checked_state(state_dict)
        self.steps, self.flat_steps = checked["steps"], checked["flat_steps"]
        self.spread_logged_steps, self.rollouts = checked["spread_logged_steps"], checked["rollouts"]
        self.rollout_steps, self.rollout_s = checked["rollout_steps"], checked["rollout_s"]
        self.rollout_totals = RolloutStats(**checked["rollout_totals"])
        self._elapsed_before_s, self._validation_s = checked["elapsed_s"], checked["validation_s"]
        self._earlier_memory_peaks = checked["memory_peaks"]
        for series, key, saved_key in (("accuracy", self.accuracy_key, checked["accuracy_key"]),
                                       ("rewards", self.reward_key, checked["reward_key"])):
            if saved_key == key:
                setattr(self, series, checked[series])
            else:
                rank_zero_info(f"FitSummary: the checkpoint's {series} are of {saved_key!r}, not {key!r}: the "
                               "summary's line for it covers this fit alone")
        self._restored = True
        self.resumed_at = self._fit_started_steps = self.steps  # also where the fit trains nothing (no train start)

    @staticmethod
    def _checked_state(state: Any) -> dict[str, Any]:
        """A checkpoint's summary state, each value checked and as the summary keeps it, else a ValueError naming
        the bad key or value."""
        # flat_steps and spread_logged_steps: absent from a checkpoint of an older FitSummary, the counts then cover
        # this fit's steps
        check_state_keys("a FitSummary state", state, _SUMMARY_KEYS, ("flat_steps", "spread_logged_steps"))
        checked = {key: check_int(f"summary state {key}", state.get(key, 0), 0) for key in _SUMMARY_COUNTS}
        checked.update((key, check_real(f"summary state {key}", state[key], low=0)) for key in _SUMMARY_SECONDS)
        checked.update((key, check_text(f"summary state {key}", state[key])) for key in ("accuracy_key", "reward_key"))
        rewards = state["rewards"]
        if not isinstance(rewards, (list, tuple)):
            raise ValueError(f"{shown_setting('summary state rewards', rewards, 80)} must be a list of numbers")
        checked["rewards"] = [check_real(f"summary state rewards[{i}]", reward) for i, reward in enumerate(rewards)]
        checked["accuracy"] = _checked_accuracy(state["accuracy"])
        totals = state["rollout_totals"]
        check_state_keys("a FitSummary state's rollout_totals", totals, _TOTALS, optional=_TOTALS)
        checked["rollout_totals"] = {key: _total(f"summary state rollout_totals.{key}", key, value)
                                     for key, value in totals.items()}
        peaks = state["memory_peaks"]
        check_state_keys("summary state memory_peaks", peaks, _PEAK_PLACES, optional=_PEAK_PLACES)
        checked["memory_peaks"] = {}
        for where, logged in peaks.items():
            check_state_keys(f"summary state memory_peaks[{where!r}]", logged, ROLLOUT_MEMORY_KEYS,
                             optional=ROLLOUT_MEMORY_KEYS)
            # byte counts as PeakMemoryMonitor logged them: floats where the ranks' values were reduced
            checked["memory_peaks"][where] = {key: check_real(f"summary state memory_peaks[{where!r}][{key!r}]",
                                                              value, low=0) for key, value in logged.items()}
        return checked

    def _elapsed(self) -> float:
        """Seconds since the training steps started, validations included, the earlier fits' added."""
        now = time.perf_counter() - self._started_s if self._started_s is not None else 0.0
        return self._elapsed_before_s + now

    # ------------------------------------------------------------------------------------------ report
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            print("\n".join(self.summary_lines(trainer)), flush=True)

    def summary_lines(self, trainer: pl.Trainer) -> list[str]:
        """The summary, one string per line (what ``on_fit_end`` prints)."""
        steps = self.steps
        # the end of fit's host peak too, read before the decode floor's bandwidth measurement allocates its buffer
        host = None if self._host_peak is None else max(self._host_peak, host_peak_bytes())
        elapsed = self._elapsed()
        training_s = max(elapsed - self._validation_s, 0.0)
        per_step = f"{_step_time(training_s / steps)} per step" if steps else ""
        if self._validation_s >= 0.5:
            per_step += f", plus {_duration(self._validation_s)} of validation"
        # the optimizer steps max_steps counts, where a step makes several (GRPOModule's num_mini_batches,
        # num_iterations) and the count covers the whole run
        optimizer_steps = (f" ({_count(trainer.global_step, 'optimizer step')})"
                           if steps and trainer.global_step != steps and (self.resumed_at is None or self._restored)
                           else "")
        lines = [f"lit_grpo: {_count(steps, 'step')}{optimizer_steps} in {_duration(elapsed)}"
                 + (f" ({per_step})" if per_step else "")]
        fit_steps = steps - self._fit_started_steps
        if self.resumed_at is not None:
            covers = (f"the lines cover all {steps}" if self._restored else
                      "the checkpoint held no FitSummary state: the lines cover this fit's steps alone")
            lines.append(f"  {'resumed':<14} at step {self.resumed_at}, {_count(fit_steps, 'step')} in this fit; "
                         + covers)
        if not fit_steps and 0 <= trainer.max_steps <= trainer.global_step:  # e.g. a resume of a finished run
            lines.append(f"  {'nothing to do':<14} the run is at trainer.max_steps={trainer.max_steps} (step "
                         f"{trainer.global_step}): raise --trainer.max_steps to train on")
        if self._threads_advice:
            lines.append(f"  {'threads':<14} {self._threads_advice}")
        if len(self.accuracy) == 1:  # one validation (a short or resumed run): nothing to compare it with
            (step, value), = self.accuracy
            lines.append(f"  {self.accuracy_key:<14} {value:.3f}   ({_when(step)})")
        elif self.accuracy:
            (first_step, first), (last_step, last) = self.accuracy[0], self.accuracy[-1]
            lines.append(f"  {self.accuracy_key:<14} {first:.3f} -> {last:.3f}   ({_when(first_step)} -> "
                         f"{_when(last_step)})")
        if self.rewards:
            n = min(self.window, max(1, len(self.rewards) // 2))  # the two ends never overlap
            first, last = sum(self.rewards[:n]) / n, sum(self.rewards[-n:]) / n
            ends = "first step -> last step" if n == 1 else f"mean of the first {n} steps -> the last {n}"
            lines.append(f"  {self.reward_key:<14} {first:.3f} -> {last:.3f}   ({ends})")
        no_signal = self._no_signal_line()
        if no_signal:
            lines.append(f"  {'no signal':<14} {no_signal}")
        if self.rollouts:
            lines.append(f"  {'rollout time':<14} {self._rollout_time(training_s)}")
            floor = self._floor_line(trainer)
            if floor:
                lines.append(f"  {'decode floor':<14} {floor}")
        peak = self._peak_line(trainer)
        if peak:
            lines.append(f"  {'rollout peak':<14} {peak}")
        if host is not None:
            lines.append(f"  {'host peak':<14} {format_bytes(host)} resident (the process's high-water mark"
                         + (", the largest rank's" if trainer.world_size > 1 else "")
                         + (", this fit's)" if self.resumed_at is not None else ")"))
        lines.extend(self._where_lines(trainer, resumed=self.resumed_at is not None))
        return lines

    def _no_signal_line(self) -> str:
        """The steps in which no group's completions got different rewards, where they are at least half of those
        that logged ``NO_SPREAD_KEY``: every advantage of such a step is 0, so the reward taught it nothing."""
        flat, logged = self.flat_steps, self.spread_logged_steps
        if not logged or 2 * flat < logged:
            return ""
        if flat == logged:
            which, taught = f"all {_count(logged, 'step')}", "every advantage was 0 and the reward taught nothing"
        else:
            which = f"{flat} of {logged} steps ({flat / logged:.0%})"
            taught = "their every advantage was 0 and the reward taught them nothing"
        return (f"{which}: no group's completions got different rewards ({NO_SPREAD_KEY} 1.0), so {taught}; check "
                "the reward functions against the completions (too hard a task? too short a max_new_tokens?)")

    def _rollout_time(self, training_s: float) -> str:
        totals = self.rollout_totals
        text = f"{self.rollout_s / max(self.rollout_steps, 1):.2f} s a step"
        if training_s > 0:
            text += f" ({min(self.rollout_s / training_s, 1.0):.0%} of it)"
        parts = []
        if totals.decode_ms_per_step is not None:
            parts.append(f"{totals.decode_ms_per_step:.1f} ms a decode step alone")
        if totals.prefill_ms_per_token is not None:
            parts.append(f"{totals.prefill_ms_per_token:.2f} ms a prompt token's prefill")
        return text + (": " + ", ".join(parts) if parts else "")

    def _floor_line(self, trainer: pl.Trainer) -> str:
        totals = self.rollout_totals
        if not totals.decode_read_bytes or not totals.decode_steps:
            return ""
        profiler = next((c for c in trainer.callbacks if isinstance(c, RolloutProfiler)), RolloutProfiler())
        bandwidth = profiler.bandwidth(trainer)
        floor = roofline(totals, bandwidth)
        return (f"{floor['rollout/floor_ms_per_step']:.2f} ms a step (its bytes at {_rate(bandwidth)}): "
                f"{totals.ms_per_step:.1f} ms a step is {floor['rollout/roofline_ratio']:.1f} x it; "
                f"{totals.generated_tokens / self.rollout_s if self.rollout_s > 0 else 0.0:.0f} tokens/s")

    def _peak_line(self, trainer: pl.Trainer) -> str:
        parts = []
        if self.rollout_totals.peak_kv_bytes:
            parts.append(f"KV cache {format_bytes(self.rollout_totals.peak_kv_bytes)}")
        for where, logged in self._memory_peaks().items():
            if "memory/rollout_peak_bytes" in logged:
                added = logged.get("memory/rollout_peak_delta_bytes")
                parts.append(f"{where} {format_bytes(logged['memory/rollout_peak_bytes'])}"
                             + (f" (+{format_bytes(added)} during the rollout)" if added is not None else ""))
        return "; ".join(parts)

    def _memory_peaks(self) -> dict[str, dict[str, float]]:
        """The largest rollout peaks PeakMemoryMonitor logged (``ROLLOUT_MEMORY_KEYS``) by where they were measured:
        ``"device"`` (CUDA, the allocator's) or ``"process"``; earlier fits' included (the checkpoint's)."""
        peaks = {where: dict(logged) for where, logged in self._earlier_memory_peaks.items()}
        for monitor in self._monitors:
            where = "device" if monitor.method == "cuda" else "process"
            mine = peaks.setdefault(where, {})
            for key in ROLLOUT_MEMORY_KEYS:
                if key in monitor.max_logged:
                    mine[key] = max(mine.get(key, 0), monitor.max_logged[key])
        return {where: logged for where, logged in peaks.items() if logged}

    @staticmethod
    def _where_lines(trainer: pl.Trainer, resumed: bool = False) -> list[str]:
        lines = []
        logger = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        if logger is not None:
            lines.append(f"  {'logs':<14} {shown_path(logger.log_dir)}  ->  tensorboard --logdir "
                         f"{shown_path(logger.root_dir)}")
        for other in trainer.loggers:  # any other logger that writes to a folder here (a CSVLogger) is named too
            folder = getattr(other, "log_dir", None)
            if not isinstance(other, TensorBoardLogger) and isinstance(folder, str) and os.path.isdir(folder):
                lines.append(f"  {'logs':<14} {shown_path(folder)} ({type(other).__name__})")
        checkpoint = last_checkpoint_callback(trainer)
        if isinstance(checkpoint, ModelCheckpoint):
            path = checkpoint.last_model_path or checkpoint.best_model_path
            if path and os.path.exists(path):
                saves = ""
                if isinstance(checkpoint, RunCheckpoint) and checkpoint.saves:
                    saves = (f", {_count(checkpoint.saves, 'save')} in {checkpoint.save_seconds:.1f} s"
                             + (" in this fit" if resumed else ""))
                cli = isinstance(checkpoint, RunCheckpoint) and checkpoint.resume_command  # lit-grpo sets it
                resume = "--ckpt_path last" if cli else fit_resume(shown_path(path))
                size = format_bytes(disk_bytes(path))
                lines.append(f"  {'checkpoint':<14} {shown_path(path)} ({size}{saves}; resume with {resume})")
        return lines


def _has_validation(trainer: pl.Trainer) -> bool:
    return trainer.enable_validation and trainer.limit_val_batches != 0


def _validate_now(trainer: pl.Trainer) -> None:
    """Run the fit's validation loop once, the way Lightning runs it between training steps (its metrics are
    logged at the current step)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    # private, no public API: the validation loop resets the logger connector's first-iteration flag, which the
    # fit loop's next step still needs; kept as Lightning's own loop would leave it
    first_loop_iter = trainer._logger_connector._first_loop_iter
    trainer.validating = True
    epoch_loop.val_loop.run()
    trainer.training = True
    trainer._logger_connector._first_loop_iter = first_loop_iter


def _rate(bytes_per_s: float) -> str:
    """``2.0e12 -> '2.0 TB/s'`` (decimal units, as bandwidths are quoted)."""
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _when(step: int) -> str:
    """A validation's place in the run, from the training steps done when it ran."""
    return "before training" if step == 0 else f"after step {step}"


def _duration(seconds: float) -> str:
    if seconds < 10:  # a short run (a plain module's steps take milliseconds): "0 s" would say nothing
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _step_time(seconds: float) -> str:
    """A step's time: ``24.1 s``, or ``50 ms`` below a second."""
    return f"{seconds:.1f} s" if seconds >= 1 else f"{1000 * seconds:.0f} ms"


#: The keys of a FitSummary state: its counts, its seconds, and the rest.
_SUMMARY_COUNTS = ("steps", "flat_steps", "spread_logged_steps", "rollouts", "rollout_steps")
_SUMMARY_SECONDS = ("rollout_s", "elapsed_s", "validation_s")
_SUMMARY_KEYS = ("steps", "accuracy_key", "accuracy", "reward_key", "rewards", "flat_steps", "spread_logged_steps",
                 "rollouts", "rollout_steps", "rollout_s", "rollout_totals", "elapsed_s", "validation_s",
                 "memory_peaks")
#: The rollout totals' keys (``RolloutStats.scalars``: its numbers, those that are None left out) and where a
#: memory peak was measured (``_memory_peaks``).
_TOTALS = tuple(field.name for field in dataclasses.fields(RolloutStats) if field.name not in ("timeline", "decisions"))
_PEAK_PLACES = ("device", "process")


def _checked_accuracy(accuracy: Any) -> list[tuple[int, float]]:
    """A state's accuracy curve as the summary keeps it (``(step, value)`` pairs), else a ValueError naming the bad
    entry."""
    if not isinstance(accuracy, (list, tuple)):
        raise ValueError(f"{shown_setting('summary state accuracy', accuracy, 80)} must be a list of [step, value] "
                         "pairs")
    checked = []
    for index, entry in enumerate(accuracy):
        pair = entry if isinstance(entry, (list, tuple)) and len(entry) == 2 else (None, None)
        step, value = integer_within(pair[0], 0), _number(pair[1])
        if step is None or value is None:
            raise ValueError(f"{shown_setting(f'summary state accuracy[{index}]', entry, 80)} is not allowed; a "
                             "validation's accuracy is [step, value], an integer >= 0 and a number")
        checked.append((step, value))
    return checked


def _total(name: str, key: str, value: Any) -> int | float:
    """A rollout total: a count (an integer >= 0) where ``RolloutStats`` counts, else a number (NaN among them: a
    length prediction's quality where nothing was scored)."""
    if type(RolloutStats.__dataclass_fields__[key].default) is int:
        return check_int(name, value, 0)
    number = _number(value)
    if number is None:
        raise ValueError(f"{shown_setting(name, value, 80)} must be a number")
    return number


def _number(value: Any) -> float | None:
    """``value`` as a float if it is a real number (NaN and infinities too; not a bool, nor an int beyond float
    range), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return None
