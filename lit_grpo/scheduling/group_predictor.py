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

from lit_grpo.runtime.validation import check_real
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
        self.decay = check_real("group predictor decay", decay, 0.0, 1.0, low_open=True)
        # Past groups, decayed: weight, sum of group means, sum of squared group means, sum of within variances,
        # sum of within variances over the finished count (the noise a group mean of that many samples holds).
        self.groups = [0.0, 0.0, 0.0, 0.0, 0.0]
        self.current_work: RolloutWork | None = None
        # prompt (its digest, or its index when no ids are given) -> log lengths of its samples finished so far
        self.finished: dict[str | int, list[float]] = {}
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
            self.finished.setdefault(_group(work, p), []).append(target)

    def _log_prediction(self, work: RolloutWork, prompt: int) -> float:
        weight, sum_mean, sum_sq, sum_within, sum_noise = self.groups
        siblings = self.finished.get(_group(work, prompt), ())
        if weight <= 0:
            return sum(siblings) / len(siblings) if siblings else prior_log_length(work.max_new_tokens)
        mean = sum_mean / weight
        within = max(sum_within / weight, 1e-6)
        # The spread of the folded group means holds each mean's own noise (within / its count); the rest is the
        # groups' difference.
        between = max(sum_sq / weight - mean * mean - sum_noise / weight, 1e-6)
        precision = 1 / between + len(siblings) / within
        return (mean / between + sum(siblings) / within) / precision

    def _switch(self, work: RolloutWork) -> None:
        """A new rollout: fold the last one's groups into the spreads, except the groups carried into this one
        (partial rollouts), which go on collecting their samples."""
        if work is self.current_work:
            return
        # Only token ids identify a prompt across calls; an index does not.
        carried = {digest for p in range(work.num_prompts) if (digest := work.prompt_digest(p)) is not None}
        self.groups = self._folded(exclude=carried)
        self.finished = {group: logs for group, logs in self.finished.items() if group in carried}
        self.current_work = work

    def _folded(self, exclude: set = frozenset()) -> list[float]:
        """The past groups' statistics with this rollout's groups (two or more finished samples; not those in
        ``exclude``) folded in."""
        weight, sum_mean, sum_sq, sum_within, sum_noise = self.groups
        for group, logs in self.finished.items():
            if len(logs) < 2 or group in exclude:
                continue
            group_mean = sum(logs) / len(logs)
            within = sum((x - group_mean) ** 2 for x in logs) / (len(logs) - 1)
            d = self.decay
            weight, sum_mean, sum_sq, sum_within, sum_noise = (
                weight * d + 1, sum_mean * d + group_mean, sum_sq * d + group_mean ** 2, sum_within * d + within,
                sum_noise * d + within / len(logs))
        return [weight, sum_mean, sum_sq, sum_within, sum_noise]

    def state_dict(self) -> dict:
        """The spreads learned across rollouts, the current rollout's groups folded in (its finished siblings
        do not outlive it)."""
        return {"decay": self.decay, "groups": self._folded(), "error": self.error.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.groups = state["decay"], list(state["groups"])
        if len(self.groups) != 5:
            raise ValueError(f"group predictor state: 'groups' holds {len(self.groups)} statistics, expected 5")
        self.current_work, self.finished = None, {}
        self.error.load_state_dict(state["error"])


def _group(work: RolloutWork, prompt: int) -> str | int:
    """Which group a prompt's samples belong to across calls: its token ids' digest (a carried group keeps it),
    or its index when the ids are not given."""
    digest = work.prompt_digest(prompt)
    return prompt if digest is None else digest
