"""Runtime refill: which pending sample a freed slot runs next, following a global plan that is corrected online.

A *refill policy* orders candidates by predicted remaining length:

- "sjf": Shortest Job First (the paper's choice): minimizes mean completion time, but leaves long jobs for last.
- "lpt": Longest Processing Time first: the classic makespan heuristic; a long job that was mispredicted is
  discovered early, while short jobs remain to fill the tail.
- "fifo": the plan's arrival order (prompt-major), as plain continuous batching.

A :class:`SlotPlanner` keeps a global plan (a :class:`~lit_grpo.scheduling.grouping.Partition` of the pending
samples over the slots, computed with the slots' ready times) and, when a slot frees, gives it the job of
*its* planned share that the policy prefers. Mispredictions are corrected at refill time from the remaining
pool: when a slot frees more than ``replan_tolerance`` of its job's predicted duration earlier or later than
planned, or its share is used up, or new predictions arrived, the whole remaining pool is re-planned from the
current state (running samples' expected remaining work as ready times).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from lit_grpo.runtime.validation import check_choice
from lit_grpo.scheduling.grouping import DEFAULT_EPSILON, Partition

RefillName = Literal["lpt", "sjf", "fifo"]


class RefillPolicy:
    """Orders candidates ``(predicted remaining length, arrival rank)``; the first in order runs first."""

    name = "base"

    def sort_key(self, length: float, rank: int) -> tuple:
        raise NotImplementedError

    def pick(self, candidates: Sequence[tuple[float, int]]) -> int:
        """Index of the preferred candidate."""
        keys = [self.sort_key(length, rank) for length, rank in candidates]
        return min(range(len(keys)), key=keys.__getitem__)

    def order(self, candidates: Sequence[tuple[float, int]]) -> list[int]:
        """Candidate indices, preferred first."""
        return sorted(range(len(candidates)), key=lambda i: self.sort_key(*candidates[i]))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SJFRefill(RefillPolicy):
    """Shortest predicted remaining length first; ties by arrival."""

    name = "sjf"

    def sort_key(self, length: float, rank: int) -> tuple:
        return (length, rank)


class LPTRefill(RefillPolicy):
    """Longest predicted remaining length first; ties by arrival."""

    name = "lpt"

    def sort_key(self, length: float, rank: int) -> tuple:
        return (-length, rank)


class FIFORefill(RefillPolicy):
    """Arrival order, predictions ignored."""

    name = "fifo"

    def sort_key(self, length: float, rank: int) -> tuple:
        return (rank,)


REFILLS: dict[str, type[RefillPolicy]] = dict(zip(get_args(RefillName), (LPTRefill, SJFRefill, FIFORefill)))
_ARRIVAL_ORDER = FIFORefill()

#: The default refill policy of "infinite": the makespan winner in the simulations with predicted lengths (see
#: lit_grpo.scheduling.infinite and tests/test_scheduling_sim.py::test_lpt_refill_beats_sjf_under_mispredictions).
DEFAULT_REFILL: RefillName = "lpt"


def make_refill(name: str | RefillPolicy) -> RefillPolicy:
    """A refill policy from its name: "sjf" | "lpt" | "fifo" (or a policy object, returned as is)."""
    if isinstance(name, RefillPolicy):
        return name
    return REFILLS[check_choice("refill", name, get_args(RefillName))]()


@dataclass
class PlannerStats:
    """What the planner did in one rollout."""

    replans: int = 0
    forced: int = 0  # refills that ran the pool's longest job instead of the planned pick (see choose)
    plan_seconds: float = 0.0
    steals: int = 0  # a freed slot whose planned share was empty took a job from the busiest slot


class SlotPlanner:
    """Global plan over ``num_slots`` slots plus runtime refill with misprediction correction.

    Jobs are hashable keys with a predicted remaining length and an arrival rank. The planner is pure: it
    never sees tokens or tensors; the caller tells it the clock (decode steps so far) and the slots' ready times.

    Args:
        policy: orders a slot's planned share.
        grouping: ``(lengths, num_slots, ready=..., epsilon=...) -> Partition`` (see ``make_grouping``).
        num_slots: the rollout's slots.
        replan_tolerance: re-plan when a slot frees more than this fraction of its job's predicted duration
            (at least 1 step) away from the plan.
        replan_window: deviations trigger re-plans only once the pool has at most this many jobs (early
            deviations are absorbed by later re-plans, and re-planning thousands of jobs per refill is waste).
        epsilon: the grouping's precision when predictions are exact.
    """

    def __init__(
        self,
        policy: RefillPolicy,
        grouping: Callable[..., Partition],
        num_slots: int,
        replan_tolerance: float = 0.1,
        replan_window: int | None = None,
        epsilon: float = DEFAULT_EPSILON,
    ) -> None:
        self.policy = policy
        self.epsilon = epsilon
        self.grouping = grouping
        self.num_slots = num_slots
        self.replan_tolerance = replan_tolerance
        self.replan_window = replan_window if replan_window is not None else 32 * num_slots
        self.pool: dict[Hashable, tuple[float, int]] = {}  # key -> (predicted remaining, arrival rank)
        self.total_work = 0.0  # sum of the pool's predicted remaining lengths
        self.shares: list[list[Hashable]] | None = None  # the plan: each slot's pending jobs
        self.plan_makespan = 0.0
        self.stale = True
        self.expected_end: list[float | None] = [None] * num_slots  # clock at which the slot's job should end
        self.planned_duration: list[float] = [0.0] * num_slots
        self.last_replan_clock: float | None = None
        self.stats = PlannerStats()

    def __len__(self) -> int:
        return len(self.pool)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.pool

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

    def update(self, key: Hashable, remaining: float, tolerance: float = 0.0) -> None:
        """New prediction for a pooled job; the plan goes stale only if it moved by more than ``tolerance``."""
        old, rank = self.pool[key]
        if abs(remaining - old) > tolerance * max(old, 1.0):
            self.add(key, remaining, rank)

    def note_start(self, slot: int, clock: float, duration: float) -> None:
        """A slot started something the planner did not choose (a probe, a kept sample): expect it back then."""
        self.expected_end[slot] = clock + duration
        self.planned_duration[slot] = duration

    def choose(
        self, slot: int, clock: float, ready: Sequence[float], slack: float = 0.0, noise: float = 0.0
    ) -> Hashable | None:
        """The job slot ``slot`` should run now, at decode step ``clock``; None when the pool is empty.

        Args:
            ready: ``[num_slots]`` expected remaining work of the slots' running jobs (0 for free slots).
            slack: relative prediction error (e.g. the predictor's log-length std). The longest job of the
                *whole* pool runs now instead of the slot's planned pick if that costs the plan at most ``slack``
                of its makespan: a plan balanced on uncertain lengths may defer a long job to a slot that frees
                later, where its error lands at the very end (robust scheduling starts long, uncertain jobs
                first, whatever the refill policy). With exact lengths (slack 0) the plan is followed.
            noise: the relative error of the predicted lengths; plans are computed to precision
                ``max(epsilon, noise)``, since planning more precisely than the lengths are known buys nothing
                and costs the FPTAS's DP.
        """
        if not self.pool:
            return None
        precision = max(self.epsilon, noise)
        if self._needs_replan(slot, clock):
            self.replan(clock, ready, precision)
        share = self.shares[slot]
        if not share:
            # The plan leaves this slot idle now; idling a free slot never helps, so take from the busiest slot.
            self.stats.steals += 1
            share = max(self.shares, key=lambda s: sum(self.pool[k][0] for k in s))
        key = share[self.policy.pick([self.pool[k] for k in share])]
        if slack > 0:
            longest = max(self.pool, key=lambda k: (self.pool[k][0], -self.pool[k][1]))
            if longest != key and self._adopt_forced(slot, longest, ready, slack, precision):
                key = longest
        for slot_share in self.shares:
            if key in slot_share:
                slot_share.remove(key)
        self.note_start(slot, clock, self._take(key))
        return key

    def _adopt_forced(
        self, slot: int, favourite: Hashable, ready: Sequence[float], slack: float, precision: float
    ) -> bool:
        """Plan the pool with ``favourite`` started on ``slot`` now; keep that plan if it is within ``slack``."""
        forced_ready = list(ready)
        forced_ready[slot] = forced_ready[slot] + self.pool[favourite][0]
        keys = sorted((k for k in self.pool if k != favourite), key=lambda k: self.pool[k][1])
        part = self._partition(keys, forced_ready, precision)
        if part.makespan > self.plan_makespan * (1 + slack):
            return False
        self.shares = [[keys[j] for j in slot_jobs] for slot_jobs in part.slots]
        self.plan_makespan = part.makespan
        self.stats.forced += 1
        return True

    def choose_greedy(self, slot: int, clock: float, policy: RefillPolicy | None = None) -> Hashable | None:
        """The favourite of the whole pool by ``policy`` (default: the planner's), no plan; used while unseen
        jobs may still arrive, and in arrival order while predictions tell nothing."""
        if not self.pool:
            return None
        keys = list(self.pool)
        return self._start_off_plan(slot, clock, keys[(policy or self.policy).pick([self.pool[k] for k in keys])])

    def choose_first(self, slot: int, clock: float) -> Hashable | None:
        """The pool's first arrival: plain continuous order."""
        return self.choose_greedy(slot, clock, _ARRIVAL_ORDER)

    def choose_least_attained(self, slot: int, clock: float, attained: Mapping[Hashable, int]) -> Hashable | None:
        """The pool's job with the fewest tokens ``attained``, the first arrival among equals (preemption's order,
        ``preemption.py``)."""
        if not self.pool:
            return None
        return self._start_off_plan(slot, clock, min(self.pool, key=lambda k: (attained[k], self.pool[k][1])))

    def _start_off_plan(self, slot: int, clock: float, key: Hashable) -> Hashable:
        """``key`` leaves the pool to run in ``slot`` from ``clock``, chosen without the plan: the plan is stale."""
        self.stale = True
        self.note_start(slot, clock, self._take(key))
        return key

    def replan(self, clock: float, ready: Sequence[float], precision: float | None = None) -> None:
        """Partition the whole pool over the slots, starting from their ready times, to ``precision``
        (default: epsilon)."""
        keys = sorted(self.pool, key=lambda k: self.pool[k][1])
        part = self._partition(keys, ready, precision if precision is not None else self.epsilon)
        self.shares = [[keys[j] for j in slot] for slot in part.slots]
        self.plan_makespan = part.makespan
        self.stale = False
        self.last_replan_clock = clock
        self.stats.replans += 1

    def _partition(self, keys: list[Hashable], ready: Sequence[float], precision: float) -> Partition:
        start = time.perf_counter()
        part = self.grouping([self.pool[k][0] for k in keys], self.num_slots, ready=list(ready), epsilon=precision)
        self.stats.plan_seconds += time.perf_counter() - start
        return part

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
        return abs(clock - expected) > max(1.0, self.replan_tolerance * self.planned_duration[slot])
