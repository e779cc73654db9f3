"""The GRPO policy loss: pure per-token functions and one small object per variant (torchtune rlhf/loss style).

Shapes: ``N`` completions (rows of a micro-batch), ``T`` completion tokens (padded; ``mask`` marks real ones).

Per token (see ../shared/papers.md, section 4)::

    r     = exp(logp - old_logp)
    loss  = -min(r * A, clip(r, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * KL
    KL    = exp(ref - logp) - (ref - logp) - 1                                  (k3 estimator)

The variants differ only in how they reduce the ``[N, T]`` token losses to a scalar and in how the micro-batches of
one optimizer step (and the ranks) add up:

=========  ==================================================================  ==========================
variant    aggregation                                                         micro-batch weight
=========  ==================================================================  ==========================
grpo       mean over each sequence's tokens, then mean over sequences          rows / step rows
bnpo       sum over all tokens / active tokens of this micro-batch             1 / micro-batches
dr_grpo    sum / (num sequences x max_completion_length)                       rows / step rows
dapo       sum / active tokens of the whole optimizer step                     world size
           (``total_active_tokens``: all micro-batches, all ranks; without
           it, this micro-batch's active tokens, then it equals bnpo)
=========  ==================================================================  ==========================

``micro_batch_weight`` is what each micro-batch's loss is multiplied by so that the weighted losses add up to the
loss of the whole optimizer step (exactly for grpo, dr_grpo and dapo; bnpo is by definition a mean of
per-micro-batch ratios, as with gradient accumulation in TRL). dapo's weight is the world size because its
normalizer already spans every rank while ddp averages the ranks' gradients.

Objects (chosen once by name, validated when built)::

    loss_fn = make_loss("dapo", epsilon_low=0.2, epsilon_high=0.28, beta=0.0)
    loss = loss_fn(logps, old_logps, advantages, mask, total_active_tokens=step_tokens)
    loss = loss * loss_fn.micro_batch_weight(rows, step_rows, micro_batches, world_size)

The functional API (``policy_loss(..., loss_type=...)``, ``aggregate``, ``micro_batch_weight``) is the same
computation, for callers that pick the variant per call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")


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


# ------------------------------------------------------------------------------------------------ the variants
@dataclass(frozen=True)
class PolicyLoss:
    """The clipped-surrogate + k3-KL loss; a subclass says how tokens and micro-batches are reduced.

    Args:
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]`` of the ratio.
        beta: weight of the k3 KL penalty (``> 0`` needs ``ref_logps`` at call time).
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0

    name: ClassVar[str]
    #: True when the aggregation divides by the whole step's active tokens (the caller must count them first).
    needs_step_tokens: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for name in ("epsilon_low", "epsilon_high"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name}={value!r} must be >= 0")
        if self.epsilon_low >= 1:
            raise ValueError(f"epsilon_low={self.epsilon_low!r} must be < 1 (the ratio's lower clip "
                             "1 - epsilon_low must be > 0)")
        if not self.beta >= 0:
            raise ValueError(f"beta={self.beta!r} must be >= 0")

    def __call__(
        self,
        logps: torch.Tensor,
        old_logps: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logps: torch.Tensor | None = None,
        max_completion_length: int | None = None,
        total_active_tokens: int | float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The scalar loss of ``N`` completions.

        Args:
            logps: ``[N, T]`` per-token log-probs under the current policy (with gradient).
            old_logps: ``[N, T]`` under the policy that sampled (``logps.detach()`` when each rollout is used once).
            advantages: ``[N]``.
            mask: ``[N, T]`` 1/True for tokens that count.
            ref_logps: ``[N, T]`` under the frozen reference model; needed when ``beta > 0``.
            max_completion_length: dr_grpo's normalizer (the rollout's ``max_new_tokens``).
            total_active_tokens: dapo's normalizer spanning the optimizer step.
        """
        self.check_inputs(logps, old_logps, advantages, mask, ref_logps, max_completion_length, total_active_tokens)
        per_token = clipped_surrogate(logps, old_logps, advantages, self.epsilon_low, self.epsilon_high)
        if self.beta > 0:
            per_token = per_token + self.beta * k3_kl(logps, ref_logps)
        return self.aggregate(per_token, mask.to(per_token.dtype), max_completion_length, total_active_tokens)

    @staticmethod
    def aggregate(per_token: torch.Tensor, mask: torch.Tensor, max_completion_length: int | None,
                  total_active_tokens: int | float | torch.Tensor | None) -> torch.Tensor:
        """Reduce ``[N, T]`` token losses (``mask`` as ``per_token``'s dtype) to a scalar."""
        raise NotImplementedError

    def micro_batch_weight(self, num_sequences: int, total_sequences: int, num_micro_batches: int,
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
        return self._weight(num_sequences, total_sequences, num_micro_batches, world_size)

    def _weight(self, num_sequences: int, total_sequences: int, num_micro_batches: int, world_size: int) -> float:
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
        if self.beta > 0 and ref_logps is None:
            raise ValueError(f"beta={self.beta} > 0 needs ref_logps (log-probs under the reference model), got None")
        if total_active_tokens is not None and float(total_active_tokens) < 0:
            raise ValueError(f"total_active_tokens={total_active_tokens!r} must be >= 0")


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

    def _weight(self, num_sequences, total_sequences, num_micro_batches, world_size):
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
                             f"max_new_tokens), got {max_completion_length!r}")


@dataclass(frozen=True)
class DAPOLoss(PolicyLoss):
    """dapo: the token sum over the whole optimizer step's active tokens (every micro-batch, every rank)."""

    name: ClassVar[str] = "dapo"
    needs_step_tokens: ClassVar[bool] = True

    @staticmethod
    def aggregate(per_token, mask, max_completion_length, total_active_tokens):
        denominator = mask.sum() if total_active_tokens is None else torch.as_tensor(total_active_tokens)
        return (per_token * mask).sum() / denominator.to(per_token.dtype).clamp(min=1.0)

    def _weight(self, num_sequences, total_sequences, num_micro_batches, world_size):
        # the normalizer already spans the step and the ranks; ddp then AVERAGES the ranks' gradients, so scale by
        # the world size to get the gradient of sum(all ranks' tokens) / total tokens.
        return float(world_size)


LOSSES: dict[str, type[PolicyLoss]] = {cls.name: cls for cls in (GRPOLoss, BNPOLoss, DrGRPOLoss, DAPOLoss)}


def loss_class(loss_type: str) -> type[PolicyLoss]:
    """The variant registered under ``loss_type``; a clear error for any other name."""
    try:
        return LOSSES[loss_type]
    except (KeyError, TypeError):
        raise ValueError(f"loss_type={loss_type!r} is not supported; use one of {list(LOSS_TYPES)}") from None


@functools.lru_cache(maxsize=64)
def make_loss(loss_type: str, epsilon_low: float = 0.2, epsilon_high: float = 0.28, beta: float = 0.0) -> PolicyLoss:
    """The loss object of a variant and its settings (validated once; equal settings share one frozen object)."""
    return loss_class(loss_type)(epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta)


# ------------------------------------------------------------------------------------------------ functional API
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
    variant = loss_class(loss_type)
    if variant is DrGRPOLoss and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length (the rollout's max_new_tokens), got None")
    return variant.aggregate(per_token, mask.to(per_token.dtype), max_completion_length, total_active_tokens)


def micro_batch_weight(loss_type: str, num_sequences: int, total_sequences: int, num_micro_batches: int,
                       world_size: int = 1) -> float:
    """``make_loss(loss_type).micro_batch_weight(...)``: the factor for one micro-batch's ``policy_loss``."""
    return make_loss(loss_type).micro_batch_weight(num_sequences, total_sequences, num_micro_batches, world_size)


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
    total_active_tokens: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The GRPO loss of ``N`` completions: ``make_loss(loss_type, epsilon_low, epsilon_high, beta)(...)``.

    The tensors and normalizers are those of :meth:`PolicyLoss.__call__` (``logps``, ``old_logps``, ``mask``,
    ``ref_logps``: ``[N, T]``; ``advantages``: ``[N]``); ``loss_type`` is ``grpo | bnpo | dr_grpo | dapo``.
    Returns a scalar tensor.
    """
    loss_fn = make_loss(loss_type, epsilon_low, epsilon_high, beta)
    return loss_fn(logps, old_logps, advantages, mask, ref_logps, max_completion_length, total_active_tokens)


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
