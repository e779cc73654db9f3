"""Global grouping: assign jobs (predicted sample lengths) to slots so the largest slot load is small.

The problem is P||Cmax with optional machine ready times: slot ``i`` is busy until ``ready[i]`` (the remaining
work of the sample it is running), then runs its jobs back to back. The makespan of a partition is
``max_i (ready[i] + sum of its jobs)``; in a rollout it is the number of decode steps until the last slot drains.

Three algorithms, all returning a :class:`Partition` whose slot ``i`` is the slot with ``ready[i]``:

- :func:`lpt_partition`: Longest Processing Time first (Graham 1969): sort jobs descending, give each to the
  least-loaded slot. ``<= (4/3 - 1/(3m)) OPT`` without ready times.
- :func:`karmarkar_karp_partition`: multiway largest differencing (Karmarkar & Karp 1982): repeatedly merge the
  two partial partitions with the largest spread, the big slots of one with the small slots of the other.
  Often better than LPT with few jobs per slot; within 4/3 of the optimum without ready times (Michiels et al.,
  performance ratios of the differencing method).
- :func:`fptas_partition`: a (1 + epsilon)-approximation, see its docstring for the exact scheme.

Files: ``partition.py`` (the Partition, the lower bound, LPT, Karmarkar-Karp), ``fptas.py`` (the FPTAS); this one
chooses among them by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, get_args

from lit_grpo.runtime.validation import check_choice

from lit_grpo.scheduling.fptas import DEFAULT_EPSILON, fptas_partition
from lit_grpo.scheduling.partition import (
    Partition,
    karmarkar_karp_partition,
    lpt_partition,
    makespan_lower_bound,
)

__all__ = [
    "DEFAULT_EPSILON",
    "GROUPINGS",
    "GroupingName",
    "GroupingFn",
    "Partition",
    "fptas_partition",
    "karmarkar_karp_partition",
    "lpt_partition",
    "make_grouping",
    "makespan_lower_bound",
]

GroupingFn = Callable[..., Partition]
GroupingName = Literal["fptas", "lpt", "kk"]

GROUPINGS: dict[str, GroupingFn] = dict(zip(get_args(GroupingName),
                                            (fptas_partition, lpt_partition, karmarkar_karp_partition)))


def make_grouping(name: str | GroupingFn, epsilon: float = DEFAULT_EPSILON) -> GroupingFn:
    """A grouping function ``(lengths, num_slots, ready=None, epsilon=None) -> Partition`` from its name.

    ``epsilon`` (default: this one) reaches the FPTAS only; LPT and Karmarkar-Karp ignore it. A callable is
    returned as is and must accept the same arguments.
    """
    if callable(name):
        return name
    algorithm = GROUPINGS[check_choice("grouping", name, get_args(GroupingName))]
    default_epsilon = epsilon

    def grouping(lengths: Sequence[float], num_slots: int, ready: Sequence[float] | None = None,
                 epsilon: float | None = None) -> Partition:
        if algorithm is fptas_partition:
            return fptas_partition(lengths, num_slots, ready, epsilon=epsilon or default_epsilon)
        return algorithm(lengths, num_slots, ready)

    grouping.__name__ = f"{name}_grouping"
    return grouping
