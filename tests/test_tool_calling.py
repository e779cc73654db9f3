"""EXPERIMENTAL tool calling during rollouts (lit_grpo.rollout.tools, data.tools): the tool runs with the parsed
arguments, its result sits in the completion with no loss, the round cap holds, a failing tool's error is its
result, and the tools/ metrics."""

import asyncio
import copy
import inspect
import logging
import types
import warnings
from pathlib import Path

import pytest
import torch

from lit_grpo import RolloutEngine, load_model_and_tokenizer
from lit_grpo.sampling import SampleProgress
from lit_grpo.rollout.config import TrainingConfig
from lit_grpo.rollout.metrics import reduce_over_ranks
from lit_grpo.rollout.tool_calls import call_body
from lit_grpo.rollout.tools import ToolBox, tool_chat_template, tool_schemas, tool_suffix_ids
from lit_grpo.runtime.models import tiny_tokenizer
from lit_grpo.runtime.validation import ConfigError
from lit_grpo.update.logprobs import completion_logits, token_logps

from test_module import grads_after_step, make_datamodule, make_module

#: The tiny tokenizer's template with tools (a system turn listing them), assistant tool calls in the Hermes format
#: and tool turns.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CALLS = []


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    CALLS.append((a, b))
    return a + b


def explode(x: int) -> int:
    """Always fails.

    Args:
        x: anything.
    """
    raise RuntimeError(f"boom {x}")


def undocumented(x):
    return x


class Scripted:
    """A RolloutEngine whose every turn replays ``turn`` (token replay, carried samples included): each decode of a
    sample emits it, so every turn calls a tool."""

    def __init__(self, engine: RolloutEngine, turn: list[int]):
        self.engine, self.turn = engine, turn

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def new_groups(self, prompts, lengths=None, tags=None, **kwargs):
        return self.engine.new_groups(prompts, tags=tags, **kwargs)

    def generate_groups(self, groups, complete=None, finish=()):
        for g in groups:
            g.forced_tokens = [s.tokens + self.turn for s in g.samples]
            g.forced_lengths = [min(len(s.tokens) + len(self.turn), self.engine.max_new_tokens + 1)
                                for s in g.samples]
        return self.engine.generate_groups(groups, complete, finish)


@pytest.fixture(scope="module")
def llama():
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    return model.eval(), tokenizer


def call_turn(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]


def rollout(llama, tools, turn_text, iterations=None, max_new_tokens=200, group_size=2, chat_template_kwargs=None):
    model, tokenizer = llama
    box = ToolBox(tools, tokenizer, iterations, chat_template_kwargs=chat_template_kwargs)
    engine = RolloutEngine(model, tokenizer, group_size=group_size, micro_group_size=2, strategy="continuous",
                           max_new_tokens=max_new_tokens, seed=0)
    engine = Scripted(engine, call_turn(tokenizer, turn_text))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+3?"}], tools=box.schemas,
                                           add_generation_prompt=True, return_dict=False,
                                           **(chat_template_kwargs or {}))
    groups = engine.new_groups([prompt])
    with torch.no_grad():
        result = engine.generate_groups(groups)
        return box, box.run_rounds(engine, groups, result)


ADD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_a_tool_call_runs_the_tool_and_its_masked_result_sits_in_the_completion(llama):
    _, tokenizer = llama
    CALLS.clear()
    box, out = rollout(llama, [add], ADD_CALL, iterations=1)
    assert CALLS == [(2, 3), (2, 3)]  # each of the G=2 samples called it once, with the parsed arguments
    assert (out.calls, out.failures) == (2, 0)
    turn = call_turn(tokenizer, ADD_CALL)
    suffix = box.suffix_ids([{"role": "tool", "name": "add", "content": "5"}])
    for k in range(2):
        ids, mask = out.completion_ids[0][k], out.tool_mask[0][k]
        assert len(mask) == len(ids) == len(out.logprobs[0][k])
        # the call, the tool's message (mask 0), then the model's next turn (here the replay's call again)
        assert ids == turn + suffix + turn
        assert mask == [1] * len(turn) + [0] * len(suffix) + [1] * len(turn)
        assert out.logprobs[0][k][len(turn):len(turn) + len(suffix)] == [0.0] * len(suffix)
        roles = [m["role"] for m in out.messages[0][k]]
        assert roles == ["assistant", "tool", "assistant"]
        assert out.messages[0][k][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
        assert out.messages[0][k][1]["content"] == "5"


def test_the_round_cap_holds_and_none_ends_at_the_length_cap(llama):
    _, out = rollout(llama, [add], ADD_CALL, iterations=2, max_new_tokens=400)
    assert out.calls == 4  # 2 rounds x 2 samples; the third turn's call is left unanswered
    assert [m["role"] for m in out.messages[0][0]] == ["assistant", "tool"] * 2 + ["assistant"]
    assert "tool_calls" in out.messages[0][0][-1]
    _, none = rollout(llama, [add], ADD_CALL, iterations=0)
    assert none.calls == 0 and none.tool_mask[0][0] == [1] * len(none.completion_ids[0][0])
    _, unbounded = rollout(llama, [add], ADD_CALL, iterations=None, max_new_tokens=400)
    assert unbounded.calls > 4
    assert all(len(ids) <= 400 for ids in unbounded.completion_ids[0])


def test_a_failing_tool_returns_its_error_text(llama):
    _, out = rollout(llama, [add, explode], '<tool_call>{"name": "explode", "arguments": {"x": 7}}</tool_call>',
                     iterations=1)
    assert (out.calls, out.failures) == (2, 2)
    assert out.messages[0][0][1] == {"role": "tool", "name": "explode", "content": '{"error": "boom 7"}'}
    _, unknown = rollout(llama, [add], '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', iterations=1)
    assert unknown.failures == 2 and "nope not found" in unknown.messages[0][0][1]["content"]


def city(name: str) -> dict:
    """Look a city up.

    Args:
        name: the city.
    """
    if name == "Atlantis":
        raise ValueError(f"keine Stadt namens {name} gefunden: größer als erwartet")
    return {"city": name, "country": "Schweiz", "greeting": "Grüezi 👋"}


def test_a_tool_result_with_non_ascii_text_reaches_the_model_as_that_text(llama):
    # a result's text as the tool wrote it, as TRL's str(result) keeps it: JSON's default \u escapes would show the
    # model other (and many more) tokens than the text
    _, out = rollout(llama, [city], '<tool_call>{"name": "city", "arguments": {"name": "Zürich"}}</tool_call>',
                     iterations=1)
    assert out.messages[0][0][1]["content"] == '{"city": "Zürich", "country": "Schweiz", "greeting": "Grüezi 👋"}'
    _, failed = rollout(llama, [city], '<tool_call>{"name": "city", "arguments": {"name": "Atlantis"}}</tool_call>',
                        iterations=1)
    assert failed.messages[0][0][1]["content"] == \
        '{"error": "keine Stadt namens Atlantis gefunden: größer als erwartet"}'


def test_bad_tool_settings_name_the_value(llama):
    _, tokenizer = llama
    with pytest.raises(ValueError, match="'no_such_module_x:f'.*does not import"):
        ToolBox(["no_such_module_x:f"], tokenizer)
    with pytest.raises(ValueError, match="'undocumented' has no JSON schema"):
        ToolBox([undocumented], tokenizer)
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed in place of the refusal
    from lit_grpo.rollout.tools import resolve_tools

    with pytest.raises(ValueError, match=r"^tools=\(an int of 5001 digits\) must be a list of callables or "):
        resolve_tools(10**5000)
    with pytest.raises(ValueError, match=r"^tool an int of 5001 digits must be a callable or a "
                                         r"'package.module:function' name$"):
        resolve_tools([10**5000])
    with pytest.raises(ValueError, match="max_tool_calling_iterations=-1"):
        ToolBox([add], tokenizer, -1)
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="ignores tools="):
        ToolBox([add], plain)
    with pytest.raises(ConfigError, match="data.tools.*'tests_x.y:z'"):
        make_datamodule(make_module(), tools=["tests_x.y:z"])
    for bad in (-1, True, 1.5):  # its own key's error, with what it allows, not one of data.tools
        with pytest.raises(ValueError, match=rf"^max_tool_calling_iterations={bad!r} must be an integer >= 0 \(tool "
                                             r"rounds per completion\) or None \(null in YAML: no count, "
                                             r"max_new_tokens bounds the rounds\)$"):
            make_datamodule(make_module(), tools=[add], max_tool_calling_iterations=bad)
    # partial rollouts: refused by the data module as a setting, and by a builder made by hand
    partial = r"over_provision=2.0 turns on partial rollouts, which tool calling does not run with yet"
    with pytest.raises(ConfigError, match=partial):
        make_datamodule(make_module(), tools=[add], over_provision=2.0)
    from lit_grpo.rollout.builder import RolloutBuilder
    from lit_grpo.rollout.rewards import build_reward_funcs
    from lit_grpo.sampling import SamplingConfig

    tools_tokenizer = copy.deepcopy(tokenizer)
    tools_tokenizer.chat_template = TOOLS_TEMPLATE
    with pytest.raises(ValueError, match=partial):
        RolloutBuilder(llama[0], tools_tokenizer, SamplingConfig(group_size=2), build_reward_funcs(["char_fraction"]),
                       training=TrainingConfig(over_provision=2.0), tools=ToolBox([add], tools_tokenizer))


def tool_batch(template=TOOLS_TEMPLATE, **kwargs):
    """A training batch whose every sample called ``add`` once (replayed), from the data module."""
    module = make_module()
    module.tokenizer.chat_template = template
    dm = make_datamodule(module, tools=[add], max_tool_calling_iterations=1, max_new_tokens=200, **kwargs)
    builder = dm._require_builder()
    builder._engine = Scripted(builder.engine, call_turn(module.tokenizer, ADD_CALL))
    return module, dm.build_train_batch()


def test_the_batch_masks_tool_results_counts_drawn_lengths_and_logs_the_tools_metrics():
    seen, columns = [], []

    def reward(prompts, completions, completion_ids, completion_length, **kwargs):
        seen.extend(completions)
        columns.extend(zip(completion_ids, completion_length))
        return [1.0] * len(completions)

    _, batch = tool_batch(reward_funcs=[reward])
    turn = len(call_turn(load_model_and_tokenizer("tiny-llama")[1], ADD_CALL))
    assert batch.tool_mask is not None and batch.tool_mask.shape == batch.completion_mask.shape
    tool_tokens = (batch.completion_mask * (1 - batch.tool_mask)).sum(dim=2)
    assert (tool_tokens > 0).all()
    assert torch.equal(batch.completion_lengths, torch.full_like(batch.completion_lengths, 2 * turn))
    assert torch.equal(batch.completion_lengths + tool_tokens, batch.completion_mask.sum(dim=2))
    assert batch.metrics["tools/call_frequency"] == 1.0 and batch.metrics["tools/failure_frequency"] == 0.0
    assert "5" in batch.completions[0][0]  # the text holds the tool's result
    assert all(isinstance(c, str) and "<tool_call>" in c for c in seen)  # plain prompts: text, as TRL's
    # the reward column counts the tool messages, as TRL's completion_ids hold them; the logged lengths do not
    whole = batch.completion_mask.sum(dim=2).flatten().tolist()
    assert [length for _, length in columns] == [len(ids) for ids, _ in columns] == whole
    assert all(length > drawn for length, drawn in zip(whole, batch.completion_lengths.flatten().tolist()))


def test_tool_results_carry_no_gradient():
    """Tool tokens at a completion's end, masked, leave the update's gradient as it is without them; unmasked, they
    change it (so the comparison can fail)."""
    module, batch = tool_batch(reward_funcs=["char_fraction"])
    batch.advantages = torch.linspace(-1, 1, batch.advantages.numel()).view_as(batch.advantages)
    # drop every row's tokens after its tool result: the result then ends each completion
    first_tool = (batch.tool_mask == 0).int().argmax(dim=2)
    end = (first_tool + (batch.completion_mask * (1 - batch.tool_mask)).sum(dim=2))
    keep = torch.arange(batch.completion_ids.shape[2]) < end[..., None]
    ended = copy.copy(batch)
    ended.completion_mask = batch.completion_mask * keep
    ended.completion_lengths = (ended.completion_mask * batch.tool_mask).sum(dim=2)
    ended.__dict__.pop("_host_lengths", None)
    without = copy.copy(ended)  # the same completions cut before their tool results
    without.completion_mask = ended.completion_mask * batch.tool_mask
    without.tool_mask = None
    unmasked = copy.copy(ended)
    unmasked.tool_mask = torch.ones_like(batch.tool_mask)
    masked_grads, masked_metrics = grads_after_step(module, ended)
    plain_grads, plain_metrics = grads_after_step(module, without)
    unmasked_grads, _ = grads_after_step(module, unmasked)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(masked_grads[name], grad, rtol=1e-4, atol=1e-7)
    assert any(not torch.allclose(unmasked_grads[n], g, rtol=1e-3, atol=1e-6) for n, g in plain_grads.items())
    assert masked_metrics["train/entropy"] == pytest.approx(plain_metrics["train/entropy"], rel=1e-5)


def test_tool_metrics_reduce_over_ranks_as_one_process_would():
    keys = ["tools/call_frequency", "tools/failure_frequency"]
    ranks = [{"tools/call_frequency": 1.0, "tools/failure_frequency": 0.5, "weight/tool_calls": 8.0},
             {"tools/call_frequency": 0.25, "tools/failure_frequency": 0.0, "weight/tool_calls": 2.0}]
    reduced = reduce_over_ranks(ranks, keys)
    assert reduced["tools/call_frequency"] == pytest.approx(0.625)
    assert reduced["tools/failure_frequency"] == pytest.approx(4 / 10)  # failures over all calls


@pytest.mark.parametrize("room", [1, 8])
def test_a_stop_string_in_the_turn_before_a_resumed_sample_ends_nothing(llama, room):
    """A sample resumed after a tool call whose turn a stop string cut: the string sits just before its tool result
    (a short one, as a BPE tokenizer renders it), inside the stop-string window of its next tokens. It must neither
    end the new turn at its first token nor make a sample cut at the length cap look stopped."""
    model, tokenizer = llama
    stop = "</tool_call>\n"  # ends in whitespace: every row is checked after every token
    ids = tokenizer(ADD_CALL + "\n")["input_ids"] + [tokenizer.eos_token_id] + tokenizer("5")["input_ids"]
    engine = RolloutEngine(model, tokenizer, group_size=2, micro_group_size=2, strategy="continuous",
                           max_new_tokens=len(ids) + room, seed=0, stop_strings=[stop])
    groups = engine.new_groups([tokenizer("hi")["input_ids"]])
    groups[0].samples = [SampleProgress(list(ids), [0.0] * len(ids), [0] * len(ids), resumed_at=len(ids))
                         for _ in range(2)]
    with torch.no_grad():
        result = engine.generate_groups(groups)
    for k in range(2):
        new = result.completion_ids[0][k][len(ids):]
        ended_on_its_own = new[-1] in engine.eos_token_ids or stop in tokenizer.decode(new)
        assert ended_on_its_own or len(new) == room  # it ran to the cap, or its own tokens ended it
        assert result.truncated[0][k] == (not ended_on_its_own)


#: A response template for transformers' parser (``parse_response``) in the Hermes format this file's template writes.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}


@pytest.fixture
def parsing(llama):
    """tiny-llama whose tokenizer parses turns with a response template (transformers' newer parser)."""
    model, tokenizer = llama
    tokenizer = copy.deepcopy(tokenizer)
    if "prefix" not in inspect.signature(tokenizer.parse_response).parameters:
        pytest.skip("this transformers' parse_response reads no response_template")
    tokenizer.response_template = RESPONSE_TEMPLATE
    return model, tokenizer


def test_a_response_template_parses_the_calls(parsing):
    CALLS.clear()
    _, out = rollout(parsing, [add], ADD_CALL, iterations=1)
    assert CALLS == [(2, 3), (2, 3)] and (out.calls, out.failures) == (2, 0)
    assert out.messages[0][0][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}


def test_a_parsed_turn_is_the_parsers_message_less_the_eos_it_kept(llama, monkeypatch):
    """The message history (and the reward functions) get the parsed message as TRL keeps it, its reasoning
    included, less an EOS the parser left in its content (transformers #42249)."""
    _, tokenizer = llama
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.response_template = RESPONSE_TEMPLATE
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    box = ToolBox([add], tokenizer, 1)  # set up with the real parser, which reads back the template's call
    monkeypatch.setattr(type(tokenizer), "parse_response", lambda self, ids, **kw: {
        "role": "assistant", "content": "Let me add." + self.eos_token, "reasoning_content": "2 and 3",
        "tool_calls": [call]}, raising=False)
    assert box.parse(tokenizer("anything")["input_ids"]) == (
        {"role": "assistant", "content": "Let me add.", "reasoning_content": "2 and 3"},
        [{"name": "add", "arguments": {"a": 2, "b": 3}}])


def test_the_call_frequency_over_ranks_counts_every_completion_generated():
    """With dynamic sampling the ranks generate different numbers of groups: calls per completion over the step is
    all calls over all completions, as one process generating them all would log."""
    G = 2
    ranks = [{"tools/call_frequency": 4 / (2 * G), "weight/groups_generated": 2.0},  # 4 calls in 2 groups
             {"tools/call_frequency": 0.0, "weight/groups_generated": 6.0}]  # no call in 6 groups
    reduced = reduce_over_ranks(ranks, ["tools/call_frequency"])
    assert reduced["tools/call_frequency"] == pytest.approx(4 / (8 * G))


def test_a_checkpoint_that_carries_partial_rollouts_is_refused_naming_why():
    """Groups carried by a run with partial rollouts (over_provision > 1) would run without tool rounds (and the
    batch had no tool_mask for them): resuming such a checkpoint with data.tools is refused, clearly."""
    from lit_grpo.rollout.builder import Prompt, PromptExample, _Carry, _carried_state
    from lit_grpo.sampling import GroupProgress

    module = make_module()
    module.tokenizer.chat_template = TOOLS_TEMPLATE
    dm = make_datamodule(module, tools=[add], max_tool_calling_iterations=1, max_new_tokens=20)
    builder = dm._require_builder()
    prompt = Prompt(0, PromptExample("2+3?", None, {"prompt": "2+3?"}), list(dm.train_prompt_ids[0]))
    carried = GroupProgress(prompt.ids, [SampleProgress() for _ in range(builder.engine.group_size)], (0, 0),
                            tag=_Carry(prompt))
    state = {**builder.state_dict(), "carried": [_carried_state(carried)]}
    with pytest.raises(ValueError, match=r"carries 1 unfinished group.*data\.tools"):
        builder.load_state_dict(state)


#: TOOLS_TEMPLATE, but a tool turn after an earlier one is rendered otherwise (as DeepSeek-R1's template opens only
#: the conversation's first tool output with its begin token).
AGAIN_TEMPLATE = "{% set ns = namespace(seen=false) %}" + TOOLS_TEMPLATE.replace(
    "{% elif m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n",
    "{% elif m.role == 'tool' %}<|im_start|>tool{{ ' again' if ns.seen }}\n{{ m.content }}<|im_end|>\n"
    "{% set ns.seen = true %}")


def test_each_round_appends_its_tool_turn_as_the_template_renders_it_there(llama):
    model, tokenizer = llama
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = AGAIN_TEMPLATE
    _, out = rollout((model, tokenizer), [add], ADD_CALL, iterations=2, max_new_tokens=400)
    text = tokenizer.decode(out.completion_ids[0][0])
    assert text.count("<|im_start|>tool\n5") == 1 and text.count("<|im_start|>tool again\n5") == 1
    conversation = tokenizer.apply_chat_template([{"role": "user", "content": "2+3?"}] + out.messages[0][0],
                                                 tokenize=False)
    assert conversation.endswith(text + "\n")  # the completion is the conversation as the template writes it


def test_the_tool_rounds_timeline_names_the_rollouts_own_samples():
    """The continuations run the same samples: the step's slot timeline and decisions index them as the first call
    did (a picture colours a sample by its prompt), with no sample that was never drawn."""
    _, batch = tool_batch(reward_funcs=["char_fraction"])
    B, G = batch.rewards.shape
    stats = batch.stats
    assert stats.decode_steps == len(stats.timeline) > 0
    assert {cell for row in stats.timeline for cell in row if cell >= 0} == set(range(B * G))
    assert {d.key for d in stats.decisions} == {(p, k) for p in range(B) for k in range(G)}


def test_a_round_cap_without_tools_is_named_not_dropped():
    with pytest.warns(UserWarning, match=r"max_tool_calling_iterations=3 applies with tools only"):
        make_datamodule(make_module(), max_tool_calling_iterations=3)


async def slow_add(a: int, b: int) -> int:
    """Add two integers, asynchronously.

    Args:
        a: the first.
        b: the second.
    """
    await asyncio.sleep(0.01)
    if a < 0:
        raise ValueError("negative")
    return a + b


def test_an_async_tool_is_awaited_and_its_error_is_its_result(llama):
    _, out = rollout(llama, [slow_add], ADD_CALL.replace('"add"', '"slow_add"'), iterations=1)
    assert (out.calls, out.failures) == (2, 0)
    assert out.messages[0][0][1] == {"role": "tool", "name": "slow_add", "content": "5"}
    box, _ = rollout(llama, [slow_add], ADD_CALL, iterations=0)
    call = {"name": "slow_add", "arguments": {"a": -1, "b": 2}}
    assert box.run(call) == ("slow_add", {"error": "negative"}, True)


def test_a_tool_module_that_fails_to_import_is_named_with_its_error_and_line(tmp_path, monkeypatch):
    """As a reward function's module: a syntax error or an exception in its own code is a setting's error naming the
    tool, the error and where (it escaped data.tools' setting check as a bare traceback)."""
    from lit_grpo.rollout.tools import resolve_tools

    (tmp_path / "typo_tools.py").write_text("def add(a: int, b: int) -> int\n    return a + b\n")
    (tmp_path / "keyless_tools.py").write_text("import os\n\nraise RuntimeError('set SEARCH_KEY')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"tool 'typo_tools:add': module 'typo_tools' raised SyntaxError: "
                                         r"expected ':' \(.*typo_tools.py, line 1\)"):
        resolve_tools(["typo_tools:add"])
    with pytest.raises(ValueError, match=r"tool 'keyless_tools:add': module 'keyless_tools' raised RuntimeError: "
                                         r"set SEARCH_KEY \(.*keyless_tools.py, line 3\)"):
        resolve_tools(["keyless_tools:add"])


@pytest.mark.parametrize("parser", ["hermes", "response_template"])
@pytest.mark.parametrize("turn", ['<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>',  # not JSON
                                  '<tool_call>{"name": 5, "arguments": {}}</tool_call>',  # a name not a string
                                  '<tool_call>["add", {"a": 2}]</tool_call>',  # not an object
                                  '<tool_call>{"name": "add", "argu'])  # cut
def test_a_malformed_call_is_text_without_a_call_under_either_parser(llama, parsing, parser, turn):
    """TRL's parse_response falls back to the turn's text for a call it cannot read: no call, no failure, never the
    run's end. The Hermes parser does the same, so a tokenizer's response schema changes nothing about what counts as
    a call."""
    model, tokenizer = llama if parser == "hermes" else parsing
    _, out = rollout((model, tokenizer), [add], turn, iterations=1)
    assert (out.calls, out.failures) == (0, 0)
    assert out.messages[0][0] == [{"role": "assistant",
                                   "content": tokenizer.decode(call_turn(tokenizer, turn), skip_special_tokens=True)}]


@pytest.mark.parametrize("parser", ["hermes", "response_template"])
def test_a_call_cut_at_the_length_cap_reaches_the_rewards_as_an_unanswered_call(llama, parsing, parser):
    """A sample that writes a whole call and hits max_new_tokens before its turn's end: no room is left for a tool
    result, so nothing runs, but its turn keeps the call as ``tool_calls`` (TRL's parsed message; as past the round
    cap), not the parser's content with the call's text taken out and no call, which showed the rewards nothing."""
    model, tokenizer = llama if parser == "hermes" else parsing
    CALLS.clear()
    cap = len(call_turn(tokenizer, ADD_CALL)) - 1  # the call's text whole, its EOS past the cap
    _, out = rollout((model, tokenizer), [add], ADD_CALL, iterations=1, max_new_tokens=cap)
    assert out.truncated[0] == [True, True] and (out.calls, out.failures, CALLS) == (0, 0, [])
    for k in range(2):
        assert out.completion_ids[0][k] == tokenizer(ADD_CALL)["input_ids"] and out.tool_mask[0][k] == [1] * cap
        (turn,) = out.messages[0][k]
        assert turn["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
        assert turn["content"] == ""


@pytest.mark.parametrize("parser", ["hermes", "response_template"])
def test_a_readable_call_with_bad_arguments_is_a_failed_call_under_either_parser(llama, parsing, parser):
    model, tokenizer = llama if parser == "hermes" else parsing
    _, out = rollout((model, tokenizer), [add], '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>',
                     iterations=1)
    assert (out.calls, out.failures) == (2, 2)
    assert "missing 1 required positional argument: 'b'" in out.messages[0][0][1]["content"]
    _, bare = rollout((model, tokenizer), [add], '<tool_call>{"name": "add"}</tool_call>', iterations=1)
    assert (bare.calls, bare.failures) == (2, 2)  # no arguments: called with none (TRL's {}), and add needs two
    assert "missing 2 required positional arguments" in bare.messages[0][0][1]["content"]


class StopCut(Scripted):
    """``Scripted`` whose turn a stop string (``"</tool_call>"``) cut: it ends with no EOS and is not truncated, as
    the engine returns such a turn (a replay itself reads no stop string)."""

    def generate_groups(self, groups, complete=None, finish=()):
        result = super().generate_groups(groups, complete, finish)
        for p, group in enumerate(result.completion_ids):
            for k, ids in enumerate(group):
                if ids[-len(self.turn):] == self.turn:
                    result.truncated[p][k] = False
        return result


def test_a_turn_cut_by_a_stop_string_is_closed_by_the_templates_end_of_turn_not_eos(llama):
    """A Qwen base tokenizer's EOS is ``<|endoftext|>`` while its template ends a turn with ``<|im_end|>``: the
    closing token comes from the template, so the completion reads as the template writes the conversation."""
    model, tokenizer = llama
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.eos_token = "<|endoftext|>"
    assert tokenizer.eos_token_id != tokenizer.convert_tokens_to_ids("<|im_end|>")
    box = ToolBox([add], tokenizer, 1)
    engine = RolloutEngine(model, tokenizer, group_size=2, micro_group_size=2, strategy="continuous",
                           max_new_tokens=200, seed=0)
    engine = StopCut(engine, tokenizer(ADD_CALL)["input_ids"])
    user = [{"role": "user", "content": "2+3?"}]
    prompt = tokenizer.apply_chat_template(user, tools=box.schemas, add_generation_prompt=True, return_dict=False)
    groups = engine.new_groups([prompt])
    with torch.no_grad():
        out = box.run_rounds(engine, groups, engine.generate_groups(groups))
    for k in range(2):
        expected = tokenizer.apply_chat_template(user + out.messages[0][k][:2], tools=box.schemas,
                                                 add_generation_prompt=True, return_dict=False)
        assert prompt + out.completion_ids[0][k][:len(expected) - len(prompt)] == expected
        assert out.tool_mask[0][k].count(0) == len(expected) - len(prompt) - len(engine.turn)
    assert tokenizer.convert_ids_to_tokens(box.turn_end) == ["<|im_end|>"]


def test_a_template_that_ends_no_turn_with_a_token_is_refused_naming_what_it_writes(llama):
    """Nothing would mark a turn's end (a turn a stop string cut could not be closed as the template writes it): the
    setup says so, and what is needed, where it fell back to the EOS with a warning."""
    _, tokenizer = llama
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE.replace("<|im_end|>", "\n\n")
    refusal = r"writes no token of its own after an assistant turn's tool call \(it renders .*\\n\\n.*special or added"
    with pytest.raises(ValueError, match=refusal):
        ToolBox([add], tokenizer, 1)
    module = make_module()
    module.tokenizer.chat_template = tokenizer.chat_template
    with pytest.raises(ConfigError, match="^data.tools: the chat template writes no token"):
        make_datamodule(module, tools=[add], max_new_tokens=20)


def unmarked_tokenizer(tokenizer):
    """``tokenizer`` whose ``<|im_end|>`` (its template's end of turn) is an added token not marked special, and
    whose EOS is ``<|endoftext|>`` (as a Qwen base tokenizer's), the ids kept."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    source = json.loads(tokenizer.backend_tokenizer.to_str())
    for token in source["added_tokens"]:
        token["special"] = token["special"] and token["content"] != "<|im_end|>"
    unmarked = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(source)),
                                       bos_token="<|im_start|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    unmarked.chat_template = tokenizer.chat_template
    return unmarked


def test_an_end_of_turn_token_not_marked_special_is_read_from_the_template_as_a_special_one(llama):
    """transformers tokenizes an added token as one id whether or not it is special: the template's <|im_end|> is
    the turn's end either way (it fell back to the EOS, with a warning), a turn the model closed with it is read
    (its decoded text keeps it), and a turn a stop string cut is closed with it, as the template writes the turn."""
    model, tokenizer = llama
    tokenizer = unmarked_tokenizer(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end not in tokenizer.all_special_ids and tokenizer.eos_token_id != im_end
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        box = ToolBox([add], tokenizer, 1)
    assert box.turn_end == [im_end]
    call = tokenizer(ADD_CALL)["input_ids"]
    assert box.parse(call + [im_end]) == ({"role": "assistant", "content": ""},
                                          [{"name": "add", "arguments": {"a": 2, "b": 3}}])
    engine = RolloutEngine(model, tokenizer, group_size=2, micro_group_size=2, strategy="continuous",
                           max_new_tokens=200, seed=0)
    user = [{"role": "user", "content": "2+3?"}]
    prompt = tokenizer.apply_chat_template(user, tools=box.schemas, add_generation_prompt=True, return_dict=False)
    for turn in (call, call + [im_end]):  # cut by a stop string after the call; closed by the model
        scripted = StopCut(engine, turn)
        groups = scripted.new_groups([prompt])
        with torch.no_grad():
            out = box.run_rounds(scripted, groups, scripted.generate_groups(groups))
        assert (out.calls, out.failures) == (2, 0)
        expected = tokenizer.apply_chat_template(user + out.messages[0][0][:2], tools=box.schemas,
                                                 add_generation_prompt=True, return_dict=False)
        assert prompt + out.completion_ids[0][0][:len(expected) - len(prompt)] == expected


#: A template whose tool turn depends on the whole conversation: it numbers the turns by their absolute position and
#: wraps a tool's result only where tools are given (as Qwen's templates branch on tools=).
NUMBERED_TEMPLATE = TOOLS_TEMPLATE.replace(
    "{% elif m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n",
    "{% elif m.role == 'tool' %}<|im_start|>tool {{ loop.index0 }}\n"
    "{% if tools %}<tool_response>{{ m.content }}</tool_response>{% else %}{{ m.content }}{% endif %}<|im_end|>\n")


def test_the_tool_turn_is_rendered_in_the_prompts_conversation_with_its_system_prompt_and_tools():
    """The tool turn is the whole conversation's (system prompt, user turn, the call, the tool) as rendered with the
    prompt's tools, less the conversation before it: not a stand-in conversation's, whose turn numbers and missing
    tools render it otherwise."""
    module, batch = tool_batch(template=NUMBERED_TEMPLATE, system_prompt="Be brief.", reward_funcs=["char_fraction"])
    tokenizer, schemas = module.tokenizer, tool_schemas([add])
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    render = lambda messages: tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False,  # noqa: E731
                                                            add_generation_prompt=True)
    for p, prompt in enumerate(batch.prompts):
        before = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
        expected = render(before + [call, {"role": "tool", "name": "add", "content": "5"}])[len(render(before)):]
        assert "<|im_start|>tool 3\n<tool_response>5</tool_response>" in expected
        for k in range(batch.completion_ids.shape[1]):
            text = tokenizer.decode(batch.completion_ids[p, k][batch.completion_mask[p, k].bool()])
            assert text.startswith(expected)


#: Qwen3's stock chat template (Qwen/Qwen3-*'s tokenizer_config.json), exact to the byte: a swap matches it by its text.
QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
#: Qwen3.5's (Qwen/Qwen3.5-4B and larger), exact to the byte: it writes calls as <function=...><parameter=...>.
QWEN3_5_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_5_chat_template.jinja").read_text()
#: The added tokens Qwen3's template writes beyond the tiny tokenizer's <|endoftext|>, <|im_start|> and <|im_end|>
#: (Qwen3's EOS is <|im_end|>, as the tiny tokenizer's); Qwen3 does not mark them special.
QWEN3_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def qwen3_tokenizer():
    """The tiny byte tokenizer with Qwen3's tool and reasoning tokens and its stock chat template."""
    from tokenizers import AddedToken

    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in QWEN3_ADDED])
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


def qwen3_call(a, b, reasoning=None):
    """An assistant turn calling ``add`` as Qwen3 writes it (a reasoning block where given)."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return {"role": "assistant", "content": "" if reasoning is None else f"<think>\n{reasoning}\n</think>\n\n",
            "tool_calls": [call]}


#: Prompts as lit_grpo renders them (a system prompt, earlier turns, the user message last) and one that ends with a
#: tool exchange: earlier assistant turns with and without reasoning, before and after the last user query.
QWEN3_PROMPTS = {
    "single": [{"role": "user", "content": "2+3?"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}],
    "multi": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
              {"role": "assistant", "content": "<think>\nadd\n</think>\n\n2"}, {"role": "user", "content": "2+3?"}],
    "multi_tools": [{"role": "user", "content": "1+1?"}, qwen3_call(1, 1), {"role": "tool", "content": "2"},
                    {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+3?"}],
    "after_tool": [{"role": "user", "content": "2+3?"}, qwen3_call(2, 3), {"role": "tool", "content": "5"},
                   qwen3_call(5, 1, reasoning="once more"), {"role": "tool", "content": "6"}],
}


@pytest.mark.parametrize("thinking", [{}, {"enable_thinking": True}, {"enable_thinking": False}])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("prompt", sorted(QWEN3_PROMPTS))
def test_the_qwen3_tool_template_renders_prompts_as_the_stock_one(prompt, with_tools, thinking):
    """The swap changes nothing a prompt shows the model: every prompt renders token for token as under the stock
    template (so prompts are rendered with the tokenizer's own)."""
    tokenizer = qwen3_tokenizer()
    model, template = tool_chat_template(tokenizer)
    assert model == "Qwen3" and template != QWEN3_TEMPLATE
    render = dict(tools=tool_schemas([add]) if with_tools else None, add_generation_prompt=True, **thinking)
    stock = tokenizer.apply_chat_template(QWEN3_PROMPTS[prompt], tokenize=False, **render)
    assert "<|im_start|>" in stock and stock.endswith("<|im_start|>assistant\n" + (
        "<think>\n\n</think>\n\n" if thinking.get("enable_thinking") is False else ""))
    assert tokenizer.apply_chat_template(QWEN3_PROMPTS[prompt], tokenize=False, chat_template=template,
                                         **render) == stock


@pytest.mark.parametrize("thinking", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("reasoning", [None, "", "I add them."])
def test_the_qwen3_tool_template_renders_a_tool_turn_as_a_continuation(reasoning, thinking):
    """The stock template renders a calling turn's empty reasoning block only while the turn is last, so a tool
    message after it changes the turn; the swapped one renders each turn the same with the tool message after it,
    in the first round and after earlier ones."""
    tokenizer = qwen3_tokenizer()
    _, template = tool_chat_template(tokenizer)
    schemas = tool_schemas([add])
    for before in ([{"role": "user", "content": "2+3?"}, qwen3_call(2, 3, reasoning)],
                   [{"role": "user", "content": "2+3?"}, qwen3_call(2, 3), {"role": "tool", "content": "5"},
                    qwen3_call(5, 1, reasoning)]):
        after = before + [{"role": "tool", "name": "add", "content": "6"}]
        prefix, full = (tokenizer.apply_chat_template(m, tools=schemas, tokenize=False, chat_template=template,
                                                      add_generation_prompt=m is after, **thinking)
                        for m in (before, after))
        assert full.startswith(prefix)
        assert full[len(prefix):] == "<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n" \
            "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if thinking else "")
    stock = [tokenizer.apply_chat_template(m, tools=schemas, tokenize=False, add_generation_prompt=m is after)
             for m in (before, after)]
    assert stock[1].startswith(stock[0]) == bool(reasoning)  # the stock template breaks on an empty block only


@pytest.mark.parametrize("thinking", [{}, {"enable_thinking": False}])
def test_data_tools_with_qwen3s_stock_template_swaps_it_for_tool_turns(thinking):
    """A TRL user's Qwen3 with its stock template and data.tools: set up (it was refused: the template does not
    render a tool turn as a continuation), tool turns rendered with the swapped template, the tokenizer's own
    template kept."""
    module, batch = tool_batch(template=QWEN3_TEMPLATE, reward_funcs=["char_fraction"], chat_template_kwargs=thinking)
    assert module.tokenizer.chat_template == QWEN3_TEMPLATE
    tokenizer = module.tokenizer
    suffix = "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n" + (
        "<think>\n\n</think>\n\n" if thinking else "")
    for p in range(batch.completion_ids.shape[0]):
        for k in range(batch.completion_ids.shape[1]):
            ids = batch.completion_ids[p, k][batch.completion_mask[p, k].bool()]
            tool = batch.tool_mask[p, k][batch.completion_mask[p, k].bool()] == 0
            assert tokenizer.decode(ids[tool]) == "\n" + suffix
    assert batch.metrics["tools/call_frequency"] == 1.0 and batch.metrics["tools/failure_frequency"] == 0.0


def test_the_template_swap_is_said_once(caplog):
    """Prompts are rendered again at each hand-over of a new policy object (fit, then validate): the swap is said at
    the first only."""
    module = make_module()
    module.tokenizer.chat_template = QWEN3_TEMPLATE
    with caplog.at_level(logging.INFO):
        dm = make_datamodule(module, tools=[add], max_new_tokens=20)
        dm.attach(copy.deepcopy(module.policy), module.tokenizer)
    assert dm._toolbox.swapped_template == "Qwen3"
    assert caplog.text.count("chat template is Qwen3's stock one") == 1


def test_a_qwen3_turn_with_reasoning_is_parsed_run_and_continued_as_the_template_writes_it(llama):
    """Qwen3's own tokens (<think>, <tool_call> as added tokens): its call, written after its reasoning, is read and
    run, and the completion is the conversation as the swapped template writes it."""
    model, _ = llama
    tokenizer = qwen3_tokenizer()
    model = copy.deepcopy(model)
    model.resize_token_embeddings(len(tokenizer))
    CALLS.clear()
    turn = '<think>\nI add them.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    box, out = rollout((model, tokenizer), [add], turn, iterations=1)
    assert CALLS == [(2, 3), (2, 3)] and (out.calls, out.failures) == (2, 0)
    assert box.swapped_template == "Qwen3" and tokenizer.chat_template == QWEN3_TEMPLATE
    user = [{"role": "user", "content": "2+3?"}]
    render = dict(tools=box.schemas, tokenize=False, chat_template=box.template_kwargs["chat_template"])
    conversation = tokenizer.apply_chat_template(user + out.messages[0][0], **render)
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, **render)
    assert conversation == prompt + tokenizer.decode(out.completion_ids[0][0]) + "\n"


def test_a_call_written_in_a_reasoning_block_is_a_thought_not_a_call(llama):
    """As Qwen3's response parser (TRL's), calls are read after the reasoning block's ``</think>``: one the model
    wrote while reasoning is not run, and a turn whose only call is in its reasoning calls nothing."""
    model, _ = llama
    tokenizer = qwen3_tokenizer()
    model = copy.deepcopy(model)
    model.resize_token_embeddings(len(tokenizer))
    thought = '<think>\nmaybe <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>\n</think>\n\n'
    CALLS.clear()
    _, out = rollout((model, tokenizer), [add], thought + ADD_CALL, iterations=1)
    assert CALLS == [(2, 3), (2, 3)] and (out.calls, out.failures) == (2, 0)
    assert out.messages[0][0][0]["content"] == ""
    assert out.messages[0][0][0]["reasoning_content"] == thought.strip()[len("<think>"):-len("</think>")].strip()
    _, none = rollout((model, tokenizer), [add], thought + "It is 2.", iterations=1)
    assert none.calls == 0 and [m["role"] for m in none.messages[0][0]] == ["assistant"]


QWEN3_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


#: Qwen3 turns and the message TRL's Qwen3 response template parses from each (trl.chat_template_utils.parse_response
#: after add_response_schema, on this file's Qwen3 tokenizer): the reasoning block apart from the content, stripped,
#: and only where not empty. ``opened``: the prompt pre-wrote ``<think>\n``, as a thinking template's does.
QWEN3_PARSES = [
    ("<think>\nI add them.\n</think>\n\n" + QWEN3_ADD, False, {"reasoning_content": "I add them.", "content": ""}),
    ("<think>\n\n</think>\n\n" + QWEN3_ADD, False, {"content": ""}),
    ("<think>\n\n  I add.  \n\n</think>\n\n  It is 5.  \n", False,
     {"reasoning_content": "I add.", "content": "It is 5."}),
    ("\n<think>\nI add.\n</think>It is 5.", False, {"reasoning_content": "I add.", "content": "It is 5."}),
    ("<think>\nmaybe " + QWEN3_ADD + "\n</think>\n\nIt is 2.", False,
     {"reasoning_content": "maybe " + QWEN3_ADD, "content": "It is 2."}),
    # a block that never closes (TRL's also keeps the <|im_end|> there, which the decoded turn no longer has)
    ("<think>\nunfinished " + QWEN3_ADD, False, {"reasoning_content": "unfinished " + QWEN3_ADD, "content": ""}),
    ("Let me add.\n" + QWEN3_ADD, False, {"content": "Let me add."}),
    ("I add.\n</think>\n\n" + QWEN3_ADD, False, {"content": "I add.\n</think>"}),
    ("I add.\n</think>\n\n" + QWEN3_ADD, True, {"reasoning_content": "I add.", "content": ""}),
    ("I add.\n</think>\n\nIt is 5.", True, {"reasoning_content": "I add.", "content": "It is 5."}),
]


@pytest.mark.parametrize("turn, opened, message", QWEN3_PARSES)
def test_a_qwen3_turn_reaches_the_history_as_trls_qwen3_parser_reads_it(turn, opened, message):
    """Without a response template, a Qwen3 turn's reasoning block is its reasoning_content, not part of its
    content (the history the reward functions get), as TRL's parser gives it; its calls as before."""
    tokenizer = qwen3_tokenizer()
    box = ToolBox([add], tokenizer, 1)
    assert not box.parses  # the Hermes reader, not a response template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+3?"}], tools=box.schemas,
                                           add_generation_prompt=True, return_dict=False)
    prefix = prompt + (tokenizer("<think>\n")["input_ids"] if opened else [])
    parsed, calls = box.parse(call_turn(tokenizer, turn), prefix)
    assert parsed == {"role": "assistant", **message}
    called = turn.endswith(QWEN3_ADD) and not turn.startswith(("<think>\nmaybe", "<think>\nunfinished"))
    assert calls == ([{"name": "add", "arguments": {"a": 2, "b": 3}}] if called else [])


def rstrip_end_tokenizer():
    """The tiny tokenizer whose ``<|im_end|>`` eats the whitespace after it (``rstrip``, as some models' added tokens
    do): the text after a turn's end then tokenizes otherwise alone than in its conversation."""
    from tokenizers import AddedToken

    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"eos_token": AddedToken("<|im_end|>", rstrip=True, normalized=False, special=True)})
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


def suffix_cases():
    """``(name, tokenizer, chat_template_kwargs)``: templates and tokenizers whose tool turns the text cut renders."""
    tiny = tiny_tokenizer()
    cases = [(name, copy.deepcopy(tiny), {}) for name in ("tools", "again", "numbered")]
    for (name, tokenizer, _), template in zip(cases, (TOOLS_TEMPLATE, AGAIN_TEMPLATE, NUMBERED_TEMPLATE)):
        tokenizer.chat_template = template
    unmarked = copy.deepcopy(tiny)
    unmarked.chat_template = TOOLS_TEMPLATE
    cases += [("unmarked", unmarked_tokenizer(unmarked), {}), ("qwen3", qwen3_tokenizer(), {}),
              ("qwen3_no_thinking", qwen3_tokenizer(), {"enable_thinking": False})]
    return cases


@pytest.mark.parametrize("name, tokenizer, thinking", suffix_cases(), ids=lambda case: case
                         if isinstance(case, str) else "")
def test_a_tool_turn_cut_from_the_text_is_the_whole_conversations_tokens(name, tokenizer, thinking):
    """Each round's tool turn is cut from the two conversations' text and only it is tokenized: the same tokens as
    the cut of the two tokenized conversations, in the first round and after earlier ones, with and without
    reasoning and a system prompt, tool results of any text."""
    box = ToolBox([add], tokenizer, 3, chat_template_kwargs=thinking, system_prompt="Be brief.")
    assert box.suffix_from_text
    tokenized = []  # the whole conversations the box tokenizes: none, only the tool turns' text
    render = tokenizer.apply_chat_template
    box.tokenizer = copy.copy(tokenizer)
    box.tokenizer.apply_chat_template = lambda *a, **kw: tokenized.append(kw.get("tokenize", True)) or render(*a, **kw)
    results = ["5", " 5 ", "\n5\n", '{"error": "boom"}', "<|im_end|>x"]
    for reasoning in (None, "I add them."):
        history = []
        for result in results:
            history.append(qwen3_call(2, 3, reasoning) if "qwen3" in name else
                           {"role": "assistant", "content": "", "tool_calls": qwen3_call(2, 3)["tool_calls"]})
            tool = [{"role": "tool", "name": "add", "content": result}]
            for prompt in (box.prompt_messages(), [{"role": "user", "content": "2+3?"}]):
                whole = tool_suffix_ids(tokenizer, tool, prompt, history, tools=box.schemas,
                                        kwargs=box.template_kwargs, turn_end=box.turn_end)
                assert box.suffix_ids(tool, history, prompt) == whole
            history += tool
    assert tokenized and not any(tokenized)


def test_a_tokenizer_whose_turn_end_strips_what_follows_it_is_cut_from_its_tokens():
    """Tokenized alone, the text after an rstrip end-of-turn token is not the conversation's tokens after it: the
    setup sees so and cuts the tokenized conversations, whose tokens the tool turns then are."""
    tokenizer = rstrip_end_tokenizer()
    box = ToolBox([add], tokenizer, 1)
    assert not box.suffix_from_text
    history = [{"role": "assistant", "content": "", "tool_calls": qwen3_call(2, 3)["tool_calls"]}]
    tool = [{"role": "tool", "name": "add", "content": "5"}]
    prompt = box.prompt_messages()
    whole = tool_suffix_ids(tokenizer, tool, prompt, history, tools=box.schemas, turn_end=box.turn_end)
    assert box.suffix_ids(tool, history) == whole
    assert tool_suffix_ids(tokenizer, tool, prompt, history, tools=box.schemas, turn_end=box.turn_end,
                           from_text=True) != whole  # the text cut's tokens would differ here


def test_the_tool_turns_conversation_keeps_a_chat_prompts_other_message_keys():
    """The tool turns render after the prompt's messages as its tokens were rendered from (``render_prompt``):
    every key of its turns, the user turn's name too, with the prompt template's content."""
    from lit_grpo.rollout.prompts import PromptExample

    box = ToolBox([add], qwen3_tokenizer(), 1, prompt_template="Q: {prompt}")
    chat = [{"role": "assistant", "content": "Hi.", "reasoning_content": "greet"},
            {"role": "user", "content": "2+3?", "name": "ada"}]
    assert box.prompt_messages(PromptExample("2+3?", messages=chat)) == [
        chat[0], {"role": "user", "content": "Q: 2+3?", "name": "ada"}]


def test_a_tokenizer_with_several_named_templates_has_the_one_tools_select_matched():
    """A tokenizer's templates by name: tool turns render with the one tools= picks (transformers' ``tool_use``
    where it has one, else ``default``), which is matched as a lone template is (it was never: a stock Qwen3 one was
    refused)."""
    for templates, swapped in (({"default": QWEN3_TEMPLATE}, "Qwen3"),
                               ({"default": TOOLS_TEMPLATE, "tool_use": QWEN3_TEMPLATE}, "Qwen3"),
                               ({"default": QWEN3_TEMPLATE, "tool_use": TOOLS_TEMPLATE}, None)):
        tokenizer = qwen3_tokenizer()
        tokenizer.chat_template = templates
        box = ToolBox([add], tokenizer, 1)
        assert box.swapped_template == swapped
        history = [qwen3_call(2, 3)]
        tool = [{"role": "tool", "name": "add", "content": "5"}]
        text = tokenizer.decode(box.suffix_ids(tool, history))
        assert text.startswith("\n<|im_start|>") and text.endswith("<|im_start|>assistant\n")
        assert ("<tool_response>\n5\n</tool_response>" in text) == (swapped is not None)


def test_an_unknown_template_that_drops_part_of_a_turn_is_refused_naming_the_known_ones_and_how_to_pass_one():
    """Another revision of a stock template (here Qwen3's, one character off) is not swapped: the refusal says
    which templates are, and how to give the model a prefix-preserving one."""
    tokenizer = qwen3_tokenizer()
    tokenizer.chat_template = QWEN3_TEMPLATE + "\n"
    assert tool_chat_template(tokenizer) is None
    with pytest.raises(ValueError, match=r"not render tool messages as a continuation.*known stock template only, "
                                         r"matched by its exact text \(Qwen3's\).*chat_template\.jinja.*"
                                         r"tokenizer\.chat_template"):
        ToolBox([add], tokenizer, 1)


#: Other Qwen3 revisions' stock chat templates, exact to the byte (their models' tokenizer_config.json, as TRL 1.16
#: ships them to recognise the models), by their SHA-256: each renders a turn the same whatever follows it, so none
#: needs a swap.
QWEN3_REVISIONS = {
    "qwen3_instruct_2507": "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326",
    "qwen3_vl": "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4",
    "qwen3_5": "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715",  # Qwen3.5-4B and larger
}


@pytest.mark.parametrize("thinking", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("name", sorted(QWEN3_REVISIONS))
def test_other_qwen3_revisions_render_tool_turns_as_continuations_without_a_swap(name, thinking):
    """Qwen3-2507, Qwen3-VL and Qwen3.5 stock templates: set up unswapped, and each tool turn, after a turn with or
    without reasoning, in the first round or after one, is the conversation's rendering after the calling turn's
    end."""
    import hashlib

    template = (Path(__file__).parent / "data" / f"{name}_chat_template.jinja").read_text()
    assert hashlib.sha256(template.encode()).hexdigest() == QWEN3_REVISIONS[name]
    tokenizer = qwen3_tokenizer()
    tokenizer.chat_template = template
    thinking = thinking if name == "qwen3_5" else {}
    schemas, im_end = tool_schemas([add]), tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tool_chat_template(tokenizer, schemas) is None
    box = ToolBox([add], tokenizer, 1, chat_template_kwargs=thinking)
    assert box.swapped_template is None and box.turn_end == [im_end]
    tool = [{"role": "tool", "name": "add", "content": "6"}]
    render = dict(tools=schemas, tokenize=False, **thinking)
    for prompt in (QWEN3_PROMPTS["single"], QWEN3_PROMPTS["multi"]):
        for reasoning in (None, "", "I add them."):
            for history in ([qwen3_call(2, 3, reasoning)],
                            [qwen3_call(2, 3), {"role": "tool", "content": "5"}, qwen3_call(5, 1, reasoning)]):
                before = tokenizer.apply_chat_template(prompt + history, **render)
                after = tokenizer.apply_chat_template(prompt + history + tool, add_generation_prompt=True, **render)
                end = before.rindex("<|im_end|>") + len("<|im_end|>")
                assert after.startswith(before[:end])
                assert tokenizer.decode(box.suffix_ids(tool, history, prompt)) == after[end:]


#: TOOLS_TEMPLATE writing its calls as Mistral's templates do, a format neither reader reads.
MISTRAL_CALLS_TEMPLATE = TOOLS_TEMPLATE.replace(
    "<tool_call>{{ c.function | tojson }}</tool_call>", "[TOOL_CALLS]{{ c.function.name }}[ARGS]"
    "{{ c.function.arguments | tojson }}")


def test_a_template_whose_calls_the_reader_does_not_read_back_is_refused_naming_the_format(llama):
    """A template writing its calls as [TOOL_CALLS]add[ARGS]{...}, which the reader does not read: no tool would
    ever run, without a word (it set up). Refused, showing the format, under either reader (Qwen3.5's <function=...>
    calls under a Hermes response template too); a response template that reads the template's own format sets
    up."""
    _, tokenizer = llama
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = MISTRAL_CALLS_TEMPLATE
    with pytest.raises(ValueError, match=r"writes a tool call as .*\[TOOL_CALLS\]add\[ARGS\].*lit_grpo's reader "
                                         r"without a response template .*does not read back"):
        ToolBox([add], tokenizer, 1)
    if "prefix" in inspect.signature(tokenizer.parse_response).parameters:
        tokenizer.response_template = RESPONSE_TEMPLATE  # the Hermes format's
        with pytest.raises(ValueError, match=r"\[TOOL_CALLS\].*which the tokenizer's response_template"):
            ToolBox([add], tokenizer, 1)
        qwen3_5 = qwen3_tokenizer()
        qwen3_5.chat_template, qwen3_5.response_template = QWEN3_5_TEMPLATE, RESPONSE_TEMPLATE
        with pytest.raises(ValueError, match=r"<function=add>.*which the tokenizer's response_template"):
            ToolBox([add], qwen3_5, 1)
    _, hermes = llama
    hermes = copy.deepcopy(hermes)
    hermes.response_template = RESPONSE_TEMPLATE
    assert ToolBox([add], hermes, 1).parses


@pytest.mark.parametrize("strategy", ["full", "micro", "continuous", "infinite"])
def test_a_turn_ends_at_the_templates_end_of_turn_token_where_it_is_no_eos(strategy):
    """A Qwen base model's EOS is ``<|endoftext|>`` (its tokenizer's and its generation config's) while its template
    ends a turn with ``<|im_end|>``: every strategy stops a sample at its first ``<|im_end|>``, kept in the
    completion and its mask as an EOS is and not truncated, and the update's log-probs are the sampler's there
    too. Without the stop the model wrote on past its turn's end (the next turns of a conversation it invents)."""
    module = make_module()
    tokenizer, policy = module.tokenizer, module.policy
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.eos_token = "<|endoftext|>"
    policy.generation_config.eos_token_id = tokenizer.eos_token_id
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end != tokenizer.eos_token_id

    def likely_end(_, __, logits):  # the random model draws <|im_end|> within a few tokens
        logits = logits.clone()
        logits[..., im_end] += 4.0
        return logits

    policy.lm_head.register_forward_hook(likely_end)
    dm = make_datamodule(module, tools=[add], max_tool_calling_iterations=1, max_new_tokens=40, strategy=strategy,
                         micro_group_size=None if strategy == "full" else 2)
    batch = dm.build_train_batch()
    ids, mask = batch.completion_ids, batch.completion_mask.bool()
    assert not batch.truncated.any()
    ends = []
    for p in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            completion = ids[p, k][mask[p, k]].tolist()
            assert im_end not in completion[:-1]  # its first <|im_end|> ended it
            ends.append(completion[-1])
    assert set(ends) <= {im_end, tokenizer.eos_token_id} and ends.count(im_end) > len(ends) // 2
    micro = batch.micro_batch(torch.arange(batch.num_completions))
    with torch.no_grad():
        logps = token_logps(completion_logits(policy, micro, batch.temperature), micro["completion_ids"])
    torch.testing.assert_close(logps[micro["completion_mask"].bool()],
                               micro["sampling_logprobs"][micro["completion_mask"].bool()], atol=2e-4, rtol=1e-4)
    builder = dm._require_builder()  # validation's engines, greedy and sampled, stop there too
    assert all(im_end in engine.eos_token_ids for engine in (builder.val_engine, builder.val_sampled_engine))


def test_an_end_of_turn_token_the_model_cannot_draw_is_refused_naming_it(llama):
    _, tokenizer = llama
    box = ToolBox([add], tokenizer, 1)
    narrow = types.SimpleNamespace(get_output_embeddings=lambda: types.SimpleNamespace(weight=torch.empty(2, 1)))
    with pytest.raises(ValueError, match=r"ends a turn with token id 2 \('<\|im_end\|>'\), outside the model's 2 "
                                         r"output ids.*resize_token_embeddings"):
        box.stop_token_ids(narrow)


def qwen3_5_call(name="add", **arguments) -> str:
    """A call as Qwen3.5's template writes it: each argument's value on its own lines, as text."""
    parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in arguments.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


@pytest.mark.parametrize("thinking", [{}, {"enable_thinking": False}])
def test_a_qwen3_5_call_is_read_run_and_continued_as_the_template_writes_it(llama, thinking):
    """Qwen3.5's stock template writes a call as <function=add><parameter=a>2</parameter>...: it sets up (it was
    refused: no reader read it), the call runs with its arguments typed as the tool's schema types them, and the
    completion is the conversation as the template writes it (reasoning and all)."""
    model, _ = llama
    tokenizer = qwen3_tokenizer()
    tokenizer.chat_template = QWEN3_5_TEMPLATE
    model = copy.deepcopy(model)
    model.resize_token_embeddings(len(tokenizer))
    CALLS.clear()
    # the thinking prompt pre-writes "<think>\n": the turn reasons, then calls
    turn = ("" if thinking else "I add them.\n</think>\n\n") + qwen3_5_call(a=2, b=3)
    box, out = rollout((model, tokenizer), [add], turn, iterations=1, max_new_tokens=400,
                       chat_template_kwargs=thinking)
    assert CALLS == [(2, 3), (2, 3)] and (out.calls, out.failures) == (2, 0)
    assert box.swapped_template is None and not box.parses
    first = out.messages[0][0][0]
    assert first["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    assert first.get("reasoning_content") == (None if thinking else "I add them.") and first["content"] == ""
    user = [{"role": "user", "content": "2+3?"}]
    render = dict(tools=box.schemas, tokenize=False, **thinking)
    conversation = tokenizer.apply_chat_template(user + out.messages[0][0], **render)
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, **render)
    assert conversation == prompt + tokenizer.decode(out.completion_ids[0][0]) + "\n"


def zip_code(code: str, country: str = "US") -> str:
    """Look a zip code up.

    Args:
        code: the zip code.
        country: its country.
    """
    return code


def typed(n: int, x: float, flag: bool, options: dict, items: list, maybe: int | None = None,
          either: int | str = 0) -> str:
    """Take one value of each JSON schema type.

    Args:
        n: an integer.
        x: a number.
        flag: a boolean.
        options: an object.
        items: an array.
        maybe: an integer or null.
        either: an integer or a string (a list of types).
    """
    return ""


def _typed_call(**values: str) -> str:
    return "<function=typed>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items()) + \
        "</function>"


@pytest.mark.parametrize("values, arguments", [
    ({"n": "7", "x": "2", "flag": "True", "options": '{"k": [1]}', "items": "[1, 2]", "maybe": "null"},
     {"n": 7, "x": 2, "flag": True, "options": {"k": [1]}, "items": [1, 2], "maybe": None}),
    ({"x": "2.5", "flag": "false", "maybe": "3", "n": "None", "either": "4"},
     {"x": 2.5, "flag": False, "maybe": 3, "n": None, "either": 4}),
    # a value that does not read as its schema's type stays text, as Qwen's own parser keeps it
    ({"n": "2.5", "x": "true", "flag": "1", "options": "[1]", "items": '{"a": 1}', "maybe": "[]"},
     {"n": "2.5", "x": "true", "flag": "1", "options": "[1]", "items": '{"a": 1}', "maybe": "[]"}),
    ({"n": "true", "x": "seven", "items": '"a"', "either": "[4]"},
     {"n": "true", "x": "seven", "items": '"a"', "either": "[4]"}),
    # a string is written as it is, so one in quotes keeps them, as where the schema types it a string alone
    ({"either": '"4"'}, {"either": '"4"'}),
])
def test_a_qwen3_5_value_takes_its_schemas_type_or_stays_text(values, arguments):
    assert call_body(_typed_call(**values), tool_schemas([typed])) == {"name": "typed", "arguments": arguments}


@pytest.mark.parametrize("body, call", [
    ("<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n-3\n</parameter>\n</function>",
     {"name": "add", "arguments": {"a": 2, "b": -3}}),
    ("<function=zip_code>\n<parameter=code>\n75001\n</parameter>\n</function>",  # a string stays text
     {"name": "zip_code", "arguments": {"code": "75001"}}),
    ("<function=other>\n<parameter=x>\n75001\n</parameter>\n<parameter=y>\nnot json\n</parameter>\n"
     "<parameter=z>\n[1, {\"k\": null}]\n</parameter>\n<parameter=t>\nTrue\n</parameter>\n"
     "<parameter=n>\nNone\n</parameter>\n</function>",  # no schema: JSON where it reads, else text
     {"name": "other", "arguments": {"x": 75001, "y": "not json", "z": [1, {"k": None}], "t": True, "n": None}}),
    ("<function=add>\n</function>", {"name": "add", "arguments": {}}),  # no arguments: {} (TRL's)
    ("<function=add>\n<parameter=a>\n2\n</parameter>\n", None),  # cut before </function>
    ("<function=add>\nI add.<parameter=a>\n2\n</parameter>\n</function>", None),  # text among the parameters
    ("<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=a>\n3\n</parameter>\n</function>", None),
])
def test_a_qwen3_5_call_body_is_read_with_the_tools_types(body, call):
    assert call_body(body, tool_schemas([add, zip_code])) == call


def test_a_malformed_qwen3_5_call_is_text_without_a_call(llama):
    """As a malformed Hermes call: the turn is text, no tool runs and no failure is counted."""
    model, _ = llama
    tokenizer = qwen3_tokenizer()
    tokenizer.chat_template = QWEN3_5_TEMPLATE
    model = copy.deepcopy(model)
    model.resize_token_embeddings(len(tokenizer))
    turn = qwen3_5_call(a=2, b=3).replace("</function>", "")
    _, out = rollout((model, tokenizer), [add], turn, iterations=1, chat_template_kwargs={"enable_thinking": False})
    assert (out.calls, out.failures) == (0, 0) and [m["role"] for m in out.messages[0][0]] == ["assistant"]


#: TOOLS_TEMPLATE writing a newline after a calling turn's end only in one kind of round, which an end token that
#: strips the whitespace after it (``rstrip_end_tokenizer``) eats in the conversation's tokens but not in the text
#: cut's: after a reasoning block, with several calls in the turn, before an empty result.
ROUND_KINDS = {
    "reasoning": "'\\n' if '<think>' in m.content",
    "several_calls": "'\\n' if m.tool_calls | length > 1",
    "empty_result": "'\\n' if loop.nextitem is defined and loop.nextitem.content == ''",
}


@pytest.mark.parametrize("kind", sorted(ROUND_KINDS))
def test_the_setup_checks_the_text_cut_on_each_kind_of_round(kind):
    """The text cut is checked at setup against the tokenized conversations' cut: on a round with reasoning, with
    several calls and with an empty result too, not only on a plain one, as a template may write what follows a
    turn's end otherwise in each. A tokenizer for which one of them differs cuts the tokenized conversations, whose
    tokens every round's tool turn then is."""
    tokenizer = rstrip_end_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE.replace("{% endfor %}<|im_end|>\n",
                                                     "{% endfor %}<|im_end|>{{ " + ROUND_KINDS[kind] + " }}")
    box = ToolBox([add], tokenizer, 1)
    calls = qwen3_call(2, 3)["tool_calls"] * (2 if kind == "several_calls" else 1)
    turn = {"role": "assistant", "content": "<think>\nI add.\n</think>\n\n" if kind == "reasoning" else "",
            "tool_calls": calls}
    tool = [{"role": "tool", "name": "add", "content": "" if kind == "empty_result" else "5"}] * len(calls)
    whole = tool_suffix_ids(tokenizer, tool, box.prompt_messages(), [turn], tools=box.schemas,
                            turn_end=box.turn_end)
    assert box.suffix_ids(tool, [turn]) == whole
    assert not box.suffix_from_text
