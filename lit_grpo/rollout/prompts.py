"""Prompt sources: a reasoning-gym task, a JSONL file, an inline list, or a Hugging Face dataset
(``lit_grpo.rollout.hf_dataset``); the chat template; the train/val split.

Every source yields ``PromptExample`` objects: the prompt text the model is asked, its gold answer (or None) and
the whole source row (``entry``), which reward functions receive (reasoning-gym scoring needs the entry).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from lit_grpo.runtime.validation import (
    SEED_MAX,
    check_int,
    check_int_in_range,
    check_text,
    shown_keys,
    shown_setting,
    shown_value,
)

#: Field names accepted for the prompt text of a JSONL row or inline dict, in order.
PROMPT_KEYS = ("prompt", "question")


@dataclass
class PromptExample:
    """One prompt.

    Attributes:
        prompt: the user message (before the chat template).
        answer: the gold answer as the source holds it (a string, a number, ...: reward functions get it unchanged,
            as TRL passes a dataset's column), or None.
        entry: the full source row (reasoning-gym: ``question``, ``answer``, ``metadata``; JSONL: the row).
        messages: a chat prompt (``[{"role", "content", ...}, ...]`` ending with the user turn ``prompt``, each
            turn with the other keys it has: ``check_messages``), rendered whole through the chat template; None for
            a single user message.
    """

    prompt: str
    answer: Any = None
    entry: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None


def chat_turns(example: PromptExample) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """``example``'s turns before its user turn and that user turn, as ``prompt_messages`` and ``render_prompt``
    take them (``history``, ``user_turn``); ``([], None)`` for a single user message."""
    return (example.messages[:-1], example.messages[-1]) if example.messages else ([], None)


def message_text(value: Any) -> str:
    """A prompt or a completion as a reward function gets it, as text: itself, or, in TRL's conversational form
    (chat prompts), its last message's content: a prompt's user turn the policy answers, a completion's final
    ``{"role": "assistant", "content": text}`` turn."""
    return value if isinstance(value, str) else value[-1]["content"]


def is_conversational(examples: Sequence[PromptExample]) -> bool:
    """Whether the reward functions get a prompt set's prompts and completions in TRL's conversational form
    (``rewards.reward_arguments``): where any of its rows is chat messages. One answer for the whole set, taken
    once, so that a function gets one form all run (a plain row then as its one user message), whatever rows a
    step draws; TRL's dataset column holds one form, so TRL's rewards never meet two."""
    return any(example.messages for example in examples)


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """A chat prompt: a non-empty list of ``{"role", "content", ...}`` turns ending with a non-empty user turn, role
    and content strings. A turn's other keys (``name``, ``tool_calls``, ``tool_call_id``, ``reasoning_content``,
    ...) are kept, as TRL passes a prompt's messages to the chat template as they are, except a key whose value is
    None, which is absent: a datasets (Arrow) row gives each turn every key of the column's struct type, None where
    the turn has none, and a template testing ``'name' in message`` would take those for given. Each turn is a dict
    of its own, role and content first."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError(f"{where}: expected a non-empty string or a list of chat messages, got "
                         f"{shown_value(messages, 80)}")
    turns = []
    for i, turn in enumerate(messages):
        if not isinstance(turn, Mapping) or not isinstance(turn.get("role"), str) or \
                not isinstance(turn.get("content"), str):
            raise ValueError(f"{where}: message {i} must be {{'role': str, 'content': str}}, got "
                             f"{shown_value(turn, 80)}")
        if odd := [key for key in turn if not isinstance(key, str)]:
            raise ValueError(f"{where}: message {i} has the key {shown_value(odd[0], 40)} ({type(odd[0]).__name__}); "
                             "a chat message's keys must be strings (the names the chat template reads)")
        turns.append({"role": turn["role"], "content": turn["content"],
                      **{key: value for key, value in turn.items() if value is not None}})
    if turns[-1]["role"] != "user" or not turns[-1]["content"].strip():
        raise ValueError(f"{where}: the messages must end with a non-empty user turn (the prompt the policy answers);"
                         f" the last is {shown_value(turns[-1]['role'])} with content "
                         f"{shown_value(turns[-1]['content'], 60)}")
    return turns


def _example_from_row(row: Any, where: str) -> PromptExample:
    if isinstance(row, str):
        if not row.strip():
            raise ValueError(f"{where}: the prompt is empty")
        return PromptExample(prompt=row, answer=None, entry={"prompt": row})
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a string or an object with a 'prompt' field, got {type(row).__name__}")
    key = next((k for k in PROMPT_KEYS if k in row), None)
    if key is None:
        raise ValueError(f"{where}: no prompt field; the row has keys {shown_keys(row)} but needs one of "
                         f"{list(PROMPT_KEYS)}")
    prompt, messages = row[key], None
    if isinstance(prompt, Sequence) and not isinstance(prompt, str):  # chat messages, as data.dataset takes them
        messages = check_messages(prompt, f"{where}, field {shown_value(key)}")
        prompt = messages[-1]["content"]
    elif not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: field {shown_value(key)} must be a non-empty string or a list of chat messages "
                         f"([{{'role': ..., 'content': ...}}, ...] ending with a user turn), got "
                         f"{shown_value(prompt, 80)}")
    example = PromptExample(prompt=prompt, answer=row.get("answer"), entry=dict(row), messages=messages)
    check_as_text(example, where)
    return example


def check_as_text(example: PromptExample, where: str) -> None:
    """Refuse a row (``where``) whose answer or messages Python cannot turn into text as the prompt set's fingerprint
    does (``prompt_set_fingerprint``; the math reward too, the answer): an int of more than
    ``sys.get_int_max_str_digits()`` digits, which Python's bare ValueError would name nowhere near the row. A JSONL
    file cannot hold one (``jsonl_prompts``); a ``data.prompts`` row can, and a checkpoint's carried prompt."""
    limit = sys.get_int_max_str_digits()
    # a row of plain values, as most are, is not turned into text: doing it for every row slowed loading a large
    # JSONL file markedly, where the parser has refused such an int already
    bits = limit * _BITS_PER_DIGIT if limit else math.inf  # 0: Python turns any int into text
    if _plain(example.answer, bits) and (example.messages is None or all(
            _plain(value, bits) for turn in example.messages for value in turn.values())):
        return
    fix = (f", more than Python turns into text (sys.get_int_max_str_digits(): {limit}); give so long a number as "
           "a string")
    if not _as_text(lambda: answer_text(example.answer)):
        raise ValueError(f"{where}: the answer is {shown_value(example.answer)}{fix}")
    if not _as_text(lambda: json.dumps(example.messages, default=str)):
        raise ValueError(f"{where}: the messages hold an int of more than {limit} digits{fix}")


#: An int of b bits is below 2**b = 10**(b / log2(10)): of at most limit x log2(10) bits, it has at most limit digits.
_BITS_PER_DIGIT = math.log2(10)


def _plain(value: Any, bits: float) -> bool:
    """Whether ``value`` is a plain one Python surely turns into text: None, a string, a float, a bool or an int of
    at most ``bits`` bits (``_BITS_PER_DIGIT`` x the limit of digits)."""
    return (value is None or isinstance(value, (str, float, bool))
            or (type(value) is int and value.bit_length() <= bits))


def _as_text(text: Callable[[], str]) -> bool:
    """Whether ``text()`` runs, False where it met an int too long for Python to turn into text."""
    try:
        text()
    except ValueError as err:
        if "integer string conversion" not in str(err):
            raise
        return False
    return True


def reasoning_gym_prompts(task: str, size: int, seed: int = 0,
                          config: Mapping[str, Any] | None = None) -> list[PromptExample]:
    """``size`` entries of a reasoning-gym task, e.g. ``task="basic_arithmetic"``; ``config`` goes to its config."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if size < 1:
        raise ValueError(f"{shown_setting('size', size)} must be >= 1 (prompts to generate from task "
                         f"{shown_value(task)})")
    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3) if isinstance(task, str) else []
        raise ValueError(f"{shown_setting('task', task)} is not a reasoning-gym task"
                         + (f"; did you mean {close}?" if close else "")
                         + f" ({len(DATASETS)} tasks, e.g. {sorted(DATASETS)[:4]}: reasoning_gym.factory.DATASETS)")
    options = {option.name for option in fields(DATASETS[task][1])} - {"seed", "size"}  # those two are data's own
    unknown = [key for key in config or {} if key not in options]  # a key of any type, shown as shown_keys shows it
    if unknown:
        raise ValueError(f"task_config {shown_keys(unknown)} is not an option of reasoning-gym task "
                         f"{shown_value(task)}; its options: {sorted(options)}")
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **dict(config or {}))
    except (ValueError, TypeError, AssertionError) as err:
        raise ValueError(f"reasoning-gym {shown_setting('task', task)} with task_config "
                         f"{shown_value(dict(config or {}))} failed: {type(err).__name__}: {err}") from err
    return [PromptExample(prompt=e["question"], answer=e.get("answer"), entry=dict(e)) for e in dataset]


def jsonl_prompts(path: str | Path) -> list[PromptExample]:
    """One example per non-empty line of a JSONL file: ``{"prompt": ..., "answer": ..., ...}``, the prompt a string
    or chat messages (``check_messages``, as ``data.dataset`` takes them)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{shown_setting('jsonl_path', path, 80)} must be a JSONL file's path")
    path = Path(path).expanduser()
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ValueError(f"prompt file {str(path)!r} {what} (jsonl_path): give a JSONL file, one prompt a line")
    examples = []
    # utf-8-sig: a byte order mark some editors write is read past, as data.dataset's JSON reader does
    with path.open(encoding="utf-8-sig") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from err
            except ValueError as err:  # valid JSON Python will not read: an integer past its int-to-str limit
                hint = "; write so long a number as a string" if "integer string conversion" in str(err) else ""
                raise ValueError(f"{path}:{number}: cannot be read ({err}){hint}") from err
            examples.append(_example_from_row(row, f"{path}:{number}"))
    if not examples:
        raise ValueError(f"prompt file {str(path)!r} holds no prompts")
    return examples


def inline_prompts(items: Sequence[Any]) -> list[PromptExample]:
    """Strings or dicts ``{"prompt": ..., "answer": ...}``."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not items:
        raise ValueError(f"prompts must be a non-empty list of strings or dicts, got {shown_value(items, 80)}")
    return [_example_from_row(row, f"prompts[{i}]") for i, row in enumerate(items)]


def check_prompt_source(size: Any, data_seed: Any, dataset: Any, task_config: Any = None, jsonl_path: Any = None,
                        prompt_column: Any = None, answer_column: Any = None,
                        split: Any = "train") -> tuple[int, int]:
    """Refuse a bad setting of the prompt source before anything is loaded: ``size`` (a task's entries),
    ``data_seed`` (the task's generation and the held-out split), ``dataset`` (a path or a ``datasets.Dataset``),
    ``task_config``, ``jsonl_path`` and the dataset's columns and split, each by its type; which source is given
    is ``load_prompts``' to judge. Returns ``(size, data_seed)`` as plain ints (a numpy integer's too)."""
    size = check_int("size", size, 1)
    data_seed = check_int_in_range("data_seed", data_seed, 0, SEED_MAX)
    # an empty path would be the current folder, which datasets reads as a dataset of whatever files it holds
    if dataset is not None and (not isinstance(dataset, (str, os.PathLike)) or not os.fspath(dataset)):
        from lit_grpo.rollout.hf_dataset import is_dataset_object

        if not is_dataset_object(dataset):
            raise ValueError(f"{shown_setting('dataset', dataset, 80)} must be a path (a local file or folder) or a "
                             "datasets.Dataset")
    if jsonl_path is not None and (not isinstance(jsonl_path, (str, os.PathLike)) or not os.fspath(jsonl_path)):
        raise ValueError(f"{shown_setting('jsonl_path', jsonl_path, 80)} must be a JSONL file's path or None")
    # a string or a list was read key by key, a number failed inside reasoning-gym's call
    if task_config is not None and not isinstance(task_config, Mapping):
        raise ValueError(f"{shown_setting('task_config', task_config, 80)} must be a mapping of the reasoning-gym "
                         "task's options (e.g. {min_terms: 2}) or None")
    check_text("prompt_column", prompt_column, none=True)
    check_text("answer_column", answer_column, none=True)
    check_text("split", split)
    return size, data_seed


def load_prompts(task: str | None = None, size: int = 1000, seed: int = 0,
                 task_config: Mapping[str, Any] | None = None, jsonl_path: str | None = None,
                 prompts: Sequence[Any] | None = None, dataset: Any = None, prompt_column: str | None = None,
                 answer_column: str | None = None, split: str = "train") -> list[PromptExample]:
    """Exactly one source: a reasoning-gym ``task``, a ``jsonl_path``, inline ``prompts`` or a ``dataset`` (a local
    path or a ``datasets.Dataset``, with ``prompt_column``, ``answer_column`` and ``split``)."""
    given = [name for name, value in (("task", task), ("jsonl_path", jsonl_path), ("prompts", prompts),
                                      ("dataset", dataset)) if value is not None]
    if len(given) != 1:
        others = " ".join(f"--data.{name} null" for name in given[:-1])
        raise ValueError(f"give exactly one prompt source (task, jsonl_path, prompts or dataset); got "
                         f"{given or 'none'}" + (f": unset the others, e.g. {others}" if len(given) > 1 else ""))
    if dataset is None:
        unused = [name for name, value in (("prompt_column", prompt_column), ("answer_column", answer_column))
                  if value is not None] + (["split"] if split != "train" else [])
        if unused:
            raise ValueError(f"{', '.join(unused)} {'apply' if len(unused) > 1 else 'applies'} to data.dataset only; "
                             f"the prompt source here is {given[0]} (data.dataset reads JSONL files too, with "
                             "prompt_column)")
    if task is not None:
        return reasoning_gym_prompts(task, size, seed, task_config)
    if jsonl_path is not None:
        return with_every_field(jsonl_prompts(jsonl_path))
    if dataset is not None:
        from lit_grpo.rollout.hf_dataset import dataset_prompts

        return dataset_prompts(dataset, prompt_column, answer_column, split)
    return with_every_field(inline_prompts(prompts))


def with_every_field(examples: list[PromptExample]) -> list[PromptExample]:
    """``examples`` with every row holding every field of any row, None where it had none, as TRL's JSON loader
    (datasets) reads a JSONL file: a reward function that takes a field by name then gets it in every call, not
    only in a batch that happens to draw a row with it. The entries are the examples' own copies."""
    fields = list(dict.fromkeys(key for example in examples for key in example.entry))
    for example in examples:
        for key in fields:
            example.entry.setdefault(key, None)
    return examples


#: ``apply_chat_template``'s own arguments, which ``render_prompt`` sets or it takes for itself, and ``messages``, the
#: template's conversation (given twice, the render raises a TypeError): not chat template variables.
RENDER_ARGUMENTS = ("conversation", "messages", "add_generation_prompt", "tokenize", "return_dict",
                    "continue_final_message", "tools", "documents", "chat_template", "padding", "truncation",
                    "max_length", "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs",
                    "sanitize_control_tokens")


def check_chat_template_kwargs(tokenizer: Any, kwargs: Mapping[str, Any] | None) -> None:
    """Raise naming the key unless each of ``kwargs`` is a variable ``tokenizer``'s chat template reads (a name it
    does not read would be dropped without a word: a typo, or a setting meant for another model's template), and
    none is ``apply_chat_template``'s own argument. ``tokenizer`` None checks the keys alone."""
    if kwargs is None:
        return
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise ValueError(f"{shown_setting('chat_template_kwargs', kwargs, 120)} must be a mapping of the chat "
                         "template's variable names to their values, or None")
    if reserved := sorted(set(kwargs) & set(RENDER_ARGUMENTS)):
        raise ValueError(f"chat_template_kwargs sets {reserved}, which lit_grpo sets itself; give only the chat "
                         "template's own variables (e.g. enable_thinking)")
    if tokenizer is None or not kwargs:
        return
    source = getattr(tokenizer, "chat_template", None)
    if not source:
        raise ValueError(f"{shown_setting('chat_template_kwargs', dict(kwargs), 120)} need a chat template; this "
                         "tokenizer has none (its prompts are plain text)")
    sources = source.values() if isinstance(source, Mapping) else [source]
    unread = [key for key in kwargs if not any(re.search(rf"\b{re.escape(key)}\b", text) for text in sources)]
    if unread:
        raise ValueError(f"chat_template_kwargs names {unread}, which this tokenizer's chat template never reads; "
                         "check the spelling against the template (tokenizer.chat_template)")


def answer_text(answer: Any) -> str | None:
    """A gold answer as text (None stays None): checkpoints written before answers kept the row's own type hold
    ``str(answer)`` (3 as "3"), so 3 and "3" are one answer wherever a checkpoint is compared with a prompt set."""
    return None if answer is None else str(answer)


def prompt_set_fingerprint(examples: Sequence[PromptExample]) -> str:
    """A short hash of ``examples`` in their order (prompt, answer and chat messages): two runs draw from the same
    prompt set, in the same positions, exactly when theirs agree."""
    # the answer as text (answer_text): a checkpoint's fingerprint was taken over text answers
    rows = [[example.prompt, answer_text(example.answer), example.messages] for example in examples]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False, default=str).encode()).hexdigest()[:16]


def other_message_keys(examples: Sequence[PromptExample]) -> list[str]:
    """The keys beyond role and content that ``examples``' chat turns hold (``check_messages``), sorted."""
    return sorted({key for example in examples for turn in example.messages or () for key in turn}
                  - {"role", "content"})


def fingerprint_without_message_keys(examples: Sequence[PromptExample]) -> str:
    """``prompt_set_fingerprint`` as it was taken when a chat turn was its role and content alone (its other keys
    dropped, ``other_message_keys``): a checkpoint of then holds it."""
    return prompt_set_fingerprint([
        replace(example, messages=[{"role": turn["role"], "content": turn["content"]}
                                    for turn in example.messages]) if example.messages else example
        for example in examples])


def check_val_size(val_size: Any) -> int | float:
    """``val_size`` as a plain int if it is a count of prompts (an integer >= 0, a numpy one too) or a plain float if
    it is a fraction of them in [0, 1) (a float, a numpy one too), else a ValueError, before any prompt is loaded;
    whether it leaves prompts on both sides is ``split_examples``' to judge."""
    if isinstance(val_size, numbers.Real) and not isinstance(val_size, (bool, numbers.Integral)):
        if not 0.0 <= val_size < 1.0:
            raise ValueError(f"{shown_setting('val_size', val_size)} as a fraction must be in [0, 1)")
        return float(val_size)
    try:
        return check_int("val_size", val_size, 0)
    except ValueError:
        raise ValueError(f"{shown_setting('val_size', val_size)} must be a count >= 0 or a fraction in "
                         "[0, 1)") from None


def split_examples(examples: Sequence[PromptExample], val_size: int | float,
                   seed: int = 0) -> tuple[list[int], list[int]]:
    """Hold out ``val_size`` distinct prompts, chosen by ``seed``, so that no validation prompt is trained on.

    A prompt is its text with its earlier chat turns. Sources repeat prompts (a small reasoning-gym task space draws
    the same question many times): a held-out prompt is validated once, and none of its rows is trained on; the
    other prompts' repeats all stay in training, weighted as the source weights them.

    Args:
        val_size: a count of distinct prompts (int >= 0) or a fraction of them in [0, 1).
    Returns:
        ``(train_indices, val_indices)`` into ``examples``, each sorted: every row of a prompt that is not held out,
        and the first row of each held-out prompt. The train part is never empty.
    """
    first_rows: dict[str, int] = {}
    prompt_of_row = []
    for row, example in enumerate(examples):
        key = json.dumps([example.prompt, example.messages], default=str)
        prompt_of_row.append(first_rows.setdefault(key, row))
    n = len(first_rows)
    val_size = check_val_size(val_size)
    if isinstance(val_size, float):
        count = int(round(val_size * n))
        if val_size > 0 and count == 0:  # asked for validation: none would run, silently
            raise ValueError(f"{shown_setting('val_size', val_size)} of {n} distinct prompts holds none out (it rounds "
                             "to 0); use a count (an integer >= 1), a larger fraction, or 0 for no validation")
    else:
        count = val_size
    if count >= n:
        fraction = ", or a smaller fraction" if isinstance(val_size, float) else ""
        allowed = "0: no validation" if n == 1 else f"a count of at most {n - 1}{fraction}; 0: no validation"
        raise ValueError(f"{shown_setting('val_size', val_size)} leaves no training prompt out of {n} distinct "
                         f"prompts; lower it ({allowed}) or add prompts")
    distinct = list(first_rows.values())
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = {distinct[i] for i in order[:count]}
    train = [row for row, first in enumerate(prompt_of_row) if first not in held_out]
    return train, sorted(held_out)


def check_prompt_shaping(system_prompt: Any, prompt_template: Any, chat_template_kwargs: Any) -> None:
    """Refuse a bad setting of what shapes a prompt's messages (``prompt_messages``, ``render_prompt``) before any
    tokenizer is loaded: the system prompt (None for no system message; an empty one is refused, see below), the
    user message's template and the chat template's variables (their names alone here; ``render_prompt`` checks
    them against the template)."""
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"{shown_setting('system_prompt', system_prompt, 80)} must be a string or None")
    # '' could mean no system message or an empty system turn, which differ where a chat template (Qwen2.5's) adds
    # a default system message to a conversation without one: None says the first, and nothing says the second
    if system_prompt == "":
        raise ValueError("system_prompt='' is empty: use None (null) for no system message (a chat template such as "
                         "Qwen2.5's then adds its own default one), or a non-empty text")
    if not isinstance(prompt_template, str) or "{prompt}" not in prompt_template:
        raise ValueError(f"{shown_setting('prompt_template', prompt_template)} must be a string that contains "
                         "'{prompt}'")
    check_chat_template_kwargs(None, chat_template_kwargs)


def prompt_messages(prompt: str, system_prompt: str | None = None, template: str = "{prompt}",
                    history: Sequence[Mapping[str, Any]] = (),
                    user_turn: Mapping[str, Any] | None = None) -> list[dict]:
    """The chat messages a prompt is rendered from (``render_prompt``): the system prompt (none where it is None or
    empty, which ``check_prompt_shaping`` refuses as a setting), ``history``, then ``template`` with ``{prompt}``
    replaced as the user message, with ``user_turn``'s other keys (a chat prompt's user turn: its ``name``, ...;
    ``chat_turns``). Raises where both the system prompt and the history's first turn are a system turn."""
    history = [dict(turn) for turn in history]
    if history and history[0]["role"] == "system" and system_prompt:
        raise ValueError(f"{shown_setting('system_prompt', system_prompt, 60)} and a prompt whose messages start with "
                         f"their own system turn ({shown_value(history[0]['content'], 60)}); drop one of the two")
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + history + [
        {"role": "user", "content": template.replace("{prompt}", prompt),
         **{key: value for key, value in (user_turn or {}).items() if key not in ("role", "content")}}]


def render_prompt(tokenizer: Any, prompt: str, system_prompt: str | None = None,
                  template: str = "{prompt}", history: Sequence[Mapping[str, Any]] = (),
                  chat_template_kwargs: Mapping[str, Any] | None = None, tools: list[dict] | None = None,
                  chat_template: bool = True, user_turn: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of one prompt: ``template`` with ``{prompt}`` replaced by the prompt (every other brace kept as
    written, e.g. ``\\boxed{}``) as the user message, through the chat template.

    ``history``: chat turns before that message (a ``messages`` prompt's earlier turns), ``user_turn``: the
    prompt's own user turn, whose keys beyond role and content the message takes (``chat_turns``; TRL passes every
    key of a prompt's messages to the template); ``system_prompt`` goes first (an error when the history starts with
    a system turn of its own). Tokenizers without a chat template, and
    ``chat_template=False``, get the plain text (system prompt, a blank line, the turns' contents, the message),
    tokenized as the tokenizer does any text (its own special tokens, e.g. a BOS, included).
    ``chat_template_kwargs``: more variables for the chat template (TRL's setting; e.g. Qwen3's ``enable_thinking``),
    each one the template reads. ``tools``: the tools' JSON schemas, for the chat template's ``tools=``
    (``lit_grpo.rollout.tools``).
    """
    messages = prompt_messages(prompt, system_prompt, template, history, user_turn)
    check_chat_template_kwargs(tokenizer, chat_template_kwargs)
    if chat_template and getattr(tokenizer, "chat_template", None):
        # tools=None, never []: some templates (Llama's) render their tool boilerplate for an empty list
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                tools=tools or None, **(chat_template_kwargs or {}))
        ids = encoded["input_ids"] if isinstance(encoded, Mapping) or hasattr(encoded, "keys") else encoded
    else:
        ids = tokenizer("".join(turn["content"] + "\n\n" for turn in messages[:-1]) + messages[-1]["content"])[
            "input_ids"]
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError(f"prompt {shown_value(prompt, 80)} renders to no tokens")
    return ids
