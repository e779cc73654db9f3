"""RewardForecast: plateau recovery on noisy planted curves, early stop where the curve flattens, checkpoints."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import numpy as np
import pytest
import scipy.stats
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

from lit_grpo.callbacks import RewardForecast, forecast_plateau
from lit_grpo.callbacks import reward_curve
from lit_grpo.callbacks import reward_forecast as reward_forecast_module
from lit_grpo.callbacks.reward_curve import CurveFit, Forecast, bin_means, exp_saturation, logistic

STEPS = np.arange(800, dtype=float)
NOISE = 0.03


def saturating(t: np.ndarray) -> np.ndarray:
    """Planted exponential saturation: 0.2 -> 0.8, lambda = 1/100. Its gain left drops below 0.01 at t = 409."""
    return exp_saturation(t, 0.2, 0.8, 1 / 100)


def sigmoid_shaped(t: np.ndarray) -> np.ndarray:
    """Planted logistic: 0.1 -> 0.7, slow start, steepest at t = 250. Gain left drops below 0.01 at t = 386."""
    return logistic(t, 0.1, 0.7, 0.03, 250)


def noisy(curve, seed: int) -> np.ndarray:
    return curve(STEPS) + np.random.default_rng(seed).normal(0.0, NOISE, STEPS.size)


# ----------------------------------------------------------------------------------------------------------------
# Pure fitting
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "curve, plateau, seen_until, step_95",
    [(saturating, 0.8, 300, 100 * math.log(20)), (sigmoid_shaped, 0.7, 360, 250 + math.log(19) / 0.03)],
    ids=["exp_saturation", "logistic"],
)
def test_forecast_recovers_the_planted_plateau(seed, curve, plateau, seen_until, step_95):
    # The curve is seen up to ~95% of its rise; the plateau itself is extrapolated.
    rewards = noisy(curve, seed)[:seen_until]
    forecast = forecast_plateau(STEPS[:seen_until], rewards)
    assert forecast.plateau_reward == pytest.approx(plateau, rel=0.05)
    assert forecast.step_to_plateau == pytest.approx(step_95, rel=0.10)
    assert forecast.remaining_gain == pytest.approx(plateau - curve(seen_until - 1), abs=0.03)
    assert forecast.noise_std == pytest.approx(NOISE, rel=0.2)
    assert forecast.rise_seen


def test_criterion_picks_the_logistic_for_a_slow_start_and_penalizes_its_extra_parameter():
    forecast = forecast_plateau(STEPS[:400], noisy(sigmoid_shaped, 0)[:400])
    assert forecast.fit.model == "logistic"
    # Equal residuals: the 4-parameter logistic must lose to the 3-parameter exponential under both criteria.
    exp = CurveFit("exp_saturation", (0.0, 1.0, 0.1), rss=1.0, num_points=100)
    log = CurveFit("logistic", (0.0, 1.0, 0.1, 5.0), rss=1.0, num_points=100)
    for criterion in ("aic", "bic"):
        assert exp.information_criterion(criterion) < log.information_criterion(criterion)


def test_the_criteria_are_gaussian_aic_and_bic():
    fit = CurveFit("exp_saturation", (0.0, 1.0, 0.1), rss=1.0, num_points=100)
    assert fit.information_criterion("aic") == pytest.approx(100 * math.log(0.01) + 2 * 3)
    assert fit.information_criterion("bic") == pytest.approx(100 * math.log(0.01) + 3 * math.log(100))


def test_the_criterion_not_the_residuals_alone_picks_the_shape():
    # on a short stretch of a saturating curve the logistic's extra parameter buys a slightly smaller residual
    forecast = forecast_plateau(STEPS[:100], noisy(saturating, 0)[:100])
    exp, log = sorted(forecast.candidates, key=lambda fit: fit.model != "exp_saturation")
    assert log.rss < exp.rss and forecast.fit is exp


@pytest.mark.parametrize("fit", [CurveFit("exp_saturation", (0.2, 0.8, 0.05), rss=0.0, num_points=10),
                                 CurveFit("logistic", (0.1, 0.7, 1.0, 1.0), rss=0.0, num_points=10)],
                         ids=["exp_saturation", "logistic"])
def test_time_to_fraction_is_where_the_fit_covers_that_share_of_its_rise(fit):
    # from the fitted reward at the first step to the plateau, whether the curve starts flat or not
    start = float(fit.predict(0.0))
    for fraction in (0.5, 0.95):
        t = fit.time_to_fraction(fraction)
        assert float(fit.predict(t)) - start == pytest.approx(fraction * (fit.plateau - start))


def test_forecast_handles_degenerate_input():
    assert forecast_plateau([0, 1, 2], [0.1, 0.2, 0.3]) is None  # too few points
    flat = forecast_plateau(STEPS[:200], np.full(200, 0.4))
    assert flat.plateau_reward == pytest.approx(0.4, abs=1e-6) and not flat.rise_seen
    # A still-straight line has no plateau in sight: a large remaining gain, not a stop.
    straight = forecast_plateau(STEPS[:200], 0.1 + 0.002 * STEPS[:200])
    assert straight.remaining_gain > 0.2
    # Known reward range bounds the extrapolation.
    bounded = forecast_plateau(STEPS[:200], 0.1 + 0.002 * STEPS[:200], reward_range=(0.0, 1.0))
    assert bounded.plateau_reward <= 1.0


def test_a_forecast_needs_five_distinct_steps_and_counts_them_from_the_first():
    assert forecast_plateau([0, 0, 1, 1, 2, 2, 3, 3], [0.1, 0.1, 0.2, 0.2, 0.3, 0.3, 0.35, 0.35]) is None
    rewards = noisy(saturating, 0)[:300]
    here, later = forecast_plateau(STEPS[:300], rewards), forecast_plateau(STEPS[:300] + 1000, rewards)
    assert later.step_to_plateau == pytest.approx(here.step_to_plateau + 1000)  # on the steps' own axis
    assert later.plateau_reward == pytest.approx(here.plateau_reward)


def test_a_rise_is_seen_beyond_twice_the_noise_of_a_reading():
    fit = CurveFit("exp_saturation", (0.0, 1.0, 0.1), rss=1.0, num_points=100)

    def forecast(observed_gain: float) -> Forecast:
        return Forecast(plateau_reward=1.0, step_to_plateau=30.0, remaining_gain=0.0, observed_gain=observed_gain,
                        noise_std=0.1, fit=fit, candidates=(fit,))

    assert not forecast(0.15).rise_seen and forecast(0.25).rise_seen


def test_a_rise_needs_the_fit_to_beat_a_flat_line_and_the_readings_to_show_it():
    fit = CurveFit("exp_saturation", (0.0, 1.0, 0.1), rss=1.0, num_points=100)

    def forecast(flat_p_value: float, readings_rise_z: float) -> Forecast:
        return Forecast(plateau_reward=1.0, step_to_plateau=30.0, remaining_gain=0.0, observed_gain=0.25,
                        noise_std=0.1, fit=fit, candidates=(fit,), flat_p_value=flat_p_value,
                        readings_rise_z=readings_rise_z)

    assert forecast(1e-4, 2.5).rise_seen
    assert not forecast(1e-2, 2.5).rise_seen and not forecast(1e-4, 1.5).rise_seen


def test_flat_noise_is_not_a_rise():
    # the fitted rise alone exceeds two readings' noise on about 5 of these 100 flat curves
    seen = [seed for seed in range(100)
            if forecast_plateau(STEPS[:40], 0.3 + np.random.default_rng(seed).normal(0.0, 0.05, 40)).rise_seen]
    assert seen == []


def test_one_outlying_first_reading_is_not_a_rise():
    rewards = 0.3 + np.random.default_rng(0).normal(0.0, 0.02, 40)
    rewards[0] = 0.2  # five readings' noise low: a saturation within one step fits it, at every later check
    forecast = forecast_plateau(STEPS[:40], rewards)
    assert forecast.observed_gain > 2 * forecast.noise_std and forecast.flat_p_value < 1e-3
    assert not forecast.rise_seen


def test_a_short_flat_curve_checked_at_every_step_never_plateaus():
    # the earliest stops the callback allows (min_points=5, check_every_n_steps=1, patience=1): few readings fit
    # a shape closely, so their noise looks small next to the shape's rise
    for seed in range(8):
        rewards = 0.3 + np.random.default_rng(seed).normal(0.0, 0.05, 40)
        for n in range(5, 41):
            forecast = forecast_plateau(STEPS[:n], rewards[:n])
            assert not (forecast.rise_seen and forecast.remaining_gain < 0.01), (seed, n)


def test_the_flat_line_test_is_an_f_test_on_the_fitted_points():
    rng = np.random.default_rng(0)
    y = 0.1 * STEPS[:30] + rng.normal(0.0, 1.0, 30)
    fit = CurveFit("exp_saturation", (0.0, 1.0, 0.1), rss=20.0, num_points=30)
    flat_rss = float(np.sum((y - y.mean()) ** 2))
    statistic = (flat_rss - 20.0) / 2 / (20.0 / 27)
    assert reward_curve.flat_p_value(fit, y) == pytest.approx(scipy.stats.f.sf(statistic, 2, 27))
    assert reward_curve.flat_p_value(fit, np.full(30, 0.5)) == 1.0  # nothing varies: nothing to explain
    assert reward_curve.flat_p_value(CurveFit("exp_saturation", (0.0, 1.0, 0.1), 0.0, 30), y) == 0.0


def test_the_noise_leaves_out_the_fitted_parameters_degrees_of_freedom():
    steps = STEPS[:8]
    rewards = noisy(saturating, 4)[:8]
    forecast = forecast_plateau(steps, rewards)
    residuals = rewards - forecast.fit.predict(steps)
    assert forecast.noise_std == pytest.approx(math.sqrt(np.sum(residuals**2) / (8 - forecast.fit.num_params)))


def test_bin_means_keeps_long_histories_short():
    t, y = bin_means(np.arange(10_000.0), np.arange(10_000.0) % 2, max_points=100)
    assert len(t) == 100 and np.allclose(y, 0.5) and t[0] == pytest.approx(49.5)


def test_the_noise_is_one_readings_however_long_the_history():
    """Past MAX_FIT_POINTS the fit runs on bin means, whose spread is smaller than a reading's: the noise (which
    gates "a rise was seen") must still be a reading's."""
    rng = np.random.default_rng(0)
    for n in (1_000, 20_000):
        steps = np.linspace(0, 800, n)
        forecast = forecast_plateau(steps, saturating(steps) + rng.normal(0, NOISE, n))
        assert forecast.noise_std == pytest.approx(NOISE, rel=0.1), n


# ----------------------------------------------------------------------------------------------------------------
# The callback in a Trainer
# ----------------------------------------------------------------------------------------------------------------


class TrajectoryModule(pl.LightningModule):
    """Logs a planted reward curve, one value per step, as a GRPO module logs reward/mean."""

    def __init__(self, rewards: np.ndarray) -> None:
        super().__init__()
        self.rewards = rewards
        self.weight = torch.nn.Parameter(torch.zeros(()))

    def training_step(self, batch, batch_idx):
        self.log("reward/mean", float(self.rewards[self.global_step]))
        return self.weight**2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(len(self.rewards), 1)), batch_size=1)


#: ``run`` has no logger unless given one, on purpose (the tests read the forecast from the callback): the warning
#: that its figures are not written is expected there. A mark, not pytest.warns, which re-emits the other warnings
#: under another module's name, where pyproject's filters no longer drop Lightning's.
no_logger = pytest.mark.filterwarnings("ignore:RewardForecast. the trainer has no logger .Trainer.logger=False.., so "
                                       "none of the figures it logs is written:UserWarning")


def run(module: TrajectoryModule, forecast: RewardForecast, max_steps: int, root, logger=False, ckpt_path=None):
    trainer = pl.Trainer(
        default_root_dir=root, max_steps=max_steps, max_epochs=-1, callbacks=[forecast], accelerator="cpu",
        logger=logger, enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
        log_every_n_steps=50,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize(
    "curve, first_flat_step", [(saturating, 409), (sigmoid_shaped, 386)], ids=["exp_saturation", "logistic"]
)
@no_logger
def test_early_stop_where_the_planted_curve_flattens(tmp_path, curve, first_flat_step):
    forecast = RewardForecast(min_delta=0.01, patience=3, stop=True, check_every_n_steps=10)
    trainer = run(TrajectoryModule(noisy(curve, seed=0)), forecast, len(STEPS), tmp_path)
    # Three plateaued checks 10 steps apart after the true gain left falls under min_delta; the logistic's flat
    # slow start (steps 0-150) must not have stopped it.
    assert forecast.stopped_step is not None
    assert first_flat_step - 20 <= forecast.stopped_step <= first_flat_step + 60
    assert trainer.global_step == forecast.stopped_step + 1


def test_forecast_is_logged_at_every_check_in_sight_and_never_stops_when_told_not_to(tmp_path):
    forecast = RewardForecast(min_delta=0.01, patience=1, stop=False, min_points=30, check_every_n_steps=20)
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = run(TrajectoryModule(noisy(saturating, seed=1)), forecast, 600, tmp_path, logger=logger)
    assert trainer.global_step == 600 and forecast.stopped_step is None

    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    plateau = events.Scalars("forecast/plateau_reward")
    # Checks at steps 40, 60, ..., 580, logged even though log_every_n_steps=50 would skip most of them, from the
    # check where the plateau is in sight on (the planted curve covers half its rise at step 69).
    checks = list(range(40, 600, 20))
    assert [e.step for e in plateau] == checks[checks.index(plateau[0].step):]
    assert 60 <= plateau[0].step <= 120
    assert plateau[-1].value == pytest.approx(0.8, rel=0.05)
    assert events.Scalars("forecast/step_to_plateau")[-1].value == pytest.approx(100 * math.log(20), rel=0.1)
    assert events.Scalars("forecast/remaining_gain")[-1].value < 0.01


def test_a_noisy_short_curve_logs_no_plateau_beyond_its_reach(tmp_path):
    """Few noisy readings of a flat curve near -0.2, fitted at every step: a fit that sends the plateau far off (to
    -7 or +8 here) is not logged; each logged one lies no farther from the fitted reward now than the curve has
    moved, so within the readings' range widened by its width."""
    rewards = -0.2 + np.random.default_rng(1).normal(0.0, 0.3, 30)
    forecast = RewardForecast(min_points=5, check_every_n_steps=1)
    logger = TensorBoardLogger(tmp_path, name="tb")
    run(TrajectoryModule(rewards), forecast, 30, tmp_path, logger=logger)
    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    logged = events.Scalars("forecast/plateau_reward")
    assert len(logged) >= 15  # most checks still forecast: a flat curve's plateau is its level
    for event in logged:
        seen = rewards[:event.step + 1]
        width = seen.max() - seen.min()
        assert seen.min() - width <= event.value <= seen.max() + width, (event.step, event.value)
    steps = {key: [e.step for e in events.Scalars(key)] for key in
             ("forecast/plateau_reward", "forecast/step_to_plateau", "forecast/remaining_gain")}
    assert steps["forecast/step_to_plateau"] == steps["forecast/remaining_gain"] == steps["forecast/plateau_reward"]


@no_logger
def test_the_stop_waits_for_patience_consecutive_plateaued_checks_from_min_points_on(tmp_path, monkeypatch):
    """The fits are scripted: plateaued, not, then plateaued on. The first fit runs at the check where min_points
    are in; a check that is not plateaued starts the count again; the stop comes at the patience-th in a row."""
    fit = CurveFit("exp_saturation", (0.0, 1.0, 0.1), rss=1.0, num_points=10)
    verdicts, fitted = iter([True, False] + [True] * 10), []

    def scripted(steps, rewards, criterion, reward_range=None):
        fitted.append(len(steps))
        return Forecast(plateau_reward=1.0, step_to_plateau=5.0, remaining_gain=0.0 if next(verdicts) else 0.5,
                        observed_gain=1.0, noise_std=0.01, fit=fit, candidates=(fit,))

    monkeypatch.setattr(reward_forecast_module, "forecast_plateau", scripted)
    forecast = RewardForecast(min_delta=0.01, patience=2, stop=True, min_points=11, check_every_n_steps=10)
    run(TrajectoryModule(noisy(saturating, seed=0)), forecast, 200, tmp_path)
    assert fitted == [11, 21, 31, 41]  # checks at steps 10 (11 points in), 20, 30, 40
    assert forecast.stopped_step == 40 and forecast.wait_count == 2


def test_a_plateau_out_of_sight_is_not_counted_towards_the_stop(tmp_path, monkeypatch):
    """A fit whose plateau lies far below the fitted reward now (a remaining gain of -5 on a curve that rose by 1)
    is not logged, so it does not count towards the stop either: the stop message quotes a charted forecast."""
    fit = CurveFit("exp_saturation", (0.0, 1.0, 0.1), rss=1.0, num_points=10)

    def far_below(steps, rewards, criterion, reward_range=None):
        return Forecast(plateau_reward=-4.0, step_to_plateau=5.0, remaining_gain=-5.0, observed_gain=1.0,
                        noise_std=0.01, fit=fit, candidates=(fit,))

    monkeypatch.setattr(reward_forecast_module, "forecast_plateau", far_below)
    forecast = RewardForecast(min_delta=0.01, patience=1, stop=True, min_points=5, check_every_n_steps=5)
    trainer = run(TrajectoryModule(noisy(saturating, seed=0)), forecast, 40, tmp_path)
    assert forecast.last_forecast.remaining_gain == -5.0 and not forecast.last_forecast.in_sight
    assert forecast.stopped_step is None and forecast.wait_count == 0 and trainer.global_step == 40


def test_a_reward_that_is_not_finite_is_not_recorded(tmp_path):
    rewards = noisy(saturating, seed=0)[:30].copy()
    rewards[[3, 17]] = np.nan
    forecast = RewardForecast(check_every_n_steps=10)
    run(TrajectoryModule(rewards), forecast, 30, tmp_path)
    assert forecast.steps == [step for step in range(30) if step not in (3, 17)]
    assert forecast.rewards == pytest.approx(np.delete(rewards, [3, 17]).tolist())


def test_a_monitor_never_logged_is_warned_about_once(tmp_path):
    forecast = RewardForecast(monitor="reward/meen", stop=True, check_every_n_steps=5)
    with pytest.warns(UserWarning, match=r"monitor='reward/meen' has not been logged by step 0, so nothing is "
                                         r"forecast \(or stopped\); logged keys: \['reward/mean'\]") as caught:
        run(TrajectoryModule(noisy(saturating, seed=0)), forecast, 30, tmp_path)
    assert sum("has not been logged" in str(w.message) for w in caught) == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(criterion="x"), "criterion='x'"),
    (dict(reward_range=1.0), r"reward_range=1.0 must be \(low, high\)"),
    (dict(reward_range=(1.0, 0.0)), r"reward_range=\(1.0, 0.0\) must have low < high"),
    # the pair named, not its infinite or NaN bound as if it were the whole setting ("must be a finite number")
    (dict(reward_range=(0.0, float("inf"))), r"reward_range=\(0.0, inf\) must be \(low, high\), two finite numbers"),
    (dict(reward_range=[float("nan"), 1.0]), r"reward_range=\[nan, 1.0\] must be \(low, high\), two finite numbers"),
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed in place of the refusal
    (dict(reward_range=[0.0, 10**5000]), r"^reward_range=a list holding an int of more than \d+ digits must be \(low, "
                                         r"high\), two finite numbers"),
    (dict(min_delta=-1), "min_delta=-1"),
    (dict(patience=1.5), "patience=1.5 must be an integer >= 1"),
    (dict(min_points=3), "min_points=3 must be an integer >= 5"),
])
def test_bad_forecast_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardForecast(**kwargs)


@pytest.mark.parametrize("kwargs, match", [(dict(criterion="x"), "criterion='x'"), (dict(fraction=2), "fraction=2"),
                                           (dict(reward_range=(1, 0)), "low < high")])
def test_bad_forecast_plateau_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        forecast_plateau(STEPS[:50], saturating(STEPS[:50]), **kwargs)


_FORECAST_STATE = {"steps": [1.0, 2.0, 3.0], "rewards": [0.1, 0.2, 0.25], "wait_count": 1, "stopped_step": None}


@pytest.mark.parametrize("change, message", [
    ({"steps": [1.0, 2.0]}, r"^forecast state steps and rewards must be as long as each other \(one reward per "
                            r"step\), not 2 and 3$"),  # was taken: the fit failed at its next check
    ({"rewards": [0.1, math.nan, 0.25]}, r"^forecast state rewards\[1\]=nan is not allowed; forecast state "
                                         r"rewards\[1\] must be a finite number$"),  # a NaN reward is never recorded
    ({"rewards": [0.1, "0.2", 0.25]}, r"^forecast state rewards\[1\]='0.2' is not allowed"),  # was parsed
    ({"steps": "123"}, r"^forecast state steps='123' must be a list of numbers$"),
    ({"steps": 10**5000}, r"^forecast state steps=\(an int of 5001 digits\) must be a list of numbers$"),
    ({"wait_count": -1}, r"^forecast state wait_count=-1 must be an integer >= 0$"),
    ({"wait_count": 1.5}, r"^forecast state wait_count=1.5 must be an integer >= 0$"),  # was cut to 1
    ({"stopped_step": "40"}, r"^forecast state stopped_step='40' must be an integer >= 0 or None \(not stopped\)$"),
    ({"patience": 3}, r"^a RewardForecast state has unknown keys \['patience'\]; it holds steps, rewards, wait_count, "
                      r"stopped_step \(stopped_step may be absent\)$"),
])
def test_a_bad_forecast_state_is_refused_naming_the_bad_key_and_the_forecast_is_left_as_it_was(change, message):
    """A corrupt or foreign checkpoint's forecast state is refused naming what is wrong and what is allowed, before
    any of it is taken."""
    forecast = RewardForecast()
    forecast.load_state_dict({"steps": [5.0], "rewards": [0.5], "wait_count": 0, "stopped_step": None})
    before = forecast.state_dict()
    with pytest.raises(ValueError, match=message):
        forecast.load_state_dict({**_FORECAST_STATE, **change})
    assert forecast.state_dict() == before
    with pytest.raises(ValueError, match=r"^a RewardForecast state lacks \['wait_count'\]; it holds steps, "):
        forecast.load_state_dict({"steps": [], "rewards": []})
    forecast.load_state_dict({key: value for key, value in _FORECAST_STATE.items() if key != "stopped_step"})
    assert forecast.state_dict() == {**_FORECAST_STATE, "stopped_step": None}  # as saved before it was kept
    forecast.load_state_dict({**_FORECAST_STATE, "steps": [np.int64(1), 2, 3], "wait_count": np.int64(1)})
    assert forecast.state_dict() == _FORECAST_STATE and type(forecast.wait_count) is int


@no_logger
def test_history_survives_a_checkpoint(tmp_path):
    rewards = noisy(saturating, seed=2)
    first = RewardForecast(check_every_n_steps=10)
    trainer = run(TrajectoryModule(rewards), first, 60, tmp_path)
    checkpoint = tmp_path / "forecast.ckpt"
    trainer.save_checkpoint(checkpoint)
    assert first.steps == list(range(60)) and first.rewards == pytest.approx(rewards[:60].tolist())

    resumed = RewardForecast(check_every_n_steps=10)
    run(TrajectoryModule(rewards), resumed, 80, tmp_path, ckpt_path=checkpoint)
    assert resumed.steps == list(range(80))
    assert resumed.rewards == pytest.approx(rewards[:80].tolist())
    assert resumed.last_forecast is not None


@no_logger
@pytest.mark.filterwarnings("ignore:RewardForecast. monitor='reward/other' has not been logged:UserWarning")
def test_a_resume_with_other_settings_goes_on_from_the_same_monitors_history(tmp_path, caplog):
    """Turning the stop on (or another patience) changes the forecast's checkpoint key: its reward history still
    comes back from the one forecast of that monitor the checkpoint holds, and its checks start over."""
    rewards = noisy(saturating, seed=2)
    trainer = run(TrajectoryModule(rewards), RewardForecast(check_every_n_steps=10), 60, tmp_path)
    checkpoint = tmp_path / "forecast.ckpt"
    trainer.save_checkpoint(checkpoint)

    resumed = RewardForecast(check_every_n_steps=10, stop=True, patience=5)
    with caplog.at_level("INFO"):
        run(TrajectoryModule(rewards), resumed, 80, tmp_path, ckpt_path=checkpoint)
    assert resumed.steps == list(range(80)) and resumed.rewards == pytest.approx(rewards[:80].tolist())
    assert "saved under other settings; it goes on from it" in caplog.text
    other = RewardForecast(monitor="reward/other")  # another monitor's forecast takes nothing
    run(TrajectoryModule(rewards), other, 70, tmp_path, ckpt_path=checkpoint)
    assert other.steps == []


class TwoCurvesModule(TrajectoryModule):
    """Logs the planted curve and its mirror image, for two forecasts with different monitors."""

    def training_step(self, batch, batch_idx):
        self.log("reward/mirrored", 1.0 - float(self.rewards[self.global_step]))
        return super().training_step(batch, batch_idx)


def test_two_differently_configured_forecasts_keep_their_own_state_in_one_checkpoint(tmp_path):
    rewards = noisy(saturating, seed=3)

    def pair() -> list[RewardForecast]:
        return [RewardForecast(check_every_n_steps=10), RewardForecast(monitor="reward/mirrored")]

    first = pair()
    assert first[0].state_key != first[1].state_key and "reward/mirrored" in first[1].state_key
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=30, callbacks=first, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(TwoCurvesModule(rewards))
    checkpoint = tmp_path / "two.ckpt"
    trainer.save_checkpoint(checkpoint)

    resumed = pair()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=40, callbacks=resumed, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(TwoCurvesModule(rewards), ckpt_path=checkpoint)
    assert resumed[0].rewards == pytest.approx(rewards[:40].tolist())
    assert resumed[1].rewards == pytest.approx((1.0 - rewards[:40]).tolist())
