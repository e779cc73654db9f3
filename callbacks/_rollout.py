"""What the callbacks share: spotting a lit_grpo rollout batch, logging at the step Lightning logs at, and making
a step's figures the whole step's under several processes (every rank's values gathered once, each key reduced by
its rule in lit_grpo.rollout.metrics.RANK_REDUCTIONS, the same on every rank).

Every callback in this package must run next to any LightningModule, so a lit_grpo batch is recognised by duck
typing alone: an object whose ``stats`` attribute is a :class:`~lit_grpo.sampling.stats.RolloutStats`. Such a batch
also carries ``prompts`` ([B]), ``completions`` ([B][G]), ``rewards`` ([B, G]), ``completion_lengths`` ([B, G])
and ``truncated`` ([B, G], bool).

Under several processes a rank cannot tell from its own batch whether another rank has a rollout at this batch, so
the callbacks that report rollouts (``FitSummary``, ``RolloutProfiler``, ``CompletionLogger``) gather at every
training batch only where the source declares it: the trainer's datamodule has ``yields_rollouts = True``
(``RolloutDataModule`` has), the same on every rank, as every rank builds the same datamodule. Any other project
pays no collective a batch for them; a rollout batch from a source that did not declare it is refused
(``check_rollout_source``).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from lit_grpo.rollout.metrics import gather_over_ranks, whole_step_metrics
from lit_grpo.runtime.distributed import strategy_all_gather
from lit_grpo.runtime.validation import shown_keys
from lit_grpo.sampling.stats import RolloutStats
from lit_grpo.scheduling.base import DECISION_NAMES, decision_counts

#: RolloutStats' scalar fields (all but the timeline and the decisions), in the order ranks gather them; then the
#: count of each scheduling decision, ``decisions/<action>_<reason>`` (the same names on every rank).
STATS_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutStats) if f.name not in ("timeline", "decisions"))
DECISION_FIELDS = tuple(f"decisions/{name}" for name in DECISION_NAMES)

#: How a project of its own gets its rollouts to the callbacks, said where a callback finds none.
CARRYING_ROLLOUTS = ("a batch carries one where the data pipeline sets its batch.stats to the RolloutStats of "
                     "RolloutEngine.generate (result.stats); a rollout generated inside training_step reaches no "
                     "callback")

T = TypeVar("T")

#: The callbacks told that the trainer has no logger for their keys (``log_metrics``), each once.
_TOLD_NO_LOGGER: weakref.WeakSet[pl.Callback] = weakref.WeakSet()


class RolloutLike(Protocol):
    """What the callbacks read of a lit_grpo training batch (one training step's batch; lit_grpo.batch.RolloutBatch)."""

    stats: RolloutStats
    prompts: list[str]
    completions: list[list[str]]
    rewards: torch.Tensor
    completion_lengths: torch.Tensor
    truncated: torch.Tensor


def rollout_stats(batch: Any) -> RolloutStats | None:
    """The batch's RolloutStats when it is a lit_grpo rollout, else None (any other module's batch)."""
    stats = getattr(batch, "stats", None)
    return stats if isinstance(stats, RolloutStats) else None


def declares_rollouts(trainer: pl.Trainer) -> bool:
    """Whether the trainer's datamodule declares that its training batches are lit_grpo rollouts (its
    ``yields_rollouts`` is True; ``RolloutDataModule``'s is): the same on every rank, which builds the same
    datamodule, so every rank decides alike whether to join the callbacks' gathers. No datamodule (the loaders given
    to ``fit`` or defined on the module) declares nothing."""
    return getattr(getattr(trainer, "datamodule", None), "yields_rollouts", False) is True


def gathers_rollouts(trainer: pl.Trainer) -> bool:
    """Whether the callbacks gather each training batch's rollout figures over ranks: under several processes, from
    a source that declares its batches rollouts (``declares_rollouts``); one process needs no gather."""
    return trainer.world_size > 1 and declares_rollouts(trainer)


def check_rollout_source(trainer: pl.Trainer, stats: RolloutStats | None, callback: str) -> None:
    """Refuse a rollout batch (``stats`` not None) under several processes from a source that did not declare its
    batches rollouts: the callbacks do not gather there, so its figures would be rank 0's alone, never the step's.

    Raised at this batch on the rank that has it, with no collective to agree first (which would cost the gather a
    batch that the declaration saves). Every rank runs the same module and data code, so in practice every rank has
    a rollout at the same batch and all raise together; where only some ranks do, theirs is a rank's error like any
    other, which ends the others (``RankFailureWatch``, which ``lit-grpo`` adds; in a project of its own without it,
    over NCCL the others may wait in their next collective until the process group's timeout)."""
    if stats is None or trainer.world_size <= 1 or declares_rollouts(trainer):
        return
    source = getattr(trainer, "datamodule", None)
    if source is not None:
        named = f"its datamodule {type(source).__name__}, which does not declare"
        declare = "set the class attribute yields_rollouts = True on the LightningDataModule that yields them"
    else:
        named = "no datamodule (loaders of its own), which do not declare"
        declare = ("loaders cannot declare it: yield the rollouts from a LightningDataModule with the class "
                   "attribute yields_rollouts = True")
    raise RuntimeError(
        f"{callback}: a training batch is a lit_grpo rollout (batch.stats is a RolloutStats) under "
        f"{trainer.world_size} processes, but the trainer has {named} that its training batches are rollouts: "
        f"{declare} (RolloutDataModule has it), so that every rank joins the gather of each step's rollout figures; "
        "undeclared, they would be rank 0's alone")


def accumulating(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether this training batch only accumulates gradients (Lightning steps the optimizer on the last of every
    ``accumulate_grad_batches`` batches, and on the epoch's last batch): a callback that keeps one point per
    optimizer step waits for the batch that ends it."""
    every = trainer.accumulate_grad_batches
    return every > 1 and (batch_idx + 1) % every != 0 and not trainer.is_last_batch


def step_parts(pending: list[T], part: T | None, trainer: pl.Trainer, batch_idx: int) -> list[T] | None:
    """One training step's parts, at most one per training batch: ``part`` (this batch's; None: it has none, as a
    batch without a rollout) joins ``pending``; at the batch that ends the optimizer step, the step's parts in
    their order (``pending`` left empty; an empty list where no batch of the step had one), else None. Under
    gradient accumulation a callback logs a step once, its micro-batches merged, not each at the same step; every
    training batch comes here, with a part or not, so a step ends at its optimizer step even where its last batch
    has no part, and no part carries over into the next step."""
    if part is not None:
        pending.append(part)
    if accumulating(trainer, batch_idx):
        return None
    parts = pending[:]
    pending.clear()
    return parts


def logger_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs this batch's scalars at.

    Lightning writes ``self.log`` values at ``_batches_that_stepped`` (not ``global_step``, which is already
    incremented in ``on_train_batch_end``); images, histograms and text written straight to the experiment use
    the same step so they line up with the scalars in TensorBoard. Lightning's own DeviceStatsMonitor reads it too.
    """
    return trainer.fit_loop.epoch_loop._batches_that_stepped  # private: Lightning has no public name for this step


def log_step_due(trainer: pl.Trainer) -> bool:
    """Whether ``Trainer(log_every_n_steps=...)`` logs at this training batch (Lightning's own rule in the fit loop,
    read from public settings: ``+ 1`` because the batch's step is counted after its hooks)."""
    every = trainer.log_every_n_steps
    return every > 0 and ((logger_step(trainer) + 1) % every == 0 or trainer.should_stop)


def tensorboard_experiments(trainer: pl.Trainer) -> list[Any]:
    """The SummaryWriters of the trainer's TensorBoard loggers (images and text go there directly)."""
    return [logger.experiment for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float], by: pl.Callback, every_log_step: bool = True) -> None:
    """Write scalars straight to every logger at this batch's step, as Lightning's own monitor callbacks do.

    Not ``pl_module.log``: Lightning re-logs a key's last value at every later step of the epoch, even steps that
    did not log it, so a figure skipped for one step (no length predictor) or logged only at some steps (a
    forecast) would show stale copies. ``every_log_step`` honours ``Trainer(log_every_n_steps=...)``; callbacks
    with their own cadence pass False. Called from training-batch hooks, ``by`` the callback that writes: a trainer
    without a logger is said once per callback, that none of its figures is written, this first call's keys as
    examples (a later step may log others: RolloutProfiler's decision counts); not refused, as Lightning's monitors
    do: what these callbacks keep, PeakMemoryMonitor's ``max_logged``, a forecast's stop, still works.
    """
    if not metrics or (every_log_step and not log_step_due(trainer)):
        return
    if not trainer.loggers:
        if by not in _TOLD_NO_LOGGER:
            _TOLD_NO_LOGGER.add(by)
            rank_zero_warn(f"{type(by).__name__}: the trainer has no logger (Trainer(logger=False)), so none of the "
                           f"figures it logs is written (such as {shown_keys(metrics)}); give the Trainer a logger (a "
                           "CSVLogger will do) to keep them")
        return
    step = logger_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def show_in_progress_bar(pl_module: pl.LightningModule, values: dict[str, float]) -> None:
    """Put values in the progress bar only (``logger=False``): the Lightning way for a callback to reach it."""
    pl_module.log_dict(values, on_step=True, on_epoch=False, prog_bar=True, logger=False)


def whole_step(trainer: pl.Trainer, metrics: Mapping[str, float | None], keys: Sequence[str]) -> dict[str, float]:
    """``metrics`` as the whole step's: under several processes reduced over ranks by one collective
    (lit_grpo.rollout.metrics.RANK_REDUCTIONS; ``keys``: every key any rank may log, in one order on every rank, so
    every rank must call this at the same hook, measured or not); one process: ``metrics`` less its None values."""
    if trainer.world_size <= 1:
        return {key: value for key, value in metrics.items() if value is not None}
    return whole_step_metrics(metrics, keys, strategy_all_gather(trainer.strategy))


def rank_rollouts(trainer: pl.Trainer,
                  stats: RolloutStats | None) -> tuple[list[RolloutStats], list[dict[str, int]]]:
    """Every rank's RolloutStats at this hook (their timelines and decisions left out) and its count of each
    scheduling decision (``action_reason`` -> count, the names that occurred), rank 0 first; a rank without a
    rollout here (``stats`` None) is left out of both. One process: its own, or nothing; several from a source that
    does not declare rollouts (``gathers_rollouts``): nothing, with no collective (``check_rollout_source`` has
    refused a rollout there).

    Under several processes from a declared source, one collective, which every rank joins at the same hook whether
    it has a rollout or not: a rank of a module whose batches are not all rollouts may have none where another has
    one, and a rank that skipped the gather would leave the others waiting in it. Ranks gather a fixed set of names
    (``DECISION_NAMES``): a custom scheduler's other reasons are counted under ``other`` (warned once)."""
    if not gathers_rollouts(trainer):
        return ([stats], [_decision_counts(stats)]) if stats is not None else ([], [])
    values = {} if stats is None else {**stats.scalars(), **{f"decisions/{name}": count for name, count
                                                             in _decision_counts(stats).items()}}
    per_rank = [rank for rank in gather_over_ranks(values, STATS_FIELDS + DECISION_FIELDS,
                                                   strategy_all_gather(trainer.strategy)) if rank]
    ranks = [_stats_from({k: v for k, v in rank.items() if k in STATS_FIELDS}) for rank in per_rank]
    counts = [{name: round(rank[f"decisions/{name}"]) for name in DECISION_NAMES if f"decisions/{name}" in rank}
              for rank in per_rank]
    return ranks, counts


def _decision_counts(stats: RolloutStats) -> dict[str, int]:
    counts = decision_counts(stats.decisions)
    unknown = sorted(set(counts) - set(DECISION_NAMES))
    if unknown:  # never raise here: a rank that raised would leave the others waiting in the gather
        rank_zero_warn(f"scheduling decisions {unknown} are not in lit_grpo.scheduling.base.DECISION_NAMES: they are "
                       "counted as rollout/decisions/other (add them there to count them by name)")
        counts["other"] = sum(counts.pop(name) for name in unknown)
    return counts


def _stats_from(values: Mapping[str, float]) -> RolloutStats:
    """A RolloutStats from gathered float values, each field in its own type (counts back to int)."""
    defaults = RolloutStats()
    return RolloutStats(**{name: round(value) if isinstance(getattr(defaults, name), int) else value
                           for name, value in values.items()})


def measured_kv_bytes(stats: RolloutStats) -> int | None:
    """``stats.peak_kv_bytes``, or None when the engine did not account it (0 bytes although tokens were decoded)."""
    if stats.peak_kv_bytes == 0 and stats.decode_steps > 0:
        return None
    return stats.peak_kv_bytes
