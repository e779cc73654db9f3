"""Forecast where the reward curve plateaus, from the curve so far (``RewardForecast`` logs it and may stop).

GRPO reward curves run through a slow start, a rapid rise and a plateau (Predictive Scaling Laws for GRPO,
arXiv 2507.18014). Two shapes are fitted to the running curve, an exponential saturation
``R(t) = R0 + (Rmax - R0)(1 - exp(-lambda t))`` (the paper's revised law) and a logistic
``R(t) = Rlow + (Rmax - Rlow) / (1 + exp(-k (t - t0)))`` (its first version's sigmoid, which also fits the slow
start); the one with the lower information criterion gives the forecast. ``t`` counts steps from the first
recorded step. The callback that runs it during training is :class:`~lit_grpo.callbacks.RewardForecast`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
from scipy.optimize import least_squares
from scipy.special import fdtrc

from lit_grpo.runtime.validation import check_choice, check_real, shown_setting

Criterion = Literal["aic", "bic"]
CRITERIA: tuple[str, ...] = get_args(Criterion)

#: A rise counts as seen when it exceeds this many standard deviations of one reward reading.
RISE_NOISE_FACTOR = 2.0

#: ... and the fit rejects a flat line at this level. The shapes' rates and centres are chosen to fit, which the F
#: test does not know of, so the level is strict: flat noise then passes for a rise in about 1% of runs at most.
RISE_SIGNIFICANCE = 1e-3

#: Longer histories are averaged into this many bins before fitting: the fit stays fast on long runs.
MAX_FIT_POINTS = 2000


def exp_saturation(t: np.ndarray, r0: float, rmax: float, lam: float) -> np.ndarray:
    """``R0 + (Rmax - R0)(1 - exp(-lambda t))``: starts at R0, rises fastest at t = 0, saturates at Rmax."""
    return r0 + (rmax - r0) * -np.expm1(-lam * t)


def logistic(t: np.ndarray, rlow: float, rmax: float, k: float, t0: float) -> np.ndarray:
    """``Rlow + (Rmax - Rlow) / (1 + exp(-k (t - t0)))``: slow start, fastest rise at t0, saturates at Rmax."""
    return rlow + (rmax - rlow) * _sigmoid(k * (t - t0))


def _sigmoid(x: np.ndarray | float) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=float)))  # exp-free: no overflow for large |x|


@dataclass(frozen=True)
class CurveFit:
    """One fitted shape, in real units (``t`` in steps since the first recorded step).

    Attributes:
        model: ``"exp_saturation"`` or ``"logistic"``.
        params: the model's parameters in the order of its function's signature.
        rss: residual sum of squares over the fitted points.
        num_points: points fitted (after binning).
    """

    model: str
    params: tuple[float, ...]
    rss: float
    num_points: int

    @property
    def num_params(self) -> int:
        return len(self.params)

    @property
    def plateau(self) -> float:
        """Rmax, the reward the curve saturates at."""
        return self.params[1]

    def predict(self, t: np.ndarray | float) -> np.ndarray:
        return _MODELS[self.model](np.asarray(t, dtype=float), *self.params)

    def information_criterion(self, criterion: Criterion = "bic") -> float:
        """Gaussian-residual AIC or BIC, ``n ln(RSS / n) + penalty``: lower is better, extra parameters cost."""
        n = self.num_points
        fit_term = n * math.log(max(self.rss / n, np.finfo(float).tiny))
        penalty = 2 * self.num_params if criterion == "aic" else self.num_params * math.log(n)
        return fit_term + penalty

    def time_to_fraction(self, fraction: float) -> float:
        """The ``t`` at which the curve has covered ``fraction`` of its rise from R(0) to Rmax (inf if never)."""
        if self.model == "exp_saturation":
            lam = self.params[2]
            return -math.log1p(-fraction) / lam if lam > 0 else math.inf
        _, _, k, t0 = self.params
        start = float(_sigmoid(-k * t0))
        target = start + fraction * (1.0 - start)
        if k <= 0 or target >= 1.0:
            return math.inf
        return max(0.0, t0 + math.log(target / (1.0 - target)) / k)


@dataclass(frozen=True)
class Forecast:
    """What the better fit predicts.

    Attributes:
        plateau_reward: Rmax.
        step_to_plateau: step at which the fit covers ``fraction`` (95%) of its gain from R(first step) to Rmax.
        remaining_gain: Rmax minus the fitted reward at the last recorded step (fitted, so noise does not count).
        observed_gain: the fitted rise so far, R(last step) - R(first step).
        noise_std: standard deviation of the residuals, the noise of one reward reading.
        fit: the chosen fit; ``candidates``: every fit that converged.
        flat_p_value: the F test's p-value of the fit against a flat line (1.0 where nothing varies).
        readings_rise_z: the mean of the last quarter of readings minus that of the first quarter, in standard
            errors of that difference (a rise the readings show, not one the fit makes of a few of them).
    """

    plateau_reward: float
    step_to_plateau: float
    remaining_gain: float
    observed_gain: float
    noise_std: float
    fit: CurveFit
    candidates: tuple[CurveFit, ...]
    flat_p_value: float = 0.0
    readings_rise_z: float = math.inf

    @property
    def rise_seen(self) -> bool:
        """Whether the curve has visibly risen: the fitted rise exceeds ``RISE_NOISE_FACTOR`` readings' noise, the
        fit beats a flat line (``flat_p_value < RISE_SIGNIFICANCE``) and the last quarter of readings lies above
        the first by ``RISE_NOISE_FACTOR`` standard errors.

        In the slow start of a sigmoid-shaped curve both shapes fit a flat line and forecast no gain, although
        the rise is still to come; a plateau is only believed once a rise stands out of the noise. The fitted rise
        alone does not show that: a shape fitted to flat noise, or to one outlying first reading (a saturation
        within a step), rises by a few readings' noise.
        """
        return (self.observed_gain > RISE_NOISE_FACTOR * self.noise_std
                and self.flat_p_value < RISE_SIGNIFICANCE and self.readings_rise_z > RISE_NOISE_FACTOR)

    @property
    def in_sight(self) -> bool:
        """Whether the plateau lies no farther from the fitted reward now than the fitted curve has moved since the
        first step (``|remaining_gain| <= |observed_gain|``): a forecast that extrapolates at most as far again as
        the curve has come. Farther, it is a shape fitted to the noise of a few readings or a curve still rising
        straight."""
        return abs(self.remaining_gain) <= abs(self.observed_gain)


def fit_exp_saturation(
    t: np.ndarray, y: np.ndarray, reward_range: tuple[float, float] | None = None
) -> CurveFit | None:
    """Least-squares exponential saturation of ``y`` over ``t`` (t >= 0); None if the fit fails numerically."""
    span = _span(t)
    rates = np.geomspace(1e-2, 1e2, 41) / span
    r0, gain, rss = _linear_fits(-np.expm1(-np.outer(rates, t)), y)
    best = int(np.argmin(rss))
    lower, upper = _level_bounds(y, reward_range)
    bounds = ([-np.inf, lower, 1e-3 / span], [np.inf, upper, 1e3 / span])
    return _refine("exp_saturation", t, y, (r0[best], r0[best] + gain[best], rates[best]), bounds)


def fit_logistic(
    t: np.ndarray, y: np.ndarray, reward_range: tuple[float, float] | None = None
) -> CurveFit | None:
    """Least-squares logistic of ``y`` over ``t`` (t >= 0); None if the fit fails numerically."""
    span = _span(t)
    rates, centers = np.meshgrid(np.geomspace(0.5, 200, 25) / span, np.linspace(0.0, 1.5 * span, 25))
    rates, centers = rates.ravel(), centers.ravel()
    rlow, gain, rss = _linear_fits(_sigmoid(rates[:, None] * (t[None, :] - centers[:, None])), y)
    best = int(np.argmin(rss))
    lower, upper = _level_bounds(y, reward_range)
    # t0 >= 0: a logistic whose inflection lies before the data is an exponential saturation with a diverging
    # Rlow, a valley the optimizer would crawl along; fit_exp_saturation covers that shape. t0 may lie past the
    # data (only the slow start seen so far).
    bounds = ([-np.inf, lower, 1e-2 / span, 0.0], [np.inf, upper, 1e3 / span, 2 * span])
    start = (rlow[best], rlow[best] + gain[best], rates[best], centers[best])
    return _refine("logistic", t, y, start, bounds)


def check_reward_range(reward_range: Any) -> tuple[float, float] | None:
    """``reward_range`` as ``(low, high)``, two finite numbers with low < high, or None; else a ValueError naming it."""
    if reward_range is None:
        return None
    message = (f"{shown_setting('reward_range', reward_range)} must be (low, high), two finite numbers with low < "
               "high, or None")
    if isinstance(reward_range, (str, bytes)) or not isinstance(reward_range, Sequence) or len(reward_range) != 2:
        raise ValueError(message)
    try:  # the pair named, not one of its numbers as if it were the whole setting
        low, high = (check_real("reward_range", value) for value in reward_range)
    except ValueError:
        raise ValueError(message) from None
    if not low < high:
        raise ValueError(f"{shown_setting('reward_range', tuple(reward_range))} must have low < high")
    return low, high


def forecast_plateau(
    steps: Sequence[float] | np.ndarray,
    rewards: Sequence[float] | np.ndarray,
    criterion: Criterion = "bic",
    fraction: float = 0.95,
    reward_range: tuple[float, float] | None = None,
) -> Forecast | None:
    """Fit both shapes to ``(steps, rewards)``, keep the one with the lower AIC/BIC, and forecast from it.

    Args:
        steps: [N] the steps of the trajectory so far; they need not be evenly spaced.
        rewards: [N] the reward at each of those steps.
        criterion: ``"bic"`` (penalizes the logistic's extra parameter more as N grows) or ``"aic"``.
        fraction: share of the predicted gain that defines "reaching the plateau".
        reward_range: known (min, max) of the reward, e.g. (0, 1) for accuracy rewards; bounds Rmax.

    Returns:
        The forecast in the steps' units, or None with fewer than 5 distinct steps or no converged fit.
    """
    check_choice("criterion", criterion, CRITERIA)
    check_real("fraction", fraction, low=0, high=1, low_open=True)
    check_reward_range(reward_range)
    steps_arr, rewards_arr = np.asarray(steps, dtype=float), np.asarray(rewards, dtype=float)
    keep = np.isfinite(steps_arr) & np.isfinite(rewards_arr)
    steps_arr, rewards_arr = steps_arr[keep], rewards_arr[keep]
    if len(np.unique(steps_arr)) < 5:
        return None
    origin = steps_arr.min()
    t, y = bin_means(steps_arr - origin, rewards_arr, MAX_FIT_POINTS)
    candidates = tuple(fit for fit in (fit_exp_saturation(t, y, reward_range), fit_logistic(t, y, reward_range))
                       if fit is not None)
    if not candidates:
        return None
    best = min(candidates, key=lambda fit: fit.information_criterion(criterion))
    now = float(best.predict(t.max()))
    # from every reading, not the bins' means: one reading's noise, however many readings a bin averages
    residuals = rewards_arr - best.predict(steps_arr - origin)
    noise_std = math.sqrt(float(np.sum(residuals**2)) / max(len(residuals) - best.num_params, 1))
    return Forecast(
        plateau_reward=best.plateau,
        step_to_plateau=origin + best.time_to_fraction(fraction),
        remaining_gain=best.plateau - now,
        observed_gain=now - float(best.predict(0.0)),
        noise_std=noise_std,
        fit=best,
        candidates=candidates,
        flat_p_value=flat_p_value(best, y),
        readings_rise_z=readings_rise_z(rewards_arr[np.argsort(steps_arr, kind="stable")], noise_std),
    )


def flat_p_value(fit: CurveFit, y: np.ndarray) -> float:
    """The F test's p-value of ``fit`` against a flat line through the mean of ``y`` ``[N]`` (the fitted points):
    how likely flat noise gives its residual drop. 1.0 where nothing varies, 0.0 for an exact fit of a varying y."""
    flat_rss = float(np.sum((y - y.mean()) ** 2))
    extra, left = fit.num_params - 1, fit.num_points - fit.num_params
    if flat_rss <= 0 or left <= 0:
        return 1.0
    if fit.rss <= 0:
        return 0.0
    return float(fdtrc(extra, left, max(flat_rss - fit.rss, 0.0) / extra / (fit.rss / left)))


def readings_rise_z(rewards: np.ndarray, noise_std: float) -> float:
    """``[N]`` readings in step order: the mean of the last quarter minus that of the first, in standard errors of
    that difference (``noise_std * sqrt(2 / quarter)``); 0.0 where neither the readings nor the noise vary."""
    quarter = max(len(rewards) // 4, 1)
    rise = float(rewards[-quarter:].mean() - rewards[:quarter].mean())
    error = noise_std * math.sqrt(2 / quarter)
    if error > 0:
        return rise / error
    return math.copysign(math.inf, rise) if rise else 0.0


def bin_means(t: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Sort by t and, past ``max_points`` points, average consecutive runs into ``max_points`` bins."""
    order = np.argsort(t, kind="stable")
    t, y = t[order], y[order]
    if len(t) <= max_points:
        return t, y
    groups = np.array_split(np.arange(len(t)), max_points)
    return np.array([t[g].mean() for g in groups]), np.array([y[g].mean() for g in groups])


def _linear_fits(basis: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best ``y ~ a + b * basis[g]`` for every row g of ``basis`` [G, N]: (a, b, rss), each [G].

    Both shapes are linear in their two levels once the rate (and centre) are fixed, so a grid over the
    nonlinear parameters with the levels solved exactly finds the global basin cheaply; least squares then
    only polishes (variable projection, in spirit).
    """
    n = y.size
    sum_f, sum_ff, sum_fy, sum_y = basis.sum(1), np.einsum("gn,gn->g", basis, basis), basis @ y, y.sum()
    det = n * sum_ff - sum_f**2
    solvable = det > 1e-12 * n * np.maximum(sum_ff, np.finfo(float).tiny)
    b = np.where(solvable, (n * sum_fy - sum_f * sum_y) / np.where(solvable, det, 1.0), 0.0)
    a = (sum_y - b * sum_f) / n
    rss = np.sum((a[:, None] + b[:, None] * basis - y[None, :]) ** 2, axis=1)
    return a, b, rss


def _refine(
    model: str, t: np.ndarray, y: np.ndarray, start: tuple[float, ...], bounds: tuple[list, list]
) -> CurveFit | None:
    """Bounded least squares from ``start``. An unconverged result is kept: it is no worse than the grid start."""
    function, jacobian = _MODELS[model], _JACOBIANS[model]
    lower, upper = np.array(bounds[0], dtype=float), np.array(bounds[1], dtype=float)
    x0 = np.clip(np.array(start, dtype=float), lower, upper)
    try:
        result = least_squares(lambda p: function(t, *p) - y, x0, jac=lambda p: jacobian(t, *p),
                               bounds=(lower, upper), method="trf", x_scale="jac", max_nfev=100)
    except (ValueError, np.linalg.LinAlgError):
        return None
    rss = 2.0 * float(result.cost)
    if not (np.all(np.isfinite(result.x)) and math.isfinite(rss)):
        return None
    return CurveFit(model, tuple(float(p) for p in result.x), rss, len(t))


def _exp_saturation_jacobian(t: np.ndarray, r0: float, rmax: float, lam: float) -> np.ndarray:
    decay = np.exp(-lam * t)
    return np.stack([decay, 1.0 - decay, (rmax - r0) * t * decay], axis=1)


def _logistic_jacobian(t: np.ndarray, rlow: float, rmax: float, k: float, t0: float) -> np.ndarray:
    s = _sigmoid(k * (t - t0))
    slope = (rmax - rlow) * s * (1.0 - s)
    return np.stack([1.0 - s, s, slope * (t - t0), -slope * k], axis=1)


def _level_bounds(y: np.ndarray, reward_range: tuple[float, float] | None) -> tuple[float, float]:
    """Bounds on the plateau Rmax: the known reward range, else 10 observed ranges around the data.

    Without a bound a still-straight curve sends Rmax to infinity (and lambda or k to 0) along a flat valley
    the optimizer crawls for hundreds of evaluations; a plateau that far away just means "not in sight".
    """
    if reward_range is not None:
        return float(reward_range[0]), float(reward_range[1])
    low, high = float(y.min()), float(y.max())
    margin = 10 * max(high - low, 1e-8)
    return low - margin, high + margin


def _span(t: np.ndarray) -> float:
    return max(float(t.max() - t.min()), 1.0)


_MODELS: dict[str, Callable[..., np.ndarray]] = {"exp_saturation": exp_saturation, "logistic": logistic}
_JACOBIANS: dict[str, Callable[..., np.ndarray]] = {
    "exp_saturation": _exp_saturation_jacobian,
    "logistic": _logistic_jacobian,
}
