"""The GRPO policy loss: the variants (lit_grpo.update.policy_losses) and a functional API over them.

Shapes: ``N`` completions (rows of a micro-batch), ``T`` completion tokens (padded; ``mask`` marks real ones).

Per token (terms in lit_grpo.update.surrogates, variants and their aggregation in lit_grpo.update.policy_losses)::

    r     = exp(logp - old_logp)                     per token, or per sequence (GSPO)
    loss  = surrogate(r, A) * w + beta * KL          w: the sampler correction (lit_grpo.update.sampler_correction)
    KL    = exp(ref - logp) - (ref - logp) - 1       (k3; times r with ``kl_bias_correction``)

Objects (chosen once by name, validated when built)::

    loss_fn = make_loss("dapo", epsilon_low=0.2, epsilon_high=0.28, beta=0.0)
    loss = loss_fn(logps, old_logps, advantages, mask, total_active_tokens=step_tokens)
    loss = loss * loss_fn.micro_batch_weight(rows, step_rows, micro_batches, world_size)

The functions below (``policy_loss(..., loss_type=...)``, ``aggregate``, ``micro_batch_weight``) are the same
computation, for callers that pick the variant per call.
"""

from __future__ import annotations

import torch

from lit_grpo.update.policy_losses import (  # noqa: F401  (the public names of the loss live here too)
    LOSS_TYPES,
    LOSSES,
    BNPOLoss,
    CISPOLoss,
    DAPOLoss,
    DrGRPOLoss,
    GRPOLoss,
    LossType,
    Number,
    PolicyLoss,
    SAPOLoss,
    loss_class,
    make_loss,
)
from lit_grpo.update.surrogates import (  # noqa: F401
    IMPORTANCE_SAMPLING_LEVELS,
    ImportanceSamplingLevel,
    clipped_surrogate,
    importance_ratio,
    k3_kl,
    token_ratio,
)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    total_active_tokens: Number | None = None,
) -> torch.Tensor:
    """Reduce a ``[N, T]`` per-token loss to a scalar according to ``loss_type`` (lit_grpo.update.policy_losses' table).

    Args:
        per_token: ``[N, T]``.
        mask: ``[N, T]`` 1 for real completion tokens, 0 for padding (and for masked truncated completions).
        max_completion_length: dr_grpo's constant normalizer (the rollout's ``max_new_tokens``).
        total_active_tokens: dapo's (and cispo's) normalizer, the active tokens of the whole optimizer step.
    """
    variant = loss_class(loss_type)
    if variant is DrGRPOLoss and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length (the rollout's max_new_tokens), got None")
    return variant.aggregate(per_token, mask.to(per_token.dtype), max_completion_length, total_active_tokens)


def micro_batch_weight(loss_type: str, num_sequences: int, total_sequences: int, num_micro_batches: int,
                       world_size: int = 1) -> float:
    """``loss_class(loss_type).micro_batch_weight(...)``: the factor for one micro-batch's ``policy_loss``."""
    return loss_class(loss_type).micro_batch_weight(num_sequences, total_sequences, num_micro_batches, world_size)


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
    total_active_tokens: Number | None = None,
) -> None:
    """Raise ``ValueError`` naming the first bad argument of ``policy_loss``."""
    make_loss(loss_type, epsilon_low, epsilon_high, beta).check_inputs(
        logps, old_logps, advantages, mask, ref_logps, max_completion_length, total_active_tokens)


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
    total_active_tokens: Number | None = None,
    *,
    importance_sampling_level: str = "token",
    kl_bias_correction: bool = False,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    sampling_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The GRPO loss of ``N`` completions: ``make_loss(loss_type, ...)(...)``.

    The tensors and normalizers are those of :meth:`PolicyLoss.__call__` (``logps``, ``old_logps``, ``mask``,
    ``ref_logps``: ``[N, T]``; ``advantages``: ``[N]``; ``sampling_weights``: ``[N, T]`` or ``[N, 1]``);
    ``loss_type`` is ``grpo | bnpo | dr_grpo | dapo | cispo | sapo``; ``importance_sampling_level`` is
    ``token | sequence``. Returns a scalar tensor.
    """
    loss_fn = make_loss(loss_type, epsilon_low, epsilon_high, beta, importance_sampling_level, kl_bias_correction,
                        sapo_temperature_pos, sapo_temperature_neg)
    return loss_fn(logps, old_logps, advantages, mask, ref_logps, max_completion_length, total_active_tokens,
                   sampling_weights)


def policy_loss_metrics(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
    ref_logps: torch.Tensor | None = None,
    *,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    kl_bias_correction: bool = False,
) -> dict[str, torch.Tensor]:
    """``make_loss(...).metrics(...)``: ``clip_ratio_low``, ``clip_ratio_high``, ``kl`` (with ``ref_logps``) and
    ``active_tokens`` of ``N`` completions (:meth:`PolicyLoss.metrics`)."""
    loss_fn = make_loss(loss_type, epsilon_low, epsilon_high, 0.0, importance_sampling_level, kl_bias_correction)
    return loss_fn.metrics(logps, old_logps, advantages, mask, ref_logps)
