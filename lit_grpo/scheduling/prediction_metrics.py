"""How good are length predictions? Rank agreement (Kendall's tau), relative error (sMAPE) and log error."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def kendall_tau(predicted: Sequence[float] | torch.Tensor, true: Sequence[float] | torch.Tensor) -> float:
    """Kendall's tau-b between two equal-length sequences; 0.0 when either is constant (no ranking).

    ``O(n^2)`` pairs, in row chunks so that 4096 samples stay within a few MB.
    """
    x = torch.as_tensor(predicted, dtype=torch.float64).flatten()
    y = torch.as_tensor(true, dtype=torch.float64).flatten()
    n = x.numel()
    if n < 2:
        return 0.0
    concordance = 0.0
    ties_x = ties_y = 0.0
    for start in range(0, n, 512):
        dx = torch.sign(x[start:start + 512, None] - x[None, :])
        dy = torch.sign(y[start:start + 512, None] - y[None, :])
        concordance += float((dx * dy).sum())
        ties_x += float((dx == 0).sum())
        ties_y += float((dy == 0).sum())
    pairs = n * (n - 1) / 2
    # Each unordered pair was seen twice, and every sample tied with itself once.
    tied_x = (ties_x - n) / 2
    tied_y = (ties_y - n) / 2
    denominator = math.sqrt((pairs - tied_x) * (pairs - tied_y))
    return concordance / 2 / denominator if denominator > 0 else 0.0


def smape(predicted: Sequence[float] | torch.Tensor, true: Sequence[float] | torch.Tensor) -> float:
    """Symmetric mean absolute percentage error ``mean(|p - t| / ((|p| + |t|) / 2))`` in [0, 2]; 0/0 counts 0."""
    p = torch.as_tensor(predicted, dtype=torch.float64).flatten()
    t = torch.as_tensor(true, dtype=torch.float64).flatten()
    if p.numel() == 0:
        return 0.0
    denominator = (p.abs() + t.abs()) / 2
    ratio = torch.where(denominator > 0, (p - t).abs() / denominator.clamp_min(1e-300), torch.zeros_like(p))
    return float(ratio.mean())


def log_rmse(predicted: Sequence[float] | torch.Tensor, true: Sequence[float] | torch.Tensor) -> float:
    """Root-mean-square of ``log(predicted / true)`` (both clamped to >= 1 token); NaN for no pairs."""
    p = torch.as_tensor(predicted, dtype=torch.float64).flatten().clamp_min(1.0)
    t = torch.as_tensor(true, dtype=torch.float64).flatten().clamp_min(1.0)
    return float((p.log() - t.log()).pow(2).mean().sqrt()) if p.numel() else math.nan
