"""Partitions of jobs into slots, the makespan lower bound, and the two classic heuristics (LPT, Karmarkar-Karp).

See ``grouping.py`` for the problem and the choice between algorithms; the FPTAS is in ``fptas.py``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Partition:
    """Jobs split into slots.

    Attributes:
        slots: ``slots[i]`` lists the job indices given to slot ``i`` (the slot whose ready time is ``ready[i]``).
        loads: ``loads[i] = ready[i] + sum of slot i's job lengths``.
        lower_bound: a lower bound on the optimal makespan (see :func:`makespan_lower_bound`).
        ratio_bound: a proven upper bound on ``makespan / OPT`` (``1 + epsilon`` when the FPTAS certified it).
        method: which construction produced the slots ("lpt", "kk", "local", "dp").
    """

    slots: list[list[int]]
    loads: list[float]
    lower_bound: float
    ratio_bound: float
    method: str

    @property
    def makespan(self) -> float:
        return max(self.loads) if self.loads else 0.0


def makespan_lower_bound(lengths: Sequence[float], num_slots: int, ready: Sequence[float] | None = None) -> float:
    """A lower bound on the optimal makespan of ``lengths`` on ``num_slots`` slots with ready times.

    The largest of: the water level (spread all work over the slots, each slot starting at its ready time, as
    if jobs could be split), the latest ready time, and the pigeonhole bounds on the ``j`` largest jobs (on
    ``j <= m`` distinct slots one slot starts at the j-th smallest ready time or later; otherwise two of them
    share the earliest slot; ``m + 1`` jobs always put two on one slot). Rounded up when every input is an
    integer, because the makespan then is one.
    """
    ready_sorted = sorted(ready) if ready is not None else [0.0] * num_slots
    jobs = sorted(lengths, reverse=True)
    bound = max(water_level(ready_sorted, sum(jobs)), ready_sorted[-1])
    for j, length in enumerate(jobs[:num_slots]):
        bound = max(bound, min(ready_sorted[j] + length, ready_sorted[0] + 2 * length))
    if len(jobs) > num_slots:
        bound = max(bound, ready_sorted[0] + jobs[num_slots - 1] + jobs[num_slots])
    if all(float(x).is_integer() for x in jobs) and all(float(x).is_integer() for x in ready_sorted):
        bound = math.ceil(bound - 1e-9)
    return float(bound)


def water_level(ready_sorted: Sequence[float], work: float) -> float:
    """The level ``T`` at which ``sum_i max(0, T - ready_sorted[i]) == work`` (ready times sorted ascending)."""
    filled = 0.0
    for i, level in enumerate(ready_sorted):
        # Slots 0..i-1 are under water; raising them to this slot's ready time costs i * (level - previous).
        nxt = ready_sorted[i + 1] if i + 1 < len(ready_sorted) else math.inf
        capacity = (i + 1) * (nxt - level)
        if filled + capacity >= work:
            return level + (work - filled) / (i + 1)
        filled += capacity
    return ready_sorted[-1]  # unreachable: the last slot has infinite capacity


def lpt_partition(lengths: Sequence[float], num_slots: int, ready: Sequence[float] | None = None) -> Partition:
    """Longest Processing Time first: jobs in descending order, each to the currently least-loaded slot.

    Ties break on the lower slot index, so the result is deterministic. ``O(n log n + n log m)``.
    """
    ready = check_jobs(lengths, num_slots, ready)
    loads = list(ready)
    slots: list[list[int]] = [[] for _ in range(num_slots)]
    heap = [(load, slot) for slot, load in enumerate(loads)]
    heapq.heapify(heap)
    for job in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        load, slot = heapq.heappop(heap)
        slots[slot].append(job)
        loads[slot] = load + lengths[job]
        heapq.heappush(heap, (loads[slot], slot))
    lower = makespan_lower_bound(lengths, num_slots, ready)
    return Partition(slots, loads, lower, lpt_ratio_bound(max(loads), lower, num_slots, ready), "lpt")


def karmarkar_karp_partition(
    lengths: Sequence[float], num_slots: int, ready: Sequence[float] | None = None
) -> Partition:
    """Multiway largest differencing method (Karmarkar-Karp generalized to m slots, as in Korf's CKK).

    Every job starts as a partial partition ``(p, 0, ..., 0)`` and the ready times as one partial partition of
    their own. Repeatedly pop the two partial partitions with the largest spread (max - min slot), combine the
    largest slot of one with the smallest of the other (one sorted ascending, the other descending), and push
    the result back. The ready-time partition's slots never merge with each other, so each final slot holds
    exactly one ready time and keeps its identity. ``O(n m log n)``.
    """
    ready = check_jobs(lengths, num_slots, ready)
    # A partial partition: list of m slots, each (load, jobs, ready slot id or -1). Jobs are a tree of pairs
    # (None, an index, or (left, right)) so that merging two slots is O(1); flattened at the end.
    heap: list[tuple[float, int, list]] = []
    counter = 0
    seed = [(ready[i], None, i) for i in range(num_slots)]
    heap.append((-(max(ready) - min(ready)), counter, seed))
    for job, length in enumerate(lengths):
        counter += 1
        part = [(float(length), job, -1)] + [(0.0, None, -1)] * (num_slots - 1)
        heap.append((-float(length), counter, part))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a.sort(key=lambda slot: slot[0])
        b.sort(key=lambda slot: -slot[0])
        merged = [(x[0] + y[0], _join(x[1], y[1]), max(x[2], y[2])) for x, y in zip(a, b)]
        counter += 1
        heapq.heappush(heap, (-_spread(merged), counter, merged))
    final = heap[0][2]
    slots: list[list[int]] = [[] for _ in range(num_slots)]
    loads = [0.0] * num_slots
    for load, jobs, slot_id in final:
        slots[slot_id] = sorted(_flatten(jobs))
        loads[slot_id] = load
    lower = makespan_lower_bound(lengths, num_slots, ready)
    return Partition(slots, loads, lower, max(loads) / lower if lower > 0 else 1.0, "kk")


def _spread(part: list[tuple]) -> float:
    loads = [slot[0] for slot in part]
    return max(loads) - min(loads)


def _join(left, right):
    if left is None:
        return right
    if right is None:
        return left
    return (left, right)


def _flatten(tree) -> list[int]:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if isinstance(node, tuple):
            stack.extend(node)
        else:
            out.append(node)
    return out


def check_jobs(lengths: Sequence[float], num_slots: int, ready: Sequence[float] | None) -> list[float]:
    """The ready times of ``num_slots`` slots (zeros when None), after checking the jobs and slots."""
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    if any(x < 0 for x in lengths):
        raise ValueError("job lengths must be non-negative")
    if ready is None:
        return [0.0] * num_slots
    if len(ready) != num_slots:
        raise ValueError(f"ready has {len(ready)} entries for {num_slots} slots")
    return [float(x) for x in ready]


def lpt_ratio_bound(makespan: float, lower: float, num_slots: int, ready: Sequence[float]) -> float:
    """Graham's 4/3 - 1/(3m) holds without ready times; with them only the a-posteriori ratio is proven."""
    posterior = makespan / lower if lower > 0 else 1.0
    if any(ready):
        return posterior
    return min(posterior, 4 / 3 - 1 / (3 * num_slots))
