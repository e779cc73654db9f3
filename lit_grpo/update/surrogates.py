"""Per-token terms of the GRPO loss: importance ratios, the policy surrogates, the k3 KL (pure functions).

Shapes: ``N`` completions, ``T`` completion tokens (padded; ``mask`` marks the real ones). A ratio is ``[N, T]``
at token level and ``[N, 1]`` at sequence level (one value per completion, broadcast over its tokens).

Per token, with ``r`` the importance ratio of the current policy to the one the update started from::

    clip (grpo, bnpo, dr_grpo, dapo,   -min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A)
          luspo)                       (delta: INTELLECT-2's two-sided clip, none by default)
    cispo                              -sg(min(r, eps_high)) A logp        (sg: no gradient through the weight)
    sapo                               -(4 / tau) sigmoid(tau (r - 1)) A,  tau = tau_pos if A > 0 else tau_neg
    vespo                              -sg(phi(w)) A logp,  phi(w) = exp(lam) w^k exp(-lam w)   (w: below)
    k3 KL to the reference             exp(ref - logp) - (ref - logp) - 1

``off_policy_mask_threshold`` drops the policy term (not the KL) of a completion whose advantage is negative and
whose mean ``sampling_logp - logp`` exceeds it (``off_policy_sequence_mask``): a mistake sampled by a policy this
one has moved away from teaches more noise than signal (DeepSeek-V3.2). ``top_entropy_quantile`` keeps the policy
term (not the KL) of only the tokens with the highest entropy (``high_entropy_mask``): the few forking tokens
where the policy hesitates carry most of the learning signal ("Beyond the 80/20 rule").

cispo keeps a gradient on every token (the clipped weight only scales it) and sapo replaces the hard clip by a
smooth gate whose slope is 1 at ``r = 1`` (so on-policy it is the plain policy gradient). vespo weighs a whole
completion by a Gamma-shaped function of its sequence ratio ``w`` (the product of its token ratios, not GSPO's
geometric mean): 1 at ``w = 1`` (on-policy, the plain policy gradient), largest at ``w = k / lam``, and falling to 0
as ``w`` grows (as ``exp(-lam w)``) and, for ``k > 0``, as it goes to 0 (as ``w^k``; at ``k = 0`` it rises to
``exp(lam)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, get_args

import torch

from lit_grpo.runtime.validation import check_choice, shown_setting

ImportanceSamplingLevel = Literal["token", "sequence"]
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = get_args(ImportanceSamplingLevel)


def importance_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor,
                     level: str = "token") -> torch.Tensor:
    """The ratio the surrogate sees: ``[N, T]`` per token, or ``[N, 1]`` per sequence (GSPO).

    The sequence ratio is ``exp(mean over the completion's active tokens of (logp - old_logp))``, the geometric
    mean of its token ratios, so its size does not depend on the completion's length; a completion without an
    active token gets 1.

    Args:
        logps: ``[N, T]`` (with gradient); old_logps: ``[N, T]`` (detached here).
        mask: ``[N, T]`` 1 on active tokens (any dtype).
        level: ``"token"`` or ``"sequence"``.
    """
    check_choice("importance_sampling_level", level, IMPORTANCE_SAMPLING_LEVELS)
    log_ratio = logps - old_logps.detach()
    if level == "token":
        return torch.exp(log_ratio)
    mask = mask.to(log_ratio.dtype)
    mean = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return torch.exp(mean)


def _column(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[N, 1]`` detached advantages in ``like``'s dtype."""
    return advantages.detach().unsqueeze(1).to(like.dtype)


def clip_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float,
                   delta: float | None = None) -> torch.Tensor:
    """PPO-clip loss ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, ``ratio``'s shape.

    PPO's clip leaves a negative advantage's ratio unbounded above (the min picks the unclipped term there), so one
    token far off-policy can dominate a step; ``delta`` (> 1 + eps_high) caps that term's ratio too.

    Args:
        ratio: ``[N, T]`` or ``[N, 1]``; advantages: ``[N]``; delta: the cap, or None (none).
    """
    adv = _column(advantages, ratio)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    return -torch.min(unclipped * adv, torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv)


def cispo_surrogate(ratio: torch.Tensor, logps: torch.Tensor, advantages: torch.Tensor,
                    epsilon_high: float) -> torch.Tensor:
    """``[N, T]`` CISPO loss ``-sg(min(r, epsilon_high)) A logp``: the weight is capped at ``epsilon_high`` itself.

    Args:
        ratio: ``[N, T]`` or ``[N, 1]``; logps: ``[N, T]`` (with gradient); advantages: ``[N]``.
    """
    weight = torch.clamp(ratio, max=epsilon_high).detach()
    return -weight * _column(advantages, logps) * logps


def sapo_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float,
                   temperature_neg: float) -> torch.Tensor:
    """SAPO loss ``-(4 / tau) sigmoid(tau (r - 1)) A``, ``ratio``'s shape; ``tau`` by the advantage's sign.

    Args:
        ratio: ``[N, T]`` or ``[N, 1]``; advantages: ``[N]`` (``A > 0`` uses ``temperature_pos``, the rest
            ``temperature_neg``).
    """
    adv = _column(advantages, ratio)
    # built in ratio's dtype: python scalars in torch.where would round the temperatures to float32
    tau = torch.where(adv > 0, torch.full_like(adv, temperature_pos), torch.full_like(adv, temperature_neg))
    return -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv


@torch.no_grad()
def vespo_weight(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                 k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float,
                 sampling_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, 1]`` VESPO's weight ``phi(w) = exp(lam + k log w - lam w)`` of each completion (no gradient).

    ``log w`` sums the active tokens' ``logp - old_logp`` (each clamped to [-20, 20]) and, with a sampler
    correction, the logs of its weights (each clamped to [log 1e-8, 20]; the active tokens', or the completion's
    one), so that ``w`` is the ratio to the policy that sampled. ``log w`` is clamped to [log 1e-8, 20] and an
    overflowing ``phi`` counts as 0, as in the VESPO paper's code and TRL's (which also sums the token weights of
    padding: 1 under any bounds around 1). A completion with a weight a mask mode set to 0 (an active token's, or
    its own) weighs 0, where TRL counts that weight as 1e-8: its ``phi`` would then be up to ``exp(lam) 1e-8^k``,
    next to 0 at the default ``k`` but ``exp(lam)``, the largest weight, at ``k = 0``.

    Args:
        logps, old_logps: ``[N, T]``; mask: ``[N, T]`` 1 on active tokens; advantages: ``[N]`` (``A >= 0`` uses
            ``k_pos``, ``lambda_pos``, the rest ``k_neg``, ``lambda_neg``).
        sampling_weights: ``[N, T]`` or ``[N, 1]`` the sampler correction's weights, or None.
    """
    floor = math.log(1e-8)
    mask = mask.to(logps.dtype)
    log_w = (torch.clamp(logps - old_logps, -20.0, 20.0) * mask).sum(dim=1, keepdim=True)     # [N, 1]
    dropped = torch.zeros_like(log_w, dtype=torch.bool)
    if sampling_weights is not None:
        weights = sampling_weights.to(logps.dtype)
        log_sampling = torch.clamp(torch.log(weights), floor, 20.0)
        masked = weights == 0
        if weights.shape == mask.shape:  # token weights: the active tokens'
            log_sampling, masked = log_sampling * mask, masked & mask.bool()
        log_w = log_w + log_sampling.sum(dim=1, keepdim=True)
        dropped = masked.any(dim=1, keepdim=True)
    log_w = torch.clamp(log_w, floor, 20.0)
    nonnegative = advantages.unsqueeze(1) >= 0
    k = torch.where(nonnegative, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
    lam = torch.where(nonnegative, torch.full_like(log_w, lambda_pos), torch.full_like(log_w, lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return phi.masked_fill(dropped, 0.0)


@torch.no_grad()
def off_policy_sequence_mask(logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                             advantages: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[N, 1]`` 1.0 for the completions the policy term keeps, 0.0 for those it drops (DeepSeek-V3.2's off-policy
    sequence masking): a completion with a negative advantage whose mean ``sampling_logp - logp`` over its active
    tokens (an estimate of KL(sampler || policy)) exceeds ``threshold``. A token the sampler could not score (NaN)
    adds 0 to that mean: one such token is no evidence of drift.

    Args:
        logps: ``[N, T]`` the current policy's (detached here); sampling_logps: ``[N, T]`` the sampler's.
        mask: ``[N, T]`` 1 on active tokens; advantages: ``[N]``; threshold: the largest mean kept.
    """
    mask = mask.to(logps.dtype)
    drift = torch.nan_to_num(sampling_logps.to(logps.dtype) - logps.detach(), nan=0.0) * mask
    mean_drift = drift.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages.unsqueeze(1) >= 0) | (mean_drift <= threshold)).to(logps.dtype)


@torch.no_grad()
def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, top_quantile: float,
                      all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      capacity: int | None = None) -> torch.Tensor:
    """``[N, T]`` bool: True on the active tokens whose entropy is at or above the ``1 - top_quantile`` quantile
    (``torch.quantile``, linear interpolation) of the active tokens' entropies, ties included; False elsewhere and
    everywhere when no token is active. At ``top_quantile`` 0 only the highest entropy (and its ties) stays.

    Without ``all_gather`` the quantile spans these ``N`` completions only. With it (several ranks, each on its own
    micro-batch) it spans every rank's active tokens, as TRL's ``get_high_entropy_mask`` gathers every process's:
    a collective, so every rank calls it for its micro-batch of the same index (the update's ranks run as many
    micro-batches, each rank's rows being B x G).

    Args:
        entropy: ``[N, T]`` each token's entropy (no gradient); mask: ``[N, T]`` 1 on active tokens;
        top_quantile: the share of the active tokens kept, in [0, 1];
        all_gather: ``tensor [k] -> [world, k]``, every rank's tensor in rank order; None: this rank alone;
        capacity: with ``all_gather``, a bound on ``N x T`` that every rank knows alike (its rows x the rollout's
            ``max_new_tokens``): the ranks meet in one gather (``every_ranks_values``); None: in two.
    """
    active = mask.bool()
    # torch.quantile takes float32 or float64; the comparison is in the same dtype, so a tie stays a tie
    entropy = entropy.detach().to(torch.promote_types(entropy.dtype, torch.float32))
    # the inactive tokens as NaN, which nanquantile leaves out: no boolean index, so no read back to the host (all
    # NaN, the threshold is NaN and no token is kept)
    values = entropy.masked_fill(~active, math.nan).flatten()
    if all_gather is not None:
        values = every_ranks_values(values, all_gather, capacity)
    threshold = _nan_quantile(values, 1.0 - top_quantile)
    return (entropy >= threshold) & active


#: The most values ``torch.quantile`` and ``torch.nanquantile`` take.
QUANTILE_LIMIT = 2 ** 24


def _nan_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.nanquantile(values, q)``, also past torch's ``QUANTILE_LIMIT`` where the values that are not NaN are
    fewer: every rank padded to a bound (``every_ranks_values``) can pass it with few active tokens. Only then are
    the NaN dropped, a boolean index whose count is read back to the host."""
    if values.numel() <= QUANTILE_LIMIT:
        return torch.nanquantile(values, q)
    present = values[~values.isnan()]
    return torch.nanquantile(present, q) if present.numel() else values.new_tensor(math.nan)


def check_entropy_mask(entropy_mask: torch.Tensor | None, top_quantile: float) -> None:
    """Refuse a high-entropy mask given where ``top_quantile`` (``top_entropy_quantile``) is 1: every active token
    is kept then and the mask is never applied, so a mask a caller took would be dropped without a word."""
    if entropy_mask is not None and top_quantile >= 1:
        raise ValueError(f"entropy_mask was given with {shown_setting('top_entropy_quantile', top_quantile)}: a "
                         "high-entropy mask applies only where top_entropy_quantile < 1 (pass entropy_mask=None, or a "
                         "quantile below 1)")


def every_ranks_values(values: torch.Tensor, all_gather: Callable[[torch.Tensor], torch.Tensor],
                       capacity: int | None = None) -> torch.Tensor:
    """``[world x size]`` every rank's ``values`` ``[n]`` (n differs: each micro-batch has its own width), each
    padded with NaN to one size: ``capacity``, a bound on n that every rank knows alike, so that one gather carries
    them and nothing is read back to the host; None: the longest n, found by a gather of the lengths (read to the
    host) before the one of the values. A collective: every rank calls it, with the same ``capacity``."""
    if capacity is None:
        capacity = int(all_gather(torch.tensor([values.numel()], device=values.device)).max())
    elif values.numel() > capacity:
        raise ValueError(f"{values.numel()} entropies to gather exceed capacity={capacity}, the bound every rank pads "
                         "to: it must be at least each rank's rows x completion width")
    padded = values.new_full((capacity,), math.nan)
    padded[:values.numel()] = values
    return all_gather(padded).flatten().to(values.device)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` k3 estimator of KL(policy || reference): ``exp(ref - logp) - (ref - logp) - 1`` (always >= 0)."""
    delta = ref_logps.detach() - logps
    return torch.exp(delta) - delta - 1.0
