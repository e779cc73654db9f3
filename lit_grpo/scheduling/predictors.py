"""Length predictors: how many tokens will a sample generate in total?

A predictor answers for a batch of samples (keys ``(prompt, sample)`` of a :class:`RolloutWork`), optionally
given each sample's hidden state after its first k tokens, and learns from the lengths of finished samples:

- :class:`OnlineLengthPredictor`: token-conditioned ridge regression of log length on the policy's own hidden
  states (prompt feature, and the latest token's hidden state after k tokens), trained online from every finished
  sample with exponential forgetting, so it follows the policy as it drifts. No second model.
- :class:`HistoryLengthPredictor`: per-prompt mean log length (prompts recur across epochs), global fallback.
- :class:`OracleLengthPredictor`: the true lengths of a forced-length replay, for benchmarks.

Before any token is sampled the G samples of a prompt are exchangeable, so a prompt-level predictor gives all of
them the same length; only the token-conditioned prediction separates them (see ``token_conditioned``).

Every predictor also reports ``log_std``: the root-mean-square error of its log-length predictions on samples it
had not yet learned from (prequential), used to turn a point prediction into expectations
(:func:`expected_length`). Metrics of prediction quality: :func:`kendall_tau`, :func:`smape`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from lit_grpo.scheduling.base import RolloutWork, SampleKey

#: The error spread assumed before a predictor has seen anything (std of log length; e^1 ~ factor 2.7).
PRIOR_LOG_STD = 1.0


@runtime_checkable
class LengthPredictor(Protocol):
    """Predicts total completion lengths (EOS included) and learns from finished samples."""

    #: The predictor reads ``work.prompt_features`` (the engine then computes them).
    needs_prompt_features: bool
    #: ``predict`` improves when given the hidden state after a sample's first k tokens (worth a probe).
    token_conditioned: bool

    def predict(
        self, work: RolloutWork, keys: Sequence[SampleKey], token_features: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Predicted lengths ``[N]`` (float tokens, the median) of ``keys``; ``token_features``: ``[N, H]``."""
        ...

    def log_std(self, token_conditioned: bool) -> float:
        """Spread of log(true / predicted) for predictions with or without token features."""
        ...

    def observe(
        self,
        work: RolloutWork,
        keys: Sequence[SampleKey],
        lengths: Sequence[int],
        token_features: torch.Tensor | None = None,
    ) -> None:
        """Learn from finished samples: their total ``lengths`` and, if probed, their ``[N, H]`` token features."""
        ...

    def state_dict(self) -> dict:
        ...

    def load_state_dict(self, state: dict) -> None:
        ...


class RidgeRegressor:
    """Ridge regression in closed form from exponentially decayed sufficient statistics.

    Keeps ``sum w``, ``sum w x``, ``sum w x x^T``, ``sum w y``, ``sum w x y`` (float64), so an update costs
    ``O(N d^2)`` and a fit one Cholesky solve per penalty, whatever the number of observations. Features are
    centered and divided by one common scale at fit time (from the same statistics), so one penalty grid suits
    any feature scale; the intercept is not penalized. Several penalties are fitted at once; the one with the
    lowest prequential error (error on new observations before they are learned) is used, which replaces
    cross-validation.

    Args:
        decay: each new observation multiplies the weight of all older ones by this (1.0: no forgetting).
        alphas: penalties, in units of pseudo-observations per standardized feature.
        min_refit: refit after at least this many new observations (and 10% of the effective count).
    """

    def __init__(self, decay: float = 0.998, alphas: Sequence[float] = (0.1, 1.0, 10.0, 100.0, 1000.0),
                 min_refit: int = 4) -> None:
        self.decay = decay
        self.alphas = tuple(float(a) for a in alphas)
        self.min_refit = min_refit
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
        if self.sw > 0:
            # Prequential error of every penalty, before the model sees these targets.
            errors = (self._predict_all(x) - y[None, :]) ** 2  # [A, N]
            self.alpha_sq_err = self.alpha_sq_err * self.decay ** len(y) + errors.sum(dim=1)
        n = len(y)
        # Row i of the batch is followed by n - 1 - i newer observations.
        w = self.decay ** torch.arange(n - 1, -1, -1, dtype=torch.float64)
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
        if self.alpha_sq_err.sum() == 0:
            return self.alphas.index(10.0) if 10.0 in self.alphas else len(self.alphas) // 2
        return int(torch.argmin(self.alpha_sq_err))

    def _predict_all(self, x: torch.Tensor) -> torch.Tensor:
        """``[A, N]``: one row per penalty."""
        self._maybe_fit()
        if self._fit is None:
            mean_y = self.sy / self.sw if self.sw > 0 else 0.0
            return torch.full((len(self.alphas), x.shape[0]), mean_y, dtype=torch.float64)
        weights, mean_x, mean_y = self._fit
        return mean_y + weights @ (x - mean_x).T

    def _maybe_fit(self) -> None:
        due = self.new_since_fit >= max(self.min_refit, 0.1 * self.effective_count)
        if self._fit is not None and not due:
            return
        if self.effective_count < 3 or self.dim is None:
            self._fit = None
            return
        self._fit = self._solve()
        self.new_since_fit = 0

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
            # Penalty alpha on the total squared error = alpha / n on the mean squared error.
            system = cov_std + (alpha / self.effective_count) * eye
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
        self.decay = state["decay"]
        self.alphas = tuple(state["alphas"])
        self._reset_stats(state["dim"] or 0)
        self.sw, self.sw2, self.sy = state["sw"], state["sw2"], state["sy"]
        self.sx, self.sxx, self.sxy = state["sx"].clone(), state["sxx"].clone(), state["sxy"].clone()
        self.alpha_sq_err = state["alpha_sq_err"].clone()
        self.new_since_fit = state["new_since_fit"]
        fit = state["fit"]
        self._fit = None if fit is None else (fit[0].clone(), fit[1].clone(), fit[2])


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


@contextlib.contextmanager
def single_thread():
    """Run the predictor's small tensor ops and solves on one thread: intra-op threading on a few hundred dims
    only adds overhead, a lot of it when the CPU is shared (measured: a 128-dim Cholesky 0.1 ms on one thread,
    20 ms on two busy cores). The caller's thread count is restored."""
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


def prior_log_length(max_new_tokens: int) -> float:
    """Log length assumed before anything is observed: a quarter of the cap (any constant ranks samples alike)."""
    return math.log(max(1.0, max_new_tokens / 4))


class OnlineLengthPredictor:
    """Token-conditioned ridge regression of log length on the policy's own hidden states, learned online.

    Two regressors share the feature map: a prompt model on ``phi(prompt feature)`` (all G samples of a prompt
    get its prediction) and a token model on ``[phi(prompt feature), phi(token feature)]``, where the token
    feature is the last-layer hidden state of a sample's latest token after its first k tokens.
    ``phi`` = RMS normalization, then a fixed Gaussian projection to ``max_dim`` dims when H is larger (keeps the
    closed-form solve at ``O(d^3)`` with ``d <= 2 max_dim``). The token model learns only from samples that
    survived the probe (it predicts for exactly those), the prompt model from all.

    Args:
        max_dim: projected size of each feature part.
        decay: forgetting factor per observation (0.998: half-life ~350 samples), so the model follows the policy.
        min_token_observations: below this many probed samples the prompt model answers instead.
        seed: of the projection matrices.
    """

    needs_prompt_features = True
    token_conditioned = True

    def __init__(self, max_dim: int = 256, decay: float = 0.998, min_token_observations: int = 16,
                 seed: int = 0) -> None:
        self.max_dim = max_dim
        self.seed = seed
        self.min_token_observations = min_token_observations
        self.prompt_model = RidgeRegressor(decay=decay)
        self.token_model = RidgeRegressor(decay=decay)
        self.prompt_error = PrequentialError()
        self.token_error = PrequentialError()
        self._projections: dict[int, torch.Tensor] = {}
        self._fallback = None  # log length used while the prompt model is empty

    def predict(
        self, work: RolloutWork, keys: Sequence[SampleKey], token_features: torch.Tensor | None = None
    ) -> torch.Tensor:
        with single_thread():
            return self._predict_log(work, keys, token_features).exp().to(torch.float32)

    def log_std(self, token_conditioned: bool) -> float:
        if token_conditioned and self.token_model.effective_count >= self.min_token_observations:
            return self.token_error.rms
        return self.prompt_error.rms

    def observe(
        self,
        work: RolloutWork,
        keys: Sequence[SampleKey],
        lengths: Sequence[int],
        token_features: torch.Tensor | None = None,
    ) -> None:
        if not keys:
            return
        with single_thread():
            self._observe(work, keys, lengths, token_features)

    def _observe(
        self, work: RolloutWork, keys: Sequence[SampleKey], lengths: Sequence[int], token_features: torch.Tensor | None
    ) -> None:
        target = torch.tensor([math.log(max(1, int(n))) for n in lengths], dtype=torch.float64)
        prompt_x = self._prompt_x(work, keys)
        for error in (self._predict_log(work, keys, None) - target).tolist():
            self.prompt_error.add(error)
        self.prompt_model.update(prompt_x, target)
        if token_features is not None:
            token_x = torch.cat([prompt_x, self._phi(token_features)], dim=1)
            if self.token_model.effective_count >= self.min_token_observations:
                for error in (self._predict_log(work, keys, token_features) - target).tolist():
                    self.token_error.add(error)
            self.token_model.update(token_x, target)

    def _predict_log(
        self, work: RolloutWork, keys: Sequence[SampleKey], token_features: torch.Tensor | None
    ) -> torch.Tensor:
        # A linear model extrapolates; lengths live in [1, max_new_tokens].
        return self._predict_log_raw(work, keys, token_features).clamp(0.0, math.log(max(1, work.max_new_tokens)))

    def _predict_log_raw(
        self, work: RolloutWork, keys: Sequence[SampleKey], token_features: torch.Tensor | None
    ) -> torch.Tensor:
        prompt_x = self._prompt_x(work, keys)
        if token_features is not None and self.token_model.effective_count >= self.min_token_observations:
            token_x = torch.cat([prompt_x, self._phi(token_features)], dim=1)
            if token_x.shape[1] == self.token_model.dim:
                return self.token_model.predict(token_x)
        if self.prompt_model.sw > 0 and prompt_x.shape[1] == (self.prompt_model.dim or 0):
            return self.prompt_model.predict(prompt_x)
        return torch.full((len(keys),), prior_log_length(work.max_new_tokens), dtype=torch.float64)

    def _prompt_x(self, work: RolloutWork, keys: Sequence[SampleKey]) -> torch.Tensor:
        """``[N, d]`` prompt part; ``[N, 1]`` of zeros (an intercept-only model) when the engine gave none."""
        if work.prompt_features is None:
            return torch.zeros(len(keys), 1, dtype=torch.float64)
        # A list index works on any device; only the selected rows travel to the CPU.
        return self._phi(work.prompt_features[[p for p, _ in keys]])

    def _phi(self, features: torch.Tensor) -> torch.Tensor:
        """``[N, H] -> [N, min(H, max_dim)]``: RMS-normalize, then project if H is large."""
        x = rms_normalize(features.detach().to("cpu"))
        hidden = x.shape[1]
        if hidden <= self.max_dim:
            return x
        if hidden not in self._projections:
            generator = torch.Generator().manual_seed(self.seed + hidden)
            matrix = torch.randn(hidden, self.max_dim, generator=generator, dtype=torch.float64)
            self._projections[hidden] = matrix / math.sqrt(self.max_dim)
        return x @ self._projections[hidden]

    def state_dict(self) -> dict:
        return {
            "max_dim": self.max_dim, "seed": self.seed, "min_token_observations": self.min_token_observations,
            "prompt_model": self.prompt_model.state_dict(), "token_model": self.token_model.state_dict(),
            "prompt_error": self.prompt_error.state_dict(), "token_error": self.token_error.state_dict(),
            "projections": {h: m.clone() for h, m in self._projections.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.max_dim, self.seed = state["max_dim"], state["seed"]
        self.min_token_observations = state["min_token_observations"]
        self.prompt_model.load_state_dict(state["prompt_model"])
        self.token_model.load_state_dict(state["token_model"])
        self.prompt_error.load_state_dict(state["prompt_error"])
        self.token_error.load_state_dict(state["token_error"])
        self._projections = {int(h): m.clone() for h, m in state["projections"].items()}


class HistoryLengthPredictor:
    """Per-prompt mean log length, keyed by the prompt's token ids; a global mean for unseen prompts.

    Args:
        decay: forgetting factor per observation of the same prompt (0.97: the last ~two visits of G = 16).
        global_decay: forgetting factor of the global mean, per observation.
    """

    needs_prompt_features = False
    token_conditioned = False

    def __init__(self, decay: float = 0.97, global_decay: float = 0.998) -> None:
        self.decay = decay
        self.global_decay = global_decay
        self.table: dict[str, list[float]] = {}  # digest -> [sum w, sum w log L]
        self.global_stats = [0.0, 0.0]
        self.error = PrequentialError()

    def predict(
        self, work: RolloutWork, keys: Sequence[SampleKey], token_features: torch.Tensor | None = None
    ) -> torch.Tensor:
        return torch.tensor([math.exp(self._log_prediction(work, p)) for p, _ in keys], dtype=torch.float32)

    def log_std(self, token_conditioned: bool) -> float:
        return self.error.rms

    def observe(
        self,
        work: RolloutWork,
        keys: Sequence[SampleKey],
        lengths: Sequence[int],
        token_features: torch.Tensor | None = None,
    ) -> None:
        for (p, _), length in zip(keys, lengths):
            target = math.log(max(1, int(length)))
            self.error.add(self._log_prediction(work, p) - target)
            digest = prompt_digest(work, p)
            if digest is not None:
                stats = self.table.setdefault(digest, [0.0, 0.0])
                stats[0] = stats[0] * self.decay + 1.0
                stats[1] = stats[1] * self.decay + target
            self.global_stats[0] = self.global_stats[0] * self.global_decay + 1.0
            self.global_stats[1] = self.global_stats[1] * self.global_decay + target

    def _log_prediction(self, work: RolloutWork, prompt: int) -> float:
        digest = prompt_digest(work, prompt)
        stats = self.table.get(digest) if digest is not None else None
        if stats and stats[0] > 0:
            return stats[1] / stats[0]
        if self.global_stats[0] > 0:
            return self.global_stats[1] / self.global_stats[0]
        return prior_log_length(work.max_new_tokens)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "global_decay": self.global_decay,
                "table": {k: list(v) for k, v in self.table.items()}, "global_stats": list(self.global_stats),
                "error": self.error.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.global_decay = state["decay"], state["global_decay"]
        self.table = {k: list(v) for k, v in state["table"].items()}
        self.global_stats = list(state["global_stats"])
        self.error.load_state_dict(state["error"])


def prompt_digest(work: RolloutWork, prompt: int) -> str | None:
    """A stable key for a prompt's token ids (Python's hash() changes between processes)."""
    if prompt >= len(work.prompt_ids):
        return None
    data = ",".join(str(int(t)) for t in work.prompt_ids[prompt]).encode()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class OracleLengthPredictor:
    """The true lengths of a forced-length replay (``work.true_lengths``): the upper bound of any predictor."""

    needs_prompt_features = False
    token_conditioned = False

    def predict(
        self, work: RolloutWork, keys: Sequence[SampleKey], token_features: torch.Tensor | None = None
    ) -> torch.Tensor:
        if work.true_lengths is None:
            raise ValueError("the oracle predictor needs work.true_lengths (a forced-length replay)")
        return torch.tensor([float(work.true_lengths[p][k]) for p, k in keys], dtype=torch.float32)

    def log_std(self, token_conditioned: bool) -> float:
        return 0.0

    def observe(
        self,
        work: RolloutWork,
        keys: Sequence[SampleKey],
        lengths: Sequence[int],
        token_features: torch.Tensor | None = None,
    ) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


PREDICTORS = {
    "online": OnlineLengthPredictor,
    "history": HistoryLengthPredictor,
    "oracle": OracleLengthPredictor,
}


def make_predictor(name: str, **kwargs) -> LengthPredictor:
    """A predictor from its name: "online" | "history" | "oracle"; kwargs go to its constructor."""
    if name not in PREDICTORS:
        raise ValueError(f"unknown length predictor {name!r}; allowed: {', '.join(PREDICTORS)}")
    return PREDICTORS[name](**kwargs)


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


def kendall_tau(predicted: Sequence[float] | torch.Tensor, true: Sequence[float] | torch.Tensor) -> float:
    """Kendall's tau-b between two equal-length sequences; 0.0 when either is constant (no ranking).

    ``O(n^2)`` pairs, in row chunks so that 4096 samples stay within a few MB.
    """
    x = torch.as_tensor(predicted, dtype=torch.float64).flatten()
    y = torch.as_tensor(true, dtype=torch.float64).flatten()
    n = x.numel()
    if n < 2:
        return 0.0
    concordance = 0.0
    ties_x = ties_y = 0.0
    for start in range(0, n, 512):
        dx = torch.sign(x[start:start + 512, None] - x[None, :])
        dy = torch.sign(y[start:start + 512, None] - y[None, :])
        concordance += float((dx * dy).sum())
        ties_x += float((dx == 0).sum())
        ties_y += float((dy == 0).sum())
    pairs = n * (n - 1) / 2
    # Each unordered pair was seen twice, and every sample tied with itself once.
    tied_x = (ties_x - n) / 2
    tied_y = (ties_y - n) / 2
    denominator = math.sqrt((pairs - tied_x) * (pairs - tied_y))
    return concordance / 2 / denominator if denominator > 0 else 0.0


def smape(predicted: Sequence[float] | torch.Tensor, true: Sequence[float] | torch.Tensor) -> float:
    """Symmetric mean absolute percentage error ``mean(|p - t| / ((|p| + |t|) / 2))`` in [0, 2]; 0/0 counts 0."""
    p = torch.as_tensor(predicted, dtype=torch.float64).flatten()
    t = torch.as_tensor(true, dtype=torch.float64).flatten()
    if p.numel() == 0:
        return 0.0
    denominator = (p.abs() + t.abs()) / 2
    ratio = torch.where(denominator > 0, (p - t).abs() / denominator.clamp_min(1e-300), torch.zeros_like(p))
    return float(ratio.mean())
