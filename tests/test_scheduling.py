"""Pure scheduling parts: grouping bounds, refill orders, length predictors, factories."""

from __future__ import annotations

import itertools
import math
import random
import re
from typing import get_args

import pytest
import torch

from lit_grpo.scheduling import (
    FIFOScheduler,
    HistoryLengthPredictor,
    InfiniteScheduler,
    SlotPlanner,
    OnlineLengthPredictor,
    OracleLengthPredictor,
    RolloutWork,
    RoundScheduler,
    Scheduler,
    fptas_partition,
    karmarkar_karp_partition,
    kendall_tau,
    lpt_partition,
    make_grouping,
    make_predictor,
    make_refill,
    makespan_lower_bound,
    planted_rollout,
    simulate_rollout,
    smape,
)
from lit_grpo.scheduling import fptas as grouping_module  # the FPTAS and its local search live in fptas.py
from lit_grpo.scheduling.config import InfiniteSchedulerConfig
from lit_grpo.scheduling.grouping import GROUPINGS, GroupingName
from lit_grpo.scheduling.predictors import LengthPredictor, PredictorName, expected_length
from lit_grpo.scheduling.refill import REFILLS, RefillName
from scheduler_helpers import trust_predictions


def brute_force_makespan(lengths, num_slots, ready=None):
    ready = list(ready) if ready is not None else [0] * num_slots
    best = math.inf
    for assignment in itertools.product(range(num_slots), repeat=len(lengths)):
        loads = list(ready)
        for job, slot in enumerate(assignment):
            loads[slot] += lengths[job]
        best = min(best, max(loads))
    return best


def check_partition(part, lengths, num_slots, ready=None):
    ready = ready or [0] * num_slots
    assert sorted(j for slot in part.slots for j in slot) == list(range(len(lengths)))
    loads = [ready[i] + sum(lengths[j] for j in part.slots[i]) for i in range(num_slots)]
    assert loads == pytest.approx(part.loads)


def small_instances(count, seed=0):
    rng = random.Random(seed)
    for index in range(count):
        num_slots = rng.randint(2, 3)
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 8))]
        ready = [rng.randint(0, 40) for _ in range(num_slots)] if index % 2 else None
        yield lengths, num_slots, ready


# ---- grouping --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon", [0.01, 0.1])
def test_fptas_within_epsilon_of_brute_force(epsilon):
    for lengths, num_slots, ready in small_instances(120):
        optimum = brute_force_makespan(lengths, num_slots, ready)
        part = fptas_partition(lengths, num_slots, ready, epsilon=epsilon)
        check_partition(part, lengths, num_slots, ready)
        assert part.lower_bound <= optimum + 1e-9
        assert part.makespan <= (1 + epsilon) * optimum + 1e-9
        assert part.ratio_bound == pytest.approx(1 + epsilon)  # small instances: certified or DP completed


def test_fptas_dp_fixes_lpt_worst_cases(monkeypatch):
    # Graham's tight LPT examples: 2m + 1 jobs, LPT = (4/3 - 1/(3m)) OPT.
    cases = [([3, 3, 2, 2, 2], 2, 6), ([5, 5, 4, 4, 3, 3, 3], 3, 9)]
    # Without the local search the DP stage has to find the optimum itself.
    monkeypatch.setattr(grouping_module, "local_search", lambda part, lengths, ready: part)
    for lengths, num_slots, optimum in cases:
        assert lpt_partition(lengths, num_slots).makespan == pytest.approx(optimum * (4 / 3 - 1 / (3 * num_slots)))
        part = fptas_partition(lengths, num_slots, epsilon=0.01)
        assert part.makespan == optimum
        assert part.method == "dp"


def test_lpt_within_graham_bound():
    for lengths, num_slots, _ in small_instances(150, seed=1):
        optimum = brute_force_makespan(lengths, num_slots)
        part = lpt_partition(lengths, num_slots)
        check_partition(part, lengths, num_slots)
        assert part.makespan <= (4 / 3 - 1 / (3 * num_slots)) * optimum + 1e-9
        assert part.ratio_bound <= 4 / 3


def test_karmarkar_karp_sane():
    for lengths, num_slots, ready in small_instances(150, seed=2):
        optimum = brute_force_makespan(lengths, num_slots, ready)
        part = karmarkar_karp_partition(lengths, num_slots, ready)
        check_partition(part, lengths, num_slots, ready)
        if ready is None:  # Michiels et al.: multiway differencing <= 4/3 - 1/(3(m-1)) OPT
            assert part.makespan <= 4 / 3 * optimum + 1e-9
    # Two-way differencing on the textbook instance: 8-7, 6-5, 4-1-1, 3-1 -> difference 2.
    assert sorted(karmarkar_karp_partition([8, 7, 6, 5, 4], 2).loads) == [14, 16]


def test_ready_times_keep_slot_identity():
    part = fptas_partition([10, 10, 10], 3, ready=[100, 0, 5])
    check_partition(part, [10, 10, 10], 3, [100, 0, 5])
    assert part.slots[0] == []  # the busy slot gets nothing
    assert part.makespan == 100


def test_lower_bound_parts():
    assert makespan_lower_bound([5, 5, 5], 2) == 10  # pigeonhole: two of three share a slot
    assert makespan_lower_bound([9, 1, 1], 3) == 9
    assert makespan_lower_bound([3, 3], 2, ready=[0, 10]) == 10  # latest ready time
    assert makespan_lower_bound([7, 1], 2, ready=[0, 4]) == 7


def test_large_plan_is_certified():
    # The planning-time figure (4096 samples, 16 slots) is benchmarked, not timed here.
    rng = random.Random(3)
    lengths = [min(1024, max(1, int(math.exp(rng.gauss(5.5, 0.8))))) for _ in range(4096)]
    part = fptas_partition(lengths, 16)
    check_partition(part, lengths, 16)
    assert part.ratio_bound == pytest.approx(1.01)


def test_bad_grouping_name():
    with pytest.raises(ValueError, match=r"'bogus'.*fptas.*lpt"):
        make_grouping("bogus")
    with pytest.raises(ValueError, match="epsilon"):
        fptas_partition([1, 2], 2, epsilon=0)


# ---- refill ----------------------------------------------------------------------------------------------------


def test_refill_policy_orders():
    candidates = [(5.0, 0), (1.0, 1), (9.0, 2), (5.0, 3)]
    assert make_refill("sjf").order(candidates) == [1, 0, 3, 2]
    assert make_refill("lpt").order(candidates) == [2, 0, 3, 1]
    assert make_refill("fifo").order(candidates) == [0, 1, 2, 3]
    assert make_refill("lpt").pick(candidates) == 2
    with pytest.raises(ValueError, match=r"refill='shortest' is not known.*lpt.*sjf.*fifo"):
        make_refill("shortest")


def test_planner_follows_plan_and_replans_on_deviation():
    planner = SlotPlanner(make_refill("sjf"), make_grouping("fptas"), num_slots=2)
    for rank, length in enumerate([6, 3, 3, 2, 2, 2]):
        planner.add(("job", rank), length, rank)
    first = [planner.choose(slot, 0, [0.0, 0.0]) for slot in range(2)]
    assert planner.stats.replans == 1
    # Plan: {6, 3, 0..} | {3, 2, 2, 2}? Either way slots balance at 9 and SJF starts each slot's shortest job.
    assert planner.plan_makespan == 9
    shortest = {("job", 3), ("job", 4), ("job", 5), ("job", 1), ("job", 2)}
    assert set(first) <= shortest
    # Slot 0 comes back on time: no re-plan. Far off the plan: re-plan.
    on_time = planner.expected_end[0]
    planner.choose(0, on_time, [0.0, 1.0])
    assert planner.stats.replans == 1
    planner.choose(1, planner.expected_end[1] + 50, [3.0, 0.0])
    assert planner.stats.replans == 2


def test_planner_slack_starts_the_longest_job():
    def exact_grouping(lengths, num_slots, ready=None, epsilon=None):
        return fptas_partition(lengths, num_slots, ready, epsilon=0.01)  # ignores the slack-derived epsilon

    def planner_with_jobs():
        planner = SlotPlanner(make_refill("sjf"), exact_grouping, num_slots=2)
        for rank, length in enumerate([10, 6, 6]):
            planner.add(rank, length, rank)
        return planner

    # Slot 1 is busy for 2 more steps. The optimal plan (makespan 12) runs 6 + 6 here and defers the long job to
    # slot 1; starting it here instead costs 14 / 12 - 1 = 17% of the plan.
    exact = planner_with_jobs()
    assert exact.choose(0, 0, [0.0, 2.0], slack=0.0) == 1
    assert exact.plan_makespan == 12
    tight = planner_with_jobs()
    assert tight.choose(0, 0, [0.0, 2.0], slack=0.1) == 1
    assert tight.stats.forced == 0
    loose = planner_with_jobs()
    assert loose.choose(0, 0, [0.0, 2.0], slack=0.5) == 0
    assert loose.stats.forced == 1
    assert loose.plan_makespan == 14
    # With the default grouping the slack also coarsens the plan (epsilon = slack): LPT, which starts it anyway.
    coarse = SlotPlanner(make_refill("sjf"), make_grouping("fptas"), num_slots=2)
    for rank, length in enumerate([10, 6, 6]):
        coarse.add(rank, length, rank)
    assert coarse.choose(0, 0, [0.0, 2.0], slack=0.5) == 0


# ---- predictors ------------------------------------------------------------------------------------------------


def feed(predictor, rollout, prompt_ids=None, max_new_tokens=1024):
    num_prompts, group_size = len(rollout.lengths), len(rollout.lengths[0])
    work = RolloutWork([4] * num_prompts, group_size, 8, max_new_tokens, rollout.prompt_features,
                       prompt_ids or [[p] for p in range(num_prompts)])
    keys = work.keys()
    features = torch.stack([rollout.token_feature(key, 16) for key in keys])
    lengths = [rollout.lengths[p][k] for p, k in keys]
    return work, keys, features, lengths


def test_online_predictor_learns_planted_signal():
    generator = torch.Generator().manual_seed(0)
    directions = torch.nn.functional.normalize(torch.randn(2, 32, generator=generator), dim=1)
    predictor = OnlineLengthPredictor()
    for _ in range(4):  # four rollouts of 8 x 16 samples, one observation at a time as samples finish
        work, keys, features, lengths = feed(predictor, planted_rollout(8, 16, generator=generator,
                                                                        directions=directions))
        for i, key in enumerate(keys):
            predictor.observe(work, [key], [lengths[i]], features[i:i + 1])
    work, keys, features, lengths = feed(predictor, planted_rollout(8, 16, generator=generator, directions=directions))
    predicted = predictor.predict(work, keys, features)
    assert kendall_tau(predicted, lengths) > 0.8
    assert smape(predicted, lengths) < 0.3
    assert predictor.log_std(True) < predictor.log_std(False)
    # Checkpoint resume: a fresh predictor loaded from the state predicts the same.
    clone = OnlineLengthPredictor()
    clone.load_state_dict(predictor.state_dict())
    assert torch.allclose(clone.predict(work, keys, features), predicted)


def test_online_predictor_maps_each_rollouts_own_prompt_features():
    """The prompt part is mapped once per rollout and indexed per call: each rollout's rows, never the last's."""
    predictor, generator = OnlineLengthPredictor(max_dim=8), torch.Generator().manual_seed(0)
    for _ in range(2):
        features = torch.randn(3, 16, generator=generator)  # projected: 16 > max_dim
        work = RolloutWork([4] * 3, 2, 2, 64, features, [[0], [1], [2]])
        for keys in ([(2, 0), (0, 1)], [(1, 1)]):
            assert torch.equal(predictor._prompt_x(work, keys), predictor._phi(features)[[p for p, _ in keys]])
            assert torch.allclose(predictor._prompt_x(work, keys), predictor._phi(features[[p for p, _ in keys]]))


@pytest.mark.parametrize("seed", [1, 2])
def test_online_predictor_learning_a_batch_equals_learning_its_samples_one_at_a_time(seed):
    """The scheduler teaches the predictor in batches. Split where the fits would change (a refit, the token model
    coming of age), each sample is scored against what one-at-a-time learning would have predicted for it (the
    penalty choice moving with every earlier sample), so the error spreads it plans with and the model it ends with
    are the same, up to rounding; the first batch crosses min_token_observations (16 < 32)."""
    generator = torch.Generator().manual_seed(seed)
    directions = torch.nn.functional.normalize(torch.randn(2, 32, generator=generator), dim=1)
    rollouts = [planted_rollout(4, 8, generator=generator, directions=directions) for _ in range(3)]
    one_by_one, batched = OnlineLengthPredictor(), OnlineLengthPredictor()
    for rollout in rollouts:
        work, keys, features, lengths = feed(one_by_one, rollout)
        for i, key in enumerate(keys):
            one_by_one.observe(work, [key], [lengths[i]], features[i:i + 1])
        work, keys, features, lengths = feed(batched, rollout)
        batched.observe(work, keys, lengths, features)
        for spread in ("token_error", "prompt_error"):
            for field, value in getattr(one_by_one, spread).state_dict().items():
                assert getattr(batched, spread).state_dict()[field] == pytest.approx(value, rel=1e-9), (spread, field)
        for model in ("token_model", "prompt_model"):
            a, b = getattr(one_by_one, model), getattr(batched, model)
            assert torch.allclose(a.alpha_sq_err, b.alpha_sq_err, rtol=1e-9) and a.new_since_fit == b.new_since_fit
        assert torch.allclose(batched.predict(work, keys, features), one_by_one.predict(work, keys, features),
                              rtol=1e-6)
    assert batched.log_std(True) < 0.9  # scored errors, not the untrained prior (1.0)


def test_history_predictor_per_prompt_with_global_fallback():
    predictor = HistoryLengthPredictor()
    work = RolloutWork([3, 3], 2, 2, 1024, prompt_ids=[[1, 2, 3], [4, 5, 6]])
    predictor.observe(work, [(0, 0), (0, 1), (1, 0)], [100, 100, 400])
    assert predictor.predict(work, [(0, 1), (1, 1)]).tolist() == pytest.approx([100, 400], rel=1e-5)
    unseen = RolloutWork([3], 1, 1, 1024, prompt_ids=[[7, 7]])
    global_mean = math.exp(predictor.global_stats[1] / predictor.global_stats[0])
    assert float(predictor.predict(unseen, [(0, 0)])[0]) == pytest.approx(global_mean, rel=1e-5)
    assert 100 < global_mean < 400
    clone = HistoryLengthPredictor()
    clone.load_state_dict(predictor.state_dict())
    assert clone.predict(work, [(1, 0)]).tolist() == predictor.predict(work, [(1, 0)]).tolist()


def test_oracle_predictor_reads_true_lengths_only():
    predictor = OracleLengthPredictor()
    work = RolloutWork([1, 1], 2, 2, 64, true_lengths=[[3, 9], [27, 1]])
    assert predictor.predict(work, [(0, 1), (1, 0)]).tolist() == [9, 27]
    assert predictor.log_std(True) == 0.0
    with pytest.raises(ValueError, match="true_lengths"):
        predictor.predict(RolloutWork([1], 1, 1, 64), [(0, 0)])


def test_make_predictor_names():
    assert isinstance(make_predictor("online"), OnlineLengthPredictor)
    assert isinstance(make_predictor("history"), HistoryLengthPredictor)
    assert isinstance(make_predictor("oracle"), OracleLengthPredictor)
    with pytest.raises(ValueError, match=r"'bert'.*online.*history.*oracle"):
        make_predictor("bert")


def test_kendall_tau_and_smape():
    x = [1.0, 2.0, 3.0, 4.0, 5.0, 5.0]
    y = [2.0, 1.0, 4.0, 3.0, 6.0, 7.0]
    scipy_stats = pytest.importorskip("scipy.stats")
    assert kendall_tau(x, y) == pytest.approx(scipy_stats.kendalltau(x, y).statistic)
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1, 1, 1], [1, 2, 3]) == 0.0  # no ranking information
    assert smape([100, 0], [50, 0]) == pytest.approx((50 / 75) / 2)


def test_expected_length_given_survival():
    assert expected_length(100, 0.0, 10, 1024) == 100
    assert expected_length(100, 0.0, 150, 1024) == 151  # exact prediction overrun: at least one more token
    mean = expected_length(100, 0.5, 0, 10**6)
    assert mean == pytest.approx(100 * math.exp(0.5**2 / 2), rel=1e-6)  # lognormal mean
    values = [expected_length(100, 0.5, survived, 1024) for survived in (0, 50, 200, 800, 1023)]
    assert values == sorted(values)
    assert all(survived < value <= 1024 for survived, value in zip((0, 50, 200, 800, 1023), values))
    assert expected_length(100, 0.05, 5000, 8192) > 5000  # far tail stays finite


# ---- scheduler construction ------------------------------------------------------------------------------------


class _ProbeSpy:
    """Mixin: records every probe a driver makes and what the scheduler answered."""

    def begin(self, work):
        self.probes = []
        super().begin(work)

    def probe(self, key, generated, feature):
        parked = super().probe(key, generated, feature)
        self.probes.append((key, generated, parked))
        return parked


class _ProbingOracle(OracleLengthPredictor):
    token_conditioned = True


def test_only_a_token_conditioned_predictor_is_probed_and_each_sample_once():
    lengths = [[3, 20, 9, 14], [17, 2, 11, 6]]
    for base in (FIFOScheduler, RoundScheduler):
        spy = type("Spy", (_ProbeSpy, base), {})()
        simulate_rollout(spy, lengths, 2, 32, token_feature=lambda key, n: pytest.fail("a feature was asked for"))
        assert spy.probes == [] and not spy.needs_prompt_features
    oracle = type("Spy", (_ProbeSpy, InfiniteScheduler), {})("oracle")
    simulate_rollout(oracle, lengths, 2, 32)
    assert oracle.probes == [] and not oracle.needs_prompt_features
    probing = type("Spy", (_ProbeSpy, InfiniteScheduler), {})(_ProbingOracle(), probe_tokens=4)
    trust_predictions(probing)
    result = simulate_rollout(probing, lengths, 2, 32)
    # every sample longer than k is probed once, at k tokens; one that ends at or before its probe is not
    assert sorted(key for key, _, _ in probing.probes) == [(p, k) for p in range(2) for k in range(4)
                                                            if lengths[p][k] > 4]
    assert {generated for _, generated, _ in probing.probes} == {4}
    # one count of parks: the probes that answered True
    assert result.parked_samples == sum(parked for *_, parked in probing.probes) > 0
    assert probing.last_info["parked_samples"] == result.parked_samples
    online = InfiniteScheduler()
    assert online.needs_prompt_features and online.probe_tokens == InfiniteSchedulerConfig().probe_tokens


def test_infinite_scheduler_settings_come_from_its_config():
    assert InfiniteScheduler().config == InfiniteSchedulerConfig()
    config = InfiniteSchedulerConfig(predictor="history", refill="sjf", grouping="kk", probe_tokens=0)
    scheduler = InfiniteScheduler.from_config(config)
    assert scheduler.config is config and scheduler.refill.name == "sjf" and scheduler.probe_tokens is None
    changed = InfiniteScheduler("oracle", config=config, gain_z=None)
    assert (changed.config.predictor, changed.config.refill, changed.config.gain_z) == ("oracle", "sjf", None)
    assert InfiniteScheduler(predictor=HistoryLengthPredictor(), refill=make_refill("fifo")).refill.name == "fifo"
    with pytest.raises(ValueError, match=r"unknown scheduler options \['bogus'\]"):
        InfiniteScheduler(bogus=1)


def test_every_declared_choice_builds_and_nothing_else_does():
    for name in get_args(RefillName):
        assert make_refill(name).name == name
    assert set(REFILLS) == set(get_args(RefillName))
    assert set(GROUPINGS) == set(get_args(GroupingName))
    for name in get_args(GroupingName):
        assert make_grouping(name)([3, 1, 2], 2).makespan == 3
    for name in get_args(PredictorName):
        assert InfiniteSchedulerConfig(predictor=name).predictor == name
        assert isinstance(make_predictor(name), LengthPredictor)
    for field, allowed in (("refill", get_args(RefillName)), ("grouping", get_args(GroupingName))):
        with pytest.raises(ValueError, match=re.escape(f"scheduler.{field}='x' is not known; use one of "
                                                       f"{list(allowed)}")):
            InfiniteSchedulerConfig(**{field: "x"})


def test_the_scheduler_refuses_to_place_a_sample_that_does_not_wait():
    class Replaying(Scheduler):
        """Places the first sample again once it has finished."""

        def admit(self):
            if (0, 0) in self.finished_keys:
                return [self._place(0, (0, 0))]
            return super().admit()

        def begin(self, work):
            self.finished_keys = set()
            super().begin(work)

        def finish(self, key, length):
            self.finished_keys.add(key)
            super().finish(key, length)

    with pytest.raises(RuntimeError, match=r"placed sample \(0, 0\), which does not wait"):
        simulate_rollout(Replaying(), [[1, 5, 5]], 2)
    scheduler = Scheduler()
    scheduler.begin(RolloutWork([1], 3, 2, 8, done={(0, 1)}))
    assert scheduler.admit() == [(0, (0, 0)), (1, (0, 2))]  # a sample carried finished never runs
    assert scheduler.slots == [(0, 0), (0, 2)] and not scheduler.waiting()


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"predictor": "bogus"}, r"'bogus'.*online"),
        ({"refill": "bogus"}, r"'bogus'.*sjf"),
        ({"grouping": "bogus"}, r"'bogus'.*fptas"),
        ({"probe_tokens": -1}, "probe_tokens"),
    ],
)
def test_infinite_scheduler_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        InfiniteScheduler(**kwargs)
