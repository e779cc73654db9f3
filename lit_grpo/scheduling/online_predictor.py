"""The token-conditioned length predictor: ridge regression of log length on the policy's own hidden states."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lit_grpo.scheduling.base import RolloutWork, SampleKey
from lit_grpo.scheduling.lognormal import PrequentialError, prior_log_length
from lit_grpo.scheduling.ridge import RidgeRegressor, rms_normalize, single_thread


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
        self._prompt_phi: tuple[torch.Tensor, torch.Tensor] | None = None  # (the rollout's features, their phi)

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
            # Learned in chunks that are scored (prequential errors) against the same fits as if their samples had
            # come one at a time: a chunk ends where a model would refit, and where the token model becomes old
            # enough to be scored at all.
            start = 0
            while start < len(keys):
                rows = slice(start, start + self._rows_scored_alike(token_features is not None))
                self._observe(work, keys[rows], lengths[rows], None if token_features is None else token_features[rows])
                start = rows.stop

    def _rows_scored_alike(self, probed: bool) -> int:
        rows = self.prompt_model.rows_before_refit()
        if probed:
            young = self.token_model.effective_count < self.min_token_observations
            rows = min(rows, 1 if young else self.token_model.rows_before_refit())
        return rows

    def _observe(
        self, work: RolloutWork, keys: Sequence[SampleKey], lengths: Sequence[int], token_features: torch.Tensor | None
    ) -> None:
        target = torch.tensor([math.log(max(1, int(n))) for n in lengths], dtype=torch.float64)
        prompt_x = self._prompt_x(work, keys)
        for error in (self._predict_log(work, keys, None, scored=target) - target).tolist():
            self.prompt_error.add(error)
        self.prompt_model.update(prompt_x, target)
        if token_features is not None:
            token_x = torch.cat([prompt_x, self._phi(token_features)], dim=1)
            if self.token_model.effective_count >= self.min_token_observations:
                for error in (self._predict_log(work, keys, token_features, scored=target) - target).tolist():
                    self.token_error.add(error)
            self.token_model.update(token_x, target)

    def _predict_log(
        self, work: RolloutWork, keys: Sequence[SampleKey], token_features: torch.Tensor | None,
        scored: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Log lengths; with ``scored`` (the targets of samples about to be learned), each one as predicted when
        its turn comes (``RidgeRegressor.predict_each``)."""
        # A linear model extrapolates; lengths live in [1, max_new_tokens].
        raw = self._predict_log_raw(work, keys, token_features, scored)
        return raw.clamp(0.0, math.log(max(1, work.max_new_tokens)))

    def _predict_log_raw(
        self, work: RolloutWork, keys: Sequence[SampleKey], token_features: torch.Tensor | None,
        scored: torch.Tensor | None,
    ) -> torch.Tensor:
        def predict(model: RidgeRegressor, x: torch.Tensor) -> torch.Tensor:
            return model.predict(x) if scored is None else model.predict_each(x, scored)

        prompt_x = self._prompt_x(work, keys)
        if token_features is not None and self.token_model.effective_count >= self.min_token_observations:
            token_x = torch.cat([prompt_x, self._phi(token_features)], dim=1)
            if token_x.shape[1] == self.token_model.dim:
                return predict(self.token_model, token_x)
        if self.prompt_model.sw > 0 and prompt_x.shape[1] == (self.prompt_model.dim or 0):
            return predict(self.prompt_model, prompt_x)
        return torch.full((len(keys),), prior_log_length(work.max_new_tokens), dtype=torch.float64)

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
        self._prompt_phi = None
