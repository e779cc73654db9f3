"""The argument checks shared across lit_grpo (lit_grpo.runtime.validation)."""

from __future__ import annotations

import dataclasses
import math
import re
import sys

import numpy as np
import pytest
import yaml

from lit_grpo.rollout import reward_log
from lit_grpo.rollout.math_reward import check_math_options
from lit_grpo.rollout.reward_functions import OverlongPenalty
from lit_grpo.rollout.slot_memory import check_max_prompt_length
from lit_grpo.runtime.validation import (check_bool, check_choice, check_field, check_folder, check_int,
                                         check_int_in_range, check_real, check_state_keys, check_text, huge_int,
                                         integer_within, plain_yaml_values, real_within, settings_from, shown_setting,
                                         shown_value)
from lit_grpo.sampling import SamplingConfig
from lit_grpo.scheduling.least_attained import preemption_points
from lit_grpo.update.lr_schedule import is_share, warmup_steps_count


@pytest.mark.parametrize("value", [np.int64(3), np.int32(3), np.uint8(3), 3])
def test_an_integer_check_takes_numpy_integers_as_plain_ints(value):
    # a setting computed with numpy, or read through it, is an integer as much as Python's 3
    for checked in (check_int("n", value, 1), check_int_in_range("n", value, 1, 5)):
        assert checked == 3 and type(checked) is int


@pytest.mark.parametrize("value", [True, np.bool_(True), 1.0, np.float64(1.0), "1", None])
def test_an_integer_check_refuses_what_is_not_an_integer(value):
    with pytest.raises(ValueError, match=r"^n=.* must be an integer >= 0 \(a count\)$"):
        check_int("n", value, 0, hint="a count")
    with pytest.raises(ValueError, match=r"^n=.* is not allowed; n must be an integer >= 0 and <= 5$"):
        check_int_in_range("n", value, 0, 5)


def test_an_integer_check_names_the_bound_a_numpy_integer_breaks():
    with pytest.raises(ValueError, match=rf"^n={re.escape(repr(np.int64(0)))} must be an integer >= 1$"):
        check_int("n", np.int64(0), 1)
    with pytest.raises(ValueError, match=r"^n=.*6.* is not allowed; n must be an integer >= 1 and <= 5$"):
        check_int_in_range("n", np.int64(6), 1, 5)


@pytest.mark.parametrize("minimum, maximum, allowed", [(None, 5, "an integer <= 5"), (1, None, "an integer >= 1"),
                                                       (None, None, "an integer")])
def test_an_integer_range_check_says_the_bounds_it_has(minimum, maximum, allowed):
    with pytest.raises(ValueError, match=rf"^n=6.5 is not allowed; n must be {allowed}$"):
        check_int_in_range("n", 6.5, minimum, maximum)


@dataclasses.dataclass(frozen=True)
class _Settings:
    count: int = 1
    share: float = 0.5

    def __post_init__(self) -> None:
        check_field(self, "count", check_int, 1, prefix="group.")
        check_field(self, "share", check_real, low=0, high=1)


def test_a_checked_field_keeps_the_plain_number_its_check_returns():
    # a frozen config's numpy numbers become the plain numbers its owner stores and a checkpoint saves
    settings = _Settings(count=np.int64(3), share=np.float32(0.25))
    assert (settings.count, settings.share) == (3, 0.25)
    assert (type(settings.count), type(settings.share)) == (int, float)
    with pytest.raises(ValueError, match=r"^group.count=0 must be an integer >= 1$"):  # named by its key
        _Settings(count=0)


@pytest.mark.parametrize("value", [np.float32(0.25), np.float64(0.25), 0.25])
def test_a_real_check_takes_numpy_numbers_as_plain_floats(value):
    for checked in (check_real("x", value, 0, 1), real_within(value, 0, 1)):
        assert checked == 0.25 and type(checked) is float
    assert real_within(np.int64(2), 0) == 2.0 and type(real_within(np.int64(2), 0)) is float


@pytest.mark.parametrize("value", [True, np.bool_(True), "1", None, float("nan"), np.float32("inf"), 10**400, 2.0])
def test_a_real_check_refuses_what_is_not_a_finite_number_within_its_bounds(value):
    assert real_within(value, 0, 1) is None
    with pytest.raises(ValueError, match=r"^x=.* is not allowed; x must be a finite number >= 0 and <= 1$"):
        check_real("x", value, 0, 1)
    assert integer_within(True) is None and integer_within(np.int64(3), 0, 5) == 3


def test_a_real_check_says_its_hint_after_the_bounds_it_has():
    # a setting's own meaning (what a value disables) said with the bounds the check words from its numbers
    with pytest.raises(ValueError, match=r"^x=1.0 is not allowed; x must be a finite number >= 0 and < 1 "
                                         r"\(0 disables it\)$"):
        check_real("x", 1.0, 0, 1, high_open=True, hint="0 disables it")
    assert check_real("x", 0, 0, 1, high_open=True, hint="0 disables it") == 0.0


def test_a_real_check_may_take_none_and_infinity():
    assert check_real("x", None, 0, none=True) is None
    assert check_real("x", np.float32("inf"), 0, finite=False) == math.inf
    assert real_within(-math.inf, finite=False) == -math.inf and real_within(math.inf, 0, 1, finite=False) is None
    with pytest.raises(ValueError, match=r"^x=None is not allowed; x must be a finite number > 0$"):
        check_real("x", None, 0, low_open=True)
    with pytest.raises(ValueError, match=r"^x=nan is not allowed; x must be a number > 0 \(a cap\) or None "
                                         r"\(no cap\)$"):  # NaN is no number of any bound, infinite or not
        check_real("x", math.nan, 0, low_open=True, hint="a cap", none="no cap", finite=False)


def test_a_checks_refusal_names_an_int_too_long_to_print_by_its_digits():
    """Python refuses to print an int of more than sys.get_int_max_str_digits() digits (4300): a refusal printing
    the value with repr raised that ValueError in place of its own. An int past float range is named by its count
    of digits, a value holding one too long to print by its type."""
    huge, limit = 10**5000, sys.get_int_max_str_digits()
    with pytest.raises(ValueError, match=r"^x=\(an int of 5001 digits\) is not allowed; x must be a finite number "
                                         r">= 0 and <= 1$"):
        check_real("x", huge, 0, 1)
    with pytest.raises(ValueError, match=r"^n=\(a negative int of 5001 digits\) must be an integer >= 1$"):
        check_int("n", -huge, 1)
    with pytest.raises(ValueError, match=r"^n=\(an int of 5001 digits\) is not allowed; n must be an integer >= 1 "
                                         r"and <= 5$"):
        check_int_in_range("n", huge, 1, 5)
    with pytest.raises(ValueError, match=rf"^x=a list holding an int of more than {limit} digits is not allowed; x "
                                         r"must be a finite number$"):
        check_real("x", [huge])
    for check, said in ((lambda v: check_bool("b", v), "must be True or False"),
                        (lambda v: check_text("t", v), "must be a non-empty string"),
                        (lambda v: check_folder("f", v, "none"), "must be a folder's path or None"),
                        (lambda v: check_choice("c", v, ("a",)), r"is not known; use one of \['a'\]")):
        with pytest.raises(ValueError, match=rf"=\(an int of 5001 digits\) {said}"):
            check(huge)
    with pytest.raises(ValueError, match=rf"^x={re.escape(repr([0] * 1000)[:100])} is not allowed"):  # cut short
        check_real("x", [0] * 1000)


def test_an_int_past_float_range_is_said_by_its_digits():
    assert [huge_int(v) for v in (10**400, 10**400 - 1, -10**5000, 10**300, 3, True, 1e308)] == [
        "an int of 401 digits", "an int of 400 digits", "a negative int of 5001 digits", None, None, None, None]
    assert shown_value("x" * 200) == repr("x" * 200)[:100] and shown_value(10**400) == "an int of 401 digits"
    assert reward_log.shown_value is shown_value  # one implementation, the reward log's too


def test_a_setting_is_shown_as_the_checks_refusals_start():
    """``name=value``: the value as shown_value shows it, cut to the width; an int past float range in parentheses,
    where its words would run into the refusal's."""
    limit = sys.get_int_max_str_digits()
    assert shown_setting("n", 10**5000) == "n=(an int of 5001 digits)"
    assert shown_setting("n", -10**400) == "n=(a negative int of 401 digits)"
    assert shown_setting("x", [10**5000]) == f"x=a list holding an int of more than {limit} digits"

    class Opaque(list):  # a type whose name takes "an"
        pass
    assert shown_setting("x", Opaque([10**5000])) == f"x=an Opaque holding an int of more than {limit} digits"
    assert shown_setting("x", "y" * 200) == "x=" + repr("y" * 200)[:100]
    assert shown_setting("x", "y" * 200, 80) == "x=" + repr("y" * 200)[:80]
    assert shown_setting("x", 10**300) == f"x={10**300!r}"[:102] and shown_setting("b", True) == "b=True"


def test_unknown_keys_are_listed_as_shown_values_in_their_order():
    """A state's or a settings mapping's unknown keys are listed as before (by their text, each as its repr), an int
    too long to print by its digits and a long key cut: sorting by str() failed with Python's int-to-str ValueError,
    and a long key ran on."""
    with pytest.raises(ValueError, match=r"^a state has unknown keys \[1, 'b', 'c'\]; it holds a$"):
        check_state_keys("a state", {"a": 0, "c": 0, 1: 0, "b": 0}, ("a",))
    with pytest.raises(ValueError, match=r"^a state has unknown keys \[an int of 5001 digits\]; it holds a$"):
        check_state_keys("a state", {"a": 0, 10**5000: 0}, ("a",))
    with pytest.raises(ValueError, match=rf"^a state has unknown keys \[{re.escape(repr('k' * 500)[:100])}\]; it "):
        check_state_keys("a state", {"a": 0, "k" * 500: 0}, ("a",))
    with pytest.raises(ValueError, match=r"^unknown sampling options \[an int of 5001 digits, 'x'\]; allowed: "):
        settings_from("sampling", {"x": 1, 10**5000: 2}, SamplingConfig)


def test_an_integer_check_may_take_none():
    assert check_int("n", None, 1, none=True) is None
    with pytest.raises(ValueError, match=r"^n=0 must be an integer >= 1 \(tokens\) or None$"):
        check_int("n", 0, 1, hint="tokens", none=True)
    with pytest.raises(ValueError, match=r"^n=None must be an integer >= 1$"):
        check_int("n", None, 1)


def test_an_integer_check_may_say_what_none_means():
    assert check_int("n", None, 1, none="no cap") is None
    assert check_int("n", np.int64(2), 1, none="no cap") == 2
    with pytest.raises(ValueError, match=r"^n=0 must be an integer >= 1 \(tokens\) or None \(no cap\)$"):
        check_int("n", 0, 1, hint="tokens", none="no cap")


def test_the_settings_own_number_checks_take_numpy_numbers():
    # each setting checked by a rule of its own takes a number computed with numpy (np.float32, numpy integers),
    # as the shared checks do, and keeps it as the plain number it is
    sampling = SamplingConfig(temperature=np.float32(0.5), top_p=np.float32(0.75), min_p=np.int64(0),
                              repetition_penalty=np.int64(1))
    assert [getattr(sampling, name) for name in ("temperature", "top_p", "min_p", "repetition_penalty")] == \
        [0.5, 0.75, 0.0, 1.0]
    assert {type(getattr(sampling, name)) for name in ("temperature", "top_p", "min_p", "repetition_penalty")} == \
        {float}
    penalty = OverlongPenalty(max_length=np.int64(100), buffer=np.int32(10))
    assert (penalty.max_length, penalty.buffer) == (100, 10) and type(penalty.max_length) is type(penalty.buffer) is int
    check_math_options(np.float32(2.0))
    check_max_prompt_length(SamplingConfig(micro_group_size="auto"), np.int64(12))
    assert preemption_points(np.int64(8), 64) == preemption_points(8, 64)
    assert is_share(np.float32(0.5)) and warmup_steps_count(np.float32(10.0)) == 10
    assert type(warmup_steps_count(np.float32(10.0))) is int


def _module_level_reward(prompts, completions, **columns):
    return [0.0] * len(completions)


class _Rewards:
    @staticmethod
    def nested(prompts, completions, **columns):
        return [0.0] * len(completions)


def test_plain_yaml_values_name_functions_and_paths_and_mark_what_no_name_imports():
    """A function or class by the name a config gives it, where it imports; a lambda, a local function, one no
    name finds, or another callable object by a marker that says so, with no address in it (the same function saved
    twice reads the same); a path as its text; a reward (WeightedReward) as the spec that builds it again; another
    dataclass as a dict of its fields. The value given keeps them."""
    import functools
    from pathlib import Path

    from lit_grpo.rollout.rewards import WeightedReward

    def local(prompts, completions, **columns):
        return [0.0] * len(completions)

    here = f"{__name__}:test_plain_yaml_values_name_functions_and_paths_and_mark_what_no_name_imports.<locals>"
    given = {"funcs": [_module_level_reward, OverlongPenalty, len, local, lambda prompts, completions: [],
                       _Rewards.nested, functools.partial(_module_level_reward), OverlongPenalty(8, 2)],
             "path": Path("/data/prompts.jsonl"), "reward": WeightedReward(_module_level_reward, 2.0, "zeros"),
             "settings": _Settings(count=2, share=np.float64(0.25))}
    plain = plain_yaml_values(given)
    assert plain == {
        "funcs": [f"{__name__}:_module_level_reward", "lit_grpo.rollout.reward_functions:OverlongPenalty",
                  "builtins:len", f"<not importable (a local function): {here}.local>",
                  f"<not importable (a lambda): {here}.<lambda>>",
                  f"<not importable (not found by that name in its module): {__name__}:_Rewards.nested>",
                  "<not importable (an instance of functools:partial)>",
                  "<not importable (an instance of lit_grpo.rollout.reward_functions:OverlongPenalty)>"],
        "path": "/data/prompts.jsonl", "reward": {"name": f"{__name__}:_module_level_reward", "weight": 2.0,
                                                  "log_name": "zeros"},
        "settings": {"count": 2, "share": 0.25}}
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain
    assert given["funcs"][0] is _module_level_reward and isinstance(given["path"], Path)


def test_an_int_beyond_float_range_is_said_by_its_exact_count_of_digits():
    # math.log10 of a huge int rounds either way: below k at some powers of ten (10**512, 10**1024), above at 10**k - 1
    for k in (309, 400, 512, 1024, 2048, 4096, 5000):
        assert huge_int(10**k) == f"an int of {k + 1} digits"
        assert huge_int(-10**k) == f"a negative int of {k + 1} digits"
        assert huge_int(10**k - 1) == f"an int of {k} digits"
    assert huge_int(10**308) is None and huge_int(1.0) is None and huge_int(True) is None


def test_plain_yaml_values_are_what_yaml_safe_load_reads_back():
    """Tuples (at any depth, in lists and mappings) as lists, numpy values as plain ones, mappings as dicts: what
    yaml.safe_dump writes and yaml.safe_load reads back equal (either refuses a tuple or a numpy scalar). The value
    given keeps its tuples."""
    given = {"betas": (np.float64(0.9), 0.99), "pairs": [(0, np.int64(1)), (1, 2)], "none": (),
             np.str_("nested"): {"stop": ("\n\n",), "on": np.bool_(True)}}
    plain = plain_yaml_values(given)
    assert plain == {"betas": [0.9, 0.99], "pairs": [[0, 1], [1, 2]], "none": [], "nested": {"stop": ["\n\n"],
                                                                                            "on": True}}
    assert type(plain["betas"]) is list and type(plain["pairs"][0]) is list and type(plain["nested"]["on"]) is bool
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain
    assert given["betas"] == (0.9, 0.99) and type(given["betas"]) is tuple and type(given["pairs"][0]) is tuple
