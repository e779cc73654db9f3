"""The argument checks shared across lit_grpo (lit_grpo.runtime.validation)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from lit_grpo.runtime.validation import check_field, check_int, check_int_in_range, check_real


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
