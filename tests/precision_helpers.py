"""What a test needs to claim greedy tokens equal across float32 implementations (not a test module)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch


def assert_greedy_margin(model: torch.nn.Module, prompt: Sequence[int], completion: Sequence[int],
                         factor: float = 10.0) -> None:
    """Assert that every token of the greedy ``completion`` leads the runner-up logit by more than ``factor`` times
    the float32 rounding of ``model``'s logits along it.

    Two float32 implementations of one forward (AVX2 or AVX-512 reductions, MKL or oneDNN, SDPA or the decode
    step's attention, one row or a batch) round differently, each by about as much as this one is from a float64
    copy of the model. Greedy tokens computed by two of them are then the same wherever the best logit leads by
    more than that, on any CPU: this makes a test's token equality a claim with a stated precision.
    """
    ids = torch.tensor([list(prompt) + list(completion)], device=next(model.parameters()).device)
    positions = slice(len(prompt) - 1, len(prompt) - 1 + len(completion))
    with torch.no_grad():
        logits = model(ids).logits[0, positions]
        exact = copy.deepcopy(model).double()(ids).logits[0, positions]
    assert logits.dtype == torch.float32, "the margin is measured for a float32 model"
    best = logits.topk(2, dim=-1)
    assert best.indices[:, 0].tolist() == list(completion), "not the model's greedy completion"
    gap = float((best.values[:, 0] - best.values[:, 1]).min())
    rounding = float((logits.double() - exact).abs().max())
    assert gap > factor * rounding, (f"a greedy step's two best logits are {gap:.3g} apart, within {factor} x the "
                                     f"float32 rounding of the logits ({rounding:.3g}): a near tie, which other "
                                     "kernels may break the other way")
