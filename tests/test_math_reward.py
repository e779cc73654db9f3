"""The ``math`` reward: answer extraction, math-verify's equivalences (a table of tricky cases), the deadline."""

import re
import signal
import threading
import time

import pytest

from lit_grpo.rollout.deadline import MAX_DEADLINE_S, DeadlineExceeded, call_with_deadline
from lit_grpo.rollout.math_reward import extract_final_answer, last_boxed, math_reward, score_math
from lit_grpo.rollout.rewards import build_reward_funcs, score_rewards

# (completion, gold answer, expected verdict): 1.0 correct, 0.0 wrong.
CASES = [
    # fractions, decimals and their LaTeX forms
    (r"So the answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{0.50}", r"\frac{1}{2}", 1.0),
    (r"\boxed{2/4}", "1/2", 1.0),
    (r"\boxed{\tfrac{6}{8}}", r"\frac{3}{4}", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    (r"\boxed{0.3333333}", r"\frac{1}{3}", 1.0),
    (r"\boxed{0.33}", r"\frac{1}{3}", 0.0),
    (r"\boxed{\frac{22}{7}}", r"\pi", 0.0),
    (r"\boxed{1.5}", r"\frac{3}{2}", 1.0),
    (r"\boxed{1\frac{1}{2}}", "1.5", 1.0),  # a mixed number
    (r"\boxed{2\frac{1}{2}}", "2", 0.0),
    # thousands separators
    (r"\boxed{1,000}", "1000", 1.0),
    ("The total is 12,345,678 dollars.", "12345678", 1.0),
    (r"<answer>1000</answer>", "1,000", 1.0),
    ("We get 1,234.5 in the end", "1234.5", 1.0),
    # percentages
    (r"\boxed{50\%}", "0.5", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    ("The discount is 25%", "0.25", 1.0),
    (r"\boxed{40\%}", "0.5", 0.0),
    # signs
    (r"\boxed{-3}", "-3", 1.0),
    (r"\boxed{-3}", "3", 0.0),
    ("the temperature falls to -7", "-7", 1.0),
    ("the temperature falls to \u22127.", "-7", 1.0),  # a Unicode minus
    ("the temperature falls to \u22127.", "7", 0.0),
    ("it is on pages 10-20", "20", 1.0),  # a range, not -20
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    (r"\boxed{\frac{-1}{2}}", r"-\frac{1}{2}", 1.0),
    # sets and intervals
    (r"\boxed{\{1, 2, 3\}}", r"\{3, 2, 1\}", 1.0),
    (r"\boxed{\{1, 2\}}", r"\{1, 2, 3\}", 0.0),
    (r"\boxed{[1, 2)}", "[1, 2)", 1.0),
    (r"\boxed{(1, 2]}", "[1, 2)", 0.0),
    (r"\boxed{(-\infty, 0)}", r"(-\infty, 0)", 1.0),
    (r"\boxed{[0, \infty)}", r"(0, \infty)", 0.0),
    # radicals, powers, symbolic forms
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0),
    (r"\boxed{2^{10}}", "1024", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{3.14}", r"\pi", 0.0),
    (r"\boxed{2x + 2}", "2(x+1)", 1.0),
    # where the final answer is taken from
    (r"First \boxed{3}, then correcting myself: \boxed{4}", "4", 1.0),
    (r"First \boxed{3}, then correcting myself: \boxed{4}", "3", 0.0),
    (r"I boxed \boxed{7} while thinking. <answer>8</answer>", "8", 1.0),
    (r"<answer>\boxed{\frac{5}{10}}</answer>", "0.5", 1.0),
    ("<answer>12</answer> and later I mention 99", "12", 1.0),
    ("2 + 3 = 5, then 5 * 4 = 20", "20", 1.0),
    ("2 + 3 = 5, then 5 * 4 = 20", "5", 0.0),
    ("I do not know.", "4", 0.0),
    ("", "4", 0.0),
    (r"\boxed{}", "4", 0.0),
    (r"\boxed{\frac{1}{2}", "0.5", 1.0),  # an unclosed box is no box, but its fraction is the last statement
    # without a tag or a box: the last math span, unless a number follows it
    (r"\frac{9}{2}", r"\frac{9}{2}", 1.0),
    (r"Half of 9 is $\frac{9}{2}$.", "4.5", 1.0),
    (r"The sum is \(\frac{1}{4}\)", "0.25", 1.0),
    (r"so $x = 2$ and \[y = \dfrac{9}{2}\]", "4.5", 1.0),
    (r"We have $x = 3$, so the answer is 7", "7", 1.0),
    (r"We have $x = 3$, so the answer is 7", "3", 0.0),
    ("It costs $5 and then $10 more", "10", 1.0),
    # text answers that math-verify cannot parse: normalized text
    ("<answer>Paris</answer>", "paris", 1.0),
    ("<answer>London</answer>", "Paris", 0.0),
    # plain words, which math-verify reads as products of letters: text, not anagrams
    ("<answer>on</answer>", "no", 0.0),
    ("<answer>pots</answer>", "stop", 0.0),
    ("<answer>Yes</answer>", "yes.", 1.0),
    ("<answer>New York</answer>", "new  york", 1.0),
    (r"<answer>\infty</answer>", "infinity", 1.0),  # a constant math-verify reads as one
]


@pytest.mark.parametrize(("completion", "gold", "expected"), CASES)
def test_math_reward_table(completion, gold, expected):
    assert math_reward([""], [completion], answer=[gold]) == [expected]


def test_the_table_is_big_and_balanced():
    assert len(CASES) >= 40
    assert 10 <= sum(verdict == 0.0 for _, _, verdict in CASES) <= len(CASES) - 10


@pytest.mark.parametrize(("text", "expected"), [
    (r"a \boxed{\frac{1}{2}} b", r"\frac{1}{2}"),
    (r"\boxed{1} \fbox{2}", "2"),
    (r"\boxed {\{1, \{2\}\}}", r"\{1, \{2\}\}"),
    (r"\boxed{1} \boxed{2", "1"),  # the last closed box
    ("no box", None),
])
def test_last_boxed_balances_braces(text, expected):
    assert last_boxed(text) == expected


def test_extract_final_answer_order():
    assert extract_final_answer(r"\boxed{1} <answer> 2 </answer>") == "2"
    assert extract_final_answer(r"<answer></answer>") is None
    assert extract_final_answer("costs 1,250.75 in total.") == "1,250.75"
    assert extract_final_answer("x is 3/4") == "3/4"
    assert extract_final_answer("nothing here") is None
    assert extract_final_answer(r"so $x = 2$, i.e. $$\frac{1}{2}$$") == r"\frac{1}{2}"
    assert extract_final_answer(r"$x = 2$, then 5") == "5"
    assert extract_final_answer(r"is -\frac{3}{4}.") == r"-\frac{3}{4}"
    assert extract_final_answer(r"$ $ and 3") == "3"  # an empty span is no statement
    assert extract_final_answer(r"<answer>so \boxed{5}</answer>") == "5"  # a box inside the tag is unwrapped


def test_math_reward_gold_from_the_row_and_no_opinion_without_gold():
    values = math_reward(["p"] * 3, [r"\boxed{2}", r"\boxed{2}", r"\boxed{2}"], answer=[None, None, "3"],
                         entry=[{"answer": "2"}, {"question": "q"}, {"answer": "2"}])
    assert values == [1.0, None, 0.0]  # the answer column wins over the row's field
    assert score_math("<answer>5</answer>", "  ") is None  # a blank gold answer is none


def test_a_gold_answer_of_an_int_too_long_to_print_is_scored_by_its_digits():
    """A gold answer that is an int of more digits than Python prints (str() raises ValueError past
    sys.get_int_max_str_digits(), 4300 by default) is compared as its digits: the math and accuracy rewards score
    it, 1.0 for those digits and 0.0 for another answer, from the answer column or the row; str() failed inside the
    reward instead, ending the run's step."""
    from lit_grpo.rollout.math_reward import gold_answer
    from lit_grpo.rollout.reward_functions import accuracy_reward

    gold = 10**5000 + 7
    digits = "1" + "0" * 4999 + "7"  # its digits, written without str()
    completions = [f"<answer>{digits}</answer>", "<answer>5</answer>"]
    assert gold_answer(gold, None) is gold and gold_answer(None, {"answer": gold}) is gold
    for reward in (math_reward, accuracy_reward):
        assert reward(["p", "p"], completions, answer=[gold, gold]) == [1.0, 0.0], reward
        assert reward(["p", "p"], completions, entry=[{"answer": gold}] * 2) == [1.0, 0.0], reward
    assert score_math(completions[0], gold) == 1.0


def _printed(value):
    """``str(value)`` with Python's limit on an int's digits lifted for the call: the text it would print."""
    import sys

    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return str(value)
    finally:
        sys.set_int_max_str_digits(limit)


def test_a_gold_answer_holding_an_int_too_long_to_print_is_scored_or_refused_by_name():
    """A gold answer that is a container holding an int of more digits than Python prints is the text str() would
    give it, that int by its digits, and scored; one with no such text is refused, named as the shared checks show
    a value. str()'s ValueError got out of the reward in place of either."""
    from lit_grpo.rollout.math_reward import gold_answer, gold_text
    from lit_grpo.rollout.reward_functions import accuracy_reward

    huge = 10**5000 + 7
    looped = [huge]
    looped.append(looped)
    for gold in ([1, huge], (huge,), {"a": [huge, "b"], huge: None}, {huge}, frozenset({huge}), looped,
                 [[huge], ((2, huge), {}, set(), frozenset(), ())]):
        assert gold_text(gold) == _printed(gold), type(gold)
    gold = [1, huge]
    completions = [f"<answer>{_printed(gold)}</answer>", "<answer>5</answer>"]
    assert gold_answer(gold, None) is gold and gold_answer(None, {"answer": gold}) is gold
    for reward in (math_reward, accuracy_reward):
        assert reward(["p", "p"], completions, answer=[gold, gold]) == [1.0, 0.0], reward

    class Gold:  # its text is an int's, too long to print: nothing to compare it as
        def __str__(self):
            return str(huge)

        def __repr__(self):
            return f"Gold({huge})"

    for gold in (Gold(), [Gold()]):
        with pytest.raises(ValueError, match=r"^math reward: the gold answer a (Gold|list) holding an int of "
                                             r"more than \d+ digits has no text to compare: str\(\) of it raised "
                                             r"ValueError: .*; give the gold answer as text$"):
            math_reward(["p"], ["<answer>5</answer>"], answer=[gold])


def test_math_is_a_builtin_usable_by_name():
    rewards = build_reward_funcs([{"name": "math", "kwargs": {"timeout_s": 2}}])
    assert rewards[0].name == "math"
    scores = score_rewards(rewards, ["p", "p"], [r"\boxed{\frac{1}{2}}", "1"], {"answer": ["0.5", "0.5"]},
                           group_size=2)
    assert scores.total.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="timeout_s=0"):
        math_reward(["p"], ["1"], answer=["1"], timeout_s=0)
    # no deadline is None: an infinite one is refused (no timer takes it), saying the number must be finite
    with pytest.raises(ValueError, match=r"timeout_s=inf must be a finite number of seconds > 0 and <= .*, or None "
                                         r"\(no deadline\)"):
        math_reward(["p"], ["1"], answer=["1"], timeout_s=float("inf"))


def test_a_deadline_longer_than_the_timer_takes_is_refused_naming_the_longest():
    # a huge finite deadline overflowed the timer (setitimer's OverflowError) once a completion was scored: refused
    # with the range, when the options are read, not clamped to no deadline (None says that)
    longest = f"{MAX_DEADLINE_S:.0f}"
    assert call_with_deadline(lambda: 42, MAX_DEADLINE_S) == 42
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert math_reward(["p"], [r"\boxed{1}"], answer=["1"], timeout_s=MAX_DEADLINE_S) == [1.0]
    for seconds in (MAX_DEADLINE_S * (1 + 1e-9), 1e300, float("inf"), True):
        with pytest.raises(ValueError, match=rf"^seconds={re.escape(repr(seconds))} must be a number > 0 and <= "
                                             rf"{longest} \(about \d+ years, the longest deadline the timer takes\)$"):
            call_with_deadline(lambda: 1, seconds)
    refusal = (r"^math reward timeout_s=1e\+300 must be a finite number of seconds > 0 and <= "
               rf"{longest} \(about \d+ years, the longest deadline the timer takes\), or None \(no deadline\)$")
    with pytest.raises(ValueError, match=refusal):
        math_reward(["p"], ["1"], answer=["1"], timeout_s=1e300)
    with pytest.raises(ValueError, match=refusal):  # by the config's options, before any completion
        build_reward_funcs([{"name": "math", "kwargs": {"timeout_s": 1e300}}])
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed in place of the refusal
    with pytest.raises(ValueError, match=r"^seconds=\(an int of 5001 digits\) must be a number > 0 and <= "):
        call_with_deadline(lambda: 1, 10**5000)
    with pytest.raises(ValueError, match=r"^math reward timeout_s=\(an int of 5001 digits\) must be a finite number "):
        build_reward_funcs([{"name": "math", "kwargs": {"timeout_s": 10**5000}}])


def test_a_pathological_answer_scores_zero_within_the_deadline():
    """9^(9^(9^9)) is a single enormous integer power for sympy: without the deadline this never returns."""
    started = time.monotonic()
    with pytest.warns(UserWarning, match="ran past timeout_s=0.5"):
        value = score_math(r"\boxed{9^{9^{9^{9}}}}", "1", timeout_s=0.5)
    assert value == 0.0
    assert time.monotonic() - started < 3.0
    assert score_math(r"\boxed{1}", "1", timeout_s=0.5) == 1.0  # the next call is unaffected


def test_deadline_restores_an_outer_timer_and_handler():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        assert call_with_deadline(lambda: 42, 1.0) == 42
        with pytest.raises(DeadlineExceeded):
            call_with_deadline(lambda: time.sleep(5), 0.2)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < left <= 30.0
        assert not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_deadline_off_the_main_thread_is_an_error():
    errors = []
    worker = threading.Thread(target=lambda: errors.append(_error_of(lambda: call_with_deadline(lambda: 1, 1.0))))
    worker.start()
    worker.join()
    assert "needs the main thread" in errors[0]
    with pytest.raises(ValueError, match="seconds=0"):
        call_with_deadline(lambda: 1, 0)


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001
        return str(err)
    return ""
