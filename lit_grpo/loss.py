"""The GRPO policy loss as small pure functions (torchtune rlhf/loss style).

Shapes: ``N`` completions (rows of a micro-batch), ``T`` completion tokens (padded; ``mask`` marks real ones).

Per token (see ../shared/papers.md, section 4)::

    r     = exp(logp - old_logp)
    loss  = -min(r * A, clip(r, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * KL
    KL    = exp(ref - logp) - (ref - logp) - 1                                  (k3 estimator)

Aggregation over tokens (``loss_type``):

=========  ==================================================================================
grpo       mean over each sequence's tokens, then mean over sequences
bnpo       sum over all tokens / active tokens of this micro-batch
dr_grpo    sum / (num sequences x max_completion_length)
dapo       sum / active tokens of the whole optimizer step (``total_active_tokens``: all micro-batches, all
           ranks); without it, this micro-batch's active tokens (then it equals bnpo)
=========  ==================================================================================

Micro-batching: ``policy_loss`` is the loss of the rows it is given. ``micro_batch_weight`` says what to multiply
each micro-batch's loss by so that the weighted losses add up to the loss of the whole optimizer step (exactly for
grpo, dr_grpo and dapo; bnpo is by definition a mean of per-micro-batch ratios, as with gradient accumulation in
TRL).
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


# ------------------------------------------------------------------------------------------------ per token
def token_ratio(logps: torch.Tensor, old_logps: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` importance ratio ``exp(logp - old_logp)`` of the current policy to the sampling one."""
    return torch.exp(logps - old_logps)


def clipped_surrogate(
    logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> torch.Tensor:
    """``[N, T]`` PPO-clip token loss ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``.

    Args:
        logps, old_logps: ``[N, T]`` log-probs of the completion tokens under the current / sampling policy
            (``old_logps`` carries no gradient).
        advantages: ``[N]``, one per completion, broadcast over its tokens.
    """
    ratio = token_ratio(logps, old_logps.detach())
    adv = advantages.detach().unsqueeze(1).to(ratio.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    return -torch.min(unclipped, clipped)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` k3 estimator of KL(policy || reference): ``exp(ref - logp) - (ref - logp) - 1`` (always >= 0)."""
    delta = ref_logps.detach() - logps
    return torch.exp(delta) - delta - 1.0


# ------------------------------------------------------------------------------------------------ aggregation
def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    total_active_tokens: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a ``[N, T]`` per-token loss to a scalar according to ``loss_type`` (module docstring table).

    Args:
        per_token: ``[N, T]``.
        mask: ``[N, T]`` 1 for real completion tokens, 0 for padding (and for masked truncated completions).
        max_completion_length: dr_grpo's constant normalizer (the rollout's ``max_new_tokens``).
        total_active_tokens: dapo's normalizer, the active tokens of the whole optimizer step.
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (the rollout's max_new_tokens), got None")
        return masked.sum() / (per_token.shape[0] * max_completion_length)
    if loss_type == "dapo":
        denominator = mask.sum() if total_active_tokens is None else torch.as_tensor(total_active_tokens)
        return masked.sum() / denominator.to(per_token.dtype).clamp(min=1.0)
    raise ValueError(f"loss_type={loss_type!r} is not supported; use one of {list(LOSS_TYPES)}")


def micro_batch_weight(loss_type: str, num_sequences: int, total_sequences: int, num_micro_batches: int) -> float:
    """Factor for one micro-batch's ``policy_loss`` so that the factors' weighted sum is the whole step's loss.

    Args:
        num_sequences: rows in this micro-batch.
        total_sequences: rows in the whole optimizer step (all micro-batches of this rank).
        num_micro_batches: micro-batches in the step.

    grpo and dr_grpo average over sequences: weight ``num_sequences / total_sequences``. dapo already divides by
    the step's active tokens: weight 1. bnpo is a per-micro-batch ratio: weight ``1 / num_micro_batches``.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not supported; use one of {list(LOSS_TYPES)}")
    if num_sequences < 1 or total_sequences < num_sequences or num_micro_batches < 1:
        raise ValueError(f"bad micro-batch sizes: num_sequences={num_sequences}, total_sequences={total_sequences}, "
                         f"num_micro_batches={num_micro_batches} (need 1 <= num_sequences <= total_sequences and "
                         "num_micro_batches >= 1)")
    if loss_type in ("grpo", "dr_grpo"):
        return num_sequences / total_sequences
    if loss_type == "dapo":
        return 1.0
    return 1.0 / num_micro_batches


# ------------------------------------------------------------------------------------------------ the loss
def check_loss_inputs(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    max_completion_length: int | None = None,
    total_active_tokens: int | float | torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` naming the first bad argument of ``policy_loss``."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not supported; use one of {list(LOSS_TYPES)}")
    if logps.dim() != 2:
        raise ValueError(f"logps must be [N, T] (2-D), got shape {tuple(logps.shape)}")
    for name, tensor in (("old_logps", old_logps), ("mask", mask), ("ref_logps", ref_logps)):
        if tensor is not None and tensor.shape != logps.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected logps' shape {tuple(logps.shape)}")
    if advantages.shape != logps.shape[:1]:
        raise ValueError(f"advantages must be [N] = [{logps.shape[0]}], got shape {tuple(advantages.shape)}")
    for name, eps in (("epsilon_low", epsilon_low), ("epsilon_high", epsilon_high)):
        if not eps >= 0:
            raise ValueError(f"{name}={eps!r} must be >= 0")
    if epsilon_low >= 1:
        raise ValueError(f"epsilon_low={epsilon_low!r} must be < 1 (the ratio's lower clip 1 - epsilon_low must be > 0)")
    if not beta >= 0:
        raise ValueError(f"beta={beta!r} must be >= 0")
    if beta > 0 and ref_logps is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logps (log-probs under the reference model), got None")
    if loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length < 1):
        raise ValueError(f"loss_type='dr_grpo' needs max_completion_length >= 1, got {max_completion_length!r}")
    if total_active_tokens is not None and float(total_active_tokens) < 0:
        raise ValueError(f"total_active_tokens={total_active_tokens!r} must be >= 0")


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    max_completion_length: int | None = None,
    total_active_tokens: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The GRPO loss of ``N`` completions (module docstring).

    Args:
        logps: ``[N, T]`` per-token log-probs under the current policy (with gradient).
        old_logps: ``[N, T]`` under the policy that sampled (``logps.detach()`` when each rollout is used once).
        advantages: ``[N]``.
        mask: ``[N, T]`` 1/True for tokens that count.
        loss_type: ``grpo | bnpo | dr_grpo | dapo``.
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]`` of the ratio.
        ref_logps: ``[N, T]`` under the frozen reference model; needed when ``beta > 0``.
        beta: weight of the k3 KL penalty.
        max_completion_length: dr_grpo's normalizer.
        total_active_tokens: dapo's normalizer spanning the optimizer step.

    Returns:
        A scalar tensor.
    """
    check_loss_inputs(logps, old_logps, advantages, mask, loss_type, epsilon_low, epsilon_high, ref_logps, beta,
                      max_completion_length, total_active_tokens)
    per_token = clipped_surrogate(logps, old_logps, advantages, epsilon_low, epsilon_high)
    if beta > 0:
        per_token = per_token + beta * k3_kl(logps, ref_logps)
    return aggregate(per_token, mask, loss_type, max_completion_length, total_active_tokens)


@torch.no_grad()
def policy_loss_metrics(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
    ref_logps: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Token means over the active tokens of ``N`` completions, for logging.

    Returns a dict of scalar tensors:
        ``clip_ratio_low``: share of tokens with ``r < 1 - epsilon_low`` and ``A < 0`` (the clip is active);
        ``clip_ratio_high``: share with ``r > 1 + epsilon_high`` and ``A > 0``;
        ``kl``: mean k3 KL to the reference (only when ``ref_logps`` is given);
        ``active_tokens``: the number of active tokens (the weight for averaging these over micro-batches).
    """
    mask = mask.to(logps.dtype)
    active = mask.sum()
    denominator = active.clamp(min=1.0)
    ratio = token_ratio(logps, old_logps)
    adv = advantages.unsqueeze(1)
    low = ((ratio < 1.0 - epsilon_low) & (adv < 0)).to(logps.dtype)
    high = ((ratio > 1.0 + epsilon_high) & (adv > 0)).to(logps.dtype)
    out = {
        "clip_ratio_low": (low * mask).sum() / denominator,
        "clip_ratio_high": (high * mask).sum() / denominator,
        "active_tokens": active,
    }
    if ref_logps is not None:
        out["kl"] = (k3_kl(logps, ref_logps) * mask).sum() / denominator
    return out
