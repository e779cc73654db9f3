"""``RankFailureWatch``: under several processes, this rank ends once another has failed."""

from __future__ import annotations

import threading

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback

from lit_grpo.runtime.rank_failure import watch_failures


class RankFailureWatch(Callback):
    """Ends this rank, naming the rank that failed and its error, within a second of another rank's failure
    recorded in the run's store (``lit_grpo.runtime.rank_failure``; ``lit-grpo`` records every rank's error there).
    Over gloo a failed rank's peers fail at their next collective anyway; over NCCL a peer waiting in a collective
    may notice only at the process group's timeout, and a rank computing alone notices only at its next
    collective. One process: nothing. ``lit-grpo`` adds it to every fit and validation.

    Logs nothing.
    """

    def __init__(self) -> None:
        self._stop: threading.Event | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size > 1 and torch.distributed.is_initialized() and self._stop is None:
            self._stop = watch_failures(trainer.global_rank, trainer.world_size)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None
