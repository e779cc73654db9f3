"""Global grouping: assign jobs (predicted sample lengths) to lanes (slots) so the largest lane load is small.

The problem is P||Cmax with optional machine ready times: lane ``i`` is busy until ``ready[i]`` (the remaining
work of the sample it is running), then runs its jobs back to back. The makespan of a partition is
``max_i (ready[i] + sum of its jobs)``; in a rollout it is the number of decode steps until the last slot drains.

Three algorithms, all returning a :class:`Partition` whose lane ``i`` is the lane with ``ready[i]``:

- :func:`lpt_partition`: Longest Processing Time first (Graham 1969): sort jobs descending, give each to the
  least-loaded lane. ``<= (4/3 - 1/(3m)) OPT`` without ready times.
- :func:`karmarkar_karp_partition`: multiway largest differencing (Karmarkar & Karp 1982): repeatedly merge the
  two partial partitions with the largest spread, the big lanes of one with the small lanes of the other.
  Often better than LPT with few jobs per lane; within 4/3 of the optimum without ready times (Michiels et al.,
  performance ratios of the differencing method).
- :func:`fptas_partition`: a (1 + epsilon)-approximation, see its docstring for the exact scheme.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: The default epsilon of :func:`fptas_partition`: the plan's makespan is within 1% of the optimum it certifies.
DEFAULT_EPSILON = 0.01

#: Work budget of the DP stage of :func:`fptas_partition` (states x lanes summed over jobs): ~0.1 s of Python.
DEFAULT_DP_BUDGET = 50_000

#: Instances with more jobs than this skip the local search (its rounds cost O(n) each).
LOCAL_SEARCH_MAX_JOBS = 1024


@dataclass
class Partition:
    """Jobs split into lanes.

    Attributes:
        lanes: ``lanes[i]`` lists the job indices given to lane ``i`` (the lane whose ready time is ``ready[i]``).
        loads: ``loads[i] = ready[i] + sum of lane i's job lengths``.
        lower_bound: a lower bound on the optimal makespan (see :func:`makespan_lower_bound`).
        ratio_bound: a proven upper bound on ``makespan / OPT`` (``1 + epsilon`` when the FPTAS certified it).
        method: which construction produced the lanes ("lpt", "kk", "local", "dp").
    """

    lanes: list[list[int]]
    loads: list[float]
    lower_bound: float
    ratio_bound: float
    method: str

    @property
    def makespan(self) -> float:
        return max(self.loads) if self.loads else 0.0


def makespan_lower_bound(lengths: Sequence[float], num_lanes: int, ready: Sequence[float] | None = None) -> float:
    """A lower bound on the optimal makespan of ``lengths`` on ``num_lanes`` lanes with ready times.

    The largest of: the water level (spread all work over the lanes, each lane starting at its ready time, as
    if jobs could be split), the latest ready time, and the pigeonhole bounds on the ``j`` largest jobs (on
    ``j <= m`` distinct lanes one lane starts at the j-th smallest ready time or later; otherwise two of them
    share the earliest lane; ``m + 1`` jobs always put two on one lane). Rounded up when every input is an
    integer, because the makespan then is one.
    """
    ready_sorted = sorted(ready) if ready is not None else [0.0] * num_lanes
    jobs = sorted(lengths, reverse=True)
    bound = max(water_level(ready_sorted, sum(jobs)), ready_sorted[-1])
    for j, length in enumerate(jobs[:num_lanes]):
        bound = max(bound, min(ready_sorted[j] + length, ready_sorted[0] + 2 * length))
    if len(jobs) > num_lanes:
        bound = max(bound, ready_sorted[0] + jobs[num_lanes - 1] + jobs[num_lanes])
    if all(float(x).is_integer() for x in jobs) and all(float(x).is_integer() for x in ready_sorted):
        bound = math.ceil(bound - 1e-9)
    return float(bound)


def water_level(ready_sorted: Sequence[float], work: float) -> float:
    """The level ``T`` at which ``sum_i max(0, T - ready_sorted[i]) == work`` (ready times sorted ascending)."""
    filled = 0.0
    for i, level in enumerate(ready_sorted):
        # Lanes 0..i-1 are under water; raising them to this lane's ready time costs i * (level - previous).
        nxt = ready_sorted[i + 1] if i + 1 < len(ready_sorted) else math.inf
        capacity = (i + 1) * (nxt - level)
        if filled + capacity >= work:
            return level + (work - filled) / (i + 1)
        filled += capacity
    return ready_sorted[-1]  # unreachable: the last lane has infinite capacity


def lpt_partition(lengths: Sequence[float], num_lanes: int, ready: Sequence[float] | None = None) -> Partition:
    """Longest Processing Time first: jobs in descending order, each to the currently least-loaded lane.

    Ties break on the lower lane index, so the result is deterministic. ``O(n log n + n log m)``.
    """
    ready = _check(lengths, num_lanes, ready)
    loads = list(ready)
    lanes: list[list[int]] = [[] for _ in range(num_lanes)]
    heap = [(load, lane) for lane, load in enumerate(loads)]
    heapq.heapify(heap)
    for job in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        load, lane = heapq.heappop(heap)
        lanes[lane].append(job)
        loads[lane] = load + lengths[job]
        heapq.heappush(heap, (loads[lane], lane))
    lower = makespan_lower_bound(lengths, num_lanes, ready)
    return Partition(lanes, loads, lower, _lpt_ratio_bound(max(loads), lower, num_lanes, ready), "lpt")


def karmarkar_karp_partition(
    lengths: Sequence[float], num_lanes: int, ready: Sequence[float] | None = None
) -> Partition:
    """Multiway largest differencing method (Karmarkar-Karp generalized to m lanes, as in Korf's CKK).

    Every job starts as a partial partition ``(p, 0, ..., 0)`` and the ready times as one partial partition of
    their own. Repeatedly pop the two partial partitions with the largest spread (max - min lane), combine the
    largest lane of one with the smallest of the other (one sorted ascending, the other descending), and push
    the result back. The ready-time partition's lanes never merge with each other, so each final lane holds
    exactly one ready time and keeps its identity. ``O(n m log n)``.
    """
    ready = _check(lengths, num_lanes, ready)
    # A partial partition: list of m lanes, each (load, jobs, ready lane id or -1). Jobs are a tree of pairs
    # (None, an index, or (left, right)) so that merging two lanes is O(1); flattened at the end.
    heap: list[tuple[float, int, list]] = []
    counter = 0
    seed = [(ready[i], None, i) for i in range(num_lanes)]
    heap.append((-(max(ready) - min(ready)), counter, seed))
    for job, length in enumerate(lengths):
        counter += 1
        part = [(float(length), job, -1)] + [(0.0, None, -1)] * (num_lanes - 1)
        heap.append((-float(length), counter, part))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a.sort(key=lambda lane: lane[0])
        b.sort(key=lambda lane: -lane[0])
        merged = [(x[0] + y[0], _join(x[1], y[1]), max(x[2], y[2])) for x, y in zip(a, b)]
        counter += 1
        heapq.heappush(heap, (-_spread(merged), counter, merged))
    final = heap[0][2]
    lanes: list[list[int]] = [[] for _ in range(num_lanes)]
    loads = [0.0] * num_lanes
    for load, jobs, lane_id in final:
        lanes[lane_id] = sorted(_flatten(jobs))
        loads[lane_id] = load
    lower = makespan_lower_bound(lengths, num_lanes, ready)
    return Partition(lanes, loads, lower, max(loads) / lower if lower > 0 else 1.0, "kk")


def _spread(part: list[tuple]) -> float:
    loads = [lane[0] for lane in part]
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


def fptas_partition(
    lengths: Sequence[float],
    num_lanes: int,
    ready: Sequence[float] | None = None,
    epsilon: float = DEFAULT_EPSILON,
    dp_budget: int = DEFAULT_DP_BUDGET,
) -> Partition:
    """A (1 + epsilon)-approximation of the minimum makespan, certified or computed by a trimmed DP.

    Formulation: minimize ``max_i (ready[i] + sum_{j in lane i} p_j)`` over all assignments of the n jobs to the
    m lanes (P||Cmax, m fixed, with machine ready times).

    Scheme (Sahni 1976's rounding DP for a fixed number of machines, made fast by certificates):

    1. Cheap candidates, in order, each returned as soon as its makespan is ``<= (1 + epsilon) * LB`` with
       ``LB`` from :func:`makespan_lower_bound` (then it is certified within ``1 + epsilon`` of the optimum):
       LPT; the better of LPT and Karmarkar-Karp; that one improved by a local search (moves and swaps off the
       fullest lane; up to LOCAL_SEARCH_MAX_JOBS jobs). Rollout-sized instances with several jobs per lane end
       here, in milliseconds.
    2. Otherwise the DP: place jobs in descending order; a state is the sorted vector of lane loads; states
       whose loads fall in the same cell of a grid of width ``delta = epsilon * LB / n`` are merged (one kept).
       Merging moves each load by less than ``delta`` per job, so the state that tracks an optimal schedule ends
       within ``n * delta = epsilon * LB <= epsilon * OPT`` of it: the best final state is ``<= (1 + eps) OPT``.
       States whose lower bound (max load, water level of the remaining work) cannot beat the incumbent are
       pruned, which keeps the guarantee. The state space is polynomial in n / epsilon for fixed m, i.e. a
       fully polynomial-time approximation scheme for fixed m, but of degree m.
    3. Cap: the DP may expand at most ``dp_budget`` (state, lane) pairs in total. When the cap binds, each layer
       keeps its most promising states (a beam), the result is the best of the beam and the candidates, and
       ``ratio_bound`` falls back to what is proven: ``makespan / LB`` (and LPT's 4/3 when there are no ready
       times). A plan for 4096 jobs on 16 lanes is certified at step 1, well under a second.

    Args:
        lengths: job lengths ``[n]`` (predicted remaining tokens), non-negative.
        num_lanes: m.
        ready: ``[m]`` ready times (default zeros).
        epsilon: the approximation parameter, > 0.
        dp_budget: the DP's work cap, see step 3.
    """
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon!r}")
    ready = _check(lengths, num_lanes, ready)
    lower = makespan_lower_bound(lengths, num_lanes, ready)
    lpt_bound = _lpt_ratio_bound(math.inf, lower, num_lanes, ready)  # every candidate below is <= LPT
    best = lpt_partition(lengths, num_lanes, ready)
    if _certified(best.makespan, lower, epsilon):
        return _finish(best, lower, 1 + epsilon)
    best = min(best, karmarkar_karp_partition(lengths, num_lanes, ready), key=lambda part: part.makespan)
    if len(lengths) <= LOCAL_SEARCH_MAX_JOBS and not _certified(best.makespan, lower, epsilon):
        best = local_search(best, lengths, ready)
    if _certified(best.makespan, lower, epsilon):
        return _finish(best, lower, 1 + epsilon)
    lanes, complete = _trimmed_dp(lengths, num_lanes, ready, epsilon * max(lower, 1e-12) / max(len(lengths), 1),
                                  best.makespan, dp_budget)
    if lanes is not None:
        loads = [ready[i] + sum(lengths[j] for j in lanes[i]) for i in range(num_lanes)]
        if max(loads) < best.makespan:
            best = Partition(lanes, loads, lower, 0.0, "dp")
    if complete:
        return _finish(best, lower, 1 + epsilon)
    return _finish(best, lower, min(best.makespan / lower if lower > 0 else 1.0, lpt_bound))


def local_search(
    part: Partition, lengths: Sequence[float], ready: Sequence[float], max_rounds: int = 1000
) -> Partition:
    """Improve a partition by moving or swapping one job between the fullest lane and another.

    A move is taken when both lanes end strictly below the fullest lane's old load, so the sum of squared
    loads falls and the search ends. ``O(rounds * |fullest| * n)``.
    """
    lanes = [list(lane) for lane in part.lanes]
    loads = list(part.loads)
    for _ in range(max_rounds):
        top = max(range(len(loads)), key=lambda i: (loads[i], -i))
        if not _improve_once(top, lanes, loads, lengths):
            break
    method = part.method if loads == part.loads else "local"
    return Partition([sorted(lane) for lane in lanes], loads, part.lower_bound, part.ratio_bound, method)


def _improve_once(top: int, lanes: list[list[int]], loads: list[float], lengths: Sequence[float]) -> bool:
    """Apply the best move or swap that lowers lane ``top`` without raising another lane to its level."""
    best_gain, best_op = 0.0, None
    for other in range(len(lanes)):
        if other == top:
            continue
        gap = loads[top] - loads[other]
        for a_pos, a in enumerate(lanes[top]):
            # Move a: the pair's new max is max(loads[top] - p_a, loads[other] + p_a).
            if lengths[a] < gap:
                gain = loads[top] - max(loads[top] - lengths[a], loads[other] + lengths[a])
                if gain > best_gain:
                    best_gain, best_op = gain, (other, a_pos, None)
            for b_pos, b in enumerate(lanes[other]):
                delta = lengths[a] - lengths[b]
                if 0 < delta < gap:
                    gain = loads[top] - max(loads[top] - delta, loads[other] + delta)
                    if gain > best_gain:
                        best_gain, best_op = gain, (other, a_pos, b_pos)
    if best_op is None or best_gain <= 1e-12:
        return False
    other, a_pos, b_pos = best_op
    a = lanes[top].pop(a_pos)
    lanes[other].append(a)
    delta = lengths[a]
    if b_pos is not None:
        b = lanes[other].pop(b_pos)
        lanes[top].append(b)
        delta -= lengths[b]
    loads[top] -= delta
    loads[other] += delta
    return True


def _trimmed_dp(
    lengths: Sequence[float],
    num_lanes: int,
    ready: Sequence[float],
    delta: float,
    incumbent: float,
    budget: int,
) -> tuple[list[list[int]] | None, bool]:
    """Sahni's rounding DP over sorted lane-load vectors; returns (lanes or None, whether no cap was hit).

    A node is ``(loads, parent, position)``: ``loads`` is sorted ascending, and ``position`` is where in the
    parent's sorted vector the job went. Lane identities (which ready time) are recovered by replaying the path.
    """
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    remaining = [0.0] * (len(order) + 1)
    for i in range(len(order) - 1, -1, -1):
        remaining[i] = remaining[i + 1] + lengths[order[i]]
    root = (tuple(sorted(ready)), None, -1)
    layer = [root]
    complete = True
    # Each layer may expand at most this many states so that the whole DP stays within the budget.
    per_layer = max(1, budget // max(1, len(order) * num_lanes))
    for depth, job in enumerate(order):
        length = lengths[job]
        rest = remaining[depth + 1]
        cells: dict[tuple[int, ...], tuple] = {}
        scored: list[tuple[float, tuple[int, ...]]] = []
        for node in layer:
            loads = node[0]
            previous = None
            for pos in range(num_lanes):
                if loads[pos] == previous:  # lanes with equal loads are interchangeable
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
    """Turn a DP node's path back into lanes aligned with ``ready``.

    Replays the DP's float additions and its sorted insertion (after equal loads), so positions line up.
    """
    path = []
    while node[1] is not None:
        path.append(node[2])
        node = node[1]
    path.reverse()
    state = sorted(([float(ready[i]), i, []] for i in range(len(ready))), key=lambda lane: lane[0])
    for job, pos in zip(order, path):
        load, lane_id, jobs = state.pop(pos)
        load = load + lengths[job]
        at = bisect.bisect_right([lane[0] for lane in state], load)
        state.insert(at, [load, lane_id, jobs + [job]])
    lanes: list[list[int]] = [[] for _ in range(len(ready))]
    for _, lane_id, jobs in state:
        lanes[lane_id] = sorted(jobs)
    return lanes


def _sorted_replace(loads: tuple[float, ...], pos: int, value: float) -> tuple[float, ...]:
    """``loads`` (ascending) with ``loads[pos]`` raised to ``value``, still ascending."""
    out = list(loads[:pos]) + list(loads[pos + 1:])
    # value >= loads[pos], so it lands at or after pos; after equal loads, as _replay assumes.
    out.insert(bisect.bisect_right(out, value, lo=pos), value)
    return tuple(out)


def _check(lengths: Sequence[float], num_lanes: int, ready: Sequence[float] | None) -> list[float]:
    if num_lanes < 1:
        raise ValueError(f"num_lanes must be >= 1, got {num_lanes}")
    if any(x < 0 for x in lengths):
        raise ValueError("job lengths must be non-negative")
    if ready is None:
        return [0.0] * num_lanes
    if len(ready) != num_lanes:
        raise ValueError(f"ready has {len(ready)} entries for {num_lanes} lanes")
    return [float(x) for x in ready]


def _certified(makespan: float, lower: float, epsilon: float) -> bool:
    return makespan <= (1 + epsilon) * lower + 1e-9


def _lpt_ratio_bound(makespan: float, lower: float, num_lanes: int, ready: Sequence[float]) -> float:
    """Graham's 4/3 - 1/(3m) holds without ready times; with them only the a-posteriori ratio is proven."""
    posterior = makespan / lower if lower > 0 else 1.0
    if any(ready):
        return posterior
    return min(posterior, 4 / 3 - 1 / (3 * num_lanes))


def _finish(part: Partition, lower: float, ratio_bound: float) -> Partition:
    return Partition(part.lanes, part.loads, lower, ratio_bound, part.method)


GroupingFn = Callable[..., Partition]

GROUPINGS: dict[str, GroupingFn] = {
    "fptas": fptas_partition,
    "lpt": lpt_partition,
    "kk": karmarkar_karp_partition,
    "karmarkar_karp": karmarkar_karp_partition,
}


def make_grouping(name: str | GroupingFn, epsilon: float = DEFAULT_EPSILON) -> GroupingFn:
    """A grouping function ``(lengths, num_lanes, ready=None, epsilon=None) -> Partition`` from its name.

    ``epsilon`` (default: this one) reaches the FPTAS only; LPT and Karmarkar-Karp ignore it. A callable is
    returned as is and must accept the same arguments.
    """
    if callable(name):
        return name
    if name not in GROUPINGS:
        raise ValueError(f"unknown grouping {name!r}; allowed: {', '.join(sorted(GROUPINGS))}")
    algorithm = GROUPINGS[name]
    default_epsilon = epsilon

    def grouping(lengths: Sequence[float], num_lanes: int, ready: Sequence[float] | None = None,
                 epsilon: float | None = None) -> Partition:
        if algorithm is fptas_partition:
            return fptas_partition(lengths, num_lanes, ready, epsilon=epsilon or default_epsilon)
        return algorithm(lengths, num_lanes, ready)

    grouping.__name__ = f"{name}_grouping"
    return grouping
