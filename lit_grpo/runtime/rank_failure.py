"""One rank's error ends every rank, and each rank's output says which rank failed first and why.

Under several processes a rank that raises leaves the others inside, or on their way to, a collective that needs
it. ``lit-grpo`` ends such a rank at once (:func:`end_failed_rank`, after its traceback): its process group's
connections close, so every other rank's pending or next collective fails, and that rank ends the same way. An
ordinary interpreter exit would first run exit handlers and join threads, which can wait on the broken collectives.

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
import traceback
from typing import NoReturn

import torch

#: How long a failing rank waits for the store (to connect, or for the record of a rank named as the cause).
STORE_TIMEOUT_S = 5.0


def describe(error: BaseException) -> str:
    """``Type: message``, the message's first 500 characters on one line."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message[:500]}" if message else type(error).__name__


def end_failed_rank(error: BaseException) -> NoReturn:
    """Print ``error``'s traceback and a line naming this rank and the run's first failure, then end this process
    with exit status 1 (``os._exit``: no exit handler or thread join can wait on the other ranks). For a process
    of a group of several ranks; the group must be initialized."""
    from lit_grpo.runtime.distributed import RaisedOnEveryRank

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    traceback.print_exception(error)
    first = (rank, describe(error)) if isinstance(error, RaisedOnEveryRank) else _record_failure(rank, error)
    if first is None:
        line = (f"rank {rank} of {world} stopped on {describe(error)} (the run's store is gone: a rank that "
                "failed first ended with it; that rank's output names its error)")
    elif first[0] == rank:
        line = f"rank {rank} of {world} failed: {first[1]}; every rank stops"
    else:
        line = f"rank {rank} of {world} stopped because rank {first[0]} failed: {first[1]}"
    print(f"lit-grpo: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def _record_failure(rank: int, error: BaseException) -> tuple[int, str] | None:
    """Record this rank's error in the run's store; return ``(rank, description)`` of the failure that came first
    (this one, another rank's, or the one a ``RankFailed`` names), or None where the store cannot be reached."""
    from lit_grpo.runtime.distributed import RankFailed

    try:
        address = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # a plain connection first: refused at once where the store is gone (a store client retries for seconds)
        socket.create_connection(address, timeout=STORE_TIMEOUT_S).close()
        store = torch.distributed.TCPStore(*address, is_master=False,
                                           timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        # torchrun's store outlives a restarted attempt's ranks: keep each attempt's records apart
        prefix = f"lit_grpo/failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        if isinstance(error, RankFailed):  # it names the rank that failed, whose record may still be on its way
            return error.ranks[0], store.get(f"{prefix}rank/{error.ranks[0]}").decode()
        order = store.add(prefix + "count", 1)  # its place among the failures, taken before a rank can read it
        store.set(f"{prefix}rank/{rank}", describe(error))
        if order == 1:  # the first: no answer needed (a rank that read this record may end the store with it)
            with contextlib.suppress(Exception):
                store.set(f"{prefix}1", str(rank))
            return rank, describe(error)
        store.set(f"{prefix}{order}", str(rank))
        first = int(store.get(f"{prefix}1").decode())
        return first, store.get(f"{prefix}rank/{first}").decode()
    except Exception:  # the store went with a failed rank, or never existed: nothing to name but this error
        return None
