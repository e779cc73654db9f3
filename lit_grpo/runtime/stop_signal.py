"""A stop asked for by SIGTERM or Ctrl-C (SIGINT), honoured where the run's state is consistent.

Owns: this process's stop request (which signal came, if any) and the handlers that record it. Signals are a
process-wide resource, so there is one :data:`STOP_SIGNAL`; :class:`~lit_grpo.callbacks.RunCheckpoint` installs
its handlers for the training loop and decides where the run stops.

A handler only records the signal, except inside :meth:`StopSignal.abandonable`: code there (a training step's
rollout, which changes nothing that its caller cannot roll back) is interrupted at once with
:class:`StopRequested`. A second signal raises ``KeyboardInterrupt`` wherever the run is: the user asked twice.

Under several processes a rank may abandon only code with no collective inside, and every rank must then learn of
it at one point they all reach: :meth:`StopSignal.abandonable_together` (a training rollout: ranks decode different
lengths, so they cannot agree per decode step without a collective each step) ends with one collective that says
whether any rank abandoned; if one did, every rank raises an agreed :class:`StopRequested`, after which the ranks are
at the same point and may save together.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopRequested(SystemExit):
    """Stops a run that a signal asked to stop. Its exit code is 128 + the signal's number (the shell's
    convention: 143 for SIGTERM, 130 for Ctrl-C), so a job scheduler sees a run that did not finish. ``agreed``:
    every rank of the run raised it at the same point (:meth:`StopSignal.abandonable_together`), so they may save
    together; a stop raised on one rank alone may not (a save runs collectives the others would not pair)."""

    def __init__(self, signum: int, agreed: bool = False):
        super().__init__(128 + int(signum))
        self.signum = int(signum)
        self.agreed = agreed

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class StopSignal:
    """The stop request of this process (``signum``, None until a signal came) and its handlers."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._abandonable = False
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        """Handle SIGTERM and SIGINT (main thread only; elsewhere Python allows no handlers) until ``restore``;
        installed already, the handlers stay and so does a stop they have received."""
        if self._previous or not _main_thread():
            return
        self.signum = None
        for signum in HANDLED:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Put back the handlers that ``install`` replaced, and forget the request (it was this run's)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self.signum = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second stop signal ({signal.Signals(signum).name}): stopping now")
        self.signum = signum
        print(f"\nlit_grpo: {signal.Signals(signum).name} received: saving the last completed step and stopping "
              "(send it again to stop at once, without saving)", file=sys.stderr, flush=True)
        if self._abandonable:
            raise StopRequested(signum)

    @contextlib.contextmanager
    def abandonable(self, enabled: bool = True) -> Iterator[None]:
        """Code that a stop may interrupt at once (its caller rolls its effects back on any exception). Raises
        :class:`StopRequested` on entry when a stop is already pending."""
        if not enabled:
            yield
            return
        if self.signum is not None:
            raise StopRequested(self.signum)
        outer, self._abandonable = self._abandonable, True
        try:
            yield
        finally:
            self._abandonable = outer

    @contextlib.contextmanager
    def abandonable_together(self, any_rank: Callable[[bool], bool]) -> Iterator[None]:
        """Code that a stop may interrupt at once on this rank alone (it must run no collective: the other ranks
        would wait in it), in a run of several ranks that all enter it. On leaving it, each rank calls
        ``any_rank(abandoned)``, a collective that every rank makes here once, whether its code finished or was
        abandoned, and that says whether any rank's was; if so every rank raises an agreed :class:`StopRequested`
        (its caller rolls its effects back, finished or not). A rank whose code finished before the stop thus
        waits only for the others to abandon theirs, and a stop that comes on a rank after its code finished is
        recorded only (the step goes on; the ranks agree at its end)."""
        abandoned = False
        try:
            with self.abandonable():
                yield
        except StopRequested:
            abandoned = True
        # outside the abandonable code: a signal during the collective is recorded, never raised inside it
        if any_rank(abandoned) or abandoned:
            raise StopRequested(self.signum or signal.SIGTERM, agreed=True) from None


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


#: This process's stop request (signals belong to the process, so there is one).
STOP_SIGNAL = StopSignal()
