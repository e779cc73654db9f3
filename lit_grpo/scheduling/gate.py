"""Whether following the predictions is expected to beat first-come order: a Monte Carlo gate.

Trust (``trust.py``) says whether predictions carry information; it does not say whether the information is worth
acting on. A freed slot's choice changes the makespan only through the samples that end last, and with weak
predictions the order they give is, for the tail, little better than arrival order, while it is a different
draw of the same lottery: it can lose as often as it wins. So before the scheduler follows predictions it
estimates, under its own calibrated lognormal model (each waiting sample's length ~ LogNormal(calibrated median,
calibrated spread), a running sample's remaining length conditioned on the tokens it survived), the makespan of
list scheduling in prediction order (longest expected first, what the plan refines) and in arrival order, on the
same draws (common random numbers). It follows the predictions only where the per-draw gain is established:
its mean exceeds ``GAIN_Z`` standard deviations of the per-draw gain, i.e. the guided order beats arrival order
on almost every rollout the model deems possible, not just on average. Exact predictions pass at once (no
spread: every draw agrees); predictions with no established correlation give equal medians and no gain.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: Draws of the lengths per decision (common to both orders).
DRAWS = 64
#: The guided order is followed when mean gain > GAIN_Z x std of the per-draw gain (about 84% of draws win at 1).
GAIN_Z = 1.0
#: The draws are seeded, so a decision is a pure function of its inputs.
SEED = 0


def draw_lengths(
    medians: Sequence[float], spreads: Sequence[float], survived: Sequence[int], cap: int, draws: int = DRAWS,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[draws, N]`` total lengths ``min(L, cap)``, ``L ~ LogNormal(log median, spread)`` given ``L > survived``.

    Inverse-CDF sampling of the normal truncated below at ``log survived`` (every draw survives what it already
    generated, so a running sample's draws are its possible totals).
    """
    mu = torch.tensor([math.log(max(m, 1e-9)) for m in medians], dtype=torch.float64)
    s = torch.tensor([max(x, 1e-6) for x in spreads], dtype=torch.float64)
    a = torch.tensor([math.log(max(k, 1e-9)) if k > 0 else -math.inf for k in survived], dtype=torch.float64)
    low = torch.special.ndtr((a - mu) / s)  # P(L <= survived)
    u = torch.rand(draws, len(medians), generator=generator, dtype=torch.float64)
    p = (low + u * (1 - low)).clamp(1e-12, 1 - 1e-12)
    lengths = torch.exp(mu + s * torch.special.ndtri(p))
    floor = torch.tensor([k + 1 for k in survived], dtype=torch.float64)
    return torch.minimum(torch.maximum(lengths, floor), torch.tensor(float(cap), dtype=torch.float64))


def list_makespan(lengths: torch.Tensor, ready: torch.Tensor) -> torch.Tensor:
    """``[draws]`` makespan of list scheduling: jobs ``lengths[:, j]`` in column order, each to the slot that frees
    first; ``ready``: ``[draws, S]`` when each slot frees."""
    ready = ready.clone()
    rows = torch.arange(lengths.shape[0])
    for j in range(lengths.shape[1]):
        slot = ready.argmin(dim=1)
        ready[rows, slot] += lengths[:, j]
    return ready.max(dim=1).values


def guided_gain(
    waiting: Sequence[tuple[float, float, int]], running: Sequence[tuple[float, float, int]], num_slots: int,
    cap: int, expected: Sequence[float], draws: int = DRAWS,
) -> tuple[float, float]:
    """(mean, std) over draws of ``makespan(arrival order) - makespan(longest expected first)``, in steps.

    Args:
        waiting: ``[N]`` ``(median, spread, generated)`` of the waiting samples, in arrival order.
        running: ``[R]`` the same for the running samples (R <= num_slots); their slots free when they end.
        expected: ``[N]`` the waiting samples' expected remaining lengths, the guided order's key.
    """
    if len(waiting) < 2:
        return 0.0, 0.0
    generator = torch.Generator().manual_seed(SEED)
    everyone = list(waiting) + list(running)
    totals = draw_lengths(*zip(*everyone), cap=cap, draws=draws, generator=generator)
    done = torch.tensor([float(k) for _, _, k in everyone], dtype=torch.float64)
    remaining = totals - done
    ready = torch.zeros(draws, num_slots, dtype=torch.float64)
    if running:
        ready[:, : len(running)] = remaining[:, len(waiting):]
    jobs = remaining[:, : len(waiting)]
    order = sorted(range(len(waiting)), key=lambda i: (-expected[i], i))
    gain = list_makespan(jobs, ready) - list_makespan(jobs[:, order], ready)
    return float(gain.mean()), float(gain.std()) if draws > 1 else 0.0


def preposterior_gain(
    num_samples: int, num_slots: int, cap: int, mean_log: float, sd_log: float, rho: float, draws: int = DRAWS,
) -> tuple[float, float]:
    """(mean, std) of the same gain before the predictions exist (to decide whether to wait for them at probes).

    Under the calibrated model with correlation ``rho``, a sample's log length is ``mean_log + sd_log * (rho z1 +
    sqrt(1 - rho^2) z2)`` and its calibrated prediction ranks it by ``z1``; both are drawn (``[draws, N]``).
    """
    if num_samples <= num_slots:
        return 0.0, 0.0
    generator = torch.Generator().manual_seed(SEED)
    z1, z2 = torch.randn(2, draws, num_samples, generator=generator, dtype=torch.float64)
    log_length = mean_log + sd_log * (rho * z1 + math.sqrt(max(0.0, 1 - rho * rho)) * z2)
    jobs = log_length.exp().clamp(1.0, float(cap))
    guided = torch.gather(jobs, 1, torch.argsort(z1, dim=1, descending=True))
    ready = torch.zeros(draws, num_slots, dtype=torch.float64)
    gain = list_makespan(jobs, ready) - list_makespan(guided, ready)
    return float(gain.mean()), float(gain.std())


def probes_pay(trust, num_samples: int, num_slots: int, cap: int, z: float = GAIN_Z) -> bool:
    """Would an order by probe predictions of the trust they earned (a ``PredictionTrust``) establish a gain over
    arrival order? If not, parking samples at their probes to wait for those predictions cannot pay."""
    mean_log, sd_log = trust.population()
    return follow_predictions(*preposterior_gain(num_samples, num_slots, cap, mean_log, sd_log, trust.rho_low), z=z)


def follow_predictions(mean_gain: float, std_gain: float, current: bool = False, z: float = GAIN_Z) -> bool:
    """Follow the predictions from here on? The course changes only where the other one is established better
    (its gain beyond ``z`` standard deviations of the per-draw gain); a tie keeps the ``current`` course."""
    if current:
        return not mean_gain < -z * std_gain
    return mean_gain > z * std_gain
