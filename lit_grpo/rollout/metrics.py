"""The scalars that describe one training step's batch: ``reward/*`` and ``completions/*`` (one definition, used by
``GRPOModule`` and by ``lit_grpo.callbacks.CompletionLogger``)."""

from __future__ import annotations

from typing import Any

import torch


def completion_length_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """``completions/{mean,min,max}_length`` and ``completions/clipped_ratio``.

    Args:
        lengths: completion tokens of every sample, any shape (e.g. ``[B, G]`` or flat ``[N]``), not empty.
        truncated: same shape, True where a completion was cut by ``max_new_tokens`` (no EOS).
    """
    lengths = lengths.detach().double()
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.detach().double().mean().item(),
    }


def reward_metrics(rewards: torch.Tensor, reward_components: dict[str, torch.Tensor], num_groups_zero_std: int,
                   num_groups_generated: int) -> dict[str, float]:
    """``reward/{mean, std, frac_zero_std, <fn_name>/mean}`` of one batch.

    Args:
        rewards: ``[B, G]`` weighted total rewards.
        reward_components: ``{fn_name: [B, G]}`` each function's raw values (NaN where it returned None).
        num_groups_zero_std, num_groups_generated: groups whose rewards were all equal / all groups sampled for
            this step (dynamic sampling's dropped groups included).
    """
    rewards = rewards.float()
    out = {
        "reward/mean": float(rewards.mean()),
        # mean over groups of the group's reward std (TRL's reward_std): the signal GRPO learns from
        "reward/std": float(rewards.std(dim=1).mean()) if rewards.shape[1] > 1 else 0.0,
        "reward/frac_zero_std": num_groups_zero_std / max(num_groups_generated, 1),
    }
    for name, values in reward_components.items():
        present = values[~torch.isnan(values)]
        if present.numel():
            out[f"reward/{name}/mean"] = float(present.float().mean())
    return out


def rollout_metrics(batch: Any) -> dict[str, float]:
    """reward/ and completions/ scalars of a ``RolloutBatch``, plus what the data side put in ``batch.metrics``
    (curriculum/*, rollout/rollouts_per_step, ...)."""
    out = reward_metrics(batch.rewards, batch.reward_components, batch.num_groups_zero_std,
                         batch.num_groups_generated)
    out.update(completion_length_metrics(batch.completion_lengths, batch.truncated))
    out.update({key: float(value) for key, value in batch.metrics.items()})
    return out
