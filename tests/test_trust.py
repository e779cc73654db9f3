"""The length-aware scheduler uses a length prediction only as far as it has earned trust
(lit_grpo/scheduling/length_aware/trust.py)."""

from __future__ import annotations

import math
import re
import random

import pytest
import torch

from lit_grpo.scheduling import (FIFOScheduler, LeastAttainedScheduler, LengthAwareConfig,
                                 simulate_rollout)
from lit_grpo.scheduling.least_attained import LOSS_SHARE
from lit_grpo.scheduling.length_aware import LengthAwareScheduler, OracleLengthPredictor, PredictionTrust
from lit_grpo.scheduling.length_aware.trust import probes_pay

from scheduler_helpers import planted_rollout


def _lognormal_pairs(rng: random.Random, n: int, noise: float) -> list[tuple[float, int]]:
    """(prediction, length) with log length ~ N(5, 1) and log prediction = log length + N(0, noise^2)."""
    pairs = []
    for _ in range(n):
        log_length = rng.gauss(5.0, 1.0)
        pairs.append((math.exp(log_length + rng.gauss(0.0, noise)), max(1, round(math.exp(log_length)))))
    return pairs


def _trust_from(pairs, rollout_size: int = 32) -> PredictionTrust:
    trust = PredictionTrust()
    for i, (predicted, length) in enumerate(pairs, 1):
        trust.observe(predicted, length)
        if i % rollout_size == 0:
            trust.end_rollout()
    return trust


def test_noise_earns_no_trust_and_calibrates_to_the_population():
    rng = random.Random(0)
    lengths = [max(1, round(math.exp(rng.gauss(5.0, 1.0)))) for _ in range(256)]
    trust = _trust_from([(math.exp(rng.gauss(5.0, 1.0)), n) for n in lengths])  # predictions unrelated to lengths
    assert abs(trust.rho) < 0.2 and trust.rho_low == 0.0 and not trust.informative
    median_a, spread_a = trust.calibrate(10.0)
    median_b, spread_b = trust.calibrate(900.0)
    assert median_a == pytest.approx(median_b) and spread_a == pytest.approx(spread_b)  # every sample alike
    assert spread_a == pytest.approx(1.0, abs=0.15)  # the population's own spread of log length


def test_trust_grows_with_the_evidence_and_the_signal():
    rng = random.Random(1)
    few = _trust_from(_lognormal_pairs(rng, 6, noise=0.5), rollout_size=6)
    many = _trust_from(_lognormal_pairs(rng, 256, noise=0.5))
    assert few.rho_low < many.rho_low  # the same signal seen on more samples is trusted more
    assert many.rho == pytest.approx(1 / math.sqrt(1 + 0.25), abs=0.08)  # corr of t and t + noise
    noisier = _trust_from(_lognormal_pairs(rng, 256, noise=1.5))
    assert 0 < noisier.rho_low < many.rho_low
    # Calibration: a noisy predictor's predictions are pulled toward the mean, and its spread is the residual.
    median, spread = noisier.calibrate(math.exp(7.0))
    assert math.exp(5.0) < median < math.exp(7.0)
    assert spread < 1.0


def test_an_exact_predictor_is_followed_exactly():
    trust = _trust_from([(float(n), n) for n in range(1, 65)])
    assert trust.rho_low == pytest.approx(1.0)
    median, spread = trust.calibrate(37.0)
    assert median == pytest.approx(37.0, rel=1e-6) and spread < 1e-6


def test_a_predictor_that_only_follows_the_average_ranks_nothing():
    """Predictions that move with each rollout's mean length, but are the same for all its samples, correlate with
    lengths across rollouts and carry nothing a scheduler can rank by: trust is measured within rollouts."""
    rng = random.Random(2)
    trust = PredictionTrust()
    for rollout in range(16):
        level = 3.0 + 0.3 * rollout  # the policy's completions grow longer, and the predictor follows
        for _ in range(32):
            trust.observe(math.exp(level), max(1, round(math.exp(level + rng.gauss(0.0, 0.5)))))
        trust.end_rollout()
    assert trust.rho_low == 0.0


def test_the_spread_is_unknown_until_a_rollout_has_shown_two_pairs():
    # Centred on its rollout's mean a lone pair deviates by nothing: a spread of 0 would claim exact lengths
    trust = PredictionTrust()
    trust.observe(40.0, 50)
    median, spread = trust.calibrate(40.0)
    assert median == pytest.approx(50.0) and spread == math.inf and trust.population()[1] == math.inf
    trust.end_rollout()
    trust.observe(80.0, 90)  # a second rollout of one pair: still nothing within a rollout
    assert trust.calibrate(40.0)[1] == math.inf and not trust.spread_known
    assert not probes_pay(trust, num_samples=32, num_slots=4, cap=256)  # an unmeasured spread earns nothing
    trust.observe(60.0, 30)
    assert trust.spread_known and 0 < trust.calibrate(40.0)[1] < math.inf
    resumed = PredictionTrust()
    resumed.load_state_dict(trust.state_dict())
    assert resumed.calibrate(40.0) == trust.calibrate(40.0)
    fresh = PredictionTrust()
    fresh.observe(40.0, 50)
    fresh.end_rollout()
    resumed.load_state_dict(fresh.state_dict())
    assert resumed.calibrate(40.0)[1] == math.inf


@pytest.mark.parametrize("rollout_size", [2, 3])
def test_the_spread_covers_as_nominal_for_small_rollouts(rollout_size):
    """Each rollout's pairs deviate from their own estimated mean, which takes a degree of freedom: pooled over
    N - k (k rollouts), not N, the calibrated interval median x exp(+-1.645 spread) holds a new sample's length 90%
    of the time for rollouts of 2 or 3 samples too (over N it held 76% and 82%). Lengths are lognormal(5, 0.8),
    predictions unrelated (no trust: the spread is the population's); coverage is that of the true distribution,
    averaged over 20 simulated runs."""
    z, mu, sigma = 1.6448536269514722, 5.0, 0.8

    def normal_cdf(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    coverages = []
    for seed in range(20):
        rng, trust = random.Random(seed), PredictionTrust()
        for _ in range(600 // rollout_size):
            for _ in range(rollout_size):
                trust.observe(math.exp(rng.gauss(mu, sigma)), max(1, round(math.exp(rng.gauss(mu, sigma)))))
            trust.end_rollout()
        median, spread = trust.calibrate(100.0)
        low, high = math.log(median) - z * spread, math.log(median) + z * spread
        coverages.append(normal_cdf((high - mu) / sigma) - normal_cdf((low - mu) / sigma))
    assert sum(coverages) / len(coverages) == pytest.approx(0.90, abs=0.02)


@pytest.mark.parametrize("rollout_size", [2, 3])
def test_rho_low_covers_as_nominal_for_small_rollouts(rollout_size):
    """rho is measured within rollouts, each rollout's pairs about their own mean, so its Fisher z has the
    standard error of the pairs' degrees of freedom (``effective_dof``: N - k), not of the N pairs: the one-sided
    bound rho_low stays below the true correlation as often as confidence_z = 2 claims (97.7%) for rollouts of 2 or
    3 samples too (over N: 91% and 96%). Pairs with correlation 0.5 in log space about a level each rollout draws
    anew (the policy's drift), 400 simulated runs of 120 pairs."""
    rho, spread = 0.5, 0.8
    covered = 0
    for seed in range(400):
        rng, trust = random.Random(seed), PredictionTrust()
        for _ in range(120 // rollout_size):
            level = 5.0 + rng.gauss(0.0, 0.5)
            for _ in range(rollout_size):
                z1, z2 = rng.gauss(0.0, 1.0), rng.gauss(0.0, 1.0)
                log_length = level + spread * (rho * z1 + math.sqrt(1 - rho * rho) * z2)
                trust.observe(math.exp(level + spread * z1), max(1, round(math.exp(log_length))))
            trust.end_rollout()
        covered += trust.rho_low <= rho
    assert covered / 400 == pytest.approx(0.977, abs=0.015)


def test_a_checkpoint_without_the_weighted_degrees_of_freedom_keeps_its_spread():
    """A trust state saved before the degrees of freedom were kept calibrates as it did then (its past's variances
    over their weight), until its pairs decay."""
    trust = _trust_from(_lognormal_pairs(random.Random(5), 64, noise=0.5), rollout_size=4)
    state = trust.state_dict()
    del state["past_dof_weight"]
    old = PredictionTrust()
    old.load_state_dict(state)
    weight, ctt = state["past"][0], state["past"][5]  # the past's weight and centred sum of t^2
    assert old.population()[1] == pytest.approx(math.sqrt(ctt / weight))
    assert old.population()[1] < trust.population()[1]


def test_trust_survives_a_checkpoint():
    trust = _trust_from(_lognormal_pairs(random.Random(3), 100, noise=0.3))
    resumed = PredictionTrust()
    resumed.load_state_dict(trust.state_dict())
    assert resumed.rho_low == trust.rho_low and resumed.calibrate(50.0) == trust.calibrate(50.0)


def test_the_effective_count_of_decayed_pairs_is_kishs():
    # (sum w)^2 / sum w^2: a rollout's pairs count plainly until it is folded in, then decayed (by 0.5 a pair here)
    # and shared equally: the rollout's two pairs weigh what 0.5 and 1 sum to, 0.75 each
    trust = PredictionTrust(decay=0.5)
    trust.observe(10.0, 12)
    trust.observe(20.0, 18)
    assert trust.effective_count == 2
    trust.end_rollout()
    assert trust.effective_count == pytest.approx(2.0)
    trust.observe(30.0, 25)  # and a new one 1
    assert trust.effective_count == pytest.approx(2.5 ** 2 / (2 * 0.75 ** 2 + 1))


def test_the_effective_count_is_that_of_the_weights_the_statistics_use():
    # Kish's count must describe the weights the means and spreads are computed with (each rollout's pairs alike):
    # recompute the statistics from explicit per-pair weights and compare both
    rng, decay = random.Random(4), 0.9
    trust, pairs, weights = PredictionTrust(decay=decay), [], []
    for size in (5, 3, 8):
        rollout = [(math.exp(rng.gauss(3.0, 1.0)), rng.randint(1, 200)) for _ in range(size)]
        for predicted, length in rollout:
            trust.observe(predicted, length)
        trust.end_rollout()
        shrink = decay ** size
        weights = [w * shrink for w in weights] + [(1 - shrink) / (1 - decay) / size] * size
        pairs += rollout
    assert trust.effective_count == pytest.approx(sum(weights) ** 2 / sum(w * w for w in weights))
    mean_t = sum(w * math.log(n) for w, (_, n) in zip(weights, pairs)) / sum(weights)
    assert trust.population()[0] == pytest.approx(mean_t)


@pytest.mark.parametrize("loss_share", [LOSS_SHARE, None])
def test_predictions_without_information_cost_nothing_against_the_default(loss_share):
    """Random features: the length-aware scheduler makes every decision the default scheduler makes on the same
    rollouts (first come here with the default's gate; preempting from the second rollout on without it), and
    never parks at a probe."""
    generator = torch.Generator().manual_seed(0)
    scheduler = LengthAwareScheduler(LengthAwareConfig("online"), loss_share=loss_share)
    default = LeastAttainedScheduler(loss_share=loss_share)
    preempted = 0
    for _ in range(4):
        lengths = planted_rollout(1, 32, generator=generator).lengths
        features = torch.randn(1, 32, generator=generator)
        noise = {}

        def token_feature(key, _):
            return noise.setdefault(key, torch.randn(32, generator=generator))

        result = simulate_rollout(scheduler, lengths, 8, 1024, prompt_features=features, reveal_lengths=False,
                                  token_feature=token_feature)
        expected = simulate_rollout(default, lengths, 8, 1024)
        assert result.decode_steps == expected.decode_steps
        assert scheduler.decisions == default.decisions and scheduler.preempting == default.preempting
        assert scheduler.last_info["parking"] == 0.0 and "probe" not in {d.reason for d in scheduler.decisions}
        if loss_share is not None:  # the default's gate chose first come: plain continuous order
            assert result.decode_steps == simulate_rollout(FIFOScheduler(), lengths, 8, 1024).decode_steps
        preempted += scheduler.preempting
    assert preempted == (0 if loss_share is not None else 3)
    assert not scheduler.trust["prompt"].informative and not scheduler.trust["probe"].informative


class _NoisyOracle(OracleLengthPredictor):
    def __init__(self, spread: float) -> None:
        self.spread, self.rng = spread, random.Random(0)

    def predict(self, work, keys, token_features=None):
        true = super().predict(work, keys)
        return true * torch.tensor([math.exp(self.rng.gauss(0.0, self.spread)) for _ in keys])


def test_trusted_predictions_beat_continuous_once_earned():
    """An informative predictor earns trust within its first rollout and then plans; the trust is in the state."""
    generator = torch.Generator().manual_seed(5)
    scheduler = LengthAwareScheduler(LengthAwareConfig(_NoisyOracle(0.25)))
    ours = continuous = 0
    for _ in range(4):
        lengths = planted_rollout(4, 16, generator=generator).lengths
        ours += simulate_rollout(scheduler, lengths, 8, 1024).decode_steps
        continuous += simulate_rollout(FIFOScheduler(), lengths, 8, 1024).decode_steps
    assert scheduler.trust["prompt"].rho_low > 0.8
    assert ours < continuous
    assert "trust" in scheduler.state_dict()


def test_the_engine_checkpoint_carries_the_predictor_and_its_trust(tiny_llama, prompt_ids):
    """A length-aware engine's state (RolloutEngine.state_dict) holds what its scheduler learned: the predictor,
    the trust its predictions earned and the default's finished groups."""
    from lit_grpo.sampling import RolloutEngine, SamplingConfig
    from lit_grpo.scheduling import RolloutWork

    model, tokenizer = tiny_llama
    config = SamplingConfig(group_size=4, micro_group_size=2, strategy="infinite", max_new_tokens=6,
                            scheduler={"length_aware": {"predictor": "online", "probe_tokens": 2}})
    engine = RolloutEngine(model, tokenizer, config=config)
    assert type(engine.scheduler) is LengthAwareScheduler
    for _ in range(2):
        engine.generate(prompt_ids[:2])
    restored = RolloutEngine(model, tokenizer, config=config)
    restored.load_state_dict(engine.state_dict())
    work = RolloutWork([3, 3], 4, 2, 6, prompt_features=torch.randn(2, model.config.hidden_size))
    keys = [(0, 1), (1, 2)]
    assert engine.scheduler.predictor.prompt_model.sw > 0  # it learned something to carry
    assert engine.scheduler.predictor.predict(work, keys).tolist() == \
        restored.scheduler.predictor.predict(work, keys).tolist()
    for kind in ("prompt", "probe"):
        assert restored.scheduler.trust[kind].state_dict() == engine.scheduler.trust[kind].state_dict()
    assert engine.scheduler.trust["probe"].effective_count > 0
    assert list(restored.scheduler.groups) == list(engine.scheduler.groups) and len(engine.scheduler.groups) == 4


@pytest.mark.parametrize("setting, message", [
    (dict(decay=0.0), r"^decay=0.0 is not allowed; decay must be a finite number > 0 and <= 1"),
    (dict(decay=1.5), r"^decay=1.5 is not allowed; decay must be a finite number > 0 and <= 1"),
    (dict(decay=-0.5), r"^decay=-0.5 is not allowed"),
    (dict(decay="0.9"), r"^decay='0.9' is not allowed"),
    (dict(confidence_z=-1.0), r"^confidence_z=-1.0 is not allowed; confidence_z must be a finite number >= 0"),
    (dict(confidence_z=math.inf), r"^confidence_z=inf is not allowed"),
])
def test_bad_trust_settings_are_refused_naming_them(setting, message):
    # above 1 the older pairs' weights would grow without bound, at or below 0 vanish or flip sign; a negative
    # confidence would trust more than is measured
    with pytest.raises(ValueError, match=message):
        PredictionTrust(**setting)
    assert PredictionTrust(decay=1, confidence_z=0).decay == 1.0  # no forgetting; the measured rho as it is


def _state_with(**changes) -> dict:
    """A measured trust's state with ``changes``: a key to None is dropped; ``"past[0]"`` sets one entry."""
    state = _trust_from(_lognormal_pairs(random.Random(7), 40, noise=0.5), rollout_size=8).state_dict()
    for key, value in changes.items():
        if "[" in key:
            name, index = key.rstrip("]").split("[")
            state[name][int(index)] = value
        elif value is None:
            del state[key]
        else:
            state[key] = value
    return state


@pytest.mark.parametrize("state, message", [
    ([0.99, 2.0], r"^a PredictionTrust state must be a mapping of decay, confidence_z, past, current, past_dof, "
                  r"past_dof_weight, not list$"),
    (_state_with(past=None), r"^a PredictionTrust state lacks \['past'\]; it holds decay, confidence_z, past, "
                             r"current, past_dof, past_dof_weight \(past_dof and past_dof_weight may be absent\)$"),
    (_state_with(alphas=[1.0]), r"^a PredictionTrust state has unknown keys \['alphas'\]; it holds decay, "),
    (_state_with(decay=0.0), r"^trust state decay=0.0 is not allowed; trust state decay must be a finite number > 0 "
                             r"and <= 1$"),
    (_state_with(decay="0.99"), r"^trust state decay='0.99' is not allowed"),
    (_state_with(confidence_z=-2.0), r"^trust state confidence_z=-2.0 is not allowed; trust state confidence_z "
                                     r"must be a finite number >= 0$"),
    (_state_with(past=[1.0] * 6), r"^trust state past=\[1.0, 1.0, 1.0, 1.0, 1.0, 1.0\] must be a list of 7 "
                                  r"numbers \(the past rollouts' weight, squared weight, sums of m and t"),
    (_state_with(current="abc"), r"^trust state current='abc' must be a list of 6 numbers \(the current "
                                 r"rollout's count, sums of m, t, m\^2, t\^2, m\*t\)$"),
    (_state_with(**{"past[0]": -1.0}), r"^trust state past\[0\]=-1.0 is not allowed; trust state past\[0\] must be "
                                       r"a finite number >= 0$"),
    (_state_with(**{"past[4]": math.nan}), r"^trust state past\[4\]=nan is not allowed; trust state past\[4\] must "
                                           r"be a finite number$"),
    (_state_with(**{"current[0]": 2.5}), r"^trust state current\[0\]=2.5 is not allowed; the current rollout's "
                                         r"count of pairs must be a whole number >= 0$"),
    (_state_with(**{"current[3]": -1.0}), r"^trust state current\[3\]=-1.0 is not allowed; trust state "
                                          r"current\[3\] must be a finite number >= 0$"),
    (_state_with(past_dof=-1.0), r"^trust state past_dof=-1.0 is not allowed; trust state past_dof must be a "
                                 r"finite number >= 0$"),
    (_state_with(past_dof_weight=math.inf), r"^trust state past_dof_weight=inf is not allowed"),
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed, a long one ran on
    (_state_with(past=[10**5000] * 6), r"^trust state past=a list holding an int of more than \d+ digits must be a "
                                       r"list of 7 numbers \(the past rollouts'"),
    (_state_with(current=10**5000), r"^trust state current=\(an int of 5001 digits\) must be a list of 6 numbers"),
    (_state_with(current=[0.0] * 1000), rf"^trust state current={re.escape(repr([0.0] * 1000)[:100])} must be a list "
                                        r"of 6 numbers"),
])
def test_a_bad_trust_state_is_refused_naming_the_bad_key_and_the_trust_is_left_as_it_was(state, message):
    """A corrupt or foreign checkpoint's trust state (another object's, a wrong length, a value out of range) is
    refused naming what is wrong and what is allowed, before any of it is taken: taken, it failed later, far from
    the checkpoint, or calibrated with nonsense."""
    trust = _trust_from(_lognormal_pairs(random.Random(8), 24, noise=0.3), rollout_size=8)
    before = trust.state_dict()
    with pytest.raises(ValueError, match=message):
        trust.load_state_dict(state)
    assert trust.state_dict() == before


def test_a_trust_state_of_numpy_numbers_or_tuples_loads_as_plain_floats():
    """What the checks take they keep as plain floats: a state written through numpy resumes as the one it was."""
    import numpy as np

    state = _state_with()
    numpy_state = {**state, "decay": np.float64(state["decay"]), "past": tuple(np.float64(x) for x in state["past"]),
                   "past_dof": np.int64(state["past_dof"])}
    trust, resumed = PredictionTrust(), PredictionTrust()
    trust.load_state_dict(state)
    resumed.load_state_dict(numpy_state)
    assert resumed.state_dict() == trust.state_dict()
    assert all(type(x) is float for x in resumed.past) and type(resumed.decay) is float
    assert type(resumed.past_dof) is float and resumed.calibrate(50.0) == trust.calibrate(50.0)
