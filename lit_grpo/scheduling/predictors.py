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
(:func:`~lit_grpo.scheduling.lognormal.expected_length`). Metrics of prediction quality:
:func:`~lit_grpo.scheduling.prediction_metrics.kendall_tau`, :func:`~lit_grpo.scheduling.prediction_metrics.smape`.

Files: this one holds the protocol, the registry and the two simple predictors; ``online_predictor.py`` the
token-conditioned one (on ``ridge.py``); ``lognormal.py`` the length model; ``prediction_metrics.py`` the metrics.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from lit_grpo.scheduling.base import RolloutWork, SampleKey
from lit_grpo.scheduling.lognormal import PRIOR_LOG_STD, PrequentialError, expected_length, prior_log_length
from lit_grpo.scheduling.online_predictor import OnlineLengthPredictor
from lit_grpo.scheduling.prediction_metrics import kendall_tau, smape

__all__ = [
    "PRIOR_LOG_STD",
    "HistoryLengthPredictor",
    "LengthPredictor",
    "OnlineLengthPredictor",
    "OracleLengthPredictor",
    "PREDICTORS",
    "expected_length",
    "kendall_tau",
    "make_predictor",
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
