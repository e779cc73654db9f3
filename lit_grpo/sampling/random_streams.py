"""Per-sample random streams: a counter-based generator keyed by (seed, rollout, prompt, sample, token).

Why counter-based: the uniform that decides token t of sample (p, k) must not depend on which other samples
share the decode batch, in which slot the sample runs, or how many steps ran before. A stateful generator per
row would tie draws to the schedule; hashing the key makes every strategy and every micro-group size draw the
same numbers, which is what makes the rollout schedule-invariant. The hash is PCG's output permutation applied
in a chain (vectorized int64 torch ops, all intermediates below 2**63, so no overflow on CPU or CUDA).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _pcg_hash(x: torch.Tensor) -> torch.Tensor:
    """PCG-RXS-M-XS 32-bit permutation of ``x`` (int64 values in [0, 2**32))."""
    state = (x * 747796405 + 2891336453) & _MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _MASK32
    return ((word >> 22) ^ word) & _MASK32


def stream_uniforms(seed: int | torch.Tensor, rollout: int | torch.Tensor, prompt: torch.Tensor, sample: torch.Tensor,
                    token: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), one per row, determined only by the key.

    Args:
        seed: an int or a 0-d int64 tensor.
        rollout: the rollout the sample's group was drawn in: an int, or ``[n]`` int64 per row.
        prompt, sample, token: ``[n]`` int64 tensors (prompt index, sample index in its group, token position).
    Returns:
        ``[n]`` float64 tensor.
    """
    h = _pcg_hash(token & _MASK32)
    h = _pcg_hash(h ^ (sample & _MASK32))
    h = _pcg_hash(h ^ (prompt & _MASK32))
    h = _pcg_hash(h ^ (rollout & _MASK32))
    h = _pcg_hash(h ^ (seed & _MASK32))
    return (h.double() + 0.5) / 4294967296.0


def rank_seed(seed: int, rank: int) -> int:
    """The base seed of data-parallel rank ``rank``'s streams: ``seed`` on rank 0, a different 32-bit value on every
    other rank (``rank`` times an odd constant added, mod 2**32), so that ranks drawing the same rollout and
    position still draw different numbers."""
    return seed if rank == 0 else (seed + rank * 0x9E3779B9) & _MASK32
