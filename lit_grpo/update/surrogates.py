"""Per-token terms of the GRPO loss: importance ratios, the policy surrogates, the k3 KL (pure functions).

Shapes: ``N`` completions, ``T`` completion tokens (padded; ``mask`` marks the real ones). A ratio is ``[N, T]``
at token level and ``[N, 1]`` at sequence level (one value per completion, broadcast over its tokens).

Per token, with ``r`` the importance ratio of the current policy to the one the update started from::

    clip (grpo, bnpo, dr_grpo, dapo)   -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    cispo                              -sg(min(r, eps_high)) A logp        (sg: no gradient through the weight)
    sapo                               -(4 / tau) sigmoid(tau (r - 1)) A,  tau = tau_pos if A > 0 else tau_neg
    k3 KL to the reference             exp(ref - logp) - (ref - logp) - 1

cispo keeps a gradient on every token (the clipped weight only scales it) and sapo replaces the hard clip by a
smooth gate whose slope is 1 at ``r = 1`` (so on-policy it is the plain policy gradient).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from lit_grpo.runtime.validation import check_choice

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


def clip_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float,
                   epsilon_high: float) -> torch.Tensor:
    """PPO-clip loss ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, ``ratio``'s shape.

    Args:
        ratio: ``[N, T]`` or ``[N, 1]``; advantages: ``[N]``.
    """
    adv = _column(advantages, ratio)
    return -torch.min(ratio * adv, torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv)


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


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` k3 estimator of KL(policy || reference): ``exp(ref - logp) - (ref - logp) - 1`` (always >= 0)."""
    delta = ref_logps.detach() - logps
    return torch.exp(delta) - delta - 1.0
