"""Pure scheduling parts: grouping bounds, refill orders, length predictors, the length-aware scheduler's
construction and options."""

from __future__ import annotations

import itertools
import math
import random
import re
from statistics import NormalDist
from typing import get_args

import pytest
import torch

from lit_grpo.scheduling import (
    FIFOScheduler,
    InfiniteSchedulerConfig,
    LeastAttainedScheduler,
    LengthAwareConfig,
    RolloutWork,
    RoundScheduler,
    Scheduler,
    simulate_rollout,
)
from lit_grpo.scheduling.base import ARRIVAL, DECISION_NAMES, lower_bound_steps
from lit_grpo.scheduling.length_aware.scheduler import PLAN, PROBE
from lit_grpo.scheduling.length_aware import (
    LengthAwareScheduler,
    OnlineLengthPredictor,
    OracleLengthPredictor,
    RefillPolicy,
    SlotPlanner,
    fptas_partition,
    kendall_tau,
    lpt_partition,
    make_predictor,
    makespan_lower_bound,
    smape,
)
from lit_grpo.scheduling.length_aware import grouping as grouping_module  # the FPTAS and its local search
from lit_grpo.scheduling.length_aware.predictors import LengthPredictor, PredictorName, expected_length, log_rmse
from lit_grpo.scheduling.length_aware.refill import RefillName
from lit_grpo.scheduling.length_aware.ridge import RidgeRegressor
from scheduler_helpers import planted_rollout, trust_predictions


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


@pytest.mark.parametrize("epsilon", [0.5, 0.1, 0.01])
def test_the_trimmed_dp_alone_is_within_epsilon_of_the_optimum(monkeypatch, epsilon):
    # no candidate is certified and none is improved, so every instance's plan is the DP's (or LPT's where the DP
    # finds nothing better): real-valued lengths and ready times, one to four slots, ties and zeros
    monkeypatch.setattr(grouping_module, "_certified", lambda makespan, lower, epsilon: False)
    monkeypatch.setattr(grouping_module, "local_search", lambda part, lengths, ready: part)
    rng = random.Random(7)
    for index in range(200):
        num_slots = rng.choice([1, 2, 2, 3, 3, 4])
        size = rng.randint(0, 7 if num_slots < 4 else 6)
        lengths = ([rng.randint(0, 60) for _ in range(size)] if index % 2 else
                   [rng.choice([0.0, 3.0, rng.uniform(0, 60), rng.uniform(0, 60)]) for _ in range(size)])
        ready = [rng.choice([0.0, 0.0, rng.uniform(0, 40)]) for _ in range(num_slots)]
        optimum = brute_force_makespan(lengths, num_slots, ready)
        part = fptas_partition(lengths, num_slots, ready, epsilon=epsilon)
        check_partition(part, lengths, num_slots, ready)
        assert part.lower_bound <= optimum + 1e-9
        assert part.makespan <= (1 + epsilon) * optimum + 1e-9
        assert part.ratio_bound == pytest.approx(1 + epsilon)


def test_a_cut_dp_claims_only_what_it_proves(monkeypatch):
    # a budget that cuts the DP's layers to a beam: the plan's ratio_bound still bounds makespan / optimum
    monkeypatch.setattr(grouping_module, "_certified", lambda makespan, lower, epsilon: False)
    rng = random.Random(8)
    for _ in range(100):
        num_slots = rng.randint(2, 3)
        lengths = [rng.uniform(1, 60) for _ in range(rng.randint(3, 7))]
        ready = [rng.choice([0.0, rng.uniform(0, 40)]) for _ in range(num_slots)]
        optimum = brute_force_makespan(lengths, num_slots, ready)
        part = fptas_partition(lengths, num_slots, ready, epsilon=0.01, dp_budget=rng.choice([1, 5, 20]))
        check_partition(part, lengths, num_slots, ready)
        assert part.makespan <= part.ratio_bound * optimum + 1e-9


def test_fptas_dp_fixes_lpt_worst_cases(monkeypatch):
    # Graham's tight LPT examples: 2m + 1 jobs, LPT = (4/3 - 1/(3m)) OPT.
    cases = [([3, 3, 2, 2, 2], 2, 6), ([5, 5, 4, 4, 3, 3, 3], 3, 9)]
    # Without the local search (a public stage of the FPTAS) the DP stage has to find the optimum itself.
    monkeypatch.setattr(grouping_module, "local_search", lambda part, lengths, ready: part)
    for lengths, num_slots, optimum in cases:
        assert lpt_partition(lengths, num_slots).makespan == pytest.approx(optimum * (4 / 3 - 1 / (3 * num_slots)))
        part = fptas_partition(lengths, num_slots, epsilon=0.01)
        assert part.makespan == optimum
        assert part.method == "dp"


def test_local_search_alone_fixes_the_smallest_lpt_worst_case():
    lpt = lpt_partition([3, 3, 2, 2, 2], 2)
    assert lpt.makespan == 7
    improved = grouping_module.local_search(lpt, [3, 3, 2, 2, 2], [0.0, 0.0])
    assert improved.makespan == 6 and improved.method == "local"
    check_partition(improved, [3, 3, 2, 2, 2], 2)


def test_lpt_within_graham_bound():
    for lengths, num_slots, _ in small_instances(150, seed=1):
        optimum = brute_force_makespan(lengths, num_slots)
        part = lpt_partition(lengths, num_slots)
        check_partition(part, lengths, num_slots)
        assert part.makespan <= (4 / 3 - 1 / (3 * num_slots)) * optimum + 1e-9
        assert part.ratio_bound <= 4 / 3


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


def test_lower_bound_counts_ready_times_in_the_pigeonhole_and_rounds_integers_up():
    # three jobs of 5 on two slots busy until 10: two of them share a slot, which frees at 10 at the earliest
    assert makespan_lower_bound([5, 5, 5], 2, ready=[10, 10]) == 20
    # five unit jobs on two slots: the water level 2.5 rounds up, since an integer makespan is at least 3
    assert makespan_lower_bound([1] * 5, 2) == 3
    assert makespan_lower_bound([0.5] * 5, 2) == 1.25  # not integers: not rounded


def test_lower_bound_steps_round_the_work_per_slot_up():
    assert lower_bound_steps([3, 3, 3], 2) == 5  # 9 tokens on 2 slots: 4.5 steps are 5
    assert lower_bound_steps([9, 1, 1], 3) == 9  # the longest sample
    assert lower_bound_steps([], 4) == 0
    for bad in (0, -2, 1.5, True):
        message = f"num_slots={bad!r} is not allowed; num_slots must be an integer >= 1"
        with pytest.raises(ValueError, match=re.escape(message)):
            lower_bound_steps([3, 3], bad)


def test_lpt_claims_grahams_bound_where_its_lower_bound_is_looser():
    # LPT's makespan 10 over the lower bound 8 is 1.25, but Graham proves 4/3 - 1/(3m) against the optimum
    part = lpt_partition([6, 4, 6, 4, 4], 3)
    assert part.makespan / part.lower_bound == pytest.approx(1.25)
    assert part.ratio_bound == pytest.approx(4 / 3 - 1 / 9)


def test_a_dp_whose_layers_fit_its_beam_is_complete_and_certified():
    # a budget of 10 keeps one state a layer; where no layer has more, nothing was cut and the guarantee holds
    part = fptas_partition([30, 19, 8, 8], 2, epsilon=0.01, dp_budget=10)
    assert part.makespan == brute_force_makespan([30, 19, 8, 8], 2) == 35
    assert part.ratio_bound == pytest.approx(1.01)


def test_large_plan_is_certified():
    # The planning-time figure (4096 samples, 16 slots) is benchmarked, not timed here.
    rng = random.Random(3)
    lengths = [min(1024, max(1, int(math.exp(rng.gauss(5.5, 0.8))))) for _ in range(4096)]
    part = fptas_partition(lengths, 16)
    check_partition(part, lengths, 16)
    assert part.ratio_bound == pytest.approx(1.01)


def test_bad_partition_inputs_are_named():
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        fptas_partition([1, 2], 2, epsilon=0)
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed
    with pytest.raises(ValueError, match=r"^epsilon must be > 0, got a negative int of 5001 digits$"):
        fptas_partition([1, 2], 2, epsilon=-10**5000)
    with pytest.raises(ValueError, match="num_slots must be >= 1"):
        fptas_partition([1, 2], 0)
    with pytest.raises(ValueError, match="non-negative"):
        lpt_partition([1, -2], 2)
    with pytest.raises(ValueError, match=r"job lengths must be finite and non-negative, got \[nan\]"):
        fptas_partition([math.nan, 3.0], 2)
    with pytest.raises(ValueError, match=r"job lengths must be finite and non-negative, got \[inf\]"):
        fptas_partition([math.inf, 3.0], 2)
    with pytest.raises(ValueError, match=r"ready times must be finite and non-negative, got \[-5\]"):
        fptas_partition([1, 2], 2, ready=[-5, 0])
    with pytest.raises(ValueError, match="ready has 1 entries for 2 slots"):
        fptas_partition([1, 2], 2, ready=[0.0])


# ---- refill ----------------------------------------------------------------------------------------------------


def test_refill_policy_orders():
    candidates = [(5.0, 0), (1.0, 1), (9.0, 2), (5.0, 3)]
    assert RefillPolicy("sjf").order(candidates) == [1, 0, 3, 2]
    assert RefillPolicy("lpt").order(candidates) == [2, 0, 3, 1]
    assert RefillPolicy("fifo").order(candidates) == [0, 1, 2, 3]
    assert RefillPolicy("lpt").pick(candidates) == 2
    assert RefillPolicy("sjf").pick(candidates) == 1
    with pytest.raises(ValueError, match=r"refill='shortest' is not known.*lpt.*sjf.*fifo"):
        RefillPolicy("shortest")


def _plan_loads(planner, ready):
    """Each slot's planned load: its ready time plus its share's predicted lengths."""
    return [ready[slot] + sum(planner.pool[key][0] for key in share) for slot, share in enumerate(planner.shares)]


def test_planner_follows_plan_and_replans_on_deviation():
    planner, lengths = SlotPlanner(RefillPolicy("sjf"), num_slots=2), [6, 3, 3, 2, 2, 2]
    for rank, length in enumerate(lengths):
        planner.add(("job", rank), length, rank)
    assert planner.total_work == 18
    planner.replan(0, [0.0, 0.0])
    assert planner.stats.replans == 1
    assert _plan_loads(planner, [0.0, 0.0]) == [9, 9]  # the plan balances the slots at 9
    first = [planner.choose(slot, 0, [0.0, 0.0]) for slot in range(2)]
    assert planner.stats.replans == 1  # the fresh plan is followed: no re-plan at the same step
    # SJF starts each slot's shortest job of its share, never the 6
    assert set(first) <= {("job", 1), ("job", 2), ("job", 3), ("job", 4), ("job", 5)}
    assert len(planner) == 4 and planner.total_work == 18 - sum(lengths[rank] for _, rank in first)
    # Slot 0 comes back on time: no re-plan. Far off the plan: re-plan.
    on_time = planner.expected_end[0]
    planner.choose(0, on_time, [0.0, 1.0])
    assert planner.stats.replans == 1
    planner.choose(1, planner.expected_end[1] + 50, [3.0, 0.0])
    assert planner.stats.replans == 2
    assert planner.choose(0, 100, [0.0, 0.0]) is not None and planner.choose(1, 100, [0.0, 0.0]) is not None
    assert len(planner) == 0 and planner.choose(0, 101, [0.0, 0.0]) is None  # an empty pool: nothing to run


def test_planner_update_replans_only_beyond_the_tolerance():
    planner = SlotPlanner(RefillPolicy("lpt"), num_slots=2)
    for rank, length in enumerate([10, 10, 10]):
        planner.add(rank, length, rank)
    planner.replan(0, [0.0, 0.0])
    planner.update(0, 10.5)  # within REPLAN_TOLERANCE (10%) of 10: the plan stands
    assert not planner.stale and planner.pool[0] == (10.0, 0)
    planner.update(0, 12.0)
    assert planner.stale and planner.pool[0] == (12.0, 0) and planner.total_work == 32


def test_planner_update_tolerates_a_tenth_of_a_token_at_least():
    planner = SlotPlanner(RefillPolicy("lpt"), num_slots=2)
    planner.add(0, 0.5, 0)
    planner.replan(0, [0.0, 0.0])
    planner.update(0, 0.58)  # 16% of the prediction, but under a tenth of a token: the plan stands
    assert not planner.stale and planner.pool[0] == (0.5, 0)


def test_planner_plans_to_the_precision_of_the_predictions():
    """Plans are computed to precision max(epsilon, noise): planning finer than the lengths are known buys
    nothing. Slot 1 is busy for 2 more steps; the optimal plan (makespan 12) runs 6 + 6 here and defers the long
    job to slot 1; to a 50% precision LPT's plan (makespan 14) is certified, and it starts the long job here."""

    def planner_with_jobs():
        planner = SlotPlanner(RefillPolicy("sjf"), num_slots=2)
        for rank, length in enumerate([10, 6, 6]):
            planner.add(rank, length, rank)
        return planner

    exact = planner_with_jobs()
    assert exact.choose(0, 0, [0.0, 2.0], noise=0.0) == 1
    coarse = planner_with_jobs()
    assert coarse.choose(0, 0, [0.0, 2.0], noise=0.5) == 0


def test_planner_greedy_and_first_choices_ignore_the_plan():
    planner = SlotPlanner(RefillPolicy("lpt"), num_slots=2)
    for rank, length in enumerate([3, 9, 5]):
        planner.add(("job", rank), length, rank)
    assert planner.choose_first(0, 0) == ("job", 0)  # arrival order
    assert planner.choose_greedy(1, 0) == ("job", 1)  # the policy's favourite of the whole pool: the longest
    assert planner.expected_end == [3, 9] and list(planner.pool) == [("job", 2)]
    # a slot whose share is empty takes from the busiest one rather than idle
    planner.replan(0, [0.0, 100.0])
    assert planner.shares[1] == []
    assert planner.choose(1, 0, [0.0, 100.0]) == ("job", 2) and planner.stats.steals == 1


def test_planner_tolerates_a_one_step_deviation_of_a_short_job():
    # a decode step is the plan's resolution: a job of 2 steps back 1 step late is on time; 2 late is not
    def started():
        planner = SlotPlanner(RefillPolicy("sjf"), num_slots=2)
        for rank in range(4):
            planner.add(rank, 2, rank)
        planner.choose(0, 0, [0.0, 0.0])
        assert planner.stats.replans == 1 and planner.expected_end[0] == 2
        return planner

    one_late, two_late = started(), started()
    one_late.choose(0, 3, [0.0, 0.0])
    two_late.choose(0, 4, [0.0, 0.0])
    assert (one_late.stats.replans, two_late.stats.replans) == (1, 2)


def test_planner_replans_at_most_once_a_step():
    planner = SlotPlanner(RefillPolicy("sjf"), num_slots=2)
    for rank in range(6):
        planner.add(rank, 2, rank)
    planner.choose(0, 0, [0.0, 0.0])
    planner.choose(1, 0, [0.0, 0.0])
    assert planner.stats.replans == 1
    # both slots come back far off the plan at step 10: the first re-plans, the second follows that plan
    planner.choose(0, 10, [0.0, 0.0])
    planner.choose(1, 10, [0.0, 0.0])
    assert planner.stats.replans == 2


def test_the_plan_does_not_depend_on_the_order_jobs_joined_the_pool():
    lengths = [4, 1, 3, 4]

    def shares(order):
        planner = SlotPlanner(RefillPolicy("lpt"), num_slots=2)
        for rank in order:
            planner.add(("job", rank), lengths[rank], rank)
        planner.replan(0, [0.0, 0.0])
        return planner.shares

    assert shares([0, 1, 2, 3]) == shares([3, 2, 1, 0]) == shares([2, 0, 3, 1])


# ---- predictors ------------------------------------------------------------------------------------------------


def feed(predictor, rollout, max_new_tokens=1024):
    num_prompts, group_size = len(rollout.lengths), len(rollout.lengths[0])
    work = RolloutWork([4] * num_prompts, group_size, 8, max_new_tokens, rollout.prompt_features)
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
    # The probe's token feature carries the within-group signal: without it (the prompt model) ranking is worse.
    assert kendall_tau(predictor.predict(work, keys), lengths) < kendall_tau(predicted, lengths) - 0.2
    # Checkpoint resume: a fresh predictor loaded from the state predicts the same.
    clone = OnlineLengthPredictor()
    clone.load_state_dict(predictor.state_dict())
    assert torch.allclose(clone.predict(work, keys, features), predicted)


def test_online_predictor_answers_each_rollout_from_its_own_prompt_features():
    """The prompt part is mapped once per rollout and indexed per call: each rollout's rows, never the last's, in
    whatever subset and order of keys is asked."""
    generator = torch.Generator().manual_seed(0)
    predictor = OnlineLengthPredictor(max_dim=8)  # projected: 16 > max_dim
    train = RolloutWork([4] * 6, 2, 2, 64, prompt_features=torch.randn(6, 16, generator=generator))
    predictor.observe(train, train.keys(), [2 + 9 * p + k for p, k in train.keys()])
    fresh = OnlineLengthPredictor(max_dim=8)
    fresh.load_state_dict(predictor.state_dict())  # the same model, no rollout's features mapped yet
    for _ in range(2):
        work = RolloutWork([4] * 3, 2, 2, 64, prompt_features=torch.randn(3, 16, generator=generator))
        whole = predictor.predict(work, work.keys())
        assert len(set(whole.tolist())) == 3  # the prompts are told apart
        assert torch.equal(fresh.predict(work, work.keys()), whole)
        for keys in ([(2, 0), (0, 1)], [(1, 1)]):
            assert torch.equal(predictor.predict(work, keys), whole[[2 * p + k for p, k in keys]])


@pytest.mark.parametrize("seed", [1, 2])
def test_online_predictor_learning_a_batch_gathers_what_one_at_a_time_gathers(seed):
    """The scheduler teaches the predictor in batches; the decayed statistics the ridge fits are solved from are
    those of one-at-a-time learning (the penalty choice and refit timing may differ: they follow the calls)."""
    generator = torch.Generator().manual_seed(seed)
    directions = torch.nn.functional.normalize(torch.randn(2, 32, generator=generator), dim=1)
    rollouts = [planted_rollout(4, 8, generator=generator, directions=directions) for _ in range(3)]
    one_by_one, batched = OnlineLengthPredictor(), OnlineLengthPredictor()
    for rollout in rollouts:
        work, keys, features, lengths = feed(one_by_one, rollout)
        for i, key in enumerate(keys):
            one_by_one.observe(work, [key], [lengths[i]], features[i:i + 1])
        batched.observe(work, keys, lengths, features)
        for model in ("token_model", "prompt_model"):
            a, b = getattr(one_by_one, model), getattr(batched, model)
            assert (a.sw, a.sw2, a.sy) == pytest.approx((b.sw, b.sw2, b.sy), rel=1e-12), model
            for stat in ("sx", "sxx", "sxy"):
                assert torch.allclose(getattr(a, stat), getattr(b, stat), rtol=1e-9, atol=1e-9), (model, stat)
    predicted = batched.predict(work, keys, features)
    assert kendall_tau(predicted, lengths) > 0.5  # what it learned ranks the samples


def test_oracle_predictor_reads_true_lengths_only():
    predictor = OracleLengthPredictor()
    work = RolloutWork([1, 1], 2, 2, 64, true_lengths=[[3, 9], [27, 1]])
    assert predictor.predict(work, [(0, 1), (1, 0)]).tolist() == [9, 27]
    assert not predictor.token_conditioned and not predictor.needs_prompt_features
    with pytest.raises(ValueError, match="true_lengths"):
        predictor.predict(RolloutWork([1], 1, 1, 64), [(0, 0)])


def test_make_predictor_names():
    assert isinstance(make_predictor("online"), OnlineLengthPredictor)
    assert isinstance(make_predictor("oracle"), OracleLengthPredictor)
    assert make_predictor("online", seed=3).seed == 3  # keywords go to the constructor
    for removed in ("history", "group", "online+group"):
        with pytest.raises(ValueError, match=r"is not known.*online.*oracle"):
            make_predictor(removed)
    with pytest.raises(ValueError, match=r"'bert'.*online.*oracle"):
        make_predictor("bert")


def test_kendall_tau_smape_and_log_rmse():
    x = [1.0, 2.0, 3.0, 4.0, 5.0, 5.0]
    y = [2.0, 1.0, 4.0, 3.0, 6.0, 7.0]
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1, 1, 1], [1, 2, 3]) == 0.0  # no ranking information
    # 15 pairs: 12 concordant, 2 discordant, 1 tied in x alone ((5, 5) against (6, 7)): tau-b = 10 / sqrt(14 x 15)
    assert kendall_tau(x, y) == pytest.approx(10 / math.sqrt(14 * 15))
    assert smape([100, 0], [50, 0]) == pytest.approx((50 / 75) / 2)
    assert log_rmse([10, 40], [20, 20]) == pytest.approx(math.log(2))
    assert math.isnan(log_rmse([], []))
    assert log_rmse([10, 20], [20, 20]) == pytest.approx(math.log(2) / math.sqrt(2))  # a root of the mean square
    scipy_stats = pytest.importorskip("scipy.stats")
    assert kendall_tau(x, y) == pytest.approx(scipy_stats.kendalltau(x, y).statistic)


def test_expected_length_given_survival():
    assert expected_length(100, 0.0, 10, 1024) == 100
    assert expected_length(100, 0.0, 150, 1024) == 151  # exact prediction overrun: at least one more token
    mean = expected_length(100, 0.5, 0, 10**6)
    assert mean == pytest.approx(100 * math.exp(0.5**2 / 2), rel=1e-6)  # lognormal mean
    values = [expected_length(100, 0.5, survived, 1024) for survived in (0, 50, 200, 800, 1023)]
    assert values == sorted(values)
    assert all(survived < value <= 1024 for survived, value in zip((0, 50, 200, 800, 1023), values))
    assert expected_length(100, 0.05, 5000, 8192) > 5000  # far tail stays finite


def test_expected_length_counts_the_draws_that_reach_the_cap():
    # a prediction at the cap with a wide spread: half the draws end at the cap, and count as the cap
    normal = NormalDist()
    draws = [min(100 * math.exp(normal.inv_cdf((i + 0.5) / 20_000)), 100) for i in range(20_000)]
    assert expected_length(100, 1.0, 0, 100) == pytest.approx(sum(draws) / len(draws), rel=1e-3)


def test_the_token_model_answers_from_min_token_observations_probed_samples_on():
    work = RolloutWork([4], 4, 2, 1024)
    keys = work.keys()
    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])

    def predicted(observed: int) -> list[float]:
        predictor = OnlineLengthPredictor(decay=1.0, min_token_observations=4)  # no decay: 4 samples count 4
        predictor.observe(work, keys[:observed], [10, 100, 10, 100][:observed], features[:observed])
        return predictor.predict(work, keys[:2], features[:2]).tolist()

    below, at = predicted(3), predicted(4)
    assert below[0] == below[1]  # the prompt model: one prediction for the prompt's samples
    assert at[0] < at[1]  # the token model tells the samples apart by their token features


def test_a_ridge_fit_is_reused_until_min_refit_new_observations():
    regressor = RidgeRegressor(decay=1.0, alphas=(1.0,), min_refit=4)  # one penalty: its fit alone answers
    x = torch.linspace(-1, 1, 20, dtype=torch.float64)[:, None]
    regressor.update(x, 2 * x[:, 0])
    probe = torch.tensor([[1.0]])
    fitted = regressor.predict(probe).item()
    regressor.update(torch.ones(3, 1, dtype=torch.float64), torch.full((3,), 10.0, dtype=torch.float64))
    assert regressor.predict(probe).item() == fitted  # 3 new observations: the fit stands
    regressor.update(torch.ones(1, 1, dtype=torch.float64), torch.full((1,), 10.0, dtype=torch.float64))
    assert regressor.predict(probe).item() > fitted  # the 4th: refitted


def test_a_ridge_regressor_fits_at_a_decay_just_above_its_bound():
    # the effective count approaches (1 + decay) / (1 - decay): above 3 just above decay 0.5, so a fit is made
    generator = torch.Generator().manual_seed(0)
    regressor = RidgeRegressor(decay=0.55, alphas=(1.0,), min_refit=1)
    for _ in range(40):
        x = torch.randn(1, 2, generator=generator, dtype=torch.float64)
        regressor.update(x, x[:, 0] - x[:, 1])
    assert regressor.effective_count > 3
    first, second = regressor.predict(torch.tensor([[1.0, 0.0], [0.0, 1.0]])).tolist()
    assert first > second  # a slope was fitted: the mean alone would answer both alike


def test_a_ridge_penalty_counts_pseudo_observations():
    # a penalty of 1 against 1000 exact observations of y = 2x + 1 barely shrinks the slope
    regressor = RidgeRegressor(decay=1.0, alphas=(1.0,))
    x = torch.linspace(-1, 1, 1000, dtype=torch.float64)[:, None]
    regressor.update(x, 2 * x[:, 0] + 1)
    assert regressor.predict(torch.tensor([[1.0]])).item() == pytest.approx(3.0, abs=0.01)


def test_a_decayed_ridge_penalty_counts_pseudo_observations_of_a_fresh_ones_weight():
    # the closed form: weighted, centred ridge with penalty alpha x (the features' common scale)^2 on the total
    # weighted squared error; decay makes the weights' sum half their effective count here
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(200, 3, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + torch.randn(200, generator=generator,
                                                                               dtype=torch.float64)
    regressor = RidgeRegressor(decay=0.98, alphas=(10.0,))
    regressor.update(x, y)
    w = 0.98 ** torch.arange(199, -1, -1, dtype=torch.float64)
    centred, target = x - (w @ x) / w.sum(), y - (w @ y) / w.sum()
    cov = (w[:, None] * centred).T @ centred
    scale_sq = (cov.diagonal() / w.sum()).mean()
    expected = torch.linalg.solve(cov + 10.0 * scale_sq * torch.eye(3, dtype=torch.float64),
                                  (w[:, None] * centred).T @ target)
    probe = torch.eye(3, dtype=torch.float64)
    slopes = regressor.predict(probe) - regressor.predict(torch.zeros(1, 3, dtype=torch.float64))
    assert slopes.tolist() == pytest.approx(expected.tolist(), rel=1e-9)


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
    for base in (FIFOScheduler, RoundScheduler, LeastAttainedScheduler):
        spy = type("Spy", (_ProbeSpy, base), {})()
        simulate_rollout(spy, lengths, 2, 32, token_feature=lambda key, n: pytest.fail("a feature was asked for"))
        assert spy.probes == [] and not spy.needs_prompt_features and spy.probe_tokens is None
    oracle = type("Spy", (_ProbeSpy, LengthAwareScheduler), {})(LengthAwareConfig(predictor="oracle"))
    simulate_rollout(oracle, lengths, 2, 32)
    assert oracle.probes == [] and not oracle.needs_prompt_features
    probing = type("Spy", (_ProbeSpy, LengthAwareScheduler), {})(
        LengthAwareConfig(predictor=_ProbingOracle(), probe_tokens=4))
    trust_predictions(probing)
    result = simulate_rollout(probing, lengths, 2, 32)
    # every sample longer than k is probed once, at k tokens; one that ends at or before its probe is not
    assert sorted(key for key, _, _ in probing.probes) == [(p, k) for p in range(2) for k in range(4)
                                                            if lengths[p][k] > 4]
    assert {generated for _, generated, _ in probing.probes} == {4}
    # one count of parks: the probes that answered True, each recorded with the reason "probe" or "plan"
    parks = [d for d in probing.decisions if d.action == "park"]
    assert result.parked_samples == len(parks) == sum(parked for *_, parked in probing.probes) > 0
    assert probing.last_info["parked_samples"] == result.parked_samples
    assert {d.reason for d in parks} <= {PROBE, PLAN} and PROBE in {d.reason for d in parks}
    assert {d.name for d in probing.decisions} <= set(DECISION_NAMES)
    online = LengthAwareScheduler()
    assert online.needs_prompt_features and online.probe_tokens == LengthAwareConfig().probe_tokens == 8


def test_length_aware_scheduler_settings_come_from_its_config():
    assert LengthAwareScheduler().config == LengthAwareConfig()
    assert (LengthAwareConfig().predictor, LengthAwareConfig().refill) == ("online", "lpt")
    config = LengthAwareConfig(predictor="online", refill="sjf", probe_tokens=0, gain_z=None)
    scheduler = LengthAwareScheduler(config)
    assert scheduler.config is config and scheduler.refill.name == "sjf" and scheduler.probe_tokens is None
    assert isinstance(scheduler.predictor, OnlineLengthPredictor)
    # the default's options sit beside it, in InfiniteSchedulerConfig
    built = InfiniteSchedulerConfig(preempt_tokens=4, park_budget=0.25, loss_share=None, length_aware=config).build()
    assert type(built) is LengthAwareScheduler and built.config is config
    assert (built.preempt_tokens, built.park_budget, built.loss_share) == (4, 0.25, None)
    from_dict = InfiniteSchedulerConfig.from_options({"length_aware": {"predictor": "oracle", "refill": "fifo"}})
    assert from_dict.length_aware == LengthAwareConfig(predictor="oracle", refill="fifo")
    # objects instead of names
    predictor = OracleLengthPredictor()
    objects = LengthAwareScheduler(LengthAwareConfig(predictor=predictor, refill=RefillPolicy("fifo")))
    assert objects.predictor is predictor and objects.refill.name == "fifo"
    with pytest.raises(ValueError, match=r"unknown scheduler.length_aware options \['grouping'\]"):
        InfiniteSchedulerConfig.from_options({"length_aware": {"grouping": "kk"}})
    for removed in ("grouping", "epsilon", "replan_tolerance", "slack_scale", "critical_fraction"):
        with pytest.raises(ValueError, match=rf"unknown scheduler options \['{removed}'\]"):
            InfiniteSchedulerConfig.from_options({removed: 1})


def test_every_declared_choice_builds_and_nothing_else_does():
    for name in get_args(RefillName):
        assert RefillPolicy(name).name == name
        assert LengthAwareScheduler(LengthAwareConfig(refill=name)).refill.name == name
    for name in get_args(PredictorName):
        assert LengthAwareConfig(predictor=name).predictor == name
        assert isinstance(make_predictor(name), LengthPredictor)
    with pytest.raises(ValueError, match=re.escape(f"scheduler.length_aware.refill='x' is not known; use one of "
                                                   f"{list(get_args(RefillName))}")):
        LengthAwareConfig(refill="x")


def test_the_scheduler_refuses_to_place_a_sample_that_does_not_wait():
    class Replaying(Scheduler):
        """Places the first sample again once it has finished."""

        def admit(self):
            if (0, 0) in self.finished_keys:
                return [self._place(0, (0, 0), ARRIVAL)]
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
    assert [(d.slot, d.key, d.action, d.reason) for d in scheduler.decisions] == [
        (0, (0, 0), "start", ARRIVAL), (1, (0, 2), "start", ARRIVAL)]


def test_trusted_ungated_predictions_run_a_rollout_where_every_sample_has_a_slot():
    """Where every sample has a slot nothing is predicted, so there is no plan to follow, even with trusted
    predictions and no gain gate (gain_z None): the rollout runs in arrival order."""
    scheduler = LengthAwareScheduler(LengthAwareConfig(predictor="oracle"))
    trust_predictions(scheduler, "prompt")
    result = simulate_rollout(scheduler, [[3, 9]], 4, 16)
    assert result.decode_steps == 9 and not scheduler.now.guided
    assert {d.reason for d in scheduler.decisions} == {ARRIVAL}
    # the next rollout, with samples that wait, still follows the predictions
    simulate_rollout(scheduler, [[3, 9, 1, 5], [2, 7, 4, 8]], 2, 16)
    assert scheduler.now.guided


def test_the_driver_refuses_a_slot_past_the_last():
    class Overflowing(Scheduler):
        def admit(self):
            return [self._place(self.work.num_slots, self._pop_unstarted(), ARRIVAL)]

    with pytest.raises(RuntimeError, match=r"Overflowing placed sample \(0, 0\) in slot 2; the slots are 0..1"):
        simulate_rollout(Overflowing(), [[3, 3]], 2)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"predictor": "bogus"}, r"scheduler.length_aware.predictor: length predictor='bogus' is not known.*online"),
        ({"refill": "bogus"}, r"scheduler.length_aware.refill='bogus'.*sjf"),
        ({"probe_tokens": -1}, r"scheduler.length_aware.probe_tokens=-1 must be an integer >= 0 or None"),
        ({"probe_tokens": 2.5}, r"scheduler.length_aware.probe_tokens=2.5 must be an integer >= 0 or None"),
        ({"gain_z": 0}, r"scheduler.length_aware.gain_z=0 is not allowed; .* must be a finite number > 0, or None"),
        ({"gain_z": math.nan}, r"scheduler.length_aware.gain_z=nan is not allowed; .* must be a finite number > 0"),
    ],
)
def test_length_aware_config_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        LengthAwareConfig(**kwargs)
    with pytest.raises(ValueError, match=pattern):
        InfiniteSchedulerConfig(length_aware=kwargs)  # given as a dict, checked the same


@pytest.mark.parametrize(("make", "pattern"), [
    # each was taken as given: a float or a string failed at the first prediction or update, inside torch, and a
    # decay above 1 grew the older observations' weights without bound
    (lambda: OnlineLengthPredictor(max_dim=0), r"max_dim=0 must be an integer >= 1"),
    (lambda: OnlineLengthPredictor(max_dim=8.5), r"max_dim=8.5 must be an integer >= 1"),
    (lambda: OnlineLengthPredictor(decay=1.5), r"decay=1.5 is not allowed; decay must be a finite number > 0.5 and "
                                               r"<= 1"),
    # at most 0.5 the decayed statistics never count the 3 observations a fit needs: the mean was predicted forever
    (lambda: OnlineLengthPredictor(decay=0.3), r"decay=0.3 is not allowed; decay must be a finite number > 0.5"),
    (lambda: RidgeRegressor(decay=0.5), r"decay=0.5 is not allowed; decay must be a finite number > 0.5"),
    (lambda: RidgeRegressor(decay=0), r"decay=0 is not allowed; decay must be a finite number > 0.5"),
    (lambda: OnlineLengthPredictor(decay="0.99"), r"decay='0.99' is not allowed"),
    (lambda: OnlineLengthPredictor(min_token_observations=-1), r"min_token_observations=-1 must be an integer >= 0"),
    (lambda: OnlineLengthPredictor(seed=1.5), r"seed=1.5 is not allowed; seed must be an integer"),
    # beyond torch's generator's range these failed at the first projection ("Overflow when unpacking long long")
    (lambda: OnlineLengthPredictor(seed=-1), r"seed=-1 is not allowed; seed must be an integer >= 0 and <= "
                                             r"4294967295$"),
    (lambda: OnlineLengthPredictor(seed=2**64), r"seed=18446744073709551616 is not allowed; seed must be an integer "
                                                r">= 0 and <= 4294967295$"),
    (lambda: RidgeRegressor(alphas=()), r"alphas=\(\) must be a non-empty list of penalties"),
    (lambda: RidgeRegressor(alphas=(1.0, math.nan)), r"alphas\[1\]=nan is not allowed; alphas\[1\] must be a "
                                                     r"finite number >= 0"),  # the entry named, not the list
    (lambda: RidgeRegressor(min_refit=2.5), r"min_refit=2.5 must be an integer >= 0"),
    # int() took these as seeds 1 and 1
    (lambda: make_predictor("noisy:0.5", seed=1.5), r"seed=1.5 is not allowed; seed must be an integer"),
    (lambda: make_predictor("noisy:0.5", seed=True), r"seed=True is not allowed; seed must be an integer"),
    (lambda: make_predictor("noisy:0.5", seed=-1), r"seed=-1 is not allowed; seed must be an integer >= 0 and <= "
                                                   r"4294967295$"),
])
def test_the_length_predictors_refuse_a_bad_setting_naming_it(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_length_aware_must_be_a_config_a_dict_or_none():
    with pytest.raises(ValueError, match=r"scheduler.length_aware=5 must be a LengthAwareConfig"):
        InfiniteSchedulerConfig(length_aware=5)
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed, a long value ran on
    with pytest.raises(ValueError, match=r"^scheduler.length_aware=\(an int of 5001 digits\) must be a "
                                         r"LengthAwareConfig, a dict of its fields \['predictor', "):
        InfiniteSchedulerConfig(length_aware=10**5000)
    with pytest.raises(ValueError, match=r"^scheduler=\(an int of 5001 digits\) must be a mapping of its options "
                                         r"\['preempt_tokens', "):
        InfiniteSchedulerConfig.from_options(10**5000)
    with pytest.raises(ValueError, match=r"^scheduler.length_aware.predictor=\(an int of 5001 digits\) must be a "
                                         r"predictor's name or a LengthPredictor$"):
        LengthAwareConfig(predictor=10**5000)
    with pytest.raises(ValueError, match=rf"^scheduler.length_aware.refill={re.escape(repr([1] * 100)[:100])} must "
                                         r"be one of \('lpt', "):
        LengthAwareConfig(refill=[1] * 100)
    assert InfiniteSchedulerConfig(length_aware=None).length_aware is None


# ---- checkpoint states of the predictors: checked whole before any of it is taken ------------------------------

def _learned_online_predictor() -> OnlineLengthPredictor:
    """An online predictor that has learned: a projection made (hidden 8 > max_dim 4), both models fitted."""
    generator = torch.Generator().manual_seed(3)
    predictor = OnlineLengthPredictor(max_dim=4, min_token_observations=0)
    for _ in range(3):
        work = RolloutWork([4] * 4, 2, 2, 64, prompt_features=torch.randn(4, 8, generator=generator))
        features = torch.randn(8, 8, generator=generator)
        predictor.observe(work, work.keys(), [2 + 5 * p + k for p, k in work.keys()], features)
    predictor.predict(work, work.keys(), features)  # fits the token model
    predictor.predict(work, work.keys())  # and the prompt model
    assert predictor.token_model._fit is not None and predictor.prompt_model._fit is not None
    assert list(predictor.state_dict()["projections"]) == [8]
    return predictor


def same_state(a, b) -> bool:
    """Whether two states (nested mappings, lists and tuples of numbers and tensors) are equal, tensors exactly."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b)
                and all(same_state(a[key], b[key]) for key in a))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN equals NaN here


def _drop(key):
    return lambda state: state.pop(key)


def _set(key, value):
    return lambda state: state.__setitem__(key, value)


def _set_entry(key, index, value):
    return lambda state: state[key].__setitem__(index, value)


_RIDGE_KEYS = "decay, alphas, dim, sw, sw2, sy, sx, sxx, sxy, alpha_sq_err, new_since_fit, fit"


@pytest.mark.parametrize("change, message", [
    (_drop("sw"), r"^a RidgeRegressor state lacks \['sw'\]; it holds " + _RIDGE_KEYS + "$"),
    (_set("past", [0.0]), r"^a RidgeRegressor state has unknown keys \['past'\]; it holds decay, "),
    (_set("decay", 0.3), r"^ridge state decay=0.3 is not allowed; ridge state decay must be a finite number > 0.5 "
                         r"and <= 1$"),
    (_set("alphas", []), r"^ridge state alphas=\[\] must be a non-empty list of penalties \(finite numbers >= 0\)$"),
    (_set_entry("alphas", 1, -1.0), r"^ridge state alphas\[1\]=-1.0 is not allowed; ridge state alphas\[1\] must be "
                                    r"a finite number >= 0$"),
    (_set("dim", 0), r"^ridge state dim=0 must be an integer >= 1 or None$"),
    (_set("dim", 8.0), r"^ridge state dim=8.0 must be an integer >= 1 or None$"),
    (_set("sw", -1.0), r"^ridge state sw=-1.0 is not allowed; ridge state sw must be a finite number >= 0$"),
    (_set("sw2", "1.0"), r"^ridge state sw2='1.0' is not allowed; ridge state sw2 must be a finite number >= 0$"),
    (_set("sy", math.nan), r"^ridge state sy=nan is not allowed; ridge state sy must be a finite number$"),
    (_set("sx", [0.0] * 8), r"^ridge state sx must be a floating-point tensor shaped \[8\] \(dim\) of finite "
                            r"numbers, not \[0.0, "),
    (_set("sx", torch.zeros(7, dtype=torch.float64)),
     r"^ridge state sx must be a floating-point tensor shaped \[8\] \(dim\) of finite numbers, not a torch.float64 "
     r"tensor shaped \[7\]$"),
    (_set("dim", None), r"^ridge state sx must be a floating-point tensor shaped \[0\] \(dim\) of finite numbers, "
                        r"not a torch.float64 tensor shaped \[8\]$"),  # no features seen, but their statistics
    (_set_entry("sxx", (1, 2), math.inf), r"^ridge state sxx\[1, 2\]=inf is not allowed; ridge state sxx must be a "
                                          r"floating-point tensor shaped \[8, 8\] \(dim x dim\) of finite numbers$"),
    (_set("sxy", torch.zeros(8, dtype=torch.int64)),
     r"^ridge state sxy must be a floating-point tensor shaped \[8\] \(dim\) of finite numbers, not a torch.int64 "),
    (_set_entry("alpha_sq_err", 4, -1.0), r"^ridge state alpha_sq_err\[4\]=-1.0 is not allowed; ridge state "
                                          r"alpha_sq_err must be a floating-point tensor shaped \[5\] \(one per "
                                          r"penalty\) of finite numbers >= 0$"),
    (_set("new_since_fit", -1), r"^ridge state new_since_fit=-1 must be an integer >= 0$"),
    (lambda state: state.__setitem__("fit", state["fit"][:2]),
     r"^ridge state fit must be None or \(weights, mean of x, mean of y\), not a tuple of 2$"),
    (lambda state: state.__setitem__("fit", (state["fit"][0][:, :7], *state["fit"][1:])),
     r"^ridge state fit\[0\] must be a floating-point tensor shaped \[5, 8\] \(penalties x dim\) of finite numbers, "
     r"not a torch.float64 tensor shaped \[5, 7\]$"),
    (lambda state: state.__setitem__("fit", (*state["fit"][:2], math.nan)),
     r"^ridge state fit\[2\]=nan is not allowed; ridge state fit\[2\] must be a finite number$"),
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed
    (_set("alphas", 10**5000), r"^ridge state alphas=\(an int of 5001 digits\) must be a non-empty list of "
                               r"penalties \(finite numbers >= 0\)$"),
    (_set("sx", 10**5000), r"^ridge state sx must be a floating-point tensor shaped \[8\] \(dim\) of finite "
                           r"numbers, not an int of 5001 digits$"),
    (_set("sx", [10**5000]), r"^ridge state sx must be a floating-point tensor shaped \[8\] \(dim\) of finite "
                             r"numbers, not a list holding an int of more than \d+ digits$"),
    (_set("fit", 10**5000), r"^ridge state fit must be None or \(weights, mean of x, mean of y\), not an int of "
                            r"5001 digits$"),
    (_set("sx", "x" * 200), rf"^ridge state sx must be a floating-point tensor shaped \[8\] \(dim\) of finite "
                            rf"numbers, not {repr('x' * 200)[:80]}$"),  # cut short
])
def test_a_bad_ridge_state_is_refused_naming_the_bad_key_and_the_regressor_is_left_as_it_was(change, message):
    """A corrupt or foreign checkpoint's ridge state (another object's, a wrong shape, a number out of range) is
    refused naming what is wrong and what is allowed, before any of it is taken: taken, it failed later, inside
    torch, far from the checkpoint, or predicted from nonsense."""
    state = _learned_online_predictor().token_model.state_dict()
    change(state)
    regressor = _learned_online_predictor().prompt_model
    before = regressor.state_dict()
    with pytest.raises(ValueError, match=message):
        regressor.load_state_dict(state)
    assert same_state(regressor.state_dict(), before)


def test_a_ridge_state_of_numpy_numbers_loads_as_plain_ones():
    """What the checks take they keep as plain numbers: a state written through numpy resumes as the one it was."""
    import numpy as np

    state = _learned_online_predictor().token_model.state_dict()
    numpy_state = {**state, "decay": np.float64(state["decay"]), "dim": np.int64(state["dim"]),
                   "alphas": tuple(np.float64(a) for a in state["alphas"]), "sw": np.float64(state["sw"]),
                   "new_since_fit": np.int64(state["new_since_fit"])}
    regressor, resumed = RidgeRegressor(), RidgeRegressor()
    regressor.load_state_dict(state)
    resumed.load_state_dict(numpy_state)
    assert type(resumed.dim) is int and type(resumed.new_since_fit) is int and type(resumed.sw) is float
    assert all(type(a) is float for a in resumed.alphas) and type(resumed.decay) is float
    x = torch.randn(3, state["dim"], dtype=torch.float64)
    assert torch.equal(resumed.predict(x), regressor.predict(x))
    fresh = RidgeRegressor()
    fresh.load_state_dict(RidgeRegressor().state_dict())  # nothing learned: no features seen, no fit
    assert fresh.dim is None and fresh.state_dict()["fit"] is None


_ONLINE_KEYS = "max_dim, seed, min_token_observations, prompt_model, token_model, projections"


@pytest.mark.parametrize("change, message", [
    (_drop("projections"), r"^an OnlineLengthPredictor state lacks \['projections'\]; it holds " + _ONLINE_KEYS + "$"),
    (_set("spread", 0.5), r"^an OnlineLengthPredictor state has unknown keys \['spread'\]; it holds max_dim, "),
    (_set("max_dim", 0), r"^online predictor state max_dim=0 must be an integer >= 1$"),
    (_set("seed", -1), r"^online predictor state seed=-1 is not allowed; online predictor state seed must be an "
                       r"integer >= 0 and <= 4294967295$"),
    (_set("min_token_observations", 1.5), r"^online predictor state min_token_observations=1.5 must be an integer "
                                          r">= 0$"),
    (_set("token_model", "ridge"), r"^an OnlineLengthPredictor state's token_model must be a mapping of "
                                   + _RIDGE_KEYS + ", not str$"),
    # the prompt model's state is good: it is not taken either
    (lambda state: state["token_model"].__setitem__("sw", -1.0),
     r"^online predictor state token_model.sw=-1.0 is not allowed; online predictor state token_model.sw must be a "
     r"finite number >= 0$"),
    (_set("projections", [torch.zeros(8, 4)]), r"^online predictor state projections must be a mapping of hidden "
                                               r"sizes to their projections, not list$"),
    (lambda state: state["projections"].__setitem__("16", torch.zeros(16, 4, dtype=torch.float64)),
     r"^online predictor state projections\['16'\] is not allowed; a projection's key is the hidden size it maps, "
     r"an integer > max_dim=4$"),
    (lambda state: state["projections"].__setitem__(4, torch.zeros(4, 4, dtype=torch.float64)),
     r"^online predictor state projections\[4\] is not allowed; a projection's key is the hidden size it maps, an "
     r"integer > max_dim=4$"),  # a hidden size of max_dim or fewer is not projected
    (lambda state: state["projections"].__setitem__(8, torch.zeros(8, 3, dtype=torch.float64)),
     r"^online predictor state projections\[8\] must be a floating-point tensor shaped \[8, 4\] \(hidden size x "
     r"max_dim\) of finite numbers, not a torch.float64 tensor shaped \[8, 3\]$"),
    # keys shown as every check shows a value: a repr of an int of more than 4300 digits failed, a long one ran on
    (lambda state: state["projections"].__setitem__(10**5000, torch.zeros(8, 4, dtype=torch.float64)),
     r"^online predictor state projections\[an int of 5001 digits\] must be a floating-point tensor shaped \[an "
     r"int of 5001 digits, 4\] \(hidden size x max_dim\) of finite numbers, not a torch.float64 tensor shaped "
     r"\[8, 4\]$"),
    (lambda state: state["projections"].__setitem__("9" * 500, torch.zeros(8, 4, dtype=torch.float64)),
     rf"^online predictor state projections\[{re.escape(repr('9' * 500)[:100])}\] is not allowed; a projection's "
     r"key is the hidden size it maps, an integer > max_dim=4$"),
])
def test_a_bad_online_predictor_state_is_refused_naming_the_bad_key_and_nothing_is_taken(change, message):
    """The online predictor's state is checked whole, its two models' states among it, before any of it is taken:
    a bad token model's state used to fail after the prompt model's was taken."""
    state = _learned_online_predictor().state_dict()
    change(state)
    predictor = OnlineLengthPredictor(max_dim=4, seed=5)
    predictor.observe(RolloutWork([4] * 2, 2, 2, 64, prompt_features=torch.ones(2, 8)), [(0, 0), (1, 1)], [3, 9])
    before = predictor.state_dict()
    with pytest.raises(ValueError, match=message):
        predictor.load_state_dict(state)
    assert same_state(predictor.state_dict(), before)


def test_an_online_predictor_state_resumes_a_predictor_that_predicts_the_same():
    learned = _learned_online_predictor()
    resumed = OnlineLengthPredictor()
    resumed.load_state_dict(learned.state_dict())
    assert same_state(resumed.state_dict(), learned.state_dict())
    work = RolloutWork([4] * 3, 2, 2, 64, prompt_features=torch.randn(3, 8, generator=torch.Generator().manual_seed(9)))
    features = torch.randn(6, 8, generator=torch.Generator().manual_seed(10))
    assert torch.equal(resumed.predict(work, work.keys(), features), learned.predict(work, work.keys(), features))


@pytest.mark.parametrize("make, state, message", [
    (OracleLengthPredictor, {"spread": 0.25}, r"^an OracleLengthPredictor state has unknown keys \['spread'\]; it "
                                              r"holds nothing$"),
    (OracleLengthPredictor, [], r"^an OracleLengthPredictor state must be an empty mapping, not list$"),
    (lambda: make_predictor("noisy:0.5"), {"spread": 0.25, "seed": 0},
     r"^a NoisyOraclePredictor state lacks \['rollout'\]; it holds spread, seed, rollout$"),
    (lambda: make_predictor("noisy:0.5"), {"spread": -0.25, "seed": 0, "rollout": 3},
     r"^noisy predictor state spread=-0.25 is not allowed; noisy predictor state spread must be a finite number "
     r">= 0$"),
    (lambda: make_predictor("noisy:0.5"), {"spread": "0.25", "seed": 0, "rollout": 3},
     r"^noisy predictor state spread='0.25' is not allowed"),
    (lambda: make_predictor("noisy:0.5"), {"spread": 0.25, "seed": 2**32, "rollout": 3},
     r"^noisy predictor state seed=4294967296 is not allowed; noisy predictor state seed must be an integer >= 0 "
     r"and <= 4294967295$"),
    (lambda: make_predictor("noisy:0.5"), {"spread": 0.25, "seed": 0, "rollout": -2},
     r"^noisy predictor state rollout=-2 must be an integer >= -1 \(-1: before the first rollout\)$"),
])
def test_a_bad_oracle_state_is_refused_naming_the_bad_key_and_nothing_is_taken(make, state, message):
    predictor = make()
    before = predictor.state_dict()
    with pytest.raises(ValueError, match=message):
        predictor.load_state_dict(state)
    assert predictor.state_dict() == before
