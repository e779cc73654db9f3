"""Online ridge regression from decayed sufficient statistics: the solver behind the token-conditioned length
predictor (``predictors.OnlineLengthPredictor``)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from lit_grpo.runtime.validation import check_int, check_real, check_state_keys, shown_setting, shown_value

#: The effective count of observations (``(sum w)^2 / sum w^2``) below which nothing is fitted: only the mean.
MIN_EFFECTIVE_COUNT = 3
#: The smallest decay allowed, excluded: weights ``decay^k`` cap the effective count at ``(1 + decay) / (1 - decay)``,
#: which is below ``MIN_EFFECTIVE_COUNT`` up to this decay (0.5), so a model that decays faster never fits.
MIN_DECAY = (MIN_EFFECTIVE_COUNT - 1) / (MIN_EFFECTIVE_COUNT + 1)


class RidgeRegressor:
    """Ridge regression in closed form from exponentially decayed sufficient statistics.

    Keeps ``sum w``, ``sum w x``, ``sum w x x^T``, ``sum w y``, ``sum w x y`` (float64), so an update costs
    ``O(N d^2)`` and a fit one Cholesky solve per penalty, whatever the number of observations. Features are
    centered and divided by one common scale at fit time (from the same statistics), so one penalty grid suits
    any feature scale; the intercept is not penalized. Several penalties are fitted at once; the one with the
    lowest prequential error (error on new observations before they are learned) is used, which replaces
    cross-validation.

    Args:
        decay: each new observation multiplies the weight of all older ones by this (1.0: no forgetting); above
            ``MIN_DECAY`` (0.5), or nothing is ever fitted.
        alphas: penalties, in units of pseudo-observations per standardized feature.
        min_refit: refit after at least this many new observations (and 10% of the effective count).
    """

    def __init__(self, decay: float = 0.998, alphas: Sequence[float] = (0.1, 1.0, 10.0, 100.0, 1000.0),
                 min_refit: int = 4) -> None:
        self.decay = check_decay("decay", decay)
        self.alphas = check_alphas("alphas", alphas)
        self.min_refit = check_int("min_refit", min_refit, 0)
        self.dim: int | None = None
        self._reset_stats(0)

    def _reset_stats(self, dim: int) -> None:
        f64 = torch.float64
        self.dim = dim if dim else None
        self.sw = 0.0  # sum of weights
        self.sw2 = 0.0  # sum of squared weights (effective count: sw^2 / sw2)
        self.sy = 0.0
        self.sx = torch.zeros(dim, dtype=f64)
        self.sxx = torch.zeros(dim, dim, dtype=f64)
        self.sxy = torch.zeros(dim, dtype=f64)
        self.alpha_sq_err = torch.zeros(len(self.alphas), dtype=f64)  # decayed squared errors per penalty
        self.new_since_fit = 0
        self._fit: tuple[torch.Tensor, torch.Tensor, float] | None = None  # (weights [A, d], mean [d], y mean)

    @property
    def effective_count(self) -> float:
        return self.sw * self.sw / self.sw2 if self.sw2 > 0 else 0.0

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add observations ``x [N, d]``, targets ``y [N]`` (oldest first)."""
        x = x.to(torch.float64)
        y = y.to(torch.float64)
        if self.dim != x.shape[1]:
            self._reset_stats(x.shape[1])  # a different feature size means a different model
        n = len(y)
        # Row i of the batch is followed by n - 1 - i newer observations.
        w = self.decay ** torch.arange(n - 1, -1, -1, dtype=torch.float64)
        if self.sw > 0:
            # Prequential error of every penalty, before the model sees these targets (decayed like the rows).
            errors = (self._predict_all(x) - y[None, :]) ** 2  # [A, N]
            self.alpha_sq_err = self.alpha_sq_err * self.decay**n + (errors * w[None, :]).sum(dim=1)
        scale = self.decay**n
        self.sw = self.sw * scale + float(w.sum())
        self.sw2 = self.sw2 * scale * scale + float((w * w).sum())
        self.sy = self.sy * scale + float((w * y).sum())
        self.sx = self.sx * scale + (w[:, None] * x).sum(dim=0)
        self.sxx = self.sxx * scale + (w[:, None] * x).T @ x
        self.sxy = self.sxy * scale + (w[:, None] * x).T @ y
        self.new_since_fit += n

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Predictions ``[N]`` for ``x [N, d]`` with the best penalty; the mean target when nothing is fitted."""
        return self._predict_all(x.to(torch.float64))[self.best_alpha_index()]

    def best_alpha_index(self) -> int:
        return self._best_alpha(self.alpha_sq_err)

    def _best_alpha(self, totals: torch.Tensor) -> int:
        if totals.sum() == 0:
            return self.alphas.index(10.0) if 10.0 in self.alphas else len(self.alphas) // 2
        return int(torch.argmin(totals))

    def _predict_all(self, x: torch.Tensor) -> torch.Tensor:
        """``[A, N]``: one row per penalty."""
        self._maybe_fit()
        if self._fit is None:
            mean_y = self.sy / self.sw if self.sw > 0 else 0.0
            return torch.full((len(self.alphas), x.shape[0]), mean_y, dtype=torch.float64)
        weights, mean_x, mean_y = self._fit
        return mean_y + weights @ (x - mean_x).T

    def _maybe_fit(self) -> None:
        due = self.new_since_fit >= self._refit_threshold()
        if self._fit is not None and not due:
            return
        if self.effective_count < MIN_EFFECTIVE_COUNT or self.dim is None:
            self._fit = None
            return
        self._fit = self._solve()
        self.new_since_fit = 0

    def _refit_threshold(self) -> float:
        """New observations after which the fit is stale: ``min_refit``, and 10% of the effective count."""
        return max(self.min_refit, 0.1 * self.effective_count)

    def _solve(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        n = self.sw
        mean_x = self.sx / n
        mean_y = self.sy / n
        cov = self.sxx / n - torch.outer(mean_x, mean_x)
        cross = self.sxy / n - mean_x * mean_y
        # One scale for all features (RMS of their standard deviations), not one per feature: with few distinct
        # prompts some directions barely vary, and per-feature standardization would blow their noise up.
        scale = float(cov.diagonal().clamp_min(0).mean().sqrt())
        if scale <= 1e-12:  # every feature constant: only the mean is known
            return torch.zeros(len(self.alphas), cov.shape[0], dtype=torch.float64), mean_x, mean_y
        cov_std = cov / (scale * scale)
        cross_std = cross / scale
        eye = torch.eye(cov.shape[0], dtype=torch.float64)
        rows = []
        for alpha in self.alphas:
            # Penalty alpha on the total weighted squared error = alpha / sum(w) on the weighted mean one (a fresh
            # observation weighs 1: alpha pseudo-observations), not alpha / the effective count, which is larger.
            system = cov_std + (alpha / n) * eye
            chol, info = torch.linalg.cholesky_ex(system)
            if int(info) != 0:  # numerically singular: fall back to a least-squares solve
                beta = torch.linalg.lstsq(system, cross_std[:, None]).solution[:, 0]
            else:
                beta = torch.cholesky_solve(cross_std[:, None], chol)[:, 0]
            rows.append(beta / scale)  # back to raw feature units
        return torch.stack(rows), mean_x, mean_y

    def state_dict(self) -> dict:
        return {
            "decay": self.decay, "alphas": list(self.alphas), "dim": self.dim, "sw": self.sw, "sw2": self.sw2,
            "sy": self.sy, "sx": self.sx.clone(), "sxx": self.sxx.clone(), "sxy": self.sxy.clone(),
            "alpha_sq_err": self.alpha_sq_err.clone(), "new_since_fit": self.new_since_fit,
            "fit": None if self._fit is None else (self._fit[0].clone(), self._fit[1].clone(), self._fit[2]),
        }

    def load_state_dict(self, state: dict) -> None:
        """Take ``state`` (``state_dict``'s, from a checkpoint), checked whole first (:func:`checked_state`): a
        corrupt or foreign one is refused naming the bad key, and leaves this regressor as it was."""
        self.take_state(checked_state(state))

    def take_state(self, checked: dict[str, Any]) -> None:
        """Take a state :func:`checked_state` returned (a predictor checks both its models' before taking either)."""
        self.decay, self.alphas = checked["decay"], checked["alphas"]
        self._reset_stats(checked["dim"] or 0)
        for key in ("sw", "sw2", "sy", "sx", "sxx", "sxy", "alpha_sq_err", "new_since_fit"):
            setattr(self, key, checked[key])
        self._fit = checked["fit"]


#: The keys of a ``RidgeRegressor`` state (``state_dict``), each required.
_STATE_KEYS = ("decay", "alphas", "dim", "sw", "sw2", "sy", "sx", "sxx", "sxy", "alpha_sq_err", "new_since_fit", "fit")


def checked_state(state: Any, what: str = "a RidgeRegressor state", prefix: str = "ridge state ") -> dict[str, Any]:
    """A ``RidgeRegressor`` state checked whole: its numbers plain, its tensors float64 copies on the CPU (where the
    updates' are), the shapes its ``dim`` and penalties give them; else a ValueError saying ``what`` the state is
    where a key is missing or unknown, or naming the bad key (``prefix`` and the key) or value and what is allowed."""
    check_state_keys(what, state, _STATE_KEYS)
    decay = check_decay(prefix + "decay", state["decay"])
    alphas = check_alphas(prefix + "alphas", state["alphas"])
    dim = check_int(prefix + "dim", state["dim"], 1, none=True)  # None: no features seen yet
    size, penalties = dim or 0, len(alphas)
    checked = {"decay": decay, "alphas": alphas, "dim": dim}
    for key in ("sw", "sw2", "sy"):  # the sums of weights cannot be negative; the targets' can
        checked[key] = check_real(prefix + key, state[key], low=None if key == "sy" else 0)
    for key, shape, dims in (("sx", [size], "dim"), ("sxx", [size, size], "dim x dim"), ("sxy", [size], "dim")):
        checked[key] = check_tensor(prefix + key, state[key], shape, dims)
    checked["alpha_sq_err"] = check_tensor(prefix + "alpha_sq_err", state["alpha_sq_err"], [penalties],
                                           "one per penalty", nonnegative=True)  # decayed squared errors
    checked["new_since_fit"] = check_int(prefix + "new_since_fit", state["new_since_fit"], 0)
    fit, name = state["fit"], prefix + "fit"
    if fit is not None:
        if type(fit) not in (list, tuple) or len(fit) != 3:
            shown = f"a {type(fit).__name__} of {len(fit)}" if type(fit) in (list, tuple) else shown_value(fit, 80)
            raise ValueError(f"{name} must be None or (weights, mean of x, mean of y), not {shown}")
        if dim is None:
            raise ValueError(f"{name} must be None where {prefix}dim is None (nothing is fitted before features)")
        fit = (check_tensor(f"{name}[0]", fit[0], [penalties, size], "penalties x dim"),
               check_tensor(f"{name}[1]", fit[1], [size], "dim"), check_real(f"{name}[2]", fit[2]))
    checked["fit"] = fit
    return checked


def check_decay(name: str, decay: Any) -> float:
    """``decay`` as a float in (``MIN_DECAY``, 1], else a ValueError naming it: above 1 the older observations'
    weights grow without bound; at most ``MIN_DECAY`` they never count enough observations for a fit."""
    return check_real(name, decay, low=MIN_DECAY, high=1, low_open=True)


def check_alphas(name: str, alphas: Any) -> tuple[float, ...]:
    """``alphas`` as a tuple of floats if it is a non-empty list of penalties (finite numbers >= 0), else a
    ValueError naming it, or the bad entry."""
    if isinstance(alphas, (str, bytes)) or not isinstance(alphas, Sequence) or not alphas:
        raise ValueError(f"{shown_setting(name, alphas, 80)} must be a non-empty list of penalties (finite numbers "
                         ">= 0)")
    return tuple(check_real(f"{name}[{i}]", a, low=0) for i, a in enumerate(alphas))


def check_tensor(name: str, value: Any, shape: Sequence[int], dims: str, nonnegative: bool = False) -> torch.Tensor:
    """``value`` as a float64 copy on the CPU if it is a floating-point tensor of ``shape`` (``dims``: its dimensions
    in words) holding finite numbers (>= 0 where ``nonnegative``), else a ValueError naming it, or its bad entry."""
    # a shape's size may come from a checkpoint's key: one too long to print is shown by its digits
    allowed = (f"a floating-point tensor shaped [{', '.join(map(shown_value, shape))}] ({dims}) of finite numbers"
               + (" >= 0" if nonnegative else ""))
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or list(value.shape) != list(shape):
        shown = (f"a {value.dtype} tensor shaped {list(value.shape)}" if isinstance(value, torch.Tensor)
                 else shown_value(value, 80))
        raise ValueError(f"{name} must be {allowed}, not {shown}")
    bad = ~torch.isfinite(value)
    if nonnegative:
        bad |= value < 0
    if bad.any():
        index = [int(i) for i in bad.nonzero()[0]]
        entry = shown_setting(f"{name}[{', '.join(map(str, index))}]", value[tuple(index)].item())
        raise ValueError(f"{entry} is not allowed; {name} must be {allowed}")
    return value.detach().to("cpu", torch.float64, copy=True)


@contextlib.contextmanager
def single_thread():
    """Run the predictor's small tensor ops and solves on one thread: intra-op threading on a few hundred dims
    only adds overhead, a lot of it when the CPU is shared. The caller's thread count is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def rms_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x [N, H]`` divided by each row's root-mean-square: hidden-state scale varies across models and layers."""
    x = x.to(torch.float64)
    return x / x.pow(2).mean(dim=-1, keepdim=True).add(1e-12).sqrt()
