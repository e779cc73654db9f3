"""Global grouping of the length-aware scheduler: predicted remaining lengths partitioned over the slots.

The problem is P||Cmax with machine ready times: slot ``i`` is busy until ``ready[i]`` (the remaining work of the
sample it runs), then runs its jobs back to back; a partition's makespan ``max_i (ready[i] + sum of its jobs)`` is
the decode steps until the last slot drains. :func:`fptas_partition` (the paper's global grouping) returns a plan
within ``1 + epsilon`` of the optimum: LPT (Graham 1969: longest job to the least-loaded slot), a local search,
then Sahni's trimmed dynamic program, stopping as soon as a plan is certified against
:func:`makespan_lower_bound`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lit_grpo.runtime.validation import shown_value


@dataclass
class Partition:
    """Jobs split into slots.

    Attributes:
        slots: ``slots[i]`` lists the job indices given to slot ``i`` (the slot whose ready time is ``ready[i]``).
        loads: ``loads[i] = ready[i] + sum of slot i's job lengths``.
        lower_bound: a lower bound on the optimal makespan (see :func:`makespan_lower_bound`).
        ratio_bound: a proven upper bound on ``makespan / OPT`` (``1 + epsilon`` when the FPTAS certified it).
        method: which construction produced the slots ("lpt", "local", "dp").
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


#: The default epsilon of :func:`fptas_partition`: the plan's makespan is within 1% of the optimum it certifies.
DEFAULT_EPSILON = 0.01

#: Work budget of the DP stage of :func:`fptas_partition` (states x slots summed over jobs).
DEFAULT_DP_BUDGET = 50_000

#: Instances with more jobs than this skip the local search (its rounds cost O(n) each).
LOCAL_SEARCH_MAX_JOBS = 1024


def fptas_partition(
    lengths: Sequence[float],
    num_slots: int,
    ready: Sequence[float] | None = None,
    epsilon: float = DEFAULT_EPSILON,
    dp_budget: int = DEFAULT_DP_BUDGET,
) -> Partition:
    """A (1 + epsilon)-approximation of the minimum makespan, certified or computed by a trimmed DP.

    Formulation: minimize ``max_i (ready[i] + sum_{j in slot i} p_j)`` over all assignments of the n jobs to the
    m slots (P||Cmax, m fixed, with machine ready times).

    Scheme (Sahni 1976's rounding DP for a fixed number of machines, made fast by certificates):

    1. Cheap candidates, in order, each returned as soon as its makespan is ``<= (1 + epsilon) * LB`` with
       ``LB`` from :func:`makespan_lower_bound` (then it is certified within ``1 + epsilon`` of the optimum):
       LPT; LPT improved by a local search (moves and swaps off the
       fullest slot; up to LOCAL_SEARCH_MAX_JOBS jobs). Rollout-sized instances with several jobs per slot end
       here.
    2. Otherwise the DP: place jobs in descending order; a state is the sorted vector of slot loads; states
       whose loads fall in the same cell of a grid of width ``delta = epsilon * LB / n`` are merged (one kept).
       Merging moves each load by less than ``delta`` per job, so the state that tracks an optimal schedule ends
       within ``n * delta = epsilon * LB <= epsilon * OPT`` of it: the best final state is ``<= (1 + eps) OPT``.
       States whose lower bound (max load, water level of the remaining work) cannot beat the incumbent are
       pruned, which keeps the guarantee. The state space is polynomial in n / epsilon for fixed m, i.e. a
       fully polynomial-time approximation scheme for fixed m, but of degree m.
    3. Cap: the DP may expand at most ``dp_budget`` (state, slot) pairs in total. When the cap binds, each layer
       keeps its most promising states (a beam), the result is the best of the beam and the candidates, and
       ``ratio_bound`` falls back to what is proven: ``makespan / LB`` (and LPT's 4/3 when there are no ready
       times). Large instances (thousands of jobs on a few slots) are certified at step 1.

    Args:
        lengths: job lengths ``[n]`` (predicted remaining tokens), non-negative.
        num_slots: m.
        ready: ``[m]`` ready times (default zeros).
        epsilon: the approximation parameter, > 0.
        dp_budget: the DP's work cap, see step 3.
    """
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {shown_value(epsilon)}")
    ready = check_jobs(lengths, num_slots, ready)
    lower = makespan_lower_bound(lengths, num_slots, ready)
    lpt_bound = lpt_ratio_bound(math.inf, lower, num_slots, ready)  # every candidate below is <= LPT
    best = lpt_partition(lengths, num_slots, ready)
    if _certified(best.makespan, lower, epsilon):
        return _finish(best, lower, 1 + epsilon)
    if len(lengths) <= LOCAL_SEARCH_MAX_JOBS and not _certified(best.makespan, lower, epsilon):
        best = local_search(best, lengths, ready)
    if _certified(best.makespan, lower, epsilon):
        return _finish(best, lower, 1 + epsilon)
    slots, complete = _trimmed_dp(lengths, num_slots, ready, epsilon * max(lower, 1e-12) / max(len(lengths), 1),
                                  best.makespan, dp_budget)
    if slots is not None:
        loads = [ready[i] + sum(lengths[j] for j in slots[i]) for i in range(num_slots)]
        if max(loads) < best.makespan:
            best = Partition(slots, loads, lower, 0.0, "dp")
    if complete:
        return _finish(best, lower, 1 + epsilon)
    return _finish(best, lower, min(best.makespan / lower if lower > 0 else 1.0, lpt_bound))


def local_search(
    part: Partition, lengths: Sequence[float], ready: Sequence[float], max_rounds: int = 1000
) -> Partition:
    """Improve a partition by moving or swapping one job between the fullest slot and another.

    A move is taken when both slots end strictly below the fullest slot's old load, so the sum of squared
    loads falls and the search ends. ``O(rounds * |fullest| * n)``.
    """
    slots = [list(slot) for slot in part.slots]
    loads = list(part.loads)
    for _ in range(max_rounds):
        top = max(range(len(loads)), key=lambda i: (loads[i], -i))
        if not _improve_once(top, slots, loads, lengths):
            break
    method = part.method if loads == part.loads else "local"
    return Partition([sorted(slot) for slot in slots], loads, part.lower_bound, part.ratio_bound, method)


def _improve_once(top: int, slots: list[list[int]], loads: list[float], lengths: Sequence[float]) -> bool:
    """Apply the best move or swap that lowers slot ``top`` without raising another slot to its level."""
    best_gain, best_op = 0.0, None
    for other in range(len(slots)):
        if other == top:
            continue
        gap = loads[top] - loads[other]
        for a_pos, a in enumerate(slots[top]):
            # Move a: the pair's new max is max(loads[top] - p_a, loads[other] + p_a).
            if lengths[a] < gap:
                gain = loads[top] - max(loads[top] - lengths[a], loads[other] + lengths[a])
                if gain > best_gain:
                    best_gain, best_op = gain, (other, a_pos, None)
            for b_pos, b in enumerate(slots[other]):
                delta = lengths[a] - lengths[b]
                if 0 < delta < gap:
                    gain = loads[top] - max(loads[top] - delta, loads[other] + delta)
                    if gain > best_gain:
                        best_gain, best_op = gain, (other, a_pos, b_pos)
    if best_op is None or best_gain <= 1e-12:
        return False
    other, a_pos, b_pos = best_op
    a = slots[top].pop(a_pos)
    slots[other].append(a)
    delta = lengths[a]
    if b_pos is not None:
        b = slots[other].pop(b_pos)
        slots[top].append(b)
        delta -= lengths[b]
    loads[top] -= delta
    loads[other] += delta
    return True


def _trimmed_dp(
    lengths: Sequence[float],
    num_slots: int,
    ready: Sequence[float],
    delta: float,
    incumbent: float,
    budget: int,
) -> tuple[list[list[int]] | None, bool]:
    """Sahni's rounding DP over sorted slot-load vectors; returns (slots or None, whether no cap was hit).

    A node is ``(loads, parent, position)``: ``loads`` is sorted ascending, and ``position`` is where in the
    parent's sorted vector the job went. Slot identities (which ready time) are recovered by replaying the path.
    """
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    remaining = [0.0] * (len(order) + 1)
    for i in range(len(order) - 1, -1, -1):
        remaining[i] = remaining[i + 1] + lengths[order[i]]
    root = (tuple(sorted(ready)), None, -1)
    layer = [root]
    complete = True
    # Each layer may expand at most this many states so that the whole DP stays within the budget.
    per_layer = max(1, budget // max(1, len(order) * num_slots))
    for depth, job in enumerate(order):
        length = lengths[job]
        rest = remaining[depth + 1]
        cells: dict[tuple[int, ...], tuple] = {}
        scored: list[tuple[float, tuple[int, ...]]] = []
        for node in layer:
            loads = node[0]
            previous = None
            for pos in range(num_slots):
                if loads[pos] == previous:  # slots with equal loads are interchangeable
                    continue
                previous = loads[pos]
                new_load = loads[pos] + length
                if new_load >= incumbent:
                    continue
                child = _sorted_replace(loads, pos, new_load)
                bound = max(child[-1], water_level(child, rest))
                if bound >= incumbent:
                    continue
                key = tuple(int(x / delta) for x in child)
                if key not in cells:
                    cells[key] = (child, node, pos)
                    scored.append((bound, key))
        if not cells:
            return None, complete  # nothing can beat the incumbent: it is within the bound
        if len(cells) > per_layer:
            complete = False
            scored.sort()
            layer = [cells[key] for _, key in scored[:per_layer]]
        else:
            layer = list(cells.values())
    best = min(layer, key=lambda node: node[0][-1])
    return _replay(best, order, lengths, ready), complete


def _replay(node: tuple, order: list[int], lengths: Sequence[float], ready: Sequence[float]) -> list[list[int]]:
    """Turn a DP node's path back into slots aligned with ``ready``.

    Replays the DP's float additions and its sorted insertion (after equal loads), so positions line up.
    """
    path = []
    while node[1] is not None:
        path.append(node[2])
        node = node[1]
    path.reverse()
    state = sorted(([float(ready[i]), i, []] for i in range(len(ready))), key=lambda slot: slot[0])
    for job, pos in zip(order, path):
        load, slot_id, jobs = state.pop(pos)
        load = load + lengths[job]
        at = bisect.bisect_right([slot[0] for slot in state], load)
        state.insert(at, [load, slot_id, jobs + [job]])
    slots: list[list[int]] = [[] for _ in range(len(ready))]
    for _, slot_id, jobs in state:
        slots[slot_id] = sorted(jobs)
    return slots


def _sorted_replace(loads: tuple[float, ...], pos: int, value: float) -> tuple[float, ...]:
    """``loads`` (ascending) with ``loads[pos]`` raised to ``value``, still ascending."""
    out = list(loads[:pos]) + list(loads[pos + 1:])
    # value >= loads[pos], so it lands at or after pos; after equal loads, as _replay assumes.
    out.insert(bisect.bisect_right(out, value, lo=pos), value)
    return tuple(out)


def _certified(makespan: float, lower: float, epsilon: float) -> bool:
    return makespan <= (1 + epsilon) * lower + 1e-9


def _finish(part: Partition, lower: float, ratio_bound: float) -> Partition:
    return Partition(part.slots, part.loads, lower, ratio_bound, part.method)


def check_jobs(lengths: Sequence[float], num_slots: int, ready: Sequence[float] | None) -> list[float]:
    """The ready times of ``num_slots`` slots (zeros when None), after checking the jobs and slots."""
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    # NaN passes a `< 0` test and then fails deep in the DP's grid (or inf makes every plan "optimal").
    bad = [x for x in lengths if not 0 <= float(x) < math.inf]
    if bad:
        raise ValueError(f"job lengths must be finite and non-negative, got {bad[:4]}")
    if ready is None:
        return [0.0] * num_slots
    if len(ready) != num_slots:
        raise ValueError(f"ready has {len(ready)} entries for {num_slots} slots")
    bad = [x for x in ready if not 0 <= float(x) < math.inf]
    if bad:
        raise ValueError(f"ready times must be finite and non-negative, got {bad[:4]}")
    return [float(x) for x in ready]


def lpt_ratio_bound(makespan: float, lower: float, num_slots: int, ready: Sequence[float]) -> float:
    """Graham's 4/3 - 1/(3m) holds without ready times; with them only the a-posteriori ratio is proven."""
    posterior = makespan / lower if lower > 0 else 1.0
    if any(ready):
        return posterior
    return min(posterior, 4 / 3 - 1 / (3 * num_slots))
