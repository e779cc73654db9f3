"""One rank's error ends every rank, and each rank's output says which rank failed first and why.

Under several processes a rank that raises leaves the others inside, or on their way to, a collective that needs
it. ``lit-grpo`` ends such a rank at once (:func:`end_failed_rank`, after its traceback), and the ranks it started
itself (Lightning's launcher starts a node's other ranks as its children) with it. An ordinary interpreter exit
would first run exit handlers and join threads, which can wait on the broken collectives. Over gloo the closed
connections make every other rank's pending or next collective fail, and that rank ends the same way; NCCL may
notice a peer's end only at its timeout, so every rank also watches for the others' failures
(:func:`watch_failures`, a thread; ``lit_grpo.callbacks.RankFailureWatch`` starts it) and ends itself within a
second of one.

Outside ``lit-grpo`` (a Lightning project of its own), ``RankFailureWatch`` ends a failing rank the same way from
Lightning's ``on_exception`` (:func:`is_failure` says which errors); under ``lit-grpo`` it leaves that to the CLI's
error path (:func:`ended_by_caller`), which picks each error's output and exit status.

Before it ends, a rank records its error in the key-value store every rank joined at start (``MASTER_ADDR``,
``MASTER_PORT``), numbered by the store's atomic counter: record 1 is the first failure, and a rank that ends
after it names it as the cause. Where the store ended with the failed rank (Lightning's own launchers run it in
rank 0's process), a rank says that its connection to the others broke, and the failed rank's output has the error.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import NoReturn

import torch

#: How long a failing rank waits for the store (to connect, or for the record of a rank named as the cause).
STORE_TIMEOUT_S = 5.0
#: How often :func:`watch_failures` asks the store whether a rank has failed.
WATCH_INTERVAL_S = 1.0

_ending = threading.Event()  # this process is ending on its own error: its watch stands down
_caller_ends = False  # inside ended_by_caller()


@contextlib.contextmanager
def ended_by_caller() -> Iterator[None]:
    """Inside, the caller records a failed rank's error and ends the rank itself (``lit-grpo``'s main, after
    Lightning's own handling, with an output and exit status per kind of error): ``RankFailureWatch`` only
    watches, so no error is recorded twice."""
    global _caller_ends
    outer, _caller_ends = _caller_ends, True
    try:
        yield
    finally:
        _caller_ends = outer


def caller_ends_failed_ranks() -> bool:
    """Whether this process runs inside :func:`ended_by_caller`."""
    return _caller_ends


def is_failure(error: BaseException) -> bool:
    """Whether ``error`` is this rank's own failure, to record for the others before the rank ends: not a stop
    (``KeyboardInterrupt``, ``SystemExit`` and its ``StopRequested``: not an ``Exception``, as ``lit-grpo`` treats
    them), nor an error every rank raises by agreement (``RaisedOnEveryRank``), nor another rank's failure seen
    here (``RankFailed``, whose rank recorded it)."""
    from lit_grpo.runtime.distributed import RaisedOnEveryRank, RankFailed

    return isinstance(error, Exception) and not isinstance(error, (RaisedOnEveryRank, RankFailed))


def describe(error: BaseException) -> str:
    """``Type: message``, the message's first 500 characters on one line."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message[:500]}" if message else type(error).__name__


def end_failed_rank(error: BaseException, exit_status: int = 1, show_traceback: bool = True) -> NoReturn:
    """Print ``error``'s traceback (unless not ``show_traceback``: a bad setting, said already) and a line naming
    this rank and the run's first failure, end the processes this one started, then this one with ``exit_status``
    (``os._exit``: no exit handler or thread join can wait on the other ranks). For a process of a group of several
    ranks; the group must be initialized."""
    from lit_grpo.runtime.distributed import RaisedOnEveryRank

    _ending.set()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if show_traceback:
        traceback.print_exception(error)
    first = (rank, describe(error)) if isinstance(error, RaisedOnEveryRank) else _record_failure(rank, error)
    if first is None:
        line = (f"rank {rank} of {world} stopped on {describe(error)} (the run's store is gone: a rank that "
                "failed first ended with it; that rank's output names its error)")
    elif first[0] == rank:
        line = f"rank {rank} of {world} failed: {first[1]}; every rank stops"
    else:
        cause = first[1] or "its output names the error"
        line = f"rank {rank} of {world} stopped because rank {first[0]} failed: {cause}"
    _end(line, exit_status)


def _end(line: str, exit_status: int = 1) -> NoReturn:
    print(f"lit-grpo: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    _end_child_processes()
    os._exit(exit_status)


def _end_child_processes() -> None:
    """SIGKILL every process this one started (the node's other ranks under Lightning's launcher, compile workers):
    a rank waiting in a collective that never completes would outlive the run."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with accelerate, a dependency
        return
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


def _prefix() -> str:
    # torchrun's store outlives a restarted attempt's ranks: keep each attempt's records apart
    return f"lit_grpo/failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _connect_store() -> torch.distributed.TCPStore:
    """A client of the store every rank joined; raises where it is gone (at once: a plain connection is refused
    first, where a store client would retry for seconds)."""
    address = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    socket.create_connection(address, timeout=STORE_TIMEOUT_S).close()
    return torch.distributed.TCPStore(*address, is_master=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))


def _first_failure(store: torch.distributed.TCPStore) -> tuple[int, str]:
    """``(rank, description)`` of the run's first recorded failure (waits for it up to the store's timeout)."""
    prefix = _prefix()
    first = int(store.get(f"{prefix}1").decode())
    return first, store.get(f"{prefix}rank/{first}").decode()


def _record_failure(rank: int, error: BaseException) -> tuple[int, str | None] | None:
    """Record this rank's error in the run's store; return ``(rank, description)`` of the failure that came first
    (this one, another rank's, or the one a ``RankFailed`` names: its description None where its record did not
    come), or None where the store cannot be reached."""
    from lit_grpo.runtime.distributed import RankFailed

    try:
        store, prefix = _connect_store(), _prefix()
        if isinstance(error, RankFailed):  # it names the rank that failed, whose record may still be on its way
            try:
                return error.ranks[0], store.get(f"{prefix}rank/{error.ranks[0]}").decode()
            except Exception:
                return error.ranks[0], None
        order = store.add(prefix + "count", 1)  # its place among the failures, taken before a rank can read it
        store.set(f"{prefix}rank/{rank}", describe(error))
        if order == 1:  # the first: no answer needed (a rank that read this record may end the store with it)
            with contextlib.suppress(Exception):
                store.set(f"{prefix}1", str(rank))
            return rank, describe(error)
        return _first_failure(store)
    except Exception:  # the store went with a failed rank, or never existed: nothing to name but this error
        return None


def watch_failures(rank: int, world: int, interval_s: float = WATCH_INTERVAL_S) -> threading.Event:
    """Start a daemon thread that ends this process, naming the cause, once another rank has recorded a failure in
    the run's store: a rank waiting in a collective that will never complete (NCCL's, whose peer has ended), or
    computing alone for long, does not outlive the run. Call it once the process group is up (every rank has joined
    the store); set the returned event to stop the watch before the run ends on its own."""
    stop = threading.Event()

    def watch() -> None:
        try:
            store = _connect_store()
        except Exception:  # no store to watch: the collectives tell the ranks instead
            return
        count = _prefix() + "count"
        while not stop.wait(interval_s):
            try:
                if not store.check([count]):
                    continue
                first = _first_failure(store)
            except torch.distributed.DistStoreError:  # a failure counted, its record not there yet: ask again
                continue
            except Exception:  # the store is gone with its rank: the collectives tell this one
                return
            if _ending.is_set() or stop.is_set() or first[0] == rank:
                return  # this rank is ending on its own error, or the run on its own
            _end(f"rank {rank} of {world} stopped because rank {first[0]} failed: {first[1]}")

    threading.Thread(target=watch, name="lit-grpo-failure-watch", daemon=True).start()
    return stop
