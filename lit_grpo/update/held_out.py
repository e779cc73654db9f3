"""Validation on held-out prompts: ``val/{reward, accuracy}`` (greedy) and ``val/{mean_at_k, pass_at_k}`` (k
sampled completions per prompt, ``data.val_num_samples``), accumulated per prompt over a validation run; and what
reward functions logged with ``log_metric`` in validation's calls: ``val/reward/<name>`` (the greedy completions')
and ``val/reward_at_k/<name>`` (the sampled ones')."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torchmetrics import MeanMetric

from lit_grpo.batch import RolloutBatch
from lit_grpo.rollout.metrics import loggable, ratio_weight, reduce_over_ranks, whole_step_metrics, with_weights
from lit_grpo.rollout.reward_log import LOGGED_REWARD_PREFIXES
from lit_grpo.runtime.distributed import union_over_ranks

#: The keys of a validation batch's ``metrics`` that reward functions logged (``ValidationLogs``).
LOGGED_KEYS = tuple(f"{prefix}/" for prefix in LOGGED_REWARD_PREFIXES)


def sampled_accuracy_at_k(accuracy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt mean@k and pass@k of ``accuracy`` ``[B, k]`` (NaN: no opinion), for the prompts with a value.

    mean@k: the mean correctness over the k samples. pass@k: the best of the k (1 when any is correct, for 0/1
    rewards); with n = k samples drawn, the unbiased estimator of pass@k (Chen et al., 2021) is exactly that.
    Returns two ``[B']`` tensors, B' the prompts with at least one value.
    """
    values = accuracy.float()
    present = ~torch.isnan(values)
    rows = present.any(dim=1)
    filled = torch.where(present, values, torch.zeros_like(values))
    mean_at_k = filled.sum(dim=1) / present.sum(dim=1).clamp(min=1)
    pass_at_k = torch.where(present, values, torch.full_like(values, -torch.inf)).amax(dim=1)
    return mean_at_k[rows], pass_at_k[rows]


class HeldOutMetrics(torch.nn.Module):
    """The four ``val/*`` means (torchmetrics ``MeanMetric``, so they add up across batches and ranks); a
    submodule of ``GRPOModule``, which logs them."""

    def __init__(self) -> None:
        super().__init__()
        self.reward = MeanMetric()
        self.accuracy = MeanMetric()
        self.mean_at_k = MeanMetric()
        self.pass_at_k = MeanMetric()

    def update(self, batch: RolloutBatch) -> dict[str, MeanMetric]:
        """Add one validation batch; returns the metrics it has values for, by logged key."""
        logged = {"val/reward": self.reward}
        kept = ~batch.skipped if batch.skipped is not None else torch.ones_like(batch.rewards[:, 0], dtype=torch.bool)
        if bool(kept.any()):  # prompts skipped for a reward error (on_reward_error="skip_group") do not count
            self.reward.update(batch.rewards.float().mean(dim=1)[kept])
        if batch.accuracy is not None:
            values = batch.accuracy.float().mean(dim=1)
            values = values[~torch.isnan(values)]
            if values.numel():
                self.accuracy.update(values)
            logged["val/accuracy"] = self.accuracy
        if batch.sampled_accuracy is not None:
            mean_at_k, pass_at_k = sampled_accuracy_at_k(batch.sampled_accuracy)
            if mean_at_k.numel():
                self.mean_at_k.update(mean_at_k)
                self.pass_at_k.update(pass_at_k)
            logged.update({"val/mean_at_k": self.mean_at_k, "val/pass_at_k": self.pass_at_k})
        return logged


class ValidationLogs:
    """What reward functions log with ``log_metric`` during one validation run, as TRL logs an evaluation's
    (``eval_<name>``): ``val/reward/<name>``, the mean of every value logged under ``name`` by the greedy
    completions' reward calls, and ``val/reward_at_k/<name>``, by sampled validation's (``data.val_num_samples``),
    each over every rank's: a sampled call's values (a judge's, at temperature) are not a greedy one's. Names are
    known only as the calls log them, and may differ between ranks, so these are plain sums gathered once at the
    end, not torchmetrics states fixed ahead."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def add(self, metrics: Mapping[str, float]) -> None:
        """Add one validation batch's ``metrics``: its ``reward/<name>`` and ``reward_at_k/<name>`` means and their
        counts under ``weight/<key>`` (``lit_grpo.rollout.reward_log.step_metrics``)."""
        for key, value in metrics.items():
            weight = ratio_weight(key) if key.startswith(LOGGED_KEYS) else None
            if weight is not None and weight in metrics:
                count = float(metrics[weight])
                self.sums[key] = self.sums.get(key, 0.0) + float(value) * count
                self.counts[key] = self.counts.get(key, 0.0) + count

    def reset(self) -> None:
        self.sums.clear()
        self.counts.clear()

    def compute(self, all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """``{"val/reward/<name>": mean, "val/reward_at_k/<name>": mean}`` over this run's batches, then
        ``reset``. ``all_gather`` (several processes; ``[2, K] -> [world, 2, K]``): over every rank's values too, a
        collective every rank calls, each rank's mean weighted by its count; a name one rank lacks is the others'
        mean."""
        keys = with_weights(union_over_ranks(self.sums) if all_gather is not None else sorted(self.sums))
        if not keys:  # no rank's calls logged (the same on every rank): nothing to gather
            return {}
        values = {}
        for key, total in self.sums.items():  # a count is never 0: a logged name has at least one value
            values[key], values[ratio_weight(key)] = total / self.counts[key], self.counts[key]
        reduced = (whole_step_metrics(values, keys, all_gather) if all_gather is not None
                   else reduce_over_ranks([values], keys))
        self.reset()
        return {f"val/{key}": value for key, value in loggable(reduced).items()}
