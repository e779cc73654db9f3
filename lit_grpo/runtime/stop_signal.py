"""A stop asked for by SIGTERM or Ctrl-C (SIGINT), honoured where the run's state is consistent.

Owns: this process's stop request (which signal came, if any) and the handlers that record it. Signals are a
process-wide resource, so there is one :data:`STOP_SIGNAL`; :class:`~lit_grpo.callbacks.RunCheckpoint` installs
its handlers for the training loop and decides where the run stops.

A handler only records the signal, except inside :meth:`StopSignal.abandonable`: code there (a training step's
rollout, which changes nothing that its caller cannot roll back) is interrupted at once with
:class:`StopRequested`. A second signal raises ``KeyboardInterrupt`` wherever the run is: the user asked twice.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopRequested(SystemExit):
    """Stops a run that a signal asked to stop. Its exit code is 128 + the signal's number (the shell's
    convention: 143 for SIGTERM, 130 for Ctrl-C), so a job scheduler sees a run that did not finish."""

    def __init__(self, signum: int):
        super().__init__(128 + int(signum))
        self.signum = int(signum)

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
        self._abandonable = True
        try:
            yield
        finally:
            self._abandonable = False


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


#: This process's stop request (signals belong to the process, so there is one).
STOP_SIGNAL = StopSignal()
