"""``train/*`` scalars of one optimizer step, accumulated over its micro-batches (used by ``GRPOModule``)."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

#: each mean key, and what it is a mean over (``PolicyLoss.metrics``' weight for it)
MEAN_OVER = {"clip_ratio_low": "clip_units", "clip_ratio_high": "clip_units", "kl": "loss_tokens",
             "phi_seq_mean": "completions"}


class StepMetrics:
    """Accumulates one optimizer step on the device and reads it to the host once (``read``): ``loss`` (the sum
    of the weighted micro-batch losses, i.e. the step's loss), ``clip_ratio_low`` and ``clip_ratio_high`` (shares
    of the clip's units: loss tokens, or completions under GSPO), ``kl`` (mean over loss tokens), ``entropy``
    (mean over all completion tokens) and, under vespo, ``phi_seq_mean`` (its weight's mean over completions).
    A mean whose loss does not report it (``kl`` without a reference) is left out."""

    def __init__(self) -> None:
        self._parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._read: dict[str, list[float]] | None = None

    def add(self, loss: torch.Tensor, loss_metrics: dict[str, torch.Tensor], entropy: torch.Tensor,
            completion_mask: torch.Tensor) -> None:
        """One micro-batch: its weighted loss (a scalar tensor), ``PolicyLoss.metrics``, ``[m, T]`` entropies and
        completion mask. Nothing is read from the device."""
        weights = {"loss_tokens": loss_metrics["active_tokens"], "clip_units": loss_metrics["clip_units"]}
        if "completions" in loss_metrics:
            weights["completions"] = loss_metrics["completions"]
        self._parts["loss"].append(loss.detach())
        for key, over in MEAN_OVER.items():
            if key in loss_metrics:
                self._parts[key].append(loss_metrics[key] * weights[over])
        for over, weight in weights.items():
            self._parts[over].append(weight)
        content = completion_mask.float()
        self._parts["entropy"].append((entropy * content).sum())
        self._parts["content_tokens"].append(content.sum())

    def add_entropy_stats(self, stats: torch.Tensor) -> None:
        """One micro-batch's ``[2]`` entropy sum and token count over the entropy bonus's tokens
        (``lit_grpo.update.entropy_bonus.entropy_stats``), for the adaptive control: ``entropy_totals``."""
        self._parts["bonus_entropy"].append(stats[0])
        self._parts["bonus_tokens"].append(stats[1])

    def entropy_totals(self) -> list[float]:
        """``[entropy sum, tokens]`` of ``add_entropy_stats`` over the step's micro-batches (after ``read``)."""
        if self._read is None:
            raise RuntimeError("StepMetrics.entropy_totals() before read(): nothing has been brought to the host")
        return [math.fsum(self._read.get("bonus_entropy", [])), math.fsum(self._read.get("bonus_tokens", []))]

    def read(self) -> list[float]:
        """Brings every value added to the host in one copy; returns each micro-batch's weighted loss."""
        keys = list(self._parts)
        flat = torch.stack([part.detach().double() for key in keys for part in self._parts[key]]).tolist()
        self._read, start = {}, 0
        for key in keys:
            self._read[key] = flat[start:start + len(self._parts[key])]
            start += len(self._parts[key])
        return self._read["loss"]

    def result(self, grad_norm: float) -> dict[str, float]:
        """The step's scalars (keys without the ``train/`` prefix), and ``weight/loss_tokens`` and
        ``weight/clip_units``, the weights of its means under several processes
        (``lit_grpo.rollout.metrics.RATIO_WEIGHTS``)."""
        if self._read is None:
            raise RuntimeError("StepMetrics.result() before read(): nothing has been brought to the host")
        sums = {key: math.fsum(values) for key, values in self._read.items()}
        out = {"loss": sums.get("loss", 0.0), "grad_norm": grad_norm,
               "entropy": sums.get("entropy", 0.0) / max(sums.get("content_tokens", 0.0), 1.0)}
        for key, over in MEAN_OVER.items():
            if key in sums:
                out[key] = sums[key] / max(sums.get(over, 0.0), 1.0)
        for over in set(MEAN_OVER.values()) & set(sums):
            out[f"weight/{over}"] = sums[over]
        return out
