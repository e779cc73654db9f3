"""A Lightning project of its own (no ``lit-grpo``), for the tests of several processes: ``python
plain_ddp_failures_at_once.py ROOT SLOW_RANK SECONDS`` fits a plain regression module on 1 node x 2 processes over
gloo under Lightning's own launcher (rank 0 starts rank 1 as its child, which re-runs this script, and ends it as it
ends; its process observer ends rank 0 once rank 1 has ended) with ``RankFailureWatch``, and both ranks raise
``PlantedError`` in their second ``training_step``. A callback after the watch handles the error in ``on_exception``
(closes a file, logs it), on ``SLOW_RANK`` for ``SECONDS``, then says so: each rank's handling must not be cut short
by the other's end."""

import sys
import time

import lightning.pytorch as pl
from callback_helpers import TinyRegression
from lightning.pytorch import Callback

from lit_grpo.callbacks import RankFailureWatch
from lit_grpo.runtime import rank_failure


class PlantedError(RuntimeError):
    """The planted failure."""


class FailingRegression(TinyRegression):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise PlantedError(f"planted failure on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


class HandlesTheError(Callback):
    """A user's callback after ``RankFailureWatch`` whose ``on_exception`` takes ``seconds`` on rank ``rank``."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_exception(self, trainer, pl_module, exception):
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)
        print(f"rank {trainer.global_rank} handled its {type(exception).__name__}", flush=True)


if __name__ == "__main__":
    root, slow_rank, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    rank_failure.HANDLING_GRACE_S = 120.0  # far above SECONDS on a loaded machine: whether a rank waits, not how long
    trainer = pl.Trainer(default_root_dir=root, accelerator="cpu", strategy="ddp", devices=2, max_steps=3,
                         callbacks=[RankFailureWatch(), HandlesTheError(slow_rank, seconds)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(FailingRegression())
