"""A Lightning project of its own (no ``lit-grpo``), for the tests of several processes: ``python
plain_ddp_failure.py ROOT RANK0`` fits a plain regression module on 2 nodes x 1 process over gloo with
``RankFailureWatch`` and a callback after it that says when it sees the error, and rank 1 raises ``PlantedError`` in
its second ``training_step``. Rank 0 meanwhile (``RANK0``) either ``stalls``, away from any collective for 300 s, or
goes on into the step's gradient reduction (``reduces``)."""

import sys
import time

import lightning.pytorch as pl
from callback_helpers import TinyRegression
from lightning.pytorch import Callback

from lit_grpo.callbacks import RankFailureWatch

RANK0 = ("stalls", "reduces")


class PlantedError(RuntimeError):
    """The planted failure."""


class FailingRegression(TinyRegression):
    def __init__(self, rank0: str) -> None:
        super().__init__()
        self.rank0 = rank0

    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == 1:
            raise PlantedError("planted failure on rank 1")
        if batch_idx == 1 and self.rank0 == "stalls":
            time.sleep(300)
        return super().training_step(batch, batch_idx)


class SaysItSawTheError(Callback):
    """A user's callback after ``RankFailureWatch``, which closes a file or logs the error in ``on_exception``."""

    def on_exception(self, trainer, pl_module, exception):
        print(f"on_exception after the watch: {type(exception).__name__}", flush=True)


if __name__ == "__main__":
    root, rank0 = sys.argv[1:]
    if rank0 not in RANK0:
        raise ValueError(f"RANK0={rank0!r} is not one of {RANK0}")
    trainer = pl.Trainer(default_root_dir=root, accelerator="cpu", strategy="ddp", num_nodes=2, devices=1,
                         max_steps=3, callbacks=[RankFailureWatch(), SaysItSawTheError()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(FailingRegression(rank0))
