"""The lognormal length model the schedulers reason with: a prior, the spread of a predictor's errors, and the
expected total length of a sample that has survived ``k`` tokens."""

from __future__ import annotations

import math

#: The error spread assumed before a predictor has seen anything (std of log length; e^1 ~ factor 2.7).
PRIOR_LOG_STD = 1.0


def prior_log_length(max_new_tokens: int) -> float:
    """Log length assumed before anything is observed: a quarter of the cap (any constant ranks samples alike)."""
    return math.log(max(1.0, max_new_tokens / 4))


class PrequentialError:
    """Decayed root-mean-square of log errors measured before learning; starts at a prior worth a few samples."""

    def __init__(self, decay: float = 0.99, prior: float = PRIOR_LOG_STD, prior_weight: float = 4.0) -> None:
        self.decay = decay
        self.weight = prior_weight
        self.sum_sq = prior_weight * prior * prior

    def add(self, log_error: float) -> None:
        self.weight = self.weight * self.decay + 1.0
        self.sum_sq = self.sum_sq * self.decay + log_error * log_error

    @property
    def rms(self) -> float:
        return math.sqrt(self.sum_sq / self.weight)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "weight": self.weight, "sum_sq": self.sum_sq}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.weight, self.sum_sq = state["decay"], state["weight"], state["sum_sq"]


def expected_length(median: float, log_std: float, survived: int, cap: int) -> float:
    """``E[min(L, cap) | L > survived]`` for ``L ~ LogNormal(log(median), log_std)``.

    Turns a point prediction into the expected total length of a sample that has already generated
    ``survived`` tokens without ending: a sample running past its prediction is expected to run on, by an amount
    that grows with the predictor's error spread. The result lies in ``[survived + 1, cap]``.
    """
    floor = min(survived + 1, cap)
    if log_std < 1e-6 or median <= 0:
        return float(min(max(median, floor), cap))
    if survived >= cap:
        return float(cap)
    mu, s = math.log(median), min(log_std, 4.0)  # beyond e^4 the spread means "unknown" anyway
    log_cap = math.log(cap)
    # P(L > a); with a = 0 every sample qualifies.
    if survived > 0:
        log_a = math.log(survived)
        tail = _normal_cdf((mu - log_a) / s)
        body_upper = _normal_cdf((mu + s * s - log_a) / s)
    else:
        tail, body_upper = 1.0, 1.0
    if tail < 1e-300:
        # Far beyond the prediction: the lognormal's excess over a is about a * s^2 / (log a - mu).
        excess = survived * s * s / max(math.log(survived) - mu, 1e-6)
        return float(min(max(survived + excess, floor), cap))
    body = math.exp(mu + s * s / 2) * (body_upper - _normal_cdf((mu + s * s - log_cap) / s))  # E[L; a < L < cap]
    capped = cap * _normal_cdf((mu - log_cap) / s)  # cap * P(L >= cap)
    return float(min(max((body + capped) / tail, floor), cap))


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))
