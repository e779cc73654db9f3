"""The group-context predictor ("group") and combined predictors ("online+group"): what they learn, their names in
configs, their checkpointed state, and that the scheduler runs them without losing to continuous order."""

import math
import random

import pytest
import torch

from lit_grpo.scheduling import FIFOScheduler, InfiniteScheduler, RolloutWork, simulate_rollout
from lit_grpo.scheduling.config import InfiniteSchedulerConfig
from lit_grpo.scheduling.predictors import (
    CombinedLengthPredictor,
    GroupLengthPredictor,
    NoisyOraclePredictor,
    make_predictor,
)


def grouped_lengths(rng: random.Random, prompts: int, group: int, between: float, within: float) -> list[list[int]]:
    """Lognormal lengths whose log has a per-prompt offset (spread ``between``) and per-sample noise (``within``)."""
    rows = []
    for _ in range(prompts):
        mu = 4.0 + rng.gauss(0, between)
        rows.append([max(1, min(1024, round(math.exp(mu + rng.gauss(0, within))))) for _ in range(group)])
    return rows


def feed_rollout(predictor, lengths: list[list[int]]) -> RolloutWork:
    work = RolloutWork([1] * len(lengths), len(lengths[0]), 4, 1024)
    keys = [(p, k) for p in range(len(lengths)) for k in range(len(lengths[0]))]
    predictor.observe(work, keys, [lengths[p][k] for p, k in keys])
    return work


def test_group_predictor_follows_finished_siblings_as_far_as_groups_differ():
    rng = random.Random(0)
    differ, alike = GroupLengthPredictor(), GroupLengthPredictor()
    for _ in range(6):  # past rollouts teach the spreads between and within groups
        feed_rollout(differ, grouped_lengths(rng, 8, 16, between=1.0, within=0.2))
        feed_rollout(alike, grouped_lengths(rng, 8, 16, between=0.0, within=0.8))
    for predictor in (differ, alike):
        work = RolloutWork([1, 1, 1], 16, 4, 1024)
        before = predictor.predict(work, [(0, 5), (1, 5), (2, 5)])
        assert before[0] == before[1] == before[2]  # nothing finished yet: every sample gets the overall mean
        predictor.observe(work, [(0, 0), (0, 1), (1, 0), (1, 1)], [10, 12, 400, 500])
        after = predictor.predict(work, [(0, 5), (1, 5), (2, 5)])
        assert after[2] == before[2]  # a group with no finished sibling keeps the overall mean
        predictor.shift = float(after[1] / after[0])
    # where groups differ the siblings set the prediction; where they do not, the prediction barely moves
    assert differ.shift > 20
    assert alike.shift < 2
    # a new rollout starts from the overall mean again: siblings of the last one do not carry over
    fresh = RolloutWork([1, 1], 16, 4, 1024)
    assert differ.predict(fresh, [(0, 0)]) == differ.predict(fresh, [(1, 0)])


def test_group_predictor_state_survives_a_checkpoint():
    predictor = GroupLengthPredictor()
    rng = random.Random(1)
    for _ in range(3):
        feed_rollout(predictor, grouped_lengths(rng, 4, 8, between=1.0, within=0.3))
    clone = GroupLengthPredictor()
    clone.load_state_dict(predictor.state_dict())
    work_a, work_b = RolloutWork([1, 1], 8, 4, 1024), RolloutWork([1, 1], 8, 4, 1024)
    for model, work in ((predictor, work_a), (clone, work_b)):
        model.observe(work, [(0, 0), (0, 1)], [30, 40])
    assert predictor.predict(work_a, [(0, 3), (1, 3)]).tolist() == clone.predict(work_b, [(0, 3), (1, 3)]).tolist()
    assert predictor.log_std(False) == clone.log_std(False)


def test_combined_predictor_learns_which_part_to_trust():
    combined = make_predictor("noisy:0.1+noisy:2.0", seed=3)
    assert isinstance(combined, CombinedLengthPredictor)
    assert [type(part) for part in combined.parts] == [NoisyOraclePredictor, NoisyOraclePredictor]
    assert [part.spread for part in combined.parts] == [0.1, 2.0]
    rng = random.Random(2)
    errors = []
    for rollout in range(8):
        lengths = grouped_lengths(rng, 4, 16, between=0.5, within=0.8)
        work = RolloutWork([1] * 4, 16, 4, 1024, true_lengths=lengths)
        keys = [(p, k) for p in range(4) for k in range(16)]
        predicted = combined.predict(work, keys)
        if rollout >= 4:
            errors += [math.log(float(x) / lengths[p][k]) ** 2 for x, (p, k) in zip(predicted, keys)]
        combined.observe(work, keys, [lengths[p][k] for p, k in keys])
    rms = math.sqrt(sum(errors) / len(errors))
    # the stack leans on the good part: near its 0.1 error, far below the plain average of the two logs (~1.0)
    assert rms < 0.3
    weights = combined.stack._fit[0][combined.stack.best_alpha_index()]
    assert weights[0] > 5 * abs(weights[1])


def test_combined_predictor_state_and_flags():
    combined = make_predictor("online+group")
    assert combined.token_conditioned and combined.needs_prompt_features
    assert not make_predictor("history+group").token_conditioned
    work = RolloutWork([1, 1], 4, 2, 256, prompt_features=torch.randn(2, 8), prompt_ids=[[1], [2]])
    keys = [(p, k) for p in range(2) for k in range(4)]
    for _ in range(3):
        combined.observe(work, keys, [10, 20, 30, 40, 100, 120, 90, 80], torch.randn(8, 8))
    clone = make_predictor("online+group")
    clone.load_state_dict(combined.state_dict())
    features = torch.randn(8, 8)
    # the clone has folded the rollout into its spreads; so does the original on its next rollout
    next_work = RolloutWork([1, 1], 4, 2, 256, prompt_features=work.prompt_features, prompt_ids=[[3], [4]])
    assert combined.predict(next_work, keys, features).tolist() == clone.predict(next_work, keys, features).tolist()
    with pytest.raises(ValueError, match=r"parts \[.online., .group.\], this one \[.online., .group., .history.\]"):
        make_predictor("online+group+history").load_state_dict(combined.state_dict())


@pytest.mark.parametrize("name,pattern", [
    ("online+", r"'online\+': empty part"),
    ("online+online", r"'online\+online' names a part twice"),
    ("online+bert", r"length predictor='bert' is not known; use one of \['online', 'history', 'group'"),
])
def test_combined_names_are_checked_in_configs(name, pattern):
    assert InfiniteSchedulerConfig(predictor="history+group").predictor == "history+group"
    with pytest.raises(ValueError, match=r"'online\+group': no part takes \['sedd'\]; its parts take"):
        make_predictor("online+group", sedd=3)
    with pytest.raises(ValueError, match=r"group predictor decay=-1 is not allowed; group predictor decay must be a "
                                         r"finite number > 0 and <= 1"):
        GroupLengthPredictor(decay=-1)
    with pytest.raises(ValueError, match=pattern):
        InfiniteSchedulerConfig(predictor=name)


@pytest.mark.parametrize("name", ["group", "history+group", "online+group"])
def test_new_predictors_never_lose_to_continuous_on_grouped_lengths(name):
    rng = random.Random(4)
    scheduler = InfiniteScheduler(name)
    planted = torch.Generator().manual_seed(0)
    steps, continuous = 0, 0
    for rollout in range(6):
        lengths = grouped_lengths(rng, 4, 16, between=1.0, within=0.3)
        features = torch.randn(4, 16, generator=planted)
        options = dict(prompt_features=features, token_feature=lambda key, n: torch.randn(16, generator=planted),
                       prompt_ids=[[rollout * 4 + p] for p in range(4)])
        result = simulate_rollout(scheduler, lengths, 8, 1024, **options)
        base = simulate_rollout(FIFOScheduler(), lengths, 8, 1024)
        if rollout >= 2:
            steps, continuous = steps + result.decode_steps, continuous + base.decode_steps
        assert result.decode_steps <= base.decode_steps * 1.05, rollout  # one rollout may tie or lose a little
    assert steps <= continuous


def test_a_combined_predictor_in_a_config_builds_and_its_engine_state_round_trips(tiny_llama, prompt_ids):
    from lit_grpo.sampling import RolloutEngine, SamplingConfig

    model, tokenizer = tiny_llama
    config = SamplingConfig(group_size=4, micro_group_size=2, strategy="infinite", max_new_tokens=6,
                            scheduler={"predictor": "online+group", "probe_tokens": 2})
    engine = RolloutEngine(model, tokenizer, config=config)
    assert isinstance(engine.scheduler.predictor, CombinedLengthPredictor)
    for _ in range(2):
        engine.generate(prompt_ids[:2])
    restored = RolloutEngine(model, tokenizer, config=config)
    restored.load_state_dict(engine.state_dict())
    work = RolloutWork([3, 3], 4, 2, 6, prompt_features=torch.randn(2, model.config.hidden_size))
    keys = [(0, 1), (1, 2)]
    assert engine.scheduler.predictor.predict(work, keys).tolist() == \
        restored.scheduler.predictor.predict(work, keys).tolist()
    assert restored.scheduler.trust["probe"].state_dict() == engine.scheduler.trust["probe"].state_dict()


def test_a_carried_group_keeps_its_finished_samples_across_calls():
    predictor = GroupLengthPredictor()
    rng = random.Random(5)
    for _ in range(3):
        feed_rollout(predictor, grouped_lengths(rng, 4, 8, between=1.0, within=0.2))
    first = RolloutWork([1, 1], 8, 4, 1024, prompt_ids=[[7, 7], [8, 8]])
    predictor.observe(first, [(0, 0), (0, 1), (1, 0)], [300, 320, 20])
    # the next call carries prompt [8, 8] (now first) and brings a new one; [7, 7] ended and is folded
    second = RolloutWork([1, 1], 8, 4, 1024, prompt_ids=[[8, 8], [9, 9]])
    carried, fresh = predictor.predict(second, [(0, 3), (1, 3)]).tolist()
    assert carried < fresh / 2  # its short sibling from the first call still counts
    assert list(predictor.finished) == [second.prompt_digest(0)]  # the ended group went into the spreads
