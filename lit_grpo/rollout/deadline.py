"""``call_with_deadline``: run a pure-Python computation for at most a given time (a SIGALRM timer).

Why a signal and not a thread or a process: a thread cannot be stopped, and forking a process that holds torch's
thread pools per call is slow and can deadlock. A signal interrupts the computation between two bytecodes, which is
where symbolic math (sympy under math-verify) spends its time, even inside one huge integer power. The price:
signals reach the main thread only, so off the main thread this raises instead of running without a limit.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from lit_grpo.runtime.validation import real_within, shown_setting

T = TypeVar("T")

#: The longest deadline the timer takes, in seconds (about 292 years): setitimer counts it in 64-bit nanoseconds, as
#: threading's waits do, and raises OverflowError beyond.
MAX_DEADLINE_S = threading.TIMEOUT_MAX


def deadline_seconds(value: object) -> float | None:
    """``value`` as a plain float if the timer takes it as a deadline (``deadline_range``), else None."""
    return real_within(value, 0, MAX_DEADLINE_S, low_open=True)


def deadline_range() -> str:
    """The deadlines the timer takes, as a refusal says them: ``> 0 and <= MAX_DEADLINE_S (...)``."""
    return (f"> 0 and <= {MAX_DEADLINE_S:.0f} (about {MAX_DEADLINE_S / (365.25 * 86400):.0f} years, the longest "
            "deadline the timer takes)")


class DeadlineExceeded(BaseException):
    """The computation ran past its deadline. A ``BaseException``, so that code under the deadline which catches
    ``Exception`` broadly (math-verify, sympy) cannot swallow it."""


def call_with_deadline(fn: Callable[[], T], seconds: float) -> T:
    """``fn()``, or ``DeadlineExceeded`` once ``seconds`` (> 0, at most ``MAX_DEADLINE_S``) have passed.

    A timer already running (an outer deadline, a test runner's timeout) is restored afterwards with the time it
    had left, and the previous SIGALRM handler is put back.
    """
    given, seconds = seconds, deadline_seconds(seconds)
    if seconds is None:
        raise ValueError(f"{shown_setting('seconds', given)} must be a number {deadline_range()}")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("call_with_deadline needs the main thread (the deadline is a SIGALRM timer, which only "
                           "the main thread receives); call it from the main thread or run without a deadline")

    def expire(signum, frame):
        raise DeadlineExceeded(f"still running after {seconds} s")

    previous_handler = signal.signal(signal.SIGALRM, expire)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if outer_delay > 0:  # the outer timer keeps its own deadline (fires at once if it passed meanwhile)
            left = max(outer_delay - (time.monotonic() - started), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)
