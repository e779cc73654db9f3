"""Whether the process's threads wait for busy cores (lit_grpo.runtime.threads): the rule on given readings."""

from __future__ import annotations

import sys

import pytest

from lit_grpo.runtime.threads import (CORE_WAIT_SHARE, ThreadTimes, busiest_threads, core_wait_advice,
                                      thread_times)


def test_several_threads_that_waited_for_busy_cores_are_told_to_try_one():
    advice = core_wait_advice(running_s=36.0, waiting_s=64.0, torch_threads=2, cores=8)
    assert advice.startswith("torch's threads waited for a core 64% of their time with 2 torch threads")
    assert "other processes" in advice and advice.endswith("try --torch_num_threads 1 (or OMP_NUM_THREADS=1)")
    # from the share on, whatever the thread count
    assert core_wait_advice(running_s=1 - CORE_WAIT_SHARE, waiting_s=CORE_WAIT_SHARE, torch_threads=16, cores=16)


def test_more_threads_than_cores_are_told_to_take_one_a_core():
    """Torch's own threads beyond the cores wait for one another on an idle machine: no other process is to blame,
    and a thread a core waits for none."""
    advice = core_wait_advice(running_s=64.0, waiting_s=36.0, torch_threads=4, cores=2)
    assert advice.startswith("torch's threads waited for a core 36% of their time with 4 torch threads on 2 cores")
    assert "other processes" not in advice and advice.endswith("try --torch_num_threads 2 (or OMP_NUM_THREADS=2)")


def test_more_threads_than_a_cpu_quotas_cores_are_told_it_is_the_quota():
    """In a 4-CPU container on a big host the threads have idle cores to run on, but the quota's time runs out:
    they wait throttled (which schedstat counts as waiting), not for one another's cores."""
    advice = core_wait_advice(running_s=30.0, waiting_s=70.0, torch_threads=64, cores=4, quota_cpus=4.0)
    assert advice.startswith("torch's threads waited for a core 70% of their time with 64 torch threads on the 4 "
                             "cores this process's cgroup CPU quota grants")
    assert "other processes" not in advice and advice.endswith("try --torch_num_threads 4 (or OMP_NUM_THREADS=4)")
    # within the quota's cores: whatever else uses the quota's time or the cores keeps them waiting
    advice = core_wait_advice(running_s=30.0, waiting_s=70.0, torch_threads=4, cores=4, quota_cpus=4.0)
    assert "other processes keep the cores busy or share the CPU quota" in advice
    assert advice.endswith("try --torch_num_threads 1 (or OMP_NUM_THREADS=1)")


@pytest.mark.parametrize("running_s, waiting_s, torch_threads", [
    (99.0, 1.0, 2),     # an idle machine: the threads hardly wait
    (85.0, 15.0, 2),    # below the share
    (30.0, 70.0, 1),    # one thread: a busy machine, but nothing to change
    (0.3, 0.6, 2),      # too short a reading to judge
    (0.0, 0.0, 2),
])
def test_no_advice_where_the_threads_did_not_wait_or_nothing_would_change(running_s, waiting_s, torch_threads):
    assert core_wait_advice(running_s, waiting_s, torch_threads, cores=1) == ""


def test_the_times_between_readings_count_every_thread_alive_at_the_second():
    earlier = ThreadTimes(running_s={1: 10.0, 2: 5.0, 3: 1.0}, waiting_s={1: 1.0, 2: 0.5, 3: 7.0})
    later = ThreadTimes(running_s={1: 12.0, 2: 6.0, 4: 0.5}, waiting_s={1: 4.0, 2: 0.5, 4: 0.25})
    # thread 3 ended (its times went with it), thread 4 started (counted whole)
    assert sorted(later.since(earlier)) == pytest.approx([(0.5, 0.25), (1.0, 0.0), (2.0, 3.0)])


def test_torchs_threads_are_those_that_ran_most():
    # two torch threads, and a sampler that ran little and waited long to be scheduled beside them
    per_thread = [(9.0, 1.0), (0.2, 3.0), (8.0, 2.0)]
    assert busiest_threads(per_thread, 2) == pytest.approx((17.0, 3.0))
    assert busiest_threads(per_thread, 8) == pytest.approx((17.2, 6.0))  # fewer threads than torch's count: all


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux keeps the threads' scheduler statistics")
def test_this_process_is_read_thread_by_thread():
    before = thread_times()
    assert before is not None and before.running_s and before.running_s.keys() == before.waiting_s.keys()
    total = 0
    for i in range(2_000_000):  # some CPU time on this thread
        total += i
    running, waiting = busiest_threads(thread_times().since(before), 1)
    assert running > 0 and waiting >= 0


def test_a_thread_that_ended_or_whose_statistics_are_unreadable_is_left_out(tmp_path, monkeypatch):
    import lit_grpo.runtime.threads as threads

    for tid, schedstat in (("11", "2000000000 500000000 7\n"), ("12", None), ("13", "n/a\n"), ("14", "x y 1\n")):
        (tmp_path / tid).mkdir()
        if schedstat is not None:  # 12 ended between the listing and the reading
            (tmp_path / tid / "schedstat").write_text(schedstat)
    monkeypatch.setattr(threads, "_TASKS", str(tmp_path))
    assert thread_times() == ThreadTimes(running_s={11: 2.0}, waiting_s={11: 0.5})


def test_the_share_a_fractional_quota_throttles_its_threads_is_not_judged():
    """Under a quota of 1.5 CPUs its 2 threads are throttled a quarter of each period with nothing else running
    (measured: as fast as one thread, docs/benchmarks.md "Threads"): no advice; a wait beyond that share is advised,
    and 2 threads under 1 CPU, beyond the quota's one core, are told to take one."""
    assert core_wait_advice(running_s=76.5, waiting_s=23.5, torch_threads=2, cores=2, quota_cpus=1.5) == ""
    assert "other processes keep the cores busy or share the CPU quota" in core_wait_advice(
        running_s=50.0, waiting_s=50.0, torch_threads=2, cores=2, quota_cpus=1.5)
    assert core_wait_advice(running_s=50.5, waiting_s=49.5, torch_threads=2, cores=1, quota_cpus=1.0).endswith(
        "try --torch_num_threads 1 (or OMP_NUM_THREADS=1)")


def test_several_ranks_on_a_node_are_judged_by_their_share_of_the_cores():
    """2 ranks of 8 threads each on 8 cores run 16 threads, which wait for one another on an idle machine too: rank 0
    is told to take a thread a core of its share (as the CLI's default divides the cores), not to blame others."""
    advice = core_wait_advice(running_s=64.0, waiting_s=36.0, torch_threads=8, cores=8, local_processes=2)
    assert advice.startswith("torch's threads waited for a core 36% of their time with 8 torch threads on 4 cores, "
                             "this process's share of the 8 cores among the 2 processes on this node: threads beyond "
                             "the share wait for one another and the other processes' threads")
    assert "other processes keep" not in advice and advice.endswith("try --torch_num_threads 4 (or OMP_NUM_THREADS=4)")
    # within its share: whatever else runs keeps the cores busy
    advice = core_wait_advice(running_s=64.0, waiting_s=36.0, torch_threads=4, cores=8, local_processes=2)
    assert ("with 4 torch threads within 4 cores, this process's share of the 8 cores among the 2 processes on this "
            "node: other processes keep the cores busy") in advice
    assert advice.endswith("try --torch_num_threads 1 (or OMP_NUM_THREADS=1)")
    # more processes than cores: a share of one core
    assert core_wait_advice(running_s=64.0, waiting_s=36.0, torch_threads=2, cores=2, local_processes=4).endswith(
        "try --torch_num_threads 1 (or OMP_NUM_THREADS=1)")


def test_several_ranks_share_a_cpu_quota():
    """The ranks a run starts are in its cgroup: 2 ranks of 2 threads under a quota of 3.5 CPUs are throttled an
    eighth of each period with nothing else running, which is not judged; 4 threads each, beyond their share of
    the quota's 4 cores, are told to take 2."""
    assert core_wait_advice(running_s=70.0, waiting_s=30.0, torch_threads=2, cores=4, quota_cpus=3.5,
                            local_processes=2) == ""
    advice = core_wait_advice(running_s=50.0, waiting_s=50.0, torch_threads=4, cores=4, quota_cpus=3.5,
                              local_processes=2)
    assert advice.startswith("torch's threads waited for a core 50% of their time with 4 torch threads on 2 cores, "
                             "this process's share of the 4 cores their cgroup CPU quota grants among the 2 processes "
                             "on this node: threads beyond the share spend the quota's time early and wait, throttled,")
    assert advice.endswith("try --torch_num_threads 2 (or OMP_NUM_THREADS=2)")
