"""What tests of precision need (not a test module): a claim that greedy tokens are equal across float32
implementations (``assert_greedy_margin``), and a count of the casts of given weights (``WeightCasts``)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode


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
        exact_model = copy.deepcopy(model).double()
        if getattr(exact_model.config, "_experts_implementation", None) not in (None, "eager"):
            exact_model.config._experts_implementation = "eager"  # grouped_mm takes no float64
        exact = exact_model(ids).logits[0, positions]
    assert logits.dtype == torch.float32, "the margin is measured for a float32 model"
    best = logits.topk(2, dim=-1)
    assert best.indices[:, 0].tolist() == list(completion), "not the model's greedy completion"
    gap = float((best.values[:, 0] - best.values[:, 1]).min())
    rounding = float((logits.double() - exact).abs().max())
    assert gap > factor * rounding, (f"a greedy step's two best logits are {gap:.3g} apart, within {factor} x the "
                                     f"float32 rounding of the logits ({rounding:.3g}): a near tie, which other "
                                     "kernels may break the other way")


class WeightCasts(TorchDispatchMode):
    """Counts the conversions (``aten.to``, ``aten._to_copy``: what autocast's casts dispatch) whose input lies in
    the storage of one of ``tensors`` (a parameter, or a copy made of it beforehand)."""

    def __init__(self, tensors):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().size()}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.to, torch.ops.aten._to_copy) and \
                args[0].untyped_storage().data_ptr() in self.storages:
            self.count += 1
        return func(*args, **(kwargs or {}))
