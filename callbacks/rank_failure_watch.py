"""``RankFailureWatch``: under several processes, a rank's error ends every rank, each naming it."""

from __future__ import annotations

import contextlib
import threading

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback

from lit_grpo.runtime.distributed import is_multi_process
from lit_grpo.runtime.rank_failure import (caller_ends_failed_ranks, end_failed_rank, is_failure, rank_place,
                                           watch_failures, watching)


class RankFailureWatch(Callback):
    """Ends this rank, naming the rank that failed and its error, within a second of another rank's failure
    recorded in the run's store (``lit_grpo.runtime.rank_failure``). Over gloo a failed rank's peers fail at their
    next collective anyway; over NCCL a peer waiting in a collective may notice only at the process group's
    timeout, and a rank computing alone notices only at its next collective. One process: nothing; nor where a
    watch of this process runs already (``lit-grpo`` starts one as the run starts, before the ranks connect).

    This rank's own error (``on_exception``; not a stop such as ``KeyboardInterrupt`` or ``StopRequested``, nor
    ``RaisedOnEveryRank`` or ``RankFailed``: ``rank_failure.is_failure``) is recorded there and ends the rank at
    once, after its traceback and its loggers' last write, with exit status 1 (``rank_failure.end_failed_rank``):
    the callbacks after this one see no ``on_exception``. Under ``lit-grpo``, which adds it to every fit and
    validation, the CLI's error path records and ends the rank instead (its output and exit status per error).

    Logs nothing.
    """

    def __init__(self) -> None:
        self._stop: threading.Event | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        place = rank_place(trainer.strategy)
        if place is not None and torch.distributed.is_initialized() and self._stop is None and not watching():
            self._stop = watch_failures(place)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not is_multi_process() or caller_ends_failed_ranks() or not is_failure(exception):
            return
        # Lightning finalizes the loggers after this hook, which the rank's end cuts short: the logged points stay
        for logger in trainer.loggers:
            with contextlib.suppress(Exception):
                logger.finalize("failed")
        end_failed_rank(exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None
