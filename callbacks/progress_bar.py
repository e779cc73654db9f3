"""A progress bar that counts optimizer steps towards ``max_steps`` and shows how the policy is doing."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar

from lit_grpo.runtime.validation import check_bool, check_int
from lit_grpo.update.lr_schedule import global_steps_to_run

from .rollout_profiler import PROGRESS_BAR_NAMES

#: Logged keys shown in the bar, under short names.
SHOWN = {"reward/mean": "reward", "val/accuracy": "val_acc", "train/loss": "loss"}

#: Progress-bar values that count something (RolloutProfiler's decode steps and lower bound): shown as integers.
COUNTS = (PROGRESS_BAR_NAMES["decode_steps"], PROGRESS_BAR_NAMES["lower_bound_steps"])


class GRPOProgressBar(TQDMProgressBar):
    r"""Lightning's TQDM bar, counting what a GRPO run counts.

    - the training bar, "GRPO steps", runs over optimizer steps, ``global_step / max_steps`` (one training batch is
      ``num_iterations x num_mini_batches`` of them, its module's ``optimizer_steps_per_training_step``: ``max_steps``
      rounded up to whole training steps, where Lightning stops), with a real rate and ETA (seconds per step when a
      step takes longer than a second), not over the batches of an epoch that never ends (``Epoch 0/-2``,
      ``-:--:--``); a resumed run starts at its step and its rate counts only the steps it ran;
    - next to it: ``reward`` (``reward/mean`` of the last step), ``val_acc`` (the last ``val/accuracy``),
      ``loss`` (``train/loss``), and whatever is logged with ``prog_bar=True`` (RolloutProfiler's ``steps``,
      ``bound`` and ``util``); the logger's version number (``v_num``) is left out.

    Logs no keys. Without ``max_steps`` (``max_steps=-1``) it is Lightning's bar over the epoch's batches.
    """

    #: Lightning's format with ``rate_fmt`` (s/step when slower than one step a second) for ``rate_noinv_fmt``.
    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]{postfix}"

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        # Lightning's bar takes any value: a negative rate hid the bar, a string failed once training started
        refresh_rate = check_int("refresh_rate", refresh_rate, 0, hint="steps between redraws; 0: no bar")
        process_position = check_int("process_position", process_position, 0)
        check_bool("leave", leave)
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)

    @property
    def train_description(self) -> str:
        return "GRPO steps" if self._counts_steps else super().train_description

    @property
    def _counts_steps(self) -> bool:
        return self._trainer is not None and self.trainer.max_steps > 0

    def init_train_tqdm(self):
        bar = super().init_train_tqdm()
        if self._counts_steps:  # the total from the start: no "0/?" line before the first step
            bar.unit = "step"
            # Lightning stops after whole training steps: a max_steps inside one (GRPOModule's several optimizer
            # steps a training step) runs on to its end
            per_step = getattr(self.trainer.lightning_module, "optimizer_steps_per_training_step", 1)
            bar.reset(total=global_steps_to_run(self.trainer.max_steps, per_step))
            bar.initial = bar.n = self.trainer.global_step  # a resumed run starts where it stopped
        return bar

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self._counts_steps:
            super().on_train_epoch_start(trainer, *args)
        # Counting steps, the one bar spans every epoch: nothing to reset.

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._counts_steps:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar = self.train_progress_bar
        if not bar.disable and self._should_update(trainer.global_step, bar.total):
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        for name in COUNTS:
            if isinstance(items.get(name), float) and items[name].is_integer():
                items[name] = int(items[name])
        shown = {name: f"{float(trainer.callback_metrics[key]):.3f}"
                 for key, name in SHOWN.items() if key in trainer.callback_metrics}
        return {**shown, **items}
