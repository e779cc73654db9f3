"""The length-aware scheduler (opt-in under "infinite") driven by the model-free simulator: its scheduling targets
on replayed lengths; and the simulator's own contract checks."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lit_grpo.scheduling import (
    FIFOScheduler,
    LengthAwareConfig,
    RolloutWork,
    RoundScheduler,
    Scheduler,
    simulate_rollout,
)
from lit_grpo.scheduling.base import ARRIVAL
from lit_grpo.scheduling.length_aware import LengthAwareScheduler, OnlineLengthPredictor, OracleLengthPredictor

from scheduler_helpers import planted_rollout

#: Options of the length-aware method itself; the rest (preempt_tokens, park_budget, loss_share) are the default's.
LENGTH_AWARE_OPTIONS = ("refill", "probe_tokens", "gain_z")


def length_aware(predictor, **kwargs) -> LengthAwareScheduler:
    """The length-aware scheduler with ``predictor``, built explicitly (the default of "infinite" has none)."""
    config = LengthAwareConfig(predictor=predictor, **{k: kwargs.pop(k) for k in LENGTH_AWARE_OPTIONS if k in kwargs})
    return LengthAwareScheduler(config, **kwargs)


class NoisyProbeOracle(OracleLengthPredictor):
    """True lengths times exp(N(0, sigma^2)), revealed only after the probe: a predictor of known quality."""

    needs_prompt_features = False
    token_conditioned = True

    def __init__(self, sigma: float) -> None:
        self.sigma = sigma

    def predict(self, work, keys, token_features=None):
        if token_features is None:
            return torch.full((len(keys),), 100.0)  # exchangeable before the probe
        true = super().predict(work, keys)
        noise = [random.Random(hash(key)).gauss(0.0, self.sigma) for key in keys]
        return true * torch.tensor(noise).exp()


def rollout_series(predictor, num_prompts, group_size, slots, seed, warmup, recurring=False, **kwargs):
    """Run ``warmup + 1`` rollouts through one scheduler; returns the last result and the scheduler."""
    generator = torch.Generator().manual_seed(seed)
    directions = torch.nn.functional.normalize(torch.randn(2, 32, generator=generator), dim=1)
    offsets = 0.5 * torch.randn(num_prompts, generator=generator) if recurring else None
    scheduler = length_aware(predictor, **kwargs)
    for _ in range(warmup + 1):
        rollout = planted_rollout(num_prompts, group_size, generator=generator, directions=directions,
                                  prompt_offsets=offsets)
        result = simulate_rollout(scheduler, rollout.lengths, slots, 1024, rollout.prompt_features,
                                  rollout.token_feature)
    return result, scheduler, rollout


def test_oracle_paper_preset_within_two_percent_of_lower_bound():
    # Preset paper: B = 1, G = 32, g = 8, 1024 new tokens; one rollout for the oracle to earn the scheduler's trust.
    for seed in range(6):
        result, scheduler, rollout = rollout_series("oracle", 1, 32, 8, seed, warmup=1)
        assert result.decode_steps <= 1.02 * result.lower_bound_steps
        assert result.parked_samples == 0 and scheduler.probe_tokens is None
        assert result.metrics["length_pred_kendall_tau"] == pytest.approx(1.0)
        assert result.metrics["length_pred_smape"] == 0.0
        micro = simulate_rollout(RoundScheduler(), rollout.lengths, 8, 1024)
        assert result.decode_steps < 0.8 * micro.decode_steps


def test_online_after_warmup_within_five_percent_of_lower_bound():
    ratios = []
    for seed in range(4):
        result, scheduler, rollout = rollout_series("online", 1, 32, 8, seed, warmup=5)
        continuous = simulate_rollout(FIFOScheduler(), rollout.lengths, 8, 1024)
        assert result.decode_steps <= continuous.decode_steps
        assert result.metrics["length_pred_kendall_tau"] > 0.7
        assert result.parked_samples > 0 and scheduler.last_info["peak_parked"] <= 32
        ratios.append(result.ratio)
    assert sum(ratios) / len(ratios) <= 1.05
    assert max(ratios) <= 1.08


@pytest.mark.parametrize("predictor", ["oracle", "online"])
def test_multi_prompt_slot_utilization(predictor):
    # B = 8, G = 16, g = 8; prompts recur with the same length profile.
    result, _, rollout = rollout_series(predictor, 8, 16, 8, seed=0, warmup=1 if predictor == "oracle" else 2,
                                        recurring=True)
    assert result.slot_utilization >= 0.95
    continuous = simulate_rollout(FIFOScheduler(), rollout.lengths, 8, 1024)
    assert result.decode_steps <= continuous.decode_steps


def test_scheduler_state_resumes_the_predictor():
    _, scheduler, rollout = rollout_series("online", 2, 16, 4, seed=0, warmup=2)
    resumed = length_aware("online")
    resumed.load_state_dict(scheduler.state_dict())
    results = [simulate_rollout(s, rollout.lengths, 4, 1024, rollout.prompt_features, rollout.token_feature)
               for s in (scheduler, resumed)]
    assert results[0].decode_steps == results[1].decode_steps
    assert results[0].metrics == results[1].metrics


def test_lpt_refill_beats_sjf_under_mispredictions():
    """Why the default refill is LPT: same plan, same noisy predictions (log error 0.3), guard off."""

    def mean_ratio(refill):
        ratios = []
        for seed in range(6):
            rollout = planted_rollout(1, 32, generator=torch.Generator().manual_seed(seed))
            scheduler = length_aware(NoisyProbeOracle(0.3), refill=refill)
            simulate_rollout(scheduler, rollout.lengths, 8, 1024)  # the probes earn trust
            ratios.append(simulate_rollout(scheduler, rollout.lengths, 8, 1024).ratio)
        return sum(ratios) / len(ratios)

    lpt, sjf = mean_ratio("lpt"), mean_ratio("sjf")
    assert lpt < sjf - 0.03
    # the measured winner is what a length-aware scheduler gets
    assert LengthAwareConfig().refill == "lpt" and LengthAwareScheduler().refill.name == "lpt"
    # With exact lengths the plan balances the slots and the order inside a slot no longer matters.
    exact = []
    for refill in ("lpt", "sjf"):
        scheduler = length_aware(NoisyProbeOracle(0.0), refill=refill)
        lengths = planted_rollout(1, 32).lengths
        simulate_rollout(scheduler, lengths, 8, 1024)
        exact.append(simulate_rollout(scheduler, lengths, 8, 1024).decode_steps)
    assert abs(exact[0] - exact[1]) <= 0.01 * exact[0]


def _parked_peak_of_the_record(decisions) -> int:
    """The most samples parked at once by the decisions' record: parks minus resumes, at its highest."""
    parked = peak = 0
    for decision in decisions:
        parked += (decision.action == "park") - (decision.action == "resume")
        peak = max(peak, parked)
    return peak


def test_park_budget_bounds_parked_samples():
    """The documented bound (length_aware/scheduler.py, 1.): at most ``max_parked + slots - 1`` samples parked at
    once, ``max_parked = park_budget x slots x max_new_tokens / k``."""
    rollout = planted_rollout(16, 16, generator=torch.Generator().manual_seed(1))
    scheduler = length_aware(NoisyProbeOracle(0.2), park_budget=0.05)  # 0.05 * 4 * 1024 / 8 = 25 samples
    simulate_rollout(scheduler, rollout.lengths, 4, 1024)  # the probes earn trust
    result = simulate_rollout(scheduler, rollout.lengths, 4, 1024)
    assert scheduler.last_info["parking"] == 1.0 and scheduler.last_info["max_parked"] == 25
    assert result.peak_parked == scheduler.last_info["peak_parked"] <= 25 + 4 - 1
    assert _parked_peak_of_the_record(scheduler.decisions) == result.peak_parked
    assert result.generated_tokens == sum(map(sum, rollout.lengths))
    assert result.decode_steps <= 1.1 * result.lower_bound_steps


def test_the_last_probe_round_may_exceed_the_budget_by_slots_minus_one():
    """The budget is checked while unprobed samples remain; the last probe round (here all 8 slots, started
    together below the budget of 10) parks regardless so that the plan sees every probe: the documented
    ``max_parked + slots - 1``, not more."""
    rollout = planted_rollout(4, 4, generator=torch.Generator().manual_seed(7), max_new_tokens=256,
                              mean_log_length=3.5)
    scheduler = length_aware(NoisyProbeOracle(0.5), probe_tokens=2, gain_z=None, park_budget=0.01)
    for _ in range(3):  # the probes earn trust
        result = simulate_rollout(scheduler, rollout.lengths, 8, 256)
    assert scheduler.last_info["parking"] == 1.0 and scheduler.last_info["max_parked"] == 10  # 0.01 x 8 x 256 / 2
    assert 10 < result.peak_parked <= 10 + 8 - 1
    assert _parked_peak_of_the_record(scheduler.decisions) == result.peak_parked
    assert result.generated_tokens == sum(map(sum, rollout.lengths))


def test_short_samples_and_no_probe():
    # Every sample ends within the probe, one exactly at it: nothing is parked, everything finishes.
    lengths = [[1, 3, 8, 5], [2, 7, 8, 4]]
    result = simulate_rollout(length_aware(NoisyProbeOracle(0.0)), lengths, 2, 64)
    assert result.parked_samples == 0 and result.generated_tokens == 38
    assert result.decode_steps <= result.lower_bound_steps + 8
    # probe_tokens=None: the online predictor plans from prompt features alone.
    rollout = planted_rollout(2, 8)
    scheduler = length_aware("online", probe_tokens=None)
    result = simulate_rollout(scheduler, rollout.lengths, 4, 1024, rollout.prompt_features)
    assert result.parked_samples == 0 and scheduler.probe_tokens is None
    assert set(result.metrics) == {"length_pred_kendall_tau", "length_pred_smape", "preempting"}


def test_the_simulator_refuses_groups_of_different_sizes():
    # a longer row's extra samples never ran but were counted in generated_tokens and the lower bound
    with pytest.raises(ValueError, match=r"G = 2 samples per prompt .* rows \[1\] have \[3\]"):
        simulate_rollout(FIFOScheduler(), [[3, 3], [5, 5, 5]], 2)
    with pytest.raises(ValueError, match=r"rows \[1\] have \[1\]"):
        simulate_rollout(FIFOScheduler(), [[3, 3], [5]], 2)


def test_simulator_enforces_the_contract():
    class Crowding(Scheduler):
        def _pick(self, num_free, num_running):
            return [self._pop_unstarted()] if self._peek_unstarted() is not None else []

        def admit(self):
            return [self._place(0, key, ARRIVAL) for key in self._pick(1, 0)]  # slot 0, whether free or not

    with pytest.raises(RuntimeError, match="placed sample .* in slot 0, which runs"):
        simulate_rollout(Crowding(), [[3, 3, 3]], 2)

    class Unrecorded(Scheduler):
        def admit(self):
            return [(1, key) for key in self._pick(1, 0)]  # an assignment its own record does not hold

    with pytest.raises(RuntimeError, match="record holds"):
        simulate_rollout(Unrecorded(), [[2, 2]], 2)

    class Idle(Scheduler):
        def _pick(self, num_free, num_running):
            return []

    with pytest.raises(RuntimeError, match="deadlock"):
        simulate_rollout(Idle(), [[2]], 1)
    # The base FIFO and round schedulers: continuous refills at once, rounds wait for their longest member.
    lengths = [[4, 1, 1, 1]]
    assert simulate_rollout(FIFOScheduler(), lengths, 2).decode_steps == 4
    assert simulate_rollout(RoundScheduler(), lengths, 2).decode_steps == 5


def test_work_given_to_the_scheduler():
    seen = {}

    class Spy(LengthAwareScheduler):
        def begin(self, work: RolloutWork) -> None:
            seen["work"] = work
            super().begin(work)

    rollout = planted_rollout(2, 4)
    simulate_rollout(Spy(LengthAwareConfig("online")), rollout.lengths, 2, 1024, rollout.prompt_features,
                     rollout.token_feature)
    assert seen["work"].prompt_features.shape == (2, 32)
    simulate_rollout(Spy(LengthAwareConfig("oracle")), rollout.lengths, 2, 1024, rollout.prompt_features)
    assert seen["work"].prompt_features is None  # not asked for
    assert seen["work"].true_lengths == rollout.lengths
    assert math.isclose(sum(map(sum, rollout.lengths)), sum(map(sum, seen["work"].true_lengths)))


class _ProbingOracle(OracleLengthPredictor):
    """The oracle, token-conditioned so that samples are probed and parked."""

    token_conditioned = True


@pytest.mark.parametrize("slots", [4, 11])
def test_the_predictor_learns_every_finished_sample_once_in_batches(slots):
    """Learning happens in batches, when the plan is refreshed and at the end of the rollout, not at every
    finish between decode steps, and no finished sample is left out or taught twice."""
    lengths = [[5, 40, 3, 22, 9, 31], [17, 2, 26, 8, 12, 35]]
    for predictor in (_ProbingOracle(), OnlineLengthPredictor()):
        calls = []
        original = predictor.observe
        predictor.observe = lambda work, keys, *rest, _orig=original: (calls.append(list(keys)), _orig(work, keys,
                                                                                                        *rest))[1]
        scheduler = length_aware(predictor, probe_tokens=4)
        for _ in range(2):
            calls.clear()
            simulate_rollout(scheduler, lengths, slots, 40)
            observed = [key for call in calls for key in call]
            assert sorted(observed) == [(p, k) for p in range(2) for k in range(6)]
            assert len(calls) < len(observed)  # batched: fewer calls than samples
            if slots == 11:  # one sample waits: nothing is refreshed, everything is learned at the end
                assert len(calls) == 2  # one call for the probed samples, one for those that ended before


@pytest.mark.parametrize("preempt_tokens", [8, None])
def test_a_slot_for_every_sample_asks_nothing_of_the_predictor(preempt_tokens):
    """With a slot for every sample nothing waits and no order is chosen: the rollout neither predicts nor
    learns (on a GPU the host's work would be the accelerator's idle time), runs as first-come, and reports
    no prediction quality; one sample more than slots and the predictor is used again."""
    lengths = [[5, 40, 3, 22, 9, 31], [17, 2, 26, 8, 12, 35]]
    rollout = planted_rollout(2, 6)
    predictor, calls = OnlineLengthPredictor(), []
    for name in ("predict", "observe"):
        original = getattr(predictor, name)
        setattr(predictor, name, lambda *args, _name=name, _orig=original, **kw: (calls.append(_name),
                                                                                   _orig(*args, **kw))[1])
    scheduler = length_aware(predictor, probe_tokens=4, preempt_tokens=preempt_tokens)
    for _ in range(2):
        result = simulate_rollout(scheduler, lengths, 12, 40, rollout.prompt_features, rollout.token_feature)
        assert result.decode_steps == simulate_rollout(FIFOScheduler(), lengths, 12, 40).decode_steps == 40
        assert calls == [] and result.metrics == {"preempting": 0.0} and scheduler.parked_samples == 0
        assert math.isnan(scheduler.last_info["length_pred_kendall_tau"])
    simulate_rollout(scheduler, lengths, 11, 40, rollout.prompt_features, rollout.token_feature)
    assert {"predict", "observe"} <= set(calls)
    assert math.isfinite(scheduler.last_info["length_pred_kendall_tau"])


@pytest.mark.parametrize("num_slots", [0, 2.5, True])
def test_the_simulator_names_a_bad_slot_count(num_slots):
    with pytest.raises(ValueError, match=rf"num_slots={num_slots!r} is not allowed; num_slots must be an integer >= 1"):
        simulate_rollout(FIFOScheduler(), [[3, 5]], num_slots)


def test_a_hand_made_rollout_work_names_a_bad_field():
    """A scheduler or predictor driven by hand gets its ``RolloutWork`` checked once, where it is built: a group of
    0 samples ran nothing, prompt features of the wrong rows were indexed deep in the predictor or silently reused."""
    fine = dict(prompt_lengths=[3, 4], group_size=2, num_slots=2, max_new_tokens=8)
    RolloutWork(**fine, prompt_features=torch.zeros(2, 5), true_lengths=[[1, 8], [2, 3]])
    for name, value, says in (
            ("group_size", 0, r"group_size=0 is not allowed; group_size must be an integer >= 1"),
            ("num_slots", 1.5, r"num_slots=1.5 is not allowed; num_slots must be an integer >= 1"),
            ("max_new_tokens", 0, r"max_new_tokens=0 is not allowed"),
            ("prompt_features", torch.zeros(3, 5), r"prompt_features must be \[B, H\] = \[2, H\], got shape \(3, 5\)"),
            ("prompt_features", torch.zeros(2), r"prompt_features must be \[B, H\] = \[2, H\], got shape \(2,\)"),
            ("true_lengths", [[1, 2]], r"true_lengths must be \[B\]\[G\] = \[2\]\[2\]"),
            ("true_lengths", [[1, 2], [3]], r"true_lengths must be \[B\]\[G\] = \[2\]\[2\]")):
        with pytest.raises(ValueError, match=says):
            RolloutWork(**{**fine, name: value})


def _state_copy(state):
    """A deep copy of a scheduler state (mappings, lists, numbers, tensors)."""
    if isinstance(state, dict):
        return {key: _state_copy(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_state_copy(value) for value in state)
    return state.clone() if isinstance(state, torch.Tensor) else state


@pytest.mark.parametrize("change, message", [
    (lambda state: state["trust"].__setitem__("tokens", state["trust"]["probe"]),
     r"^the checkpoint's scheduler state has trust for unknown kinds \['tokens'\]; a length-aware scheduler keeps "
     r"prompt, probe$"),
    # a kind shown as every key is: sorting by str() failed for an int of more than 4300 digits
    (lambda state: state["trust"].__setitem__(10**5000, state["trust"]["probe"]),
     r"^the checkpoint's scheduler state has trust for unknown kinds \[an int of 5001 digits\]; a length-aware "),
    (lambda state: state.__setitem__("trust", [state["trust"]["probe"]]),
     r"^the checkpoint's scheduler state trust must be a mapping of kinds \(prompt, probe\) to trust states, not "
     r"list$"),
    # the predictor's state and the groups are good: they are not taken either
    (lambda state: state["trust"]["probe"].__setitem__("decay", 0.0),
     r"^the checkpoint's scheduler state trust\['probe'\] does not load: trust state decay=0.0 is not allowed; trust "
     r"state decay must be a finite number > 0 and <= 1$"),
    (lambda state: state.__setitem__("predictor", {"spread": 0.25, "seed": 0, "rollout": 3}),
     r"^the checkpoint's length predictor state does not load into this run's OnlineLengthPredictor: an "
     r"OnlineLengthPredictor state lacks \['max_dim', 'min_token_observations', "),  # another predictor's
    (lambda state: state["predictor"]["prompt_model"].__setitem__("sy", math.inf),
     r"^the checkpoint's length predictor state does not load into this run's OnlineLengthPredictor: online "
     r"predictor state prompt_model.sy=inf is not allowed"),
    # checked before the predictor's state is taken, which the default scheduler's groups follow
    (lambda state: state["groups"].append([]), r"^scheduler state groups\[\d+\]=\[\] is not allowed; a finished "
                                               r"group is a non-empty list of its samples' lengths"),
    (lambda state: state.__setitem__("rollout_index", 2), r"^a LengthAwareScheduler state has unknown keys "
                                                          r"\['rollout_index'\]; it holds groups, preemption, "),
])
def test_a_bad_scheduler_state_is_refused_naming_where_and_nothing_is_taken(change, message):
    """A scheduler state whose trust or predictor is bad is refused naming which (the kind of trust, the predictor
    this run has), before any of it is taken: an unknown kind was a bare KeyError, a bad trust state did not say
    which, and the predictor's state and the groups were taken before a trust state failed."""
    _, written, _ = rollout_series("online", 2, 8, 4, seed=0, warmup=1)
    state = _state_copy(written.state_dict())
    change(state)
    _, scheduler, _ = rollout_series("online", 2, 8, 4, seed=1, warmup=1)
    before = _state_copy(scheduler.state_dict())
    with pytest.raises(ValueError, match=message):
        scheduler.load_state_dict(state)
    after = scheduler.state_dict()
    assert after["groups"] == before["groups"] and after["trust"] == before["trust"]
    assert all(torch.equal(after["predictor"][model][key], before["predictor"][model][key])
               for model in ("prompt_model", "token_model") for key in ("sx", "sxx", "sxy"))
    assert after["predictor"]["prompt_model"]["sw"] == before["predictor"]["prompt_model"]["sw"]


def test_a_scheduler_state_without_one_kind_of_trust_keeps_that_kind_fresh():
    """A state that lacks a kind of trust (the probe's, of a run whose predictor was never probed) leaves that kind
    as it is; the other is taken."""
    _, written, _ = rollout_series("online", 2, 8, 4, seed=0, warmup=1)
    state = written.state_dict()
    del state["trust"]["probe"]
    scheduler = length_aware("online")
    scheduler.load_state_dict(state)
    assert scheduler.trust["prompt"].state_dict() == written.trust["prompt"].state_dict()
    assert scheduler.trust["probe"].state_dict() == length_aware("online").trust["probe"].state_dict()


def test_a_default_schedulers_state_gives_a_length_aware_one_its_groups_checked():
    """The default scheduler's state (no predictor) gives the length-aware scheduler its finished groups, said, and
    is checked as the default's is: a bad group is refused, the groups left as they were."""
    scheduler = length_aware("online")
    with pytest.warns(UserWarning, match=r"the length-aware method's predictor and trust start fresh"):
        scheduler.load_state_dict({"groups": [[3, 4]]})
    assert list(scheduler.groups) == [[3, 4]]
    with pytest.raises(ValueError, match=r"^scheduler state groups\[0\]=\[3, None\] is not allowed"):
        scheduler.load_state_dict({"groups": [[3, None]]})
    assert list(scheduler.groups) == [[3, 4]]
