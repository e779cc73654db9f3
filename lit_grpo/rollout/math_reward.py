"""The ``math`` reward: the completion's final answer verified against the gold answer with math-verify.

``math_reward`` follows the reward protocol of ``lit_grpo.rollout.rewards`` (name ``math`` in configs). For each
completion:

1. :func:`extract_final_answer` finds the answer the completion commits to: the last ``<answer>...</answer>``
   (the format lit_grpo's prompts ask for; a ``\\boxed{}`` inside it is unwrapped), else the last ``\\boxed{...}``
   (braces balanced, so ``\\boxed{\\frac{1}{2}}`` is whole), else the text's last statement: its last LaTeX math
   span (``$...$``, ``$$...$$``, ``\\(...\\)``, ``\\[...\\]``) unless a number follows it, else its last number (a
   sign, thousands separators, decimals, a ``/`` or bare ``\\frac{a}{b}`` fraction and a ``%`` kept). The tag wins
   over a box because a model reasoning in LaTeX boxes intermediate results, while the tag is its declared final
   answer.
2. Gold and answer are parsed by Hugging Face's math-verify as LaTeX (``$...$``) and as plain expressions, and
   compared by ``math_verify.verify``: equivalent fractions and decimals, LaTeX forms, thousands separators,
   percentages (``50\\%`` equals 0.5 and 50), signs, sets (order-free) and intervals (open and closed ends
   distinct). A gold answer of plain words, which math-verify would read as a product of one-letter symbols
   (matching any anagram: "on" would equal "no"), or one it cannot parse, is compared as normalized text.
3. Parsing and verifying one completion run under a deadline (``timeout_s``, :func:`lit_grpo.rollout.deadline.
   call_with_deadline`); a completion that runs past it (``\\boxed{9^{9^{9^{9}}}}`` would take hours) scores 0
   and a warning names it. math-verify's own timeouts are whole-second ``signal.alarm`` calls that would replace
   this deadline's timer, so they are turned off and this one deadline covers both steps.

Values: 1.0 correct, 0.0 wrong or no answer found, ``None`` (no opinion) for rows without a gold answer.
"""

from __future__ import annotations

import decimal
import functools
import logging
import re
import warnings
from collections.abc import Mapping
from typing import Any

from lit_grpo.rollout.deadline import DeadlineExceeded, call_with_deadline, deadline_range, deadline_seconds
from lit_grpo.rollout.prompts import message_text
from lit_grpo.runtime.validation import shown_setting, shown_value

#: The answer a completion commits to, in the format lit_grpo's prompts ask for.
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
#: A sign: a minus (ASCII or Unicode) not right after a word or a number ("10-20" is a range, not -20).
SIGN = r"(?:(?<![\w.)])[-\u2212])?"
#: Digits with thousands separators in groups of three, or none, and decimals (no sign).
DECIMAL = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
#: A number as written in an answer: sign, thousands separators or plain digits, decimals, a fraction, a percent.
_NUMBER = re.compile(SIGN + r"\\d?frac\s*\{-?\d+\}\s*\{\d+\}"
                     r"|" + SIGN + DECIMAL + r"(?:\s*/\s*\d+)?\s*\\?%?|" + SIGN + r"\.\d+")
#: A gold answer of plain words (two letters or more each) ...
_WORDS = re.compile(r"[A-Za-z]{2,}(?:[\s'-]+[A-Za-z]+)*\.?")
#: ... unless it is a constant math-verify reads as one.
_MATH_WORDS = frozenset({"infinity", "inf", "oo"})
#: A LaTeX math span: ``$$...$$``, ``$...$``, ``\(...\)`` or ``\[...\]`` (one group each).
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)

DEFAULT_TIMEOUT_S = 5.0


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or ``\fbox{...}``) in ``text``, braces balanced; None if none is
    closed."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def extract_final_answer(completion: str) -> str | None:
    """The final answer of a completion (module docstring, step 1); None when it states none."""
    tags = ANSWER_TAG.findall(completion)
    if tags:
        content = tags[-1].strip()
        boxed = last_boxed(content)
        return boxed if boxed is not None else (content or None)
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed or None
    return _last_statement(completion)


def _last_statement(text: str) -> str | None:
    """The last math span of ``text`` unless a number follows it, else that number; None when neither exists."""
    spans = [match for match in _MATH_SPAN.finditer(text) if next(g for g in match.groups() if g is not None).strip()]
    numbers = list(_NUMBER.finditer(text))
    if spans and not (numbers and numbers[-1].start() >= spans[-1].end()):
        return next(group for group in spans[-1].groups() if group is not None).strip()
    return numbers[-1].group().strip() if numbers else None


class _DropTimeoutDisabledNotice(logging.Filter):
    """math-verify warns once that its own timeouts are off; here the deadline covers them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in str(record.msg)


@functools.lru_cache(maxsize=1)
def _math_verify():
    """The math-verify module and its extraction configs (imported once, on first use)."""
    try:
        import math_verify
    except ImportError as err:  # a core dependency; only a broken install gets here
        raise ImportError("the 'math' reward needs math-verify: pip install 'math-verify>=0.9'") from err
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutDisabledNotice())
    return math_verify, [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()]


def parse_math(text: str) -> list:
    """math-verify's parse of ``text`` as LaTeX math, then as written; ``[]`` when neither finds an expression.
    No deadline of its own: call it under :func:`call_with_deadline`."""
    math_verify, configs = _math_verify()
    parsed = math_verify.parse(f"${text}$", configs, parsing_timeout=None)
    return parsed or math_verify.parse(text, configs, parsing_timeout=None)


def _normalized_text(text: str) -> str:
    return " ".join(text.strip().rstrip(".").lower().split())


def answers_match(answer: str, gold: str) -> bool:
    """Whether ``answer`` is mathematically the ``gold`` answer (module docstring, step 2). No deadline."""
    math_verify, _ = _math_verify()
    words = _WORDS.fullmatch(gold.strip()) and _normalized_text(gold) not in _MATH_WORDS
    gold_parsed = [] if words else parse_math(gold)
    if not gold_parsed:
        return _normalized_text(answer) == _normalized_text(gold)
    answer_parsed = parse_math(answer)
    return bool(answer_parsed) and math_verify.verify(gold_parsed, answer_parsed, timeout_seconds=None)


def score_math(completion: str, gold: Any, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> float | None:
    """1.0 / 0.0 for one completion against ``gold`` (as ``gold_text``); None without a gold answer; 0.0 past
    ``timeout_s`` (None: no deadline, for callers off the main thread)."""
    gold = None if gold is None else gold_text(gold)
    if gold is None or not gold.strip():
        return None
    answer = extract_final_answer(completion)
    if answer is None:
        return 0.0
    answer = answer.replace("\u2212", "-")  # a Unicode minus, which math-verify does not read
    check = lambda: answers_match(answer, gold)  # noqa: E731
    try:
        return 1.0 if (call_with_deadline(check, timeout_s) if timeout_s is not None else check()) else 0.0
    except DeadlineExceeded:
        warnings.warn(f"math reward: verifying answer {answer!r:.120} against {gold!r:.60} ran past "
                      f"timeout_s={timeout_s}; scored 0", stacklevel=2)
        return 0.0


def math_reward(prompts: list[str], completions: list[str], answer: list[Any] | None = None,
                entry: list[Mapping[str, Any] | None] | None = None, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                **columns: Any) -> list[float | None]:
    """Math-verified correctness of each completion's final answer (module docstring).

    The gold answer is the ``answer`` column, else the row's ``answer`` field, read as text (a number too);
    ``timeout_s``: the deadline per completion in seconds (> 0), or None for none.
    """
    check_math_options(timeout_s)
    answers = answer if answer is not None else [None] * len(completions)
    entries = entry if entry is not None else [None] * len(completions)
    out: list[float | None] = []
    for completion, gold, row in zip(map(message_text, completions), answers, entries):
        gold = gold_answer(gold, row)
        out.append(score_math(completion, None if gold is None else gold_text(gold), timeout_s))
    return out


def gold_answer(answer: Any, row: Mapping[str, Any] | None) -> Any:
    """A completion's gold answer: its ``answer`` column, else its row's ``answer`` field; None where neither has
    one, or it is blank (the correctness rewards and ``rewards.check_gold_answers`` read it alike)."""
    gold = answer if answer is not None else (row.get("answer") if isinstance(row, Mapping) else None)
    return None if gold is None or not gold_text(gold).strip() else gold


def gold_text(gold: Any) -> str:
    """A gold answer as the text it is compared as: ``str(gold)``, an int by its digits however many (``str()``
    refuses one of more than ``sys.get_int_max_str_digits()``; a row from Python can hold one, and scoring it must
    give a reward, not end the step), in a list, tuple, dict or set too (``_spelled``); a ValueError naming the
    gold answer where it has no such text (another object holding such an int)."""
    try:
        return str(gold)
    except ValueError as error:
        try:
            return _spelled(gold, frozenset())
        except ValueError:
            pass
        raise ValueError(f"math reward: the gold answer {shown_value(gold)} has no text to compare: str() of it "
                         f"raised {type(error).__name__}: {error}; give the gold answer as text") from None


def _spelled(value: Any, inside: frozenset[int]) -> str:
    """``repr(value)`` as ``str()`` of a container spells an item, an int by its digits however many, in a list,
    tuple, dict, set or frozenset too (one met again inside itself as ``[...]``, as repr shows it: ``inside``, the
    ids of those around it); a ValueError where another type's repr raises."""
    kind = type(value)
    if id(value) in inside:  # only a list or a dict can hold itself
        return "[...]" if kind is list else "{...}"
    try:
        return repr(value)
    except ValueError:
        if isinstance(value, int):  # exact, and not bound by the limit
            return format(decimal.Decimal(int(value)), "f")
        if kind not in (list, tuple, dict, set, frozenset):
            raise
    inside = inside | {id(value)}
    if kind is dict:
        return "{" + ", ".join(f"{_spelled(key, inside)}: {_spelled(item, inside)}"
                               for key, item in value.items()) + "}"
    items = ", ".join(_spelled(item, inside) for item in value)
    if kind is list:
        return f"[{items}]"
    if kind is tuple:
        return f"({items},)" if len(value) == 1 else f"({items})"
    return f"{{{items}}}" if kind is set else f"frozenset({{{items}}})"


def check_math_options(timeout_s: float | None = DEFAULT_TIMEOUT_S) -> None:
    """Raise, naming the value, unless ``timeout_s`` is a finite number of seconds > 0, at most the timer's longest
    (``deadline.MAX_DEADLINE_S``), or None (no deadline: the timer takes no infinite one)."""
    if timeout_s is not None and deadline_seconds(timeout_s) is None:
        raise ValueError(f"math reward {shown_setting('timeout_s', timeout_s)} must be a finite number of seconds "
                         f"{deadline_range()}, or None (no deadline)")


#: Called by ``build_reward_funcs`` with a config's options: a bad value fails when the config is read.
math_reward.check_options = check_math_options
