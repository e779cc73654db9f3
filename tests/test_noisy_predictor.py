"""The noisy oracle predictor ("noisy:S") of the length-aware scheduler: reproducible noise of the stated spread."""

import math
import re
import statistics
from pathlib import Path

import pytest

from lit_grpo.scheduling import InfiniteSchedulerConfig, LengthAwareConfig, RolloutWork, simulate_rollout
from lit_grpo.scheduling.length_aware import LengthAwareScheduler, make_predictor
from lit_grpo.scheduling.length_aware.predictors import NoisyOraclePredictor


def replay_work(true_lengths, cap=1024):
    return RolloutWork([4] * len(true_lengths), len(true_lengths[0]), 8, cap, true_lengths=true_lengths)


def log_errors(predictor, work):
    keys = work.keys()
    predicted = predictor.predict(work, keys).tolist()
    return [math.log(value / work.true_lengths[p][k]) for value, (p, k) in zip(predicted, keys)]


def test_the_name_and_the_constructor_build_the_same_predictor():
    by_name, by_keyword = make_predictor("noisy:0.25"), NoisyOraclePredictor(log_std=0.25)
    assert isinstance(by_name, NoisyOraclePredictor) and by_name.spread == by_keyword.spread == 0.25
    assert not by_name.token_conditioned and not by_name.needs_prompt_features
    work = replay_work([[100] * 8] * 4)
    assert by_name.predict(work, work.keys()).tolist() == by_keyword.predict(work, work.keys()).tolist()


def test_noise_is_reproducible_per_seed_sample_and_rollout():
    lengths = [[100 + 10 * k for k in range(16)] for _ in range(4)]
    first, second, other_seed = make_predictor("noisy:0.5"), make_predictor("noisy:0.5"), make_predictor(
        "noisy:0.5", seed=1)
    rollout_a, rollout_b = replay_work(lengths), replay_work(lengths)
    a1 = log_errors(first, rollout_a)
    assert log_errors(first, rollout_a) == a1  # the same rollout asked twice (a refresh): the same predictions
    assert log_errors(second, rollout_a) == a1  # another predictor, as another refill's engine has
    assert log_errors(other_seed, rollout_a) != a1
    b1 = log_errors(first, rollout_b)
    assert b1 != a1  # a new rollout draws new noise
    log_errors(second, rollout_b)
    clone = make_predictor("noisy:0.5")
    clone.load_state_dict(second.state_dict())  # a resume continues with the next rollout's noise
    rollout_c = replay_work(lengths)
    assert log_errors(clone, rollout_c) == log_errors(first, rollout_c)


@pytest.mark.parametrize("spread", [0.0, 0.25, 0.5, 1.0])
def test_spread_of_the_error_is_s(spread):
    predictor = make_predictor(f"noisy:{spread}")
    assert predictor.spread == spread
    errors = []
    for _ in range(25):  # 25 rollouts x 64 samples, far from the clamps (lengths ~1000, cap 10^6)
        work = replay_work([[1000] * 16 for _ in range(4)], cap=10 ** 6)
        errors += log_errors(predictor, work)
        predictor.observe(work, work.keys(), [1000] * 64)
    assert statistics.fmean(errors) == pytest.approx(0.0, abs=0.1 * spread + 1e-9)
    assert statistics.pstdev(errors) == pytest.approx(spread, rel=0.08, abs=1e-9)


def test_predictions_are_clamped_to_one_and_the_cap():
    predictor = make_predictor("noisy:3.0")
    work = replay_work([[1, 2, 64, 64] * 8], cap=64)
    values = predictor.predict(work, work.keys()).tolist()
    assert min(values) >= 1.0 and max(values) <= 64.0 and 64.0 in values and 1.0 in values


def test_noisy_zero_schedules_as_the_oracle():
    lengths = [[50, 1024, 47, 1024, 70, 34, 1024, 153], [288, 12, 1024, 5, 197, 73, 761, 166]]
    results = {}
    for name in ("oracle", "noisy:0"):
        scheduler = LengthAwareScheduler(LengthAwareConfig(predictor=name))
        for _ in range(2):  # the first rollout earns the predictions' trust, the second follows them
            steps = simulate_rollout(scheduler, lengths, 4, 1024).decode_steps
        results[name] = (steps, scheduler.decisions)
    assert results["oracle"] == results["noisy:0"]
    assert "plan" in {d.reason for d in results["oracle"][1]}  # followed, not the default's order


@pytest.mark.parametrize("name, message", [
    ("noisy", r"'noisy' needs its spread: 'noisy:S'"),
    ("noisy:", r"length predictor 'noisy:': S=''.*finite number >= 0"),
    ("noisy:abc", r"length predictor 'noisy:abc': S='abc'.*finite number >= 0"),
    ("noisy:-0.5", r"S='-0.5'.*>= 0"),
    ("noisy:nan", r"S='nan'"),
    ("oracle:0.5", r"length predictor='oracle:0.5' is not known; use one of \['online', 'oracle', 'noisy:S"),
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed, a long name ran on
    pytest.param(10**5000, r"^length predictor an int of 5001 digits must be a name; allowed: online, oracle, "
                           r"noisy:S", id="an int of 5001 digits"),  # pytest's own id would print it
    ("noisy:" + "x" * 500, rf"^length predictor {re.escape(repr('noisy:' + 'x' * 500)[:100])}: "
                           rf"S={re.escape(repr('x' * 500)[:100])} must be a finite number >= 0"),
])
def test_bad_names_are_named_with_what_is_allowed(name, message):
    with pytest.raises(ValueError, match=message):
        make_predictor(name)


def test_bad_keywords_and_config_values_are_named():
    with pytest.raises(ValueError, match=r"noisy predictor log_std=-1 must be a finite number >= 0"):
        NoisyOraclePredictor(log_std=-1)
    # shown as every check shows a value: float() of an int of more than 308 digits raised an OverflowError, a
    # repr of one of more than 4300 failed, a long value ran on
    with pytest.raises(ValueError, match=r"^noisy predictor log_std=\(an int of 5001 digits\) must be a finite "
                                         r"number >= 0 \(the spread of the log-length error, e.g. 0.25\)$"):
        NoisyOraclePredictor(log_std=10**5000)
    with pytest.raises(ValueError, match=r"^noisy predictor log_std=\(an int of 401 digits\) must be a finite"):
        NoisyOraclePredictor(log_std=10**400)
    with pytest.raises(ValueError, match=rf"^noisy predictor log_std={re.escape(repr('9' * 500)[:100])} must be a "):
        NoisyOraclePredictor(log_std="9" * 500)
    assert LengthAwareConfig(predictor="noisy:0.25").predictor == "noisy:0.25"
    assert InfiniteSchedulerConfig(length_aware={"predictor": "noisy:0.25"}).length_aware.predictor == "noisy:0.25"
    with pytest.raises(ValueError, match=r"scheduler.length_aware.predictor: length predictor='bert' is not known"):
        LengthAwareConfig(predictor="bert")
    with pytest.raises(ValueError, match=r"scheduler.length_aware.predictor: length predictor 'noisy:x'"):
        InfiniteSchedulerConfig(length_aware={"predictor": "noisy:x"})


def test_the_oracle_noise_needs_a_replay():
    with pytest.raises(ValueError, match="needs work.true_lengths"):
        make_predictor("noisy:0.5").predict(RolloutWork([4], 2, 2, 64), [(0, 0)])


def test_the_cli_names_a_bad_noisy_predictor_and_refuses_a_good_one_for_training():
    from lit_grpo.cli import build_cli

    config = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    option = "--data.sampling.scheduler.length_aware.predictor"
    # the noise is added to the true lengths, which only a replay has (tools.bench_rollout --lengths)
    with pytest.raises(ValueError, match=r"predictor='noisy:0.25' reads the true lengths, which only a replay"):
        build_cli(["--config", config, option, "noisy:0.25", "--trainer.logger", "false"], run=False)
    with pytest.raises(ValueError, match=r"scheduler.length_aware.predictor: length predictor 'noisy:-1'"):
        build_cli(["--config", config, option, "noisy:-1", "--trainer.logger", "false"], run=False)
