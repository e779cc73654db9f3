"""A Lightning project of its own (no ``lit-grpo``), for the tests of several processes: ``python
plain_ddp_callbacks.py OUT SOURCE`` fits 4 steps on 2 nodes x 1 process over gloo with ``FitSummary``,
``RolloutProfiler`` and ``CompletionLogger``, counting the strategy's ``all_gather`` calls by training batch, and
writes what each rank saw to ``OUT/rank<R>.json``. SOURCE is one of ``SOURCES``:

- ``plain``: a regression module, its batches tensors (no rollouts, no datamodule);
- ``declared``: hand-built rollouts from a datamodule that declares them (``yields_rollouts = True``), each rank
  its own share (Lightning's distributed sampler);
- ``undeclared``: the same rollouts from the module's own loader, which declares nothing."""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
from callback_helpers import RolloutModule, TinyRegression, make_rollout
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy

from lit_grpo.callbacks import CompletionLogger, FitSummary, RolloutProfiler

SOURCES = ("plain", "declared", "undeclared")
STEPS = 4


class CountingDDP(DDPStrategy):
    """DDP that counts its ``all_gather`` calls."""

    gathers = 0

    def all_gather(self, *args, **kwargs):
        self.gathers += 1
        return super().all_gather(*args, **kwargs)


class DeclaredRollouts(pl.LightningDataModule):
    """A data module of a project's own that yields rollouts, and says so."""

    yields_rollouts = True

    def __init__(self, module: RolloutModule) -> None:
        super().__init__()
        self.module = module

    def train_dataloader(self):
        return self.module.train_dataloader()


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call, on every rank, by step."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.setdefault(step, {}).update({key: float(value) for key, value in metrics.items()})


class Record(pl.Callback):
    """After the other callbacks: the strategy's gathers so far at each training batch, and the batch's rollout."""

    def __init__(self) -> None:
        self.gathers_by_batch: list[int] = []
        self.generated_tokens: list[int] = []
        self.lengths: list[list[int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.gathers_by_batch.append(trainer.strategy.gathers)
        if hasattr(batch, "stats"):
            self.generated_tokens.append(batch.stats.generated_tokens)
            self.lengths.append(batch.completion_lengths.flatten().tolist())


if __name__ == "__main__":
    out, source = sys.argv[1:]
    if source not in SOURCES:
        raise ValueError(f"SOURCE={source!r} is not one of {SOURCES}")
    record, logger = Record(), RecordingLogger()
    summary = FitSummary(validate_before_training=False)
    trainer = pl.Trainer(default_root_dir=out, accelerator="cpu", strategy=CountingDDP(), num_nodes=2, devices=1,
                         max_steps=STEPS, log_every_n_steps=1, logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[summary, RolloutProfiler(progress_bar=False, read_bytes_per_s=1e9),
                                    CompletionLogger(), record])
    if source == "plain":
        trainer.fit(TinyRegression())
    else:
        module = RolloutModule([make_rollout(seed) for seed in range(2 * STEPS)])
        trainer.fit(module, datamodule=DeclaredRollouts(module) if source == "declared" else None)
    figures = [{key: value for key, value in metrics.items() if key.startswith(("rollout/", "completions/"))}
               for _, metrics in sorted(logger.logged.items())]
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "gathers_by_batch": record.gathers_by_batch, "generated_tokens": record.generated_tokens,
        "lengths": record.lengths, "logged": [metrics for metrics in figures if metrics],
        "summary_generated_tokens": summary.rollout_totals.generated_tokens, "summary_rollouts": summary.rollouts}))
