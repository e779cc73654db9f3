"""Completion lengths of every rollout, and now and then a table of what the policy actually wrote."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lit_grpo.rollout.metrics import completion_length_metrics
from lit_grpo.runtime.validation import check_int

from ._rollout import (CARRYING_ROLLOUTS, RolloutLike, check_rollout_source, gathers_rollouts, log_metrics,
                       logger_step, rollout_stats, step_parts, tensorboard_experiments, whole_step)

#: What this callback reads of a rollout batch besides its ``stats`` (``RolloutLike``).
COMPLETION_FIELDS = ("prompts", "completions", "rewards", "completion_lengths", "truncated")

#: The scalars this callback logs (where the LightningModule does not), in the order ranks gather them.
COMPLETION_KEYS = ("completions/mean_length", "completions/min_length", "completions/max_length",
                   "completions/clipped_ratio")

# Characters that Markdown would turn into formatting or table structure inside a cell.
_MARKDOWN_SPECIAL = "\\`*_{}[]<>()#+-!|~"


class CompletionLogger(Callback):
    r"""Logs completion-length statistics of each rollout and a sample table of prompts, completions and rewards.

    **Logged keys** (once per training step; under gradient accumulation once per optimizer step, after its last
    micro-batch, over all its micro-batches' samples)

    - ``completions/mean_length``, ``completions/min_length``, ``completions/max_length``: completion tokens
      over the B x G samples of the rollout, the whole step's under several processes (scalars, every step,
      honouring ``log_every_n_steps``), unless the LightningModule logs these keys itself (GRPOModule does), in
      which case its values stand alone. Under several processes the ranks' figures are gathered at every step,
      every rank joining, where the trainer's datamodule declares that its training batches are rollouts (its
      ``yields_rollouts`` is True, as ``RolloutDataModule``'s); where it does not, no gather (another project pays
      no collective a step), and a rollout batch raises an error at that batch
      (``lit_grpo.callbacks._rollout.check_rollout_source``): its figures would be rank 0's alone.
    - ``completions/clipped_ratio``: share of completions cut by ``max_new_tokens`` (no EOS).
    - ``completions/length`` (TensorBoard histogram, every ``histogram_every_n_steps`` steps): the lengths
      (rank 0's batches under several processes, as is the table).
    - ``completions/samples`` (TensorBoard text, every ``table_every_n_steps`` steps, the first included): a
      Markdown table of the first ``num_prompts`` prompts (under gradient accumulation, of the step's first
      micro-batch) with ``num_completions`` completions each, their reward, length, whether they were clipped and
      the columns reward functions logged (``log_extra``); texts cut to ``max_chars`` characters.

    Histogram and table need a :class:`~lightning.pytorch.loggers.TensorBoardLogger` (warns once otherwise).
    Needs lit_grpo batches: ``stats`` (a RolloutStats) with ``prompts``, ``completions``, ``rewards``,
    ``completion_lengths`` and ``truncated`` (``lit_grpo.batch.RolloutBatch``); a batch with ``stats`` and not all of
    these is refused, naming what it lacks. With batches without ``stats`` (any other LightningModule) it warns once
    and logs nothing.

    Args:
        histogram_every_n_steps: training steps between two length histograms.
        table_every_n_steps: training steps between two sample tables.
        num_prompts: prompts shown in the table.
        num_completions: completions shown per prompt.
        max_chars: longer prompts and completions are cut (with "…") to keep the table readable.
    """

    def __init__(
        self,
        histogram_every_n_steps: int = 1,
        table_every_n_steps: int = 50,
        num_prompts: int = 2,
        num_completions: int = 4,
        max_chars: int = 400,
    ) -> None:
        self.histogram_every_n_steps = check_int("histogram_every_n_steps", histogram_every_n_steps, 1)
        self.table_every_n_steps = check_int("table_every_n_steps", table_every_n_steps, 1)
        self.num_prompts = check_int("num_prompts", num_prompts, 1)
        self.num_completions = check_int("num_completions", num_completions, 1)
        self.max_chars = check_int("max_chars", max_chars, 1)
        self._warned: set[str] = set()
        self._step_samples: list[tuple[torch.Tensor, torch.Tensor]] = []  # the step's micro-batches' so far
        self._step_table: str | None = None  # the step's first micro-batch's table, where the step shows one

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_samples, self._step_table = [], None  # a fit that ended mid-step leaves none to the next

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = logger_step(trainer)  # the step logged at: the loop's own count, which a resumed run restores
        want_histogram = step % self.histogram_every_n_steps == 0
        want_table = step % self.table_every_n_steps == 0
        part = None
        stats = rollout_stats(batch)
        check_rollout_source(trainer, stats, "CompletionLogger")
        if stats is None:
            self._warn_once("no_rollout", "a training batch is not a lit_grpo rollout (no batch.stats): the "
                                          "batches that are not are left out (a module that has none logs "
                                          f"nothing; {CARRYING_ROLLOUTS}, with the fields CompletionLogger "
                                          "reads, as lit_grpo.batch.RolloutBatch holds them).")
        else:
            _check_completions(batch)
            lengths = batch.completion_lengths.detach().flatten().cpu()
            if want_table and self._step_table is None and lengths.numel() and trainer.is_global_zero:
                self._step_table = sample_table(batch, self.num_prompts, self.num_completions, self.max_chars)
            part = (lengths, batch.truncated.detach().flatten().cpu())
        parts = step_parts(self._step_samples, part, trainer, batch_idx)
        if parts is None:  # the step goes on to the micro-batch whose optimizer step ends it
            return
        table, self._step_table = self._step_table, None
        lengths = torch.cat([length for length, _ in parts]) if parts else torch.zeros(0, dtype=torch.long)
        truncated = torch.cat([clipped for _, clipped in parts]) if parts else torch.zeros(0, dtype=torch.bool)
        # A module that already logs these keys (GRPOModule does) keeps them: the same figure is never written twice.
        # Which keys are left, and whether the source declares rollouts, is the same on every rank, so every rank
        # joins the gather below, or none does: a rank whose step had no rollout too (its figures absent), where
        # another rank's had one.
        wanted = [key for key in COMPLETION_KEYS if key not in trainer.callback_metrics]
        if wanted and (gathers_rollouts(trainer) or trainer.world_size <= 1):
            summary = completion_length_metrics(lengths, truncated) if lengths.numel() else {}
            log_metrics(trainer, whole_step(trainer, {key: summary.get(key) for key in wanted}, wanted), self)
        if lengths.numel() == 0:
            return

        if not (want_histogram or want_table) or not trainer.is_global_zero:
            return
        experiments = tensorboard_experiments(trainer)
        if not experiments:
            self._warn_once("no_tensorboard", "the trainer has no TensorBoardLogger; the length histogram and "
                                              "sample table are not logged.")
            return
        for experiment in experiments:
            if want_histogram:
                experiment.add_histogram("completions/length", lengths.double(), step)
            if table is not None:
                experiment.add_text("completions/samples", table, step)

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            rank_zero_warn(f"CompletionLogger: {message}")


def _check_completions(batch: Any) -> None:
    """Refuse a batch that carries a rollout's ``stats`` without its completions, naming what it lacks (a project
    of its own may hand the engine's stats alone to the callbacks, which is all RolloutProfiler reads)."""
    missing = [name for name in COMPLETION_FIELDS if not hasattr(batch, name)]
    if missing:
        raise TypeError(
            f"CompletionLogger: a training batch ({type(batch).__name__}) carries a rollout's batch.stats but "
            f"lacks {', '.join(missing)}: it reads prompts ([B] strings), completions ([B][G] strings), and "
            "rewards, completion_lengths and truncated ([B, G] tensors), as lit_grpo.batch.RolloutBatch holds them. "
            "Give the batch these, or leave CompletionLogger out (RolloutProfiler, SlotTimelineLogger and "
            "PeakMemoryMonitor need batch.stats alone)")


def sample_table(batch: RolloutLike, num_prompts: int, num_completions: int, max_chars: int) -> str:
    """A Markdown table: one row per shown completion, the prompt written on its group's first row, and a column
    for each of the batch's ``reward_extras`` (what reward functions logged with ``log_extra``) before the
    completion."""
    extras = getattr(batch, "reward_extras", None) or {}
    header = ["prompt", "k", "reward", "length", *(markdown_cell(column, max_chars) for column in extras),
              "completion"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for p, prompt in enumerate(batch.prompts[:num_prompts]):
        for k, completion in enumerate(batch.completions[p][:num_completions]):
            length = int(batch.completion_lengths[p, k])
            clipped = " (clipped)" if bool(batch.truncated[p, k]) else ""
            cells = [markdown_cell(prompt, max_chars) if k == 0 else "", str(k), f"{float(batch.rewards[p, k]):.3f}",
                     f"{length}{clipped}", *(_extra_cell(values[p][k], max_chars) for values in extras.values()),
                     markdown_cell(completion, max_chars)]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _extra_cell(value: Any, max_chars: int) -> str:
    """A logged extra value as a cell: empty where none was logged, a float to 3 decimals, else its text."""
    if value is None:
        return ""
    return f"{value:.3f}" if isinstance(value, float) else markdown_cell(str(value), max_chars)


def markdown_cell(text: str, max_chars: int) -> str:
    """``text`` made safe for one Markdown table cell: cut, special characters escaped, newlines as <br>."""
    if len(text) > max_chars:
        text = text[:max_chars] + "…"
    escaped = "".join(f"\\{c}" if c in _MARKDOWN_SPECIAL else c for c in text)
    return escaped.replace("\r\n", "\n").replace("\n", "<br>")
