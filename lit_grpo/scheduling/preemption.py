"""Preemption by attained service: every sample starts early, so the longest ones end side by side.

Before a token is sampled the G samples of a prompt are exchangeable, and on real rollouts no token-conditioned
signal measured orders them well enough to plan on (docs/benchmarks.md, "Length prediction on real rollouts").
What the lengths do carry is their tail: a sample that has run long is expected to run longer. First-come order
pays for that tail at the end of a rollout, where the last samples to start are as likely to be long as any, and
one of them runs on alone while the other slots idle. Least attained service first fixes the tail without
predicting anything: a running sample is preempted (parked, its KV kept aside) when it reaches a preemption
point (:func:`preemption_points`) while a waiting sample has generated fewer tokens, and a freed slot runs the
waiting sample that has generated least. Every sample then starts within the rollout's first quanta, the short ones
end early, and the rollout ends with the longest samples running together, each since early on.

Where lengths are light-tailed (a sample that has run long is about to end), preemption can lose to first-come
order. So a gate, as for predictions (``gate.py``): :meth:`AttainedService.gains` draws rollouts from the groups
finished so far (whole groups with replacement, each group's samples shuffled, since they are exchangeable),
computes the makespan of both orders on each draw (:func:`rollout_makespan`, an event-driven model of the rule
above) and preempts only where the mean gain is positive and at most ``LOSS_SHARE`` of the draws lose. The share
of losing draws, not a multiple of their spread: the per-draw gain is skewed (a win saves many decode steps, a loss
costs few), so a threshold in standard deviations either refuses shapes where nearly every draw wins or admits
light tails where a draw in six loses.

Owns: the finished groups' lengths it draws from (kept across rollouts, checkpointed). The scheduler that uses it
(``infinite.py``) owns which sample is parked and where each runs.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import deque
from collections.abc import Sequence

import torch

from lit_grpo.scheduling.gate import list_makespan

#: Finished groups kept to draw rollouts from (the most recent ones: lengths follow the policy as it trains).
KEPT_GROUPS = 64
#: Rollouts drawn per decision, and their seed (a decision is a pure function of its inputs).
DRAWS = 64
SEED = 0
#: The share of drawn rollouts that may lose to first-come order where preemption is chosen.
LOSS_SHARE = 0.1
#: The points' stride is at most this share of the cap (:func:`preemption_points`).
STRIDE_SHARE = 1 / 8


def preemption_points(quantum: int | None, max_new_tokens: int) -> frozenset[int]:
    """The token counts below the cap at which a running sample may be preempted (empty for ``quantum`` None or 0).

    ``q, 2q, 4q, ...`` up to a stride, the largest of them at most an eighth of the cap (and at least ``q``), then
    every stride. Doubling parks a short sample rarely. The stride keeps the rollout's end fine-grained: with
    doubling alone the last quantum is half the cap, so the longest samples, parked at a quarter of it while the
    others catch up, run their last half in whole waves, with slots idle while the last wave runs.
    """
    if not quantum or quantum >= max_new_tokens:
        return frozenset()
    stride = quantum
    while 2 * stride <= STRIDE_SHARE * max_new_tokens:
        stride *= 2
    points, t = set(range(stride, max_new_tokens, stride)), quantum
    while t < stride:
        points.add(t)
        t *= 2
    return frozenset(points)


def rollout_makespan(lengths: Sequence[int], num_slots: int, points: frozenset[int] = frozenset(),
                     park_tokens: float = math.inf) -> int:
    """Decode steps of a rollout of samples ``lengths`` (arrival order) on ``num_slots`` slots.

    With no ``points``, first-come order. Else least attained service: a sample reaching a point is parked when a
    waiting sample has generated fewer tokens and the parked samples' tokens stay within ``park_tokens``; a freed
    slot runs the waiting sample that has generated least (the first arrival among equals).
    """
    waiting = [(0, i) for i in range(len(lengths))]  # (attained, arrival): a heap
    order = sorted(points)
    running: list[tuple[int, int, int, int]] = []  # (event clock, arrival, start clock, attained at start)
    clock = parked_tokens = 0

    def run(i: int, attained: int) -> None:
        """Sample ``i`` runs from ``clock`` until it ends or reaches its next point."""
        j = bisect.bisect_right(order, attained)
        stop = min(lengths[i], order[j]) if j < len(order) else lengths[i]
        heapq.heappush(running, (clock + stop - attained, i, clock, attained))

    while waiting or running:
        while len(running) < num_slots and waiting:
            attained, i = heapq.heappop(waiting)
            parked_tokens -= attained  # 0 for a sample not started yet
            run(i, attained)
        clock = running[0][0]
        while running and running[0][0] == clock:
            _, i, start, attained = heapq.heappop(running)
            attained += clock - start
            if attained >= lengths[i]:
                continue
            if waiting and waiting[0][0] < attained and parked_tokens + attained <= park_tokens:
                parked_tokens += attained
                heapq.heappush(waiting, (attained, i))
                continue
            run(i, attained)
    return clock


class AttainedService:
    """Whether preempting by attained service beats first-come order on the rollouts seen so far.

    Args:
        quantum: q, the first preemption point (None or 0: never preempt).
        loss_share: the most drawn rollouts that may lose where preemption is chosen (None: preempt wherever the
            mean gain is positive).
    """

    def __init__(self, quantum: int | None, loss_share: float | None = LOSS_SHARE) -> None:
        self.quantum, self.loss_share = quantum, loss_share
        self.groups: deque[list[int]] = deque(maxlen=KEPT_GROUPS)

    def observe(self, lengths: Sequence[int]) -> None:
        """A group whose samples all finished: their lengths (tokens)."""
        self.groups.append([int(x) for x in lengths])

    def gains(self, num_prompts: int, group_size: int, num_slots: int, max_new_tokens: int,
              park_tokens: float) -> list[float]:
        """``makespan(first-come) - makespan(preempting)`` of each drawn rollout, in decode steps (none where
        nothing can be preempted, nothing was seen or nothing waits)."""
        points = preemption_points(self.quantum, max_new_tokens)
        if not points or not self.groups or num_prompts * group_size <= num_slots:
            return []
        rng, groups, draws = random.Random(SEED), list(self.groups), []
        for _ in range(DRAWS):
            lengths = []
            for _ in range(num_prompts):
                group = rng.choice(groups)
                lengths.extend(rng.sample(group, group_size) if len(group) >= group_size
                               else rng.choices(group, k=group_size))
            draws.append(lengths)
        # First-come order is list scheduling: every draw at once (gate.py); preempting, one draw at a time.
        first_come = list_makespan(torch.tensor(draws, dtype=torch.float64),
                                   torch.zeros(DRAWS, num_slots, dtype=torch.float64)).tolist()
        return [first - rollout_makespan(lengths, num_slots, points, park_tokens)
                for first, lengths in zip(first_come, draws)]

    def pays(self, num_prompts: int, group_size: int, num_slots: int, max_new_tokens: int,
             park_tokens: float) -> bool:
        """Preempt in this rollout? Where the drawn rollouts gain on average and few of them lose."""
        gains = self.gains(num_prompts, group_size, num_slots, max_new_tokens, park_tokens)
        if not gains or sum(gains) <= 0:
            return False
        return self.loss_share is None or sum(gain < 0 for gain in gains) <= self.loss_share * len(gains)

    def state_dict(self) -> dict:
        return {"groups": [list(group) for group in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        self.groups = deque(([int(x) for x in group] for group in state["groups"]), maxlen=KEPT_GROUPS)
