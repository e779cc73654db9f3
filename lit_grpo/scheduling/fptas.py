"""The (1 + epsilon)-approximate global grouping (:func:`fptas_partition`): heuristics, a local search, then a
trimmed dynamic program, stopping as soon as a plan is certified within ``1 + epsilon`` of the lower bound."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from lit_grpo.scheduling.partition import (
    Partition,
    check_jobs,
    karmarkar_karp_partition,
    lpt_partition,
    lpt_ratio_bound,
    makespan_lower_bound,
    water_level,
)

#: The default epsilon of :func:`fptas_partition`: the plan's makespan is within 1% of the optimum it certifies.
DEFAULT_EPSILON = 0.01

#: Work budget of the DP stage of :func:`fptas_partition` (states x slots summed over jobs): ~0.1 s of Python.
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
       LPT; the better of LPT and Karmarkar-Karp; that one improved by a local search (moves and swaps off the
       fullest slot; up to LOCAL_SEARCH_MAX_JOBS jobs). Rollout-sized instances with several jobs per slot end
       here, in milliseconds.
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
       times). A plan for 4096 jobs on 16 slots is certified at step 1, well under a second.

    Args:
        lengths: job lengths ``[n]`` (predicted remaining tokens), non-negative.
        num_slots: m.
        ready: ``[m]`` ready times (default zeros).
        epsilon: the approximation parameter, > 0.
        dp_budget: the DP's work cap, see step 3.
    """
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon!r}")
    ready = check_jobs(lengths, num_slots, ready)
    lower = makespan_lower_bound(lengths, num_slots, ready)
    lpt_bound = lpt_ratio_bound(math.inf, lower, num_slots, ready)  # every candidate below is <= LPT
    best = lpt_partition(lengths, num_slots, ready)
    if _certified(best.makespan, lower, epsilon):
        return _finish(best, lower, 1 + epsilon)
    best = min(best, karmarkar_karp_partition(lengths, num_slots, ready), key=lambda part: part.makespan)
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
