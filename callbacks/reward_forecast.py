"""Forecast where the reward curve plateaus during training, and optionally stop when little gain is left.

The curve fitting (an exponential saturation and a logistic, after Predictive Scaling Laws for GRPO,
arXiv 2507.18014) is in ``reward_curve.py``; this file is the callback that feeds it the logged rewards.
"""

from __future__ import annotations

import ast
import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_grpo.runtime.validation import (check_bool, check_choice, check_int, check_real, check_state_keys, check_text,
                                         shown_setting)

from ._rollout import accumulating, log_metrics, logger_step
from .reward_curve import CRITERIA, Criterion, Forecast, check_reward_range, forecast_plateau


class RewardForecast(Callback):
    r"""Forecasts the reward plateau from the running reward curve; optionally stops training once reached.

    Every training step it records ``(step, trainer.callback_metrics[monitor])`` (a value logged in
    ``training_step``; ``<monitor>_step`` is preferred when the module logs both on_step and on_epoch; under
    gradient accumulation the value of the batch that ends the step). Every
    ``check_every_n_steps`` steps, once ``min_points`` points are in, it fits an exponential saturation and a
    logistic (:func:`forecast_plateau`) and logs the better fit's forecast where its plateau is in sight.

    **Logged keys** (at each check whose plateau is in sight)

    - ``forecast/plateau_reward``: the predicted plateau Rmax.
    - ``forecast/step_to_plateau``: the step at which 95% of the predicted gain (from the first recorded reward to
      Rmax) is reached, on the same step axis as the logged scalars.
    - ``forecast/remaining_gain``: Rmax minus the fitted reward now.

    In sight: the plateau lies no farther from the fitted reward now than the fitted curve has moved since the
    first recorded step (``|remaining_gain| <= |observed_gain|``), so a logged forecast extrapolates at most as far
    again as the curve has come. A fit that puts it farther (a curve still rising straight, or a shape fitted to
    the noise of a few readings, which can send Rmax up to ten times the readings' range away) logs nothing at
    that check; ``last_forecast`` still holds it. The three keys are logged together or not at all.

    With ``stop=True``, training stops (``trainer.should_stop``, agreed across ranks) after ``patience``
    consecutive checks whose plateau is in sight (each one logged) where the curve has visibly risen
    (``Forecast.rise_seen``: the fitted rise exceeds twice the noise of one reward reading, the fit beats a flat
    line at the 0.1% level and the last quarter of readings lies above the first; during a flat slow start no fit
    can see the rise to come) and ``remaining_gain < min_delta``. A run whose reward never rises is therefore
    rarely stopped by this callback: its noise passes for a rise in about 1% of runs at most (checked every step).
    ``stopped_step`` tells where it stopped. The history and the patience count survive checkpoints
    (``state_dict``; a corrupt one is refused naming the bad key or value, before any of it is taken); a resume
    with other settings (``stop`` turned on, another ``patience``) goes on from the history of the checkpoint's one
    forecast of the same ``monitor``, its checks starting over (``on_load_checkpoint``).

    Under several processes every rank holds the same state: the recorded value is the monitored one averaged over
    the ranks (one small all-reduce per batch; unchanged when the module logs it reduced already), and each check's
    plateau verdict is rank 0's (broadcast), so the patience count and the stop agree on every rank.

    The monitored value must be logged at every training step: ``callback_metrics`` keeps the last value, which
    would be recorded again at steps that did not log it. A monitor still unlogged at the first check is warned
    about once, naming the logged keys, and so is one that a validation logs and the training steps do not (a
    ``val/`` value). Bad settings (a criterion, a reward range that is not ``low < high``, a negative
    ``min_delta``) are refused when the callback is built.

    Args:
        monitor: the reward metric, as logged.
        min_delta: remaining gain below which the curve counts as plateaued (reward units).
        patience: consecutive plateaued checks before stopping.
        stop: stop training, or only log the forecast.
        min_points: recorded points needed before the first fit.
        check_every_n_steps: steps between two fits.
        criterion: ``"bic"`` or ``"aic"``, the penalized criterion that picks the shape.
        reward_range: known (min, max) of the reward, bounds the plateau (e.g. ``(0.0, 1.0)``).
    """

    def __init__(
        self,
        monitor: str = "reward/mean",
        min_delta: float = 0.01,
        patience: int = 3,
        stop: bool = False,
        min_points: int = 20,
        check_every_n_steps: int = 10,
        criterion: Criterion = "bic",
        reward_range: tuple[float, float] | None = None,
    ) -> None:
        check_text("monitor", monitor)
        check_bool("stop", stop)  # "false" would be truthy: the callback would stop training
        check_choice("criterion", criterion, CRITERIA)
        patience = check_int("patience", patience, 1)
        check_every_n_steps = check_int("check_every_n_steps", check_every_n_steps, 1)
        min_points = check_int("min_points", min_points, 5)
        self.monitor = monitor
        self.min_delta = check_real("min_delta", min_delta, low=0)
        self.patience = patience
        self.stop = stop
        self.min_points = min_points
        self.check_every_n_steps = check_every_n_steps
        self.criterion = criterion
        self.reward_range = check_reward_range(reward_range)
        self._start()
        self._warned_missing = False
        self._warned_validation = False
        self._before_validation: float | None = None  # the monitor's value when the validation under way started
        self._left_by_validation: float | None = None  # what the last validation logged, until a batch ends

    def _start(self) -> None:
        """No points and no decision yet: at construction and when a fit starts (a resumed one then loads its
        checkpoint's state)."""
        self.steps: list[float] = []
        self.rewards: list[float] = []
        self.wait_count = 0
        self.stopped_step: int | None = None
        self.last_forecast: Forecast | None = None
        self._last_checked_step: int | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._start()

    @property
    def state_key(self) -> str:
        """Unique per setting, as ModelCheckpoint's: two differently configured forecasts restore their own state."""
        return self._generate_state_key(
            monitor=self.monitor, min_delta=self.min_delta, patience=self.patience, stop=self.stop,
            min_points=self.min_points, check_every_n_steps=self.check_every_n_steps, criterion=self.criterion,
            reward_range=self.reward_range)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._check_not_validations(trainer)
        if accumulating(trainer, batch_idx):  # one point per optimizer step: its last batch's
            return
        value = self._over_ranks(trainer, pl_module, self._monitored_value(trainer))
        step = logger_step(trainer)
        if value is not None:
            self.steps.append(float(step))
            self.rewards.append(value)
        # Checks key on the optimizer step, not the batch: with gradient accumulation one step spans several
        # batches and is checked once. Every rank checks at the same steps, so the stop decision's collective
        # call never waits for a rank that skipped it.
        if step % self.check_every_n_steps or step == self._last_checked_step:
            return
        self._last_checked_step = step
        if not self.rewards and not self._warned_missing:  # a misspelled or foreign monitor: never fits, never stops
            self._warned_missing = True
            rank_zero_warn(f"RewardForecast: monitor={self.monitor!r} has not been logged by step {step}, so nothing "
                           f"is forecast (or stopped); logged keys: {sorted(trainer.callback_metrics)}")
        forecast = self._forecast(trainer)
        plateaued = (forecast is not None and forecast.rise_seen and forecast.in_sight
                     and forecast.remaining_gain < self.min_delta)
        if trainer.world_size > 1:  # rank 0's verdict: the patience count is the same on every rank by construction
            plateaued = bool(trainer.strategy.broadcast(plateaued, src=0))
        self.wait_count = self.wait_count + 1 if plateaued else 0
        if self.stop:
            self._maybe_stop(trainer, forecast)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._before_validation = _value(trainer.callback_metrics.get(self.monitor))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        logged = _value(trainer.callback_metrics.get(self.monitor))
        if logged is not None and logged != self._before_validation:  # this validation logged the monitor
            self._left_by_validation = logged

    def _check_not_validations(self, trainer: pl.Trainer) -> None:
        """Say once where the monitor is a validation's value that the training step left as it was: it stays in
        ``callback_metrics`` until the next validation, so every training step would record it again. By value
        (``callback_metrics`` may hold a new tensor of the same value): a training step that logs the same key
        writes its own."""
        left, self._left_by_validation = self._left_by_validation, None
        metrics = trainer.callback_metrics
        if (left is None or self._warned_validation or f"{self.monitor}_step" in metrics
                or _value(metrics.get(self.monitor)) != left):
            return
        self._warned_validation = True
        rank_zero_warn(f"RewardForecast: monitor={self.monitor!r} is logged in validation, not at every training "
                       "step: each step records its last validation's value again, and the forecast fits that "
                       "staircase; monitor a value the module logs in training_step")

    def _monitored_value(self, trainer: pl.Trainer) -> float | None:
        metrics = trainer.callback_metrics
        for key in (f"{self.monitor}_step", self.monitor):
            if key in metrics:
                value = float(metrics[key])
                return value if math.isfinite(value) else None
        return None

    @staticmethod
    def _over_ranks(trainer: pl.Trainer, pl_module: pl.LightningModule, value: float | None) -> float | None:
        """The monitored value averaged over the ranks (several processes: one small all-reduce per batch; a value
        missing or not finite on any rank is None on every rank), so every rank records the same history. A metric
        the module already reduced over the ranks passes unchanged; one process runs no collective."""
        if trainer.world_size <= 1:
            return value
        local = torch.tensor(math.nan if value is None else value, dtype=torch.float64, device=pl_module.device)
        mean = float(trainer.strategy.reduce(local, reduce_op="mean"))
        return mean if math.isfinite(mean) else None

    def _forecast(self, trainer: pl.Trainer) -> Forecast | None:
        """Fit the history and log the forecast where its plateau is in sight; None before ``min_points`` points
        or when no fit converges."""
        if len(self.rewards) < self.min_points:
            return None
        forecast = forecast_plateau(self.steps, self.rewards, self.criterion, reward_range=self.reward_range)
        if forecast is None:
            return None
        self.last_forecast = forecast
        if not forecast.in_sight:  # nothing to chart
            return forecast
        # Logged at every check, whatever log_every_n_steps: the checks have their own cadence.
        log_metrics(trainer, {
            "forecast/plateau_reward": forecast.plateau_reward,
            "forecast/step_to_plateau": forecast.step_to_plateau,
            "forecast/remaining_gain": forecast.remaining_gain,
        }, self, every_log_step=False)
        return forecast

    def _maybe_stop(self, trainer: pl.Trainer, forecast: Forecast | None) -> None:
        should_stop = trainer.strategy.reduce_boolean_decision(self.wait_count >= self.patience, all=False)
        if not should_stop or trainer.should_stop:
            return
        trainer.should_stop = True
        self.stopped_step = logger_step(trainer)
        reason = "" if forecast is None else (
            f" to plateau at {forecast.plateau_reward:.4g} ({forecast.fit.model} fit); remaining gain "
            f"{forecast.remaining_gain:.3g} < min_delta {self.min_delta}")
        rank_zero_info(f"RewardForecast: {self.monitor} is forecast{reason} for {self.wait_count} checks. "
                       f"Stopping at step {self.stopped_step}.")

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "rewards": list(self.rewards), "wait_count": self.wait_count,
                "stopped_step": self.stopped_step}

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """A resume with other settings (``stop`` turned on, another ``patience``) finds no state under this
        forecast's key: the one forecast of the same ``monitor`` the checkpoint holds gives its reward history
        (the checks start over), rather than a forecast that restarts from nothing, unnoticed."""
        saved = checkpoint.get("callbacks") or {}
        if self.state_key in saved:
            return
        same_monitor = [key for key in saved if _forecast_monitor(key) == self.monitor]
        if len(same_monitor) == 1:
            state = saved[same_monitor[0]]
            self.load_state_dict({**state, "wait_count": 0, "stopped_step": None})
            rank_zero_info(f"RewardForecast: the checkpoint's {self.monitor} history ({len(self.steps)} points) was "
                           "saved under other settings; it goes on from it, its checks start over")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take ``state_dict`` (``state_dict``'s, from a checkpoint), checked whole first: a corrupt or foreign one is
        refused naming the bad key or value, and leaves the forecast as it was."""
        # stopped_step: absent from a state saved by hand, taken as not stopped
        check_state_keys("a RewardForecast state", state_dict, ("steps", "rewards", "wait_count", "stopped_step"),
                         ("stopped_step",))
        steps, rewards = (_numbers(f"forecast state {name}", state_dict[name]) for name in ("steps", "rewards"))
        if len(steps) != len(rewards):
            raise ValueError(f"forecast state steps and rewards must be as long as each other (one reward per step), "
                             f"not {len(steps)} and {len(rewards)}")
        wait_count = check_int("forecast state wait_count", state_dict["wait_count"], 0)
        stopped = check_int("forecast state stopped_step", state_dict.get("stopped_step"), 0, none="not stopped")
        self.steps, self.rewards, self.wait_count, self.stopped_step = steps, rewards, wait_count, stopped


def _numbers(name: str, values: Any) -> list[float]:
    """``values`` as plain floats if it is a list of finite numbers, else a ValueError naming the bad one."""
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{shown_setting(name, values, 80)} must be a list of numbers")
    return [check_real(f"{name}[{index}]", value) for index, value in enumerate(values)]


def _value(logged: Any) -> float | None:
    """A logged metric's value as a float (None: not logged)."""
    return None if logged is None else float(logged)


def _forecast_monitor(state_key: str) -> str | None:
    """The ``monitor`` of a RewardForecast's checkpoint key (``RewardForecast{'monitor': ..., ...}``); None for
    another callback's."""
    prefix = f"{RewardForecast.__qualname__}{{"
    if not state_key.startswith(prefix):
        return None
    try:
        return ast.literal_eval(state_key[len(RewardForecast.__qualname__):]).get("monitor")
    except (ValueError, SyntaxError, AttributeError):
        return None
