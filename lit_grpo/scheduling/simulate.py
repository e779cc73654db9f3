"""A model-free rollout simulator: drives any Scheduler with known lengths through the engine's own loop.

``simulate_rollout`` runs ``driver.drive_rollout``, the loop the engine runs, with an executor that counts tokens
instead of decoding: a sample ends when it reaches its given length. Decode steps, utilization and the lower bound
are those of RolloutStats, so scheduling figures can be checked and benchmarked without a model (the engine's
forced-length replay gives the same counts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lit_grpo.runtime.validation import check_int_in_range
from lit_grpo.scheduling.base import Assignment, RolloutWork, SampleKey, Scheduler, lower_bound_steps, whole_tail
from lit_grpo.scheduling.driver import Row, drive_rollout

#: ``token_feature(key, generated) -> [H]``: the hidden state of a sample's latest token.
TokenFeatureFn = Callable[[SampleKey, int], torch.Tensor]


@dataclass
class SimulationResult:
    """Counts of one simulated rollout (the same meanings as RolloutStats)."""

    decode_steps: int
    lower_bound_steps: int
    generated_tokens: int
    slot_utilization: float
    num_slots: int
    parked_samples: int
    peak_parked: int
    metrics: dict[str, float] = field(default_factory=dict)
    timeline: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def ratio(self) -> float:
        """``decode_steps / lower_bound_steps``: 1.0 is a perfect schedule."""
        return self.decode_steps / self.lower_bound_steps if self.lower_bound_steps else 1.0


class _CountingExecutor:
    """Runs samples of known lengths: each step adds one token to every running sample (the scheduler's
    ``generated`` record), and a sample ends at its length."""

    def __init__(self, scheduler: Scheduler, lengths: dict[SampleKey, int], token_feature: TokenFeatureFn):
        self.scheduler, self.lengths, self.token_feature = scheduler, lengths, token_feature

    def over(self) -> bool:
        return not self.scheduler.running and not self.scheduler.waiting()

    def start(self, assignments: list[Assignment]) -> None:
        pass

    def step(self, rows: list[Row], probing: list[int]) -> list[bool]:
        generated = self.scheduler.generated
        return [generated[key] + 1 == self.lengths[key] for _, key in rows]

    def feature(self, slot: int, key: SampleKey) -> torch.Tensor:
        return self.token_feature(key, self.scheduler.generated[key])

    def finish(self, slot: int, key: SampleKey) -> None:
        pass

    def park(self, slot: int, key: SampleKey) -> None:
        pass

    def settle(self) -> None:
        pass


def simulate_rollout(
    scheduler: Scheduler,
    lengths: Sequence[Sequence[int]],
    num_slots: int,
    max_new_tokens: int | None = None,
    prompt_features: torch.Tensor | None = None,
    token_feature: TokenFeatureFn | None = None,
    reveal_lengths: bool = True,
    keep_timeline: bool = False,
    park_cost: Callable[[int], float] = whole_tail,
) -> SimulationResult:
    """Run one rollout of known completion ``lengths[p][k]`` through ``scheduler``.

    Args:
        lengths: ``[B][G]`` completion lengths (>= 1, EOS included).
        num_slots: g.
        max_new_tokens: the cap (default: the longest length).
        prompt_features: ``[B, H]``, given to the scheduler when it asks for them.
        token_feature: features at probes (default: zeros of size H, or 1).
        reveal_lengths: fill ``work.true_lengths`` as the engine's forced-length replay does (oracle).
        keep_timeline: record ``timeline[t][s]`` = flat sample index ``p * G + k`` or -1.
        park_cost: a parked sample's tokens in tokens of every layer's KV (``RolloutWork.park_cost``).
    """
    num_slots = check_int_in_range("num_slots", num_slots, 1)
    num_prompts = len(lengths)
    group_size = len(lengths[0]) if num_prompts else 1  # no prompt: an empty rollout of any G
    ragged = [p for p, row in enumerate(lengths) if len(row) != group_size]
    if ragged:
        raise ValueError(f"lengths must have one row of G = {group_size} samples per prompt (the first row's); rows "
                         f"{ragged[:4]} have {[len(lengths[p]) for p in ragged[:4]]}")
    flat = [int(n) for row in lengths for n in row]
    if any(n < 1 for n in flat):
        raise ValueError("lengths must be >= 1 (EOS counts)")
    cap = max_new_tokens if max_new_tokens is not None else max(flat, default=1)
    if any(n > cap for n in flat):
        raise ValueError(f"a length exceeds max_new_tokens={cap}")
    if token_feature is None:
        hidden = prompt_features.shape[1] if prompt_features is not None else 1
        token_feature = lambda key, generated: torch.zeros(hidden)  # noqa: E731
    work = RolloutWork(
        prompt_lengths=[1] * num_prompts,
        group_size=group_size,
        num_slots=num_slots,
        max_new_tokens=cap,
        prompt_features=prompt_features if getattr(scheduler, "needs_prompt_features", False) else None,
        true_lengths=[list(map(int, row)) for row in lengths] if reveal_lengths else None,
        park_cost=park_cost,
    )
    target = {(p, k): int(lengths[p][k]) for p in range(num_prompts) for k in range(group_size)}
    driven = drive_rollout(scheduler, work, _CountingExecutor(scheduler, target, token_feature), keep_timeline)
    steps, total = driven.decode_steps, sum(flat)
    return SimulationResult(
        decode_steps=steps,
        lower_bound_steps=lower_bound_steps(flat, num_slots),
        generated_tokens=total,
        slot_utilization=total / (steps * num_slots) if steps else 0.0,
        num_slots=num_slots,
        parked_samples=scheduler.parked_samples,
        peak_parked=scheduler.peak_parked,
        metrics=driven.metrics,
        timeline=driven.timeline,
    )
