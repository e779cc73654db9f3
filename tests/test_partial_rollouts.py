"""Partial rollouts in the engine: a rollout stops once enough groups are complete; the rest continue later."""

from __future__ import annotations

import pytest
import torch

from lit_grpo.rollout.config import AdvantageConfig, TrainingConfig
from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.sampling import RolloutEngine

PROMPTS = ["What is 2+3?", "Compute the sum of 7, 8 and 9. Think step by step.", "hi", "Name a colour."]


@pytest.fixture(scope="module")
def tiny64():
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    return model.double().eval(), tokenizer


def _engine(model, tokenizer, strategy="continuous", **options):
    return RolloutEngine(model, tokenizer, group_size=4, micro_group_size=3, strategy=strategy,
                         max_new_tokens=12, temperature=1.0, seed=7, **options)


@pytest.mark.parametrize("strategy", ["full", "micro", "continuous", "infinite"])
def test_carried_samples_continue_their_own_streams(tiny64, strategy):
    """Stopping after one group and continuing the rest in later calls (their rows prefilled again) gives the
    completions and log-probs of one uninterrupted rollout: a sample's draws depend on the sample only."""
    model, tokenizer = tiny64
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    whole = _engine(model, tokenizer, strategy).generate(prompts)

    engine = _engine(model, tokenizer, strategy)
    groups = engine.new_groups(prompts, tags=list(range(len(prompts))))
    completions, logprobs, calls = {}, {}, 0
    while groups:
        result = engine.generate_groups(groups, complete=1)
        calls += 1
        for tag, ids, lps, versions in zip(result.tags, result.completion_ids, result.logprobs, result.versions):
            completions[tag], logprobs[tag] = ids, lps
            assert all(len(v) == len(c) for v, c in zip(versions, ids))
        groups = result.carried
    assert calls > 1
    assert [completions[p] for p in range(len(prompts))] == whole.completion_ids
    for p in range(len(prompts)):
        assert torch.allclose(torch.tensor([x for row in logprobs[p] for x in row], dtype=torch.float64),
                              torch.tensor([x for row in whole.logprobs[p] for x in row], dtype=torch.float64))


def test_a_partial_rollout_returns_the_first_complete_groups_and_carries_the_rest(tiny64):
    model, tokenizer = tiny64
    engine = _engine(model, tokenizer, "full")  # every sample runs at once: a group completes with its longest
    lengths = [[12, 12, 12, 12], [2, 3, 2, 3], [12, 1, 1, 1], [4, 4, 4, 4]]
    groups = engine.new_groups([tokenizer(t)["input_ids"] for t in PROMPTS], lengths, tags=["a", "b", "c", "d"])
    result = engine.generate_groups(groups, complete=2)
    assert result.tags == ["b", "d"]  # the two that finished first, in input order
    assert [g.tag for g in result.carried] == ["a", "c"]
    carried = {g.tag: g for g in result.carried}
    assert not carried["a"].complete and carried["a"].started > 0  # running when the rollout stopped
    assert sum(s.done for s in carried["c"].samples) >= 1  # its finished samples travel with it
    # Nothing is dropped: the next call finishes what was carried, drawing its tokens in rollout 1.
    rest = engine.generate_groups(result.carried)
    assert rest.tags == ["a", "c"] and rest.carried == []
    assert [[len(c) for c in group] for group in rest.completion_ids] == [lengths[0], lengths[2]]
    versions = rest.versions[0][0]
    assert versions[0] == 0 and versions[-1] == 1  # started in rollout 0, finished in rollout 1
    assert rest.stats.prefill_tokens > 0 and rest.stats.generated_tokens == sum(v == 1 for g in rest.versions
                                                                                for s in g for v in s)


def test_groups_that_must_finish_are_run_to_the_end_and_returned_first(tiny64):
    model, tokenizer = tiny64
    engine = _engine(model, tokenizer)
    lengths = [[12, 12, 12, 12], [2, 2, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]]
    groups = engine.new_groups([tokenizer(t)["input_ids"] for t in PROMPTS], lengths, tags=[0, 1, 2, 3])
    result = engine.generate_groups(groups, complete=1, finish=[0])
    assert result.tags == [0]  # the long group had to finish, and it fills the one place
    assert {g.tag for g in result.carried} == {1, 2, 3} and all(g.complete for g in result.carried if g.tag == 1)


def test_bad_partial_arguments_are_named(tiny64):
    model, tokenizer = tiny64
    engine = _engine(model, tokenizer)
    groups = engine.new_groups([tokenizer("hi")["input_ids"]])
    with pytest.raises(ValueError, match="complete=2 must be an integer between 1 and the number of groups"):
        engine.generate_groups(groups, complete=2)
    with pytest.raises(ValueError, match=r"complete=1.5 must be an integer"):
        engine.generate_groups(groups, complete=1.5)
    for finish in ([1], [-1], [True]):
        with pytest.raises(ValueError, match=r"finish=.* must be indices of the groups, integers in \[0, 1\)"):
            engine.generate_groups(groups, finish=finish)
    with pytest.raises(ValueError, match="at least one group"):
        engine.generate_groups([])
    with pytest.raises(ValueError, match="tags has 2 entries for 1 prompts"):
        engine.new_groups([tokenizer("hi")["input_ids"]], tags=[0, 1])
    with pytest.raises(ValueError, match=r"forced lengths must be integers, got \[2.9, True\]"):
        engine.new_groups([tokenizer("hi")["input_ids"]], lengths=[[2.9, True, 3, 3]])


def test_carried_progress_this_rollout_cannot_continue_is_refused_naming_the_sample(tiny64):
    """A sample carried unfinished at or past this engine's cap (a checkpoint of a run with a higher
    max_new_tokens) drew one token more, past the cap, or failed to index its slot's row; other malformed progress
    failed later or returned lists out of step."""
    from lit_grpo.sampling import GroupProgress, SampleProgress

    model, tokenizer = tiny64
    engine = RolloutEngine(model, tokenizer, group_size=2, micro_group_size=2, strategy="continuous",
                           max_new_tokens=3, seed=7)
    short, long = (tokenizer(t)["input_ids"] for t in PROMPTS[2:0:-1])  # the long prompt widens every row

    def run(sample):
        carried = GroupProgress(short, [sample, SampleProgress()], (0, 0))
        return engine.generate_groups([carried, *engine.new_groups([long])])

    for n in (3, 5):
        with pytest.raises(ValueError, match=rf"group 0, sample 0 is unfinished with {n} tokens, but a sample of "
                                             r"this rollout ends at 3 \(max_new_tokens=3"):
            run(SampleProgress([5] * n, [-1.0] * n, [0] * n))
    eos = engine.eos_token_ids[0]
    for sample, match in [(SampleProgress([eos, 5], [-1.0] * 2, [0] * 2), rf"hold the stop tokens \[{eos}\]"),
                          (SampleProgress([5, 6], [-1.0], [0, 0]), "holds 2 tokens, 1 log-probs and 2 versions"),
                          (SampleProgress(done=True), "is done without a token")]:
        with pytest.raises(ValueError, match=match):
            run(sample)
    result = run(SampleProgress([5, 6], [-1.0] * 2, [0] * 2))  # two of three: one more token, truncated
    assert len(result.completion_ids[0][0]) == 3 and result.completion_ids[0][0][:2] == [5, 6]


def test_a_group_carried_complete_is_observed_by_the_gate_once(tiny64):
    """Two groups complete in the step where one is wanted: the second is carried, already whole, and returned
    by the next call; the preemption gate learns each group's lengths once."""
    model, tokenizer = tiny64
    engine = RolloutEngine(model, tokenizer, group_size=1, micro_group_size=2, strategy="infinite",
                           max_new_tokens=6, seed=0)
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    result = engine.generate_groups(engine.new_groups(prompts, lengths=[[1], [1], [5], [5]]), complete=1)
    assert [g.complete for g in result.carried] == [True, False, False]
    engine.generate_groups(result.carried)
    assert sorted(engine.scheduler.groups) == [[1], [1], [5], [5]]


class _Draws:
    """A builder's ``draw`` over 40 prompts in order, remembering the step (``step``, set by the test) of each."""

    def __init__(self, tokenizer):
        from lit_grpo.rollout.builder import Prompt
        from lit_grpo.rollout.prompts import PromptExample

        self.pool = [Prompt(i, PromptExample(f"What is {i} + {i}?", str(2 * i)),
                            tokenizer(f"What is {i} + {i}?")["input_ids"]) for i in range(40)]
        self.drawn, self.drawn_at, self.step = [], {}, 0

    def __call__(self, count):
        self.drawn.extend(self.pool[len(self.drawn):len(self.drawn) + count])
        self.drawn_at.update((p.index, self.step) for p in self.drawn[-count:])
        return self.drawn[-count:]


def _partial_builder(model, tokenizer, reward_funcs, advantage=AdvantageConfig(), **training):
    """B = 2 groups a step over-provisioned twice, carried one step at most; ``training``: more of its settings."""
    from lit_grpo.rollout.builder import RolloutBuilder
    from lit_grpo.sampling import SamplingConfig

    sampling = SamplingConfig(group_size=4, micro_group_size=4, strategy="continuous", max_new_tokens=12, seed=1)
    return RolloutBuilder(model, tokenizer, sampling, reward_funcs, advantage=advantage,
                          training=TrainingConfig(prompts_per_step=2, over_provision=2.0, max_staleness=1, **training))


def test_the_builder_carries_groups_and_drops_none(tiny64):
    from lit_grpo.rollout.builder import RolloutBuilder
    from lit_grpo.rollout.rewards import build_reward_funcs

    model, tokenizer = tiny64
    draw = _Draws(tokenizer)
    drawn, drawn_at = draw.drawn, draw.drawn_at
    builder = _partial_builder(model, tokenizer, build_reward_funcs(["char_fraction"]))
    sampling = builder.sampling
    returned, carried_some, offpolicy_some = [], False, False
    for step in range(6):
        draw.step = step
        batch = builder.build_train(draw)
        assert batch.rewards.shape == (2, 4)
        assert len(drawn) <= 4 + 2 * step  # fresh prompts only to fill up to ceil(2.0 x B) groups
        assert {"rollout/carried_samples", "rollout/offpolicy_tokens_frac"} <= set(batch.metrics)
        assert all(step - drawn_at[index] <= 1 for index in batch.indices)  # max_staleness=1
        carried = any(step > drawn_at[index] for index in batch.indices)
        carried_some |= carried
        if not carried:  # every token sampled by this step's weights: nothing for the sampler correction
            assert batch.offpolicy_tokens == 0
        offpolicy_some |= batch.offpolicy_tokens > 0
        tokens = int(batch.completion_mask.sum())
        assert batch.metrics["rollout/offpolicy_tokens_frac"] == batch.offpolicy_tokens / tokens
        returned.extend(batch.indices)
    assert carried_some and offpolicy_some
    in_flight = [group.tag.prompt.index for group in builder.carried]
    assert sorted(returned + in_flight) == [p.index for p in drawn]  # every drawn group returned or still carried
    assert len(set(returned)) == len(returned)
    state = builder.state_dict()
    assert len(state["carried"]) == len(builder.carried)
    with pytest.raises(ValueError, match=r"over_provision=0.5 is not allowed; over_provision must be a finite "
                                         r"number >= 1 \(1.0: no partial rollouts\)$"):
        RolloutBuilder(model, tokenizer, sampling, [], training=TrainingConfig(over_provision=0.5))
    with pytest.raises(ValueError, match=r"max_staleness=0 must be an integer >= 1"):
        RolloutBuilder(model, tokenizer, sampling, [], training=TrainingConfig(max_staleness=0))


def test_off_policy_tokens_are_counted_over_the_groups_trained_on_only(tiny64):
    """Dynamic sampling drops the carried groups here (their rewards are all equal) and refills with fresh ones:
    every token trained on is this step's, so nothing turns the sampler correction on."""
    from lit_grpo.rollout.rewards import WeightedReward

    model, tokenizer = tiny64
    draw = _Draws(tokenizer)

    def flat_when_carried(prompts, completions, **columns):  # fresh groups: 0, 1, 2, 3
        return [0.0 if draw.drawn_at[draw.prompt_of[p]] < draw.step else float(k % 4) for k, p in
                enumerate(prompts)]

    draw.prompt_of = {p.example.prompt: p.index for p in draw.pool}
    builder = _partial_builder(model, tokenizer, [WeightedReward(flat_when_carried)], dynamic_sampling=True,
                               max_rollouts_per_step=4)
    refilled = 0
    for step in range(6):
        draw.step = step
        batch = builder.build_train(draw)
        assert all(draw.drawn_at[index] == step for index in batch.indices)
        refilled += batch.metrics["rollout/rollouts_per_step"] > 1
        assert batch.offpolicy_tokens == 0 and batch.metrics["rollout/offpolicy_tokens_frac"] == 0
    assert refilled, "the test needs carried groups dropped"


def test_partial_rollouts_under_normalize_then_sum_score_the_groups_returned(tiny64):
    """Carried and fresh groups alike: each step's advantages are normalize_then_sum's of the B groups returned,
    whatever rollout they were drawn in."""
    from lit_grpo.rollout.advantages import normalize_then_sum_advantages
    from lit_grpo.rollout.rewards import WeightedReward

    model, tokenizer = tiny64
    draw = _Draws(tokenizer)

    def length(prompts, completions, **columns):
        return [float(len(c)) for c in completions]

    def odd(prompts, completions, **columns):
        return [float(k % 2) if k % 3 else None for k in range(len(prompts))]

    funcs = [WeightedReward(length, 0.1), WeightedReward(odd, 1.0)]
    builder = _partial_builder(model, tokenizer, funcs,
                               AdvantageConfig(multi_objective_aggregation="normalize_then_sum"))
    carried_some = False
    for step in range(3):
        draw.step = step
        batch = builder.build_train(draw)
        carried_some |= any(step > draw.drawn_at[index] for index in batch.indices)
        values = torch.stack([batch.reward_components[name] for name in ("length", "odd")], dim=-1)
        expected = normalize_then_sum_advantages(values, torch.tensor([0.1, 1.0])).float()
        torch.testing.assert_close(batch.advantages, expected)
    assert carried_some, "the test needs carried groups"


def test_carried_groups_that_fill_the_rollout_alone_run_without_fresh_ones(tiny64):
    """A checkpoint of a run with more over-provision (here 2 carried groups, resumed at over_provision 1.0 and B
    2): the carried groups make up the rollout, no prompt is drawn, and the step trains on them."""
    from lit_grpo.rollout.builder import RolloutBuilder, _Carry
    from lit_grpo.rollout.rewards import build_reward_funcs
    from lit_grpo.sampling import GroupProgress, SampleProgress, SamplingConfig

    model, tokenizer = tiny64
    draw = _Draws(tokenizer)
    sampling = SamplingConfig(group_size=4, micro_group_size=4, strategy="continuous", max_new_tokens=6, seed=1)
    builder = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["char_fraction"]),
                             training=TrainingConfig(prompts_per_step=2))
    carried = draw(2)
    builder.carried = [GroupProgress(p.ids, [SampleProgress() for _ in range(4)], (0, i), tag=_Carry(p))
                       for i, p in enumerate(carried)]
    batch = builder.build_train(draw)
    assert batch.indices == [p.index for p in carried]
    assert len(draw.drawn) == 2 and builder.carried == []


def test_a_resumed_carried_chat_prompt_reaches_the_rewards_as_its_messages(tiny64):
    """A carried group saved in a checkpoint keeps its chat prompt's messages: after the resume its reward calls get
    the messages (TRL's conversational form), as every other step's calls of the run did, not the last turn's
    text."""
    from lit_grpo.rollout.builder import Prompt, RolloutBuilder, _Carry
    from lit_grpo.rollout.prompts import PromptExample
    from lit_grpo.rollout.rewards import WeightedReward
    from lit_grpo.sampling import GroupProgress, SampleProgress, SamplingConfig

    model, tokenizer = tiny64
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2 + 2?"}]
    seen = []

    def record(prompts, completions, **columns):
        seen.extend(zip(prompts, completions))
        return [0.0] * len(prompts)

    sampling = SamplingConfig(group_size=4, micro_group_size=4, strategy="continuous", max_new_tokens=6, seed=1)
    saved = RolloutBuilder(model, tokenizer, sampling, [WeightedReward(record)],
                           training=TrainingConfig(prompts_per_step=1), conversational=True)
    prompt = Prompt(0, PromptExample("What is 2 + 2?", "4", {"prompt": messages}, messages),
                    tokenizer("What is 2 + 2?")["input_ids"])
    saved.carried = [GroupProgress(prompt.ids, [SampleProgress() for _ in range(4)], (0, 0), tag=_Carry(prompt))]
    resumed = RolloutBuilder(model, tokenizer, sampling, [WeightedReward(record)],
                             training=TrainingConfig(prompts_per_step=1), conversational=True)
    resumed.load_state_dict(saved.state_dict())
    resumed.build_train(_Draws(tokenizer))
    assert [p for p, _ in seen] == [messages] * 4
    assert all(c[0]["role"] == "assistant" for _, c in seen)


def test_carried_groups_of_a_checkpoint_with_text_answers_get_the_rows_own_answers(tiny64):
    """A checkpoint written while answers were kept as text carries ``"14"`` for a row's 14: resumed, the carried
    groups' reward calls get the row's int, as every fresh group's do (a TRL reward comparing ints scored them 0);
    a carried prompt that is not the one at its index in this prompt set keeps the answer it was saved with."""
    import copy

    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.rollout.builder import _carried_group
    from lit_grpo.rollout.prompts import PromptExample

    model, tokenizer = tiny64
    rows = [{"prompt": f"What is {i} + {i}?", "answer": 2 * i} for i in range(8)]
    seen = []

    def int_answer(completions, answer, **kwargs):
        seen.extend(answer)
        return [float(isinstance(a, int)) for a in answer]

    def datamodule():
        data = RolloutDataModule(prompts=rows, val_size=0, prompts_per_step=2, over_provision=2.0,
                                 reward_funcs=[int_answer], sampling={"group_size": 2, "max_new_tokens": 4})
        data.attach(model, tokenizer)
        data.setup("fit")
        return data

    saving = datamodule()
    saving.build_train_batch()
    state = copy.deepcopy(saving.state_dict())
    carried = state["engine"]["carried"]
    assert carried, "the test needs carried groups"
    for group in carried:  # as such a checkpoint holds them
        group["prompt"]["answer"] = str(group["prompt"]["answer"])
    resumed = datamodule()
    resumed.load_state_dict(state)
    seen.clear()
    resumed.build_train_batch()
    assert seen and all(isinstance(a, int) for a in seen)
    assert [g.tag.prompt.example.answer for g in resumed.builder.carried] == \
        [rows[g.tag.prompt.index]["answer"] for g in resumed.builder.carried]
    other = [PromptExample(f"not the prompt {i}", 2 * i) for i in range(8)]
    assert _carried_group(carried[0], other).tag.prompt.example.answer == carried[0]["prompt"]["answer"]
