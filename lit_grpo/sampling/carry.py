"""A group's progress, which outlives one ``generate`` call when a rollout stops before every group is done.

With partial rollouts (``RolloutEngine.generate_groups(..., complete=n)``) a rollout ends as soon as ``n`` groups
are complete; every other group comes back as a ``GroupProgress``: its finished samples, and its unfinished ones
(running, parked or not started) with their tokens so far. The next call continues them: a sample's row is
prefilled again (prompt and tokens so far) under the weights of that call, and it draws its next tokens from its
own random stream (``stream``), so what a sample draws depends on the sample, never on the call it runs in.
Each token records the rollout it was drawn in (``versions``); the rollout builder counts from them the tokens
drawn under older weights (the ``rollout/offpolicy_tokens_frac`` metric).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SampleProgress:
    """One sample's tokens so far.

    Attributes:
        tokens: completion token ids, EOS included once it is drawn.
        logprobs: the sampler's log-probability of each token.
        versions: the engine's rollout index each token was drawn in.
        done: the sample ended (EOS or the length cap).
        resumed_at: the caller resumed the sample after it ended, having appended tokens of its own up to here (a
            tool's result after a turn that called it): the stop tokens and stop strings before it end nothing.
    """

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False
    resumed_at: int = 0


@dataclass
class GroupProgress:
    """A prompt's G samples, in whatever state a rollout left them.

    Attributes:
        prompt_ids: the prompt's token ids.
        samples: ``[G]`` progress, one per sample.
        stream: ``(rollout index, prompt index)`` the group was first drawn with; its samples' random streams are
            keyed by it, so a carried sample continues the stream it started.
        forced_lengths: ``[G]`` replayed completion lengths, or None.
        tag: the caller's own data (the prompt's answer, its staleness); the engine only carries it along.
        forced_tokens: ``[G]`` replayed completions (token replay), each ``forced_lengths[k]`` tokens long, or
            None. A carried sample emits them on from ``len(tokens)``.
    """

    prompt_ids: list[int]
    samples: list[SampleProgress]
    stream: tuple[int, int]
    forced_lengths: list[int] | None = None
    tag: Any = None
    forced_tokens: list[list[int]] | None = None

    @property
    def complete(self) -> bool:
        return all(sample.done for sample in self.samples)

    @property
    def started(self) -> int:
        """Samples with at least one token."""
        return sum(bool(sample.tokens) for sample in self.samples)


def plan_partial_rollout(staleness: Sequence[int], num_groups: int, over_provision: float,
                         max_staleness: int) -> tuple[int, list[int]]:
    """The next partial rollout, given the carried groups' ``staleness`` (steps each has been carried):

    returns how many fresh groups to add (up to ``ceil(over_provision x num_groups)`` groups in all) and the indices
    of carried groups that must complete in it (carried ``max_staleness`` steps or more; the stalest
    ``num_groups`` at most, since only that many groups are returned).
    """
    fresh = max(math.ceil(over_provision * num_groups) - len(staleness), 0)
    stalest = sorted(range(len(staleness)), key=lambda i: -staleness[i])[:num_groups]
    return fresh, sorted(i for i in stalest if staleness[i] >= max_staleness)
