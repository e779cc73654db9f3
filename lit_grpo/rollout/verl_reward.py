"""verl's reward functions as lit_grpo reward functions: ``VerlScore``.

verl scores one completion a call: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``,
the signature of its ``default_compute_score`` and of the function its ``custom_reward_function.path`` / ``.name``
name, returning a number or a dict with the number under ``"score"``. A reward function with a parameter named
``solution_str`` and none named ``completions`` is taken for one (``is_verl_score``) and wrapped in ``VerlScore``
when it is built (``WeightedReward``), so ``reward_funcs: [my_reward:compute_score]`` runs it unchanged. Each
completion gets one call, by keyword, as verl's default (``naive``) reward manager makes it:

- ``data_source``: the row's ``data_source`` field (None where the row has none);
- ``solution_str``: the completion's text (special tokens left out, as verl decodes it);
- ``ground_truth``: the row's ``reward_model["ground_truth"]`` (verl's layout), else its gold answer (``answer``:
  ``data.answer_column``); a row with neither is refused before the model loads (``check_rows``);
- ``extra_info``: the row's ``extra_info`` field ({} where the row has none, as verl passes it).

A function written for verl's ``batch`` reward manager, ``compute_score(data_sources, solution_strs,
ground_truths, extra_infos)`` (``solution_strs``), gets the same values as lists, in one call, and returns one
result per completion. A dict's other keys become columns of ``CompletionLogger``'s table (``log_extra``), as verl
keeps them as its ``reward_extra_info``. An ``async def`` function is awaited, a call's completions together.
verl's ``custom_reward_function.reward_kwargs`` are the spec's ``kwargs``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lit_grpo.rollout.prompts import message_text
from lit_grpo.runtime.validation import shown_value

#: verl's per-completion keywords, in its order.
VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
SIGNATURE = f"verl's compute_score({', '.join(VERL_KEYWORDS)})"


def is_verl_score(fn: Any) -> bool:
    """Whether ``fn`` has verl's shape: a parameter named ``solution_str`` (``solution_strs``: its batch reward
    manager's) and none named ``completions`` (TRL's)."""
    try:
        names = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return bool({"solution_str", "solution_strs"} & set(names)) and "completions" not in names


def ground_truth(row: Any, answer: Any) -> tuple[bool, Any]:
    """``(found, value)``: the row's ``reward_model["ground_truth"]``, else its gold answer where it has one."""
    spec = row.get("reward_model") if isinstance(row, Mapping) else None
    if isinstance(spec, Mapping) and "ground_truth" in spec:
        return True, spec["ground_truth"]
    return answer is not None, answer


class VerlScore:
    """A verl reward function called as a lit_grpo one (module docstring).

    Args:
        fn: ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``, or verl's batch form
            ``fn(data_sources, solution_strs, ground_truths, extra_infos) -> list``; sync or async.
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.batch = "solution_strs" in inspect.signature(fn).parameters

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any] | None = None,
                 entry: Sequence[Any] | None = None, log_extra: Callable[[str, list], None] | None = None,
                 **columns: Any) -> Any:
        rows = entry if entry is not None else [None] * len(completions)
        answers = answer if answer is not None else [None] * len(completions)
        calls = []  # every call's arguments first: a refusal leaves no coroutine of an async fn unawaited
        for completion, row, gold in zip(completions, rows, answers):
            found, truth = ground_truth(row, gold)
            if not found:
                # raised inside the call: score_rewards names the function and the prompt
                raise ValueError(f"it is {SIGNATURE}, which needs each row's reward_model.ground_truth (verl's "
                                 "layout) or a gold answer (data.answer_column); this prompt's row has neither")
            fields = row if isinstance(row, Mapping) else {}
            extra_info = fields.get("extra_info")
            calls.append({"data_source": fields.get("data_source"), "solution_str": message_text(completion),
                          "ground_truth": truth, "extra_info": {} if extra_info is None else extra_info})
        if self.batch:
            results = self.fn(**{key + "s": [call[key] for call in calls] for key in VERL_KEYWORDS})
            return self._awaited_batch(results, log_extra) if inspect.isawaitable(results) else \
                self._scores(results, log_extra)
        results = [self.fn(**call) for call in calls]
        if any(inspect.isawaitable(result) for result in results):
            return self._awaited(results, log_extra)
        return self._scores(results, log_extra)

    async def _awaited_batch(self, results: Any, log_extra: Any) -> Any:
        return self._scores(await results, log_extra)

    async def _awaited(self, results: list[Any], log_extra: Any) -> list[Any]:
        async def value(result: Any) -> Any:
            return await result if inspect.isawaitable(result) else result

        return self._scores(list(await asyncio.gather(*map(value, results))), log_extra)

    def _scores(self, results: list[Any], log_extra: Any) -> list[Any]:
        """Each result's score; a dict's other keys logged as columns, None where a result lacks one. A batch
        function's return that is no list (None, a tensor) is left to ``score_rewards``' check of the values."""
        if not isinstance(results, (list, tuple)):
            return results
        extras: dict[str, list[Any]] = {}
        scores = []
        for i, result in enumerate(results):
            if not isinstance(result, Mapping):
                scores.append(result)
                continue
            if "score" not in result:
                # raised inside the call: score_rewards names the function and the prompt
                raise ValueError(f"it returned {shown_value(dict(result), 200)}; a verl reward function returns a "
                                 "number or a dict with the number under 'score'")
            scores.append(result["score"])
            for key, value in result.items():
                if key != "score":
                    extras.setdefault(key, [None] * len(results))[i] = value
        if log_extra is not None:
            for key, values in extras.items():
                log_extra(key, values)
        return scores

    def check_rows(self, examples: Sequence[Any], source: str) -> None:
        """Refuse prompts (``PromptExample``) one of which has no ground truth, naming it and its fields; said
        before the model loads, where a call would raise only after the first rollout."""
        for index, example in enumerate(examples):
            if not ground_truth(example.entry, example.answer)[0]:
                fields = sorted(example.entry) if isinstance(example.entry, Mapping) else []
                raise ValueError(f"reward function {self.__name__!r} is {SIGNATURE}: it needs each row's "
                                 "reward_model.ground_truth (verl's layout) or a gold answer (data.answer_column); "
                                 f"row {index} of {source} has neither (its fields: {fields})")
