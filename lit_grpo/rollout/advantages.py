"""Group-relative advantages (GRPO): each completion's reward compared with its group's.

Shapes: ``B`` prompts (groups), ``G`` completions per prompt, ``K`` reward functions.

Several reward functions are combined in one of two ways (``Aggregation``, TRL's ``multi_objective_aggregation``):
``"sum_then_normalize"`` sums their weighted values and normalizes the total (``group_advantages``);
``"normalize_then_sum"`` (GDPO, arXiv 2601.05242) normalizes each function's values within the group first, sums
them with the weights and normalizes that sum over the batch (``normalize_then_sum_advantages``).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

from lit_grpo.runtime.validation import check_choice

#: Added to the standard deviation before dividing, as in TRL / the GRPO papers.
STD_EPS = 1e-4

Scale = Literal["group", "batch", "none"]
SCALES: tuple[str, ...] = get_args(Scale)

Aggregation = Literal["sum_then_normalize", "normalize_then_sum"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def group_advantages(rewards: torch.Tensor, scale: str = "group",
                     batch_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages ``A = (R - mean_group(R)) / (std + 1e-4)``, over each group's scored completions.

    Args:
        rewards: ``[B, G]`` total reward of completion ``k`` of prompt ``p``; NaN marks an unscored completion (every
            reward function returned None), left out of its group's mean and standard deviation, as in TRL.
        scale: what divides the centered rewards:
            ``"group"``: the group's standard deviation (unbiased, as ``torch.std``);
            ``"batch"``: the standard deviation of all ``B x G`` rewards (unbiased);
            ``"none"``: nothing (Dr. GRPO), ``A = R - mean_group(R)``.
        batch_rewards: ``[B', G]`` for ``scale="batch"``: the rewards whose standard deviation divides (e.g. every
            rank's rewards, gathered; NaN left out); default ``rewards``.

    Returns:
        ``[B, G]`` float32 advantages (whatever ``rewards``' dtype). A group whose rewards are all equal gets (near)
        0 everywhere, never NaN: its float32 mean may differ from the rewards in the last bit, which
        ``/ (std + eps)`` scales to about 1e-3, as in TRL. Exactly 0 for an unscored completion, for every
        completion of a group with fewer than two scored ones (a lone value has nothing to be compared with,
        ``G == 1`` included), and under ``"batch"`` when fewer than two rewards are scored in all.

    Raises:
        TypeError: ``rewards`` (or ``batch_rewards``) is not a tensor.
        ValueError: ``rewards`` is not 2-D, is empty, holds inf, or ``scale`` is unknown.
    """
    check_choice("scale", scale, SCALES)
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a [B, G] tensor, got {type(rewards).__name__} (torch.tensor(rewards) "
                        "makes one)")
    if batch_rewards is not None and not isinstance(batch_rewards, torch.Tensor):
        raise TypeError(f"batch_rewards must be a [B', G] tensor or None, got {type(batch_rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G] (2-D), got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        raise ValueError(f"rewards is empty (shape {tuple(rewards.shape)}); need at least one prompt and one sample")
    rewards = rewards.float()
    if bool(rewards.isinf().any()):
        raise ValueError(f"rewards hold infinite values: {rewards[rewards.isinf()].tolist()[:8]}")
    if rewards.shape[1] == 1:
        return torch.zeros_like(rewards)
    centered = rewards - rewards.nanmean(dim=1, keepdim=True)  # NaN where unscored; 0 where alone in its group
    if scale == "none":
        return centered.nan_to_num(nan=0.0)
    if scale == "group":
        std = _nanstd(rewards, dim=1)  # unbiased; NaN where fewer than two are scored
    else:
        pool = rewards if batch_rewards is None else batch_rewards.float().to(rewards.device)
        std = _nanstd(pool.flatten(), dim=0)
    # a zero-variance group: centered is 0 up to the mean's rounding, and / (0 + eps) keeps it finite
    return (centered / (std + STD_EPS)).nan_to_num(nan=0.0)


def normalize_then_sum(components: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """GDPO's reward of each completion: every function's values normalized within their group, then weighted and
    summed, ``R = nansum_k w_k (r_k - nanmean_group(r_k)) / (nanstd_group(r_k) + 1e-4)``.

    Args:
        components: ``[B, G, K]`` each function's value for completion ``g`` of prompt ``b``, NaN where it returned
            None; NaN values are left out of their group's mean and (unbiased) standard deviation.
        weights: ``[K]`` the functions' weights.

    Returns:
        ``[B, G]``, in the components' float dtype (at least float32). A function that gave fewer than two values in
        a group adds nothing to it (its standard deviation is undefined, as in TRL); one whose values are all equal
        adds (near) 0. NaN where every function returned None (the completion is unscorable).

    Raises:
        ValueError: ``components`` is not 3-D, is empty or holds inf, or ``weights`` is not ``[K]``.
    """
    if components.dim() != 3:
        raise ValueError(f"components must be [B, G, K] (3-D), got shape {tuple(components.shape)}")
    if components.numel() == 0:
        raise ValueError(f"components is empty (shape {tuple(components.shape)})")
    if weights.shape != components.shape[2:]:
        raise ValueError(f"weights must be [K] = [{components.shape[2]}], got shape {tuple(weights.shape)}")
    if bool(components.isinf().any()):
        raise ValueError(f"components hold infinite values: {components[components.isinf()].tolist()[:8]}")
    values = components.to(torch.promote_types(components.dtype, torch.float32))
    normalized = (values - values.nanmean(dim=1, keepdim=True)) / (_nanstd(values, dim=1) + STD_EPS)
    sums = (normalized * weights.to(values)).nansum(dim=2)
    return sums.masked_fill(values.isnan().all(dim=2), float("nan"))


def normalize_then_sum_advantages(components: torch.Tensor, weights: torch.Tensor,
                                  batch_sums: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages under ``"normalize_then_sum"``: ``R = normalize_then_sum(components, weights)`` normalized over
    the batch, ``A = (R - nanmean(R)) / (nanstd(R) + 1e-4)``; ``scale_rewards`` plays no part.

    Args:
        components: ``[B, G, K]``, as ``normalize_then_sum``.
        weights: ``[K]``, as ``normalize_then_sum``.
        batch_sums: ``[B', G]`` the ``R`` whose mean and standard deviation normalize (e.g. every rank's,
            gathered; NaN entries left out); default this batch's own.

    Returns:
        ``[B, G]`` float advantages, 0 where every function returned None (and everywhere when the batch holds
        fewer than two scored completions).
    """
    sums = normalize_then_sum(components, weights)
    # each group's sums add up to 0, so the batch mean is 0 but for rounding: subtracted anyway, as TRL does
    pool = (sums if batch_sums is None else batch_sums.to(sums)).flatten()
    advantages = (sums - pool.nanmean()) / (_nanstd(pool, dim=0) + STD_EPS)
    return advantages.nan_to_num(nan=0.0)


def _nanstd(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The unbiased standard deviation along ``dim`` (kept) of the values that are not NaN; NaN where fewer than
    two are."""
    present = ~values.isnan()
    count = present.sum(dim=dim, keepdim=True)
    centered = torch.where(present, values - values.nanmean(dim=dim, keepdim=True), torch.zeros_like(values))
    variance = (centered ** 2).sum(dim=dim, keepdim=True) / (count - 1).clamp(min=1)
    return variance.sqrt().masked_fill(count < 2, float("nan"))


def zero_std_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: groups without learning signal, whose ``G`` rewards are all equal.

    Args:
        rewards: ``[B, G]`` total rewards (``"sum_then_normalize"``), or ``[B, G, K]`` each reward function's
            values (``"normalize_then_sum"``): then a group is one where every function's values are equal, NaN
            (None) left out, so that each function's normalized values are (near) 0 in it, whatever the totals do.
            Functions that vary but cancel in the weighted sum (exact complements of equal weight) still count
            as signal: the test is on each function, not on their sum's rounding.
    """
    if rewards.dim() not in (2, 3):
        raise ValueError(f"rewards must be [B, G] or [B, G, K], got shape {tuple(rewards.shape)}")
    values = rewards if rewards.dim() == 3 else rewards.unsqueeze(-1)
    values = values.to(torch.promote_types(values.dtype, torch.float32))  # holds inf and NaN
    present = ~values.isnan()
    low = torch.where(present, values, torch.full_like(values, math.inf)).amin(dim=1)     # [B, K]
    high = torch.where(present, values, torch.full_like(values, -math.inf)).amax(dim=1)  # [B, K]; -inf when all NaN
    return (high <= low).all(dim=1)
