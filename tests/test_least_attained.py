"""The default scheduler of "infinite" (scheduling/least_attained.py): least attained service, its gate, and the
reasons it records for every decision."""

from __future__ import annotations

import functools
import math
import random
import re

import pytest
import torch

from lit_grpo.sampling import RolloutEngine
from lit_grpo.sampling.memory_budget import auto_micro_group_size, kv_bytes_per_token, tail_tokens
from lit_grpo.scheduling import (FIFOScheduler, InfiniteSchedulerConfig, LeastAttainedScheduler, LengthAwareConfig,
                                 RolloutWork, decision_counts, simulate_rollout)
from lit_grpo.scheduling.base import ARRIVAL, LEAST_ATTAINED, PREEMPTION, whole_tail
from lit_grpo.scheduling.least_attained import LOSS_SHARE, preemption_points, rollout_makespan
from lit_grpo.scheduling.length_aware import LengthAwareScheduler, make_predictor
from lit_grpo.scheduling.length_aware.scheduler import PLAN


def _heavy_groups(seed: int, prompts: int = 4, group_size: int = 16, cap: int = 256) -> list[list[int]]:
    """Lognormal lengths (log spread 1), capped: most samples short, a few near the cap."""
    rng = random.Random(seed)
    return [[min(cap, max(1, round(rng.lognormvariate(4.8, 1.0)))) for _ in range(group_size)]
            for _ in range(prompts)]


def _work(prompts: int, group_size: int, slots: int, cap: int) -> RolloutWork:
    return RolloutWork(prompt_lengths=[1] * prompts, group_size=group_size, num_slots=slots, max_new_tokens=cap)


def test_preemption_points_double_from_the_quantum_then_come_every_eighth_of_the_cap():
    assert preemption_points(8, 256) == {8, 16, 32, 64, 96, 128, 160, 192, 224}
    assert preemption_points(8, 1024) == {8, 16, 32, 64, 128, 256, 384, 512, 640, 768, 896}
    assert preemption_points(8, 100) == set(range(8, 100, 8))  # an eighth of 100 is below 16: the stride is q
    assert preemption_points(8, 24) == {8, 16}
    assert preemption_points(8, 8) == preemption_points(None, 100) == preemption_points(0, 100) == frozenset()


def test_fine_points_at_the_end_share_the_slots_among_the_longest_samples():
    # 14 samples at the cap and a few short ones on 8 slots: with doubling alone the last 512 tokens of the long
    # ones run in two whole waves; every eighth of the cap they share the slots.
    lengths = [50, 1024, 47, 1024, 70, 34, 1024, 153, 288, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 139, 1024,
               34, 1024, 83, 316, 315, 197, 73, 761, 166, 207, 75, 621, 70, 47]
    first_come = rollout_makespan(lengths, 8)
    doubling = frozenset(8 << j for j in range(7))  # 8 ... 512
    assert rollout_makespan(lengths, 8, doubling) > first_come
    assert rollout_makespan(lengths, 8, preemption_points(8, 1024)) < first_come


def test_the_gates_model_of_both_orders_is_the_scheduler_driven_through_the_engines_loop():
    # rollout_makespan is what the gate believes; the scheduler, driven as the engine drives it, must do just that
    rng = random.Random(0)
    for _ in range(20):
        lengths = [[rng.randint(1, 60) for _ in range(rng.randint(2, 8))] for _ in range(3)]
        lengths = [row[:min(map(len, lengths))] for row in lengths]
        slots = rng.randint(1, 6)
        flat = [x for row in lengths for x in row]
        assert rollout_makespan(flat, slots) == simulate_rollout(FIFOScheduler(), lengths, slots, 64).decode_steps
        preempting = LeastAttainedScheduler(preempt_tokens=4, loss_share=None, park_budget=None)
        preempting.observe([60] + [1] * 7)  # a heavy tail seen: the gate preempts wherever anything waits
        result = simulate_rollout(preempting, lengths, slots, 64)
        if preempting.preempting:
            assert result.decode_steps == rollout_makespan(flat, slots, preemption_points(4, 64))


#: A parked tail's cost where two of three layers keep a ring of 6 positions (``tail_tokens``).
RING_COST = functools.partial(tail_tokens, [6, 6, None])


@pytest.mark.parametrize("park_cost", [whole_tail, RING_COST], ids=["tokens", "ring"])
@pytest.mark.parametrize("park_budget", [None, 0.05, 0.3, 1.0])
def test_the_gates_model_equals_the_driven_scheduler_step_for_step_with_and_without_a_park_budget(park_budget,
                                                                                                  park_cost):
    # Under a park budget the first sample parked in a step can leave no room for the next, so the order in which
    # one step's preemption points are offered (the driver's: slot order) decides the run; the model must follow it,
    # counting a parked tail at the cost the scheduler counts it (a ring model's tail past its window costs less)
    rng, cases = random.Random(str(park_budget)), 0
    for _ in range(150):
        cap, slots = rng.choice([16, 40, 64, 100]), rng.randint(1, 6)
        group_size = rng.randint(1, 8)
        lengths = [[rng.randint(1, cap) for _ in range(group_size)] for _ in range(rng.randint(1, 5))]
        quantum = rng.choice([1, 2, 4, 8])
        scheduler = _AlwaysPreempting(preempt_tokens=quantum, park_budget=park_budget, loss_share=None)
        driven = simulate_rollout(scheduler, lengths, slots, cap, park_cost=park_cost).decode_steps
        flat = [x for row in lengths for x in row]
        model = rollout_makespan(flat, slots, preemption_points(quantum, cap), scheduler.park_tokens, park_cost)
        assert model == driven, (lengths, slots, quantum, park_budget)
        cases += scheduler.parked_samples > 0
    assert cases > 50  # most draws park something: the comparison reaches the preemption path


def test_a_park_cost_without_ring_layers_is_the_identity_and_changes_no_decision():
    # the park budget counts a parked tail's KV: where every layer holds every token that is its tokens, so a model
    # without ring layers parks, resumes and ends where it did when the budget counted tokens
    assert [tail_tokens([None, None], t) for t in (0, 1, 7, 64)] == [0, 1, 7, 64]
    assert RING_COST(4) == 4 and RING_COST(12) == (6 + 6 + 12) / 3  # a tail past the ring costs less
    identity = functools.partial(tail_tokens, [None, None, None])
    rng, parks = random.Random(1), 0
    for _ in range(60):
        cap, slots = rng.choice([16, 40, 64]), rng.randint(1, 4)
        lengths = [[rng.randint(1, cap) for _ in range(rng.randint(1, 6))]] * rng.randint(1, 3)
        runs = []
        for park_cost in (whole_tail, identity):
            scheduler = _AlwaysPreempting(preempt_tokens=2, park_budget=0.2, loss_share=None)
            steps = simulate_rollout(scheduler, lengths, slots, cap, park_cost=park_cost).decode_steps
            runs.append((steps, scheduler.park_tokens, scheduler.decisions))
        assert runs[0] == runs[1]
        flat = [x for row in lengths for x in row]
        points = preemption_points(2, cap)
        assert rollout_makespan(flat, slots, points, runs[0][1], identity) == rollout_makespan(flat, slots, points,
                                                                                                runs[0][1])
        parks += any(d.action == "park" for d in runs[0][2])
    assert parks > 20


def test_the_park_budget_counts_a_ring_models_tails_at_their_kv():
    # a budget of 0.25 x 1 slot x cost(16) = 0.25 x (6 + 6 + 16) / 3 = 7/3 full-layer tokens: a 2-token tail fits
    # (counted at 2), the 4-token one after it does not (2 + 4 > 7/3); counted in tokens (0.25 x 16 = 4) both fit
    scheduler = _AlwaysPreempting(preempt_tokens=2, park_budget=0.25, loss_share=None)
    simulate_rollout(scheduler, [[16, 16, 16]], 1, 16, park_cost=RING_COST)
    assert scheduler.park_tokens == pytest.approx(0.25 * 28 / 3)
    assert scheduler.parked_tokens == pytest.approx(0)  # every tail given back at its cost
    tokens = _AlwaysPreempting(preempt_tokens=2, park_budget=0.25, loss_share=None)
    simulate_rollout(tokens, [[16, 16, 16]], 1, 16)
    assert tokens.park_tokens == 4 and tokens.parked_samples > scheduler.parked_samples > 0


def test_a_long_sample_that_arrives_last_starts_early_when_preempting():
    lengths = [5, 5, 5, 5, 5, 5, 60]
    assert rollout_makespan(lengths, 2) == 75  # three rounds of two 5s, then the 60 alone
    preempting = rollout_makespan(lengths, 2, preemption_points(4, 64))
    assert 60 <= preempting < 75  # the 60 started within the first quanta
    # The park budget bounds it: with room for nothing parked, the order is first-come again.
    assert rollout_makespan(lengths, 2, preemption_points(4, 64), park_tokens=0) == 75


def test_a_sample_parks_where_the_parked_tokens_reach_the_park_budget_exactly():
    # the budget is "at most park_tokens": parking the 60 at 4 tokens with a budget of 4 fits, one fewer does not;
    # the gate's model and the scheduler driven through the engine's loop draw the line at the same place
    lengths, points = [5, 5, 5, 5, 5, 5, 60], preemption_points(4, 64)
    assert rollout_makespan(lengths, 2, points, park_tokens=4) == 74
    assert rollout_makespan(lengths, 2, points, park_tokens=3) == 75
    scheduler = _AlwaysPreempting(preempt_tokens=4, park_budget=4 / (2 * 64), loss_share=None)
    assert simulate_rollout(scheduler, [lengths], 2, 64).decode_steps == 74 and scheduler.park_tokens == 4


def test_the_gate_preempts_on_heavy_tails_and_not_on_equal_lengths():
    heavy, equal = LeastAttainedScheduler(), LeastAttainedScheduler()
    work = _work(4, 16, 8, 256)
    assert heavy.judge(work) == (False, "first come: no finished group to draw rollouts from yet")
    for seed in range(8):
        for group in _heavy_groups(seed):
            heavy.observe(group)
        equal.observe([50] * 16)
    decision, note = heavy.judge(work)
    assert decision and note.startswith("preempting: ") and "drawn rollouts lose" in note
    assert sum(equal.gains(4, 16, 8, 256, 0.5 * 8 * 256)) <= 0 and not equal.judge(work)[0]
    assert heavy.judge(_work(4, 2, 8, 256)) == (False, "first come: every sample has a slot")


def test_the_gate_refuses_light_tails_where_some_drawn_rollouts_lose():
    # Lognormal lengths of log spread 0.3: preempting wins on average but loses on a share of arrangements above
    # the gate's; ungated (loss_share None) it preempts on the mean alone.
    rng = random.Random(1)
    gated, ungated = LeastAttainedScheduler(), LeastAttainedScheduler(loss_share=None)
    for _ in range(16):
        group = [min(512, round(rng.lognormvariate(5.3, 0.3))) for _ in range(16)]
        gated.observe(group)
        ungated.observe(group)
    gains = gated.gains(4, 16, 8, 512, 0.5 * 8 * 512)
    assert sum(gains) > 0 and sum(g < 0 for g in gains) > LOSS_SHARE * len(gains)
    work = _work(4, 16, 8, 512)
    assert ungated.judge(work)[0] and not gated.judge(work)[0]


def test_the_gate_keeps_the_most_recent_groups_and_its_state():
    gate = LeastAttainedScheduler()
    for n in range(100):
        gate.observe([n + 1] * 2)
    assert len(gate.groups) == 64 and gate.groups[0] == [37, 37]
    restored = LeastAttainedScheduler()
    restored.load_state_dict(gate.state_dict())
    assert list(restored.groups) == list(gate.groups)
    written_by_0_1 = {"predictor": {}, "trust": {}, "preemption": {"groups": [[3, 4]]}}
    restored.load_state_dict(written_by_0_1)
    assert list(restored.groups) == [[3, 4]]


def test_a_restored_gate_keeps_only_the_most_recent_groups_too():
    # a state holding more groups than the gate keeps (a hand-made or foreign one) is cut to the most recent, and
    # the groups observed after it keep the bound
    restored = LeastAttainedScheduler()
    restored.load_state_dict({"groups": [[n + 1] * 2 for n in range(100)]})
    assert len(restored.groups) == 64 and restored.groups[0] == [37, 37]
    restored.observe([500, 500])
    assert len(restored.groups) == 64 and restored.groups[0] == [38, 38] and restored.groups[-1] == [500, 500]


_SCHEDULER_KEYS = r"it holds groups, preemption, predictor, trust \(each may be absent\)"


@pytest.mark.parametrize("state, message", [
    ([[3, 4]], r"^a LeastAttainedScheduler state must be a mapping of groups, preemption, predictor, trust, not "
               r"list$"),
    ({"groups": [[3, 4]], "rollout_index": 2}, r"^a LeastAttainedScheduler state has unknown keys "
                                               r"\['rollout_index'\]; " + _SCHEDULER_KEYS + "$"),
    ({"preemption": {"groups": [[3]], "draws": 64}}, r"^a LeastAttainedScheduler state's preemption has unknown keys "
                                                     r"\['draws'\]; it holds groups$"),
    ({"groups": [[3, 4], []]}, r"^scheduler state groups\[1\]=\[\] is not allowed; a finished group is a "
                               r"non-empty list of its samples' lengths \(integers >= 0\)$"),
    ({"groups": [[3, -4]]}, r"^scheduler state groups\[0\]=\[3, -4\] is not allowed; a finished group is a "),
    ({"groups": [[3, "4"]]}, r"^scheduler state groups\[0\]=\[3, '4'\] is not allowed"),  # was parsed as 4
    ({"groups": [[3, 4.5]]}, r"^scheduler state groups\[0\]=\[3, 4.5\] is not allowed"),  # was cut to 4
    ({"groups": "34"}, r"^scheduler state groups='34' must be a list of finished groups$"),
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed
    ({"groups": [[-10**5000]]}, r"^scheduler state groups\[0\]=a list holding an int of more than \d+ digits is not "
                                r"allowed; a finished group is a non-empty list of its samples' lengths"),
    ({"groups": 10**5000}, r"^scheduler state groups=\(an int of 5001 digits\) must be a list of finished groups$"),
    ({"preemption": {"groups": [[True]]}}, r"^scheduler state preemption.groups\[0\]=\[True\] is not allowed"),
    ({"groups": [[3]], "preemption": {"groups": [[4]]}}, r"^a LeastAttainedScheduler state holds groups and "
                                                         r"preemption.groups; it holds its finished groups once"),
])
def test_a_bad_gate_state_is_refused_naming_the_bad_key_and_the_groups_are_left_as_they_were(state, message):
    """A corrupt or foreign checkpoint's scheduler state is refused naming what is wrong and what is allowed,
    before any of it is taken: a string length was parsed as a number and a fraction cut, an empty group failed in
    the gate's draw at the next rollout, a foreign state was taken as no groups at all."""
    gate = LeastAttainedScheduler()
    gate.observe([5, 6])
    with pytest.raises(ValueError, match=message):
        gate.load_state_dict(state)
    assert list(gate.groups) == [[5, 6]]


def test_a_gate_state_of_any_version_loads():
    """What the default scheduler wrote, a length-aware one's (its predictor and trust dropped, said), and a state of
    the 0.1 combined scheduler (its groups under "preemption", or none before preemption existed) load."""
    import numpy as np

    gate = LeastAttainedScheduler()
    gate.load_state_dict({"groups": [[np.int64(3), 0], (7,)]})
    assert list(gate.groups) == [[3, 0], [7]] and type(gate.groups[0][0]) is int
    with pytest.warns(UserWarning, match="the default scheduler has none"):
        gate.load_state_dict({"groups": [[2, 2]], "predictor": {}, "trust": {}})
    assert list(gate.groups) == [[2, 2]]
    with pytest.warns(UserWarning, match="the default scheduler has none"):
        gate.load_state_dict({"predictor": {}, "trust": {}})  # written before preemption existed
    assert list(gate.groups) == []


def test_the_gate_keeps_first_come_order_where_no_drawn_rollout_gains():
    # every sample ends before the first preemption point: both orders take the same steps, a gain of 0 is none
    gate = LeastAttainedScheduler()
    gate.observe([4] * 16)
    gains = gate.gains(4, 16, 8, 256, 0.5 * 8 * 256)
    assert len(gains) == 64 and set(gains) == {0}
    assert gate.judge(_work(4, 16, 8, 256)) == (False, "first come: 0 of 64 drawn rollouts lose, mean gain +0.0 steps")


def test_a_loss_share_of_0_preempts_where_no_drawn_rollout_loses():
    # loss_share is the most drawn rollouts that may lose: 0 allows none, and none losing is allowed
    gate = LeastAttainedScheduler(loss_share=0.0)
    for seed in range(8):
        for group in _heavy_groups(seed):
            gate.observe(group)
    gains = gate.gains(4, 16, 8, 256, 0.5 * 8 * 256)
    assert min(gains) >= 0 and sum(gains) > 0
    decision, note = gate.judge(_work(4, 16, 8, 256))
    assert decision and note.startswith("preempting: 0 of 64 drawn rollouts lose")


def _series(scheduler, rollouts: int, slots: int = 32):
    results = []
    for seed in range(rollouts):
        lengths = _heavy_groups(seed, prompts=8)
        results.append((simulate_rollout(scheduler, lengths, slots, 256),
                        simulate_rollout(FIFOScheduler(), lengths, slots, 256)))
    return results


class _BudgetWatch(LeastAttainedScheduler):
    """Records the parked samples' tokens after every preemption."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.parked_tokens_seen: list[int] = []

    def preempt(self, key, generated):
        parked = super().preempt(key, generated)
        self.parked_tokens_seen.append(sum(self.generated[k] for k in self.parked))
        return parked


def test_the_scheduler_preempts_once_the_tail_is_seen_and_gains_on_it():
    scheduler = _BudgetWatch()
    results = _series(scheduler, 6)
    first, _ = results[0]
    assert first.parked_samples == 0  # no group seen yet
    assert scheduler.last_info["preempting"] == 1.0
    later = results[1:]
    assert all(run.generated_tokens == fifo.generated_tokens for run, fifo in later)
    assert sum(run.parked_samples for run, _ in later) > 0
    assert sum(run.decode_steps for run, _ in later) < 0.97 * sum(fifo.decode_steps for _, fifo in later)
    assert max(scheduler.parked_tokens_seen) <= 0.5 * 32 * 256  # park_budget 0.5 of the slots' generation KV


class _AlwaysPreempting(LeastAttainedScheduler):
    """Preempts in every rollout (no gate); records the parked tokens it counts and those parked after each admit."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counted_and_parked: list[tuple[int, int]] = []

    def judge(self, work):
        return True, "preempting: forced by the test"

    def admit(self):
        assignments = super().admit()
        self.counted_and_parked.append((self.parked_tokens, sum(self.generated[k] for k in self.parked)))
        return assignments


def test_a_resumed_sample_gives_its_tokens_back_to_the_park_budget():
    # a resumed sample's tokens leave the park budget at once, so a later sample may park within it again
    scheduler = _AlwaysPreempting(preempt_tokens=4, park_budget=0.25, loss_share=None)  # 0.25 x 2 x 64 = 32 tokens
    simulate_rollout(scheduler, [[20, 20, 20, 20]], 2, 64)
    assert scheduler.park_tokens == 32
    assert all(counted == parked for counted, parked in scheduler.counted_and_parked), scheduler.counted_and_parked
    assert scheduler.parked_tokens == 0  # every parked sample resumed and finished
    # step 4: samples 0 and 1 park at 4 tokens (8); step 12: 2 and 3 park at 8 (24), 0 and 1 resume (16 left);
    # step 24: 0 parks at 16, which fits only with the resumed samples' 8 + 8 given back (16 + 16 <= 32)
    parks = [(d.step, d.key) for d in scheduler.decisions if d.action == "park"]
    assert parks == [(4, (0, 0)), (4, (0, 1)), (12, (0, 2)), (12, (0, 3)), (24, (0, 0))]
    assert decision_counts(scheduler.decisions)["resume_least_attained"] == 5


def test_preempt_is_asked_only_of_running_samples():
    # a sample that ends at a preemption point finishes: it is not offered to preempt as well
    class Asked(_AlwaysPreempting):
        def begin(self, work):
            super().begin(work)
            self.asked = []

        def preempt(self, key, generated):
            self.asked.append((key, generated, key in self.running))
            return super().preempt(key, generated)

    scheduler = Asked(preempt_tokens=4, park_budget=None, loss_share=None)
    simulate_rollout(scheduler, [[4, 8, 12, 30]], 2, 64)
    assert scheduler.asked and all(running for *_, running in scheduler.asked), scheduler.asked
    assert all(generated in scheduler.preempt_points for _, generated, _ in scheduler.asked)


def test_every_decision_carries_its_reason():
    """Why did this sample get this slot? The first rollout runs first come (nothing seen yet); later ones start
    and resume the least attained sample and park only at preemption points, for one that has generated fewer."""
    scheduler = LeastAttainedScheduler()
    first = simulate_rollout(scheduler, _heavy_groups(0, prompts=8), 32, 256)
    assert {d.name for d in scheduler.decisions} == {"start_arrival"}
    assert [d.key for d in scheduler.decisions] == [(p, k) for p in range(8) for k in range(16)]  # arrival order
    assert first.parked_samples == 0
    lengths = _heavy_groups(1, prompts=8)
    simulate_rollout(scheduler, lengths, 32, 256)
    counts = decision_counts(scheduler.decisions)
    assert set(counts) == {"start_least_attained", "park_preemption", "resume_least_attained"}
    assert counts["start_least_attained"] == 8 * 16 and counts["park_preemption"] == counts["resume_least_attained"]
    points = preemption_points(8, 256)
    attained, started = {}, {}
    for decision in scheduler.decisions:  # replay the record: every park is at a point, every start/resume in a slot
        if decision.action == "park":
            assert decision.reason == PREEMPTION
            attained[decision.key] = attained.get(decision.key, 0) + decision.step - started[decision.key]
            assert attained[decision.key] in points
        else:
            assert decision.reason == LEAST_ATTAINED and 0 <= decision.slot < 32
            started[decision.key] = decision.step


def test_without_a_quantum_the_scheduler_runs_first_come_order():
    scheduler = LeastAttainedScheduler(preempt_tokens=None)
    for run, fifo in _series(scheduler, 3):
        assert run.decode_steps == fifo.decode_steps and run.parked_samples == 0
    assert scheduler.preempt_points == frozenset() and scheduler.gate_note.startswith("first come: no preemption")
    assert {d.reason for d in scheduler.decisions} == {ARRIVAL}


def test_a_resumed_scheduler_preempts_from_its_first_rollout():
    trained = LeastAttainedScheduler()
    _series(trained, 3)
    resumed = InfiniteSchedulerConfig().build()
    resumed.load_state_dict(trained.state_dict())
    simulate_rollout(resumed, _heavy_groups(9, prompts=8), 32, 256)
    assert resumed.last_info["preempting"] == 1.0


def test_a_preempting_length_aware_rollout_is_not_turned_over_to_predictions_midway():
    # A weak predictor (a noisy oracle of spread 1.5) can establish a gain over arrival order midway through a
    # rollout; preemption, chosen at its start, is not arrival order, and is kept: no planned pick in such a rollout.
    for seed in (0, 2):
        scheduler = LengthAwareScheduler(LengthAwareConfig(make_predictor("noisy:1.5", seed=seed)))
        preempted = 0
        for rollout in range(5):
            simulate_rollout(scheduler, _heavy_groups(seed * 10 + rollout, prompts=8), 32, 256)
            if scheduler.preempting:
                preempted += 1
                assert all(d.reason != PLAN for d in scheduler.decisions)
        assert preempted >= 3


@pytest.mark.parametrize("name, value, allowed", [
    ("preempt_tokens", -1, "an integer >= 0 or None"), ("preempt_tokens", 2.5, "an integer >= 0 or None"),
    ("preempt_tokens", True, "an integer >= 0 or None"), ("preempt_tokens", "8", "an integer >= 0 or None"),
    ("park_budget", 0, "a finite number > 0, or None"), ("park_budget", math.nan, "a finite number > 0, or None"),
    ("park_budget", math.inf, "a finite number > 0, or None"),
    ("loss_share", 1.5, "a finite number >= 0 and <= 1, or None"),
    ("loss_share", math.nan, "a finite number >= 0 and <= 1, or None"),
    ("loss_share", "0.1", "a finite number >= 0 and <= 1, or None")])
def test_a_bad_option_is_refused_by_name(name, value, allowed):
    # NaN passes every comparison's "not too small" test: it must be refused, not act as "off"
    with pytest.raises(ValueError, match=rf"scheduler.{name}={re.escape(repr(value))} .*must be {allowed}"):
        InfiniteSchedulerConfig(**{name: value})


def test_the_default_has_four_options_and_builds_the_least_attained_scheduler():
    config = InfiniteSchedulerConfig()
    assert [f for f in config.__dataclass_fields__] == ["preempt_tokens", "park_budget", "loss_share", "length_aware"]
    assert type(config.build()) is LeastAttainedScheduler
    assert type(InfiniteSchedulerConfig(length_aware={"predictor": "oracle"}).build()) is LengthAwareScheduler
    with pytest.raises(ValueError, match=r"unknown scheduler options \['predictor'\]"):
        InfiniteSchedulerConfig.from_options({"predictor": "online"})


def test_the_kv_budget_counts_what_preemption_may_park(tiny_llama):
    assert InfiniteSchedulerConfig().parked_kv_bounds(256) == (0, 0.5)
    assert InfiniteSchedulerConfig(park_budget=None).parked_kv_bounds(256) == (224, 0.0)  # up to its last point
    assert InfiniteSchedulerConfig(preempt_tokens=None).parked_kv_bounds(256) == (0, 0.0)
    length_aware = InfiniteSchedulerConfig(length_aware=LengthAwareConfig(probe_tokens=8))
    assert length_aware.parked_kv_bounds(256) == (8, 0.5)  # and each sample's probe
    model_config = tiny_llama[0].config
    per_token = kv_bytes_per_token(model_config, torch.float32)
    # 20 slots, one prompt's prefix, and one layer of it twice for a moment (its prefill's split)
    budget = per_token * (20 * (10 + 100) + 10) + per_token // model_config.num_hidden_layers * 10
    assert auto_micro_group_size(model_config, torch.float32, budget, 10, 100, 64) == 20
    # Each slot may hold half its generation KV parked: 10 + 100 + 50 positions a slot.
    assert auto_micro_group_size(model_config, torch.float32, budget, 10, 100, 64, park_fraction=0.5) == 13
    with pytest.raises(ValueError, match="park_fraction"):
        auto_micro_group_size(model_config, torch.float32, budget, 10, 100, 64, park_fraction=-1)


def test_the_engine_preempts_and_resumes_samples_without_changing_them(tiny_llama):
    model, tokenizer = tiny_llama
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2+3?", "hi", "Count to five.", "Name a colour.")]
    lengths = [[2, 2, 2, 2, 2, 2, 2, 30]] * 4  # the long sample arrives last in each group
    engine = RolloutEngine(model, tokenizer, group_size=8, micro_group_size=4, strategy="infinite",
                           max_new_tokens=30, temperature=1.0, seed=3, preempt_tokens=2)
    engine.generate(prompts, lengths=lengths)  # the groups' lengths are seen
    result = engine.generate(prompts, lengths=lengths)
    assert result.stats.preempting == 1.0 and result.stats.parked_samples > 0
    counts = decision_counts(result.stats.decisions)
    assert counts["park_preemption"] == counts["resume_least_attained"] == result.stats.parked_samples
    continuous = RolloutEngine(model, tokenizer, group_size=8, micro_group_size=4, strategy="continuous",
                               max_new_tokens=30, temperature=1.0, seed=3)
    expected = continuous.generate(prompts, lengths=lengths)
    expected = continuous.generate(prompts, lengths=lengths)  # the same rollout index: the same streams
    assert result.completion_ids == expected.completion_ids
    # float32 model: parked rows resume from KV re-read into another slot, so log-probs agree to float32 rounding
    for got, want in zip(sum(result.logprobs, []), sum(expected.logprobs, [])):
        assert got == pytest.approx(want, abs=1e-6)
    assert result.stats.decode_steps < expected.stats.decode_steps
    per_token = kv_bytes_per_token(model.config, torch.float32)
    assert 0 < result.stats.parked_kv_bytes <= 0.5 * 4 * 30 * per_token


@pytest.mark.parametrize("options, message", [
    ({"park_budget": -1}, r"scheduler.park_budget=-1 is not allowed"),
    ({"loss_share": 2}, r"scheduler.loss_share=2 is not allowed"),
    ({"preempt_tokens": -3}, r"scheduler.preempt_tokens=-3 must be an integer >= 0"),
])
def test_a_scheduler_built_by_hand_refuses_a_bad_option_naming_it(options, message):
    for scheduler in (LeastAttainedScheduler, LengthAwareScheduler):
        with pytest.raises(ValueError, match=message):
            scheduler(**options)
