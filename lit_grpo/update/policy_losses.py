"""The GRPO loss variants as small frozen objects (torchtune rlhf/loss style), built from a ``LossConfig``.

Shapes: ``N`` completions (rows of a micro-batch), ``T`` completion tokens (padded; ``mask`` marks real ones).

Per token (the terms are in lit_grpo.update.surrogates)::

    r     = exp(logp - old_logp)                     token level, or per sequence (below)
    loss  = surrogate(r, A) * w * m * e + beta * KL  w: the sampler correction (lit_grpo.update.sampler_correction)
    KL    = exp(ref - logp) - (ref - logp) - 1       (k3; times r with ``kl_bias_correction``)
    m     = 0 or 1 per completion                    the off-policy sequence mask (``off_policy_mask_threshold``;
                                                     1 without it)
    e     = 0 or 1 per token                         the high-entropy mask (``top_entropy_quantile``: 1 on the
                                                     micro-batch's top share of tokens by entropy; 1 without it)

``importance_sampling_level="sequence"`` (GSPO) replaces each token's ratio by its completion's
``exp(mean over active tokens of (logp - old_logp))``. ``kl_bias_correction`` weighs the k3 KL by ``r``, which
makes its gradient the unbiased gradient of KL(policy || reference) when the tokens came from ``old_logp``.

The variants differ in their surrogate (clip, cispo, sapo, vespo: lit_grpo.update.surrogates), in how they reduce
the ``[N, T]`` token losses to a scalar and in how the micro-batches of one optimizer step (and the ranks) add up:

=========  ==========  ==================================================================  ======================
variant    surrogate   aggregation                                                         micro-batch weight
=========  ==========  ==================================================================  ======================
grpo       clip        mean over each sequence's tokens, then mean over sequences          rows / step rows
bnpo       clip        sum over all tokens / active tokens of this micro-batch             1 / micro-batches
dr_grpo    clip        sum / (num sequences x max_completion_length)                       rows / step rows
dapo       clip        sum / active tokens of the whole optimizer step                     world size
                       (``total_active_tokens``: all micro-batches, all ranks; without
                       it, this micro-batch's active tokens, then it equals bnpo)
cispo      cispo       as dapo                                                             world size
sapo       sapo        as grpo                                                             rows / step rows
luspo      clip        sum over each sequence's tokens, then mean over sequences           rows / step rows
                       (LUSPO: GSPO's sequence loss times the sequence's length)
vespo      vespo       as dapo                                                             world size
=========  ==========  ==================================================================  ======================

``micro_batch_weight`` is what each micro-batch's loss is multiplied by so that the weighted losses add up to the
loss of the whole optimizer step (exactly for all but bnpo, which is by definition a mean of per-micro-batch
ratios, as with gradient accumulation in TRL). dapo's weight is the world size because its normalizer already spans
every rank while ddp averages the ranks' gradients. ``top_entropy_quantile`` < 1 ranks each micro-batch's tokens, with
every rank's micro-batch of the same index under several (as TRL does per micro-batch over its processes), so which
tokens count depends on how the rows are cut.

Objects (built once from a ``LossConfig``, lit_grpo.update.loss_config)::

    loss_fn = make_loss(LossConfig(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28))   # or make_loss("dapo")
    loss = loss_fn(logps, old_logps, advantages, mask, total_active_tokens=step_tokens)
    loss = loss * loss_fn.micro_batch_weight(rows, step_rows, micro_batches, world_size)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lit_grpo.runtime.validation import check_choice, shown_setting, shown_value
from lit_grpo.update.loss_config import LOSS_TYPES, LossConfig
from lit_grpo.update.surrogates import (check_entropy_mask, cispo_surrogate, clip_surrogate, high_entropy_mask,
                                        importance_ratio, k3_kl, off_policy_sequence_mask, sapo_surrogate,
                                        vespo_weight)

Number = int | float | torch.Tensor


# ------------------------------------------------------------------------------------------------ the variants
@dataclass(frozen=True)
class PolicyLoss:
    """The surrogate + k3-KL loss; a subclass says which surrogate and how tokens and micro-batches are reduced.

    Args:
        config: the settings (``LossConfig``, checked when it was built); its ``loss_type`` is this variant's name.
    """

    config: LossConfig

    name: ClassVar[str]
    #: True when the aggregation divides by the whole step's active tokens (the caller must count them first).
    needs_step_tokens: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.config.loss_type != self.name:
            raise ValueError(f"{type(self).__name__} is loss_type={self.name!r}, its config says "
                             f"loss_type={self.config.loss_type!r} (use make_loss(config))")

    def __call__(
        self,
        logps: torch.Tensor,
        old_logps: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logps: torch.Tensor | None = None,
        max_completion_length: int | None = None,
        total_active_tokens: Number | None = None,
        sampling_weights: torch.Tensor | None = None,
        sampling_logps: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
        entropy_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The scalar loss of ``N`` completions.

        Args:
            logps: ``[N, T]`` per-token log-probs under the current policy (with gradient).
            old_logps: ``[N, T]`` under the policy that sampled (``logps.detach()`` when each rollout is used once).
            advantages: ``[N]``. NaN in an advantage, or in an active token's log-prob, makes the loss NaN (not
                looked for: that would wait on the device at every call).
            mask: ``[N, T]`` 1/True for tokens that count; what the other tensors hold where it is 0 (NaN, -inf)
                reaches neither the loss nor its gradient. Every tensor on ``logps``' device.
            ref_logps: ``[N, T]`` under the frozen reference model; needed when ``beta > 0``.
            max_completion_length: dr_grpo's normalizer (the rollout's ``max_new_tokens``).
            total_active_tokens: dapo's (and cispo's and vespo's) normalizer spanning the optimizer step: a number,
                or a one-element tensor (used where it is, never read back to the host).
            sampling_weights: ``[N, T]`` or ``[N, 1]`` the sampler correction's weights (no gradient), which
                multiply the policy term, not the KL; None: no correction.
            sampling_logps: ``[N, T]`` the sampler's log-probs, which ``off_policy_mask_threshold`` compares with
                ``logps`` (None: ``old_logps``, the sampler when the rollout ran on the update's weights).
            entropy: ``[N, T]`` each token's entropy under the current policy at the sampling temperature (no
                gradient), which ``top_entropy_quantile`` < 1 ranks these ``N`` completions' tokens by; needed then.
            all_gather: several ranks: ``tensor [k] -> [world, k]``, so that ``top_entropy_quantile``'s quantile
                spans every rank's micro-batch, as TRL's (``high_entropy_mask``; every rank calls the loss in
                lockstep then); None: these ``N`` completions' alone.
            entropy_mask: ``[N, T]`` bool the high-entropy mask already taken (``high_entropy_mask`` of ``entropy``
                with ``all_gather``), used as it is: a caller that needs it too (the entropy bonus) takes it once,
                so the ranks gather once; None: taken here where ``top_entropy_quantile`` < 1. Refused where
                ``top_entropy_quantile`` is 1 (no token is masked then: the mask would be dropped unread).
        """
        self.check_inputs(logps, old_logps, advantages, mask, ref_logps, max_completion_length, total_active_tokens)
        for name, tensor in (("sampling_logps", sampling_logps), ("entropy", entropy), ("entropy_mask", entropy_mask)):
            if tensor is not None and tensor.shape != logps.shape:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected logps' shape "
                                 f"{tuple(logps.shape)}")
        _check_devices(logps, sampling_logps=sampling_logps, entropy=entropy, entropy_mask=entropy_mask,
                       sampling_weights=sampling_weights)
        check_entropy_mask(entropy_mask, self.config.top_entropy_quantile)
        if self.config.top_entropy_quantile < 1 and entropy is None and entropy_mask is None:
            raise ValueError(f"{shown_setting('top_entropy_quantile', self.config.top_entropy_quantile)} < 1 needs "
                             "entropy (each token's entropy, [N, T]), got None")
        if sampling_weights is not None and sampling_weights.shape not in (logps.shape, logps.shape[:1] + (1,)):
            raise ValueError(f"sampling_weights has shape {tuple(sampling_weights.shape)}, expected "
                             f"{tuple(logps.shape)} or {(logps.shape[0], 1)}")
        # sampling_logps and entropy are not filled: their only readers (off_policy_sequence_mask, high_entropy_mask)
        # leave padding out themselves, so two fills a micro-batch would change nothing
        logps, old_logps, ref_logps, sampling_weights = _padding_ignored(mask, logps, old_logps, ref_logps,
                                                                         sampling_weights)
        per_token = self.per_token_loss(logps, old_logps, advantages, mask, ref_logps, sampling_weights,
                                        sampling_logps, entropy, all_gather, entropy_mask)
        return self.aggregate(per_token, mask.to(per_token.dtype), max_completion_length, total_active_tokens)

    def per_token_loss(self, logps, old_logps, advantages, mask, ref_logps=None, sampling_weights=None,
                       sampling_logps=None, entropy=None, all_gather=None, entropy_mask=None):
        """``[N, T]`` token losses before aggregation (arguments as in ``__call__``)."""
        ratio = importance_ratio(logps, old_logps, mask, self.config.importance_sampling_level)
        per_token = self.policy_term(ratio, logps, old_logps, advantages, mask, sampling_weights)
        if (threshold := self.config.off_policy_mask_threshold) is not None:
            sampled = old_logps if sampling_logps is None else sampling_logps
            per_token = per_token * off_policy_sequence_mask(logps, sampled, mask, advantages, threshold)
        if (top_quantile := self.config.top_entropy_quantile) < 1:
            if entropy_mask is None:
                entropy_mask = high_entropy_mask(entropy, mask, top_quantile, all_gather)
            per_token = per_token * entropy_mask.to(per_token.dtype)
        if self.config.beta > 0:
            kl = k3_kl(logps, ref_logps)
            per_token = per_token + self.config.beta * (kl * ratio if self.config.kl_bias_correction else kl)
        return per_token

    def policy_term(self, ratio, logps, old_logps, advantages, mask, sampling_weights=None) -> torch.Tensor:
        """``[N, T]`` the surrogate times the sampler correction's weights (arguments as in ``__call__``, ``ratio``
        from ``importance_ratio``)."""
        per_token = self.surrogate(ratio, logps, advantages).expand_as(logps)
        if sampling_weights is not None:
            per_token = per_token * sampling_weights.detach().to(per_token.dtype)
        return per_token

    def surrogate(self, ratio: torch.Tensor, logps: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """The policy term per token: ``ratio`` ``[N, T]`` or ``[N, 1]``, ``logps`` ``[N, T]``, ``advantages``
        ``[N]``; returns ``[N, T]`` or ``[N, 1]``."""
        return clip_surrogate(ratio, advantages, self.config.epsilon_low, self.config.epsilon_high, self.config.delta)

    def clipped(self, ratio: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bool masks (``ratio``'s shape) of the tokens whose ratio is clipped from below / above with an
        advantage that makes the clip bind; ``advantages``: ``[N]``."""
        adv = advantages.unsqueeze(1)
        return (ratio < 1.0 - self.config.epsilon_low) & (adv < 0), (ratio > 1.0 + self.config.epsilon_high) & (adv > 0)

    @staticmethod
    def aggregate(per_token: torch.Tensor, mask: torch.Tensor, max_completion_length: int | None,
                  total_active_tokens: Number | None) -> torch.Tensor:
        """Reduce ``[N, T]`` token losses (``mask`` as ``per_token``'s dtype) to a scalar."""
        raise NotImplementedError

    @classmethod
    def micro_batch_weight(cls, num_sequences: int, total_sequences: int, num_micro_batches: int,
                           world_size: int = 1) -> float:
        """Factor for one micro-batch's loss so that the factors' weighted sum is the whole step's loss.

        Args:
            num_sequences: rows in this micro-batch.
            total_sequences: rows in the whole optimizer step (all micro-batches of this rank).
            num_micro_batches: micro-batches in the step.
            world_size: data-parallel ranks whose gradients are averaged.
        """
        if num_sequences < 1 or total_sequences < num_sequences or num_micro_batches < 1 or world_size < 1:
            raise ValueError(f"bad micro-batch sizes: num_sequences={num_sequences}, total_sequences="
                             f"{total_sequences}, num_micro_batches={num_micro_batches}, world_size={world_size} "
                             "(need 1 <= num_sequences <= total_sequences, num_micro_batches >= 1, world_size >= 1)")
        return cls._weight(num_sequences, total_sequences, num_micro_batches, world_size)

    @staticmethod
    def _weight(num_sequences: int, total_sequences: int, num_micro_batches: int, world_size: int) -> float:
        return num_sequences / total_sequences

    def check_inputs(self, logps, old_logps, advantages, mask, ref_logps=None, max_completion_length=None,
                     total_active_tokens=None) -> None:
        """Raise ``ValueError`` naming the first bad tensor or normalizer of a call."""
        if logps.dim() != 2:
            raise ValueError(f"logps must be [N, T] (2-D), got shape {tuple(logps.shape)}")
        for name, tensor in (("old_logps", old_logps), ("mask", mask), ("ref_logps", ref_logps)):
            if tensor is not None and tensor.shape != logps.shape:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected logps' shape "
                                 f"{tuple(logps.shape)}")
        if advantages.shape != logps.shape[:1]:
            raise ValueError(f"advantages must be [N] = [{logps.shape[0]}], got shape {tuple(advantages.shape)}")
        for name, tensor in (("logps", logps), ("old_logps", old_logps), ("ref_logps", ref_logps)):
            if tensor is not None and not tensor.is_floating_point():
                raise ValueError(f"{name} must be floating point (log-probs), got {tensor.dtype}")
        _check_devices(logps, old_logps=old_logps, advantages=advantages, mask=mask, ref_logps=ref_logps)
        if self.config.beta > 0 and ref_logps is None:
            raise ValueError(f"beta={self.config.beta} > 0 needs ref_logps (log-probs under the reference model), "
                             "got None")
        if isinstance(total_active_tokens, torch.Tensor):  # on the device: its sign is not read back (a wait)
            if total_active_tokens.numel() != 1:
                raise ValueError("total_active_tokens must be a number or a one-element tensor, got a tensor of "
                                 f"shape {tuple(total_active_tokens.shape)}")
        elif total_active_tokens is not None and total_active_tokens < 0:
            raise ValueError(f"{shown_setting('total_active_tokens', total_active_tokens)} must be >= 0")

    @torch.no_grad()
    def metrics(self, logps, old_logps, advantages, mask, ref_logps=None,
                sampling_weights=None) -> dict[str, torch.Tensor]:
        """Means over the active tokens (or completions) of ``N`` completions, for logging (arguments as in
        ``__call__``).

        Returns a dict of scalar tensors:
            ``clip_ratio_low`` / ``clip_ratio_high``: share of the ratios (at this loss's level: tokens, or under
            GSPO completions with an active token) clipped where the clip binds (``clipped``; cispo: its cap,
            sapo and vespo: never);
            ``kl``: mean k3 KL to the reference, as the loss weighs it (only when ``ref_logps`` is given);
            ``active_tokens``: the number of active tokens (the weight for averaging ``kl`` over micro-batches);
            ``clip_units``: the number of ratios the clip shares count (the weight for averaging them);
            vespo only: ``phi_seq_mean``, the mean of its weight over the ``N`` completions (TRL's
            ``vespo/phi_seq_mean``), with ``completions``, ``N`` (the weight for averaging it).
        """
        PolicyLoss.check_inputs(self, logps, old_logps, advantages, mask, ref_logps)  # the tensors': no normalizer
        logps, old_logps, ref_logps = _padding_ignored(mask, logps, old_logps, ref_logps)
        mask = mask.to(logps.dtype)
        active = mask.sum()
        ratio = importance_ratio(logps, old_logps, mask, self.config.importance_sampling_level)
        # a share of what the clip acts on: tokens, or whole completions under GSPO (as TRL counts them)
        sequences = self.config.importance_sampling_level == "sequence"
        units = (mask.sum(dim=1, keepdim=True) > 0).to(mask.dtype) if sequences else mask
        clip_units = units.sum()
        low, high = (flags.to(logps.dtype) for flags in self.clipped(ratio, advantages))
        out = {"clip_ratio_low": (low * units).sum() / clip_units.clamp(min=1.0),
               "clip_ratio_high": (high * units).sum() / clip_units.clamp(min=1.0),
               "active_tokens": active, "clip_units": clip_units}
        if ref_logps is not None:
            kl = k3_kl(logps, ref_logps)
            out["kl"] = ((kl * ratio if self.config.kl_bias_correction else kl) * mask).sum() / active.clamp(min=1.0)
        return out


@dataclass(frozen=True)
class GRPOLoss(PolicyLoss):
    """grpo: each sequence's token mean, then the mean over sequences (long answers weigh no more than short)."""

    name: ClassVar[str] = "grpo"

    @staticmethod
    def aggregate(per_token, mask, max_completion_length, total_active_tokens):
        return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()


@dataclass(frozen=True)
class BNPOLoss(PolicyLoss):
    """bnpo: the token mean over the micro-batch; micro-batches are averaged."""

    name: ClassVar[str] = "bnpo"

    @staticmethod
    def aggregate(per_token, mask, max_completion_length, total_active_tokens):
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)

    @staticmethod
    def _weight(num_sequences, total_sequences, num_micro_batches, world_size):
        return 1.0 / num_micro_batches


@dataclass(frozen=True)
class DrGRPOLoss(PolicyLoss):
    """dr_grpo: the token sum over a constant, ``N x max_completion_length`` (no length bias)."""

    name: ClassVar[str] = "dr_grpo"

    @staticmethod
    def aggregate(per_token, mask, max_completion_length, total_active_tokens):
        return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)

    def check_inputs(self, logps, old_logps, advantages, mask, ref_logps=None, max_completion_length=None,
                     total_active_tokens=None) -> None:
        super().check_inputs(logps, old_logps, advantages, mask, ref_logps, max_completion_length,
                             total_active_tokens)
        if max_completion_length is None or max_completion_length < 1:
            raise ValueError(f"loss_type='dr_grpo' needs max_completion_length >= 1 (the rollout's "
                             f"max_new_tokens), got {shown_value(max_completion_length)}")


@dataclass(frozen=True)
class DAPOLoss(PolicyLoss):
    """dapo: the token sum over the whole optimizer step's active tokens (every micro-batch, every rank)."""

    name: ClassVar[str] = "dapo"
    needs_step_tokens: ClassVar[bool] = True

    @staticmethod
    def aggregate(per_token, mask, max_completion_length, total_active_tokens):
        denominator = mask.sum() if total_active_tokens is None else torch.as_tensor(total_active_tokens).reshape(())
        return (per_token * mask).sum() / denominator.to(per_token.dtype).clamp(min=1.0)

    @staticmethod
    def _weight(num_sequences, total_sequences, num_micro_batches, world_size):
        # the normalizer already spans the step and the ranks; ddp then AVERAGES the ranks' gradients, so scale by
        # the world size to get the gradient of sum(all ranks' tokens) / total tokens.
        return float(world_size)


@dataclass(frozen=True)
class CISPOLoss(DAPOLoss):
    """cispo: ``-sg(min(r, epsilon_high)) A logp`` aggregated as dapo; ``epsilon_high`` is the ratio's cap."""

    name: ClassVar[str] = "cispo"

    def surrogate(self, ratio, logps, advantages):
        return cispo_surrogate(ratio, logps, advantages, self.config.epsilon_high)

    def clipped(self, ratio, advantages):
        adv = advantages.unsqueeze(1)
        return torch.zeros_like(ratio, dtype=torch.bool), (ratio > self.config.epsilon_high) & (adv > 0)


@dataclass(frozen=True)
class SAPOLoss(GRPOLoss):
    """sapo: the soft gate ``-(4 / tau) sigmoid(tau (r - 1)) A`` aggregated as grpo; no hard clip (``tau``: the
    config's ``sapo_temperature_pos`` / ``_neg`` by the advantage's sign; larger is a sharper gate)."""

    name: ClassVar[str] = "sapo"

    def surrogate(self, ratio, logps, advantages):
        return sapo_surrogate(ratio, advantages, self.config.sapo_temperature_pos, self.config.sapo_temperature_neg)

    def clipped(self, ratio, advantages):
        none = torch.zeros_like(ratio, dtype=torch.bool)
        return none, none


@dataclass(frozen=True)
class LUSPOLoss(PolicyLoss):
    """luspo: the clip surrogate summed over each sequence's tokens, then the mean over sequences. With GSPO's
    sequence ratio (``importance_sampling_level="sequence"``, the paper's setup) it is GSPO's per-sequence loss
    weighed by the sequence's length, which removes GSPO's bias toward short completions."""

    name: ClassVar[str] = "luspo"

    @staticmethod
    def aggregate(per_token, mask, max_completion_length, total_active_tokens):
        return (per_token * mask).sum(dim=1).mean()


@dataclass(frozen=True)
class VESPOLoss(DAPOLoss):
    """vespo: ``-sg(phi(w)) A logp`` aggregated as dapo, ``phi`` a smooth Gamma-shaped weight of each completion's
    sequence ratio ``w`` in place of a clip (``vespo_weight``; its shape: the config's ``vespo_*``). The sampler
    correction's weights enter ``w`` rather than multiplying the loss."""

    name: ClassVar[str] = "vespo"

    def policy_term(self, ratio, logps, old_logps, advantages, mask, sampling_weights=None):
        c = self.config
        phi = vespo_weight(logps, old_logps.detach(), mask, advantages, c.vespo_k_pos, c.vespo_lambda_pos,
                           c.vespo_k_neg, c.vespo_lambda_neg, sampling_weights)                # [N, 1]
        return -phi.to(logps.dtype) * advantages.detach().unsqueeze(1).to(logps.dtype) * logps

    def clipped(self, ratio, advantages):
        none = torch.zeros_like(ratio, dtype=torch.bool)
        return none, none

    @torch.no_grad()
    def metrics(self, logps, old_logps, advantages, mask, ref_logps=None, sampling_weights=None):
        out = super().metrics(logps, old_logps, advantages, mask, ref_logps, sampling_weights)
        logps, old_logps, sampling_weights = _padding_ignored(mask, logps, old_logps, sampling_weights)
        c = self.config
        phi = vespo_weight(logps, old_logps, mask, advantages, c.vespo_k_pos, c.vespo_lambda_pos, c.vespo_k_neg,
                           c.vespo_lambda_neg, sampling_weights)                                   # [N, 1]
        out["phi_seq_mean"] = phi.to(logps.dtype).mean()
        out["completions"] = torch.tensor(float(phi.shape[0]), dtype=logps.dtype, device=logps.device)
        return out


def _check_devices(logps: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming the first of ``tensors`` (None: absent) on another device than ``logps``: read
    from the tensors' attributes, nothing waits on the device."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != logps.device:
            raise ValueError(f"{name} is on {tensor.device}, logps on {logps.device}: every tensor of the loss must "
                             "be on one device")


def _padding_ignored(mask: torch.Tensor, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` (``[N, T]``, or None, or a ``[N, 1]`` weight left as it is) with 0 where ``mask`` is 0, so that
    what padding holds (NaN or -inf where no log-prob was computed) reaches neither the loss nor its gradient, which
    ``per_token * mask`` alone would turn into NaN. Elementwise, on the device: no wait on it."""
    padding = ~mask.bool()
    return tuple(tensor.masked_fill(padding, 0.0) if tensor is not None and tensor.shape == mask.shape else tensor
                 for tensor in tensors)


LOSSES: dict[str, type[PolicyLoss]] = {cls.name: cls for cls in (GRPOLoss, BNPOLoss, DrGRPOLoss, DAPOLoss,
                                                                 CISPOLoss, SAPOLoss, LUSPOLoss, VESPOLoss)}


def loss_class(loss_type: str) -> type[PolicyLoss]:
    """The variant registered under ``loss_type``; a clear error for any other name."""
    return LOSSES[check_choice("loss_type", loss_type, LOSS_TYPES)]


def make_loss(config: LossConfig | str | None = None, **settings: Any) -> PolicyLoss:
    """The loss object of ``config``; given a name or nothing, of ``LossConfig(loss_type=config, **settings)``
    (``settings`` may then hold ``loss_type``). Checked once; equal settings share one frozen object."""
    if isinstance(config, str):
        config = LossConfig(loss_type=config, **settings)
    elif config is None:
        config = LossConfig(**settings)
    elif settings:
        raise TypeError(f"make_loss got a LossConfig and settings {sorted(settings)}; put them in the config")
    return _loss_of(config)


@functools.lru_cache(maxsize=64)
def _loss_of(config: LossConfig) -> PolicyLoss:
    return LOSSES[config.loss_type](config)
