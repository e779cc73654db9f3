"""A model-free rollout simulator: drives any Scheduler with known lengths through the engine's own loop.

``simulate_rollout`` runs ``driver.drive_rollout``, the loop the engine runs, with an executor that counts tokens
instead of decoding: a sample ends when it reaches its given length. Decode steps, utilization and the lower bound
are those of RolloutStats, so scheduling figures can be checked and benchmarked without a model (the engine's
forced-length replay gives the same counts).

Synthetic features for length predictors: :func:`planted_rollout` builds prompt and token features that carry a
known share of the log-length signal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lit_grpo.scheduling.base import Assignment, RolloutWork, SampleKey, Scheduler, lower_bound_steps
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
    prompt_ids: list[list[int]] | None = None,
    reveal_lengths: bool = True,
    keep_timeline: bool = False,
) -> SimulationResult:
    """Run one rollout of known completion ``lengths[p][k]`` through ``scheduler``.

    Args:
        lengths: ``[B][G]`` completion lengths (>= 1, EOS included).
        num_slots: g.
        max_new_tokens: the cap (default: the longest length).
        prompt_features: ``[B, H]``, given to the scheduler when it asks for them.
        token_feature: features at probes (default: zeros of size H, or 1).
        prompt_ids: per-prompt token ids (default: ``[[p]]``, distinct per prompt index).
        reveal_lengths: fill ``work.true_lengths`` as the engine's forced-length replay does (oracle).
        keep_timeline: record ``timeline[t][s]`` = flat sample index ``p * G + k`` or -1.
    """
    num_prompts = len(lengths)
    group_size = len(lengths[0]) if num_prompts else 0
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
        prompt_ids=prompt_ids if prompt_ids is not None else [[p] for p in range(num_prompts)],
        true_lengths=[list(map(int, row)) for row in lengths] if reveal_lengths else None,
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


@dataclass
class SyntheticRollout:
    """Lengths with a planted signal: ``log L = mu_p + spread * z_pk`` (clipped to [1, cap]).

    ``prompt_features[p]`` encode ``mu_p`` and ``token_features[p, k]`` encode ``z_pk`` along fixed random
    directions, plus Gaussian noise of std ``noise`` per dimension.
    """

    lengths: list[list[int]]
    prompt_features: torch.Tensor  # [B, H]
    token_features: torch.Tensor  # [B, G, H]

    def token_feature(self, key: SampleKey, generated: int) -> torch.Tensor:
        return self.token_features[key[0], key[1]]


def planted_rollout(
    num_prompts: int,
    group_size: int,
    hidden: int = 32,
    max_new_tokens: int = 1024,
    mean_log_length: float = 5.0,
    prompt_spread: float = 0.5,
    sample_spread: float = 0.6,
    noise: float = 0.3,
    signal: float = 3.0,
    generator: torch.Generator | None = None,
    directions: torch.Tensor | None = None,
    prompt_offsets: torch.Tensor | None = None,
) -> SyntheticRollout:
    """A synthetic rollout for predictor and scheduler tests (see :class:`SyntheticRollout`).

    ``directions`` (``[2, H]``, unit rows) fixes where the signal lives, so a series of rollouts shares it, as a
    policy's hidden-state geometry does across steps; default: drawn from ``generator``. ``prompt_offsets``
    (``[B]``, the ``mu_p``) makes prompts recur with the same length profile; default: fresh prompts.
    """
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    if directions is None:
        directions = torch.nn.functional.normalize(torch.randn(2, hidden, generator=g), dim=1)
    mu = prompt_offsets if prompt_offsets is not None else prompt_spread * torch.randn(num_prompts, generator=g)
    z = torch.randn(num_prompts, group_size, generator=g)
    log_lengths = mean_log_length + mu[:, None] + sample_spread * z
    lengths = log_lengths.exp().round().clamp(1, max_new_tokens).long().tolist()
    prompt_features = noise * torch.randn(num_prompts, hidden, generator=g) + signal * mu[:, None] * directions[0]
    token_features = noise * torch.randn(num_prompts, group_size, hidden, generator=g)
    token_features = token_features + signal * z[..., None] * directions[1] + prompt_features[:, None, :]
    return SyntheticRollout(lengths, prompt_features, token_features)
