"""What one rollout cost: decode steps, tokens, KV bytes, time, and the slot timeline behind them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

#: Value of a timeline cell whose slot held no sample at that step.
IDLE = -1


@dataclass
class RolloutStats:
    """Counters of one ``RolloutEngine.generate`` call (ints are counts, bytes are bytes).

    Attributes:
        decode_steps: forward passes of the decode loop (each produces one token per running slot).
        prefill_tokens: prompt tokens run through prefill forwards (each prompt once).
        generated_tokens: completion tokens produced, EOS included.
        lower_bound_steps: ``max(ceil(sum L / slots), max L)``, the fewest decode steps any schedule needs.
        slot_utilization: ``generated_tokens / (decode_steps * slots)``.
        peak_kv_bytes: the most bytes held at once by KV tensors (slot cache with padding + cached prompts).
        wall_s: seconds spent in ``generate``.
        tokens_per_s: ``generated_tokens / wall_s``.
        forward_s: seconds spent in prefill forwards and decode steps (forward, sampling and the step's one
            device-to-host copy); the rest of ``wall_s`` is the engine's and the scheduler's bookkeeping.
        capture_s: seconds spent capturing the decode step's CUDA graph in this rollout (0 when the engine reused
            the previous rollout's, or runs eagerly).
        num_slots: concurrent sequences the rollout ran with.
        length_pred_kendall_tau / length_pred_smape: quality of the length predictions ("infinite" only).
        timeline: ``timeline[t][s]`` is the flat sample index ``p * G + k`` that slot ``s`` ran at decode step
            ``t``, or ``IDLE``. Kept for pictures (see lit_grpo.callbacks.SlotTimelineLogger).
        group_size: G, to map flat sample indices back to prompts.
    """

    decode_steps: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    lower_bound_steps: int = 0
    slot_utilization: float = 0.0
    peak_kv_bytes: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    forward_s: float = 0.0
    capture_s: float = 0.0
    num_slots: int = 0
    group_size: int = 0
    length_pred_kendall_tau: float | None = None
    length_pred_smape: float | None = None
    timeline: list[list[int]] = field(default_factory=list, repr=False)

    def finalize(self, lengths: list[int]) -> None:
        """Fill the derived fields from the completion lengths once the rollout is over."""
        self.generated_tokens = sum(lengths)
        self.lower_bound_steps = lower_bound_steps(lengths, self.num_slots)
        denominator = self.decode_steps * self.num_slots
        self.slot_utilization = self.generated_tokens / denominator if denominator else 0.0
        self.tokens_per_s = self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def scalars(self) -> dict[str, float]:
        """The numeric fields (no timeline), None dropped: what loggers and benchmarks record."""
        out = asdict(self)
        out.pop("timeline")
        return {k: v for k, v in out.items() if v is not None}


def lower_bound_steps(lengths: list[int], num_slots: int) -> int:
    """``max(ceil(sum L / g), max L)``: no schedule on ``num_slots`` slots finishes in fewer decode steps."""
    if not lengths:
        return 0
    return max(math.ceil(sum(lengths) / num_slots), max(lengths))
