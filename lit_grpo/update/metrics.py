"""``train/*`` scalars of one optimizer step, accumulated over its micro-batches (used by ``GRPOModule``)."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

CLIP_KEYS = ("clip_ratio_low", "clip_ratio_high", "kl")


class StepMetrics:
    """Accumulates one optimizer step on the device and reads it to the host once (``read``): ``loss`` (the sum
    of the weighted micro-batch losses, i.e. the step's loss), ``clip_ratio_low``, ``clip_ratio_high`` and ``kl``
    (means over loss tokens) and ``entropy`` (mean over all completion tokens)."""

    def __init__(self) -> None:
        self._parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._read: dict[str, list[float]] | None = None

    def add(self, loss: torch.Tensor, loss_metrics: dict[str, torch.Tensor], entropy: torch.Tensor,
            completion_mask: torch.Tensor) -> None:
        """One micro-batch: its weighted loss (a scalar tensor), ``PolicyLoss.metrics``, ``[m, T]`` entropies and
        completion mask. Nothing is read from the device."""
        active = loss_metrics["active_tokens"]
        self._parts["loss"].append(loss.detach())
        for key in CLIP_KEYS:
            if key in loss_metrics:
                self._parts[key].append(loss_metrics[key] * active)
        self._parts["loss_tokens"].append(active)
        content = completion_mask.float()
        self._parts["entropy"].append((entropy * content).sum())
        self._parts["content_tokens"].append(content.sum())

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
        """The step's scalars (keys without the ``train/`` prefix), and ``weight/loss_tokens``, the weight of the
        means over loss tokens under several processes (``lit_grpo.rollout.metrics.RATIO_WEIGHTS``)."""
        if self._read is None:
            raise RuntimeError("StepMetrics.result() before read(): nothing has been brought to the host")
        sums = {key: math.fsum(values) for key, values in self._read.items()}
        loss_tokens = sums.get("loss_tokens", 0.0)
        out = {"loss": sums.get("loss", 0.0), "grad_norm": grad_norm,
               "entropy": sums.get("entropy", 0.0) / max(sums.get("content_tokens", 0.0), 1.0)}
        for key in CLIP_KEYS:
            out[key] = sums.get(key, 0.0) / max(loss_tokens, 1.0)
        out["weight/loss_tokens"] = loss_tokens
        return out
