"""Group-relative advantages (GRPO): each completion's reward compared with its group's.

Shapes: ``B`` prompts (groups), ``G`` completions per prompt.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from lit_grpo.runtime.validation import check_choice

#: Added to the standard deviation before dividing, as in TRL / the GRPO papers.
STD_EPS = 1e-4

Scale = Literal["group", "batch", "none"]
SCALES: tuple[str, ...] = get_args(Scale)


def group_advantages(rewards: torch.Tensor, scale: str = "group",
                     batch_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages ``A = (R - mean_group(R)) / (std + 1e-4)``.

    Args:
        rewards: ``[B, G]`` total reward of completion ``k`` of prompt ``p``.
        scale: what divides the centered rewards:
            ``"group"``: the group's standard deviation (unbiased, as ``torch.std``);
            ``"batch"``: the standard deviation of all ``B x G`` rewards (unbiased);
            ``"none"``: nothing (Dr. GRPO), ``A = R - mean_group(R)``.
        batch_rewards: ``[B', G]`` for ``scale="batch"``: the rewards whose standard deviation divides (e.g. every
            rank's rewards, gathered); default ``rewards``.

    Returns:
        ``[B, G]`` float advantages. A group whose rewards are all equal gets (near) 0 everywhere, never NaN: its
        float32 mean may differ from the rewards in the last bit, which ``/ (std + eps)`` scales to about 1e-3, as
        in TRL. Every group gets exactly 0 when ``G == 1`` (a lone completion has nothing to be compared with).

    Raises:
        ValueError: ``rewards`` is not 2-D, is empty, holds NaN/inf, or ``scale`` is unknown.
    """
    check_choice("scale", scale, SCALES)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G] (2-D), got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        raise ValueError(f"rewards is empty (shape {tuple(rewards.shape)}); need at least one prompt and one sample")
    rewards = rewards.float()
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards hold non-finite values: {rewards[~torch.isfinite(rewards)].tolist()[:8]}")
    group_size = rewards.shape[1]
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if group_size == 1:
        return torch.zeros_like(rewards)
    if scale == "none":
        return centered
    if scale == "group":
        std = rewards.std(dim=1, keepdim=True)  # unbiased; defined since G >= 2
    else:
        pool = rewards if batch_rewards is None else batch_rewards.float().to(rewards.device)
        std = pool.std() if pool.numel() > 1 else rewards.new_zeros(())
    # a zero-variance group: centered is 0 up to the mean's rounding, and / (0 + eps) keeps it finite: no NaN
    return centered / (std + STD_EPS)


def zero_std_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: groups whose ``G`` rewards are all equal (they carry no learning signal).

    Args:
        rewards: ``[B, G]``.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G] (2-D), got shape {tuple(rewards.shape)}")
    return (rewards == rewards[:, :1]).all(dim=1)
