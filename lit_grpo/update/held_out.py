"""Validation on held-out prompts: ``val/{reward, accuracy}`` (greedy) and ``val/{mean_at_k, pass_at_k}`` (k
sampled completions per prompt, ``data.val_num_samples``), accumulated per prompt over a validation run."""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric

from lit_grpo.batch import RolloutBatch


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
