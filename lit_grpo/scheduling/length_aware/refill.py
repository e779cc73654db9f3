"""Runtime refill of the length-aware scheduler: which pending sample a freed slot runs, following a global plan
that is corrected online.

A *refill policy* orders candidates ``(predicted remaining length, arrival rank)``:

- "sjf": Shortest Job First (the paper's choice): minimizes mean completion time, but leaves long jobs for last.
- "lpt": Longest Processing Time first (the default): a long job that was mispredicted is discovered early,
  while short jobs remain to fill the tail.
- "fifo": arrival order (prompt-major), as plain continuous sampling.

A :class:`SlotPlanner` keeps a global plan (a :class:`~lit_grpo.scheduling.length_aware.grouping.Partition` of the
pending samples over the slots, from the slots' ready times) and gives a freed slot the job of *its* planned share
that the policy prefers. Mispredictions are corrected at refill time: when a slot frees more than
``REPLAN_TOLERANCE`` of its job's predicted duration off the plan, or its share is used up, or new predictions
arrived, the remaining pool is re-planned from the current state.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import get_args

from lit_grpo.runtime.validation import check_choice
from lit_grpo.scheduling.config import RefillName
from lit_grpo.scheduling.length_aware.grouping import DEFAULT_EPSILON, fptas_partition

#: Re-plan when a slot frees more than this fraction of its job's predicted duration (at least a step) off the plan.
REPLAN_TOLERANCE = 0.1

_SORT_KEYS = {
    "lpt": lambda length, rank: (-length, rank),
    "sjf": lambda length, rank: (length, rank),
    "fifo": lambda length, rank: (rank,),
}


class RefillPolicy:
    """Orders candidates ``(predicted remaining length, arrival rank)``; the first in order runs first."""

    def __init__(self, name: RefillName) -> None:
        self.name = check_choice("refill", name, get_args(RefillName))
        self.sort_key = _SORT_KEYS[name]

    def pick(self, candidates: Sequence[tuple[float, int]]) -> int:
        """Index of the preferred candidate."""
        return min(range(len(candidates)), key=lambda i: self.sort_key(*candidates[i]))

    def order(self, candidates: Sequence[tuple[float, int]]) -> list[int]:
        """Candidate indices, preferred first."""
        return sorted(range(len(candidates)), key=lambda i: self.sort_key(*candidates[i]))

    def __repr__(self) -> str:
        return f"RefillPolicy({self.name!r})"


_ARRIVAL_ORDER = RefillPolicy("fifo")


@dataclass
class PlannerStats:
    """What the planner did in one rollout."""

    replans: int = 0
    plan_seconds: float = 0.0
    steals: int = 0  # a freed slot whose planned share was empty took a job from the busiest slot


class SlotPlanner:
    """Global plan over ``num_slots`` slots plus runtime refill with misprediction correction.

    Jobs are hashable keys with a predicted remaining length and an arrival rank. The planner is pure: it never
    sees tokens or tensors; the caller tells it the clock (decode steps so far) and the slots' ready times.
    Deviations trigger re-plans only once the pool has at most 32 jobs per slot (early deviations are absorbed
    by later re-plans, and re-planning thousands of jobs per refill is waste).
    """

    def __init__(self, policy: RefillPolicy, num_slots: int, epsilon: float = DEFAULT_EPSILON) -> None:
        self.policy, self.num_slots, self.epsilon = policy, num_slots, epsilon
        self.replan_window = 32 * num_slots
        self.pool: dict[Hashable, tuple[float, int]] = {}  # key -> (predicted remaining, arrival rank)
        self.total_work = 0.0  # sum of the pool's predicted remaining lengths
        self.shares: list[list[Hashable]] | None = None  # the plan: each slot's pending jobs
        self.stale = True
        self.expected_end: list[float | None] = [None] * num_slots  # clock at which the slot's job should end
        self.planned_duration: list[float] = [0.0] * num_slots
        self.last_replan_clock: float | None = None
        self.stats = PlannerStats()

    def __len__(self) -> int:
        return len(self.pool)

    def add(self, key: Hashable, remaining: float, rank: int) -> None:
        """A job joins the pool (or changes its prediction); the plan is recomputed at the next refill."""
        self._take(key)
        self.pool[key] = (float(remaining), rank)
        self.total_work += float(remaining)
        self.stale = True

    def _take(self, key: Hashable) -> float:
        """Remove ``key`` from the pool (if there); returns its predicted remaining length."""
        entry = self.pool.pop(key, None)
        if entry is None:
            return 0.0
        self.total_work -= entry[0]
        return entry[0]

    def update(self, key: Hashable, remaining: float) -> None:
        """New prediction for a pooled job; the plan goes stale only if it moved by more than the tolerance."""
        old, rank = self.pool[key]
        if abs(remaining - old) > REPLAN_TOLERANCE * max(old, 1.0):
            self.add(key, remaining, rank)

    def note_start(self, slot: int, clock: float, duration: float) -> None:
        """A slot started something the planner did not choose (a probe, a kept sample): expect it back then."""
        self.expected_end[slot] = clock + duration
        self.planned_duration[slot] = duration

    def choose(self, slot: int, clock: float, ready: Sequence[float], noise: float = 0.0) -> Hashable | None:
        """The job slot ``slot`` should run now, at decode step ``clock``; None when the pool is empty.

        Args:
            ready: ``[num_slots]`` expected remaining work of the slots' running jobs (0 for free slots).
            noise: the relative error of the predicted lengths; plans are computed to precision
                ``max(epsilon, noise)``, since planning more precisely than the lengths are known buys nothing.
        """
        if not self.pool:
            return None
        if self._needs_replan(slot, clock):
            self.replan(clock, ready, max(self.epsilon, noise))
        share = self.shares[slot]
        if not share:
            # The plan leaves this slot idle now; idling a free slot never helps, so take from the busiest slot.
            self.stats.steals += 1
            share = max(self.shares, key=lambda s: sum(self.pool[k][0] for k in s))
        key = share[self.policy.pick([self.pool[k] for k in share])]
        share.remove(key)
        self.note_start(slot, clock, self._take(key))
        return key

    def choose_greedy(self, slot: int, clock: float, policy: RefillPolicy | None = None) -> Hashable | None:
        """The favourite of the whole pool by ``policy`` (default: the planner's), no plan."""
        if not self.pool:
            return None
        keys = list(self.pool)
        key = keys[(policy or self.policy).pick([self.pool[k] for k in keys])]
        self.stale = True
        self.note_start(slot, clock, self._take(key))
        return key

    def choose_first(self, slot: int, clock: float) -> Hashable | None:
        """The pool's first arrival: plain continuous order."""
        return self.choose_greedy(slot, clock, _ARRIVAL_ORDER)

    def replan(self, clock: float, ready: Sequence[float], precision: float | None = None) -> None:
        """Partition the whole pool over the slots from their ready times, to ``precision`` (default: epsilon)."""
        keys = sorted(self.pool, key=lambda k: self.pool[k][1])
        start = time.perf_counter()
        part = fptas_partition([self.pool[k][0] for k in keys], self.num_slots, ready=list(ready),
                               epsilon=precision if precision is not None else self.epsilon)
        self.stats.plan_seconds += time.perf_counter() - start
        self.shares = [[keys[j] for j in slot] for slot in part.slots]
        self.stale = False
        self.last_replan_clock = clock
        self.stats.replans += 1

    def _needs_replan(self, slot: int, clock: float) -> bool:
        if self.stale or self.shares is None:
            return True
        if self.last_replan_clock == clock:
            return False  # at most one re-plan per step for deviations and used-up shares
        if not self.shares[slot]:
            return True
        if len(self.pool) > self.replan_window:
            return False
        expected = self.expected_end[slot]
        if expected is None:
            return False
        return abs(clock - expected) > max(1.0, REPLAN_TOLERANCE * self.planned_duration[slot])
