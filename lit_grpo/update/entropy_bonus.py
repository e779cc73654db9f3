"""The entropy bonus (TRL's ``entropy_coef``) and its adaptive control (Skywork-OR1, TRL's ``use_adaptive_entropy``).

Shapes: ``N`` completions (rows of a micro-batch), ``T`` completion tokens (padded; ``mask`` marks the loss tokens).

Per micro-batch the loss becomes ``loss x micro_batch_weight - coef x H x bonus_weight``::

    H            = sum(entropy x e) / max(sum(e), 1)     e = mask x the high-entropy mask (top_entropy_quantile < 1)
    bonus_weight = world size / micro-batches of every rank

``H`` is the mean token entropy over the tokens the policy term acts on, whatever the loss type's normalizer, so
``coef`` means the same for every loss type. ``bonus_weight`` is TRL's ``1 / gradient_accumulation_steps``: ddp
(and FSDP) average the ranks' gradients, so every micro-batch of every rank weighs ``1 / micro-batches of every
rank`` in the step's gradient, as each of TRL's ``gradient_accumulation_steps x processes`` micro-batches does. The
entropy is the one at the sampling temperature (the log-probs' logits divided by it), as TRL's.

``EntropyControl`` holds the coefficient: constant, or under ``use_adaptive_entropy`` moved after each optimizer
step by ``next_coefficient`` from that step's entropy over every micro-batch and rank (token-weighted: the sums
and counts of ``entropy_stats``, added up before one division), and applied in a step only where the previous
step's entropy was at or below ``entropy_target``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from lit_grpo.runtime.validation import check_real, check_state_keys, shown_setting
from lit_grpo.update.loss_config import LossConfig
from lit_grpo.update.surrogates import check_entropy_mask, high_entropy_mask


def bonus_tokens(entropy: torch.Tensor, mask: torch.Tensor, top_entropy_quantile: float = 1.0,
                 all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 entropy_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, T]`` the tokens the bonus averages over, in ``entropy``'s dtype: ``mask`` ``[N, T]`` (the loss tokens),
    times the high-entropy mask where ``top_entropy_quantile`` < 1 (the tokens the policy term keeps; its quantile
    over every rank's micro-batch with ``all_gather``, as the loss's). ``entropy_mask``: that mask ``[N, T]`` as
    the loss took it (``PolicyLoss``'s ``entropy_mask``), so the ranks gather once; None: taken here. Refused where
    ``top_entropy_quantile`` is 1 (no mask applies: it would be dropped unread)."""
    check_entropy_mask(entropy_mask, top_entropy_quantile)
    tokens = mask.to(entropy.dtype)
    if top_entropy_quantile < 1:
        if entropy_mask is None:
            entropy_mask = high_entropy_mask(entropy, mask, top_entropy_quantile, all_gather)
        tokens = tokens * entropy_mask.to(entropy.dtype)
    return tokens


def entropy_bonus(entropy: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The scalar ``H``: the mean of ``entropy`` ``[N, T]`` (with the gradient it carries) over ``tokens`` ``[N, T]``
    (``bonus_tokens``); 0 where there is none."""
    return (entropy * tokens).sum() / tokens.sum().clamp(min=1.0)


def entropy_stats(entropy: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[2]`` float64, no grad: the sum of ``entropy`` over ``tokens`` and their count (``[N, T]`` both), which
    add up over micro-batches and ranks to the step's token-weighted entropy."""
    return torch.stack([(entropy.detach() * tokens).sum(), tokens.sum()]).double()


def bonus_weight(num_micro_batches: int, world_size: int = 1) -> float:
    """Each micro-batch's factor for ``H``: ``world_size / num_micro_batches`` (every rank's micro-batches of the
    optimizer step, summed over ranks: the gradient's average over ranks makes it ``1 / num_micro_batches``)."""
    if num_micro_batches < 1 or world_size < 1:
        raise ValueError(f"bad micro-batch counts: num_micro_batches={num_micro_batches}, world_size={world_size} "
                         "(need both >= 1)")
    return world_size / num_micro_batches


def next_coefficient(coef: float, world_entropy: float, target: float, delta: float, low: float,
                     high: float) -> float:
    """Skywork-OR1's step: ``coef + delta`` (at most ``high``) where ``world_entropy`` is at or below ``target``,
    else ``coef - delta`` (at least ``low``)."""
    if world_entropy <= target:
        return min(coef + delta, high)
    return max(coef - delta, low)


class EntropyControl:
    """The entropy bonus's coefficient across optimizer steps (``LossConfig``'s ``entropy_coef`` and the adaptive
    settings).

    ``applied()`` is the coefficient a step's micro-batches use, read as the step starts: ``coef``, or under the
    adaptive control ``coef`` where ``last_world_entropy`` (the previous step's) is at or below ``entropy_target``,
    else 0; infinite before the first step, so the first step applies none. ``end_step(entropy_sum, tokens)``, with
    the step's sums over every micro-batch and rank, moves ``coef`` (``next_coefficient``) and records the entropy.
    ``state_dict`` / ``load_state_dict``: the two numbers a resume needs (plain floats, exact).
    """

    def __init__(self, config: LossConfig) -> None:
        self.config = config
        self.coef = float(config.entropy_coef)
        self.last_world_entropy = math.inf

    @property
    def enabled(self) -> bool:
        return self.config.entropy_bonus_on

    @property
    def adaptive(self) -> bool:
        return self.config.use_adaptive_entropy

    def applied(self) -> float:
        """The coefficient this optimizer step applies (the class docstring)."""
        if self.adaptive and not self.last_world_entropy <= self.config.entropy_target:
            return 0.0
        return self.coef

    def end_step(self, entropy_sum: float, tokens: float) -> None:
        """After an optimizer step, under the adaptive control: its entropy, ``entropy_sum / max(tokens, 1)``
        (sums over every micro-batch and rank), moves the coefficient for the next step. Else nothing."""
        if not self.adaptive:
            return
        world_entropy = entropy_sum / max(tokens, 1.0)
        c = self.config
        self.coef = next_coefficient(self.coef, world_entropy, c.entropy_target, c.entropy_coef_delta,
                                     c.entropy_coef_min, c.entropy_coef_max)
        self.last_world_entropy = world_entropy

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_world_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take ``state`` (``state_dict``'s, from a checkpoint), checked whole first: a corrupt or foreign one is
        refused naming the bad key or value, and leaves the control as it was. The coefficient need not lie within
        this run's bounds: a resume may narrow them, and the next step's move brings it inside."""
        check_state_keys("an EntropyControl state", state, ("entropy_coef", "last_world_entropy"))
        coef = check_real("entropy control state entropy_coef", state["entropy_coef"])
        entropy = state["last_world_entropy"]
        try:
            number = float(entropy) if isinstance(entropy, numbers.Real) and not isinstance(entropy, bool) else None
        except OverflowError:  # an int beyond float range
            number = None
        # inf before the first step; nan where a step's entropy was not a number (end_step records it, and it
        # closes the gate as inf does); -inf no step gives, and it would open the gate
        if number is None or number == -math.inf:
            raise ValueError(f"{shown_setting('entropy control state last_world_entropy', entropy)} is not "
                             "allowed; it must be a number: finite, inf (no step measured yet) or nan (a step's "
                             "entropy that was not a number)")
        self.coef, self.last_world_entropy = coef, number
