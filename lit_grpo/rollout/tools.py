"""Tool calling during rollouts (EXPERIMENTAL, opt-in: ``data.tools``), as TRL 1.16's ``GRPOTrainer(tools=...)``.

The prompts are rendered with the tools' JSON schemas (the chat template's ``tools=``). A sample whose turn ends
with a tool call (EOS, or a stop string of ``data.sampling.stop_strings`` such as ``"</tool_call>"``, after which
the template's own end-of-turn token is appended: ``turn_end_ids``; that token ends a sample as an EOS does,
``ToolBox.stop_token_ids``) gets each called tool run on the host, the tool messages appended to its tokens as the
chat template renders them in the sample's conversation (the prompt's system prompt, tools and template variables,
its earlier turns), and decodes on: the builder hands such samples back to ``RolloutEngine.generate_groups`` as
carried samples (``SampleProgress`` with ``resumed_at``), re-prefilled with their tokens so far and drawing on from
their own random streams, so the decode loop is the partial rollouts' one. A tool's exception becomes its result,
``{"error": "..."}``, as TRL's; an ``async def`` tool is awaited, a round's async calls together. A known stock chat
template that does not render a conversation as a continuation of its prefix (Qwen3's) is swapped for a
prefix-preserving version of it in the tool turns' renderings (``tool_chat_template``), as TRL swaps in a training
template.

The appended tokens are part of the completion but were not drawn by the policy: ``tool_mask`` (TRL's name) is 0
on them, 1 on drawn tokens, and they get no loss, KL, entropy or sampler correction, and do not count in the
logged ``completions/*_length`` (TRL's). They are in the reward functions' ``completion_ids`` (TRL's) and so in
their ``completion_length`` column. They do count against ``max_new_tokens`` (TRL's ``max_completion_length``): a
tool result that would leave no room for a drawn token is dropped and the sample ends as it is.

Tool calls are parsed with the tokenizer's ``parse_response`` where it has a response schema (as TRL), else in the
Hermes / Qwen format or Qwen3.5's, after a reasoning block (``lit_grpo.rollout.tool_calls``). Under either, a turn
whose calls cannot be read (a malformed or cut call) is text with no call, TRL's fallback: no tool runs and no
failure is counted. A call that reads but fails to run (an unknown tool, arguments that do not fit) is a failed
call. A template whose calls the reader does not read back is refused at setup (``check_calls_read``).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lit_grpo.rollout.async_loop import run_concurrently
from lit_grpo.rollout.prompts import PromptExample, chat_turns, prompt_messages
from lit_grpo.rollout.rewards import import_failure
from lit_grpo.rollout.tool_calls import HERMES_CALL, call_body, json_value, read_calls, reasoning_open, split_reasoning
from lit_grpo.runtime.validation import check_int, config_errors, shown_setting, shown_value
from lit_grpo.sampling.carry import GroupProgress, SampleProgress
from lit_grpo.sampling.decode_step import vocab_size
from lit_grpo.sampling.engine import stop_token_ids
from lit_grpo.sampling.stats import RolloutStats
from lit_grpo.scheduling.driver import IDLE

#: The argument (name and value) of the stand-in call that ``turn_end_ids`` and ``check_calls_read`` render.
TURN_MARKER = "lit_grpo_turn_marker"


def resolve_tools(specs: Sequence[Any] | None) -> list[Callable]:
    """The tool functions of ``data.tools``: each a callable or a ``"package.module:function"`` name, imported.
    Raises naming the entry that does not resolve, or two tools of one name (the model calls them by name)."""
    if specs is None:
        return []
    if isinstance(specs, (str, bytes, Mapping)) or not isinstance(specs, Sequence):
        raise ValueError(f"{shown_setting('tools', specs, 80)} must be a list of callables or "
                         "'package.module:function' names")
    tools = [_resolve_tool(spec) for spec in specs]
    names = [tool.__name__ for tool in tools]
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"tools has several functions named {repeated}; the model calls a tool by its name, so "
                         "each needs its own")
    return tools


def _resolve_tool(spec: Any) -> Callable:
    if callable(spec):
        if not hasattr(spec, "__name__"):
            raise ValueError(f"tool {shown_value(spec, 80)} has no __name__: give a function (its name, type hints and "
                             "docstring make its schema)")
        return spec
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"tool {shown_value(spec, 80)} must be a callable or a 'package.module:function' name")
    module_name, attribute = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"tool {spec!r}: module {module_name!r} does not import ({error})") from error
    except Exception as error:  # noqa: BLE001 - the module's own code failed: a setting's error, not a traceback
        raise ValueError(f"tool {spec!r}: module {module_name!r} raised {import_failure(error)}") from error
    tool = getattr(module, attribute, None)
    if not callable(tool):
        raise ValueError(f"tool {spec!r}: module {module_name!r} has no function {attribute!r}")
    return tool


def tool_schemas(tools: Sequence[Callable]) -> list[dict]:
    """``[len(tools)]`` JSON schemas from the functions' type hints and docstrings (transformers'
    ``get_json_schema``); raises naming a function it cannot describe."""
    from transformers.utils import get_json_schema

    schemas = []
    for tool in tools:
        try:
            schemas.append(get_json_schema(tool))
        except Exception as error:  # its own TypeError / DocstringParsingException, each naming what is missing
            raise ValueError(f"tool {tool.__name__!r} has no JSON schema: {error}; a tool needs type hints on "
                             "every argument and a Google-style docstring with an Args section") from error
    return schemas


@dataclass
class ToolRollout:
    """One rollout's completions after its tool rounds, ``[b][G]`` each, as ``RolloutResult``'s fields.

    Attributes:
        tool_mask: ``[b][G][T_i]`` 1 on drawn tokens, 0 on appended tool messages.
        messages: ``[b][G]`` each completion as a conversation: its assistant turns (``content`` and
            ``tool_calls``) and tool messages; one assistant turn where it called no tool.
        stats: each engine call's ``RolloutStats``, the first rollout's and then each tool round's, their
            samples keyed as the first call's (``_renumbered``).
        calls, failures: tool calls made and those that failed (unknown tool, bad arguments, the tool raised).
    """

    completion_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    versions: list[list[list[int]]]
    truncated: list[list[bool]]
    tool_mask: list[list[list[int]]]
    messages: list[list[list[dict]]]
    stats: list[RolloutStats] = field(default_factory=list)
    calls: int = 0
    failures: int = 0

    @classmethod
    def from_result(cls, result: Any) -> ToolRollout:
        """A rollout's ``RolloutResult`` before any tool round: every token drawn, no message yet."""
        return cls([[list(ids) for ids in group] for group in result.completion_ids],
                   [[list(lp) for lp in group] for group in result.logprobs],
                   [[list(v) for v in group] for group in result.versions],
                   [list(group) for group in result.truncated],
                   [[[1] * len(ids) for ids in group] for group in result.completion_ids],
                   [[[] for _ in group] for group in result.completion_ids], [result.stats])

    def append_tool_turn(self, p: int, k: int, suffix: Sequence[int], tool_messages: list[dict],
                         version: int) -> None:
        """Append to completion ``(p, k)`` its ``tool_messages``, rendered as the ``suffix`` tokens: not drawn
        (``tool_mask`` 0, log-prob 0), counted as of rollout ``version``."""
        self.completion_ids[p][k].extend(suffix)
        self.logprobs[p][k].extend([0.0] * len(suffix))
        self.versions[p][k].extend([version] * len(suffix))
        self.tool_mask[p][k].extend([0] * len(suffix))
        self.messages[p][k].extend(tool_messages)

    def continue_with(self, p: int, k: int, result: Any, i: int) -> None:
        """Completion ``(p, k)`` as the continued decode's ``result`` holds it (its group ``i``): the tokens past
        those it had were drawn (``tool_mask`` 1)."""
        new = result.completion_ids[i][k][len(self.completion_ids[p][k]):]
        self.tool_mask[p][k].extend([1] * len(new))
        self.completion_ids[p][k] = list(result.completion_ids[i][k])
        self.logprobs[p][k] = list(result.logprobs[i][k])
        self.versions[p][k] = list(result.versions[i][k])
        self.truncated[p][k] = result.truncated[i][k]


class ToolBox:
    """The tools of a run, their schemas and the tokenizer that renders and parses their turns.

    Args:
        tools: ``data.tools`` (``resolve_tools``).
        tokenizer: the policy's; its chat template must render the tools and tool messages (checked here).
        max_tool_calling_iterations: tool rounds per completion (TRL's setting); None: no count (the rounds still
            end, as each appends tokens within ``max_new_tokens``).
        chat_template_kwargs: the chat template's variables (``data.chat_template_kwargs``).
        system_prompt: the prompts' system prompt (``data.system_prompt``), so that a tool turn is rendered in its
            prompt's own conversation.
        prompt_template: the prompts' user message template (``data.prompt_template``), likewise.

    Attributes:
        turn_end: the tokens that close an assistant turn (``turn_end_ids``), appended to a turn a stop string cut.
        swapped_template: the name of the model whose stock chat template is swapped in the tool turns' renderings
            (``tool_chat_template``), or None: the tokenizer's own template renders them.
        template_kwargs: ``apply_chat_template``'s keywords for the tool turns: the chat template's variables and,
            where a template was swapped, ``chat_template=`` the prefix-preserving one.
        suffix_from_text: whether a tool turn's tokens are cut from the conversations' text and only they are
            tokenized (``suffix_from_text``, checked here), else from the tokenized conversations.
    """

    def __init__(self, tools: Sequence[Any], tokenizer: Any, max_tool_calling_iterations: int | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None, system_prompt: str | None = None,
                 prompt_template: str = "{prompt}"):
        self.tools = resolve_tools(tools)
        if not self.tools:
            raise ValueError("tools is empty: give at least one tool, or leave data.tools unset")
        self.max_tool_calling_iterations = check_max_tool_calling_iterations(max_tool_calling_iterations)
        self.schemas = tool_schemas(self.tools)
        self.by_name = {tool.__name__: tool for tool in self.tools}
        self.tokenizer, self.chat_template_kwargs = tokenizer, dict(chat_template_kwargs or {})
        self.system_prompt, self.prompt_template = system_prompt, prompt_template
        swap = tool_chat_template(tokenizer, self.schemas)
        self.swapped_template = swap[0] if swap else None
        self.template_kwargs = {**self.chat_template_kwargs, **({"chat_template": swap[1]} if swap else {})}
        stand_in = self.prompt_messages()  # what the checks render a turn after
        check_template_renders_tools(tokenizer, self.schemas, self.template_kwargs, stand_in)
        self.turn_end = turn_end_ids(tokenizer, stand_in, self.schemas, self.template_kwargs)
        self.suffix_from_text = suffix_from_text(tokenizer, stand_in, self.schemas, self.template_kwargs,
                                                 self.turn_end)
        # the schema parse_response reads (TRL's test); else the Hermes format
        self.parses = any(getattr(tokenizer, name, None) is not None for name in ("response_schema",
                                                                                  "response_template"))
        # transformers' newer parser reads a response_template and needs the text before the turn (prefix=: the
        # template may have pre-written part of it, such as "<think>"), and types arguments by the tools' schemas
        parameters = inspect.signature(tokenizer.parse_response).parameters if self.parses else {}
        self.parse_keywords = {name for name in ("prefix", "tools") if name in parameters} \
            if getattr(tokenizer, "response_template", None) is not None else set()
        check_calls_read(self.parse, tokenizer, stand_in, self.schemas, self.template_kwargs, self.turn_end)

    def stop_token_ids(self, model: Any) -> list[int]:
        """The ids a rollout with these tools ends a sample on: the model's EOS ids (the engine's default,
        ``stop_token_ids``) and the template's ``turn_end``, which need not be one of them (a Qwen base model's EOS is
        ``<|endoftext|>`` while its template ends a turn with ``<|im_end|>``). A turn the model closed is over: a call
        it ends with is read and run, and the model does not write on into turns of a conversation it invents. The
        stop token stays in the completion, as an EOS does. Raises where the model cannot draw ``turn_end``."""
        vocab = vocab_size(model)
        if outside := [token for token in self.turn_end if not 0 <= token < vocab]:
            raise ValueError(f"the chat template ends a turn with token id {outside[0]} "
                             f"({self.tokenizer.convert_ids_to_tokens(outside[0])!r}), outside the model's {vocab} "
                             "output ids: the model could never end a turn; resize its embeddings to the tokenizer "
                             "(model.resize_token_embeddings(len(tokenizer)))")
        return sorted({*stop_token_ids(model, self.tokenizer), *self.turn_end})

    # ------------------------------------------------------------------------------------------ parsing
    def parse(self, ids: Sequence[int], prefix: Sequence[int] = ()) -> tuple[dict, list[dict]]:
        """One assistant turn's message without its calls (``{"role": "assistant", "content": ...}``, and what else
        ``parse_response`` read, such as ``reasoning_content``, as TRL keeps the parsed message) and its tool calls
        (``[{"name", "arguments"}]``, empty: no call). ``prefix``: the token ids before the turn (the prompt, the
        completion's earlier turns and tool results). Read by the tokenizer's ``parse_response`` where it has a
        response schema or template (``_parse_response``), else in the Hermes / Qwen format (``_parse_hermes``).

        A turn whose calls cannot be read (not JSON, not an object, a name that is not a string) is its text with no
        call, under either parser: TRL's ``parse_response`` falls back so, and a tool call the model wrote so badly
        is no call at all, so it is neither run nor counted as a failure. A call that reads but does not run (an
        unknown tool, arguments that do not fit it) is a failed call (``run``)."""
        # the turn's own end is no text of it: decoding skips it only where the tokenizer marks it special
        ended = bool(self.turn_end) and list(ids[-len(self.turn_end):]) == self.turn_end
        text = self.tokenizer.decode(list(ids[:len(ids) - len(self.turn_end)] if ended else ids),
                                     skip_special_tokens=True)
        plain = {"role": "assistant", "content": text}
        if self.parses:
            return self._parse_response(ids, prefix, plain)
        return self._parse_hermes(text, prefix, plain)

    def _parse_response(self, ids: Sequence[int], prefix: Sequence[int], plain: dict) -> tuple[dict, list[dict]]:
        """``parse`` by the tokenizer's ``parse_response``; ``plain``: the turn as text with no call, its fallback."""
        keywords = {"prefix": list(prefix), "tools": self.schemas}
        try:
            parsed = self.tokenizer.parse_response(list(ids), **{k: keywords[k] for k in self.parse_keywords})
        except (ValueError, TypeError):  # a malformed or cut call
            return plain, []
        if not isinstance(parsed, Mapping):  # a turn cut so early the parser found nothing
            return plain, []
        calls = read_calls(parsed.get("tool_calls") or [])
        if calls is None:
            return plain, []
        # some transformers versions leave the EOS in a call turn's content (transformers #42249; TRL strips it)
        content = parsed.get("content") or ""
        if isinstance(content, str) and self.tokenizer.eos_token:
            content = content.removesuffix(self.tokenizer.eos_token)
        extra = {k: v for k, v in parsed.items() if k not in ("role", "content", "tool_calls")}
        return {"role": "assistant", "content": content, **extra}, calls

    def _parse_hermes(self, text: str, prefix: Sequence[int], plain: dict) -> tuple[dict, list[dict]]:
        """``parse`` of the turn's ``text`` in the Hermes / Qwen format (or Qwen3.5's, ``call_body``), as TRL reads
        it with Qwen3's: a reasoning block (``split_reasoning``; one ``prefix`` left open too) is its
        ``reasoning_content`` where not empty, out of its ``content`` (Qwen3's template splits a block in the content
        back out when it renders it, so the rendering is the same, and the reward functions get the message TRL gives
        them). ``plain``: the turn as text with no call, its fallback."""
        reasoning, rest = split_reasoning(text, reasoning_open(self.tokenizer, prefix))
        message = plain if reasoning is None else {"role": "assistant", "content": rest.strip(),
                                                   **({"reasoning_content": reasoning} if reasoning else {})}
        # calls are read after a reasoning block: one written while reasoning is a thought (Qwen3's parser, TRL's)
        start = rest.find("</think>") + len("</think>") if reasoning is None and "</think>" in rest else 0
        calls = read_calls([call_body(body, self.schemas) for body in HERMES_CALL.findall(rest, start)])
        if calls is None:
            return plain, []
        # a call is acted on only where the turn ends with it (text after the last call: the model went on)
        if not calls or rest[rest.rfind("</tool_call>") + len("</tool_call>"):].strip():
            return message, []
        return {**message, "content": rest[:rest.find("<tool_call>", start)].strip()}, calls

    # ------------------------------------------------------------------------------------------ running
    def run(self, call: dict) -> tuple[str, Any, bool]:
        """``(name, result, failed)`` of one parsed call; an unknown tool, bad arguments or the tool's exception
        give ``{"error": text}``."""
        return self.run_all([call])[0]

    def run_all(self, calls: Sequence[dict]) -> list[tuple[str, Any, bool]]:
        """``run``'s ``(name, result, failed)`` of each call: the plain tools' in turn, then the async ones' (``async
        def``, as TRL's: their call returns an awaitable) awaited together on the reward functions' loop."""
        results = [self._call(call) for call in calls]
        pending = [i for i, (_, value, _) in enumerate(results) if inspect.isawaitable(value)]
        for i, outcome in zip(pending, run_concurrently([results[i][1] for i in pending]) if pending else []):
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome  # an interrupt or a cancellation is no tool's error
            failed = isinstance(outcome, Exception)
            results[i] = (results[i][0], {"error": str(outcome)} if failed else outcome, failed)
        return results

    def _call(self, call: dict) -> tuple[str, Any, bool]:
        """``run`` up to an async tool's awaitable, which stands for its result."""
        name, arguments = call.get("name"), call.get("arguments")
        if isinstance(arguments, str):  # some formats carry the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if name not in self.by_name:
            return str(name or "unknown"), {"error": f"Tool {name} not found."}, True
        if not isinstance(arguments, Mapping):
            return name, {"error": f"arguments must be a JSON object, got {arguments!r:.80}"}, True
        try:
            return name, self.by_name[name](**arguments), False
        except Exception as error:  # the model learns from its error text, as TRL's
            return name, {"error": str(error)}, True

    def prompt_messages(self, example: PromptExample | None = None) -> list[dict]:
        """The messages ``example``'s prompt was rendered from (``render_prompt``'s, with this run's system prompt
        and template); without one a stand-in user message, as the template checks use."""
        if example is None:
            return prompt_messages("x", self.system_prompt, self.prompt_template)
        return prompt_messages(example.prompt, self.system_prompt, self.prompt_template, *chat_turns(example))

    def suffix_ids(self, tool_messages: list[dict], history: Sequence[dict] = (),
                   prompt: Sequence[dict] | None = None) -> list[int]:
        """The tokens after an assistant turn that called tools, up to the next assistant turn's start: the tool
        messages as the chat template renders them, in the sample's own conversation (``tool_suffix_ids``).

        ``prompt``: the prompt's messages (``prompt_messages``; default: a stand-in user message); ``history``: the
        completion's messages so far (``ToolRollout``'s, the calling turn last). A template may number turns from
        the start, branch on the tools or the system prompt, or render a tool turn after an earlier one otherwise
        (DeepSeek-R1's opens only the first tool output), so the conversation is rendered as the prompt was. A
        history it cannot render back gets the first round's form (a stand-in calling turn)."""
        prompt = self.prompt_messages() if prompt is None else list(prompt)
        render = dict(tools=self.schemas, kwargs=self.template_kwargs, turn_end=self.turn_end,
                      from_text=self.suffix_from_text)
        if history:
            try:
                return tool_suffix_ids(self.tokenizer, tool_messages, prompt, history, **render)
            except ValueError:
                pass
        return tool_suffix_ids(self.tokenizer, tool_messages, prompt, **render)

    def run_rounds(self, engine: Any, groups: Sequence[GroupProgress], result: Any,
                   examples: Sequence[PromptExample] | None = None) -> ToolRollout:
        """Tool rounds after ``engine.generate_groups(groups)`` gave ``result`` (every group completed, in input
        order): run the calls that end a turn, append their messages, continue those samples with
        ``generate_groups``, until no turn calls a tool or ``max_tool_calling_iterations`` rounds ran.
        ``examples``: ``[b]`` the groups' prompts, whose conversations the tool turns are rendered in (None: a
        stand-in user message)."""
        if examples is not None and len(examples) != len(groups):
            raise ValueError(f"run_rounds got {len(examples)} examples for {len(groups)} groups; give one per group")
        prompts = [self.prompt_messages(None if examples is None else examples[p]) for p in range(len(groups))]
        out = ToolRollout.from_result(result)
        turn_start = [[0] * len(group) for group in out.completion_ids]
        pending = self._ended_turns(groups, out, turn_start, [(p, k) for p, group in enumerate(out.completion_ids)
                                                              for k in range(len(group))])
        eos = set(engine.eos_token_ids)
        rounds = 0
        while pending and (self.max_tool_calling_iterations is None or rounds < self.max_tool_calling_iterations):
            resumed = []
            ran = iter(self.run_all([call for calls in pending.values() for call in calls]))
            for (p, k), calls in pending.items():
                results = [next(ran) for _ in calls]
                out.calls += len(results)
                out.failures += sum(failed for _, _, failed in results)
                tool_messages = [{"role": "tool", "name": name, "content": _content(value)}
                                 for name, value, _ in results]
                ids = out.completion_ids[p][k]
                suffix = self.closing(ids, eos) + self.suffix_ids(tool_messages, out.messages[p][k], prompts[p])
                if len(ids) + len(suffix) >= engine.max_new_tokens:  # no room to answer: it ends as it is (TRL)
                    continue
                out.append_tool_turn(p, k, suffix, tool_messages, engine.rollout_index - 1)
                turn_start[p][k] = len(ids)
                resumed.append((p, k))
            if not resumed:
                break
            self._continue(engine, groups, out, resumed)
            pending = self._ended_turns(groups, out, turn_start, resumed)
            rounds += 1
        return out  # samples still in ``pending`` hit the round cap: their last turn stays an unanswered call

    def closing(self, turn: Sequence[int], eos: set[int]) -> list[int]:
        """What closes ``turn`` before its tool results: nothing where the model ended it (an EOS of the engine, or
        the template's ``turn_end``), else the template's ``turn_end`` (a stop string such as ``"</tool_call>"``
        cut it)."""
        ended = turn[-1] in eos or bool(self.turn_end and list(turn[-len(self.turn_end):]) == self.turn_end)
        return [] if ended else list(self.turn_end)

    def _ended_turns(self, groups: Sequence[GroupProgress], out: ToolRollout, turn_start: list[list[int]],
                     keys: Sequence[tuple[int, int]]) -> dict[tuple[int, int], list[dict]]:
        """Record each sample's newest assistant turn in ``out.messages``, its calls as ``tool_calls``; return those
        whose calls are to run: not a truncated sample's, which has no room left for their results. Its call stays
        in its turn unanswered, as one past the round cap does, so the reward functions see it (TRL's message)."""
        pending = {}
        for p, k in keys:
            completion, start = out.completion_ids[p][k], turn_start[p][k]
            turn = completion[start:]
            message, calls = (self.parse(turn, groups[p].prompt_ids + completion[:start]) if turn
                              else ({"role": "assistant", "content": ""}, []))
            if calls:  # the parser took the call's text out of the content: it must stay somewhere
                message["tool_calls"] = [{"type": "function", "function": call} for call in calls]
                if not out.truncated[p][k]:
                    pending[(p, k)] = calls
            out.messages[p][k].append(message)
        return pending

    @staticmethod
    def _continue(engine: Any, groups: Sequence[GroupProgress], out: ToolRollout,
                  resumed: list[tuple[int, int]]) -> None:
        """Decode on the ``resumed`` samples (carried progress: their tokens so far, their own streams)."""
        by_group: dict[int, set[int]] = {}
        for p, k in resumed:
            by_group.setdefault(p, set()).add(k)
        order = sorted(by_group)
        carried = [GroupProgress(groups[p].prompt_ids,
                                 [SampleProgress(out.completion_ids[p][k], out.logprobs[p][k], out.versions[p][k],
                                                 done=k not in by_group[p],
                                                 resumed_at=len(out.completion_ids[p][k]) if k in by_group[p] else 0)
                                  for k in range(len(out.completion_ids[p]))],
                                 groups[p].stream, tag=groups[p].tag) for p in order]
        result = engine.generate_groups(carried)
        out.stats.append(_renumbered(result.stats, order))
        for i, p in enumerate(order):
            for k in by_group[p]:
                out.continue_with(p, k, result, i)


def _renumbered(stats: RolloutStats, order: list[int]) -> RolloutStats:
    """``stats`` of a call that ran the rollout's groups ``order`` (its group i is the rollout's ``order[i]``), its
    timeline and decisions keyed by the rollout's samples, as the first call's are (``merge_stats(same_samples)``)."""
    G = max(1, stats.group_size)
    stats.timeline = [[IDLE if cell == IDLE else order[cell // G] * G + cell % G for cell in row]
                      for row in stats.timeline]
    stats.decisions = [d._replace(key=(order[d.key[0]], d.key[1])) for d in stats.decisions]
    return stats


def checked_tools(specs: Sequence[Any] | None, max_tool_calling_iterations: Any,
                  over_provision: float) -> tuple[list[Callable], int | None]:
    """``data.tools`` resolved to its functions, each with its JSON schema (a function without one fails here, not
    at the first rollout), and the settings beside them checked: the round cap (an error of its own key, which the
    user wrote under ``data.max_tool_calling_iterations``; returned as a plain int or None) and partial rollouts off
    where there are tools. Errors of the tools start with ``data.tools``."""
    max_tool_calling_iterations = check_max_tool_calling_iterations(max_tool_calling_iterations)
    with config_errors("data.tools"):
        tools = resolve_tools(specs)
        tool_schemas(tools)
        if tools:
            check_without_partial_rollouts(over_provision)
    return tools, max_tool_calling_iterations


def check_without_partial_rollouts(over_provision: float) -> None:
    """Raise unless ``over_provision`` leaves partial rollouts off: tool calling does not run with them (a carried
    group's samples may wait on a tool)."""
    if over_provision > 1:
        raise ValueError(f"over_provision={over_provision} turns on partial rollouts, which tool calling does not "
                         "run with yet (a carried group's samples may wait on a tool); set over_provision: 1.0")


def check_max_tool_calling_iterations(value: Any) -> int | None:
    """``value`` as a plain int (a numpy integer's too) or None; raises naming it unless it is None or an integer
    >= 0."""
    return check_int("max_tool_calling_iterations", value, 0, hint="tool rounds per completion",
                     none="null in YAML: no count, max_new_tokens bounds the rounds")


def check_template_renders_tools(tokenizer: Any, schemas: list[dict], kwargs: Mapping[str, Any],
                                 prompt: Sequence[dict]) -> None:
    """Raise unless the tokenizer's chat template shows ``tools=`` in a prompt and renders tool messages after
    ``prompt`` (a prompt's messages)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("data.tools needs a chat template (the tools are passed to it as tools=); this tokenizer "
                         "has none")
    plain = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True, **kwargs)
    shown = tokenizer.apply_chat_template(list(prompt), tools=schemas, tokenize=False, add_generation_prompt=True,
                                          **kwargs)
    if plain == shown:
        raise ValueError("this tokenizer's chat template ignores tools= (a prompt renders the same with and without "
                         "them), so the model would never see data.tools: use a model whose template supports tool "
                         "use")
    try:
        tool_suffix_ids(tokenizer, [{"role": "tool", "name": schemas[0]["function"]["name"], "content": "1"}], prompt,
                        tools=schemas, kwargs=kwargs)
    except ValueError as error:
        known = sorted({model for model, _, _ in PREFIX_PRESERVING_EDITS.values()})
        raise ValueError(f"{error}. lit_grpo renders tool turns with a prefix-preserving version of a known stock "
                         f"template only, matched by its exact text ({', '.join(known)}'s); for this model, give it "
                         "a template that renders every turn the same whatever follows: in its model directory "
                         "(model.model: DIR) as chat_template.jinja, or as tokenizer.chat_template before the "
                         "run") from error


def check_calls_read(parse: Callable, tokenizer: Any, prompt: Sequence[dict], tools: list[dict],
                     kwargs: Mapping[str, Any], turn_end: Sequence[int]) -> None:
    """Raise unless ``parse`` (``ToolBox.parse``) reads back the call the chat template writes in an assistant turn
    after ``prompt`` (a call of the first of ``tools``): a template whose calls the reader does not read would run
    no tool at all, without a word (Mistral's ``[TOOL_CALLS]`` calls under this reader)."""
    turn = _marker_call_turn(tools)
    call = turn["tool_calls"][0]["function"]
    render = dict(tools=tools, tokenize=False, **kwargs)
    start = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, **render)
    whole = tokenizer.apply_chat_template([*prompt, turn], **render)
    # the turn as the model writes it, as text (its tokens as the model would draw them are unknown): from where the
    # finished turn leaves the generation prompt, at a tag's or a line's end (the prompt may pre-write a block that
    # the finished turn closes at once or leaves out), up to its end
    begin = len(start) if whole.startswith(start) else max(
        whole.rfind(">", 0, _common_length(start, whole)), whole.rfind("\n", 0, _common_length(start, whole))) + 1
    marker = tokenizer.decode(list(turn_end))
    end = whole.rindex(marker) + len(marker) if marker in whole[begin:] else len(whole)
    written = _ids(tokenizer(whole[begin:end], add_special_tokens=False))
    _, calls = parse(written, _ids(tokenizer(whole[:begin], add_special_tokens=False)))
    if [(c["name"], json_value(c["arguments"]) if isinstance(c["arguments"], str) else c["arguments"])
            for c in calls] != [(call["name"], call["arguments"])]:
        reader = ("the tokenizer's response_template (parse_response)"
                  if getattr(tokenizer, "response_template", None) is not None else
                  "lit_grpo's reader without a response template (the Hermes format <tool_call>{\"name\": ..., "
                  "\"arguments\": {...}}</tool_call>, or Qwen3.5's <tool_call><function=NAME><parameter=KEY>VALUE"
                  "</parameter></function></tool_call>)")
        raise ValueError(f"the chat template writes a tool call as {tokenizer.decode(written)!r:.200}, which {reader} "
                         f"does not read back as that call (it read {calls!r:.120}), so no tool would ever run: give "
                         "the tokenizer a response_template for this template's format (transformers' "
                         "parse_response), in the model directory's tokenizer_config.json or as "
                         "tokenizer.response_template before the run")


#: Stock chat templates that do not render a conversation as a continuation of its prefix, each by the SHA-256 of its
#: exact text (TRL matches a stock template by its exact text too): the model's name and the one edit that makes it
#: preserve prefixes, ``(old, new)``.
#: Qwen3's renders the empty reasoning block ``<think>\n\n</think>\n\n`` of an assistant turn after the last user
#: query only while that turn is the conversation's last, so a tool-calling turn loses it once its tool message
#: follows. The edit renders the block where the turn has reasoning, wherever it stands: a turn renders the same
#: with or without messages after it, and a prompt (never ending with an assistant turn) renders as under the stock
#: template, so prompts need no swap.
PREFIX_PRESERVING_EDITS = {
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": (
        "Qwen3", "{%- if loop.last or (not loop.last and reasoning_content) %}", "{%- if reasoning_content %}"),
}


def tool_chat_template(tokenizer: Any, tools: list[dict] | None = None) -> tuple[str, str] | None:
    """``(model, template)``: the prefix-preserving version of the chat template the tool turns render with (``tools``:
    their schemas; ``tools_template``), where that template is a known stock one that drops part of a turn once
    messages follow it (``PREFIX_PRESERVING_EDITS``); None otherwise (the tokenizer's own template is used, and
    checked)."""
    template = tools_template(tokenizer, tools)
    known = None if template is None else PREFIX_PRESERVING_EDITS.get(hashlib.sha256(template.encode()).hexdigest())
    if known is None:
        return None
    model, old, new = known
    return model, template.replace(old, new)


def tools_template(tokenizer: Any, tools: list[dict] | None) -> str | None:
    """The text of the chat template ``apply_chat_template`` renders with ``tools=tools``: the tokenizer's own, or of
    its several named ones (a mapping) the one transformers picks (``tool_use`` with tools where it has one, else
    ``default``); None where it has none to pick."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        try:
            template = tokenizer.get_chat_template(tools=tools or None)
        except ValueError:  # several templates and no default: apply_chat_template refuses it too, naming them
            return None
    return template if isinstance(template, str) else None


def turn_end_ids(tokenizer: Any, prompt: Sequence[dict], tools: list[dict],
                 kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """``[1]`` the token that closes an assistant turn calling a tool, read from the chat template: the last whole
    token it writes after the call's arguments (Qwen's ``<|im_end|>``, Gemma's ``<end_of_turn>``, Llama 3's
    ``<|eot_id|>``, GPT-OSS's ``<|call|>``), which need not be the tokenizer's EOS (a Qwen base tokenizer's is
    ``<|endoftext|>``). ``prompt``: the messages before the turn; ``tools``: the schemas, the first one's tool called.

    A whole token is a special one or any added token, special or not: transformers tokenizes an added token as one
    id either way, so a tokenizer that does not mark its ``<|im_end|>`` special ends its turns with the same token.
    Raises where the template cannot render the turn or writes no such token after the call: nothing would mark a
    turn's end, so neither a turn a stop string cuts could be closed nor a tool turn be cut from the conversation as
    the template writes them."""
    try:
        text = tokenizer.apply_chat_template([*prompt, _marker_call_turn(tools)], tools=tools, tokenize=False,
                                             **(kwargs or {}))
    except Exception as error:  # noqa: BLE001 - the template's own failure, named in the setting's error
        raise ValueError(f"the chat template cannot render an assistant turn that calls a tool ({error}); data.tools "
                         "needs a template that renders assistant tool_calls") from error
    if TURN_MARKER not in text:
        raise ValueError("the chat template does not write a tool call's arguments in the assistant's turn, so its "
                         "end cannot be read; data.tools needs a template that renders assistant tool_calls")
    after = text[text.rindex(TURN_MARKER) + len(TURN_MARKER):]
    whole = _whole_token_ids(tokenizer)
    ends = [token for token in _ids(tokenizer(after, add_special_tokens=False)) if token in whole][-1:]
    if not ends:
        raise ValueError(f"the chat template writes no token of its own after an assistant turn's tool call (it "
                         f"renders {after!r:.80} after the call's arguments), so nothing marks the turn's end; "
                         "data.tools needs a template that ends an assistant turn with a special or added token of "
                         "the tokenizer's (such as <|im_end|>, <|eot_id|> or <end_of_turn>)")
    return ends


def _marker_call_turn(tools: list[dict]) -> dict:
    """An assistant turn with one call of the first of ``tools`` whose one argument is ``TURN_MARKER``, so the
    chat template's rendering of it can be found in the text."""
    call = {"name": tools[0]["function"]["name"], "arguments": {TURN_MARKER: TURN_MARKER}}
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}


def _whole_token_ids(tokenizer: Any) -> set[int]:
    """The ids the tokenizer never splits into others: its named special tokens and its added tokens, special or
    not."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ()} | {int(i) for i in added}


def tool_suffix_ids(tokenizer: Any, tool_messages: list[dict], prompt: Sequence[dict], history: Sequence[dict] = (),
                    tools: list[dict] | None = None, kwargs: Mapping[str, Any] | None = None,
                    turn_end: Sequence[int] | None = None, from_text: bool = False) -> list[int]:
    """See ``ToolBox.suffix_ids``: the conversation ``prompt + history`` (without a ``history``, a stand-in calling
    turn) rendered with and without ``tool_messages``, with the prompt's ``tools`` and chat template ``kwargs``, the
    first cut after its last ``turn_end`` (TRL's ``_get_tool_suffix_ids`` cuts after the last EOS, which it falls
    back to): what a template writes after a turn's end (a newline) starts the suffix. Raises where the template
    does not render the tool messages as a continuation.

    ``from_text``: the two conversations are cut as text, after the last ``turn_end``'s text, and only the suffix
    is tokenized (``suffix_from_text``): tokenizing both whole conversations is most of a round's rendering, and
    they grow with every round."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    before = [*(dict(m) for m in prompt),
              *([dict(m) for m in history] or [{"role": "assistant", "content": "", "tool_calls": calls}])]
    render = dict(tools=tools or None, **(kwargs or {}))
    if from_text and turn_end:
        prefix, full = _rendered(tokenizer, before, tool_messages, tokenize=False, **render)
        marker = tokenizer.decode(list(turn_end))
        if marker and marker in prefix:  # else the token cut's fallback (the EOS) decides
            return _ids(tokenizer(_suffix(prefix, full, prefix.rindex(marker) + len(marker)),
                                  add_special_tokens=False))
    prefix, full = _rendered(tokenizer, before, tool_messages, tokenize=True, **render)
    prefix, full = _ids(prefix), _ids(full)
    end = _end_of_last(prefix, list(turn_end or ())) or _end_of_last(prefix, [tokenizer.eos_token_id])
    return _suffix(prefix, full, end or len(prefix))


def suffix_from_text(tokenizer: Any, prompt: Sequence[dict], tools: list[dict], kwargs: Mapping[str, Any] | None,
                     turn_end: Sequence[int]) -> bool:
    """Whether ``tool_suffix_ids(from_text=True)`` gives the tokens of the whole conversations' cut for this
    tokenizer and template, checked on ``prompt`` and each of ``stand_in_rounds`` (calls of the first of ``tools``):
    it does where the tokenizer tokenizes the text after an added token apart from the text before it, as
    transformers' fast tokenizers split a text at its added tokens; not where the end-of-turn token strips the
    whitespace after it (``rstrip``), or where a tokenizer treats a text's start otherwise (a prefix space), which
    the cut's start would be. What follows a turn's end is the template's own text, which may differ with the kind
    of round (reasoning, several calls, an empty result), so each kind is tried."""
    render = dict(tools=tools, kwargs=kwargs, turn_end=turn_end)

    def same(history: list[dict], tool_messages: list[dict]) -> bool:
        try:
            whole = tool_suffix_ids(tokenizer, tool_messages, prompt, history, **render)
        except ValueError:  # a kind of round the template does not continue: no tool turn of it to cut either way
            return True
        return tool_suffix_ids(tokenizer, tool_messages, prompt, history, from_text=True, **render) == whole

    return all(same(*kind) for kind in stand_in_rounds(tools[0]["function"]["name"]))


def stand_in_rounds(name: str) -> list[tuple[list[dict], list[dict]]]:
    """``(history, tool_messages)`` of the rounds ``suffix_from_text`` tries (calls of the tool ``name``): a plain
    turn with one call and its result, and a turn with all a template may write otherwise after a turn's end, each
    of which the plain one lacks: a reasoning block, two calls, and their results, the first one empty. Two
    rounds, not one per kind: each one renders the conversations twice over, at every setup."""
    call = {"type": "function", "function": {"name": name, "arguments": {}}}
    plain = {"role": "assistant", "content": "", "tool_calls": [call]}
    loaded = {"role": "assistant", "content": "<think>\nx\n</think>\n\n", "tool_calls": [call, call]}
    return [([plain], [{"role": "tool", "name": name, "content": "1"}]),
            ([loaded], [{"role": "tool", "name": name, "content": content} for content in ("", "2")])]


def _rendered(tokenizer: Any, before: list[dict], tool_messages: list[dict], **render: Any) -> tuple[Any, Any]:
    """``before`` rendered, and ``before + tool_messages`` with the next assistant turn's start; raises naming the
    template's error."""
    try:
        return (tokenizer.apply_chat_template(before, **render),
                tokenizer.apply_chat_template(before + tool_messages, add_generation_prompt=True, **render))
    except Exception as error:
        raise ValueError(f"the chat template cannot render a tool turn ({error}); data.tools needs a template "
                         "that renders assistant tool_calls and role 'tool' messages") from error


def _suffix(prefix: Sequence, full: Sequence, end: int) -> Sequence:
    """``full`` after ``prefix[:end]`` (token ids or text), where ``full`` continues it with something; raises
    where the template did not render the tool messages as a continuation."""
    if full[:end] != prefix[:end] or len(full) == end:
        raise ValueError("the chat template does not render tool messages as a continuation of the assistant's "
                         "turn (a conversation with them does not start with the one without), so tool results "
                         "cannot be appended to a completion")
    return full[end:]


def _common_length(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _end_of_last(ids: list[int], part: list[int]) -> int | None:
    """The index just after the last occurrence of ``part`` in ``ids``; None where it does not occur (or is empty)."""
    if not part or None in part:
        return None
    return next((i + len(part) for i in range(len(ids) - len(part), -1, -1) if ids[i:i + len(part)] == part), None)


def _ids(encoded: Any) -> list[int]:
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) or hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


def _content(value: Any) -> str:
    """A tool's result as a tool message's content: text as it is, anything else as JSON (or its str), its text
    unescaped (JSON's ``\\u`` escapes would show the model other tokens than the text, as TRL's ``str`` does not)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)
