"""Length predictors: how many tokens will a sample generate in total?

A predictor answers for a batch of samples (keys ``(prompt, sample)`` of a :class:`RolloutWork`), optionally
given each sample's hidden state after its first k tokens, and learns from the lengths of finished samples:

- :class:`OnlineLengthPredictor`: token-conditioned ridge regression of log length on the policy's own hidden
  states (prompt feature, and the latest token's hidden state after k tokens), trained online from every finished
  sample with exponential forgetting, so it follows the policy as it drifts. No second model.
- :class:`HistoryLengthPredictor`: per-prompt mean log length (prompts recur across epochs), global fallback.
- :class:`~lit_grpo.scheduling.group_predictor.GroupLengthPredictor` (``"group"``): the shrunk mean of a sample's
  siblings that finished in this rollout (group context).
- :class:`~lit_grpo.scheduling.combined_predictor.CombinedLengthPredictor` (``"online+group"``, any parts joined
  by ``+``): the parts' log predictions stacked with learned weights.
- :class:`OracleLengthPredictor`: the true lengths of a forced-length replay, for benchmarks.
- :class:`NoisyOraclePredictor` (``"noisy:S"``): the oracle with log-normal error of spread S, for the curve of
  decode steps against prediction error.

Before any token is sampled the G samples of a prompt are exchangeable, so a prompt-level predictor gives all of
them the same length; only the token-conditioned prediction separates them (see ``token_conditioned``).

Every predictor also reports ``log_std``: the root-mean-square error of its log-length predictions on samples it
had not yet learned from (prequential), used to turn a point prediction into expectations
(:func:`~lit_grpo.scheduling.lognormal.expected_length`). Metrics of prediction quality:
:func:`~lit_grpo.scheduling.prediction_metrics.kendall_tau`, :func:`~lit_grpo.scheduling.prediction_metrics.smape`.

Files: this one holds the protocol, the registry and the two simple predictors; ``online_predictor.py`` the
token-conditioned one (on ``ridge.py``); ``lognormal.py`` the length model; ``prediction_metrics.py`` the metrics.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import Literal, Protocol, get_args, runtime_checkable

import torch

from lit_grpo.runtime.validation import check_choice
from lit_grpo.scheduling.base import RolloutWork, SampleKey
from lit_grpo.scheduling.combined_predictor import CombinedLengthPredictor
from lit_grpo.scheduling.group_predictor import GroupLengthPredictor
from lit_grpo.scheduling.lognormal import PRIOR_LOG_STD, PrequentialError, expected_length, prior_log_length
from lit_grpo.scheduling.online_predictor import OnlineLengthPredictor
from lit_grpo.scheduling.prediction_metrics import kendall_tau, smape

__all__ = [
    "PRIOR_LOG_STD",
    "CombinedLengthPredictor",
    "GroupLengthPredictor",
    "HistoryLengthPredictor",
    "LengthPredictor",
    "NoisyOraclePredictor",
    "OnlineLengthPredictor",
    "OracleLengthPredictor",
    "PREDICTORS",
    "PredictorName",
    "expected_length",
    "kendall_tau",
    "make_predictor",
    "parse_predictor_name",
    "prior_log_length",
    "smape",
]


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
            digest = work.prompt_digest(p)
            if digest is not None:
                stats = self.table.setdefault(digest, [0.0, 0.0])
                stats[0] = stats[0] * self.decay + 1.0
                stats[1] = stats[1] * self.decay + target
            self.global_stats[0] = self.global_stats[0] * self.global_decay + 1.0
            self.global_stats[1] = self.global_stats[1] * self.global_decay + target

    def _log_prediction(self, work: RolloutWork, prompt: int) -> float:
        digest = work.prompt_digest(prompt)
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


class NoisyOraclePredictor:
    """The oracle's true length times ``exp(N(0, S^2))`` per sample, clamped to ``[1, max_new_tokens]``.

    A predictor whose error is known, to measure how decode steps grow with prediction error. The noise of sample
    ``(p, k)`` is a pure function of ``(seed, p, k, rollout)``, so runs are reproducible and every scheduler driven
    through the same rollouts sees the same errors; rollouts are counted here (a new ``RolloutWork`` is a new
    rollout). S is not revealed: ``log_std`` is the error measured on finished samples (prequential, from the
    prior the other predictors start from), as a real predictor's would be.

    Args:
        log_std: S, the spread of the log-length error (>= 0; 0 is the oracle).
        seed: base of the noise.
    """

    needs_prompt_features = False
    token_conditioned = False

    def __init__(self, log_std: float, seed: int = 0) -> None:
        self.spread = check_spread(log_std)
        self.seed = int(seed)
        self.rollout = -1
        self.current_work: RolloutWork | None = None
        self.error = PrequentialError()

    def predict(
        self, work: RolloutWork, keys: Sequence[SampleKey], token_features: torch.Tensor | None = None
    ) -> torch.Tensor:
        return torch.tensor([self._prediction(work, key) for key in keys], dtype=torch.float32)

    def log_std(self, token_conditioned: bool) -> float:
        return self.error.rms

    def observe(
        self,
        work: RolloutWork,
        keys: Sequence[SampleKey],
        lengths: Sequence[int],
        token_features: torch.Tensor | None = None,
    ) -> None:
        for key, length in zip(keys, lengths):
            self.error.add(math.log(self._prediction(work, key)) - math.log(max(1, int(length))))

    def _prediction(self, work: RolloutWork, key: SampleKey) -> float:
        if work.true_lengths is None:
            raise ValueError("the noisy oracle predictor needs work.true_lengths (a forced-length replay)")
        if work is not self.current_work:
            self.current_work = work
            self.rollout += 1
        p, k = key
        noisy = work.true_lengths[p][k] * math.exp(self.spread * _standard_normal(self.seed, p, k, self.rollout))
        return float(min(max(noisy, 1.0), work.max_new_tokens))

    def state_dict(self) -> dict:
        return {"spread": self.spread, "seed": self.seed, "rollout": self.rollout, "error": self.error.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.spread, self.seed, self.rollout = state["spread"], state["seed"], state["rollout"]
        self.current_work = None
        self.error.load_state_dict(state["error"])


def _standard_normal(*key: int) -> float:
    """A standard normal draw that depends on ``key`` only (blake2b, not Python's per-process ``hash``)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return NormalDist().inv_cdf((int.from_bytes(digest, "big") + 0.5) / 2 ** 64)


def check_spread(value: object, name: str = "noisy predictor log_std") -> float:
    """``value`` as a finite float >= 0, or a ValueError naming it."""
    try:
        spread = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        spread = math.nan
    if isinstance(value, bool) or not math.isfinite(spread) or spread < 0:
        raise ValueError(f"{name}={value!r} must be a finite number >= 0 (the spread of the log-length error, "
                         "e.g. 0.25)")
    return spread


#: The predictors named without an argument; "noisy:S" is the oracle with log-normal error of spread S, and names
#: joined by "+" (e.g. "online+group") combine predictors.
PredictorName = Literal["online", "history", "group", "oracle"]
PREDICTORS = dict(zip((*get_args(PredictorName), "noisy"), (OnlineLengthPredictor, HistoryLengthPredictor,
                                                           GroupLengthPredictor, OracleLengthPredictor,
                                                           NoisyOraclePredictor)))
#: How each name is written where a string is expected (configs, --predictors).
PREDICTOR_NAMES = (*get_args(PredictorName), "noisy:S (S >= 0, e.g. noisy:0.25)",
                   "NAME+NAME (combined, e.g. online+group)")


def parse_predictor_name(name: str, spread_given: bool = False) -> tuple[str, dict]:
    """``(registry name, constructor kwargs)`` of a predictor name: "online" | "history" | "group" | "oracle" |
    "noisy:S" (bare "noisy" only when ``spread_given``: the spread comes as a keyword) | parts joined by "+"
    (``("combined", {"parts": [names]})``); a ValueError naming the bad name and what is allowed otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"length predictor {name!r} must be a name; allowed: {', '.join(PREDICTOR_NAMES)}")
    if "+" in name:
        parts = name.split("+")
        for part in parts:
            if not part:
                raise ValueError(f"length predictor {name!r}: empty part; join names with single '+'")
            parse_predictor_name(part)
        if len(set(parts)) != len(parts):
            raise ValueError(f"length predictor {name!r} names a part twice")
        return "combined", {"parts": parts}
    base, colon, argument = name.partition(":")
    if base == "noisy" and colon:
        return base, {"log_std": check_spread(argument, f"length predictor {name!r}: S")}
    if base == "noisy" and not spread_given:
        raise ValueError(f"length predictor {name!r} needs its spread: 'noisy:S' with S >= 0, e.g. 'noisy:0.25'")
    if colon or base not in PREDICTORS:
        check_choice("length predictor", name, PREDICTOR_NAMES)  # raises: no name of it takes an argument
    return base, {}


def make_predictor(name: str, **kwargs) -> LengthPredictor:
    """A predictor from its name (:func:`parse_predictor_name`); kwargs go to its constructor (to every part's
    that takes them, for a combined name: ``seed`` reaches the noisy oracle).

    ``make_predictor("noisy:0.25")`` equals ``make_predictor("noisy", log_std=0.25)``.
    """
    base, parsed = parse_predictor_name(name, spread_given="log_std" in kwargs)
    if base == "combined":
        accepted = set().union(*(_keywords(part) for part in parsed["parts"]))
        if set(kwargs) - accepted:
            raise ValueError(f"length predictor {name!r}: no part takes {sorted(set(kwargs) - accepted)}; its parts "
                             f"take {sorted(accepted)}")
        parts = [make_predictor(part, **{k: v for k, v in kwargs.items() if k in _keywords(part)})
                 for part in parsed["parts"]]
        return CombinedLengthPredictor(parts, names=parsed["parts"])
    if parsed and "log_std" in kwargs:
        raise ValueError(f"length predictor {name!r} already sets its spread; drop log_std={kwargs['log_std']!r}")
    return PREDICTORS[base](**parsed, **kwargs)


def _keywords(name: str) -> set[str]:
    """The constructor keywords of the predictor ``name`` names."""
    return set(inspect.signature(PREDICTORS[parse_predictor_name(name)[0]]).parameters)
