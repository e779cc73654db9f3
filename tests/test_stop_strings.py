"""Stop strings (``SamplingConfig.stop_strings``): a sample ends on the token whose text completes one, in every
strategy, in rollouts that carry samples over, and in the builder's batches; it is not truncated."""

import pytest
import torch

from lit_grpo.rollout.builder import Prompt, RolloutBuilder
from lit_grpo.rollout.config import TrainingConfig
from lit_grpo.rollout.prompts import PromptExample
from lit_grpo.rollout.rewards import build_reward_funcs
from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.sampling import RolloutEngine, SamplingConfig
from lit_grpo.sampling.stop_strings import StopStrings

PROMPTS = ["What is 2+3?", "Compute the sum of 7, 8 and 9. Think step by step.", "hi", "Name a colour."]


@pytest.fixture(scope="module")
def tiny64():
    """tiny-llama in float64 (row counts leave no trace in the sampler's float32: see conftest's ``tiny``)."""
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    return model.double().eval(), tokenizer, [tokenizer(text)["input_ids"] for text in PROMPTS]


def _engine(model, tokenizer, strategy="continuous", **options):
    settings = dict(group_size=4, micro_group_size=3, strategy=strategy, max_new_tokens=16, temperature=1.0,
                    top_k=20, seed=7) | options
    return RolloutEngine(model, tokenizer, **settings)


def _stops_from(tokenizer, completions, count=3):
    """``count`` two-character strings from the middles of completions, printable ASCII, so that some samples
    stop on them and others run on."""
    found = []
    for group in completions:
        text = tokenizer.decode(group[0], skip_special_tokens=True)
        pieces = [text[i:i + 2] for i in range(3, len(text) - 3)
                  if text[i:i + 2].isascii() and text[i:i + 2].isprintable()]
        if pieces and pieces[0] not in found:
            found.append(pieces[0])
    assert len(found) >= 2, found
    return found[:count]


def _cut(tokenizer, ids, stops):
    """``ids`` up to the first token whose prefix's text holds a stop string, and whether it stopped there."""
    for t in range(1, len(ids) + 1):
        if any(s in tokenizer.decode(ids[:t], skip_special_tokens=True) for s in stops):
            return ids[:t], True
    return ids, False


@pytest.mark.parametrize("strategy", ["full", "micro", "continuous", "infinite"])
def test_a_sample_ends_on_the_token_that_completes_a_stop_string(tiny64, strategy):
    model, tokenizer, prompts = tiny64
    free = _engine(model, tokenizer, strategy).generate(prompts)
    stops = _stops_from(tokenizer, free.completion_ids)
    stopped = _engine(model, tokenizer, strategy, stop_strings=stops).generate(prompts)
    ended = 0
    for p, group in enumerate(free.completion_ids):
        for k, ids in enumerate(group):
            want, stop = _cut(tokenizer, ids, stops)
            ended += stop
            assert stopped.completion_ids[p][k] == want, (p, k)
            assert stopped.truncated[p][k] == (free.truncated[p][k] and not stop), (p, k)
            assert stopped.logprobs[p][k] == pytest.approx(free.logprobs[p][k][:len(want)], abs=1e-6)
    assert 0 < ended < sum(len(group) for group in free.completion_ids)  # some stop, some run on
    assert stopped.stats.generated_tokens < free.stats.generated_tokens


def test_a_carried_sample_that_stopped_is_not_truncated_when_its_group_returns(tiny64):
    model, tokenizer, prompts = tiny64
    free = _engine(model, tokenizer).generate(prompts)
    stops = _stops_from(tokenizer, free.completion_ids)
    engine = _engine(model, tokenizer, stop_strings=stops)
    groups, truncated, calls = engine.new_groups(prompts, tags=list(range(len(prompts)))), {}, 0
    while groups:
        result = engine.generate_groups(groups, complete=1)
        truncated.update(zip(result.tags, result.truncated))
        groups, calls = result.carried, calls + 1
    assert calls > 1
    for p, group in enumerate(free.completion_ids):
        assert truncated[p] == [free.truncated[p][k] and not _cut(tokenizer, ids, stops)[1]
                                for k, ids in enumerate(group)]


def test_replayed_lengths_ignore_stop_strings(tiny64):
    """A forced length is where the recording ended: a stop string before it does not end the sample."""
    model, tokenizer, prompts = tiny64
    free = _engine(model, tokenizer).generate(prompts)
    stops = _stops_from(tokenizer, free.completion_ids)
    lengths = [[17] * 4 for _ in prompts]  # past the cap: each runs to it, truncated
    replay = _engine(model, tokenizer, stop_strings=stops).generate(prompts, lengths)
    assert [[len(ids) for ids in group] for group in replay.completion_ids] == [[16] * 4 for _ in prompts]
    assert all(all(group) for group in replay.truncated)
    assert any(_cut(tokenizer, ids, stops)[1] for group in replay.completion_ids for ids in group)


def test_the_window_holds_a_string_the_newest_token_completes():
    """A multi-token string (merged tokens) ends the sample exactly at the token that completes it."""
    _, tokenizer = load_model_and_tokenizer("tiny-llama")
    ids = tokenizer("xyz</answer> and more")["input_ids"]
    stop = StopStrings(tokenizer, ["</answer>", "never"])
    ended = [stop.ended([ids[:t]])[0] for t in range(1, len(ids) + 1)]
    first = next(t for t in range(1, len(ids) + 1) if "</answer>" in tokenizer.decode(ids[:t]))
    assert 1 < first < len(ids) and ended.index(True) == first - 1  # the sample ends there: later ones never run
    assert stop.ended([]) == []


def test_special_tokens_among_a_strings_tokens_do_not_hide_it():
    """Special tokens hold no text (the decoding skips them): between a string's tokens they pushed its first ones
    out of the window of the last few tokens, and the sample ran on past the string."""
    _, tokenizer = load_model_and_tokenizer("tiny-llama")
    ids = tokenizer("Answer: 4 2x", add_special_tokens=False)["input_ids"]
    specials = [t for t in tokenizer.all_special_ids if t != tokenizer.eos_token_id]
    assert specials and tokenizer.decode(specials, skip_special_tokens=True) == ""
    stop = StopStrings(tokenizer, ["4 2"])
    ids = ids[:-2] + specials * 3 + ids[-2:]  # " 4", the special tokens, " 2", "x"
    holds = ["4 2" in tokenizer.decode(ids[:t], skip_special_tokens=True) for t in range(1, len(ids) + 1)]
    first = holds.index(True) + 1
    assert first - 1 - ids.index(specials[0]) > stop.window  # the string's tokens are farther apart than the window
    assert stop.ended([ids[:t] for t in range(1, first + 1)]) == holds[:first]


@pytest.mark.parametrize("value", ["</answer>", [""], ["ok", 3], None])
def test_bad_stop_strings_name_the_value(value):
    with pytest.raises(ValueError, match=r"sampling.stop_strings=.* must be a list of non-empty strings"):
        SamplingConfig(stop_strings=value)


def test_stop_strings_are_a_tuple_whatever_list_they_came_as():
    assert SamplingConfig(stop_strings=["a", "b"]).stop_strings == ("a", "b")


def test_stop_strings_need_a_tokenizer(tiny64):
    model, _, _ = tiny64
    with pytest.raises(ValueError, match=r"stop_strings=\['x'\] need a tokenizer"):
        RolloutEngine(model, None, eos_token_ids=[0], stop_strings=["x"])


def test_the_builders_batches_and_validation_stop_on_them(tiny64):
    """A training batch's completions, lengths and truncation flags are those of the run without stop strings cut
    where one completes; the validation engines stop on them too."""
    model, tokenizer, prompts = tiny64
    pool = [Prompt(index=i, example=PromptExample(text, None), ids=ids)
            for i, (text, ids) in enumerate(zip(PROMPTS, prompts))]
    batches = []
    for stops in ((), None):
        if stops is None:
            stops = _stops_from(tokenizer, [[ids[ids != tokenizer.pad_token_id].tolist() for ids in group]
                                            for group in batches[0].completion_ids])
        sampling = SamplingConfig(group_size=4, micro_group_size=4, strategy="continuous", max_new_tokens=16,
                                  top_k=20, seed=7, stop_strings=stops)
        builder = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["char_fraction"]),
                                 training=TrainingConfig(prompts_per_step=4))
        batches.append(builder.build_train(lambda count: pool[:count]))
    free, stopped = batches
    assert builder.val_engine.stop_strings.strings == builder.val_sampled_engine.stop_strings.strings == tuple(stops)
    ended = 0
    for p in range(len(prompts)):
        for k in range(4):
            ids = free.completion_ids[p, k][:int(free.completion_lengths[p, k])].tolist()
            want, stop = _cut(tokenizer, ids, stops)
            ended += stop
            assert stopped.completion_ids[p, k][:len(want)].tolist() == want
            assert int(stopped.completion_lengths[p, k]) == len(want)
            assert bool(stopped.truncated[p, k]) == (bool(free.truncated[p, k]) and not stop)
    assert ended > 0


@pytest.mark.parametrize("strings", [["</answer>", "é!"], ["a b", "x "], ["\n"]])
def test_decoding_only_rows_whose_token_could_complete_a_string_misses_none(strings):
    """Against the text of every whole prefix, up to the one that first holds a string: the rows left undecoded (their
    newest token holds no string's last character) never complete one; multi-byte characters and strings ending in
    a space included."""
    _, tokenizer = load_model_and_tokenizer("tiny-llama")
    generator = torch.Generator().manual_seed(0)
    pieces = ["é!", "</answer>", "a b", "x ", "\n", "q", "é", ">", "!", " ", "an", "sw"]
    stop, checked, stopped = StopStrings(tokenizer, strings), 0, 0
    for _ in range(40):
        text = "".join(pieces[i] for i in torch.randint(0, len(pieces), (12,), generator=generator).tolist())
        ids = tokenizer(text)["input_ids"]
        prefixes = [ids[:t] for t in range(1, len(ids) + 1)]
        holds = [any(s in tokenizer.decode(p, skip_special_tokens=True) for s in strings) for p in prefixes]
        first = holds.index(True) + 1 if any(holds) else len(prefixes)
        assert stop.ended(prefixes[:first]) == holds[:first]
        checked, stopped = checked + first, stopped + any(holds)
    assert 20 < stopped < 40 and checked > 100
