"""One rank's error ends every rank, and each rank's output says which rank failed first and why.

Under several processes a rank that raises leaves the others inside, or on their way to, a collective that needs
it. ``lit-grpo`` ends such a rank at once (:func:`end_failed_rank`, after its traceback), and the ranks it started
itself (Lightning's launcher starts a node's other ranks as its children) with it. An ordinary interpreter exit
would first run exit handlers and join threads, which can wait on the broken collectives. Over gloo the closed
connections make every other rank's pending or next collective fail, and that rank ends the same way; NCCL may
notice a peer's end only at its timeout, so every rank also watches for the others' failures
(:func:`watch_failures`, a thread; ``lit_grpo.callbacks.RankFailureWatch`` starts it) and ends itself within a
second of one. The same poll passes a stop signal that reached one rank only to every rank
(``StopSignal.relay``, ``lit_grpo.runtime.stop_signal``).

Outside ``lit-grpo`` (a Lightning project of its own), ``RankFailureWatch`` records a failing rank's error from
Lightning's ``on_exception`` (:func:`is_failure` says which errors, :func:`record_failure`) and ends the rank the
same way once the error leaves the script (:func:`end_at_uncaught_error`), after Lightning's own handling; under
``lit-grpo`` it leaves both to the CLI's error path (:func:`ended_by_caller`), which picks each error's output and
exit status. Either way each failed rank says in the store, from ``on_exception``, that it goes on handling its
error (under ``lit-grpo``, :func:`say_handling`: its record comes as it ends), and every rank, whether it read a
record, was told of the failure (``RankFailed``) or failed too, waits before it ends until each rank that said so
is done, at most ``HANDLING_GRACE_S`` in all (:func:`_end`): on one node under Lightning's launcher the ranks end
together (rank 0 ends the ranks it started as it ends, and its process observer ends rank 0 once one of them has),
so two ranks failing at once each finish their handling. A rank told of the failure quotes the failed rank's
record where it comes within that same bound (under ``lit-grpo`` it comes as that handling ends); else its line
says that the failed rank's output names the error.

Before it ends, a rank records its error in the key-value store every rank joined at start (``MASTER_ADDR``,
``MASTER_PORT``), numbered by the store's atomic counter: record 1 is the first failure, and a rank that ends
after it names it as the cause (its rank, or a node's name for a node that failed before it knew its ranks). Where
rank 0's process runs the store (Lightning's own launchers; not torchrun's agent), it ends with rank 0: rank 0 keeps
it as it ends until every other rank has read the first failure, at most ``READ_WAIT_S`` (those ranks are still
connected to it, so their collectives do not fail meanwhile). A rank that had not read it by then (killed, or its
watch not running) says that its connection to the others broke, and the failed rank's output has the error.

A rank can also fail before the ranks connect (a model path that exists on one node only, or a config file): the
others would wait in the process group's setup until its timeout. Its place comes from its settings, or where they
cannot be read from its launcher's environment (:func:`launched_place`: torchrun's, SLURM's). Each rank watches from
before that setup (``GRPOCLI`` starts the watch as the run starts), and a rank failing there records its error
through :func:`end_unconnected_rank`: rank 0, which runs the store, starts it itself and keeps it until every rank
still to come has read the record (each says so in the store), within ``SETUP_WAIT_S``; any other rank records it in
rank 0's store, waiting for it as long (and so does rank 0 under torchrun, whose agent runs the store). A store rank
0 finds on its port is another run's: it is left alone. Under Lightning's own launcher rank 0 waits for the other
nodes only (one of each reading is enough): the ranks of its own node are its children, which it ends as it ends (on
one node it waits for none), and whose end, a SIGKILL's too, has its process observer end rank 0 within seconds. A
rank of another node, or under torchrun or SLURM any rank, killed (SIGKILL, the OOM killer) before it read the
record holds rank 0 the whole ``SETUP_WAIT_S``: nothing tells it from a late one. Under Lightning's own launcher of
several nodes the launcher's environment gives only the node (:func:`launched_node`): the process started on a node
records its error in rank 0's store as ``node N``'s, which every rank names (:func:`end_unread_node`). On a node
other than 0 it waits for that store ``SETUP_WAIT_S`` (nothing tells a run of one node given a leftover
``NODE_RANK`` from a node whose node 0 comes later) and says its node read it. Node 0's process, where rank 0 would
run the store, runs it itself and keeps it until every other node has read the record: each node that reads it says
the run's count of nodes, and while none has (a run of one node has no reader, and a node whose settings could not
be read knows no count), until ``UNKNOWN_NODES_WAIT_S`` passes after its start or the last read, at most
``SETUP_WAIT_S`` in all. Ctrl-C ends any of these waits at once, naming the error.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any, NoReturn

import torch

from lit_grpo.runtime.stop_signal import STOP_SIGNAL

#: How long a failing rank waits for the store (to connect, or for the record of a rank named as the cause).
STORE_TIMEOUT_S = 5.0
#: How long a store client's connect may take once a plain connection to the store's port was accepted: the store
#: may end (with rank 0's process) in between, and torch's client retries a refused port until its timeout, then
#: once more after a random delay about as long; a store that is there answers in milliseconds.
STORE_CONNECT_TIMEOUT_S = 1.0
#: How often :func:`watch_failures` asks the store whether a rank has failed (or received a stop signal).
WATCH_INTERVAL_S = 1.0
#: How long a rank that failed before the ranks connected waits for the others to read its record (rank 0, running
#: the store), or for rank 0's store to exist (any other rank): a rank still loading its model comes late. A rank
#: rank 0 waits for (another node's, under Lightning's launcher; any, under torchrun or SLURM) killed (SIGKILL)
#: before it read the record holds rank 0 that long: nothing tells it from a late one, since the store exists only
#: from rank 0's failure on (no rank could leave a sign of life in it before) and tells no count of its clients.
SETUP_WAIT_S = 300.0
#: How long node 0, failing before its settings were read under Lightning's launcher (:func:`end_unread_node`),
#: keeps the store it runs while no other node says the run's count of nodes: from its start, and from each read
#: of its record. The run may have one node (no reader comes); each other node's process watches the store from
#: its start (its settings read), so it reads the record within seconds of both starting.
UNKNOWN_NODES_WAIT_S = 30.0
#: How long rank 0, whose process runs the run's store (not torchrun's agent), keeps it as it ends, once a failure is
#: recorded there, for the other ranks to read that record: each rank's watch asks once a second, and a rank that
#: has not read it when the store ends can only name its broken connection.
READ_WAIT_S = 3.0
#: How long a rank waits in all, before it ends, for every failed rank that said it handles its error to finish
#: (``record_failure(..., handling=True)``, :func:`say_handling`: its later callbacks' ``on_exception``, its loggers'
#: last write), and for a record that comes as that handling ends: on one node under Lightning's launcher the ranks
#: end together, so an end at once would cut that handling short.
HANDLING_GRACE_S = 10.0

_ending = threading.Event()  # this process is ending on its own error: its watch stands down
_watches: set[threading.Event] = set()  # the stop events of this process's watches
_caller_ends = False  # inside ended_by_caller()
_handling: tuple[str, int] | None = None  # the store address where this rank said it handles its failure
_grace_end: float | None = None  # when this process's wait for the failed ranks' handling runs out (monotonic)


def _start_clean() -> None:
    """A forked child (a ``ddp_fork`` rank) starts with no watch and none of its parent's flags: the parent's watch
    thread does not run there (its ``RankFailureWatch`` starts its own), nor the CLI's error path (that callback
    ends a failing child), and a lock of the parent's may have been held at the fork: new objects, not cleared ones."""
    global _ending, _watches, _caller_ends, _handling, _grace_end
    _ending, _watches, _caller_ends, _handling, _grace_end = threading.Event(), set(), False, None, None


os.register_at_fork(after_in_child=_start_clean)


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """This process's place in a run of several processes, as Lightning's strategy sets it before the ranks
    connect. ``address`` and ``port``: the store every rank joins (rank 0's process runs it). ``starts_node``:
    this process is Lightning's launcher, which starts its node's other ranks as its children (they end with it)."""

    rank: int
    world: int
    node: int
    local: int
    nodes: int
    address: str
    port: int
    starts_node: bool

    @property
    def others_wait(self) -> bool:
        """Whether another process of the run exists or will: one this process would start does not, yet."""
        return self.world > 1 and (self.nodes > 1 or not self.starts_node)


def rank_place(strategy: Any) -> RankPlace | None:
    """This process's place in the run of ``strategy`` (a Lightning strategy whose ranks are set, as a Trainer's
    are from its construction on); None for a run of one process."""
    world = getattr(strategy, "world_size", 1)
    environment = getattr(strategy, "cluster_environment", None)
    if world <= 1 or environment is None:
        return None
    return RankPlace(strategy.global_rank, world, strategy.node_rank, strategy.local_rank,
                     getattr(strategy, "num_nodes", 1), environment.main_address, environment.main_port,
                     not environment.creates_processes_externally)


def launched_place() -> RankPlace | None:
    """This process's place as its launcher's environment gives it, before any setting is read: torchrun's
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or SLURM's
    (``SLURM_PROCID``, ``SLURM_NTASKS``, ...), as Lightning's environments read them. None for one process, or
    where no launcher gives the world size (Lightning's own launcher takes it from the trainer's settings)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    for kind, nodes in ((TorchElasticEnvironment, lambda world: world // int(os.environ.get("LOCAL_WORLD_SIZE", 1))),
                        (SLURMEnvironment, lambda world: int(os.environ.get("SLURM_NNODES", 1)))):
        try:
            if not kind.detect():
                continue
            environment = kind()
            world = environment.world_size()
            place = RankPlace(environment.global_rank(), world, environment.node_rank(), environment.local_rank(),
                              nodes(world), environment.main_address, environment.main_port, False)
        except (KeyError, ValueError, RuntimeError):  # a variable missing or no number: not this launcher's run
            continue
        return place if world > 1 else None
    return None


def launched_node() -> int | None:
    """This process's node where Lightning's own launcher runs several nodes and the settings could not be read:
    ``NODE_RANK``, for the process started on each node (``MASTER_PORT`` set, no ``LOCAL_RANK``: not a rank the
    launcher started); the world size and the node's ranks are settings. None elsewhere."""
    if "LOCAL_RANK" in os.environ or "MASTER_PORT" not in os.environ or launched_place() is not None:
        return None
    with contextlib.suppress(KeyError, ValueError):
        return int(os.environ["NODE_RANK"])
    return None


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
    (``os._exit``: no exit handler or thread join can wait on the other ranks). The end first waits while any
    failed rank still handles its error (:func:`say_handling`), at most ``HANDLING_GRACE_S``: this one's end may end
    it. For a process of a group of several ranks; the group must be initialized."""
    _ending.set()
    if show_traceback:
        traceback.print_exception(error)
    _end(record_failure(error), exit_status)


def record_failure(error: BaseException, handling: bool = False) -> str:
    """Record this rank's ``error`` in the run's store for the other ranks (their watches end them), and return the
    line this rank ends with, naming the run's first failure; this process's watches stand down (it is ending). For
    a process of a group of several ranks; the group must be initialized. ``handling``: this rank goes on handling
    the error before it ends (Lightning's ``on_exception`` hooks, the loggers' last write): the other ranks' ends give
    it up to ``HANDLING_GRACE_S`` for that, until :func:`_end` says it is done. For a ``RankFailed`` the line
    quotes the failed rank's record, waited for while that rank still handles its error (its record may come as it
    ends), within the same ``HANDLING_GRACE_S`` as this rank's end waits in."""
    from lit_grpo.runtime.distributed import RaisedOnEveryRank

    _ending.set()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if handling:
        _say_handling()
    first = (rank, describe(error)) if isinstance(error, RaisedOnEveryRank) else _record_failure(rank, error)
    if first is None:
        return (f"rank {rank} of {world} stopped on {describe(error)} (the run's store is gone: a rank that "
                "failed first ended with it; that rank's output names its error)")
    return _ending_line(rank, world, first)


def say_handling() -> None:
    """Say in the run's store that this rank failed and goes on handling its error before it records it and ends
    (``lit-grpo``: Lightning's ``on_exception`` hooks and the loggers' last write, then the CLI's error path,
    :func:`end_failed_rank`, which says it is done as it ends): every other rank, told of the failure or failing
    itself, waits for that, at most ``HANDLING_GRACE_S``, before its end can end this one. For a process of a group
    of several ranks; the group must be initialized."""
    _say_handling()


def end_at_uncaught_error(line: str, exit_status: int = 1, shown_error: BaseException | None = None) -> None:
    """From now on an error that leaves the script (``sys.excepthook``, as the interpreter calls it) ends this
    process as :func:`end_failed_rank` does, after the hook before this one (its traceback; not the interpreter's
    own for ``shown_error``, whose traceback the caller printed already), with ``line``: the
    callers of ``trainer.fit`` get the error first (their ``except`` and ``finally``), as without several processes,
    and no exit handler or thread join can then wait on the other ranks. A script that catches the error goes on,
    and ends so too where it exits (the first exit handler: ``sys.exit`` in its ``except``, or its end), with the
    ranks this process started: they may have missed the record, whose store can end with this process. The end
    first waits while any failed rank still handles its error, at most ``HANDLING_GRACE_S``, as every end does."""
    shown = sys.excepthook
    atexit.register(_end, line, exit_status)

    def show_and_end(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        try:
            if error is not shown_error or shown is not sys.__excepthook__:  # one traceback, and a user's hook
                shown(kind, error, trace)
        finally:
            _end(line, exit_status)

    sys.excepthook = show_and_end


def end_unconnected_rank(error: BaseException, place: RankPlace, exit_status: int = 1,
                         show_traceback: bool = True) -> NoReturn:
    """:func:`end_failed_rank` for a rank that failed before the ranks connected (no process group yet), in a run
    whose other ranks exist or will (``place.others_wait``): they would wait for it in the process group's setup.
    Its error is recorded in the run's store, which rank 0 starts itself (keeping it until each rank still to come
    has read the record, at most ``SETUP_WAIT_S``) and any other rank waits for as long; then this process ends
    as :func:`end_failed_rank` ends it."""
    _ending.set()
    if show_traceback:
        traceback.print_exception(error)
    deadline = time.monotonic() + SETUP_WAIT_S
    rank, world = place.rank, place.world
    runs_store = place.rank == 0 and not _launcher_runs_store()
    _say_wait(f"rank {rank} of {world}", error, "the other ranks to read its record" if runs_store else
              f"rank 0's store at {place.address}:{place.port} to record it", exit_status)
    address = (place.address, place.port)
    store = _start_store(address) if runs_store else _await_store(address, deadline)
    if store is None:
        where = f"{place.address}:{place.port}"
        why = (f"its port {where} is another process's (another run's store?), left alone" if runs_store
               else f"no store came at {where} within {SETUP_WAIT_S:.0f} s")
        _end(f"rank {rank} of {world} failed before the ranks connected: {describe(error)}; {why}, so the ranks "
             "waiting there end at their process group's timeout", exit_status, after_handling=False)
    try:
        first = _record_in(store, rank, error)
        _say_read(store, place)
        started = time.monotonic()
    except Exception:  # the store went with rank 0's process, which ended on a failure: its output names it
        _end(f"rank {rank} of {world} stopped on {describe(error)} before the ranks connected (the run's store is "
             "gone: rank 0 ended on a failure; its output names it)", exit_status, after_handling=False)
    line = _ending_line(rank, world, first)
    if runs_store:
        if not _await_readers(store, place, deadline):
            line += f" (not every rank read it within {SETUP_WAIT_S:.0f} s: those end at their process group's timeout)"
        _end(line, exit_status, after_handling=False)
    # Lightning's launcher (rank 0's process) ends its node, without a word, once a child has ended: said first, the
    # record is then kept a little while for rank 0 to read and name (it ends this process as it ends)
    print(f"lit_grpo: {line}", file=sys.stderr, flush=True)
    read_by_rank_0 = [_rank_read_key(0)]
    with contextlib.suppress(Exception):  # the store may go with rank 0
        while not store.check(read_by_rank_0) and time.monotonic() < started + STORE_TIMEOUT_S:
            time.sleep(0.1)
    _end(None, exit_status, after_handling=False)


def end_unread_node(error: BaseException, node: int, exit_status: int = 1, show_traceback: bool = True) -> NoReturn:
    """:func:`end_unconnected_rank` for the process started on node ``node`` under Lightning's own launcher of
    several nodes, whose settings could not be read (:func:`launched_node`): its ranks unknown, its error is recorded
    in rank 0's store as ``node N``'s, which every rank names as it ends. Node 0's process, where rank 0 would run
    that store, runs it itself and keeps it until every other node has read the record (:func:`_await_nodes`);
    another node waits for it ``SETUP_WAIT_S``. It starts no rank, so its node is said to have read the record."""
    _ending.set()
    if show_traceback:
        traceback.print_exception(error)
    address = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]))
    name, where = f"node {node}", "{}:{}".format(*address)
    waits = (f"the other nodes, if any, to read it in rank 0's store, which it runs at {where}; while no node says "
             f"the run's count of nodes, {UNKNOWN_NODES_WAIT_S:.0f} s after its start or the last read"
             if node == 0 else f"rank 0's store at {where} to record it")
    _say_wait(name, error, waits, exit_status)
    store = _start_store(address) if node == 0 else _await_store(address, time.monotonic() + SETUP_WAIT_S)
    if store is None:
        why = (f"its port {where} is another process's (another run's store?), left alone" if node == 0 else
               f"no store came at {where} within {SETUP_WAIT_S:.0f} s")
        _end(f"{name} failed before the ranks connected: {describe(error)}; {why}, so the ranks waiting there end at "
             "their process group's timeout", exit_status, after_handling=False)
    if node == 0:  # its own store: nothing can take it away
        _end(_ending_line(name, 0, _record_in(store, name, error)) + _await_nodes(store), exit_status,
             after_handling=False)
    try:
        first = _record_in(store, name, error)
        _say_node_read(store, node)
    except Exception:  # the store went with rank 0's process, which ended on a failure: its output names it
        _end(f"{name} stopped on {describe(error)} before the ranks connected (the run's store is gone: rank 0 ended "
             "on a failure; its output names it)", exit_status, after_handling=False)
    _end(_ending_line(name, 0, first), exit_status, after_handling=False)


def _say_wait(this: str, error: BaseException, waits: str, exit_status: int) -> None:
    """Say what ``this`` rank (or node), failed before the ranks connected, ``waits`` for before it ends: the wait
    can be long (a rank still loading its model comes late), so not a silent stall; from now on Ctrl-C (SIGINT,
    where its handler is the interpreter's own) ends it at once naming ``error``, not in the wait's traceback."""
    failed = f"{this} failed before the ranks connected: {describe(error)}"
    print(f"lit_grpo: {failed}; it waits up to {SETUP_WAIT_S:.0f} s for {waits} (Ctrl-C ends the wait)",
          file=sys.stderr, flush=True)
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, lambda *_: _end(f"{failed}; Ctrl-C ended its wait, so the ranks that did not "
                                                     "read its record end at their process group's timeout",
                                                     exit_status, after_handling=False))


def _await_nodes(store: torch.distributed.TCPStore) -> str:
    """Keep the store (run by node 0's process, :func:`end_unread_node`) until every other node has read the run's
    first failure, the count of nodes said by the first reader that knows it (:func:`_say_read`), at most
    ``SETUP_WAIT_S``; while none has said it (one node, or only nodes whose settings could not be read either),
    until ``UNKNOWN_NODES_WAIT_S`` passes with no read. Returns what its ending line adds: "" where every node read."""
    prefix, started = _prefix(), time.monotonic()
    reads, last_read = 0, started
    while time.monotonic() < started + SETUP_WAIT_S:
        if store.check([prefix + "nodes"]):
            nodes = int(store.get(prefix + "nodes"))
            if store.check([_node_read_key(other) for other in range(1, nodes)]):
                return ""
        elif (count := store.add(prefix + "reads", 0)) > reads:  # another read: nodes may still be coming
            reads, last_read = count, time.monotonic()
        elif time.monotonic() >= last_read + UNKNOWN_NODES_WAIT_S:
            read = (f"{reads} read it, none knowing the run's count of nodes, then no other" if reads else
                    "no node read it")
            return (f" ({read} within {UNKNOWN_NODES_WAIT_S:.0f} s: a run of one node has none, and a node still to "
                    "come waits until its process group's timeout)")
        time.sleep(0.1)
    return f" (not every node read it within {SETUP_WAIT_S:.0f} s: those end at their process group's timeout)"


def _ending_line(rank: int | str, world: int, first: tuple[int | str, str | None]) -> str:
    """The line a rank ends with (``rank`` of ``world``, or a node's name: ``node N``), ``first`` being the run's
    first failure (its rank or node name, and its description)."""
    this = f"rank {rank} of {world}" if isinstance(rank, int) else rank
    if first[0] == rank:
        return f"{this} failed: {first[1]}; every rank stops"
    failed = f"rank {first[0]}" if isinstance(first[0], int) else first[0]
    return f"{this} stopped because {failed} failed: {first[1] or 'its output names the error'}"


def _end(line: str | None, exit_status: int = 1, after_handling: bool = True) -> NoReturn:
    """End this process with ``line`` (its last words, said before its handling is said done: the others may end it
    from then on), its failure's handling over; ``after_handling``: first wait while any other failed rank still
    handles its error (:func:`_await_handling`), as every end of a connected rank does."""
    if line is not None:
        print(f"lit_grpo: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    _say_handled()
    if after_handling:
        _await_handling()
        _keep_store_for_readers()
    _end_child_processes()
    os._exit(exit_status)


def _keep_store_for_readers() -> None:
    """In rank 0's process, where it runs the run's store, and a failure is recorded there: wait until every other
    rank has read the run's first failure (its watch, or its own record, says so), at most ``READ_WAIT_S``, before
    the store ends with this process. The ranks it waits for are still connected to it: none of their collectives
    fails meanwhile, so each learns of the failure from the record."""
    if _launcher_runs_store() or not torch.distributed.is_initialized() or torch.distributed.get_rank() != 0:
        return
    with contextlib.suppress(Exception):  # no store to keep
        store = _connect_store()
        if not store.check([_prefix() + "count"]):
            return
        readers = [_rank_read_key(rank) for rank in range(1, torch.distributed.get_world_size())]
        _await_keys(store, readers, time.monotonic() + READ_WAIT_S)


def _handling_keys() -> tuple[str, str]:
    """The store's counts of the ranks that said they handle their failure, and of those that said they are done."""
    return f"{_prefix()}handling", f"{_prefix()}handled"


def _say_handling() -> None:
    """Say in the run's store, before this rank's failure is recorded, that it goes on handling its error (once)."""
    global _handling
    if _handling is not None:
        return
    with contextlib.suppress(Exception):  # no store: no rank can read the record either
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        _connect_store(address).add(_handling_keys()[0], 1)
        _handling = address


def _say_handled() -> None:
    """Say in the run's store that this rank's handling of its error is over (it ends now), if it said it had some."""
    global _handling
    if _handling is not None:
        address, _handling = _handling, None
        with contextlib.suppress(Exception):  # the store went with another rank: nobody waits on this one
            _connect_store(address).add(_handling_keys()[1], 1)


def _handling_left(store: torch.distributed.TCPStore) -> bool:
    """Whether a rank said it handles its failure and has not yet said it is done."""
    handling, handled = _handling_keys()
    return store.add(handling, 0) > store.add(handled, 0)


def _grace_deadline() -> float:
    """When this process's waits for the failed ranks' handling run out (``time.monotonic``): ``HANDLING_GRACE_S``
    after the first of them, one bound for them all (a told rank's wait for a record, then for the handling)."""
    global _grace_end
    if _grace_end is None:
        _grace_end = time.monotonic() + HANDLING_GRACE_S
    return _grace_end


def _await_handling() -> None:
    """Wait, until :func:`_grace_deadline`, while any rank that said it handles its failure (:func:`say_handling`,
    ``record_failure(..., handling=True)``) has not said it is done, before this rank ends: on one node under
    Lightning's launcher the launcher's end ends the ranks it started, and its process observer ends the launcher
    once one of them has ended, so an end here could cut another rank's handling short, two failing at once too."""
    with contextlib.suppress(Exception):  # no store (gone with a failed rank): nobody is left to wait for
        store, deadline = _connect_store(), _grace_deadline()
        while _handling_left(store) and time.monotonic() < deadline:
            time.sleep(0.1)


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


def _connect_store(address: tuple[str, int] | None = None) -> torch.distributed.TCPStore:
    """A client of the store every rank joined (at ``address``; default: ``MASTER_ADDR``, ``MASTER_PORT``, which
    Lightning sets as the ranks connect); raises where it is gone (at once: a plain connection is refused first,
    where a store client would retry for seconds; within about twice ``STORE_CONNECT_TIMEOUT_S`` where it ends
    between the two)."""
    address = address or (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    socket.create_connection(address, timeout=STORE_TIMEOUT_S).close()
    store = torch.distributed.TCPStore(*address, is_master=False,
                                       timeout=datetime.timedelta(seconds=STORE_CONNECT_TIMEOUT_S))
    store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))  # for its waits: a record may still be on its way
    return store


def _launcher_runs_store() -> bool:
    """Whether the launcher runs the run's store and rank 0 joins it as any rank does (torchrun's agent store);
    else rank 0's process runs it, as torch's ``env://`` setup has it."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _start_store(address: tuple[str, int]) -> torch.distributed.TCPStore | None:
    """The run's store at ``address``, started by rank 0 (or node 0's process) that failed before the ranks connected
    (shared with this process's own where its process group's setup started one: ``multi_tenant``); None where
    another process holds the port. A store there is another run's (two runs given one ``MASTER_PORT``), whose ranks
    would end on this record."""
    with contextlib.suppress(RuntimeError):
        return torch.distributed.TCPStore(*address, is_master=True, wait_for_workers=False,
                                          multi_tenant=True, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    return None


def _await_store(address: tuple[str, int], deadline: float) -> torch.distributed.TCPStore | None:
    """A client of the run's store at ``address``, asked for once a second until ``deadline`` (``time.monotonic``):
    rank 0's, which may still be loading its model, or the launcher's. None: none came."""
    while True:
        with contextlib.suppress(OSError, RuntimeError):
            return _connect_store(address)
        if time.monotonic() >= deadline:
            return None
        time.sleep(WATCH_INTERVAL_S)


def _rank_read_key(rank: int) -> str:
    """The store's key that says ``rank`` read the run's first failure (or recorded its own)."""
    return f"{_prefix()}read/rank/{rank}"


def _node_read_key(node: int) -> str:
    """The store's key that says a process of ``node`` read the run's first failure."""
    return f"{_prefix()}read/node/{node}"


def _read_keys(place: RankPlace) -> list[str]:
    """The keys that say a rank read the run's first failure, one per rank :func:`_await_readers` waits for:
    under Lightning's launcher per node (its launcher process ends the node's others with it), else per rank."""
    if place.starts_node:
        return [_node_read_key(node) for node in range(place.nodes) if node != place.node]
    return [_rank_read_key(rank) for rank in range(place.world) if rank != place.rank]


def _say_read(store: torch.distributed.TCPStore, place: RankPlace) -> None:
    """Record that this process read the run's first failure (or failed itself), for rank 0 to stop waiting. For
    its node too: under Lightning's launcher a node's processes end together (the launcher ends its children as it
    ends, and its process observer ends the launcher once a child has); and the run's count of nodes, for node 0's
    process to wait for each where it failed before it could read its own (:func:`_await_nodes`)."""
    store.set(_rank_read_key(place.rank), "1")
    store.set(f"{_prefix()}nodes", str(place.nodes))
    _say_node_read(store, place.node)


def _say_node_read(store: torch.distributed.TCPStore, node: int) -> None:
    """Record that ``node`` read the run's first failure, and count the read (:func:`_await_nodes` waits for both)."""
    store.set(_node_read_key(node), "1")
    store.add(f"{_prefix()}reads", 1)


def _await_readers(store: torch.distributed.TCPStore, place: RankPlace, deadline: float) -> bool:
    """Keep the store (run by this process, rank 0) until every other rank (node, under Lightning's launcher) has
    read the run's first failure, or ``deadline`` (``time.monotonic``) passes; whether all did."""
    return _await_keys(store, _read_keys(place), deadline)


def _await_keys(store: torch.distributed.TCPStore, keys: list[str], deadline: float) -> bool:
    """Wait until the store holds every one of ``keys`` or ``deadline`` (``time.monotonic``) passes; whether it does."""
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _first_failure(store: torch.distributed.TCPStore) -> tuple[int | str, str]:
    """``(rank, description)`` of the run's first recorded failure (waits for it up to the store's timeout); the
    rank is a node's name (``node N``) for a node that failed before it knew its ranks (:func:`end_unread_node`)."""
    prefix = _prefix()
    first = store.get(f"{prefix}1").decode()
    return int(first) if first.isdigit() else first, store.get(f"{prefix}rank/{first}").decode()


def _record_failure(rank: int, error: BaseException) -> tuple[int | str, str | None] | None:
    """Record this rank's error in the run's store; return ``(rank, description)`` of the failure that came first
    (this one, another rank's, or the one a ``RankFailed`` names: its description None where its record did not
    come), or None where the store cannot be reached."""
    try:
        store = _connect_store()
        first = _record_in(store, rank, error)
        store.set(_rank_read_key(rank), "1")  # it knows the first failure: rank 0 keeps no store for it
        return first
    except Exception:  # the store went with a failed rank, or never existed: nothing to name but this error
        return None


def _record_in(store: torch.distributed.TCPStore, rank: int | str, error: BaseException
               ) -> tuple[int | str, str | None]:
    """:func:`_record_failure` in ``store`` (``rank``: or a node's name, ``node N``); raises where the store is
    gone."""
    from lit_grpo.runtime.distributed import RankFailed

    prefix = _prefix()
    if isinstance(error, RankFailed):  # it names the rank that failed, whose record may still be on its way
        return error.ranks[0], _await_record(store, error.ranks[0])
    order = store.add(prefix + "count", 1)  # its place among the failures, taken before a rank can read it
    store.set(f"{prefix}rank/{rank}", describe(error))
    if order == 1:  # the first: no answer needed (a rank that read this record may end the store with it)
        with contextlib.suppress(Exception):
            store.set(f"{prefix}1", str(rank))
        return rank, describe(error)
    return _first_failure(store)


def _await_record(store: torch.distributed.TCPStore, rank: int) -> str | None:
    """The description failed ``rank`` recorded, waited for ``STORE_TIMEOUT_S``, and while a rank still handles its
    failure (``lit-grpo`` records it as the rank ends) until :func:`_grace_deadline`; None where it did not come."""
    key, short = f"{_prefix()}rank/{rank}", time.monotonic() + STORE_TIMEOUT_S
    try:
        while not store.check([key]):
            now = time.monotonic()
            if now >= _grace_deadline() or (now >= short and not _handling_left(store)):
                return None
            time.sleep(0.1)
        return store.get(key).decode()
    except Exception:  # the store went with the failed rank
        return None


def watching() -> bool:
    """Whether a watch (:func:`watch_failures`) of this process runs (and is not being stopped)."""
    return any(not stop.is_set() for stop in list(_watches))


def watch_failures(place: RankPlace, interval_s: float = WATCH_INTERVAL_S) -> threading.Event:
    """Start a daemon thread that ends this process, naming the cause, once another rank has recorded a failure in
    the run's store: a rank waiting in a collective that will never complete (NCCL's, whose peer has ended), or in
    the process group's setup for a rank that failed before it, or computing alone for long, does not outlive the
    run. It may start before the ranks connect (it asks for the store until it exists); set the returned event to
    stop the watch before the run ends on its own. Before it ends this process it records that this rank read the
    failure; rank 0 before the ranks connected first keeps its store until every rank did (``SETUP_WAIT_S``). A rank
    that failed too and handles its own error (``say_handling``) is left to its own error path, which ends it with
    that error's exit status, for up to ``HANDLING_GRACE_S``. Each poll also relays stop signals between the ranks
    (``STOP_SIGNAL.relay``: this rank's own is said in the store, another rank's said there is recorded here)."""
    stop = threading.Event()
    _watches.add(stop)

    def watch() -> None:
        store, count = None, _prefix() + "count"
        while not stop.wait(interval_s):
            try:
                store = store or _connect_store((place.address, place.port))
                STOP_SIGNAL.relay(store, place.rank)  # a stop signal that came to one rank reaches every rank
                if not store.check([count]):
                    continue
                first = _first_failure(store)
            except torch.distributed.DistStoreError:  # a failure counted, its record not there yet: ask again
                continue
            except Exception:  # no store yet (or gone with its rank: then the collectives tell this one)
                store = None
                continue
            if _ending.is_set() or stop.is_set() or first[0] == place.rank:
                return  # this rank is ending on its own error, or the run on its own
            if _handling is not None and _ending.wait(HANDLING_GRACE_S):
                return  # this rank failed too (both at once): its own error path ends it, with its exit status
            with contextlib.suppress(Exception):
                _say_read(store, place)
                if place.rank == 0 and not torch.distributed.is_initialized():  # the others may still need it
                    _await_readers(store, place, time.monotonic() + SETUP_WAIT_S)
            _end(_ending_line(place.rank, place.world, first))  # once the failed ranks' handling is done

    def run() -> None:
        try:
            watch()
        finally:
            _watches.discard(stop)

    threading.Thread(target=run, name="lit-grpo-failure-watch", daemon=True).start()
    return stop
