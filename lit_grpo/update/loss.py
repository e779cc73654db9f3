"""The GRPO policy loss as functions, for callers that pick the variant per call (TRL's argument names).

Shapes: ``N`` completions (rows of a micro-batch), ``T`` completion tokens (padded; ``mask`` marks real ones).

Per token (terms in lit_grpo.update.surrogates, variants and their aggregation in lit_grpo.update.policy_losses)::

    r     = exp(logp - old_logp)                     per token, or per sequence (GSPO)
    loss  = surrogate(r, A) * w * m * e + beta * KL  w: the sampler correction (lit_grpo.update.sampler_correction)
    KL    = exp(ref - logp) - (ref - logp) - 1       (k3; times r with ``kl_bias_correction``)
    m     = 0 or 1 per completion                    the off-policy sequence mask (``off_policy_mask_threshold``;
                                                     1 without it)
    e     = 0 or 1 per token                         the high-entropy mask (``top_entropy_quantile``; 1 without it)

The settings (``loss_type``, ``epsilon_low``, ``beta``, ...) are ``LossConfig``'s fields (lit_grpo.update.loss_config),
given as keywords; each function is ``make_loss(**settings)`` and one method of the loss object it returns.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_grpo.update.policy_losses import Number, loss_class, make_loss


def micro_batch_weight(loss_type: str, num_sequences: int, total_sequences: int, num_micro_batches: int,
                       world_size: int = 1) -> float:
    """``loss_class(loss_type).micro_batch_weight(...)``: the factor for one micro-batch's ``policy_loss``."""
    return loss_class(loss_type).micro_batch_weight(num_sequences, total_sequences, num_micro_batches, world_size)


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logps: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    total_active_tokens: Number | None = None,
    sampling_weights: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    **settings: Any,
) -> torch.Tensor:
    """The GRPO loss of ``N`` completions: ``make_loss(**settings)(...)``, a scalar tensor.

    The tensors and normalizers are those of :meth:`PolicyLoss.__call__` (``logps``, ``old_logps``, ``mask``,
    ``ref_logps``, ``sampling_logps``, ``entropy``: ``[N, T]``; ``advantages``: ``[N]``; ``sampling_weights``:
    ``[N, T]`` or ``[N, 1]``); ``settings`` are ``LossConfig``'s fields (``loss_type="dapo"``, ``epsilon_low=0.2``,
    ...).
    """
    loss_fn = make_loss(**settings)
    return loss_fn(logps, old_logps, advantages, mask, ref_logps, max_completion_length, total_active_tokens,
                   sampling_weights, sampling_logps, entropy)


def policy_loss_metrics(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logps: torch.Tensor | None = None,
    **settings: Any,
) -> dict[str, torch.Tensor]:
    """``make_loss(**settings).metrics(...)``: ``clip_ratio_low``, ``clip_ratio_high``, ``kl`` (with ``ref_logps``)
    and ``active_tokens`` of ``N`` completions (:meth:`PolicyLoss.metrics`)."""
    return make_loss(**settings).metrics(logps, old_logps, advantages, mask, ref_logps)
