"""A stop asked for by SIGTERM or Ctrl-C (SIGINT), honoured where the run's state is consistent.

Owns: this process's stop request (which signal came, if any, and to which rank), the handlers that record it, and
the run's stop in the key-value store its ranks share. Signals are a process-wide resource, so there is one
:data:`STOP_SIGNAL`; :class:`~lit_grpo.callbacks.RunCheckpoint` installs its handlers for the training loop and
decides where the run stops.

A handler only records the signal, except inside :meth:`StopSignal.abandonable`: code there (a training step's
rollout, which changes nothing that its caller cannot roll back) is interrupted at once with
:class:`StopRequested`. A second signal raises ``KeyboardInterrupt`` wherever the run is: the user asked twice. One
within ``COPY_WINDOW_S`` of the first is a copy of it (a launcher forwarding what its workers received already).

Under several processes a rank may abandon only code with no collective inside, and every rank must then learn of
it at one point they all reach: :meth:`StopSignal.abandonable_together` (a training rollout: ranks decode different
lengths, so they cannot agree per decode step without a collective each step) ends with one collective that says
whether any rank abandoned; if one did, every rank raises an agreed :class:`StopRequested`, after which the ranks are
at the same point and may save together.

A signal may reach one rank only (``docker stop`` and Kubernetes send it to the container's first process, ``kill``
to one process id: Lightning's launcher's, rank 0): the ranks pass it on through the key-value store every rank
joined, in :meth:`StopSignal.relay`, which the failure watch's thread (``lit_grpo.runtime.rank_failure``'s
``watch_failures``) calls once a poll, so not in the signal handler. A rank says its own signal there, the first
rank to say one being the run's; every other rank records a peer stop (:meth:`StopSignal.record_peer_stop`) and,
where its main thread is inside abandonable code, interrupts it there as its own signal would, so the ranks meet
after their rollouts within about two polls. Never by signals: a forwarded one on top of a scheduler's own would
count as a second one and stop that rank unsaved; a peer stop is no signal of this process, so its own first signal
after one is still a first.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

HANDLED = (signal.SIGTERM, signal.SIGINT)
#: A signal this soon after the process's first is a copy of it, not a second request: torchrun forwards to its
#: workers the Ctrl-C (or the scheduler's SIGTERM) that the terminal (or scheduler) sent them already, at once.
COPY_WINDOW_S = 1.0


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
    """The stop request of this process (``signum``, None until a signal came to it or to another rank: ``peer``,
    that rank, or None) and its handlers."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.peer: int | None = None
        self._received: int | None = None  # the signal this process received itself (a second one stops at once)
        self._received_at = 0.0  # when (``_now``): a signal within COPY_WINDOW_S of it is a copy
        self._shared = False  # this process's own signal is said in the run's store (relay)
        self._peer_interrupt = False  # the next call of the handler is record_peer_stop's interrupt, no signal
        self._abandonable = False
        self._previous: dict[int, Any] = {}
        self._runs = 0  # the runs that installed the handlers in this process: one stop key in the store per run

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        """Handle SIGTERM and SIGINT (main thread only; elsewhere Python allows no handlers) until ``restore``;
        installed already, the handlers stay and so does a stop they have received."""
        if self._previous or not _main_thread():
            return
        self._forget()
        self._runs += 1
        for signum in HANDLED:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Put back the handlers that ``install`` replaced, and forget the request (it was this run's)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self._forget()

    def _forget(self) -> None:
        self.signum = self.peer = self._received = None
        self._shared = self._peer_interrupt = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._peer_interrupt:  # record_peer_stop's interrupt (the stop is recorded): no signal of this process's
            self._peer_interrupt = False
            if self._abandonable and self.signum is not None:
                self._abandonable = False  # closed as it raises, as for a signal (below)
                raise StopRequested(self.signum)
            return
        if self._received is not None:
            if _now() - self._received_at < COPY_WINDOW_S:
                return
            raise KeyboardInterrupt(f"second stop signal ({signal.Signals(signum).name}): stopping now")
        self._received, self._received_at = signum, _now()
        if self.signum is None:
            self.signum = signum
        print(f"\nlit_grpo: {signal.Signals(signum).name} received: saving the last completed step and stopping "
              "(send it again to stop at once, without saving)", file=sys.stderr, flush=True)
        if self._abandonable:
            # closed here: a handler may run between the scope's flag and its try, or in its finally before the
            # reset, and this raise would then skip the reset (the next fit's first signal raised mid-update)
            self._abandonable = False
            raise StopRequested(self.signum)

    def record_peer_stop(self, rank: int, signum: int) -> None:
        """Record a stop that ``signum`` asked of rank ``rank`` (another rank of this run; called from a thread
        other than the main one, :meth:`relay`): this process stops as if it had received the signal, but a signal
        it receives itself after this counts as its first, not a second one. Where its main thread is inside
        abandonable code, it is interrupted there (``_thread.interrupt_main``: its handler runs, as for a signal,
        and raises :class:`StopRequested`). Nothing where a stop is recorded already, or no handler is installed."""
        if self.signum is not None or not self._previous:
            return
        self.signum, self.peer = int(signum), int(rank)
        print(f"\nlit_grpo: a stop from rank {rank} ({signal.Signals(signum).name} came to it): saving the last "
              "completed step and stopping", file=sys.stderr, flush=True)
        if self._abandonable:
            # the handler learns it is this interrupt from the flag; should a signal of signum come meanwhile,
            # the two are one call of the handler, which counts it as this one
            self._peer_interrupt = True
            _thread.interrupt_main(self.signum)

    def relay(self, store: Any, rank: int) -> None:
        """One exchange with the run's key-value store ``store`` (a ``torch.distributed.Store`` every rank joined;
        this process is rank ``rank``), from a thread that polls it: say this process's own signal there, the first
        time it is seen (the first rank to say one is the run's), or record the stop that another rank said
        (:meth:`record_peer_stop`). Nothing while no handler is installed (no run listens for stops); raises what
        the store raises (gone: the caller's watch decides)."""
        if not self._previous:
            return
        key = self._store_key()
        if self._received is not None and not self._shared:
            store.compare_set(key, "", f"{rank} {self._received}")
            self._shared = True
        elif self.signum is None and store.check([key]):
            self.record_peer_stop(*map(int, store.get(key).decode().split()))

    def _store_key(self) -> str:
        # the run's stop in the store: per torchrun attempt (its agent's store outlives an attempt's ranks) and per
        # run of this process (every rank runs its fits in the same order, so the count matches on every rank)
        return f"lit_grpo/stop/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{self._runs}"

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


def _now() -> float:
    return time.monotonic()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


#: This process's stop request (signals belong to the process, so there is one).
STOP_SIGNAL = StopSignal()
