"""Reward functions and how several are combined.

Protocol (TRL's for a plain-text prompt)::

    reward_fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

A function with a parameter named ``completions`` is called as TRL calls it, ``prompts`` and ``completions`` by
keyword (so TRL's ``def f(completions, solution, **kwargs)`` runs unchanged); any other by position, those two
first. For chat prompts they come in TRL's conversational form (``reward_arguments``): each prompt's messages and
each completion ``[{"role": "assistant", "content": text}]``; ``lit_grpo.rollout.prompts.message_text`` reads
the text of either form. The form is the prompt set's, one for the run (``prompts.is_conversational``): a set with
any chat row gives every call this form, a plain row as its one user message.

``prompts`` and ``completions`` are flat lists of ``N = B x G`` entries (``prompts[i]`` is the prompt of
completion ``i``; completion ``k`` of prompt ``p`` is at ``i = p * G + k``). ``columns`` are per-completion lists
of the same length: ``answer`` (the gold answer as the row holds it, a number as a number, or None), ``entry``
(the prompt's source row: for reasoning-gym the dataset entry with ``question``, ``answer``, ``metadata``),
``completion_ids``, ``completion_length`` (tokens, ``len(completion_ids)``: with tool calling the appended tool
messages too, as TRL's ``completion_ids`` hold them and ``max_new_tokens`` bounds them; the logged
``completions/*_length`` count drawn tokens only), ``truncated`` (hit the length cap), ``max_new_tokens``, plus
every field of the prompt's row but ``prompt`` (a JSONL row's, a dataset's columns; ``check_row_fields`` refuses
one named as an argument above; ``check_reward_columns`` refuses a function needing a field no row has). Take
``**kwargs`` and ignore what you do not need.

Every call also passes ``trainer_state`` (a ``TrainerState``: ``global_step``, ``max_steps``, ``epoch``), under
TRL's name and with its fields' meaning, for rewards shaped by training progress, and TRL's ``log_metric(name,
value)`` and ``log_extra(column, values)``, for what the function wants logged (``lit_grpo/rollout/reward_log.py``).

Each call gets its own copies of the arguments (lists and dicts rebuilt, strings and numbers shared; a value
``copy.deepcopy`` refuses, a lock or a client handle, is passed as it is): what a function changes in them
(``prompt.extend(completion)``, ``entry.pop(key)``) reaches no other function, no retry and not the caller. TRL
passes every function the same lists, so there a function sees what those before it changed; here none does,
because the async functions run concurrently (which change lands first would depend on their timing), a retry has
to start from the arguments as they came (a function's whole-batch call would otherwise see other inputs than its
retries), and a function's values should not depend on its place in ``reward_funcs``. To hand one function's
results to another, share an object of your own, not the arguments.

A function returns one value per completion: a number, or ``None`` for "no opinion" (e.g. a math checker asked
about a code task). Several functions are combined with weights::

    total_i = sum over functions f with value v_f,i not None of  weight_f * v_f,i

When every function returns ``None`` for a completion it is unscored: its logged total is ``0.0``, but it is left
out of its group's mean and standard deviation and gets advantage 0, as in TRL (``RolloutBuilder``); a warning is
emitted once per call.

Errors stop training, never silently zero a reward:

- a function that raises -> ``RewardFunctionError`` naming the function and the first prompt it fails on (found
  by calling it again one group at a time, each call on copies of its own of the arguments as they came); with
  ``on_error="skip_group"`` the groups it fails on are skipped instead (``RewardScores.skipped_groups``; a warning
  names the function, the prompt and the error) and the other groups are scored normally;
- a wrong number of values, a value that is not a number, NaN or inf -> ``RewardFunctionError`` naming the
  function, the value, its index in the batch and the prompt, whatever ``on_error`` says (no group to skip).

A function may be async (``async def``, as TRL's): the async functions of a call run together on one event loop
(``lit_grpo/rollout/async_loop.py``), after the others, so that a judge model's or a sandbox's requests overlap.

Built-in functions (names usable in configs; defined in ``lit_grpo/rollout/reward_functions.py``): ``accuracy``
(``accuracy_reward``: the answer extracted from the completion scored by the reasoning-gym dataset's own
``score_answer``, or by normalized exact match for other sources), ``format`` (``format_reward``: 1 when the
completion has exactly one ``<answer>...</answer>``), ``overlong`` (``OverlongPenalty``: DAPO's soft length
penalty), ``char_fraction`` (share of characters from a set; a toy signal for smoke tests), ``math``
(``math_reward``: the final answer verified against the gold answer with math-verify,
``lit_grpo/rollout/math_reward.py``), ``reward_model`` (``RewardModel``: a trained reward model's score,
``lit_grpo/rollout/reward_model.py``; the short form names the model, ``org/name``).
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import inspect
import math
import os
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence, Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Literal, get_args

import torch

from lit_grpo.rollout.async_loop import run_concurrently
from lit_grpo.rollout.math_reward import gold_answer
from lit_grpo.rollout.prompts import message_text
from lit_grpo.rollout.reward_log import LOG_KEYWORDS, CallLog, RewardLogs, as_number
from lit_grpo.rollout.reward_model import (RewardModel, is_reward_model_name, reward_model_kwargs,
                                           reward_model_name)
from lit_grpo.rollout.reward_functions import BUILTIN_REWARDS, reasoning_gym_source
from lit_grpo.rollout.verl_reward import VerlScore, is_verl_score
from lit_grpo.runtime.validation import (NOT_IMPORTABLE, check_choice, huge_int, plain_yaml_values, real_within,
                                         saved_name, shown_keys, shown_setting, shown_value)

RewardFn = Callable[..., Sequence[Any]]

#: The per-completion columns ``score_rewards`` passes (besides a JSONL row's extra fields): data, not options.
COLUMNS = ("answer", "entry", "completion_ids", "completion_length", "truncated", "max_new_tokens")
#: The rewards whose values are correctness, in the order ``correctness_reward`` looks for them.
CORRECTNESS_REWARDS = ("accuracy", "math")
#: The largest reward a float32 tensor holds (the batch's rewards are float32).
FLOAT32_MAX = float(torch.finfo(torch.float32).max)

#: What ``score_rewards`` does when a reward function raises: "raise" a ``RewardFunctionError`` naming the
#: function and the prompt, or "skip_group": score the other groups, report the failing ones in
#: ``RewardScores.skipped_groups`` (the trainer gives their rows no loss).
OnRewardError = Literal["raise", "skip_group"]
ON_ERROR: tuple[str, ...] = get_args(OnRewardError)
#: Seconds at most that ``on_error="raise"`` spends calling the groups after the batch's first, where that one
#: failed, to find whether some group scores (``RewardFunctionError.others_scored``): a function that fails slowly
#: (a timeout) is not waited on for every group before the run ends.
OTHER_GROUPS_PROBE_S = 10.0
#: The keywords every reward call gets besides the columns (TRL's names): no column may take them.
CALL_KEYWORDS = ("trainer_state", *LOG_KEYWORDS)


@dataclass(frozen=True)
class TrainerState:
    """Training progress as a reward function sees it (``trainer_state``; TRL passes transformers' TrainerState,
    whose fields these are).

    Attributes:
        global_step: optimizer steps taken so far (training steps x ``num_iterations`` x ``num_mini_batches``).
        max_steps: the optimizer steps the run will take (from ``max_epochs`` where ``max_steps`` is unset; -1:
            neither bounds it).
        epoch: epochs of training prompts drawn so far, fractional (``steps / steps_per_epoch``).
    """

    global_step: int = 0
    max_steps: int = -1
    epoch: float = 0.0


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names the function and the prompt. ``group``: the first group it
    raised on alone (None: the whole batch only, or its result was wrong); ``others_scored``: whether another group
    of the batch scored, so that ``on_error="skip_group"`` would go on (None: not known)."""

    def __init__(self, message: str, name: str, prompt: str | None, group: int | None,
                 others_scored: bool | None = None):
        super().__init__(message)
        self.name = name
        self.prompt = prompt
        self.group = group
        self.others_scored = others_scored


# --------------------------------------------------------------------------------------------- specs
@dataclass
class WeightedReward:
    """A reward function, its weight in the total, and the name it is logged under (``reward/<name>/mean``)."""

    fn: RewardFn
    weight: float = 1.0
    name: str = ""
    #: whether ``fn`` takes ``prompts`` and ``completions`` by keyword, as TRL passes them (``check_reward_call``)
    by_keyword: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(f"reward function {shown_value(self.fn)} is not callable")
        if is_verl_score(self.fn):  # verl's compute_score(data_source, solution_str, ground_truth, extra_info)
            self.fn = VerlScore(self.fn)
        weight = real_within(self.weight, -FLOAT32_MAX, FLOAT32_MAX)  # totals are float32 tensors
        if weight is None:
            raise ValueError(f"{shown_setting('reward weight', self.weight)} for "
                             f"{shown_value(self.name or reward_name(self.fn))} must be a finite number, |weight| <= "
                             f"{FLOAT32_MAX:.4g} (rewards are float32)")
        self.weight = weight
        if not isinstance(self.name, str):  # it names the logged key reward/<name>/mean
            raise ValueError(f"{shown_setting('reward name', self.name)} for {shown_value(self.fn)} must be a string "
                             "('' for the function's name)")
        if not self.name:
            self.name = reward_name(self.fn)
        self.by_keyword = check_reward_call(self.fn, self.name)

    def saved_setting(self) -> dict[str, Any]:
        """This reward as a run saves it (``plain_yaml_values``): the spec that builds it again
        (``saved_reward_spec``)."""
        return saved_reward_spec(self)

    def call(self, prompts: Sequence[str], completions: Sequence[str], **keywords: Any) -> Any:
        """``fn`` on these completions, ``prompts`` and ``completions`` passed as it takes them."""
        if self.by_keyword:
            return self.fn(prompts=list(prompts), completions=list(completions), **keywords)
        return self.fn(list(prompts), list(completions), **keywords)


def check_reward_call(fn: RewardFn, name: str) -> bool:
    """How ``fn`` is called: True for TRL's way, ``prompts`` and ``completions`` by keyword (it has a parameter named
    ``completions`` that takes a keyword), False for by position, those two first; a decorator's forwarding
    ``wrapper(*args, **kwargs)`` as the function it wraps (``__wrapped__``). Refuse a function neither way can
    call as meant: no ``**kwargs`` for the columns (every call passes them all, and the row's own fields); by position,
    fewer than two positional parameters, or a column (``answer``, ...) or ``prompts`` / ``completions`` out of its
    place among them. Said before a model loads."""
    try:
        parameters = list(inspect.signature(fn, follow_wrapped=False).parameters.values())  # an adapter's own
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return False
    named = {p.name: p for p in parameters}
    takes_columns = any(p.kind is p.VAR_KEYWORD for p in parameters)  # the columns and every field of the row
    forwards = any(p.kind is p.VAR_POSITIONAL for p in parameters) and takes_columns and "completions" not in named
    if forwards and callable(getattr(fn, "__wrapped__", None)):
        # a decorator's wrapper(*args, **kwargs) passes its arguments on as they come: the function it wraps (TRL's
        # f(completions, solution, **kwargs)) says how to call it
        return check_reward_call(fn.__wrapped__, name)
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if takes_columns and "completions" in named and all(
            named[arg].kind in keyword for arg in ("prompts", "completions") if arg in named):
        return True
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return False
    first_two = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    # a parameter named prompts or completions elsewhere would get the other list, or a column, by position
    misplaced = any(name in named and first_two[index:index + 1] != [name]
                    for index, name in enumerate(("prompts", "completions")))
    if len(first_two) < 2 or set(first_two) & set(COLUMNS) or not takes_columns or misplaced:
        raise ValueError(f"reward function {name!r} has the signature {inspect.signature(fn)}, but lit_grpo calls "
                         "fn(prompts=..., completions=..., **columns) where it names completions (as TRL), else "
                         "fn(prompts, completions, **columns) by position, then the columns "
                         f"({', '.join(COLUMNS)} and the row's fields) by name; write it as "
                         "def f(prompts, completions, **kwargs) or def f(completions, **kwargs)")
    return False


def reward_name(fn: Any) -> str:
    """``fn.__name__`` without a ``_reward`` suffix; a callable object's class name otherwise."""
    return _logged_name(getattr(fn, "__name__", None) or type(fn).__name__)


def _logged_name(name: str) -> str:
    """A function's ``name`` as its reward is logged: without a ``_reward`` suffix."""
    return name[: -len("_reward")] if name.endswith("_reward") and len(name) > len("_reward") else name


def import_failure(err: Exception) -> str:
    """An error a module raised while it was imported, with where in the user's code: a syntax error's line, else
    the innermost frame outside the import machinery (the traceback itself is not shown)."""
    if isinstance(err, SyntaxError) and err.filename:
        return f"{type(err).__name__}: {err.msg} ({err.filename}, line {err.lineno})"
    frames = [frame for frame in traceback.extract_tb(err.__traceback__) if not frame.filename.startswith("<")]
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


#: TRL's built-in reward names (those its `trl grpo` command takes): what each is here.
TRL_REWARDS = {
    "accuracy_reward": "TRL's accuracy_reward (math-verify against the row's solution) is 'math' here, with "
                       "data.answer_column: solution",
    "reasoning_accuracy_reward": "TRL's reasoning_accuracy_reward is closest to 'math' here (the last <answer> or "
                                 "\\boxed{} is the answer), with data.answer_column: solution",
    "think_format_reward": "TRL's think_format_reward has no built-in counterpart ('format' checks <answer> tags); "
                           "name TRL's own, 'trl.rewards:think_format_reward', where TRL is installed",
    "get_soft_overlong_punishment": "TRL's get_soft_overlong_punishment is 'overlong' here: {name: overlong, "
                                    "kwargs: {max_length: max_completion_len, buffer: soft_punish_cache}}",
}


def _unknown_reward_hint(name: str) -> str:
    """What to write instead of the unknown reward ``name``: TRL's counterpart, else the closest built-in."""
    if name in TRL_REWARDS:
        return f"{TRL_REWARDS[name]}; "
    close = difflib.get_close_matches(name, BUILTIN_REWARDS, n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def _import_reward(name: str) -> Any:
    """What ``"package.module:function"`` (or ``"package.module.function"``) names, imported."""
    module_name, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        # importlib reads a path as a module name: 'my_rewards' is not a package, a relative import needs one
        file = PurePath(module_name.replace("\\", "/"))
        module = file.stem if file.suffix == ".py" else file.name
        raise ValueError(f"reward function {name!r} names a file; name its module: {module + ':' + attr!r}, with the "
                         f"module's folder ({str(file.parent)!r}) the working folder or on PYTHONPATH")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        missing = getattr(err, "name", None)
        if not isinstance(err, ModuleNotFoundError) or missing and not (
                module_name == missing or module_name.startswith(missing + ".")):
            # the module was found; a package it imports is not installed, or a name it imports is not in its
            # package: its line, as for any error of its own
            raise ValueError(f"reward function {name!r} cannot be imported: its module {module_name!r} raised "
                             f"{import_failure(err)}") from err
        here = [path.stem for path in Path.cwd().glob("*.py")]
        if module_name in here:  # a script run from another folder has that one on sys.path, not this one
            hint = "its file is in the working folder, which is not on sys.path: add the folder to PYTHONPATH"
        else:  # a module of the working folder one slip away (my_reward for my_rewards)
            close = difflib.get_close_matches(module_name, here, n=1)
            hint = f"did you mean {close[0] + ':' + attr!r}?" if close else (
                f"use a built-in {sorted(BUILTIN_REWARDS)} or 'package.module:function'")
        raise ValueError(f"reward function {name!r} cannot be imported ({err}); {hint}") from err
    except Exception as err:  # noqa: BLE001 - the module's own code failed: a setting's error, not a traceback
        raise ValueError(f"reward function {name!r} cannot be imported: its module {module_name!r} raised "
                         f"{import_failure(err)}") from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        # the module's own public functions: what a misspelt name was meant to be
        functions = sorted(key for key, value in vars(module).items() if not key.startswith("_")
                           and inspect.isfunction(value) and value.__module__ == module.__name__)
        close = difflib.get_close_matches(attr, functions, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"its functions: {functions}" if functions else ""
        raise ValueError(f"reward function {name!r} cannot be imported ({err}); " + (
            hint or f"use a built-in {sorted(BUILTIN_REWARDS)} or 'package.module:function'")) from err


def _resolve(name: str | Callable[..., Any], kwargs: Mapping[str, Any]) -> RewardFn:
    """The reward function a config's ``name`` and option ``kwargs`` give: a built-in, a reward model, an
    imported function or, from Python, the callable itself (a class is built with the options, a function bound to
    them), its options checked."""
    if callable(name):
        target, name = name, getattr(name, "__name__", type(name).__name__)
    elif name.startswith(NOT_IMPORTABLE):  # a saved setting (a checkpoint's, hparams.yaml) given back as a config
        why = name[len(NOT_IMPORTABLE):].partition("(")[2].partition(")")[0]  # "<not importable (why): ..."
        raise ValueError(f"reward function {name!r} is how a run saves a function that no name imports"
                         + (f" ({why})" if why else "") + ": give the function itself from Python, or define it "
                         "at the top level of a module and name it 'package.module:function'")
    elif name in BUILTIN_REWARDS:
        target = BUILTIN_REWARDS[name]
    elif is_reward_model_name(name):
        target, kwargs = RewardModel, reward_model_kwargs(name, kwargs)
    elif ":" in name or "." in name:
        target = _import_reward(name)
    else:
        raise ValueError(f"reward function {name!r} is unknown; {_unknown_reward_hint(name)}use a built-in "
                         f"{sorted(BUILTIN_REWARDS)}, 'package.module:function' or a reward model's 'org/name' or "
                         "folder")
    if not callable(target):
        raise ValueError(f"reward function {name!r} imports {shown_value(target, 80)}, which is not callable; name a "
                         "function fn(prompts, completions, **columns) as 'package.module:function'")
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"reward function {name!r}: {shown_setting('kwargs', kwargs)} must be a mapping of option "
                         "names to values")
    _check_options(name, target, kwargs)
    check_values = getattr(target, "check_options", None)  # a function's own check of its options' values
    if check_values is not None and not isinstance(target, type):
        check_values(**kwargs)
    if isinstance(target, type):
        return target(**kwargs)
    if kwargs:
        return functools.wraps(target)(functools.partial(target, **kwargs))
    return target


def reward_options(target: Any) -> tuple[list[str], bool]:
    """The options a reward function (or class) takes by name, and whether it takes any other keyword too
    (``**kwargs``). A function's first two positional parameters (prompts, completions) and the ``COLUMNS`` are
    data, not options."""
    parameters = list(inspect.signature(target).parameters.values())
    if not isinstance(target, type):
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
        parameters = [p for p in parameters if p not in positional]
    named = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return [n for n in named if n not in COLUMNS], any(p.kind is p.VAR_KEYWORD for p in parameters)


def _check_options(name: str, target: Any, kwargs: Mapping[str, Any]) -> None:
    """Refuse an option the function does not take by name. A built-in's ``**columns`` receives data only, so it
    takes its named options alone; another function with ``**kwargs`` may read any option from them."""
    options, takes_any = reward_options(target)
    unknown = [key for key in kwargs if key not in options]
    # a function's own may share a built-in's name; a key that is no text (YAML's 1:) names no option, **kwargs or not
    refused = unknown if BUILTIN_REWARDS.get(name) is target or not takes_any else [
        key for key in unknown if not isinstance(key, str)]
    if refused:
        raise ValueError(f"reward function {name!r} takes no option {shown_keys(refused)}; its options: {options}")
    for option in sorted(unknown):  # a misspelled named option would reach **kwargs, the named one keeping its default
        close = difflib.get_close_matches(option, options, n=1, cutoff=0.8)
        if close:
            raise ValueError(f"reward function {name!r} takes no option {option!r} (did you mean {close[0]!r}?); an "
                             f"option it does not name reaches its **kwargs, and {close[0]!r} would keep its default")


def correctness_reward(reward_funcs: Sequence[WeightedReward], name: str | None) -> str | None:
    """The reward whose values are correctness (val/accuracy, curriculum feedback): ``name``, which must be one of
    ``reward_funcs``' names; without a name the first of ``CORRECTNESS_REWARDS`` among them, else None (no
    correctness is measured)."""
    names = [reward.name for reward in reward_funcs]
    if name is None:
        return next((candidate for candidate in CORRECTNESS_REWARDS if candidate in names), None)
    if name not in names:
        raise ValueError(f"{shown_setting('accuracy_reward', name)} is not one of the reward functions' names {names}; "
                         f"name one of them, or leave it unset for the first of {list(CORRECTNESS_REWARDS)} among them")
    return name


def check_gold_answers(reward_funcs: Sequence[WeightedReward], examples: Sequence[Any], source: str) -> None:
    """Refuse prompts none of which a built-in correctness reward (``CORRECTNESS_REWARDS``) can score: it would say
    None for every completion, and the run would train on the other rewards alone (or on none), unnoticed. A
    prompt (a ``PromptExample``: ``answer``, ``entry``) is scored by ``math`` where it has a gold answer, and by
    ``accuracy`` also where its reasoning-gym dataset scores it (tasks such as graph_color have no gold answer).
    ``source`` names where the prompts come from and how an answer is given, for the message."""
    def has_gold(example: Any) -> bool:
        return gold_answer(example.answer, example.entry) is not None

    scorable = {"math": has_gold, "accuracy": lambda example: has_gold(example) or bool(
        reasoning_gym_source(example.entry))}
    names = [reward.name for reward in reward_funcs for name in CORRECTNESS_REWARDS
             if inspect.unwrap(reward.fn) is BUILTIN_REWARDS[name] and not any(map(scorable[name], examples))]
    if names:
        raise ValueError(f"the reward functions {names} score against a gold answer, but none of the {len(examples)} "
                         f"prompts has one ({source}); give the answers, or drop those reward functions")


def check_row_fields(examples: Sequence[Any], source: str) -> None:
    """Refuse prompts (``PromptExample``) with a field named as an argument every reward call passes itself
    (``prompts``, ``completions``, ``trainer_state``, ``log_metric``, ``log_extra`` and the ``COLUMNS`` but
    ``answer``, which is the gold answer by design): the call's value would replace the row's without a word, or
    collide with it. ``source`` names where the prompts come from, for the message."""
    taken = {"prompts", "completions", *CALL_KEYWORDS, *COLUMNS} - {"answer"}
    for index, example in enumerate(examples):
        if clash := sorted(taken & set(example.entry)):
            # the rows lacking a field hold it as None (prompts.with_every_field): name one that holds a value
            held = ((i, [key for key in clash if other.entry.get(key) is not None]) for i, other in enumerate(examples))
            index, clash = next(((i, keys) for i, keys in held if keys), (index, clash))
            raise ValueError(f"{source}: row {index} has the fields {clash}, which are names the reward functions "
                             f"get from lit_grpo itself ({', '.join(sorted(taken))}); rename those fields")


def _required_keywords(reward: WeightedReward) -> list[str]:
    """The parameters of ``reward``'s function that a call must pass by name (no default): beyond ``prompts`` and
    ``completions``, or the first two positional ones where it is called by position; a decorator's forwarding
    ``wrapper(*args, **kwargs)`` read as the function it wraps (as ``check_reward_call`` reads it), less what an
    outer layer gives a default (a spec's options, bound by ``functools.partial`` over the wrapper)."""
    fn, defaulted = reward.fn, set()
    while True:
        try:
            parameters = list(inspect.signature(fn, follow_wrapped=False).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature: nothing to check
            return []
        defaulted.update(p.name for p in parameters if p.default is not p.empty)
        if isinstance(fn, functools.partial):  # its keywords, which a wrapper's **kwargs hides in its signature
            defaulted.update(fn.keywords)
        kinds = {p.kind for p in parameters}
        wrapped = getattr(fn, "__wrapped__", None)
        if not ({inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds and callable(wrapped)):
            break
        fn = wrapped
    if not reward.by_keyword:
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
        parameters = [p for p in parameters if p not in positional]
    return [p.name for p in parameters if p.default is p.empty and p.name not in defaulted
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("prompts", "completions")]


def check_reward_columns(reward_funcs: Sequence[WeightedReward], examples: Sequence[Any], source: str) -> None:
    """Refuse a reward function with a parameter it needs (no default) that no call passes: neither an argument
    every call gets (``COLUMNS``, ``trainer_state``, ``log_metric``, ``log_extra``) nor a field of the prompts'
    rows (``PromptExample.entry``). Its first call would raise TypeError, as TRL's does, but only after the model
    loaded and the first rollout ran; said with the prompts instead, naming the fields there are. A function that
    carries ``check_rows(examples, source)`` (as ``VerlScore`` does) checks the rows itself first. ``source``
    names where the prompts come from, for the message."""
    fields = sorted({key for example in examples for key in example.entry} - {"prompt"})
    given = {*COLUMNS, *CALL_KEYWORDS, *fields}
    for reward in reward_funcs:
        check_rows = getattr(reward.fn, "check_rows", None)  # a function's own check of the rows (VerlScore's)
        if callable(check_rows):
            check_rows(examples, source)
        missing = [name for name in _required_keywords(reward) if name not in given]
        if missing:
            # a misspelt column, or the singular of an argument every call passes (prompt for prompts)
            close = difflib.get_close_matches(missing[0], [*fields, "prompts", "completions", *COLUMNS], n=1)
            raise ValueError(f"reward function {reward.name!r} needs {missing}, which no row of {source} has: its "
                             f"fields are {fields}" + (f" (did you mean {close[0]!r}?)" if close else "")
                             + f", and every call also passes {list(COLUMNS + CALL_KEYWORDS)}; add the column, "
                             "or give the parameter a default")


#: The keys of a reward spec given as a mapping (``build_reward_funcs``).
REWARD_SPEC_KEYS = ("name", "weight", "kwargs", "log_name")


def _reward_from_mapping(spec: Mapping[str, Any]) -> WeightedReward:
    """A reward spec given as ``{"name": ..., "weight": 1.0, "kwargs": {...}, "log_name": ...}``."""
    if unknown := [key for key in spec if key not in REWARD_SPEC_KEYS]:
        # a key of any type: listed as shown_keys shows it, the closest meant key found for the first string
        misspelt = sorted(key for key in unknown if isinstance(key, str))
        close = difflib.get_close_matches(misspelt[0], REWARD_SPEC_KEYS, n=1) if misspelt else []
        raise ValueError(f"reward spec {shown_value(dict(spec))} takes only the keys {list(REWARD_SPEC_KEYS)}; "
                         f"unknown: {shown_keys(unknown)}" + (f" (did you mean '{close[0]}'?)" if close else ""))
    if "name" not in spec:
        raise ValueError(f"reward spec {shown_value(dict(spec))} has no 'name': give a built-in's name "
                         f"{sorted(BUILTIN_REWARDS)}, 'package.module:function' or a reward model's 'org/name' "
                         "or folder")
    name = spec["name"]
    if isinstance(name, os.PathLike):
        name = _path_name(name)
    if not (isinstance(name, str) and name or callable(name)):
        raise ValueError(f"reward spec {shown_value(dict(spec))}: {shown_setting('name', name)} must be a built-in's "
                         f"name {sorted(BUILTIN_REWARDS)}, 'package.module:function', a reward model's 'org/name' or "
                         "folder, or (from Python) the function itself")
    kwargs, log_name = spec.get("kwargs"), spec.get("log_name")
    fn = _resolve(name, {} if kwargs is None else kwargs)  # [] or 0 named, not read as no options
    if log_name is None or log_name == "":  # another falsy value (0, False) is named by WeightedReward
        log_name = name if isinstance(name, str) and name in BUILTIN_REWARDS else ""
    return WeightedReward(fn, spec.get("weight", 1.0), log_name)


def _path_name(path: os.PathLike) -> str:
    """A reward spec's name given as a path (``os.PathLike``: a ``pathlib.Path``, a Python config's): the text of the
    reward model's folder it names, which a run saves and which builds the same reward model. A path is meant as a
    folder, so a bare ``Path("rm")`` (pathlib drops a ``./``) reads as ``./rm``, never as a built-in's name; refused
    where its text holds a ':', which no folder name in a spec may (it would read as a module's function)."""
    text = os.fsdecode(path)
    if ":" in text:
        raise ValueError(f"reward spec {shown_value(path)} is a path, which names a reward model's folder; its text "
                         "holds a ':', which a spec reads as 'package.module:function': rename or link the folder")
    return text if "/" in text else f"./{text}"


def build_reward_funcs(specs: Sequence[Any] | None) -> list[WeightedReward]:
    """Turn config entries into ``WeightedReward`` objects.

    Each entry is a ``WeightedReward``, a callable (weight 1), a name (a built-in, ``"pkg.module:fn"`` or a reward
    model's ``org/name`` or folder; a folder may be a ``pathlib.Path``, read as its text), or a dict ``{"name": ...,
    "weight": 1.0, "kwargs": {...}, "log_name": ...}`` (from Python its name may be the callable itself or a
    path). ``None`` or ``[]`` -> ``[accuracy]``.
    ``kwargs`` are options the function takes by name (``reward_options``); a misspelled one is an error, and a
    function that carries ``check_options(**kwargs)`` (as ``math`` does) has their values checked here too.
    """
    if isinstance(specs, (str, bytes, Mapping, WeightedReward)) or callable(specs) or (
            specs is not None and not isinstance(specs, Sequence)):  # a str or a dict would be read item by item
        raise ValueError(f"{shown_setting('reward_funcs', specs, 80)} must be a list of reward specs (names, dicts or "
                         f"callables); for one, write [{shown_value(specs, 60)}]")
    if not specs:
        specs = ["accuracy"]
    out: list[WeightedReward] = []
    for spec in specs:
        if isinstance(spec, os.PathLike):  # a reward model's folder, as its text names it
            spec = _path_name(spec)
        if isinstance(spec, WeightedReward):
            out.append(spec)
        elif isinstance(spec, str):
            out.append(WeightedReward(_resolve(spec, {}), 1.0, spec if spec in BUILTIN_REWARDS else ""))
        elif isinstance(spec, Mapping):
            out.append(_reward_from_mapping(spec))
        elif callable(spec):
            out.append(WeightedReward(spec))
        else:
            raise ValueError(f"reward spec {shown_value(spec)} is not a name, a dict or a callable")
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ValueError(f"reward functions need distinct names (they are logged as reward/<name>/mean): {names}; "
                         "set log_name")
    return out


# --------------------------------------------------------------------------------------------- saved specs
def saved_reward_specs(specs: Any) -> Any:
    """``reward_funcs`` as a run saves them (hparams.yaml, a checkpoint's hyperparameters; ``plain_yaml_values``
    then makes them plain): each entry that is or names a callable (``saved_reward_spec``) in a config's spelling
    where one builds the same reward again; anything else, and what is not a list of specs, as given (the build
    refuses it)."""
    if type(specs) not in (list, tuple):
        return specs
    return [saved_reward_spec(spec) for spec in specs]


def saved_reward_spec(spec: Any) -> Any:
    """One reward spec as a run saves it: a ``WeightedReward`` as ``{"name", "weight", "kwargs", "log_name"}``
    (``REWARD_SPEC_KEYS``), its name the function's built-in name or ``saved_name`` with its options as ``kwargs``
    (``_reward_spelling``), where that spec builds an equal reward (function, weight, name), else a marker for the
    function that says none does; a mapping naming a callable (not a class, which a config builds with the
    options as given) and a callable that is no plain function or class (a ``functools.partial``, an
    ``OverlongPenalty``) as the reward they build, where a spelling builds it again; a folder's path as the text that
    names it (``_path_name``); anything else as given, for ``plain_yaml_values``. What does not build is kept as
    given: the build that follows refuses it."""
    if isinstance(spec, WeightedReward):
        return _saved_reward(spec)
    name = spec.get("name") if isinstance(spec, Mapping) else None
    if isinstance(spec, os.PathLike) or isinstance(name, os.PathLike):  # a folder, as the text that names it
        try:
            return _path_name(spec) if name is None else {**spec, "name": _path_name(name)}
        except ValueError:  # saved as given, refused by the build
            return spec
    if (callable(name) and not inspect.isclass(name)) or (
            callable(spec) and not (inspect.isroutine(spec) or inspect.isclass(spec))):
        try:
            with warnings.catch_warnings():  # the build that follows warns
                warnings.simplefilter("ignore")
                reward = _reward_from_mapping(spec) if isinstance(spec, Mapping) else WeightedReward(spec)
        except Exception:  # noqa: BLE001 - any spec that does not build: saved as given, refused by the build
            return spec
        saved = _saved_reward(reward)
        if not saved["name"].startswith(NOT_IMPORTABLE):
            return saved
    return spec


def _saved_reward(reward: WeightedReward) -> dict[str, Any]:
    """``reward`` as the spec that builds it again (``saved_reward_spec``), or with a marker for its function."""
    spelling = _reward_spelling(reward.fn)
    if spelling is not None:
        name, kwargs = spelling
        spec = {"name": name, "weight": reward.weight, **({} if kwargs is None else {"kwargs": kwargs})}
        try:  # the spelling is kept only where it builds the same reward: a check of its options may refuse it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built = _reward_from_mapping(spec)
        except Exception:  # noqa: BLE001 - a spelling that does not build is no spelling of this reward
            built = None
        if built is not None and _same_function(built.fn, reward.fn) and built.by_keyword == reward.by_keyword:
            return spec if built.name == reward.name else {**spec, "log_name": reward.name}
    given = reward.fn.fn if type(reward.fn) is VerlScore else reward.fn  # as given: WeightedReward wrapped it
    marker = saved_name(given)
    if not marker.startswith(NOT_IMPORTABLE):  # a name that imports it, but builds another reward (a class's)
        marker = f"{NOT_IMPORTABLE} (its name builds another reward): {marker}>"
    spec = {"name": marker, "weight": reward.weight}
    # a spec naming the function itself, from Python, logs it under its own name
    return spec if reward.name == reward_name(reward.fn) else {**spec, "log_name": reward.name}


def _reward_spelling(fn: Any) -> tuple[str, dict[str, Any] | None] | None:
    """The name and options (None: none) a config's spec gives to build a reward function like ``fn``: a function
    that a name imports (a built-in's name where it is one); a ``functools.partial`` of one with keyword arguments
    only, each a plain YAML value that reads back as itself (a spec's kwargs bind the function's options so); an
    ``OverlongPenalty`` (not a subclass's) by its options; a verl function (``VerlScore``) as itself, which the
    build wraps again. None for any other: no spelling is made up for it. ``_saved_reward`` checks it builds."""
    if type(fn) is VerlScore:
        return _reward_spelling(fn.fn)
    if type(fn) is functools.partial:
        if fn.args or not _reads_back(fn.keywords):
            return None
        spelling = _reward_spelling(fn.func)
        return None if spelling is None or spelling[1] is not None else (spelling[0], dict(fn.keywords))
    if type(fn) is BUILTIN_REWARDS["overlong"]:  # its options are its state; _same_function compares the rest
        options = {option: getattr(fn, option, None) for option in reward_options(type(fn))[0]}
        return ("overlong", options) if _reads_back(options) else None
    if not inspect.isroutine(fn):  # a class builds an object with the spec's options; another object is no name
        return None
    builtin = _builtin_name(fn)
    name = builtin if builtin is not None else saved_name(fn)
    return None if name.startswith(NOT_IMPORTABLE) else (name, None)


def _builtin_name(target: Any) -> str | None:
    """The built-in name (``BUILTIN_REWARDS``) of the function or class ``target``, None where it is none."""
    return next((key for key, value in BUILTIN_REWARDS.items() if value is target), None)


def _reads_back(value: Any) -> bool:
    """Whether plain YAML and torch.load(weights_only=True) read ``value`` back as itself: a string, a bool, a
    number (an int that prints), None, and lists and string-keyed dicts of those; not a tuple (read as a list)."""
    if value is None or type(value) in (str, bool, float):
        return True
    if type(value) is int:
        return huge_int(value) is None
    if type(value) is list:
        return all(map(_reads_back, value))
    if type(value) is dict:
        return all(isinstance(key, str) and _reads_back(item) for key, item in value.items())
    return False


def _same_function(built: Any, given: Any) -> bool:
    """Whether the reward function a saved spec builds is ``given``: itself; a ``functools.partial`` of the same
    function with equal arguments; an ``OverlongPenalty`` or ``VerlScore`` of the same type and state."""
    if built is given:
        return True
    if type(built) is not type(given):
        return False
    if type(given) is functools.partial:
        return built.func is given.func and built.args == given.args and built.keywords == given.keywords
    if type(given) is VerlScore:
        return _same_function(built.fn, given.fn) and built.batch == given.batch
    return type(given) is BUILTIN_REWARDS["overlong"] and vars(built) == vars(given)


# --------------------------------------------------------------------------------------------- a resume's rewards
def reward_changes(saved: Any, now: Any) -> list[str]:
    """How the reward functions ``now`` (this run's ``reward_funcs``) differ from ``saved`` (a checkpoint's): a line
    for each reward removed, added or changed (its weight, kwargs or log_name), none where they are the same. Both
    are compared as a run saves them (``saved_reward_specs``, then plain YAML), so a function is the name it was
    saved as (a built-in's function named by its module, 'package.module:function', is the built-in's name; a reward
    model's local folder is its real path) and a marker (``<not importable ...>``) equals the same marker; a spec's
    defaults are filled in (a name alone weighs 1.0 with no kwargs and its default log name; an option given at the
    function's default reads as unset), and no rewards are ``accuracy``, as the build reads them. A reward is known
    by its spec's name, the n-th of a name given twice (under two log names) by the n-th; what is no spec (the build
    refuses it) by itself, whole. A resume may change them on purpose, so this is said, not refused: the reward
    logged from here on measures another objective than the checkpoint's."""
    old, new = _compared_rewards(saved), _compared_rewards(now)
    lines = []
    for key, fields in old.items():
        if key not in new:
            lines.append(f"{_reward_label(key)}: removed" + (
                f" (weight {shown_value(fields['weight'])} in the checkpoint)" if "weight" in fields else ""))
            continue
        for part, was in fields.items():
            if not _same_value(was, new[key][part]):
                lines.append(f"{_reward_label(key)}: {part} {_shown_field(was)} in the checkpoint, "
                             f"{_shown_field(new[key][part])} now")
    for key, fields in new.items():
        if key not in old:
            lines.append(f"{_reward_label(key)}: added" + (
                f" (weight {shown_value(fields['weight'])} now)" if "weight" in fields else ""))
    return lines


def _compared_rewards(specs: Any) -> dict[tuple[bool, str, int], dict[str, Any]]:
    """``specs`` as ``reward_changes`` compares them: by ``(is a spec, its name or shown text, n-th of it)``, each
    spec's weight, kwargs and log name (None: its default), anything else as itself."""
    specs = plain_yaml_values(saved_reward_specs(specs))
    if specs is None or specs == []:
        specs = ["accuracy"]
    compared: dict[tuple[bool, str, int], dict[str, Any]] = {}
    for spec in specs if isinstance(specs, list) else [specs]:
        if isinstance(spec, str):
            spec = {"name": spec}
        name = spec.get("name") if isinstance(spec, dict) and set(spec) <= set(REWARD_SPEC_KEYS) else None
        if isinstance(name, str):
            log_name, target = spec.get("log_name"), _reward_target(name)
            if log_name in (None, ""):  # its default as this spelling gives it: a folder's link logs its own name
                log_name = _default_log_name(name)
            name = _compared_name(name, target)
            kwargs = {} if spec.get("kwargs") is None else _set_options(spec["kwargs"], target)
            fields = {"weight": spec.get("weight", 1.0), "kwargs": kwargs,
                      "log_name": None if log_name in (None, "", _default_log_name(name)) else log_name}
            label = (True, name)
        else:
            fields, label = {"spec": spec}, (False, shown_value(spec, 1000))
        count = sum(1 for key in compared if key[:2] == label)
        compared[(*label, count)] = fields
    return compared


def _reward_target(name: str) -> Any:
    """The function or class a spec's ``name`` builds its reward from, nothing built: a built-in's, a reward model's
    class, an imported one; None where no name imports it (a marker, a module that fails: the build says why)."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if is_reward_model_name(name):
        return RewardModel
    if name.startswith(NOT_IMPORTABLE) or not (":" in name or "." in name):
        return None
    try:
        return _import_reward(name)
    except Exception:  # noqa: BLE001 - any failure: the name is compared as its text
        return None


def _compared_name(name: str, target: Any) -> str:
    """A spec's ``name`` as ``reward_changes`` knows its reward (``target``: ``_reward_target``'s): the built-in's
    name where it imports a built-in's function, which is logged under that name either way (a class is not: its
    object may name itself, a reward model after its folder); a reward model's local folder by its real path, which
    ``./rm``, ``/abs/rm/``, ``~/rm`` and a link all name; any other name as its text."""
    builtin = _builtin_name(target)
    if builtin is not None and inspect.isroutine(target):
        return builtin
    folder = os.path.expanduser(name)  # as RewardModel reads it
    return os.path.realpath(folder) if is_reward_model_name(name) and os.path.isdir(folder) else name


def _set_options(kwargs: Any, target: Any) -> Any:
    """A spec's ``kwargs`` less the options equal to their defaults in ``target``'s signature: an option given at its
    default builds the same reward as one left unset (a Python object is saved with every option)."""
    try:
        parameters = inspect.signature(target).parameters
        options = reward_options(target)[0]
    except (TypeError, ValueError):  # no target, or one without a signature: compared as given
        return kwargs
    if not isinstance(kwargs, dict):
        return kwargs
    return {key: value for key, value in kwargs.items() if key not in options
            or parameters[key].default is inspect.Parameter.empty or not _same_value(value, parameters[key].default)}


def _default_log_name(name: str) -> str | None:
    """The name a spec named ``name`` without a log name is logged under, where the name tells it: a built-in's own,
    an imported function's (``reward_name`` of ``package.module:function``), a reward model's (its folder's or hub
    id's last part, as ``RewardModel`` names itself); None where only the object built knows (a marker)."""
    if name in BUILTIN_REWARDS:
        return name
    if is_reward_model_name(name):
        return _logged_name(reward_model_name(name))
    if name.startswith(NOT_IMPORTABLE) or ":" not in name:
        return None
    return _logged_name(name.rpartition(":")[2].rpartition(".")[2])


def _reward_label(key: tuple[bool, str, int]) -> str:
    is_spec, name, count = key
    label = f"reward {shown_value(name)}" if is_spec else f"reward spec {name}"
    return label + (f" (number {count + 1} of that name)" if count else "")


def _same_value(was: Any, now: Any) -> bool:
    """Whether two saved values are one: equal, 1 and 1.0 too, but not True and 1."""
    if isinstance(was, bool) != isinstance(now, bool):
        return False
    try:
        return bool(was == now)
    except Exception:  # noqa: BLE001 - values that cannot be compared (a hand-edited checkpoint's) differ
        return False


def _shown_field(value: Any) -> str:
    return "None (its default)" if value is None else shown_value(value)


# --------------------------------------------------------------------------------------------- scoring
@dataclass
class RewardScores:
    """The outcome of ``score_rewards``.

    Attributes:
        total: ``[N]`` weighted sum per completion (0.0 where every function said None: unscored).
        components: ``{name: [N]}`` each function's raw values, NaN where it returned None.
        skipped_groups: sorted group indices (``i // group_size``) some function raised on, with
            ``on_error="skip_group"``; their ``total`` is 0.0 and their component values NaN.
        errors: one message per skipped (function, group).
        logs: what the calls logged with ``log_metric`` and ``log_extra`` (``lit_grpo.rollout.reward_log``).
    """

    total: torch.Tensor
    components: dict[str, torch.Tensor]
    skipped_groups: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    logs: RewardLogs | None = None


def _shown(prompt: Any) -> Any:
    """A prompt as an error names it: a chat prompt by its last message's text (``message_text``), the question
    asked, where its messages' repr, cut short, showed a system prompt shared by every row."""
    is_chat = isinstance(prompt, list) and prompt and isinstance(prompt[-1], Mapping) and "content" in prompt[-1]
    return message_text(prompt) if is_chat else prompt


def _check_values(values: Any, name: str, prompts: Sequence[str], n: int, offset: int = 0) -> list[float | None]:
    """Reward function ``name``'s ``values`` for ``n`` completions of ``prompts`` as ``n`` floats or None; raises
    naming the function, the bad value, its index (in the batch: ``offset``, the first completion's) and its prompt
    where one is not a number finite in float32."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    # a dict or a set has a length too, but no order of the completions: a dict's keys would be taken as rewards
    if values is None:
        raise ValueError(f"reward function {name!r} returned None, as a function without a return statement does; it "
                         f"must return a list of {n} values, each a float or None")
    if isinstance(values, (str, bytes, Mapping, AbstractSet)) or not hasattr(values, "__len__"):
        raise ValueError(f"reward function {name!r} returned {type(values).__name__} {shown_value(values)}; it must "
                         f"return a list of {n} values, each a float or None")
    if len(values) != n:
        raise ValueError(f"reward function {name!r} returned {len(values)} values for {n} completions; it must "
                         "return one float (or None) per completion")
    out: list[float | None] = []
    for i, value in enumerate(values):
        if value is None:
            out.append(None)
            continue
        number = as_number(value)
        if number is None:
            raise ValueError(f"reward function {name!r} returned {shown_value(value)} ({type(value).__name__}) at "
                             f"index {offset + i} for prompt {_shown(prompts[i])!r:.300}; values must be floats or "
                             "None")
        if not math.isfinite(number) or abs(number) > FLOAT32_MAX:  # rewards are float32 tensors
            # TRL's nansum takes a NaN for None; refused here, so that a broken computation is not read as no opinion
            nan = "; a NaN is refused where TRL reads it as None: return None for no opinion" if number != number \
                else ""
            # an int beyond float range, which as_number made an infinity, is not even a float
            beyond = ", which is not a finite float" if huge_int(value) else ""
            raise ValueError(f"reward function {name!r} returned {shown_value(value)} at index {offset + i} "
                             f"for prompt {_shown(prompts[i])!r:.300}{beyond}; values must be finite in float32, "
                             f"|value| <= {FLOAT32_MAX:.4g} (or None for no opinion){nan}")
        out.append(number)
    return out


def _call_all(reward_funcs: Sequence[WeightedReward], prompts: Sequence[str], completions: Sequence[str],
              columns: Mapping[str, Sequence[Any]], state: Mapping[str, Any]) -> tuple[list[Any], list[CallLog]]:
    """Each function's values on the whole batch, or the exception it raised, and what each call logged: the plain
    ones called in turn, the async ones (whose call returns an awaitable) then awaited together (``async_loop``).
    Each call gets copies of its own of the arguments (``_fresh_arguments``): what one function changes in them no
    other sees, nor a retry, nor the caller."""
    outcomes: list[Any] = []
    logs = [CallLog(reward.name, len(completions)) for reward in reward_funcs]
    for reward, log in zip(reward_funcs, logs):
        try:
            own_prompts, own_completions, own_columns = _fresh_arguments(prompts, completions, columns)
            outcomes.append(reward.call(own_prompts, own_completions, **own_columns, **state, **log.keywords()))
        except Exception as err:  # noqa: BLE001 - re-raised with the function and prompt named, or skipped
            outcomes.append(err)
    pending = [i for i, outcome in enumerate(outcomes) if inspect.isawaitable(outcome)]
    if pending:
        for i, outcome in zip(pending, run_concurrently([outcomes[i] for i in pending])):
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome  # an interrupt or a cancellation is no reward's error
            outcomes[i] = outcome
    return outcomes, logs


def _call(reward: WeightedReward, prompts: Sequence[str], completions: Sequence[str],
          columns: Mapping[str, Sequence[Any]], state: Mapping[str, Any], log: CallLog) -> Any:
    """One function's values on these completions, awaited if it is async; what it logs goes to ``log``."""
    raw = reward.call(prompts, completions, **columns, **state, **log.keywords())
    if not inspect.isawaitable(raw):
        return raw
    (outcome,) = run_concurrently([raw])
    if isinstance(outcome, BaseException):
        try:
            raise outcome
        finally:  # its traceback holds this frame, which holds it: a cycle that would keep the function's locals
            del outcome  # (and, through the caller's frame, the whole batch's error) alive until a collection
    return outcome


def _values_by_group(err: Exception, reward: WeightedReward, prompts: Sequence[str],
                     completions: Sequence[str], columns: Mapping[str, Sequence[Any]],
                     state: Mapping[str, Any], group_size: int, on_error: str,
                     logs: RewardLogs) -> tuple[list[float | None], list[int], list[str]]:
    """A reward function raised on the whole batch: call it again one group at a time (what the groups' calls
    that return log goes to ``logs``). ``prompts``, ``completions`` and ``columns`` are the arguments as they came
    (no call got them, only copies: ``_call_all``); each group's call gets copies of its own.

    ``on_error="raise"``: raise ``RewardFunctionError`` naming the function and the first failing prompt; where
    that is the batch's first group, the next groups are called (``OTHER_GROUPS_PROBE_S`` at most) until one scores,
    and a function that raised on every group is said to (skip_group would skip them all).
    ``on_error="skip_group"``: return ``(values, skipped_groups, errors)``: the values of the groups that score
    fine (None in the failing groups' rows) and the failing group indices; raise only when no group fails alone
    (the batch fails as a whole, so there is nothing to skip).
    """
    values: list[float | None] = []
    skipped: list[int] = []
    errors: list[str] = []
    for start in range(0, len(prompts), group_size):
        end = start + group_size
        group = start // group_size
        log = CallLog(reward.name, end - start)
        # a call may change its arguments before it raises (prompt.extend(completion), entry.pop(key)): a retry
        # that got what a call left would fail, or pass, on another input than the row's
        group_prompts, group_completions, group_columns = _fresh_arguments(
            prompts[start:end], completions[start:end], {k: v[start:end] for k, v in columns.items()})
        try:
            raw = _call(reward, group_prompts, group_completions, group_columns, state, log)
        except Exception as group_err:  # noqa: BLE001 - any failure is the one we look for
            message = (f"reward function {reward.name!r} raised {type(group_err).__name__}: {group_err} on prompt "
                       f"{group} {_shown(prompts[start])!r:.300}")
            note = _completion_form_note(group_err, completions[start])
            if on_error == "raise":
                others = True if group else _other_groups_score(reward, prompts, completions, columns, state,
                                                                group_size)
                if others is False:
                    message += f", and on each of the batch's other {len(prompts) // group_size - 1} groups"
                raise RewardFunctionError(message + note, reward.name, _shown(prompts[start]), group,
                                          others_scored=others) from group_err
            message += note
            skipped.append(group)
            errors.append(message)
            values.extend([None] * (end - start))
            continue
        try:
            values.extend(_check_values(raw, reward.name, prompts[start:end], end - start, offset=start))
        except ValueError as bad:  # its result: said as on the whole batch (_each_function_values)
            raise RewardFunctionError(str(bad), reward.name, None, None) from None
        logs.add(log, offset=start)
    if not skipped:
        prompt = _shown(prompts[0]) if prompts else None
        raise RewardFunctionError(f"reward function {reward.name!r} raised {type(err).__name__}: {err} on the whole "
                                  f"batch (each group alone scores fine; first prompt {prompt!r:.300})",
                                  reward.name, prompt, None) from err
    return values, skipped, errors


def _other_groups_score(reward: WeightedReward, prompts: Sequence[str], completions: Sequence[str],
                        columns: Mapping[str, Sequence[Any]], state: Mapping[str, Any],
                        group_size: int) -> bool | None:
    """Whether a call on one of the groups after the first returns (its values unchecked, its logs dropped): True
    at the first that does, False where every one raised, None where ``OTHER_GROUPS_PROBE_S`` ran out first (or
    the batch has one group). Only where the first group raised: ``skip_group`` would go on with the others."""
    if len(prompts) <= group_size:
        return None
    deadline = time.perf_counter() + OTHER_GROUPS_PROBE_S
    for start in range(group_size, len(prompts), group_size):
        if time.perf_counter() >= deadline:
            return None
        end = start + group_size
        arguments = _fresh_arguments(prompts[start:end], completions[start:end],
                                     {k: v[start:end] for k, v in columns.items()})
        try:
            _call(reward, *arguments, state, CallLog(reward.name, end - start))
        except Exception:  # noqa: BLE001 - any failure is one more group it fails on
            continue
        return True
    return False


def _completion_form_note(err: Exception, completion: Any) -> str:
    """Where ``err`` is a function's reading ``completion`` as the other of the two forms (a text read as TRL's
    conversational ``[{"role": "assistant", "content": text}]``, or that list read as text), which form it gets and
    why; else an empty string. The answer is a completion's last turn: with ``data.tools`` the turns before it are
    tool calls and replies (``lit_grpo.rollout.tools``)."""
    if not isinstance(err, (TypeError, AttributeError)):
        return ""
    said = str(err)
    if isinstance(completion, str) and ("string indices" in said or "'str' object" in said):
        return ("; its completions are plain strings, because its prompts are text, not chat messages: completions "
                "come in TRL's conversational form ([{'role': 'assistant', 'content': text}]) only with chat-message "
                "prompts (a prompt column of [{'role': ..., 'content': ...}] lists, which may hold a system turn; "
                "data.system_prompt does not make text prompts chat messages)")
    if isinstance(completion, list) and ("'list'" in said or '(not "list")' in said):  # text + completion
        return ("; its completions are in TRL's conversational form, lists of messages, because its prompts are "
                "chat messages: a completion's text is completion[-1]['content'] (its last turn, the answer, after "
                "any tool call and reply)")
    return ""


#: Types whose values no call can change in place: a copy shares them (``_fresh``).
_IMMUTABLE = frozenset({str, bytes, int, float, complex, bool, type(None)})


def _fresh(value: Any, memo: dict[int, Any]) -> Any:
    """A copy of ``value`` that a call may change without changing ``value``: lists, dicts and tuples rebuilt
    (an object met twice copied once, ``memo``, as ``copy.deepcopy`` keeps it), strings and numbers shared, and
    tuples of only those (no call can change them in place, so a copy would only cost time), any other value
    ``copy.deepcopy``'d, or kept as it is where ``copy.deepcopy`` refuses it (a lock, a client handle): a retry
    then sees what a failed call left in it."""
    kind = type(value)
    if kind in _IMMUTABLE or (kind is tuple and _IMMUTABLE.issuperset(map(type, value))):
        return value
    if id(value) in memo:
        return memo[id(value)]
    if kind is list:
        if _IMMUTABLE.issuperset(map(type, value)):  # token ids, texts: one C-level copy
            memo[id(value)] = copied = value.copy()
            return copied
        memo[id(value)] = copied = []  # memoized first: a list holding itself copies once
        copied.extend(_fresh(item, memo) for item in value)
        return copied
    if kind is dict:
        if _IMMUTABLE.issuperset(map(type, value.values())):  # a chat message
            memo[id(value)] = copied = value.copy()
            return copied
        memo[id(value)] = copied = {}
        copied.update((key, _fresh(item, memo)) for key, item in value.items())  # keys are hashable, so shared
        return copied
    if kind is tuple:
        items = tuple(_fresh(item, memo) for item in value)
        copied = value if all(a is b for a, b in zip(items, value)) else items
    else:
        try:
            copied = copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - any value deepcopy refuses
            copied = value
    memo[id(value)] = copied
    return copied


def own_copy(value: Any) -> Any:
    """A copy of ``value`` that a reward call may change without changing ``value`` or another's copy (``_fresh``):
    what one row of a scoring's columns gets."""
    return _fresh(value, {})


def _fresh_arguments(prompts: Sequence[Any], completions: Sequence[Any], columns: Mapping[str, Sequence[Any]]
                    ) -> tuple[list[Any], list[Any], dict[str, list[Any]]]:
    """Copies of a scoring's ``N`` prompts, completions and per-completion columns that a reward call may change
    (``prompt.extend(completion)``, ``entry.pop(key)``) without changing these (``_fresh``)."""
    memo: dict[int, Any] = {}

    def fresh_list(values: Sequence[Any]) -> list[Any]:
        # a new list, not _fresh(list(values)): memo would hold that temporary's id, which the next may reuse
        values = list(values)
        return values if _IMMUTABLE.issuperset(map(type, values)) else [_fresh(value, memo) for value in values]

    return fresh_list(prompts), fresh_list(completions), {key: fresh_list(values) for key, values in columns.items()}


def check_prompt_form(examples: Sequence[Any], conversational: bool) -> None:
    """Refuse prompt examples (``PromptExample``) of which one is chat messages where the reward functions' form is
    text (``conversational`` False): that form was taken from other prompts than these, or not from the prompt set
    at all. A plain prompt takes either form (a set mixing both gives it as its one user message)."""
    if not conversational:
        chat = next((example.prompt for example in examples if example.messages), None)
        if chat is not None:
            raise ValueError(f"conversational=False, but prompt {shown_value(chat, 80)} is chat messages: the reward "
                             "functions' form is the whole prompt set's: pass "
                             "conversational=is_conversational(examples) over all its rows (RolloutBuilder's "
                             "conversational)")


def reward_arguments(examples: Sequence[Any], texts: Sequence[Sequence[str]],
                     conversations: Sequence[Sequence[list[dict]]] | None = None, *,
                     conversational: bool) -> tuple[list[Any], list[Any]]:
    """``(prompts, completions)`` as reward functions get them, ``N = B x G`` each, from ``B`` prompt examples
    (``PromptExample``) and their ``[B][G]`` completion texts: text; or, ``conversational`` (the whole prompt
    set's form, ``prompts.is_conversational``, not this batch's: one form all run), TRL's conversational form: each
    prompt's messages as its row holds them, each completion ``[{"role": "assistant", "content": text}]`` (a plain
    prompt as its one user message), or with tool calls (``conversations``, ``[B][G]``: ``lit_grpo.rollout.tools``)
    its turns and tool messages, as TRL's."""
    check_prompt_form(examples, conversational)
    if not conversational:
        return ([example.prompt for example, group in zip(examples, texts) for _ in group],
                [text for group in texts for text in group])
    prompts = [example.messages or [{"role": "user", "content": example.prompt}] for example in examples]
    # a list of its own for each completion, as TRL's rows give: a function building the conversation on it
    # (prompt.extend(completion)) would otherwise extend the group's next prompts too, and the row's messages; the
    # turns' other keys too (own_copy: a tool call's arguments parsed in place)
    prompts = [own_copy(prompt) for prompt, group in zip(prompts, texts) for _ in group]
    if conversations is not None:
        return prompts, [[dict(turn) for turn in turns] for group in conversations for turns in group]
    return prompts, [[{"role": "assistant", "content": text}] for group in texts for text in group]


def _checked_arguments(reward_funcs: Sequence[WeightedReward], prompts: Sequence[Any], completions: Sequence[Any],
                       columns: Mapping[str, Sequence[Any]] | None, group_size: int,
                       on_error: str) -> dict[str, Sequence[Any]]:
    """``score_rewards``' arguments checked (one prompt and one value of each column per completion, ``group_size``
    dividing them, no column named as a call keyword); returns the columns as a dict of its own."""
    check_choice("on_error", on_error, ON_ERROR)
    if not reward_funcs:
        raise ValueError("no reward functions given; pass at least one (e.g. ['accuracy'])")
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions; repeat each prompt once per completion")
    columns = dict(columns or {})
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    for keyword in CALL_KEYWORDS:
        if keyword in columns:
            raise ValueError(f"a column is named {keyword!r}, a keyword every reward call gets (TRL's name; "
                             "trainer_state: the training progress, log_metric and log_extra: what the function "
                             "logs): rename that field of the prompts")
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the {n} completions")
    return columns


def _check_total_finite(total: torch.Tensor, reward_funcs: Sequence[WeightedReward]) -> None:
    """Refuse ``[N]`` weighted totals that overflow float32: each value and weight is finite in float32, their sum
    need not be."""
    if not bool(torch.isfinite(total).all()):
        weights = {reward.name: reward.weight for reward in reward_funcs}
        raise ValueError(f"the weighted rewards overflow float32 ({total[~torch.isfinite(total)].tolist()[:4]}): "
                         f"the reward weights {weights} times their values exceed {FLOAT32_MAX:.4g}; use smaller "
                         "weights")


def _each_function_values(reward_funcs: Sequence[WeightedReward], prompts: Sequence[Any],
                          completions: Sequence[Any], columns: Mapping[str, Sequence[Any]], state: Mapping[str, Any],
                          group_size: int, on_error: str,
                          logs: RewardLogs) -> tuple[list[list[float | None]], set[int], list[str]]:
    """``score_rewards``' calls: ``[len(reward_funcs)][N]`` each function's checked values (None: no opinion, or
    a row of a group it raised on), the groups skipped under ``on_error="skip_group"`` and one message per skipped
    (function, group), each also warned. What the calls that returned logged goes to ``logs``."""
    n = len(completions)
    every_values: list[list[float | None]] = []
    skipped: set[int] = set()
    errors: list[str] = []
    # no call gets these lists themselves, only copies (_call_all): a retry group by group after a call that
    # raised (_values_by_group) starts from them as they came
    outcomes, call_logs = _call_all(reward_funcs, prompts, completions, columns, state)
    for i, reward in enumerate(reward_funcs):
        raw, outcomes[i] = outcomes[i], None  # an error held in the list would keep this frame alive: see below
        failure = raw if isinstance(raw, Exception) else None
        # retried outside the except clause: a group's error is then not chained to the whole batch's
        if failure is not None:
            values, failed, messages = _values_by_group(failure, reward, prompts, completions, columns, state,
                                                        group_size, on_error, logs)
            # its traceback holds this frame, which holds it: a cycle that would keep the function's locals (a
            # reward model's tensors) alive until a garbage collection, where an except clause lets them go
            failure = raw = None
            skipped.update(failed)
            errors.extend(messages)
            for message in messages:
                warnings.warn(f"{message}; on_error='skip_group': the group is skipped (no loss)", stacklevel=3)
        else:
            try:
                values = _check_values(raw, reward.name, prompts, n)
            except ValueError as err:  # the function's result: its error, said as one it raised (without frames)
                raise RewardFunctionError(str(err), reward.name, None, None) from None
            logs.add(call_logs[i])
        every_values.append(values)
    return every_values, skipped, errors


def _weighted_total(reward_funcs: Sequence[WeightedReward], values: Sequence[Sequence[float | None]],
                    n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """From each function's ``[N]`` values (``_each_function_values``): the ``[N]`` weighted total over the values
    that are not None, ``{name: [N]}`` each function's values (NaN for None) and ``[N]`` bool, whether some function
    had a value for the completion."""
    total = torch.zeros(n, dtype=torch.float32)
    seen = torch.zeros(n, dtype=torch.bool)
    components: dict[str, torch.Tensor] = {}
    for reward, function_values in zip(reward_funcs, values):
        component = torch.tensor([math.nan if v is None else v for v in function_values], dtype=torch.float32)
        components[reward.name] = component
        present = ~torch.isnan(component)
        total = total + torch.where(present, component * reward.weight, torch.zeros_like(component))
        seen |= present
    return total, components, seen


def _group_rows(groups: AbstractSet[int], group_size: int, n: int) -> torch.Tensor:
    """``[n]`` bool: True on the rows of ``groups`` (group ``g`` holds rows ``g * group_size`` up to the next)."""
    rows = torch.zeros(n, dtype=torch.bool)
    for group in groups:
        rows[group * group_size:(group + 1) * group_size] = True
    return rows


def score_rewards(
    reward_funcs: Sequence[WeightedReward],
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]] | None = None,
    group_size: int = 1,
    on_error: str = "raise",
    trainer_state: TrainerState | None = None,
) -> RewardScores:
    """Run every reward function on ``N`` completions and combine them (module docstring).

    Args:
        reward_funcs: from ``build_reward_funcs``.
        prompts: ``N`` strings (a prompt repeated for each of its ``G`` completions).
        completions: ``N`` strings, completion ``i`` of ``prompts[i]``.
        columns: per-completion lists of length ``N``, passed as keyword arguments.
        group_size: ``G``; used to name the failing prompt when a function raises (and the unit skipped).
        on_error: ``"raise"`` (a ``RewardFunctionError``) or ``"skip_group"`` (``RewardScores.skipped_groups``).
        trainer_state: passed to every call as ``trainer_state`` (default: a ``TrainerState()`` at step 0).
    """
    columns = _checked_arguments(reward_funcs, prompts, completions, columns, group_size, on_error)
    state = {"trainer_state": trainer_state if trainer_state is not None else TrainerState()}
    n = len(completions)
    logs = RewardLogs(n)
    values, skipped, errors = _each_function_values(reward_funcs, prompts, completions, columns, state, group_size,
                                                    on_error, logs)
    total, components, seen = _weighted_total(reward_funcs, values, n)
    _check_total_finite(total, reward_funcs)
    if skipped:
        rows = _group_rows(skipped, group_size, n)
        total = torch.where(rows, torch.zeros_like(total), total)
        components = {k: torch.where(rows, torch.full_like(v, math.nan), v) for k, v in components.items()}
        seen |= rows  # skipped rows are reported as skipped, not as "no opinion"
    if n and not bool(seen.all()):
        missing = int((~seen).sum())
        warnings.warn(f"every reward function returned None for {missing} of {n} completions; they are left out "
                      "of their group's baseline and get advantage 0", stacklevel=2)
    logs.check_names([reward.name for reward in reward_funcs])
    return RewardScores(total=total, components=components, skipped_groups=sorted(skipped), errors=errors, logs=logs)
