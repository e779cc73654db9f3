"""The group-context length predictor: a sample's length from its siblings that already finished in this rollout.

The G samples of a prompt share the prompt's difficulty, so once some of them finish, the rest are expected near
them (Seer, arXiv 2511.14617, schedules on a group's first finished responses). How near is measured, not
assumed: across past rollouts the predictor keeps the spread of group means around the overall mean (between
groups) and of samples around their group's mean (within groups), and predicts the posterior mean of the group's
log length, a normal-normal shrinkage of the finished siblings' mean towards the overall mean::

    log L_hat = (m / s_b^2 + n * mean_finished / s_w^2) / (1 / s_b^2 + n / s_w^2)

With no finished sibling every sample of the rollout gets ``m``; where groups do not differ (``s_b -> 0``) the
siblings count for nothing. The first siblings to finish are the group's shortest, so early predictions lean
short; the scheduler's calibration (``trust.py``) and gate judge whether what is left ranks samples well enough.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lit_grpo.scheduling.base import RolloutWork, SampleKey
from lit_grpo.scheduling.lognormal import PrequentialError, prior_log_length


class GroupLengthPredictor:
    """Shrunk mean log length of a sample's finished siblings (module docstring); learned across rollouts.

    Args:
        decay: forgetting factor per group folded into the between/within spreads and the overall mean.
    """

    needs_prompt_features = False
    token_conditioned = False

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        # Past groups, decayed: weight, sum of group means, sum of squared group means, sum of within variances.
        self.groups = [0.0, 0.0, 0.0, 0.0]
        self.current_work: RolloutWork | None = None
        self.finished: dict[int, list[float]] = {}  # prompt -> log lengths of its finished samples, this rollout
        self.error = PrequentialError()

    def predict(
        self, work: RolloutWork, keys: Sequence[SampleKey], token_features: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._switch(work)
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
        self._switch(work)
        for (p, _), length in zip(keys, lengths):
            target = math.log(max(1, int(length)))
            self.error.add(self._log_prediction(work, p) - target)
            self.finished.setdefault(p, []).append(target)

    def _log_prediction(self, work: RolloutWork, prompt: int) -> float:
        weight, sum_mean, sum_sq, sum_within = self.groups
        if weight <= 0:
            siblings = self.finished.get(prompt)
            return sum(siblings) / len(siblings) if siblings else prior_log_length(work.max_new_tokens)
        mean = sum_mean / weight
        within = max(sum_within / weight, 1e-6)
        # The spread of group means holds within-group noise of mean size G; what is left is the groups' own.
        between = max(sum_sq / weight - mean * mean - within / max(work.group_size, 1), 1e-6)
        siblings = self.finished.get(prompt, ())
        precision = 1 / between + len(siblings) / within
        return (mean / between + sum(siblings) / within) / precision

    def _switch(self, work: RolloutWork) -> None:
        """A new rollout: fold the last one's groups into the spreads."""
        if work is not self.current_work:
            self.groups, self.current_work, self.finished = self._folded(), work, {}

    def _folded(self) -> list[float]:
        """The past groups' statistics with this rollout's groups (two or more finished samples) folded in."""
        weight, sum_mean, sum_sq, sum_within = self.groups
        for logs in self.finished.values():
            if len(logs) < 2:
                continue
            group_mean = sum(logs) / len(logs)
            within = sum((x - group_mean) ** 2 for x in logs) / (len(logs) - 1)
            d = self.decay
            weight, sum_mean, sum_sq, sum_within = (weight * d + 1, sum_mean * d + group_mean,
                                                    sum_sq * d + group_mean ** 2, sum_within * d + within)
        return [weight, sum_mean, sum_sq, sum_within]

    def state_dict(self) -> dict:
        """The spreads learned across rollouts, the current rollout's groups folded in (its finished siblings
        do not outlive it)."""
        return {"decay": self.decay, "groups": self._folded(), "error": self.error.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.groups = state["decay"], list(state["groups"])
        self.current_work, self.finished = None, {}
        self.error.load_state_dict(state["error"])
