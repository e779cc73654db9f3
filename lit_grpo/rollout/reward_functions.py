"""The built-in reward functions (names usable in configs), each following the protocol of ``lit_grpo.rollout.rewards``.

- ``accuracy`` (``accuracy_reward``): the answer extracted from the completion, scored by the reasoning-gym
  dataset's own ``score_answer``, or by normalized exact match for other sources;
- ``format`` (``format_reward``): 1 when the completion has exactly one ``<answer>...</answer>``;
- ``overlong`` (``OverlongPenalty``): DAPO's soft length penalty;
- ``char_fraction`` (``char_fraction_reward``): share of characters from a set, a toy signal for smoke tests;
- ``math`` (``math_reward``, in ``lit_grpo/rollout/math_reward.py``): the final answer (``<answer>``, ``\\boxed{}``,
  else the last math span or number) verified against the gold answer with math-verify, under a deadline per
  completion;
- ``reward_model`` (``RewardModel``, in ``lit_grpo/rollout/reward_model.py``): a trained sequence-classification
  reward model's score of the prompt and completion.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

from lit_grpo.rollout.math_reward import ANSWER_TAG, DECIMAL, SIGN, gold_answer, gold_text, math_reward
from lit_grpo.rollout.prompts import message_text
from lit_grpo.rollout.reward_model import RewardModel
from lit_grpo.runtime.validation import check_int, shown_setting


# --------------------------------------------------------------------------------------------- answer extraction
#: A number: the math reward's sign and digits (no fraction or percent).
_NUMBER = re.compile(SIGN + DECIMAL + "|" + SIGN + r"\.\d+")


def _number(text: str) -> str | None:
    """The value of ``text`` written as one number ("1,000", "1 000", "- 5", "\u22125", "2.50") in one exact
    spelling (plain digits, no leading or trailing zeros: "1000", "-5", "2.5"), else None: a list such as "1,2,3"
    or "2 3" is not one number. Digits, not a float: a float keeps 17 significant digits and takes 309 or more for
    inf, so other numbers would read as the same."""
    text = re.sub(r"^([-\u2212])\s+", r"\1", text.strip())
    text = re.sub(r"(?<=\d) (?=\d{3}\b)", ",", text)  # a space as a thousands separator
    if _NUMBER.fullmatch(text) is None:
        return None
    text = text.replace(",", "").replace("\u2212", "-")
    whole, _, fraction = text.lstrip("-").partition(".")
    digits = (whole.lstrip("0") or "0") + ("." + fraction.rstrip("0") if fraction.rstrip("0") else "")
    return "-" + digits if text.startswith("-") and digits != "0" else digits


def _is_number(text: str) -> bool:
    return _number(text) is not None


def extract_answer(completion: str, numeric: bool = False) -> str | None:
    """The final answer a completion states.

    Order: the last ``<answer>...</answer>``; else, when ``numeric``, the last number (commas dropped, a trailing
    ``.`` dropped); else the last non-empty line. ``None`` when nothing is found.
    """
    tags = ANSWER_TAG.findall(completion)
    if tags:
        return tags[-1].strip()
    if numeric:
        numbers_found = _NUMBER.findall(completion)
        return numbers_found[-1].replace(",", "").replace("\u2212", "-") if numbers_found else None
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def _normalize(text: str) -> str:
    text = text.strip().rstrip(".").strip()
    number = _number(text)
    if number is not None:
        return number
    return re.sub(r"\s*,\s*", ",", " ".join(text.lower().split()))  # "2, 3" is "2,3"


@functools.lru_cache(maxsize=None)
def _reasoning_gym_scorer(dataset_name: str) -> Callable[[str | None, dict], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset_name)


def reasoning_gym_source(entry: Mapping[str, Any] | None) -> str | None:
    """The reasoning-gym dataset that scores ``entry`` (``entry["metadata"]["source_dataset"]``), or None."""
    if isinstance(entry, Mapping) and isinstance(entry.get("metadata"), Mapping):
        return entry["metadata"].get("source_dataset") or None
    return None


def score_answer(answer: str | None, gold: Any, entry: Mapping[str, Any] | None = None) -> float | None:
    """Score one extracted answer: 1 correct, 0 wrong (reasoning-gym tasks may give partial credit).

    A reasoning-gym entry (``entry["metadata"]["source_dataset"]``) is scored by that dataset's own
    ``score_answer(answer, entry)``. Anything else: normalized exact match with ``gold`` as text (``gold_text``: a
    dataset's number too; numbers compared digit for digit, "2.50" as "2.5", text case- and space-insensitively).
    ``None`` when there is no gold answer (no opinion).
    """
    source = reasoning_gym_source(entry)
    if source:
        return float(_reasoning_gym_scorer(source)(answer, dict(entry)))
    if gold is None:
        return None
    if answer is None:
        return 0.0
    return 1.0 if _normalize(answer) == _normalize(gold_text(gold)) else 0.0


# --------------------------------------------------------------------------------------------- built-in rewards
def accuracy_reward(
    prompts: list[str], completions: list[str], answer: list[Any] | None = None,
    entry: list[Mapping[str, Any] | None] | None = None, **columns: Any
) -> list[float | None]:
    """Correctness of the final answer in ``[0, 1]``, against the gold answer as text (it comes as the row holds it,
    e.g. an int); ``None`` for rows with neither gold answer (a blank one counts as none, as for ``math``) nor
    dataset entry."""
    answers = answer if answer is not None else [None] * len(completions)
    entries = entry if entry is not None else [None] * len(completions)
    out: list[float | None] = []
    for completion, gold, row in zip(map(message_text, completions), answers, entries):
        gold = gold_answer(gold, row)
        if gold is None and not (isinstance(row, Mapping) and row.get("metadata")):
            out.append(None)
            continue
        numeric = gold is not None and _is_number(gold_text(gold))
        out.append(score_answer(extract_answer(completion, numeric=numeric), gold, row))
    return out


def format_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """1.0 when the completion holds exactly one non-empty ``<answer>...</answer>``, else 0.0."""
    return [1.0 if len(tags := ANSWER_TAG.findall(c)) == 1 and tags[0].strip() else 0.0
            for c in map(message_text, completions)]


class OverlongPenalty:
    """DAPO's soft overlong punishment, with ``L`` the completion length in tokens (the ``completion_length`` column:
    with tool calling the appended tool messages count, as TRL's soft overlong punishment counts its
    ``completion_ids``)::

        0                                   if L <= max_length - buffer
        ((max_length - buffer) - L) / buffer  if max_length - buffer < L <= max_length   (0 down to -1)
        -1                                  if L > max_length

    Args:
        max_length: the length cap; ``None`` uses the rollout's ``max_new_tokens`` column (so a truncated
            completion gets -1).
        buffer: the soft zone's width in tokens (DAPO: 4096 of 20480); must be >= 1.
    """

    def __init__(self, max_length: int | None = None, buffer: int = 64):
        self.buffer = check_int("OverlongPenalty buffer", buffer, 1, hint="tokens")
        self.max_length = check_int("OverlongPenalty max_length", max_length, 1, hint="tokens", none=True)
        self.__name__ = "overlong"

    def __call__(self, prompts: list[str], completions: list[str], completion_length: list[int] | None = None,
                 max_new_tokens: list[int] | None = None, **columns: Any) -> list[float]:
        if completion_length is None:
            raise ValueError("OverlongPenalty needs the completion_length column (token counts)")
        out = []
        for i, length in enumerate(completion_length):
            cap = self.max_length if self.max_length is not None else (max_new_tokens[i] if max_new_tokens else None)
            if cap is None:
                raise ValueError("OverlongPenalty(max_length=None) needs the max_new_tokens column")
            buffer = min(self.buffer, cap)
            if length <= cap - buffer:
                out.append(0.0)
            elif length <= cap:
                out.append(((cap - buffer) - length) / buffer)
            else:
                out.append(-1.0)
        return out


def char_fraction_reward(prompts: list[str], completions: list[str], chars: str = "0123456789",
                         **columns: Any) -> list[float]:
    """Share of the completion's characters that are in ``chars`` (0.0 for an empty completion).

    A toy shaping signal for smoke tests: even a random model's completions get different values, so advantages
    and gradients are non-zero (configs/tiny.yaml uses it).
    """
    return [sum(ch in chars for ch in c) / len(c) if c else 0.0 for c in map(message_text, completions)]


def check_char_fraction_options(chars: str = "0123456789") -> None:
    """Raise, naming the value, unless ``chars`` is a non-empty string: a number failed in the first call, and no
    characters scored every completion 0, a reward without signal."""
    if not isinstance(chars, str) or not chars:
        raise ValueError(f"char_fraction reward {shown_setting('chars', chars)} must be a non-empty string (the "
                         "characters counted)")


#: Called by ``build_reward_funcs`` with a config's options: a bad value fails when the config is read.
char_fraction_reward.check_options = check_char_fraction_options


BUILTIN_REWARDS: dict[str, Callable[..., Any]] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "overlong": OverlongPenalty,  # a class: built with the spec's kwargs
    "char_fraction": char_fraction_reward,
    "math": math_reward,  # kwargs: timeout_s
    "reward_model": RewardModel,  # a class: kwargs model, dtype, device, batch_size
}
