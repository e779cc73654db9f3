"""The default scheduler of "infinite": continuous slots, and least-attained-service preemption where it pays.

Design note
-----------
A rollout runs B prompts x G samples on g slots. Continuous sampling refills a freed slot at once with the next
waiting sample, first come, first served. Its weak point is the end of the rollout: the last samples to start are
as likely to be long as any, and one of them runs on alone while the other slots idle. Completion lengths are
heavy-tailed (a sample that has run long is expected to run longer), so the fix needs no length prediction:

1. **Least attained service.** A running sample that reaches a *preemption point* (:func:`preemption_points`:
   8, 16, 32, ... tokens, then every eighth of the cap) is parked while a waiting sample has generated fewer
   tokens; its KV is kept aside (the engine's job) and it resumes where it stopped. A freed slot runs the waiting
   sample that has generated least, the first arrival among equals. Every sample starts within the rollout's first
   quanta, short ones end early, and the rollout ends with the longest samples running side by side.
2. **The park budget.** Parked samples hold at most ``park_budget`` of the slots' generation KV
   (``park_budget x g x cost(max_new_tokens)``, a sample's ``t`` tokens costing ``cost(t)``: its KV in tokens of
   every layer, ``RolloutWork.park_cost``; ``t`` itself unless a sliding layer keeps only its window of a tail);
   a sample that would exceed it runs on.
3. **The gate.** Where lengths are light-tailed, preemption can lose to first-come order. So once per rollout the
   scheduler draws rollouts from the groups that finished in earlier rollouts (whole groups with replacement, each
   group's samples shuffled, since they are exchangeable), runs both rules on each draw (:func:`rollout_makespan`)
   and preempts only where the mean gain is positive and at most ``loss_share`` of the draws lose. The share of
   losing draws, not a multiple of their spread: the gain is skewed (a win saves many steps, a loss costs few).
   Until a group has finished, and wherever every sample has a slot, the rollout runs first come, first served.

Every decision carries its reason (``base.Decision``): ``start`` / ``arrival`` when the gate chose first-come
order; ``start`` / ``least_attained`` and ``resume`` / ``least_attained`` when it chose preemption; ``park`` /
``preemption`` at a preemption point. The rollout's choice is ``preempting`` (``last_info``, ``rollout/preempting``)
and its grounds, in words, ``gate_note``. A sample carried from an earlier rollout counts the tokens it generated
there: among waiting samples it runs after those that have generated fewer.

State: the finished groups the gate draws from live across rollouts (checkpointed, ``state_dict``); which sample
runs where, which are parked and how far each got is the base Scheduler's record; nothing else is kept.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lit_grpo.runtime.validation import check_int, check_state_keys, integer_within, shown_setting
from lit_grpo.scheduling.base import LEAST_ATTAINED, PREEMPTION, RolloutWork, SampleKey, Scheduler, whole_tail

#: The first preemption point, in tokens.
PREEMPT_TOKENS = 8
#: Parked samples' KV, as a share of the slots' generation KV (``g x max_new_tokens`` tokens of every layer).
PARK_BUDGET = 0.5
#: The share of drawn rollouts that may lose to first-come order where preemption is chosen.
LOSS_SHARE = 0.1
#: Finished groups kept to draw rollouts from (the most recent: lengths follow the policy as it trains).
KEPT_GROUPS = 64
#: Rollouts drawn per decision, and their seed (a decision is a pure function of its inputs).
DRAWS = 64
SEED = 0
#: The points' stride is at most this share of the cap.
STRIDE_SHARE = 1 / 8


def preemption_points(quantum: int | None, max_new_tokens: int) -> frozenset[int]:
    """The token counts below the cap at which a running sample may be parked (empty for ``quantum`` None or 0).

    ``q, 2q, 4q, ...`` up to a stride, the largest of them at most an eighth of the cap (and at least ``q``), then
    every stride. Doubling parks a short sample rarely; the stride keeps the rollout's end fine-grained (with
    doubling alone the last quantum is half the cap, and the longest samples run it in whole waves, slots idle).
    """
    quantum = check_int("preempt_tokens", quantum, 0, none=True)
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


def list_makespan(lengths: torch.Tensor, ready: torch.Tensor) -> torch.Tensor:
    """``[draws]`` decode steps of first-come order, every draw at once: jobs ``lengths[:, j]`` ``[draws, N]`` in
    column order, each to the slot that frees first; ``ready``: ``[draws, S]`` when each slot frees."""
    ready = ready.clone()
    rows = torch.arange(lengths.shape[0])
    for j in range(lengths.shape[1]):
        slot = ready.argmin(dim=1)
        ready[rows, slot] += lengths[:, j]
    return ready.max(dim=1).values


def rollout_makespan(lengths: Sequence[int], num_slots: int, points: frozenset[int] = frozenset(),
                     park_tokens: float = math.inf, park_cost: Callable[[int], float] = whole_tail) -> int:
    """Decode steps of a rollout of samples ``lengths`` (arrival order) on ``num_slots`` slots, as this scheduler
    runs it through ``driver.drive_rollout``: with no ``points`` first-come order, else least attained service
    within ``park_tokens``, a parked sample's tokens costing ``park_cost`` of them.

    Exact, not an estimate: the slots are tracked because the driver offers a step's preemption points in slot
    order, and under a park budget the first sample parked in a step can leave no room for the next.
    """
    waiting = [(0, i) for i in range(len(lengths))]  # (attained, arrival): a heap
    free = list(range(num_slots))  # a heap: admission fills the lowest free slot first
    order = sorted(points)
    running: list[tuple[int, int, int, int, int]] = []  # (event clock, slot, arrival, start clock, attained at start)
    clock = parked_tokens = 0

    def run(slot: int, i: int, attained: int) -> None:
        """Sample ``i`` runs in ``slot`` from ``clock`` until it ends or reaches its next point."""
        j = bisect.bisect_right(order, attained)
        stop = min(lengths[i], order[j]) if j < len(order) else lengths[i]
        heapq.heappush(running, (clock + stop - attained, slot, i, clock, attained))

    while waiting or running:
        while free and waiting:
            attained, i = heapq.heappop(waiting)
            if attained:  # a parked sample (every sample starts here at 0)
                parked_tokens -= park_cost(attained)
            run(heapq.heappop(free), i, attained)
        clock = running[0][0]
        while running and running[0][0] == clock:  # one step's events, in slot order (the heap's second key)
            _, slot, i, start, attained = heapq.heappop(running)
            attained += clock - start
            if attained >= lengths[i]:
                heapq.heappush(free, slot)
            elif waiting and waiting[0][0] < attained and parked_tokens + park_cost(attained) <= park_tokens:
                parked_tokens += park_cost(attained)
                heapq.heappush(waiting, (attained, i))
                heapq.heappush(free, slot)
            else:
                run(slot, i, attained)
    return clock


class LeastAttainedScheduler(Scheduler):
    """Continuous slots with least-attained-service preemption, gated per rollout (the module's design note).

    Args:
        preempt_tokens: q, the first preemption point (None or 0: never preempt: plain continuous sampling).
        park_budget: parked samples' KV as a share of the slots' generation KV, > 0 (None: unbounded).
        loss_share: the most drawn rollouts that may lose where preemption is chosen, in [0, 1] (None: preempt
            wherever the drawn rollouts gain on average).
    """

    def __init__(self, preempt_tokens: int | None = PREEMPT_TOKENS, park_budget: float | None = PARK_BUDGET,
                 loss_share: float | None = LOSS_SHARE) -> None:
        from lit_grpo.scheduling.config import InfiniteSchedulerConfig  # its checks; it imports this module

        # built by hand (not from a config), a bad option fails here, naming it, not at the first rollout
        InfiniteSchedulerConfig(preempt_tokens=preempt_tokens, park_budget=park_budget, loss_share=loss_share)
        self.preempt_tokens, self.park_budget, self.loss_share = preempt_tokens, park_budget, loss_share
        self.groups: deque[list[int]] = deque(maxlen=KEPT_GROUPS)  # finished groups' lengths, for the gate
        self.last_info: dict[str, float] = {}

    # ---- the rollout, in the order the driver calls ---------------------------------------------------------

    def begin(self, work: RolloutWork) -> None:
        super().begin(work)
        self.park_tokens = self._park_tokens(work)
        self.parked_tokens = 0  # what the parked samples hold, in tokens of every layer (work.park_cost)
        self.finished: dict[SampleKey, int] = {}
        self.preempting, self.gate_note = self.judge(work)
        self.preempt_points = preemption_points(self.preempt_tokens, work.max_new_tokens) if self.preempting \
            else frozenset()
        # Preempting, the waiting samples by (tokens generated, arrival): the next to run is the least attained
        # (first come, first served needs no order of its own: the base record's).
        self._least = [(self.generated[key], rank, key) for rank, key in enumerate(self._order)] \
            if self.preempting else []
        heapq.heapify(self._least)
        self._rank = {key: rank for rank, key in enumerate(self._order)} if self.preempting else {}

    def admit(self) -> list[tuple[int, SampleKey]]:
        if not self.preempting:
            return super().admit()  # first come, first served
        assignments = []
        for slot in self.free_slots():
            if not self._least:
                break
            _, _, key = heapq.heappop(self._least)
            if key in self.parked:
                self.parked_tokens -= self.work.park_cost(self.generated[key])
            assignments.append(self._place(slot, key, LEAST_ATTAINED))
        return assignments

    def preempt(self, key: SampleKey, generated: int) -> bool:
        """Park ``key`` at a preemption point when a waiting sample has generated fewer tokens and the parked
        samples' KV stays within the park budget."""
        if not self.preempting or key not in self.running:
            return False
        cost = self.work.park_cost(generated)
        if not self._least or self._least[0][0] >= generated or self.parked_tokens + cost > self.park_tokens:
            return False
        self._park(key, PREEMPTION)
        self.parked_tokens += cost
        heapq.heappush(self._least, (generated, self._rank[key], key))
        return True

    def finish(self, key: SampleKey, length: int) -> None:
        self._vacate(key)
        self.finished[key] = int(length)

    def end(self) -> dict[str, float]:
        for p in range(self.work.num_prompts):  # the groups made whole here (carried samples included): the gate's
            lengths = [self.finished.get((p, k), self.work.generated.get((p, k)) if (p, k) in self.work.done else None)
                       for k in range(self.work.group_size)]
            whole_here = any((p, k) in self.finished for k in range(self.work.group_size))  # not whole already
            if None not in lengths and whole_here:  # (a group carried complete is observed once, when it ended)
                self.observe(lengths)
        self.last_info = {"preempting": float(self.preempting), "parked_samples": self.parked_samples,
                          "peak_parked": self.peak_parked}
        return {"preempting": float(self.preempting)}

    # ---- the gate ----------------------------------------------------------------------------------------------

    def judge(self, work: RolloutWork) -> tuple[bool, str]:
        """Preempt in this rollout? ``(decision, its grounds in words)``."""
        points = preemption_points(self.preempt_tokens, work.max_new_tokens)
        if not points:
            return False, f"first come: no preemption point below the cap (preempt_tokens={self.preempt_tokens})"
        if len(work.pending_keys()) <= work.num_slots:
            return False, "first come: every sample has a slot"
        if not self.groups:
            return False, "first come: no finished group to draw rollouts from yet"
        gains = self.gains(work.num_prompts, work.group_size, work.num_slots, work.max_new_tokens,
                           self._park_tokens(work), work.park_cost)
        losing = sum(gain < 0 for gain in gains)
        grounds = f"{losing} of {len(gains)} drawn rollouts lose, mean gain {sum(gains) / len(gains):+.1f} steps"
        if sum(gains) <= 0 or (self.loss_share is not None and losing > self.loss_share * len(gains)):
            return False, f"first come: {grounds}"
        return True, f"preempting: {grounds}"

    def _park_tokens(self, work: RolloutWork) -> float:
        """What parked samples may hold in ``work``, in tokens of every layer: ``park_budget`` of the slots'
        generation KV (``park_budget x g x cost(max_new_tokens)``)."""
        return math.inf if self.park_budget is None \
            else self.park_budget * work.num_slots * work.park_cost(work.max_new_tokens)

    def observe(self, lengths: Sequence[int]) -> None:
        """A group whose samples all finished: their lengths (tokens)."""
        self.groups.append([int(x) for x in lengths])

    def gains(self, num_prompts: int, group_size: int, num_slots: int, max_new_tokens: int,
              park_tokens: float = math.inf, park_cost: Callable[[int], float] = whole_tail) -> list[float]:
        """``decode steps(first come) - decode steps(preempting)`` of each of ``DRAWS`` rollouts drawn from the
        finished groups (none where nothing was seen or every sample has a slot)."""
        points = preemption_points(self.preempt_tokens, max_new_tokens)
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
        first_come = list_makespan(torch.tensor(draws, dtype=torch.float64),
                                   torch.zeros(DRAWS, num_slots, dtype=torch.float64)).tolist()
        return [first - rollout_makespan(lengths, num_slots, points, park_tokens, park_cost)
                for first, lengths in zip(first_come, draws)]

    def state_dict(self) -> dict:
        """The finished groups the gate draws from (everything else lives for one rollout)."""
        return {"groups": [list(group) for group in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        """Take the finished groups of ``state`` (``state_dict``'s, from a checkpoint), checked whole first
        (``checked_groups``): a corrupt or foreign one is refused naming the bad key or group, and leaves the groups
        as they were. A length-aware scheduler's predictor and trust are dropped, said."""
        groups = self.checked_groups(state)
        dropped = sorted({"predictor", "trust"} & set(state))
        if dropped and type(self) is LeastAttainedScheduler:
            warnings.warn(f"the checkpoint's scheduler state holds {dropped} (a length predictor's); the default "
                          "scheduler has none and keeps only the finished groups (sampling.scheduler.length_aware "
                          "resumes them)", stacklevel=2)
        self.groups = groups

    def checked_groups(self, state: Any) -> deque[list[int]]:
        """The finished groups of a scheduler state, checked, as the gate keeps them (the most recent
        ``KEPT_GROUPS``, plain ints), else a ValueError naming the bad key or group. The groups are under
        ``groups``; a checkpoint of the 0.1 combined scheduler keeps them under ``preemption`` beside a length
        predictor's state, or has none (written before preemption existed); a length-aware scheduler's state holds
        its predictor and trust beside them."""
        check_state_keys(f"a {type(self).__name__} state", state, _STATE_KEYS, optional=_STATE_KEYS)
        name, groups = "scheduler state groups", state.get("groups", [])
        if "preemption" in state:
            if "groups" in state:
                raise ValueError(f"a {type(self).__name__} state holds groups and preemption.groups; it holds its "
                                 "finished groups once (under preemption only in a checkpoint of the 0.1 combined "
                                 "scheduler)")
            check_state_keys(f"a {type(self).__name__} state's preemption", state["preemption"], ("groups",))
            name, groups = "scheduler state preemption.groups", state["preemption"]["groups"]
        if not isinstance(groups, (list, tuple)):
            raise ValueError(f"{shown_setting(name, groups, 80)} must be a list of finished groups")
        checked = deque(maxlen=KEPT_GROUPS)
        for index, group in enumerate(groups):
            lengths = [integer_within(length, 0) for length in group] if isinstance(group, (list, tuple)) else []
            if not lengths or None in lengths:
                raise ValueError(f"{shown_setting(f'{name}[{index}]', group, 80)} is not allowed; a finished group "
                                 "is a non-empty list of its samples' lengths (integers >= 0)")
            checked.append(lengths)
        return checked


#: The keys of a scheduler state the default scheduler reads (``checked_groups``): each may be absent.
_STATE_KEYS = ("groups", "preemption", "predictor", "trust")
