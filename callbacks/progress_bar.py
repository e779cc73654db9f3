"""A progress bar that counts optimizer steps towards ``max_steps`` and shows how the policy is doing."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar

#: Logged keys shown in the bar, under short names (None: kept under its own name).
SHOWN = {"reward/mean": "reward", "val/accuracy": "val_acc", "train/loss": "loss"}


class GRPOProgressBar(TQDMProgressBar):
    r"""Lightning's TQDM bar, counting what a GRPO run counts.

    - the training bar runs over optimizer steps, ``global_step / max_steps`` (one rollout is one or
      ``num_iterations`` steps), with a real rate and ETA (seconds per step when a step takes longer than a
      second), not over the batches of an epoch that never ends (``Epoch 0/-2``, ``-:--:--``);
    - next to it: ``reward`` (``reward/mean`` of the last step), ``val_acc`` (the last ``val/accuracy``),
      ``loss``, and whatever is logged with ``prog_bar=True`` (RolloutProfiler's ``steps``, ``bound``, ``util``);
      the logger's version number (``v_num``) is left out.

    Logs no keys. Without ``max_steps`` it falls back to the epoch's batches.
    """

    BAR_FORMAT = ("{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]{postfix}")

    def init_train_tqdm(self):
        bar = super().init_train_tqdm()
        bar.unit = "step"
        return bar

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.max_steps <= 0:
            super().on_train_epoch_start(trainer, *args)
            return
        bar = self.train_progress_bar
        if bar.total != trainer.max_steps:  # once per fit: the bar spans every epoch
            bar.reset(total=trainer.max_steps)
            bar.initial = bar.n = trainer.global_step  # a resumed run starts where it stopped
            bar.set_description("GRPO steps", refresh=False)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.max_steps <= 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar = self.train_progress_bar
        if bar is not None and not bar.disable:
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        shown = {}
        for key, name in SHOWN.items():
            value = trainer.callback_metrics.get(key)
            if value is not None:
                shown[name] = f"{float(value):.3f}"
        return {**shown, **items}
