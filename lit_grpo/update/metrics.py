"""``train/*`` scalars of one optimizer step, accumulated over its micro-batches (used by ``GRPOModule``)."""

from __future__ import annotations

import torch

CLIP_KEYS = ("clip_ratio_low", "clip_ratio_high", "kl")


class StepMetrics:
    """Accumulates one optimizer step: ``loss`` (the sum of the weighted micro-batch losses, i.e. the step's
    loss), ``clip_ratio_low``, ``clip_ratio_high`` and ``kl`` (means over loss tokens) and ``entropy`` (mean over
    all completion tokens)."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.sums = dict.fromkeys((*CLIP_KEYS, "entropy"), 0.0)
        self.loss_tokens = 0.0
        self.content_tokens = 0.0

    def add(self, loss: float, loss_metrics: dict[str, torch.Tensor], entropy: torch.Tensor,
            completion_mask: torch.Tensor) -> None:
        """One micro-batch: its weighted loss, ``PolicyLoss.metrics``, ``[m, T]`` entropies and completion mask."""
        self.loss += loss
        active = float(loss_metrics["active_tokens"])
        for key in CLIP_KEYS:
            if key in loss_metrics:
                self.sums[key] += float(loss_metrics[key]) * active
        self.loss_tokens += active
        content = completion_mask.float()
        self.sums["entropy"] += float((entropy * content).sum())
        self.content_tokens += float(content.sum())

    def result(self, grad_norm: float) -> dict[str, float]:
        """The step's scalars (keys without the ``train/`` prefix), and ``weight/loss_tokens``, the weight of the
        means over loss tokens under several processes (``lit_grpo.rollout.metrics.RATIO_WEIGHTS``)."""
        out = {"loss": self.loss, "grad_norm": grad_norm,
               "entropy": self.sums["entropy"] / max(self.content_tokens, 1.0)}
        for key in CLIP_KEYS:
            out[key] = self.sums[key] / max(self.loss_tokens, 1.0)
        out["weight/loss_tokens"] = self.loss_tokens
        return out
