"""Length predictors of the length-aware scheduler: how many tokens will a sample generate in total?

A predictor answers for a batch of samples (keys ``(prompt, sample)`` of a :class:`RolloutWork`), optionally given
each sample's hidden state after its first k tokens, and learns from the lengths of finished samples:

- :class:`OnlineLengthPredictor` (``"online"``): the paper's token-conditioned predictor: ridge regression of log
  length on the policy's own hidden states (prompt feature, and the latest token's hidden state after k tokens),
  learned online from every finished sample with exponential forgetting. No second model.
- :class:`OracleLengthPredictor` (``"oracle"``): the true lengths of a forced-length replay, for benchmarks.
- :class:`NoisyOraclePredictor` (``"noisy:S"``): the oracle with log-normal error of spread S, for the curve of
  decode steps against prediction error.

Before any token is sampled the G samples of a prompt are exchangeable, so a prompt-level prediction gives all of
them the same length; only the token-conditioned prediction separates them (``token_conditioned``). How far a
prediction is believed is the scheduler's trust (``trust.py``), not the predictor's own claim.

Also here: the lognormal expectation the scheduler plans with (:func:`expected_length`) and the quality metrics
(:func:`kendall_tau`, :func:`smape`, :func:`log_rmse`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist
from typing import Any, Protocol, get_args, runtime_checkable

import torch

from lit_grpo.runtime.validation import (
    SEED_MAX,
    check_choice,
    check_int,
    check_int_in_range,
    check_real,
    check_state_keys,
    integer_within,
    shown_setting,
    shown_value,
)
from lit_grpo.scheduling.base import RolloutWork, SampleKey
from lit_grpo.scheduling.config import PredictorName
from lit_grpo.scheduling.length_aware.ridge import (
    RidgeRegressor,
    check_tensor,
    checked_state,
    rms_normalize,
    single_thread,
)

#: The widest log-length spread worth reasoning with (beyond e^4 a spread means "unknown" anyway).
MAX_LOG_STD = 4.0


@runtime_checkable
class LengthPredictor(Protocol):
    """Predicts total completion lengths (EOS included) and learns from finished samples."""

    #: The predictor reads ``work.prompt_features`` (the engine then computes them).
    needs_prompt_features: bool
    #: ``predict`` improves when given the hidden state after a sample's first k tokens (worth a probe).
    token_conditioned: bool

    def predict(self, work: RolloutWork, keys: Sequence[SampleKey],
                token_features: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted lengths ``[N]`` (float tokens, the median) of ``keys``; ``token_features``: ``[N, H]``."""
        ...

    def observe(self, work: RolloutWork, keys: Sequence[SampleKey], lengths: Sequence[int],
                token_features: torch.Tensor | None = None) -> None:
        """Learn from finished samples: their total ``lengths`` and, if probed, their ``[N, H]`` token features."""
        ...

    def state_dict(self) -> dict:
        ...

    def load_state_dict(self, state: dict) -> None:
        ...


def prior_log_length(max_new_tokens: int) -> float:
    """Log length assumed before anything is observed: a quarter of the cap (any constant ranks samples alike)."""
    return math.log(max(1.0, max_new_tokens / 4))


class OnlineLengthPredictor:
    """Token-conditioned ridge regression of log length on the policy's own hidden states, learned online.

    Two regressors share the feature map: a prompt model on ``phi(prompt feature)`` (all G samples of a prompt
    get its prediction) and a token model on ``[phi(prompt feature), phi(token feature)]``, where the token feature
    is the last-layer hidden state of a sample's latest token after its first k tokens. ``phi`` = RMS
    normalization, then a fixed Gaussian projection to ``max_dim`` dims when H is larger (keeps the closed-form
    solve at ``O(d^3)``, ``d <= 2 max_dim``). The token model learns only from probed samples (it predicts for
    exactly those), the prompt model from all.

    Args:
        max_dim: projected size of each feature part.
        decay: forgetting factor per observation (0.998: half-life ~350 samples), so the model follows the policy;
            in (0.5, 1] (``RidgeRegressor``).
        min_token_observations: below this many probed samples the prompt model answers instead.
        seed: of the projection matrices, in [0, 2**32 - 1].
    """

    needs_prompt_features = True
    token_conditioned = True

    def __init__(self, max_dim: int = 256, decay: float = 0.998, min_token_observations: int = 16,
                 seed: int = 0) -> None:
        self.max_dim = check_int("max_dim", max_dim, 1)
        self.min_token_observations = check_int("min_token_observations", min_token_observations, 0)
        # added to the hidden size as a torch seed: a float failed there, and one beyond the generator's range
        self.seed = check_int_in_range("seed", seed, 0, SEED_MAX)
        self.prompt_model = RidgeRegressor(decay=decay)
        self.token_model = RidgeRegressor(decay=decay)
        self._projections: dict[int, torch.Tensor] = {}
        self._prompt_phi: tuple[torch.Tensor, torch.Tensor] | None = None  # (the rollout's features, their phi)

    def predict(self, work: RolloutWork, keys: Sequence[SampleKey],
                token_features: torch.Tensor | None = None) -> torch.Tensor:
        with single_thread():
            prompt_x = self._prompt_x(work, keys)
            if token_features is not None and self.token_model.effective_count >= self.min_token_observations:
                token_x = torch.cat([prompt_x, self._phi(token_features)], dim=1)
                if token_x.shape[1] == self.token_model.dim:
                    return self._lengths(self.token_model.predict(token_x), work)
            if self.prompt_model.sw > 0 and prompt_x.shape[1] == (self.prompt_model.dim or 0):
                return self._lengths(self.prompt_model.predict(prompt_x), work)
            return torch.full((len(keys),), math.exp(prior_log_length(work.max_new_tokens)))

    def observe(self, work: RolloutWork, keys: Sequence[SampleKey], lengths: Sequence[int],
                token_features: torch.Tensor | None = None) -> None:
        if not keys:
            return
        with single_thread():
            target = torch.tensor([math.log(max(1, int(n))) for n in lengths], dtype=torch.float64)
            prompt_x = self._prompt_x(work, keys)
            self.prompt_model.update(prompt_x, target)
            if token_features is not None:
                self.token_model.update(torch.cat([prompt_x, self._phi(token_features)], dim=1), target)

    @staticmethod
    def _lengths(log_lengths: torch.Tensor, work: RolloutWork) -> torch.Tensor:
        # A linear model extrapolates; lengths live in [1, max_new_tokens].
        return log_lengths.clamp(0.0, math.log(max(1, work.max_new_tokens))).exp().to(torch.float32)

    def _prompt_x(self, work: RolloutWork, keys: Sequence[SampleKey]) -> torch.Tensor:
        """``[N, d]`` prompt part; ``[N, 1]`` of zeros (an intercept-only model) when the engine gave none."""
        if work.prompt_features is None:
            return torch.zeros(len(keys), 1, dtype=torch.float64)
        # Every prompt's row is mapped once per rollout: the scheduler asks for a few rows at a time, many times,
        # and on a GPU the host's time between decode steps is the accelerator's idle time.
        features = work.prompt_features
        if self._prompt_phi is None or self._prompt_phi[0] is not features:
            self._prompt_phi = (features, self._phi(features))
        return self._prompt_phi[1][[p for p, _ in keys]]

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
        return {"max_dim": self.max_dim, "seed": self.seed, "min_token_observations": self.min_token_observations,
                "prompt_model": self.prompt_model.state_dict(), "token_model": self.token_model.state_dict(),
                "projections": {h: m.clone() for h, m in self._projections.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Take ``state`` (``state_dict``'s, from a checkpoint), checked whole first, both models' states among it:
        a corrupt or foreign one is refused naming the bad key, and leaves this predictor as it was."""
        what, prefix = "an OnlineLengthPredictor state", "online predictor state "
        check_state_keys(what, state, _ONLINE_STATE_KEYS)
        max_dim = check_int(prefix + "max_dim", state["max_dim"], 1)
        seed = check_int_in_range(prefix + "seed", state["seed"], 0, SEED_MAX)
        min_token_observations = check_int(prefix + "min_token_observations", state["min_token_observations"], 0)
        prompt_model, token_model = (checked_state(state[name], f"{what}'s {name}", f"{prefix}{name}.")
                                     for name in ("prompt_model", "token_model"))
        projections = _checked_projections(prefix + "projections", state["projections"], max_dim)
        self.max_dim, self.seed, self.min_token_observations = max_dim, seed, min_token_observations
        self.prompt_model.take_state(prompt_model)
        self.token_model.take_state(token_model)
        self._projections = projections
        self._prompt_phi = None


#: The keys of an ``OnlineLengthPredictor`` state, each required.
_ONLINE_STATE_KEYS = ("max_dim", "seed", "min_token_observations", "prompt_model", "token_model", "projections")


def _checked_projections(name: str, projections: Any, max_dim: int) -> dict[int, torch.Tensor]:
    """The projections ``name`` of an online predictor's state (``{hidden size: [hidden size, max_dim]}``, made only
    for hidden sizes above ``max_dim``) as float64 copies, else a ValueError naming the bad key or matrix."""
    if not isinstance(projections, Mapping):
        raise ValueError(f"{name} must be a mapping of hidden sizes to their projections, not "
                         f"{type(projections).__name__}")
    checked = {}
    for hidden, matrix in projections.items():
        size, key = integer_within(hidden, max_dim + 1), f"{name}[{shown_value(hidden)}]"
        if size is None:
            raise ValueError(f"{key} is not allowed; a projection's key is the hidden size it maps, an integer > "
                             f"max_dim={max_dim}")
        checked[size] = check_tensor(key, matrix, [size, max_dim], "hidden size x max_dim")
    return checked


class OracleLengthPredictor:
    """The true lengths of a forced-length replay (``work.true_lengths``): the upper bound of any predictor."""

    needs_prompt_features = False
    token_conditioned = False

    def predict(self, work: RolloutWork, keys: Sequence[SampleKey],
                token_features: torch.Tensor | None = None) -> torch.Tensor:
        if work.true_lengths is None:
            raise ValueError("the oracle predictor needs work.true_lengths (a forced-length replay)")
        return torch.tensor([float(work.true_lengths[p][k]) for p, k in keys], dtype=torch.float32)

    def observe(self, work: RolloutWork, keys: Sequence[SampleKey], lengths: Sequence[int],
                token_features: torch.Tensor | None = None) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to take; a state that holds something is another predictor's, refused naming its keys."""
        check_state_keys("an OracleLengthPredictor state", state, ())


class NoisyOraclePredictor(OracleLengthPredictor):
    """The oracle's true length times ``exp(N(0, S^2))`` per sample, clamped to ``[1, max_new_tokens]``.

    A predictor whose error is known, to measure how decode steps grow with prediction error. The noise of sample
    ``(p, k)`` is a pure function of ``(seed, p, k, rollout)``, so runs are reproducible and every scheduler driven
    through the same rollouts sees the same errors; rollouts are counted here (a new ``RolloutWork`` is a new one).

    Args:
        log_std: S, the spread of the log-length error (>= 0; 0 is the oracle).
        seed: base of the noise, in [0, 2**32 - 1].
    """

    def __init__(self, log_std: float, seed: int = 0) -> None:
        self.spread = check_spread(log_std)
        self.seed = check_int_in_range("seed", seed, 0, SEED_MAX)  # int() took 1.5 as 1 and True as 1
        self.rollout = -1
        self.current_work: RolloutWork | None = None

    def predict(self, work: RolloutWork, keys: Sequence[SampleKey],
                token_features: torch.Tensor | None = None) -> torch.Tensor:
        true = super().predict(work, keys).tolist()
        if work is not self.current_work:
            self.current_work, self.rollout = work, self.rollout + 1
        noisy = [length * math.exp(self.spread * _standard_normal(self.seed, p, k, self.rollout))
                 for length, (p, k) in zip(true, keys)]
        return torch.tensor([min(max(x, 1.0), work.max_new_tokens) for x in noisy], dtype=torch.float32)

    def state_dict(self) -> dict:
        return {"spread": self.spread, "seed": self.seed, "rollout": self.rollout}

    def load_state_dict(self, state: dict) -> None:
        """Take ``state`` (``state_dict``'s), checked whole first: a bad one is refused naming the bad key."""
        check_state_keys("a NoisyOraclePredictor state", state, ("spread", "seed", "rollout"))
        spread = check_real("noisy predictor state spread", state["spread"], low=0)
        seed = check_int_in_range("noisy predictor state seed", state["seed"], 0, SEED_MAX)
        rollout = check_int("noisy predictor state rollout", state["rollout"], -1, "-1: before the first rollout")
        self.spread, self.seed, self.rollout = spread, seed, rollout
        self.current_work = None


def _standard_normal(*key: int) -> float:
    """A standard normal draw that depends on ``key`` only (blake2b, not Python's per-process ``hash``)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return NormalDist().inv_cdf((int.from_bytes(digest, "big") + 0.5) / 2 ** 64)


def check_spread(value: object, name: str = "noisy predictor log_std") -> float:
    """``value`` as a finite float >= 0, or a ValueError naming it."""
    try:
        spread = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond float range
        spread = math.nan
    if isinstance(value, bool) or not math.isfinite(spread) or spread < 0:
        raise ValueError(f"{shown_setting(name, value)} must be a finite number >= 0 (the spread of the log-length "
                         "error, e.g. 0.25)")
    return spread


PREDICTORS = {"online": OnlineLengthPredictor, "oracle": OracleLengthPredictor, "noisy": NoisyOraclePredictor}
#: How each name is written where a string is expected (configs, --predictors).
PREDICTOR_NAMES = (*get_args(PredictorName), "noisy:S (S >= 0, e.g. noisy:0.25)")


def parse_predictor_name(name: str) -> tuple[str, dict]:
    """``(registry name, constructor kwargs)`` of "online" | "oracle" | "noisy:S"; a ValueError naming the bad name
    and what is allowed otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"length predictor {shown_value(name)} must be a name; allowed: {', '.join(PREDICTOR_NAMES)}")
    base, colon, argument = name.partition(":")
    if base == "noisy":
        if not colon:
            raise ValueError(f"length predictor {name!r} needs its spread: 'noisy:S' with S >= 0, e.g. 'noisy:0.25'")
        return base, {"log_std": check_spread(argument, f"length predictor {shown_value(name)}: S")}
    if colon or base not in PREDICTORS:
        check_choice("length predictor", name, PREDICTOR_NAMES)  # raises: no other name takes an argument
    return base, {}


def make_predictor(name: str, **kwargs) -> LengthPredictor:
    """A predictor from its name (:func:`parse_predictor_name`); kwargs go to its constructor (``seed``)."""
    base, parsed = parse_predictor_name(name)
    return PREDICTORS[base](**parsed, **kwargs)


def expected_length(median: float, log_std: float, survived: int, cap: int) -> float:
    """``E[min(L, cap) | L > survived]`` for ``L ~ LogNormal(log(median), log_std)``, in ``[survived + 1, cap]``.

    Turns a point prediction into the expected total length of a sample that has already generated ``survived``
    tokens without ending: a sample running past its prediction is expected to run on, by an amount that grows with
    the prediction's error spread.
    """
    floor = min(survived + 1, cap)
    if log_std < 1e-6 or median <= 0:
        return float(min(max(median, floor), cap))
    if survived >= cap:
        return float(cap)
    mu, s, log_cap = math.log(median), min(log_std, MAX_LOG_STD), math.log(cap)
    if survived > 0:  # P(L > a) and the matching upper limit of the body's integral
        log_a = math.log(survived)
        tail, body_upper = _normal_cdf((mu - log_a) / s), _normal_cdf((mu + s * s - log_a) / s)
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
    concordance = ties_x = ties_y = 0.0
    for start in range(0, n, 512):
        dx = torch.sign(x[start:start + 512, None] - x[None, :])
        dy = torch.sign(y[start:start + 512, None] - y[None, :])
        concordance += float((dx * dy).sum())
        ties_x += float((dx == 0).sum())
        ties_y += float((dy == 0).sum())
    pairs = n * (n - 1) / 2
    # Each unordered pair was seen twice, and every sample tied with itself once.
    denominator = math.sqrt((pairs - (ties_x - n) / 2) * (pairs - (ties_y - n) / 2))
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


def log_rmse(predicted: Sequence[float] | torch.Tensor, true: Sequence[float] | torch.Tensor) -> float:
    """Root-mean-square of ``log(predicted / true)`` (both clamped to >= 1 token); NaN for no pairs."""
    p = torch.as_tensor(predicted, dtype=torch.float64).flatten().clamp_min(1.0)
    t = torch.as_tensor(true, dtype=torch.float64).flatten().clamp_min(1.0)
    return float((p.log() - t.log()).pow(2).mean().sqrt()) if p.numel() else math.nan
