"""Every public callback of lit_grpo.callbacks in a Lightning project with no lit_grpo part: Lightning's own
BoringModel, a tiny LightningDataModule, a CSVLogger, a short fit and a validation. Each either logs the keys it can
measure there (each named by its docstring), or says once why it cannot, or refuses with an error naming what it
needs; none fails on a plain module's batch."""

from __future__ import annotations

import csv
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from test_logged_keys import LOGS_NOTHING, docstring_keys, matches
from torch.utils.data import DataLoader

from lit_grpo import callbacks

MiB = 1 << 20
#: Training steps of each fit, a validation every VAL_EVERY of them.
STEPS, VAL_EVERY = 6, 3
#: What the module logs itself (and the CSVLogger's step column), beside a callback's keys.
MODULE_KEYS = {"reward/mean", "val/accuracy", "epoch", "step"}


class TinyData(pl.LightningDataModule):
    """A LightningDataModule of Lightning's random vectors: 8 training batches, 2 validation batches."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 16), batch_size=2)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 4), batch_size=2)


class LoggingBoringModel(BoringModel):
    """BoringModel that logs a reward of its own (a curve that saturates: 0.2, 0.36, ...) at every training step and
    an accuracy in validation, as a project of its own would."""

    def training_step(self, batch, batch_idx):
        self.log("reward/mean", 1.0 - 0.8 ** (self.global_step + 1))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("val/accuracy", -super().validation_step(batch, batch_idx)["x"])


class RecordingCSVLogger(CSVLogger):
    """A CSVLogger that also keeps every write: (stage, step, metrics)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.writes: list[tuple[str, int | None, dict]] = []
        self.stage = "fit"

    def log_metrics(self, metrics, step=None) -> None:
        self.writes.append((self.stage, step, dict(metrics)))
        super().log_metrics(metrics, step)

    def keys(self, stage: str | None = None) -> set[str]:
        return {key for written, _, metrics in self.writes if stage in (None, written) for key in metrics}


@dataclass
class Run:
    trainer: pl.Trainer
    logger: RecordingCSVLogger
    said: list[str]  # the callback's warnings, by its class name
    out: str

    def steps_of(self, key: str) -> list[int]:
        return [step for stage, step, metrics in self.logger.writes if stage == "fit" and key in metrics]

    def csv_columns(self) -> set[str]:
        with open(Path(self.logger.log_dir) / "metrics.csv", newline="") as file:
            return set(next(csv.reader(file)))


def fit_and_validate(tmp_path: Path, callback: Callback, capsys, module: type[BoringModel] = LoggingBoringModel) -> Run:
    """A fit of ``STEPS`` steps with ``callback`` alone and a CSVLogger, validating every ``VAL_EVERY`` steps, then a
    validation of the trained module."""
    pl.seed_everything(0)
    logger = RecordingCSVLogger(tmp_path)
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=STEPS, val_check_interval=VAL_EVERY, accelerator="cpu",
                         logger=logger, callbacks=[callback], log_every_n_steps=1, enable_model_summary=False,
                         enable_checkpointing=isinstance(callback, pl.callbacks.ModelCheckpoint),
                         enable_progress_bar=isinstance(callback, pl.callbacks.ProgressBar))
    name = type(callback).__name__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = module()
        trainer.fit(model, datamodule=TinyData())
        logger.stage = "validate"
        trainer.validate(model, datamodule=TinyData())
    said = [str(w.message) for w in caught if str(w.message).startswith(f"{name}:")]
    return Run(trainer, logger, said, capsys.readouterr().out)


# ----------------------------------------------------------------------------------------------------------------
# One case per public callback: what it does on the plain module
# ----------------------------------------------------------------------------------------------------------------


def _peak_memory(run: Run, callback: callbacks.PeakMemoryMonitor) -> None:
    assert callback.method in ("hwm+sampling", "sampling")
    peaks = [metrics["memory/step_peak_bytes"] for stage, _, metrics in run.logger.writes
             if "memory/step_peak_bytes" in metrics]
    assert len(peaks) == STEPS and min(peaks) > 10 * MiB  # a Python process with torch holds far more
    assert callback.max_logged["memory/step_peak_bytes"] == max(peaks)


def _forecast(run: Run, callback: callbacks.RewardForecast) -> None:
    # one point a step, from the module's own reward; a forecast from the fifth point on, its three keys together
    assert callback.steps == [float(step) for step in range(STEPS)]
    assert callback.rewards == pytest.approx([1.0 - 0.8 ** (step + 1) for step in range(STEPS)])
    steps = run.steps_of("forecast/plateau_reward")
    assert steps and min(steps) >= 4
    assert steps == run.steps_of("forecast/step_to_plateau") == run.steps_of("forecast/remaining_gain")
    assert callback.last_forecast.plateau_reward == pytest.approx(1.0, abs=0.05)


def _summary(run: Run, callback: callbacks.FitSummary) -> None:
    # a validation before the first step, then every VAL_EVERY steps; the module's own reward curve. The
    # trainer.validate after the fit is no point of the fit's curve (it was recorded as "after step 7")
    assert [step for step, _ in callback.accuracy] == [0, 3, 6]
    assert callback.steps == STEPS and len(callback.rewards) == STEPS
    assert f"lit_grpo: {STEPS} steps in" in run.out
    assert "val/accuracy" in run.out and "(before training -> after step 6)" in run.out
    rewards = [1.0 - 0.8 ** (step + 1) for step in range(STEPS)]
    first, last = sum(rewards[:3]) / 3, sum(rewards[3:]) / 3
    assert f"reward/mean    {first:.3f} -> {last:.3f}   (mean of the first 3 steps -> the last 3)" in run.out
    assert "rollout time" not in run.out  # no rollouts: no line about them
    # where the logs are, with a logger other than TensorBoard's too (its folder was not named)
    assert f"  logs           {run.logger.log_dir} (RecordingCSVLogger)\n" in run.out


def _checkpoint(run: Run, callback: callbacks.RunCheckpoint) -> None:
    last = Path(run.logger.log_dir) / "checkpoints" / "last.ckpt"
    assert last.is_file() and callback.last_model_path == str(last)
    assert callback.saves >= 3  # every 2 steps and after every validation, each step once
    pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False).validate(
        LoggingBoringModel(), datamodule=TinyData(), ckpt_path=str(last))


def _progress_bar(run: Run, callback: callbacks.GRPOProgressBar) -> None:
    bar = callback.train_progress_bar
    assert (bar.n, bar.total, bar.unit) == (STEPS, STEPS, "step")  # optimizer steps out of max_steps
    assert "reward=" in bar.postfix and "v_num" not in bar.postfix


def _rank_failure_watch(run: Run, callback: callbacks.RankFailureWatch) -> None:
    assert callback._stop is None  # one process: no watch started


def _says_it_has_no_rollouts(run: Run, callback: Callback) -> None:
    # once, and how a project of its own gets its rollouts to it: the engine's stats on the batch
    (said,) = run.said
    assert "batch.stats" in said and "RolloutEngine.generate" in said, said


@dataclass
class Case:
    make: Callable[[], Callback]
    keys: set[str] = field(default_factory=set)  # what it logs on the plain module
    says: int = 0  # warnings it gives there
    check: Callable[[Run, Callback], None] | None = None


CASES = {
    "PeakMemoryMonitor": Case(callbacks.PeakMemoryMonitor,
                              {"memory/step_peak_bytes", "memory/step_peak_delta_bytes"}, check=_peak_memory),
    "RolloutProfiler": Case(callbacks.RolloutProfiler, says=1, check=_says_it_has_no_rollouts),
    "CompletionLogger": Case(callbacks.CompletionLogger, says=1, check=_says_it_has_no_rollouts),
    "SlotTimelineLogger": Case(lambda: callbacks.SlotTimelineLogger(every_n_steps=1), says=1,
                               check=_says_it_has_no_rollouts),
    "RewardForecast": Case(lambda: callbacks.RewardForecast(min_points=5, check_every_n_steps=1),
                           {"forecast/plateau_reward", "forecast/step_to_plateau", "forecast/remaining_gain"},
                           check=_forecast),
    "FitSummary": Case(callbacks.FitSummary, check=_summary),
    "RunCheckpoint": Case(lambda: callbacks.RunCheckpoint(every_n_train_steps=2), check=_checkpoint),
    "GRPOProgressBar": Case(callbacks.GRPOProgressBar, check=_progress_bar),
    "RankFailureWatch": Case(callbacks.RankFailureWatch, check=_rank_failure_watch),
    # ExportModel refuses a module without a policy and a tokenizer: test_export_model_refuses_a_plain_module
}


def test_every_public_callback_has_a_case_here():
    public = {name for name in callbacks.__all__
              if isinstance(getattr(callbacks, name), type) and issubclass(getattr(callbacks, name), Callback)}
    assert public == {*CASES, "ExportModel"}


@pytest.mark.parametrize("name", CASES)
def test_a_callback_on_a_plain_boring_model(tmp_path, capsys, name):
    case = CASES[name]
    callback = case.make()
    run = fit_and_validate(tmp_path, callback, capsys)
    logged = run.logger.keys() - MODULE_KEYS
    assert logged == case.keys
    assert run.logger.keys("validate") - MODULE_KEYS == set()  # a validation is no training step
    assert logged <= run.csv_columns()  # written to the CSV file, not only handed to the logger
    # each key it logs there is one its docstring lists; one that lists none says that it logs nothing
    listed = docstring_keys(type(callback))
    if listed is None:
        assert LOGS_NOTHING.search(type(callback).__doc__), name
    else:
        assert {key for key in logged if not matches(key, listed)} == set()
    assert len(run.said) == case.says, run.said
    if case.check is not None:
        case.check(run, callback)


def test_export_model_refuses_a_plain_module_before_training_naming_what_it_needs(tmp_path, capsys):
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=STEPS, accelerator="cpu", logger=False,
                         callbacks=[callbacks.ExportModel()], enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"^ExportModel exports a module's policy and tokenizer \(as GRPOModule "
                                         r"holds them\); BoringModel has no policy or tokenizer$"):
        trainer.fit(BoringModel(), datamodule=TinyData())
    assert trainer.global_step == 0
    # a validation exports nothing, so it has nothing to refuse
    trainer.validate(BoringModel(), datamodule=TinyData())


def test_a_forecast_of_a_reward_the_module_never_logs_says_so_naming_the_logged_keys(tmp_path, capsys):
    """Lightning's BoringModel as it is logs nothing: the default monitor, reward/mean, is never there."""
    forecast = callbacks.RewardForecast(min_points=5, check_every_n_steps=1)
    run = fit_and_validate(tmp_path, forecast, capsys, module=BoringModel)
    assert run.said == ["RewardForecast: monitor='reward/mean' has not been logged by step 0, so nothing is forecast "
                        "(or stopped); logged keys: []"]
    assert forecast.rewards == [] and run.logger.keys() == set()


@pytest.mark.parametrize("make, keys", [
    (callbacks.PeakMemoryMonitor, ["memory/step_peak_bytes", "memory/step_peak_delta_bytes"]),
    (lambda: callbacks.RewardForecast(min_points=5, check_every_n_steps=1),
     ["forecast/plateau_reward", "forecast/remaining_gain", "forecast/step_to_plateau"]),
], ids=["PeakMemoryMonitor", "RewardForecast"])
def test_a_callback_with_no_logger_for_its_keys_says_so_once(tmp_path, make, keys):
    """Trainer(logger=False): what the callback measured has nowhere to go, said once, naming the keys (it went
    unsaid: every step's figures dropped without a word)."""
    callback = make()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=STEPS, accelerator="cpu", logger=False,
                         callbacks=[callback], log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    name = type(callback).__name__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.seed_everything(0)
        trainer.fit(LoggingBoringModel(), datamodule=TinyData())
    said = [str(w.message) for w in caught if str(w.message).startswith(f"{name}:")]
    assert said == [f"{name}: the trainer has no logger (Trainer(logger=False)), so none of the figures it logs is "
                    f"written (such as {keys}); give the Trainer a logger (a CSVLogger will do) to keep them"]


def test_the_no_logger_warning_says_every_figure_is_lost_not_only_the_first_steps_keys():
    """A callback's first due step may log fewer keys than later ones (RolloutProfiler's decision counts come with
    the steps that decide): the one warning says none of its figures is written, the first keys as examples,
    where it read as the complete list of what is lost."""
    from types import SimpleNamespace

    from lit_grpo.callbacks._rollout import log_metrics

    trainer, callback = SimpleNamespace(loggers=[]), callbacks.RolloutProfiler()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log_metrics(trainer, {"rollout/decode_steps": 3.0}, callback, every_log_step=False)
        log_metrics(trainer, {"rollout/decode_steps": 4.0, "rollout/decisions/start_arrival": 1.0}, callback,
                    every_log_step=False)
    assert [str(w.message) for w in caught] == [
        "RolloutProfiler: the trainer has no logger (Trainer(logger=False)), so none of the figures it logs is written "
        "(such as ['rollout/decode_steps']); give the Trainer a logger (a CSVLogger will do) to keep them"]
