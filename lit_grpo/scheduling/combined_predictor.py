"""Combining length predictors: ``"online+group"`` stacks the parts' log predictions with a learned weight each.

Each part predicts as it would alone; a small ridge regression of log length on the parts' log predictions
(``ridge.py``, learned online from the same finished samples, on the predictions the parts made before they
learned from them) decides how much each is worth, so a part that carries nothing gets a weight near 0 instead
of diluting the others. Until the stack has seen ``min_observations`` samples it averages the parts' logs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lit_grpo.runtime.validation import check_int, check_real
from lit_grpo.scheduling.base import RolloutWork, SampleKey
from lit_grpo.scheduling.lognormal import PrequentialError
from lit_grpo.scheduling.ridge import RidgeRegressor, single_thread


class CombinedLengthPredictor:
    """The parts' log predictions, stacked (module docstring).

    Args:
        parts: the predictors to combine (two or more).
        names: what each part is called (default: its class name); a checkpoint's parts must match them.
        decay: the stack's forgetting factor per observation, in (0, 1].
        min_observations: samples before the stack's weights replace the plain average, >= 0.
    """

    def __init__(self, parts: Sequence, names: Sequence[str] | None = None, decay: float = 0.995,
                 min_observations: int = 32) -> None:
        if len(parts) < 2:
            raise ValueError(f"a combined predictor needs two or more parts, got {len(parts)}")
        check_real("combined predictor decay", decay, 0.0, 1.0, low_open=True)
        check_int("combined predictor min_observations", min_observations, 0)
        self.parts = list(parts)
        self.names = list(names) if names is not None else [type(part).__name__ for part in self.parts]
        self.needs_prompt_features = any(part.needs_prompt_features for part in self.parts)
        self.token_conditioned = any(part.token_conditioned for part in self.parts)
        self.min_observations = min_observations
        self.stack = RidgeRegressor(decay=decay, alphas=(0.1, 1.0, 10.0))
        self.error = PrequentialError()

    def predict(
        self, work: RolloutWork, keys: Sequence[SampleKey], token_features: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not keys:
            return torch.zeros(0)
        # A linear stack can reach past the possible lengths: keep its predictions within [1, cap].
        combined = self._combine(self._part_logs(work, keys, token_features))
        return combined.clamp(0.0, math.log(max(work.max_new_tokens, 1))).exp().to(torch.float32)

    def log_std(self, token_conditioned: bool) -> float:
        return self.error.rms

    def observe(
        self,
        work: RolloutWork,
        keys: Sequence[SampleKey],
        lengths: Sequence[int],
        token_features: torch.Tensor | None = None,
    ) -> None:
        if not keys:
            return
        logs = self._part_logs(work, keys, token_features)  # before the parts learn from these samples
        target = torch.tensor([float(max(1, int(n))) for n in lengths], dtype=torch.float64).log()
        for error in (self._combine(logs) - target).tolist():
            self.error.add(error)
        with single_thread():
            self.stack.update(logs, target)
        for part in self.parts:
            part.observe(work, keys, lengths, token_features)

    def _part_logs(self, work: RolloutWork, keys: Sequence[SampleKey], token_features) -> torch.Tensor:
        """``[N, parts]`` log predictions of each part."""
        columns = [part.predict(work, keys, token_features if part.token_conditioned else None)
                   for part in self.parts]
        return torch.stack(columns, dim=1).to(torch.float64).clamp_min(1e-9).log()

    def _combine(self, logs: torch.Tensor) -> torch.Tensor:
        if self.stack.effective_count < self.min_observations:
            return logs.mean(dim=1)
        with single_thread():
            return self.stack.predict(logs)

    def state_dict(self) -> dict:
        return {"names": list(self.names), "parts": [part.state_dict() for part in self.parts],
                "stack": self.stack.state_dict(), "error": self.error.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("names") != self.names:
            raise ValueError(f"the checkpoint's combined predictor has parts {state.get('names')}, this one "
                             f"{self.names}: load it into the same combination")
        for part, part_state in zip(self.parts, state["parts"]):
            part.load_state_dict(part_state)
        self.stack.load_state_dict(state["stack"])
        self.error.load_state_dict(state["error"])
