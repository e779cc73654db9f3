import functools
import json
import math
import re
import time

import numpy as np
import pytest
import reasoning_gym
import torch

from lit_grpo.rollout.reward_functions import OverlongPenalty, accuracy_reward, extract_answer, format_reward
from lit_grpo.rollout.rewards import (RewardFunctionError, WeightedReward, build_reward_funcs, correctness_reward,
                                      reward_name, score_rewards)


def forwarding(fn):
    """A decorator of one's own: a wrapper that passes its arguments on as they come (``functools.wraps``)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def test_weighted_sum_skips_none():
    def a(prompts, completions, **kw):
        return [1.0, None, 0.5, None]

    def b(prompts, completions, **kw):
        return [0.0, 2.0, None, None]

    funcs = [WeightedReward(a, 2.0), WeightedReward(b, 0.5)]
    with pytest.warns(UserWarning, match="every reward function returned None for 1 of 4"):
        out = score_rewards(funcs, ["p"] * 4, ["c"] * 4, group_size=2)
    assert out.total.tolist() == [2.0, 1.0, 1.0, 0.0]  # all-None -> 0.0
    assert math.isnan(out.components["a"][1]) and out.components["b"][1] == 2.0
    assert list(out.components) == ["a", "b"]


def test_weighted_rewards_that_overflow_float32_name_the_weights():
    def big(prompts, completions, **kw):
        return [2.0, 1.0]

    with pytest.raises(ValueError, match=r"the weighted rewards overflow float32 \(\[inf\]\): the reward weights "
                                         r"\{'big': 3e\+38\}"):
        score_rewards([WeightedReward(big, 3e38)], ["p"] * 2, ["c"] * 2, group_size=2)


@pytest.mark.parametrize("arguments, message", [
    (dict(prompts=["p"], completions=["c"] * 2), r"1 prompts for 2 completions"),
    (dict(columns={"answer": ["a"]}), r"column 'answer' has 1 values for 2 completions"),
    (dict(columns={"trainer_state": ["a", "b"]}), r"a column is named 'trainer_state', a keyword every reward call"),
    (dict(group_size=3), r"group_size=3 must be >= 1 and divide the 2 completions"),
    (dict(group_size=0), r"group_size=0 must be >= 1"),
    (dict(on_error="ignore"), r"on_error"),
    (dict(reward_funcs=[]), r"no reward functions given"),
])
def test_scoring_refuses_arguments_that_do_not_line_up_naming_the_bad_value(arguments, message):
    """One prompt and one value of each column per completion, G dividing them, no column named as a keyword every
    call gets, a known on_error and some function: else an error naming the bad value, before any function runs."""
    calls = []

    def f(prompts, completions, **kw):
        calls.append(prompts)
        return [1.0] * len(prompts)

    given = dict(reward_funcs=[WeightedReward(f)], prompts=["p"] * 2, completions=["c"] * 2, group_size=2)
    with pytest.raises(ValueError, match=message):
        score_rewards(**{**given, **arguments})
    assert calls == []


def test_columns_reach_the_functions():
    seen = {}

    def f(prompts, completions, answer, **kw):
        seen.update(kw, answer=answer)
        return [float(c == a) for c, a in zip(completions, answer)]

    out = score_rewards([WeightedReward(f)], ["p1", "p2"], ["4", "5"], {"answer": ["4", "6"], "extra": [1, 2]})
    assert out.total.tolist() == [1.0, 0.0]
    assert seen["extra"] == [1, 2]


def test_raising_function_names_function_and_prompt():
    def picky(prompts, completions, **kw):
        if any("bad" in p for p in prompts):
            raise KeyError("boom")
        return [0.0] * len(prompts)

    prompts = ["good one"] * 2 + ["a bad prompt"] * 2
    with pytest.raises(RewardFunctionError, match=r"'picky' raised KeyError.*prompt 1 'a bad prompt'") as info:
        score_rewards([WeightedReward(picky)], prompts, ["x"] * 4, group_size=2)
    assert info.value.name == "picky" and info.value.group == 1 and info.value.prompt == "a bad prompt"
    assert isinstance(info.value.__cause__, KeyError)


def test_a_function_failing_on_every_group_says_so_and_one_failing_on_some_says_the_others_score():
    """Under on_error="raise" the first failing group ends the call; where it is the batch's first, the others are
    tried until one scores: a function that fails on every group (a bug of its own, not a row's) is said to, since
    skip_group would skip them all."""
    calls = []

    def lookup(prompts, completions, **kw):
        calls.append(len(prompts))
        return [{}[prompt] for prompt in prompts]

    with pytest.raises(RewardFunctionError, match=r"'lookup' raised KeyError: 'p0' on prompt 0 'p0', and on each "
                                                  r"of the batch's other 2 groups") as info:
        score_rewards([WeightedReward(lookup)], ["p0", "p0", "p1", "p1", "p2", "p2"], ["c"] * 6, group_size=2)
    assert info.value.group == 0 and info.value.others_scored is False
    assert calls == [6, 2, 2, 2]  # the batch, then each group

    def first_bad(prompts, completions, **kw):
        if "bad" in prompts:
            raise ValueError("no")
        return [1.0] * len(prompts)

    for prompts, group in ((["bad", "bad", "ok", "ok"], 0), (["ok", "ok", "bad", "bad"], 1)):
        with pytest.raises(RewardFunctionError) as info:
            score_rewards([WeightedReward(first_bad)], prompts, ["c"] * 4, group_size=2)
        assert info.value.group == group and info.value.others_scored is True
        assert "other" not in str(info.value), str(info.value)


def test_the_other_groups_are_tried_for_a_bounded_time(monkeypatch):
    """A function that fails slowly (a timeout) is not waited on for every group: past the bound it is not known
    whether another group scores, and the message claims nothing."""
    from lit_grpo.rollout import rewards

    monkeypatch.setattr(rewards, "OTHER_GROUPS_PROBE_S", 0.0)
    calls = []

    def slow_failure(prompts, completions, **kw):
        calls.append(len(prompts))
        time.sleep(0.01)
        raise TimeoutError("the judge did not answer")

    with pytest.raises(RewardFunctionError) as info:
        score_rewards([WeightedReward(slow_failure)], ["p0", "p0", "p1", "p1", "p2", "p2"], ["c"] * 6, group_size=2)
    assert info.value.others_scored is None and calls == [6, 2]
    assert str(info.value).endswith("on prompt 0 'p0'"), str(info.value)


def _reads_chat_completions(completions, **kwargs):
    return [float(len(completion[0]["content"])) for completion in completions]  # Unsloth's notebooks' way


def _reads_text_completions(completions, **kwargs):
    return [float(bool(re.search("<answer>", completion))) for completion in completions]


def _adds_to_text_completions(completions, **kwargs):
    return [float(len("<think>" + completion)) for completion in completions]


@pytest.mark.parametrize("fn, prompts, completions, note", [
    (_reads_chat_completions, ["q"] * 2, ["x", "y"],
     "; its completions are plain strings, because its prompts are text, not chat messages: completions come in "
     "TRL's conversational form ([{'role': 'assistant', 'content': text}]) only with chat-message prompts (a prompt "
     "column of [{'role': ..., 'content': ...}] lists, which may hold a system turn; data.system_prompt does not make "
     "text prompts chat messages)"),
    (_reads_text_completions, [[{"role": "user", "content": "q"}]] * 2, [[{"role": "assistant", "content": "x"}]] * 2,
     "; its completions are in TRL's conversational form, lists of messages, because its prompts are chat messages: "
     "a completion's text is completion[-1]['content'] (its last turn, the answer, after any tool call and reply)"),
    (_adds_to_text_completions, [[{"role": "user", "content": "q"}]] * 2,
     [[{"role": "assistant", "content": "x"}]] * 2, "a completion's text is completion[-1]['content'] (its last turn, "
     "the answer, after any tool call and reply)"),
], ids=["chat_reader_on_text", "text_reader_on_chat", "text_concatenated_to_chat"])
def test_a_function_reading_the_other_completion_form_is_told_which_form_it_gets(fn, prompts, completions, note):
    with pytest.raises(RewardFunctionError) as info:
        score_rewards([WeightedReward(fn)], prompts, completions, group_size=2)
    assert str(info.value).endswith(note), str(info.value)


_TOOL_TURNS = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
    "name": "add", "arguments": {"a": 1, "b": 2}}}]}, {"role": "tool", "name": "add", "content": "3"},
               {"role": "assistant", "content": "<answer>3</answer>"}]


def test_a_text_reader_on_completions_with_tool_turns_is_told_the_answer_is_the_last_turn():
    """With data.tools a completion is its turns: completion[0] is the turn that called the tool, not the answer."""
    prompts = [[{"role": "user", "content": "q"}]] * 2
    with pytest.raises(RewardFunctionError) as info:
        score_rewards([WeightedReward(_reads_text_completions)], prompts, [_TOOL_TURNS] * 2, group_size=2)
    message = str(info.value)
    assert message.endswith("a completion's text is completion[-1]['content'] (its last turn, the answer, after "
                            "any tool call and reply)"), message
    assert "completion[0]" not in message, message


def test_a_type_error_on_the_form_the_function_reads_gets_no_note_on_forms():
    def divides_by_text(completions, **kwargs):
        return [1.0 / completion for completion in completions]

    with pytest.raises(RewardFunctionError) as info:
        score_rewards([WeightedReward(divides_by_text)], ["q"] * 2, ["x", "y"], group_size=2)
    assert "conversational" not in str(info.value) and str(info.value).endswith("'q'"), str(info.value)


def test_skip_group_blanks_every_row_of_the_failing_group_in_every_component():
    # skip_group: all G rows of the failing group get total 0 and NaN components, even from functions that scored it
    def fine(prompts, completions, **kw):
        return [1.0] * len(prompts)

    def picky(prompts, completions, **kw):
        if any("bad" in p for p in prompts):
            raise KeyError("boom")
        return [2.0] * len(prompts)

    prompts = ["ok"] * 3 + ["bad"] * 3 + ["fine"] * 3
    with pytest.warns(UserWarning, match="'picky' raised KeyError"):
        out = score_rewards([WeightedReward(fine), WeightedReward(picky)], prompts, ["c"] * 9, group_size=3,
                            on_error="skip_group")
    assert out.skipped_groups == [1]
    assert out.total.tolist() == [3.0] * 3 + [0.0] * 3 + [3.0] * 3
    for name in ("fine", "picky"):
        assert torch.isnan(out.components[name][3:6]).all(), name
        assert not torch.isnan(out.components[name][[0, 1, 2, 6, 7, 8]]).any(), name


def test_skipped_rows_are_not_said_to_have_no_opinion(recwarn):
    def picky(prompts, completions, **kw):
        if any("bad" in p for p in prompts):
            raise KeyError("boom")
        return [1.0] * len(prompts)

    out = score_rewards([WeightedReward(picky)], ["ok", "ok", "bad", "bad"], ["c"] * 4, group_size=2,
                        on_error="skip_group")
    assert out.skipped_groups == [1]
    said = [str(w.message) for w in recwarn]
    assert any("'picky' raised KeyError" in message for message in said)
    assert not any("returned None" in message for message in said), said  # skipped, not "no opinion"


def test_a_skipped_functions_locals_are_freed_when_scoring_returns():
    """A reward model's tensors in the failing call's frame go with it, not at the next garbage collection."""
    import gc
    import weakref

    class Activations:
        pass

    held = []

    def reward_model(prompts, completions, **kw):
        activations = Activations()
        held.append(weakref.ref(activations))
        if any("bad" in p for p in prompts):
            raise RuntimeError("boom")
        return [1.0] * len(prompts)

    gc.disable()
    try:
        with pytest.warns(UserWarning, match="'reward_model' raised RuntimeError"):
            score_rewards([WeightedReward(reward_model)], ["ok", "ok", "bad", "bad"], ["c"] * 4, group_size=2,
                          on_error="skip_group")
        assert len(held) == 3 and all(ref() is None for ref in held)  # the batch's call and each group's
    finally:
        gc.enable()


@pytest.mark.parametrize("on_error", ["raise", "skip_group"])
def test_a_function_failing_only_on_the_whole_batch_is_named_whatever_on_error(on_error):
    # each group alone scores fine: there is no group to skip, and the batch is not scored one group at a time
    def batch_only(prompts, completions, **kw):
        if len(prompts) > 2:
            raise RuntimeError("too many")
        return [1.0] * len(prompts)

    with pytest.raises(RewardFunctionError, match=r"'batch_only' raised RuntimeError: too many on the whole batch "
                                                  r"\(each group alone scores fine; first prompt 'p0'\)") as info:
        score_rewards([WeightedReward(batch_only)], ["p0", "p0", "p1", "p1"], ["c"] * 4, group_size=2,
                      on_error=on_error)
    assert info.value.group is None and info.value.prompt == "p0"


def test_a_function_named_only_reward_keeps_its_name():
    def _reward(prompts, completions, **kw):
        return [0.0] * len(prompts)

    assert reward_name(_reward) == "_reward" and WeightedReward(_reward).name == "_reward"
    assert reward_name(accuracy_reward) == "accuracy"


@pytest.mark.parametrize("values, match", [
    ([1.0], r"'bad' returned 1 values for 2 completions"),
    ([1.0, "x"], r"'bad' returned 'x' \(str\) at index 1 for prompt 'q2'"),
    ([float("nan"), 1.0], r"'bad' returned nan at index 0 for prompt 'q1'.*finite"),
    ([1.0, float("inf")], r"returned inf at index 1"),
    ([1e39, 1.0], r"'bad' returned 1e\+39 at index 0 for prompt 'q1'; values must be finite in float32"),
    # an int beyond float range (float() raised a bare OverflowError): its size said, not its hundreds of digits,
    # nor Python's refusal to print an int of more than 4300 (sys.get_int_max_str_digits())
    ([1.0, -10**400], r"'bad' returned a negative int of 401 digits at index 1 for prompt 'q2', which is not a finite "
                      r"float; values must be finite in float32"),
    ([10**5000, 1.0], r"'bad' returned an int of 5001 digits at index 0 for prompt 'q1', which is not a finite float; "
                      r"values must be finite in float32, \|value\| <= 3.403e\+38 \(or None for no opinion\)$"),
    # a power of ten whose log10 rounds below it (10**512's is 511.99999999999994): its digits counted, not one short
    ([10**512, 1.0], r"'bad' returned an int of 513 digits at index 0 for prompt 'q1', which is not a finite float"),
    ([1.0, [10**5000]], r"'bad' returned a list holding an int of more than 4300 digits \(list\) at index 1 for "
                        r"prompt 'q2'; values must be floats or None"),
    ("11", r"returned str"),
    ({0: 1.0, 1: 0.0}, r"returned dict"),  # its keys were taken as the rewards
    ({1.0, 0.0}, r"returned set"),
    (None, r"'bad' returned None, as a function without a return statement does; it must return a list of 2 values, "
           r"each a float or None"),
    (np.array([np.nan, 1.0]), r"'bad' returned np.float64\(nan\) at index 0.*; a NaN is refused where TRL reads "
                              r"it as None: return None for no opinion"),
])
def test_bad_return_values(values, match):
    def bad(prompts, completions, **kw):
        return values

    with pytest.raises(RewardFunctionError, match=match):
        score_rewards([WeightedReward(bad)], ["q1", "q2"], ["a", "b"])


@pytest.mark.parametrize("on_error", ["raise", "skip_group"])
def test_a_bad_value_found_while_retrying_group_by_group_is_said_as_on_the_whole_batch(on_error):
    """A function that raises on one group and returns a bad value on another: the group-by-group retry meets the bad
    value first, and says it as the whole batch's call does (a RewardFunctionError naming the function, the value,
    its index in the batch and its prompt), never a bare ValueError from lit_grpo's own frames."""
    def bad(prompts, completions, **kw):
        if any("raise" in p for p in prompts):
            raise KeyError("boom")
        return [1.0, math.nan] if prompts[0] == "q2" else [1.0, 1.0]

    prompts = ["q1", "q1", "q2", "q2", "raise", "raise"]
    with pytest.raises(RewardFunctionError, match=r"'bad' returned nan at index 3 for prompt 'q2'.*finite") as info:
        score_rewards([WeightedReward(bad)], prompts, ["a"] * 6, group_size=2, on_error=on_error)
    # no group to skip: a bad value stops the run whatever on_error says
    assert (info.value.name, info.value.group, info.value.__cause__) == ("bad", None, None)


def test_numpy_and_torch_values_score_as_python_ones():
    """A reward function may return a NumPy array or scalars, bools included (``answer == gold``)."""
    def matches(prompts, completions, **kw):
        return np.array([c == "yes" for c in completions])

    def scalars(prompts, completions, **kw):
        return [np.float32(0.5), torch.tensor(1.0), True, np.int64(2)]

    scores = score_rewards([WeightedReward(matches), WeightedReward(scalars)], ["q"] * 4, ["yes", "no", "yes", "x"])
    assert scores.components["matches"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scores.components["scalars"].tolist() == [0.5, 1.0, 1.0, 2.0]
    with pytest.raises(RewardFunctionError, match=r"'bad' returned .*'x'.* \(str_\) at index 0"):
        score_rewards([WeightedReward(lambda p, c, **kw: np.array(["x", "y"]), name="bad")], ["q"] * 2, ["a", "b"])
    # other NumPy scalars are no numbers, though item() gives an int for a nanosecond datetime or timedelta
    for value in (np.datetime64(5, "ns"), np.timedelta64(5, "ns"), np.datetime64("NaT")):
        with pytest.raises(RewardFunctionError, match=r"'bad' returned .* \((datetime|timedelta)64\) at index 0"):
            score_rewards([WeightedReward(lambda p, c, **kw: [value], name="bad")], ["q"], ["a"])


def test_extract_answer():
    assert extract_answer("so <answer> 12 </answer> and <answer>-4</answer>") == "-4"
    assert extract_answer("1 + 2 = 3. So the answer is 1,234.", numeric=True) == "1234"
    assert extract_answer("It is 7.", numeric=True) == "7"
    assert extract_answer("no number", numeric=True) is None
    assert extract_answer("on pages 10-20", numeric=True) == "20"  # a range, not -20
    assert extract_answer("thinking\n\nParis\n") == "Paris"


def test_reasoning_gym_scoring_uses_the_dataset_score_answer():
    dataset = reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=1)
    entry = dataset[0]  # 'Calculate 5 - 3 - 6.' -> '-4'
    gold = entry["answer"]
    completions = [f"<answer>{gold}</answer>", f"5 - 3 - 6 = {gold}", "The answer is 12", "no idea"]
    got = accuracy_reward(["q"] * 4, completions, answer=[gold] * 4, entry=[entry] * 4)
    expected = [dataset.score_answer(a, entry) for a in (gold, gold, "12", None)]
    assert got == expected == [1.0, 1.0, 0.0, 0.0]


def test_accuracy_without_reasoning_gym_entry():
    got = accuracy_reward(["q"] * 4, ["The answer is 42.", "42.0", "41", "x"], answer=["42", "42", "42", None])
    assert got == [1.0, 1.0, 0.0, None]
    assert accuracy_reward(["q"], ["Let me think.\nParis."], answer=["Paris"]) == [1.0]
    # numbers as people write them: thousands separators (commas or spaces), a spaced or Unicode minus
    completions = ["<answer>1 000</answer>", "<answer>1,000</answer>", "<answer>- 5</answer>", "It is \u22125.",
                   "It is \u22125."]
    assert accuracy_reward(["q"] * 5, completions, answer=["1000", "1000", "-5", "-5", "5"]) == [1.0, 1.0, 1.0, 1.0,
                                                                                                0.0]
    # a list is not one number: "1,2,3" is not 123, and "2, 3" is "2,3"
    got = accuracy_reward(["q"] * 3, ["<answer>123</answer>", "<answer>1, 2, 3</answer>", "<answer>2 3</answer>"],
                          answer=["1,2,3", "1,2,3", "23"])
    assert got == [0.0, 1.0, 0.0]
    assert accuracy_reward(["q"], ["x"], answer=["  "]) == [None]  # a blank gold answer is no gold answer


def test_accuracy_compares_numbers_exactly_whatever_their_digits():
    """Numbers are compared digit for digit (2.50 is 2.5, 007 is 7): read as floats, a product of two 10-digit
    numbers matched any answer within its 17 significant digits, and two numbers of 309 digits or more were both
    inf, so one matched any other."""
    product = str(12345678901 * 98765432109)
    completions = [f"<answer>{int(product) + 1}</answer>", f"<answer>{product}</answer>", "<answer>2" + "0" * 400
                   + "</answer>", "<answer>1" + "0" * 400 + "</answer>", "<answer>0.30000000000000001</answer>",
                   "<answer>2.50</answer>", "<answer>-007</answer>", "<answer>-0.0</answer>", "<answer>.5</answer>"]
    gold = [product, product, "1" + "0" * 400, "1" + "0" * 400, "0.3", 2.5, -7, 0, "0.50"]
    assert accuracy_reward(["q"] * 9, completions, answer=gold) == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]


def test_format_and_overlong():
    completions = ["<answer>3</answer>", "3", "<answer>1</answer><answer>2</answer>", "<answer> </answer>"]
    assert format_reward([], completions) == [1.0, 0.0, 0.0, 0.0]
    penalty = OverlongPenalty(buffer=4)
    got = penalty([""] * 4, [""] * 4, completion_length=[4, 6, 8, 9], max_new_tokens=[8] * 4)
    assert got == [0.0, -0.5, -1.0, -1.0]
    assert OverlongPenalty(max_length=10, buffer=5)([""], [""], completion_length=[7]) == [pytest.approx(-0.4)]
    for bad in (0, "64", 2.5, True):
        with pytest.raises(ValueError, match=rf"buffer={bad!r} must be an integer >= 1"):
            OverlongPenalty(buffer=bad)


def test_an_overlong_buffer_wider_than_the_cap_is_the_cap():
    # a cap of 10 tokens and the default buffer of 64: the penalty runs from 0 at no tokens to -1 at the cap
    got = OverlongPenalty()([""] * 3, [""] * 3, completion_length=[5, 10, 11], max_new_tokens=[10] * 3)
    assert got == [-0.5, -1.0, -1.0]


def test_build_reward_funcs_from_config_specs():
    funcs = build_reward_funcs([
        "accuracy",
        {"name": "format", "weight": 0.25},
        {"name": "overlong", "kwargs": {"buffer": 16}},
        {"name": "lit_grpo.rollout.reward_functions:format_reward", "log_name": "fmt2"},
    ])
    assert [(f.name, f.weight) for f in funcs] == [("accuracy", 1.0), ("format", 0.25), ("overlong", 1.0),
                                                    ("fmt2", 1.0)]
    assert funcs[2].fn.buffer == 16
    assert [f.name for f in build_reward_funcs(None)] == ["accuracy"]
    with pytest.raises(ValueError, match="reward function 'nope' is unknown"):
        build_reward_funcs(["nope"])
    with pytest.raises(ValueError, match=r"reward function 'acuracy' is unknown; did you mean 'accuracy'\? use a "):
        build_reward_funcs(["acuracy"])
    with pytest.raises(ValueError, match="distinct names"):
        build_reward_funcs(["format", "format"])
    with pytest.raises(ValueError, match="unknown: \\['wieght'\\]"):
        build_reward_funcs([{"name": "format", "wieght": 2}])
    with pytest.raises(ValueError, match="weight"):
        WeightedReward(format_reward, float("nan"))
    for weight in (None, "1", True, -3.5e38):  # named, not a bare TypeError from float()
        with pytest.raises(ValueError, match=rf"reward weight={re.escape(repr(weight))} for 'format' must be a "
                                             r"finite number"):
            build_reward_funcs([{"name": "format", "weight": weight}])
    # an int beyond float range: named by its size, not a bare OverflowError from math.isfinite
    with pytest.raises(ValueError, match=r"reward weight=\(an int of 5001 digits\) for 'format' must be a finite "
                                         r"number, \|weight\| <= 3.403e\+38"):
        build_reward_funcs([{"name": "format", "weight": 10**5000}])


def test_a_reward_weight_is_kept_as_a_plain_float():
    # a weight computed with numpy is the float it holds, as the totals' tensor and a checkpoint take it
    for weight in (np.float32(0.5), np.int64(2), 3):
        kept = WeightedReward(format_reward, weight).weight
        assert kept == float(weight) and type(kept) is float


@pytest.mark.parametrize("name, meant", [
    # TRL's accuracy_reward is math-verify: not lit_grpo's 'accuracy', the spelling closest to it
    ("accuracy_reward", "is 'math' here, with data.answer_column: solution; use a built-in"),
    ("think_format_reward", "name TRL's own, 'trl.rewards:think_format_reward', where TRL is installed"),
    ("get_soft_overlong_punishment", "{name: overlong, kwargs: {max_length: max_completion_len, buffer: "
                                     "soft_punish_cache}}"),
])
def test_trls_built_in_reward_names_say_what_they_are_here(name, meant):
    with pytest.raises(ValueError, match=f"reward function '{name}' is unknown; TRL's {name}") as refused:
        build_reward_funcs([name])
    assert meant in str(refused.value) and "did you mean" not in str(refused.value)


def test_scores_are_float_tensors():
    out = score_rewards(build_reward_funcs(["format"]), ["p", "p"], ["<answer>1</answer>", ""], group_size=2)
    assert out.total.dtype == torch.float32 and out.total.tolist() == [1.0, 0.0]


def _takes_a_threshold(prompts, completions, threshold=0.5, **kwargs):
    return [float(len(c) > threshold) for c in completions]


def _strict(prompts, completions, threshold=0.5):
    return [0.0 for _ in completions]


def test_reward_options_are_checked_by_name():
    funcs = build_reward_funcs([{"name": "math", "kwargs": {"timeout_s": 2.0}},
                                {"name": "char_fraction", "kwargs": {"chars": "ab"}}])
    assert funcs[0].fn.keywords == {"timeout_s": 2.0} and funcs[1].fn.keywords == {"chars": "ab"}
    # a built-in's **columns receive data only: a misspelled option is refused, naming the options it takes
    for spec, match in [({"name": "math", "kwargs": {"timeout": 5}}, r"'math' takes no option \['timeout'\]; "
                                                                     r"its options: \['timeout_s'\]"),
                        ({"name": "format", "kwargs": {"strict": True}}, r"its options: \[\]"),
                        ({"name": "overlong", "kwargs": {"bufer": 3}}, r"options: \['max_length', 'buffer'\]"),
                        ({"name": "accuracy", "kwargs": {"answer": "4"}}, r"\['answer'\]; its options: \[\]"),
                        ({"name": "math", "kwargs": [5]}, "must be a mapping"),
                        # values too, when the config is read rather than at the first rollout
                        ({"name": "math", "kwargs": {"timeout_s": True}}, r"timeout_s=True must be a finite "
                                                                          r"number of seconds > 0"),
                        ({"name": "math", "kwargs": {"timeout_s": -1}}, r"timeout_s=-1 must be")]:
        with pytest.raises(ValueError, match=match):
            build_reward_funcs([spec])
    # your own function: a named option, or any option when it takes **kwargs; else refused
    name = f"{__name__}:_takes_a_threshold"
    assert build_reward_funcs([{"name": name, "kwargs": {"threshold": 2, "extra": 1}}])[0].fn.keywords == {
        "threshold": 2, "extra": 1}
    with pytest.raises(ValueError, match=r"takes no option \['treshold'\]; its options: \['threshold'\]"):
        build_reward_funcs([{"name": f"{__name__}:_strict", "kwargs": {"treshold": 2}}])
    # ... but not a misspelling of a named one: it would reach **kwargs while the named option kept its default
    with pytest.raises(ValueError, match=r"takes no option 'treshold' \(did you mean 'threshold'\?\); an option "
                                         r"it does not name reaches its \*\*kwargs"):
        build_reward_funcs([{"name": name, "kwargs": {"treshold": 2}}])


def test_the_correctness_reward_follows_the_reward_functions():
    assert correctness_reward(build_reward_funcs(["format", "math"]), None) == "math"
    assert correctness_reward(build_reward_funcs(["math", "accuracy"]), None) == "accuracy"
    assert correctness_reward(build_reward_funcs(["format"]), None) is None
    assert correctness_reward(build_reward_funcs(["format", "math"]), "format") == "format"
    with pytest.raises(ValueError, match=r"accuracy_reward='mathh' is not one of .*\['format', 'math'\]"):
        correctness_reward(build_reward_funcs(["format", "math"]), "mathh")


def test_gold_answers_are_required_wherever_a_reward_scores_against_them():
    from lit_grpo.rollout.prompts import PromptExample
    from lit_grpo.rollout.rewards import check_gold_answers

    def prompts(*answers):
        return [PromptExample(prompt="q", answer=answer) for answer in answers]

    math_with_options = build_reward_funcs([{"name": "math", "kwargs": {"timeout_s": 1.0}, "log_name": "m"}])
    with pytest.raises(ValueError, match=r"the reward functions \['m'\] score against a gold answer, but none of the "
                                         r"2 prompts has one \(where\)"):
        check_gold_answers(math_with_options, prompts(None, " "), "where")
    check_gold_answers(math_with_options, prompts(None, "4"), "where")  # one answer: the rest may say "no opinion"
    with pytest.raises(ValueError, match=r"the reward functions \['math'\] score against a gold answer, but none"):
        check_gold_answers(build_reward_funcs(["math", "format"]), prompts(None, None), "where")  # format would train
    check_gold_answers(build_reward_funcs(["format"]), prompts(None, None), "where")
    # your own function logged as "accuracy" is not the built-in: it may need no answer
    check_gold_answers([WeightedReward(format_reward, name="accuracy")], prompts(None), "where")


def test_a_reasoning_gym_task_without_gold_answers_is_scored_by_accuracy_not_math():
    """graph_color's entries have no answer: its dataset scores a completion, which ``accuracy`` asks and ``math``
    cannot."""
    from lit_grpo.rollout.prompts import reasoning_gym_prompts
    from lit_grpo.rollout.rewards import check_gold_answers

    examples = reasoning_gym_prompts("graph_color", 2, 0, None)
    assert all(example.answer is None for example in examples)
    scores = accuracy_reward([e.prompt for e in examples], ["<answer>{}</answer>"] * 2,
                             entry=[e.entry for e in examples])
    assert all(score is not None for score in scores)
    check_gold_answers(build_reward_funcs(["accuracy", "format"]), examples, "task")
    with pytest.raises(ValueError, match=r"the reward functions \['math'\] score against a gold answer"):
        check_gold_answers(build_reward_funcs(["accuracy", "math"]), examples, "task")


@pytest.mark.parametrize("fn", [lambda prompts, completions: [0.0] * len(completions),  # no room for the columns
                                lambda completions: [0.0] * len(completions),
                                lambda prompts, **kwargs: [0.0] * len(prompts),
                                lambda answer, completions_, **kwargs: [0.0],  # a column first, by position
                                lambda completions, /, **kwargs: [0.0],  # completions only by position, first
                                lambda x, prompts, **kwargs: [0.0]])  # prompts out of its place, by position
def test_a_reward_function_lit_grpo_cannot_call_as_meant_is_refused_when_built(fn):
    with pytest.raises(ValueError, match=r"reward function 'mine' has the signature \(.*\), but lit_grpo calls "
                                         r"fn\(prompts=\.\.\., completions=\.\.\., \*\*columns\) where it names "
                                         r"completions \(as TRL\), else fn\(prompts, completions, \*\*columns\) "
                                         r"by position.*def f\(prompts, completions, \*\*kwargs\) or def "
                                         r"f\(completions, \*\*kwargs\)"):
        WeightedReward(fn, name="mine")


def test_reward_arguments_are_text_or_trls_conversational_form():
    """The form is the one given (the prompt set's, ``is_conversational``), not this batch's: a batch of plain rows
    from a set with chat rows gets the conversational form too, and chat rows said to be text are refused."""
    from lit_grpo.rollout.prompts import PromptExample, is_conversational
    from lit_grpo.rollout.rewards import reward_arguments

    plain = [PromptExample("a?"), PromptExample("b?")]
    assert reward_arguments(plain, [["1", "2"], ["3", "4"]], conversational=False) == (
        ["a?", "a?", "b?", "b?"], ["1", "2", "3", "4"])
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "a?"}]
    mixed = [PromptExample("a?", messages=chat), PromptExample("b?")]
    assert (is_conversational(plain), is_conversational(mixed), is_conversational(mixed[1:])) == (False, True, False)
    as_chat = ([[{"role": "user", "content": "b?"}]], [[{"role": "assistant", "content": "2"}]])
    assert reward_arguments(mixed[1:], [["2"]], conversational=True) == as_chat  # a plain row: its user turn
    prompts, completions = reward_arguments(mixed, [["1"], ["2"]], conversational=True)
    assert prompts == [chat, *as_chat[0]]
    assert completions == [[{"role": "assistant", "content": "1"}], *as_chat[1]]
    with pytest.raises(ValueError, match=r"conversational=False, but prompt 'a\?' is chat messages: the reward "
                                         r"functions' form is the whole prompt set's: pass "
                                         r"conversational=is_conversational\(examples\) over all its rows"):
        reward_arguments(mixed, [["1"], ["2"]], conversational=False)


def test_trls_reward_signatures_run_unchanged():
    """TRL calls a reward function with keywords: one that names ``completions`` gets them so, wherever they stand
    (TRL's ``accuracy_reward(completions, solution, **kwargs)``), and ``prompts`` by keyword or among the kwargs."""
    seen = {}

    def accuracy(completions, solution, **kwargs):  # TRL's accuracy_reward's shape
        seen["accuracy"] = (completions, solution, kwargs["prompts"])
        return [float(c == s) for c, s in zip(completions, solution)]

    def reversed_order(completions, prompts, **kwargs):
        seen["reversed"] = (completions, prompts)
        return [0.5] * len(completions)

    def keyword_only(*, prompts, completions, **kwargs):
        seen["keyword_only"] = (completions, prompts)
        return [0.0] * len(completions)

    def positional(p, c, **kwargs):  # no parameter named completions: by position, as before
        seen["positional"] = (c, p)
        return [0.0] * len(c)

    funcs = [WeightedReward(fn) for fn in (accuracy, reversed_order, keyword_only, positional)]
    assert [f.by_keyword for f in funcs] == [True, True, True, False]
    scores = score_rewards(funcs, ["p1", "p2"], ["4", "5"], {"solution": ["4", "4"]}, group_size=2)
    assert scores.components["accuracy"].tolist() == [1.0, 0.0]
    assert seen == {"accuracy": (["4", "5"], ["4", "4"], ["p1", "p2"]), "reversed": (["4", "5"], ["p1", "p2"]),
                    "keyword_only": (["4", "5"], ["p1", "p2"]), "positional": (["4", "5"], ["p1", "p2"])}


def test_a_dict_spec_from_python_takes_the_function_itself_with_its_weight_and_options():
    def length_bonus(prompts, completions, scale=1.0, **kwargs):
        return [scale * len(c) for c in completions]

    weighted, scaled = build_reward_funcs([{"name": length_bonus, "weight": 0.5},
                                           {"name": length_bonus, "kwargs": {"scale": 2.0}, "log_name": "scaled"}])
    assert (weighted.name, weighted.weight, weighted.fn) == ("length_bonus", 0.5, length_bonus)
    assert scaled.name == "scaled" and scaled.fn(["p"], ["abc"]) == [6.0]
    with pytest.raises(ValueError, match=r"'length_bonus' .*'sclae'"):
        build_reward_funcs([{"name": length_bonus, "kwargs": {"sclae": 2.0}}])

    def accuracy(completions, **kwargs):  # a function of one's own that shares a built-in's name
        return [kwargs["scale"]] * len(completions)

    (own,) = build_reward_funcs([{"name": accuracy, "kwargs": {"scale": 2.0}}])
    assert own.call(["p"], ["abc"]) == [2.0]
    with pytest.raises(ValueError, match=r"reward function 'accuracy' takes no option \['scale'\]"):
        build_reward_funcs([{"name": "accuracy", "kwargs": {"scale": 2.0}}])


def test_reward_specs_that_are_not_a_list_or_name_nothing_callable_are_refused():
    def mine(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    # a string or a dict was read item by item ("reward function 'a' is unknown"); a function was not iterable
    for specs in ("accuracy", {"name": "accuracy"}, mine):
        with pytest.raises(ValueError, match=r"reward_funcs=.* must be a list of reward specs .*; for one, write \["):
            build_reward_funcs(specs)
    with pytest.raises(ValueError, match=r"name=3 must be a built-in's name .*'package.module:function', a "
                                         r"reward model's 'org/name' or folder, or \(from Python\) the function"):
        build_reward_funcs([{"name": 3}])
    with pytest.raises(ValueError, match=r"reward function 'os:path' imports .*, which is not callable"):
        build_reward_funcs(["os:path"])
    with pytest.raises(ValueError, match=r"reward name=3 for .* must be a string"):
        build_reward_funcs([{"name": "format", "log_name": 3}])
    # a number failed in the first call (not iterable), and no characters scored every completion 0
    for chars in (5, ""):
        with pytest.raises(ValueError, match=re.escape(f"char_fraction reward chars={chars!r} must be a non-empty "
                                                       "string")):
            build_reward_funcs([{"name": "char_fraction", "kwargs": {"chars": chars}}])
    assert build_reward_funcs([{"name": "char_fraction", "kwargs": {"chars": "ab"}}])[0].fn([""], ["abcd"]) == [0.5]
    with pytest.raises(ValueError, match=r"^char_fraction reward chars=\(an int of 5001 digits\) must be a non-empty "
                                         r"string"):  # a repr of an int of more than 4300 digits failed
        build_reward_funcs([{"name": "char_fraction", "kwargs": {"chars": 10**5000}}])
    # a falsy kwargs or log_name was read as none given: the options dropped, the default name taken
    with pytest.raises(ValueError, match=r"reward function 'overlong': kwargs=\[\] must be a mapping of option "
                                         r"names to values"):
        build_reward_funcs([{"name": "overlong", "kwargs": []}])
    with pytest.raises(ValueError, match=r"reward name=0 for .* must be a string"):
        build_reward_funcs([{"name": "format", "log_name": 0}])
    assert [r.name for r in build_reward_funcs([{"name": "format", "log_name": None, "kwargs": None}])] == ["format"]
    # a mapping without a name says so, and a misspelled key names the one it meant
    with pytest.raises(ValueError, match=r"reward spec \{'weight': 1.0\} has no 'name': give a built-in's name "
                                         r"\['accuracy', .*'package.module:function'"):
        build_reward_funcs([{"weight": 1.0}])
    with pytest.raises(ValueError, match=r"reward spec .* takes only the keys \['name', 'weight', 'kwargs', "
                                         r"'log_name'\]; unknown: \['wieght'\] \(did you mean 'weight'\?\)"):
        build_reward_funcs([{"name": "accuracy", "wieght": 1.0}])
    assert [r.name for r in build_reward_funcs(None)] == ["accuracy"]


#: A module-level value a reward spec may name by mistake: an int too long for Python to print.
_HUGE = 10**5000


def test_a_bad_reward_spec_is_shown_bounded_and_an_int_too_long_to_print_by_its_digits():
    """Each refusal shows the bad value as the shared checks do: a repr of an int of more than 4300 digits failed
    with Python's int-to-str ValueError in place of the refusal, a long value ran on."""
    holding = r"a dict holding an int of more than \d+ digits"
    cases = [
        (lambda: WeightedReward(_HUGE), r"^reward function an int of 5001 digits is not callable$"),
        (lambda: WeightedReward(format_reward, math.nan, _HUGE),  # the weight is checked before the name
         r"^reward weight=nan for an int of 5001 digits must be a finite number"),
        (lambda: build_reward_funcs([{"name": "format", "log_name": _HUGE}]),
         r"^reward name=\(an int of 5001 digits\) for .* must be a string \('' for the function's name\)$"),
        # the function beside a bad name: its repr failed the same way (a partial binding such an int), or ran on
        (lambda: WeightedReward(functools.partial(format_reward, limit=_HUGE), 1.0, 3),
         r"^reward name=3 for a partial holding an int of more than \d+ digits must be a string \('' for the "
         r"function's name\)$"),
        (lambda: WeightedReward(functools.partial(format_reward, text="x" * 500), 1.0, 3),
         rf"^reward name=3 for {re.escape(repr(functools.partial(format_reward, text='x' * 500))[:100])} must be a "
         r"string \('' for the function's name\)$"),
        (lambda: build_reward_funcs([{"name": _HUGE}]),
         rf"^reward spec {holding}: name=\(an int of 5001 digits\) must be a built-in's name "),
        (lambda: build_reward_funcs([{"name": "format", "wieght": _HUGE}]),
         rf"^reward spec {holding} takes only the keys \['name', 'weight', 'kwargs', 'log_name'\]; unknown: "),
        (lambda: build_reward_funcs([{"weight": _HUGE}]), rf"^reward spec {holding} has no 'name': give a "),
        (lambda: build_reward_funcs([{"name": "x" * 500, "wieght": 1}]),
         rf"^reward spec {re.escape(repr({'name': 'x' * 500, 'wieght': 1})[:100])} takes only the keys "),
        (lambda: build_reward_funcs(_HUGE),
         r"^reward_funcs=\(an int of 5001 digits\) must be a list of reward specs \(names, dicts or callables\); "
         r"for one, write \[an int of 5001 digits\]$"),
        (lambda: build_reward_funcs([_HUGE]), r"^reward spec an int of 5001 digits is not a name, a dict or a "
                                              r"callable$"),
        (lambda: build_reward_funcs([{"name": "overlong", "kwargs": _HUGE}]),
         r"^reward function 'overlong': kwargs=\(an int of 5001 digits\) must be a mapping of option names to "
         r"values$"),
        (lambda: build_reward_funcs([f"{__name__}:_HUGE"]),
         rf"^reward function '{__name__}:_HUGE' imports an int of 5001 digits, which is not callable; name a "),
        (lambda: correctness_reward(build_reward_funcs(["format", "math"]), _HUGE),
         r"^accuracy_reward=\(an int of 5001 digits\) is not one of the reward functions' names \['format', "
         r"'math'\]; name one of them"),
        (lambda: correctness_reward(build_reward_funcs(["format"]), "m" * 500),
         rf"^accuracy_reward={re.escape(repr('m' * 500)[:100])} is not one of the reward functions' names"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()


def test_a_reward_specs_unknown_keys_are_listed_whatever_their_type():
    """Unknown keys of a reward spec are listed as shown_keys shows them: sorting an int key with a string one
    failed with Python's TypeError, and an int key of more than 4300 digits failed its repr with the int-to-str
    ValueError, each in place of the refusal. A misspelt string key still names the one it meant."""
    start = r"^reward spec .* takes only the keys \['name', 'weight', 'kwargs', 'log_name'\]; unknown: "
    with pytest.raises(ValueError, match=start + r"\[3, 'wieght'\] \(did you mean 'weight'\?\)$"):
        build_reward_funcs([{"name": "format", 3: 1.0, "wieght": 1.0}])
    with pytest.raises(ValueError, match=start + r"\[an int of 5001 digits\]$"):
        build_reward_funcs([{"name": "format", _HUGE: 1.0}])
    with pytest.raises(ValueError, match=start + r"\[\(1, 2\), 'zzz'\]$"):
        build_reward_funcs([{"name": "format", (1, 2): 1.0, "zzz": 0}])


def test_a_reward_specs_option_keys_that_are_no_text_are_refused_by_name():
    """Its kwargs' keys too (YAML's ``1:``): an int beside a string failed sorting with TypeError, an int of more
    than 4300 digits its repr with the int-to-str ValueError, and a function taking ``**kwargs`` fed the key to
    difflib (TypeError), each in place of the refusal. No option's name is anything but text, also where the
    function takes any other option (``extra`` here), which is not refused with it."""
    takes_any = f"{__name__}:_takes_a_threshold"
    for name, kwargs, shown in [("accuracy", {1: 2, "x": 3}, r"\[1, 'x'\]"),
                                ("accuracy", {_HUGE: 1}, r"\[an int of 5001 digits\]"),
                                (takes_any, {1: 2}, r"\[1\]"), (takes_any, {1: 2, "extra": 3}, r"\[1\]"),
                                (takes_any, {_HUGE: 1}, r"\[an int of 5001 digits\]")]:
        with pytest.raises(ValueError, match=rf"^reward function {re.escape(repr(name))} takes no option {shown}; "
                                             r"its options: "):
            build_reward_funcs([{"name": name, "kwargs": kwargs}])


def test_a_reward_module_that_fails_to_import_is_named_with_its_error_and_line(tmp_path, monkeypatch):
    """A syntax error or an exception in the module's own code is a setting's error naming the function, the
    error and where, as a missing module is, not a traceback."""
    (tmp_path / "typo_rewards.py").write_text("def f(prompts, completions, **kwargs)\n    return [0.0]\n")
    (tmp_path / "keyless_rewards.py").write_text("import os\n\nraise RuntimeError('set JUDGE_KEY')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"reward function 'typo_rewards:f' cannot be imported: its module "
                                         r"'typo_rewards' raised SyntaxError: expected ':' \(.*typo_rewards.py, "
                                         r"line 1\)"):
        build_reward_funcs(["typo_rewards:f"])
    with pytest.raises(ValueError, match=r"reward function 'keyless_rewards:f' cannot be imported: its module "
                                         r"'keyless_rewards' raised RuntimeError: set JUDGE_KEY "
                                         r"\(.*keyless_rewards.py, line 3\)"):
        build_reward_funcs([{"name": "keyless_rewards:f"}])
    with pytest.raises(ValueError, match=r"'no_such_rewards_module:f' cannot be imported \(No module named"):
        build_reward_funcs(["no_such_rewards_module:f"])


def test_a_reward_function_saved_by_its_name_builds_again_and_one_saved_as_not_importable_is_named():
    """What a run saves of its reward specs (plain_yaml_values) is a config's spelling: an importable function's
    name builds that function again, with its weight and log name; a lambda's or local function's marker is refused
    saying why no name imports it and what to give instead, not as a module that is not installed."""
    from lit_grpo.rollout.reward_functions import char_fraction_reward
    from lit_grpo.runtime.validation import plain_yaml_values

    saved = plain_yaml_values([char_fraction_reward, {"name": char_fraction_reward, "weight": 0.5, "log_name": "x"}])
    built = build_reward_funcs(saved)
    assert [(r.fn, r.weight, r.name) for r in built] == [(char_fraction_reward, 1.0, "char_fraction"),
                                                          (char_fraction_reward, 0.5, "x")]
    [marker] = plain_yaml_values([lambda prompts, completions, **columns: [0.0] * len(completions)])
    for spec in (marker, {"name": marker}):
        with pytest.raises(ValueError, match=re.escape(f"reward function {marker!r} is how a run saves a function "
                                                       "that no name imports (a lambda): give the function itself "
                                                       "from Python, or define it at the top level of a module and "
                                                       "name it 'package.module:function'")):
            build_reward_funcs([spec])


def _same_fn(fn):
    """What makes two reward functions the same: the function itself; a functools.partial's function and arguments;
    an OverlongPenalty's options (its type and attributes)."""
    if isinstance(fn, functools.partial):
        return functools.partial, fn.func, fn.args, fn.keywords
    if isinstance(fn, OverlongPenalty):
        return type(fn), vars(fn)
    return fn


def _judge(prompts, completions, **columns):
    return [0.0] * len(completions)


def test_a_runs_saved_reward_specs_build_the_same_rewards_again():
    """What a run saves of its reward functions (RolloutDataModule's hparams: hparams.yaml, a checkpoint's
    datamodule_hyper_parameters) is a config's spelling, which builds the same rewards again (function, weight,
    name): a WeightedReward as {name, weight, log_name where its name is not the one the spec gives}, not its
    fields (fn was refused as an unknown key); a functools.partial of an importable function with keyword arguments
    as its name and those as kwargs; an OverlongPenalty as the built-in overlong with its options. Saved again,
    the spelling reads the same."""
    import io

    import yaml

    from datamodule_helpers import PROMPTS
    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.rollout.reward_functions import char_fraction_reward

    chars = "char_fraction"  # a built-in by its built-in name
    given = [WeightedReward(char_fraction_reward, 0.5, "digits"), WeightedReward(format_reward, 2.0),
             WeightedReward(functools.partial(char_fraction_reward, chars="ab"), -1.0, "ab"),
             functools.partial(char_fraction_reward, chars="xy"),
             {"name": char_fraction_reward, "kwargs": {"chars": "pq"}, "log_name": "pq"},
             {"name": functools.partial(char_fraction_reward, chars="mn"), "weight": 3.0, "log_name": "mn"},
             WeightedReward(OverlongPenalty(16, buffer=4), 0.25), WeightedReward(_judge)]
    data = RolloutDataModule(prompts=PROMPTS, reward_funcs=given)
    saved = [{"name": chars, "weight": 0.5, "log_name": "digits"}, {"name": "format", "weight": 2.0},
             {"name": chars, "weight": -1.0, "kwargs": {"chars": "ab"}, "log_name": "ab"},
             {"name": chars, "weight": 1.0, "kwargs": {"chars": "xy"}, "log_name": "partial"},
             {"name": chars, "weight": 1.0, "kwargs": {"chars": "pq"}, "log_name": "pq"},
             {"name": chars, "weight": 3.0, "kwargs": {"chars": "mn"}, "log_name": "mn"},
             {"name": "overlong", "weight": 0.25, "kwargs": {"max_length": 16, "buffer": 4}},
             {"name": f"{__name__}:_judge", "weight": 1.0}]
    assert data.hparams.reward_funcs == saved and data.hparams_initial["reward_funcs"] == saved
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    read = yaml.safe_load(yaml.safe_dump(data.hparams_initial["reward_funcs"]))
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=True) == read == saved
    built = build_reward_funcs(read)
    assert [(_same_fn(r.fn), r.weight, r.name, r.by_keyword) for r in built] == [
        (_same_fn(r.fn), r.weight, r.name, r.by_keyword) for r in data.reward_funcs]
    assert RolloutDataModule(prompts=PROMPTS, reward_funcs=read).hparams.reward_funcs == saved
    assert RolloutDataModule(prompts=PROMPTS, reward_funcs=built).hparams.reward_funcs == saved


class _LongerPenalty(OverlongPenalty):
    """An OverlongPenalty of one's own: the built-in overlong would build another class."""


class _Scores:
    """A class given as the reward function itself: a config naming it builds one of its objects instead."""

    def __init__(self, prompts, completions, **columns):
        self.values = [0.0] * len(completions)


def test_a_saved_reward_that_no_spec_builds_again_is_a_marker_that_says_so():
    """A reward no config spelling builds the same again is saved with a marker for its function, in a spec's shape
    (weight, log_name where the name is not the function's): a lambda; a functools.partial with a positional
    argument, an option whose value YAML would read back as another type (a tuple as a list), an option the spec
    would refuse, or of a local function; an OverlongPenalty of a subclass or with an attribute of its own; a class
    as the function itself, which a config's name would build an object of. Given
    back, each is refused saying a run saved a function no name imports, not as a spec with an unknown key."""
    from lit_grpo.rollout.reward_functions import char_fraction_reward
    from lit_grpo.runtime.validation import plain_yaml_values

    def local(prompts, completions, chars="", **columns):
        return [0.0] * len(completions)

    tagged = OverlongPenalty(16, 4)
    tagged.note = "mine"
    partial = "<not importable (an instance of functools:partial)>"
    cases = [(WeightedReward(lambda prompts, completions, **columns: [], 0.5, "l"),
              {"name": f"<not importable (a lambda): {__name__}:test_a_saved_reward_that_no_spec_builds_again_is_a_"
                       "marker_that_says_so.<locals>.<lambda>>", "weight": 0.5, "log_name": "l"}),
             (WeightedReward(functools.partial(char_fraction_reward, ["q"]), 1.0, "p1"),
              {"name": partial, "weight": 1.0, "log_name": "p1"}),
             (WeightedReward(functools.partial(char_fraction_reward, chars=("a", "b")), 1.0, "p2"),
              {"name": partial, "weight": 1.0, "log_name": "p2"}),
             (WeightedReward(functools.partial(char_fraction_reward, chrs="a"), 1.0, "p3"),
              {"name": partial, "weight": 1.0, "log_name": "p3"}),
             (WeightedReward(functools.partial(local, chars="a"), 1.0, "p4"),
              {"name": partial, "weight": 1.0, "log_name": "p4"}),
             (WeightedReward(_LongerPenalty(16, 4)),
              {"name": f"<not importable (an instance of {__name__}:_LongerPenalty)>", "weight": 1.0}),
             (WeightedReward(tagged, 2.0),
              {"name": "<not importable (an instance of lit_grpo.rollout.reward_functions:OverlongPenalty)>",
               "weight": 2.0}),
             (WeightedReward(_Scores, 1.0, "scores"),
              {"name": f"<not importable (its name builds another reward): {__name__}:_Scores>", "weight": 1.0,
               "log_name": "scores"})]
    for reward, spec in cases:
        assert plain_yaml_values(reward) == spec
        with pytest.raises(ValueError, match=re.escape(f"reward function {spec['name']!r} is how a run saves a "
                                                       "function that no name imports")):
            build_reward_funcs([spec])


def test_a_resume_reads_a_reward_option_given_at_its_default_as_unset():
    """A resume compares each reward's kwargs with the function's (or class's) defaults filled in: an option given at
    its default is the same reward as one left unset. OverlongPenalty(buffer=8) from Python is saved with every
    option (max_length: None too), and {name: overlong, kwargs: {buffer: 8}} was warned of as a kwargs change. An
    option given another value is still named."""
    from lit_grpo.rollout.reward_functions import char_fraction_reward
    from lit_grpo.rollout.rewards import reward_changes, saved_reward_specs
    from lit_grpo.runtime.validation import plain_yaml_values

    saved = plain_yaml_values(saved_reward_specs([OverlongPenalty(buffer=8),
                                                  functools.partial(char_fraction_reward, chars="0123456789"),
                                                  {"name": "org/rm", "kwargs": {"device": "auto", "dtype": None}}]))
    assert saved[0] == {"name": "overlong", "weight": 1.0, "kwargs": {"max_length": None, "buffer": 8}}
    assert saved[1]["kwargs"] == {"chars": "0123456789"}
    same = [{"name": "overlong", "kwargs": {"buffer": 8}}, {"name": "char_fraction", "log_name": "partial"},
            {"name": "org/rm", "kwargs": {"batch_size": 16}}]
    assert reward_changes(saved, same) == [] and reward_changes(same, saved) == []
    other = [{"name": "overlong", "kwargs": {"buffer": 8, "max_length": 64}},
             {"name": "char_fraction", "kwargs": {"chars": "ab"}, "log_name": "partial"},
             {"name": "org/rm", "kwargs": {"device": "cpu"}}]
    assert reward_changes(saved, other) == [
        "reward 'overlong': kwargs {'buffer': 8} in the checkpoint, {'buffer': 8, 'max_length': 64} now",
        "reward 'char_fraction': kwargs {} in the checkpoint, {'chars': 'ab'} now",
        "reward 'org/rm': kwargs {} in the checkpoint, {'device': 'cpu'} now"]


def test_a_resume_reads_a_builtin_function_named_by_its_module_as_the_builtin():
    """A resume compares a 'package.module:function' (or 'package.module.function') that imports a built-in's function
    as the built-in's name: accuracy and lit_grpo.rollout.reward_functions:accuracy_reward were one reward removed and
    one added. A change of its weight is named under the built-in's name; a class named by its module stays as spelt
    (its object may log under a name of its own: a reward model's, its folder's)."""
    from lit_grpo.rollout.rewards import reward_changes

    module = "lit_grpo.rollout.reward_functions"
    saved = ["accuracy", {"name": "format", "weight": 0.5}, {"name": "char_fraction", "kwargs": {"chars": "ab"}}]
    now = [f"{module}:accuracy_reward", {"name": f"{module}.format_reward", "weight": 0.5},
           {"name": f"{module}:char_fraction_reward", "kwargs": {"chars": "ab"}}]
    assert reward_changes(saved, now) == [] and reward_changes(now, saved) == []
    assert reward_changes(saved, [*now[:1], {"name": f"{module}:format_reward", "weight": 2.0}, now[2]]) == [
        "reward 'format': weight 0.5 in the checkpoint, 2.0 now"]
    model = {"model": "org/rm"}
    assert reward_changes([{"name": "reward_model", "kwargs": model}],
                          [{"name": "lit_grpo.rollout.reward_model:RewardModel", "kwargs": model}]) == [
        "reward 'reward_model': removed (weight 1.0 in the checkpoint)",
        "reward 'lit_grpo.rollout.reward_model:RewardModel': added (weight 1.0 now)"]


def test_a_resume_reads_a_reward_models_folder_by_its_real_path(tmp_path, monkeypatch):
    """A resume compares a reward model's folder by its real path: ./rm, its absolute path, a trailing '/', ~/rm and a
    link to it are one folder, one reward model (no model is built to compare); they were one removed and one added.
    A link of another name logs it under that name (the folder's last part), a log_name change. Another folder is
    another reward, shown by its real path; a name that is no local folder (a hub id) by its text."""
    import os

    from lit_grpo.rollout.rewards import reward_changes

    (tmp_path / "rm").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "rm")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for spelling in (str(tmp_path / "rm"), f"{tmp_path}/rm/", "./rm/", "~/rm", "./link"):
        link = {"log_name": "rm"} if spelling == "./link" else {}  # logged as the folder its name names
        assert reward_changes(["./rm"], [{"name": spelling, **link}]) == [], spelling
        assert reward_changes([{"name": spelling, "weight": 2.0, **link}], [{"name": "./rm", "weight": 2.0}]) == []
    real = os.path.realpath(tmp_path)
    assert reward_changes(["./rm"], ["./link"]) == [
        f"reward '{real}/rm': log_name None (its default) in the checkpoint, 'link' now"]
    assert reward_changes(["./rm"], ["./other"]) == [f"reward '{real}/rm': removed (weight 1.0 in the checkpoint)",
                                                     f"reward '{real}/other': added (weight 1.0 now)"]
    assert reward_changes(["org/rm"], ["org/rm/"]) == ["reward 'org/rm': removed (weight 1.0 in the checkpoint)",
                                                       "reward 'org/rm/': added (weight 1.0 now)"]


def test_a_misspelt_function_of_a_reward_module_is_named_with_the_closest_it_has(tmp_path, monkeypatch):
    """``my_rewards:lenght_reward`` names the module's ``length_reward``; without a close name, its functions."""
    (tmp_path / "spelt_rewards.py").write_text("import re\n\nSCALE = 2\n\n\ndef length_reward(completions, **kw):\n"
                                               "    return [0.0]\n\n\ndef _helper():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"'spelt_rewards:lenght_reward' cannot be imported \(module 'spelt_rewards' "
                                         r"has no attribute 'lenght_reward'\); did you mean 'length_reward'\?"):
        build_reward_funcs(["spelt_rewards:lenght_reward"])
    with pytest.raises(ValueError, match=r"has no attribute 'judge'\); its functions: \['length_reward'\]"):
        build_reward_funcs(["spelt_rewards.judge"])


@pytest.mark.parametrize("spec", ["my_rewards.py:length_reward", "./my_rewards.py:length_reward",
                                  "/data/lib/my_rewards.py:length_reward", "lib\\my_rewards.py:length_reward"])
def test_a_reward_named_by_its_file_is_refused_with_the_module_name_to_write(spec):
    """A file's path where a module's name goes was refused by what importlib says of it ('my_rewards' is not a
    package, a relative import needs a package): the message gives the spec to write instead."""
    with pytest.raises(ValueError, match=rf"reward function {re.escape(repr(spec))} names a file; name its module: "
                                         r"'my_rewards:length_reward', with the module's folder"):
        build_reward_funcs([spec])


def test_a_missing_reward_module_or_a_missing_import_inside_it_is_told_apart(tmp_path, monkeypatch):
    """A module name one letter off names the working folder's module; a module that imports a package that is not
    installed names that package and the line, where both read 'No module named ...; use a built-in'."""
    (tmp_path / "near_rewards.py").write_text("def f(completions, **kw):\n    return [0.0]\n")
    (tmp_path / "needy_rewards.py").write_text("import os\nimport judge_sdk_not_installed\n\n\ndef f(completions, "
                                               "**kw):\n    return [0.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"'near_reward:f' cannot be imported \(No module named 'near_reward'\); did "
                                         r"you mean 'near_rewards:f'\?"):
        build_reward_funcs(["near_reward:f"])
    with pytest.raises(ValueError, match=r"'needy_rewards:f' cannot be imported: its module 'needy_rewards' raised "
                                         r"ModuleNotFoundError: No module named 'judge_sdk_not_installed' "
                                         r"\(.*needy_rewards.py, line 2\)"):
        build_reward_funcs(["needy_rewards:f"])


def test_an_import_error_inside_a_reward_module_or_a_working_folder_off_the_path_is_said_as_such(tmp_path,
                                                                                                 monkeypatch):
    """A name the module's own import does not find (``from os import no_such_name``) is the module's error, with
    its line, not the module missing; a module of the working folder that is not importable because that folder is
    not on ``sys.path`` (a script run from elsewhere) is said so, not 'did you mean' the very name given."""
    (tmp_path / "stale_rewards.py").write_text("import os\nfrom os import no_such_name\n")
    (tmp_path / "unlisted_rewards.py").write_text("def f(completions, **kw):\n    return [0.0]\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"'unlisted_rewards:f' cannot be imported \(No module named "
                                         r"'unlisted_rewards'\); its file is in the working folder, which is not on "
                                         r"sys.path: add the folder to PYTHONPATH"):
        build_reward_funcs(["unlisted_rewards:f"])
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"'stale_rewards:f' cannot be imported: its module 'stale_rewards' raised "
                                         r"ImportError: cannot import name 'no_such_name' from 'os' "
                                         r"\(.*\).*\(.*stale_rewards.py, line 2\)"):
        build_reward_funcs(["stale_rewards:f"])


def test_reward_functions_of_the_documented_shapes_are_accepted():
    def trl_style(completions, **kwargs):
        return [0.0] * len(completions)

    @functools.wraps(trl_style)  # an adapter of TRL's function is judged by its own signature
    def adapted(prompts, completions, **kwargs):
        return trl_style(completions, **kwargs)

    for fn in (lambda prompts, completions, **kwargs: [0.0], lambda p, c, *rest, **kwargs: [0.0],
               lambda prompts, completions, answer=None, **columns: [0.0], adapted):
        WeightedReward(fn, name="mine")


def test_every_call_gets_the_training_progress_as_trl_passes_it():
    """``trainer_state`` (TRL's keyword and fields), also in the retry of one group at a time; a prompt field of
    that name is refused, not shadowed."""
    from lit_grpo.rollout.rewards import TrainerState

    seen = []

    def ramp(prompts, completions, trainer_state, **columns):
        seen.append(trainer_state)
        if "b" in prompts:
            raise RuntimeError("no b")
        return [trainer_state.global_step / trainer_state.max_steps] * len(prompts)

    state = TrainerState(global_step=3, max_steps=12, epoch=0.5)
    with pytest.warns(UserWarning, match="no b"):
        scores = score_rewards([WeightedReward(ramp, 1.0)], ["a", "a", "b", "b"], ["x"] * 4, group_size=2,
                               on_error="skip_group", trainer_state=state)
    assert scores.total.tolist() == [0.25, 0.25, 0.0, 0.0] and seen == [state] * 3
    assert score_rewards([WeightedReward(lambda p, c, trainer_state, **k: [trainer_state.epoch] * len(p), 1.0)],
                         ["a"], ["x"]).total.tolist() == [0.0]  # without one: step 0
    with pytest.raises(ValueError, match=r"a column is named 'trainer_state'"):
        score_rewards([WeightedReward(ramp, 1.0)], ["a"], ["x"], {"trainer_state": [1]})


@pytest.mark.parametrize("bound, num_prompts, iterations, mini_batches, expected", [
    ({"max_steps": 3}, 8, 1, 1, [(0, 3, 0.0), (1, 3, 0.25), (2, 3, 0.5)]),
    # no max_steps: the bound from max_epochs, 2 training steps an epoch of 2 optimizer steps each
    ({"max_epochs": 1}, 4, 2, 1, [(0, 4, 0.0), (2, 4, 0.5)]),
    # ... and of 2 x 2 with 2 mini-batches a pass
    ({"max_epochs": 1}, 4, 2, 2, [(0, 8, 0.0), (4, 8, 0.5)]),
])
def test_the_data_module_lends_the_trainers_progress_to_the_reward_functions(tmp_path, bound, num_prompts,
                                                                             iterations, mini_batches, expected):
    """A whole fit: the reward functions see the optimizer steps taken so far, the run's bound and the epochs of
    prompts drawn."""
    from lightning.pytorch import Trainer

    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.update.module import GRPOModule

    seen = []

    def progress(prompts, completions, trainer_state, **columns):
        seen.append((trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch))
        return [float(len(c) % 3) for c in completions]

    prompts = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(num_prompts)]
    data = RolloutDataModule(prompts=prompts, val_size=0, prompts_per_step=2, reward_funcs=[progress],
                             sampling={"group_size": 2, "max_new_tokens": 4})
    trainer = Trainer(**bound, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      limit_val_batches=0, default_root_dir=tmp_path, enable_model_summary=False)
    trainer.fit(GRPOModule(model="tiny-llama", num_iterations=iterations, num_mini_batches=mini_batches),
                datamodule=data)
    assert seen == expected


def test_a_decorated_trl_reward_function_is_called_as_the_function_it_wraps():
    """A decorator's forwarding wrapper (``wrapper(*args, **kwargs)``, ``functools.wraps``) around TRL's
    ``f(completions, solution, **kwargs)`` runs as TRL runs it, by keyword: by position it got the prompts as its
    completions and the completions as its solution (a TypeError, 'multiple values for argument')."""

    @forwarding
    def accuracy(completions, solution, **kwargs):
        return [float(c == s) for c, s in zip(completions, solution)]

    @forwarding
    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    @forwarding
    def positional(p, c, **kwargs):  # no parameter named completions: by position, as before
        return [float(len(c_i)) for c_i in c]

    funcs = [WeightedReward(fn) for fn in (accuracy, length, positional)]
    assert [f.by_keyword for f in funcs] == [True, True, False]
    scores = score_rewards(funcs, ["p1", "p2"], ["4", "55"], {"solution": ["4", "4"]}, group_size=2)
    assert {k: v.tolist() for k, v in scores.components.items()} == {"accuracy": [1.0, 0.0], "length": [1.0, 2.0],
                                                                     "positional": [1.0, 2.0]}


@pytest.mark.parametrize("field", ["log_metric", "log_extra"])
def test_a_row_field_named_as_a_logging_keyword_is_refused_at_setup(field):
    """Every reward call gets ``log_metric`` and ``log_extra`` (TRL's names) as it gets ``trainer_state``: a row
    field of that name is refused with the prompts, not at the first step's scoring, after the model loaded and
    the first rollout ran."""
    from lit_grpo.rollout.prompts import PromptExample
    from lit_grpo.rollout.rewards import check_row_fields

    examples = [PromptExample("a?", "1", {"prompt": "a?"}), PromptExample("b?", "2", {"prompt": "b?", field: 0})]
    with pytest.raises(ValueError, match=rf"data.prompts: row 1 has the fields \['{field}'\], which are names the "
                                         r"reward functions get from lit_grpo itself \(.*log_extra, log_metric.*\); "
                                         "rename those fields"):
        check_row_fields(examples, "data.prompts")


def test_a_row_field_named_as_an_argument_is_refused_naming_the_row_that_has_it():
    """The rows that lack a field hold it as None (``load_prompts``, as TRL's JSON loader): the row named is the
    one that holds a value for it, not the first row, which holds only that None."""
    from lit_grpo.rollout.prompts import load_prompts
    from lit_grpo.rollout.rewards import check_row_fields

    examples = load_prompts(prompts=[{"prompt": "a?"}, {"prompt": "b?"}, {"prompt": "c?", "truncated": True}])
    with pytest.raises(ValueError, match=r"data.prompts: row 2 has the fields \['truncated'\]"):
        check_row_fields(examples, "data.prompts")


def test_each_completion_gets_a_chat_prompt_of_its_own():
    """A reward function that builds each conversation on its prompt's list (``p.extend(c)``) sees every
    completion's prompt as the row holds it, as with TRL's rows: one list shared by a group's completions grew with
    each of them."""
    from lit_grpo.rollout.prompts import PromptExample
    from lit_grpo.rollout.rewards import reward_arguments

    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "a?"}]
    example = PromptExample("a?", messages=chat)
    prompts, completions = reward_arguments([example], [["x", "yy", "zzz"]], conversational=True)

    def turns(prompts, completions, **kwargs):
        out = []
        for prompt, completion in zip(prompts, completions):
            prompt.extend(completion)
            prompt[0]["content"] += "!"
            out.append(float(len(prompt)))
        return out

    assert score_rewards([WeightedReward(turns)], prompts, completions, group_size=3).total.tolist() == [3.0] * 3
    assert example.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "a?"}]


def test_each_completion_gets_a_chat_prompts_other_message_keys_of_its_own():
    """A turn's other keys (an assistant turn's tool_calls) are each completion's own too: a function that changes
    one for a completion (parses a call's arguments in place) found it changed for the group's next ones."""
    from lit_grpo.rollout.prompts import PromptExample, check_messages
    from lit_grpo.rollout.rewards import reward_arguments

    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    chat = check_messages([{"role": "assistant", "content": "", "tool_calls": [call]},
                           {"role": "user", "content": "a?"}], "test")
    example = PromptExample("a?", messages=chat)
    prompts, completions = reward_arguments([example], [["x", "yy", "zzz"]], conversational=True)

    def parsed(prompts, completions, **kwargs):
        out = []
        for prompt in prompts:
            function = prompt[0]["tool_calls"][0]["function"]
            function["arguments"] = json.loads(function["arguments"])  # a str as the row holds it
            out.append(float(function["arguments"]["a"]))
        return out

    assert score_rewards([WeightedReward(parsed)], prompts, completions, group_size=3).total.tolist() == [1.0] * 3
    assert example.messages[0]["tool_calls"] == [call] and call["function"]["arguments"] == '{"a": 1}'


def test_an_error_names_a_chat_prompt_by_its_question():
    """A chat prompt is named in an error by its last message, the question asked: its messages' repr, cut to 300
    characters, showed a system prompt every row shares and never the row that failed."""
    from lit_grpo.rollout.prompts import PromptExample
    from lit_grpo.rollout.rewards import RewardFunctionError, reward_arguments

    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    examples = [PromptExample(q, messages=[system, {"role": "user", "content": q}])
                for q in ("What is 1+1?", "Name a prime above 100.")]
    prompts, completions = reward_arguments(examples, [["a", "b"], ["c", "d"]], conversational=True)

    def picky(prompts, completions, **kwargs):
        if any("prime" in prompt[-1]["content"] for prompt in prompts):
            raise KeyError("metadata")
        return [0.0] * len(prompts)

    def not_finite(prompts, completions, **kwargs):
        return [0.0, 0.0, math.nan, 0.0]

    with pytest.raises(RewardFunctionError, match=r"raised KeyError: 'metadata' on prompt 1 'Name a prime above "
                                                  r"100\.'$") as raised:
        score_rewards([WeightedReward(picky)], prompts, completions, group_size=2)
    assert raised.value.prompt == "Name a prime above 100."
    with pytest.raises(RewardFunctionError, match=r"returned nan at index 2 for prompt 'Name a prime above 100\.'; "):
        score_rewards([WeightedReward(not_finite)], prompts, completions, group_size=2)


def test_a_rows_answer_reaches_the_reward_functions_as_the_row_holds_it(tmp_path):
    """As TRL passes a dataset's columns: a JSONL row's or a prompt list's int answer is an int, so a TRL reward
    comparing ints scores; the built-in correctness rewards read it as text."""
    import json

    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.rollout.prompts import jsonl_prompts
    from lit_grpo.runtime.models import load_model_and_tokenizer

    rows = [{"prompt": f"What is {i} + {i}?", "answer": 2 * i, "half": i} for i in range(4)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [e.answer for e in jsonl_prompts(tmp_path / "rows.jsonl")] == [0, 2, 4, 6]

    def int_match(completions, answer, half, **kwargs):  # a TRL reward that compares ints
        return [float(a == 2 * h) for a, h in zip(answer, half)]

    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    data = RolloutDataModule(prompts=rows, val_size=0, prompts_per_step=2, reward_funcs=[int_match, "math"],
                             sampling={"group_size": 2, "max_new_tokens": 2})
    data.attach(model, tokenizer)
    data.setup("fit")
    batch = data.build_train_batch()
    assert batch.reward_components["int_match"].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert batch.columns["answer"] == [rows[i]["answer"] for i in batch.indices]
    scores = score_rewards(build_reward_funcs(["accuracy", "math"]), ["p"] * 3,
                           ["<answer>4</answer>", "<answer>1.5</answer>", "<answer>5</answer>"],
                           {"answer": [4, 1.5, 4]}, group_size=1)
    assert scores.components["accuracy"].tolist() == scores.components["math"].tolist() == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("on_error", ["raise", "skip_group"])
def test_each_retry_after_a_failed_call_gets_the_arguments_as_they_came(on_error):
    """A function may change its arguments before it raises (TRL-style ``prompt.extend(completion)``, a key set in
    the row): each group's retry, of each function, gets fresh copies of them as score_rewards got them."""
    retries = []

    def changing(name):
        def fn(prompts, completions, entry, **columns):
            if len(completions) == 2:  # a retry of one group
                retries.append((name, [len(p) for p in prompts], [sorted(e) for e in entry]))
            for prompt, completion, row in zip(prompts, completions, entry):
                prompt.extend(completion)
                row[name] = True
            if len(completions) > 2 or completions[0][0]["content"] == "bad":
                raise ValueError("the whole batch, or the bad group")
            return [1.0] * len(completions)
        fn.__name__ = name
        return fn

    prompts = [[{"role": "user", "content": f"q{i // 2}"}] for i in range(4)]
    completions = [[{"role": "assistant", "content": text}] for text in ("a", "b", "bad", "c")]
    columns = {"entry": [{"answer": i // 2} for i in range(4)]}
    funcs = [WeightedReward(changing("first")), WeightedReward(changing("second"))]
    if on_error == "raise":
        with pytest.raises(RewardFunctionError, match=r"'first' raised ValueError.* on prompt 1 'q1'"):
            score_rewards(funcs, prompts, completions, columns, group_size=2, on_error=on_error)
        assert retries == [("first", [1, 1], [["answer"], ["answer"]])] * 2
        return
    with pytest.warns(UserWarning, match="skipped"):
        scores = score_rewards(funcs, prompts, completions, columns, group_size=2, on_error=on_error)
    assert scores.skipped_groups == [1]
    assert retries == [(name, [1, 1], [["answer"], ["answer"]]) for name in ("first", "first", "second", "second")]


def test_a_column_whose_values_cannot_be_copied_reaches_every_call_and_retry_as_it_is():
    """A column ``copy.deepcopy`` refuses (a lock, a client handle) is not copied for the retries: each call gets
    the objects themselves, as before the retries got copies."""
    import threading

    lock = threading.Lock()
    seen = []

    def fn(prompts, completions, handle, **kw):
        seen.append([h is lock for h in handle])
        if len(completions) > 2 or completions[0] == "bad":
            raise ValueError("the whole batch, or the bad group")
        return [0.0] * len(completions)

    with pytest.warns(UserWarning, match="skipped"):
        scores = score_rewards([WeightedReward(fn)], ["p"] * 4, ["c", "c", "bad", "c"], {"handle": [lock] * 4},
                               group_size=2, on_error="skip_group")
    assert scores.skipped_groups == [1]
    assert seen == [[True] * 4, [True] * 2, [True] * 2]


def test_no_reward_function_sees_what_another_changed_in_its_arguments():
    """Each call gets its own copies of the arguments: a function that changes them (TRL-style
    ``prompt.extend(completion)``, a key popped from the row, a token appended) changes them neither for the
    functions after it, plain or async, nor for the caller; TRL passes every function the same lists."""
    import asyncio

    seen = []

    def changing(prompts, completions, entry, completion_ids, **kw):
        for prompt, completion, row, ids in zip(prompts, completions, entry, completion_ids):
            prompt.extend(completion)
            row.pop("answer")
            ids.append(0)
        completions.reverse()
        return [0.0] * len(completions)

    def reading(prompts, completions, entry, completion_ids, **kw):
        seen.append(([len(p) for p in prompts], [c[0]["content"] for c in completions], entry, completion_ids))
        return [0.0] * len(completions)

    async def reading_async(prompts, completions, entry, completion_ids, **kw):
        await asyncio.sleep(0)
        return reading(prompts, completions, entry, completion_ids)

    prompts = [[{"role": "user", "content": f"q{i // 2}"}] for i in range(4)]
    completions = [[{"role": "assistant", "content": text}] for text in ("a", "b", "c", "d")]
    columns = {"entry": [{"answer": i // 2} for i in range(4)], "completion_ids": [[i] for i in range(4)]}
    funcs = [WeightedReward(changing), WeightedReward(reading), WeightedReward(reading_async, name="later")]
    score_rewards(funcs, prompts, completions, columns, group_size=2)
    expected = ([1] * 4, ["a", "b", "c", "d"], [{"answer": i // 2} for i in range(4)], [[i] for i in range(4)])
    assert seen == [expected, expected]
    assert ([len(p) for p in prompts], [c[0]["content"] for c in completions], columns["entry"],
            columns["completion_ids"]) == expected


def test_the_arguments_kept_for_a_retry_copy_what_a_call_could_change_and_share_the_rest(monkeypatch):
    """What a retry gets is copied without ``copy.deepcopy`` for plain data: lists and dicts rebuilt, strings and
    numbers (every token id of ``completion_ids``) shared, as no call can change them in place; an object met twice
    (a group's ``entry``) is copied once, as ``copy.deepcopy`` keeps it."""
    from lit_grpo.rollout import rewards

    def no_deepcopy(value, memo=None):
        raise AssertionError(f"copy.deepcopy({value!r:.60})")

    monkeypatch.setattr(rewards.copy, "deepcopy", no_deepcopy)
    prompts = [[{"role": "user", "content": f"q{i // 2}"}] for i in range(4)]
    completions = [[{"role": "assistant", "content": text}] for text in ("a", "b", "c", "d")]
    entries = [{"answer": p, "metadata": {"tags": ["x"]}} for p in range(2)]
    columns = {"entry": [entries[i // 2] for i in range(4)], "completion_ids": [[7, 8, 9]] * 4}
    retries = []

    def fn(prompts, completions, entry, completion_ids, **kw):
        if len(completions) == 4:
            for prompt, row, ids in zip(prompts, entry, completion_ids):
                prompt.append({"role": "assistant", "content": "changed"})
                row["metadata"]["tags"].append("changed")
                ids.append(0)
            raise ValueError("the whole batch")
        retries.append((prompts, entry, completion_ids))
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match="on the whole batch"):
        score_rewards([WeightedReward(fn)], prompts, completions, columns, group_size=2)
    assert [[len(p) for p in seen] for seen, _, _ in retries] == [[1, 1], [1, 1]]
    for start, (seen, entry, ids) in zip((0, 2), retries):
        assert seen[0] is not prompts[start] and seen[0][0]["content"] is prompts[start][0]["content"]
        assert entry[0] is entry[1] and entry[0]["metadata"]["tags"] == ["x"]
        assert ids == [[7, 8, 9]] * 2


def test_a_copy_shares_a_tuple_of_strings_and_numbers_and_rebuilds_one_holding_a_list():
    """A tuple no call can change (a reasoning-gym row's ``difficulty`` ranges, ``(2, 6)``) is shared as a string
    is; one holding a list is rebuilt around that list's copy."""
    from lit_grpo.rollout.rewards import own_copy

    fixed, mixed = (2, 6, "x"), (1, ["a"])
    row = {"difficulty": {"num_terms": fixed}, "mixed": mixed}
    copied = own_copy(row)
    assert copied["difficulty"]["num_terms"] is fixed and copied["difficulty"] is not row["difficulty"]
    assert copied["mixed"] == mixed and copied["mixed"] is not mixed and copied["mixed"][1] is not mixed[1]


def test_a_reward_needing_a_column_the_data_lacks_is_refused_with_the_prompts():
    """TRL's ``def f(completions, solution, **kwargs)`` on data without ``solution`` would raise TypeError at the
    first step's scoring, after the model loaded and the first rollout ran: refused with the prompts instead,
    naming the function, the parameter and the columns the rows have."""
    from lit_grpo.rollout.prompts import PromptExample
    from lit_grpo.rollout.rewards import check_reward_columns

    examples = [PromptExample("a?", "1", {"prompt": "a?", "answer": "1", "solutions": "1"})]

    def needs_solution(completions, solution, **kwargs):
        return [1.0] * len(completions)

    def by_position(prompts, completions, difficulty, *, level, **columns):
        return [1.0] * len(completions)

    def fine(prompts, completions, answer, completion_ids, trainer_state, solutions, **kwargs):
        return [1.0] * len(completions)

    @functools.wraps(needs_solution)
    def decorated(*args, **kwargs):
        return needs_solution(*args, **kwargs)

    check_reward_columns(build_reward_funcs([fine, "accuracy", "format", "overlong", "math"]), examples,
                         "data.dataset='rows.jsonl'")
    bound = functools.partial(by_position, difficulty=1, level=2)  # a spec's kwargs bind them so
    check_reward_columns(build_reward_funcs([bound]), examples, "x")
    for fn, missing in ((needs_solution, "['solution']"), (decorated, "['solution']"),
                        (by_position, "['difficulty', 'level']")):
        with pytest.raises(ValueError, match=rf"reward function '{fn.__name__}' needs {re.escape(missing)}, which no "
                                             r"row of data.dataset='rows.jsonl' has: its fields are \['answer', "
                                             r"'solutions'\]"):
            check_reward_columns(build_reward_funcs([fn]), examples, "data.dataset='rows.jsonl'")
    with pytest.raises(ValueError, match=r"did you mean 'solutions'\?"):
        check_reward_columns(build_reward_funcs([needs_solution]), examples, "data.dataset='rows.jsonl'")

    def singular(prompt, completions, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(ValueError, match=r"'singular' needs \['prompt'\].*did you mean 'prompts'\?"):
        check_reward_columns(build_reward_funcs([singular]), examples, "data.dataset='rows.jsonl'")


def test_an_option_a_spec_binds_on_a_decorated_reward_is_no_missing_column():
    """A spec's ``kwargs`` bind a decorated function's option (``functools.partial`` over its forwarding wrapper):
    the function it wraps has no default for it, but every call gets it, so no column is missing."""
    from lit_grpo.rollout.prompts import PromptExample
    from lit_grpo.rollout.rewards import check_reward_columns

    @forwarding
    def above(completions, threshold, **kwargs):
        return [float(threshold)] * len(completions)

    examples = [PromptExample("a?", "1", {"prompt": "a?", "answer": "1"})]
    check_reward_columns(build_reward_funcs([{"name": above, "kwargs": {"threshold": 0.5}}]), examples, "x")
    with pytest.raises(ValueError, match=r"reward function 'above' needs \['threshold'\]"):
        check_reward_columns(build_reward_funcs([above]), examples, "x")


def test_a_field_missing_from_some_jsonl_rows_reaches_every_call_as_none():
    """As TRL's JSON loader (datasets) reads a JSONL file: a field some rows lack is None in those rows, so a
    function taking it by name gets it in every call, not only in a batch that happens to hold a row with it."""
    from lit_grpo.rollout.prompts import load_prompts

    rows = [{"prompt": "a?", "solution": "1"}, {"prompt": "b?"}, "c?"]
    examples = load_prompts(prompts=rows)
    assert [e.entry for e in examples] == [{"prompt": "a?", "solution": "1"}, {"prompt": "b?", "solution": None},
                                           {"prompt": "c?", "solution": None}]
    assert rows[1] == {"prompt": "b?"}, "the caller's rows are not changed"
