"""Whether this process's threads wait for cores that other processes keep busy (or a CPU quota has spent), and
what to do about it.

Torch's intra-op threads meet at the end of every parallel op: where another process holds the core one of them
needs, the op waits for the scheduler to give it one, and a step of many small ops can take many times as long as
on one thread. Linux counts, for each thread, the time it ran and the time it was ready to run but waited for a core
(``/proc/self/task/<tid>/schedstat``): on an idle machine with no more threads than cores the wait is near zero,
on a busy one it is a large share of the threads' time. A merely slow CPU runs its threads without waiting, so the
share tells the two apart (measured in docs/benchmarks.md, "Threads").
"""

from __future__ import annotations

import dataclasses
import os

from lit_grpo.runtime.validation import core_share

#: The share of the threads' time spent waiting for a core from which a run of several torch threads is told to try
#: one: well above an idle machine's, and below the shares at which two threads were measured slower than one.
CORE_WAIT_SHARE = 0.2
#: The least thread time, running and waiting, in seconds, that a reading must cover to be judged: a shorter one
#: is a few scheduler ticks, whatever the machine's load.
MIN_THREAD_S = 1.0

_TASKS = "/proc/self/task"
#: What threads beyond a CPU quota's cores do.
_THROTTLED = "spend the quota's time early and wait, throttled, for its next period"


@dataclasses.dataclass(frozen=True)
class ThreadTimes:
    """The seconds each thread of the process (by its id) has run on a core and waited for one since it started."""

    running_s: dict[int, float]
    waiting_s: dict[int, float]

    def since(self, earlier: ThreadTimes) -> list[tuple[float, float]]:
        """Each thread's ``(running, waiting)`` seconds between ``earlier`` and this reading: a thread started in
        between counts whole, one that ended in between took its times with it."""
        return [(max(0.0, running - earlier.running_s.get(tid, 0.0)),
                 max(0.0, self.waiting_s[tid] - earlier.waiting_s.get(tid, 0.0)))
                for tid, running in self.running_s.items()]


def busiest_threads(per_thread: list[tuple[float, float]], count: int) -> tuple[float, float]:
    """The ``(running, waiting)`` seconds of the ``count`` threads that ran most, summed: torch's threads, not the
    helpers that wake now and then (a memory sampler, a reward loop), whose waits to be scheduled beside them would
    count as the cores' business."""
    busiest = sorted(per_thread, reverse=True)[:count]
    return sum(running for running, _ in busiest), sum(waiting for _, waiting in busiest)


def thread_times() -> ThreadTimes | None:
    """This process's threads' times from ``/proc/self/task/*/schedstat``; None where Linux does not keep them
    (another system, or a kernel without scheduler statistics)."""
    running, waiting = {}, {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/schedstat") as file:
                ran_ns, waited_ns = (int(field) for field in file.read().split()[:2])
        except (OSError, ValueError):  # a thread that ended meanwhile, or no statistics
            continue
        running[int(tid)], waiting[int(tid)] = ran_ns / 1e9, waited_ns / 1e9
    return ThreadTimes(running, waiting) if running else None


def core_wait_advice(running_s: float, waiting_s: float, torch_threads: int, cores: int,
                     quota_cpus: float | None = None, local_processes: int = 1) -> str:
    """What to do where torch's threads, ``running_s`` and ``waiting_s`` seconds between two readings, waited
    for a core at least ``CORE_WAIT_SHARE`` of their time with several torch threads: with more of them than the
    process's share of the ``cores`` the node's ``local_processes`` may use (all of them for one process; the
    share :func:`~lit_grpo.runtime.validation.core_share`, which the CLI's default thread count takes), a thread a
    core of the share (they wait for one another, the machine idle or not); else one thread, which waits for no
    other; ``""`` where they did not, where torch has one thread already (nothing to change) or where the reading
    covers less than ``MIN_THREAD_S``. ``quota_cpus``: the CPUs of the cgroup CPU quota, which the node's processes
    share (the ranks a run starts are in its cgroup), where they are fewer than the affinity's cores
    (``lit_grpo.runtime.validation.core_limit``). Once a period's quota is spent its threads wait, throttled, until
    the next, which Linux counts as waiting for a core: within the share, the part of their time a quota of a
    fraction of the cores leaves each process's threads throttled (1 - quota_cpus / local_processes / threads) is
    not judged."""
    total = running_s + waiting_s
    share = core_share(cores, local_processes)
    throttled = (max(0.0, 1 - quota_cpus / local_processes / torch_threads)
                 if quota_cpus is not None and torch_threads <= share else 0.0)
    if torch_threads <= 1 or total < MIN_THREAD_S or waiting_s - throttled * total < CORE_WAIT_SHARE * total:
        return ""
    waited = (f"torch's threads waited for a core {waiting_s / total:.0%} of their time with {torch_threads} torch "
              "threads")
    if local_processes > 1:
        granted = " their cgroup CPU quota grants" if quota_cpus is not None else ""
        shared = (f"{_cores(share)}, this process's share of the {_cores(cores)}{granted} among the "
                  f"{local_processes} processes on this node")
    if torch_threads > share:
        if local_processes > 1:
            beyond = _THROTTLED if quota_cpus is not None else "wait for one another and the other processes' threads"
            on = f"{shared}: threads beyond the share {beyond},"
        elif quota_cpus is not None:
            on = f"the {_cores(cores)} this process's cgroup CPU quota grants: threads beyond them {_THROTTLED},"
        else:
            on = f"{_cores(cores)}: threads beyond the cores wait for one another"
        return (f"{waited} on {on} and every parallel op waits for its slowest thread; try --torch_num_threads "
                f"{share} (or OMP_NUM_THREADS={share})")
    within = f" within {shared}" if local_processes > 1 else ""
    busy = "keep the cores busy or share the CPU quota" if quota_cpus is not None else "keep the cores busy"
    return (f"{waited}{within}: other processes {busy} and every parallel op waits for its slowest thread; "
            "try --torch_num_threads 1 (or OMP_NUM_THREADS=1)")


def _cores(count: int) -> str:
    return f"{count} {'core' if count == 1 else 'cores'}"
