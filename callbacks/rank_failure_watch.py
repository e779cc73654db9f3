"""``RankFailureWatch``: under several processes, a rank's error ends every rank, each naming it."""

from __future__ import annotations

import threading
import traceback

import lightning.pytorch as pl
from lightning.pytorch import Callback

from lit_grpo.runtime.distributed import RankFailed, is_multi_process
from lit_grpo.runtime.rank_failure import (caller_ends_failed_ranks, end_at_uncaught_error, is_failure, rank_place,
                                           record_failure, say_handling, watch_failures, watching)


class RankFailureWatch(Callback):
    """Ends this rank, naming the rank that failed and its error, within a second of another rank's failure
    recorded in the run's store (``lit_grpo.runtime.rank_failure``): over gloo a failed rank's peers fail at their
    next collective anyway; over NCCL a peer waiting in a collective may notice only at the process group's
    timeout, and a rank computing alone notices only at its next collective. Where a watch of this process runs
    already (``lit-grpo`` starts one as the run starts, before the ranks connect), it starts none of its own. The
    watch also passes a SIGTERM or Ctrl-C that reached one rank only to the others (``RunCheckpoint``'s stop,
    ``lit_grpo.runtime.stop_signal``).

    What it does, by case (the first two in a Lightning project of its own, under several processes):

    - This rank's own error (``on_exception``; not a stop such as ``KeyboardInterrupt`` or ``StopRequested``, nor
      ``RaisedOnEveryRank`` or ``RankFailed``: ``rank_failure.is_failure``): it shows the traceback and records
      the error in the store at once for the other ranks, saying that this rank still handles it. Lightning then
      ends its handling as without several processes (every callback's ``on_exception``, this one's place in the
      list whatever it is, and the loggers' last write); the others, failing too or not, wait up to
      ``rank_failure.HANDLING_GRACE_S`` in all for every such handling before they end, since on one node under
      Lightning's launcher rank 0 and the ranks it started end together. Where the error leaves the script, the
      rank ends with exit status 1, after a hook of the user's if any (the traceback is not shown twice), and once
      the other failed ranks' handling is done (within that same bound), before any exit handler or thread join can
      wait on the other ranks (``rank_failure.end_at_uncaught_error``); a script that catches it goes on, and the
      rank ends so where the script exits (``sys.exit`` or its end), with exit status 1 whatever the script's (the
      others were told that the run failed).
    - Told of another rank's failure by a collective (``RankFailed``; nothing recorded): the rank ends as above,
      where the error leaves the script or the script exits, with exit status 1 (it must not report success), but
      only once the failed ranks' own handling is done (at most ``HANDLING_GRACE_S``), since its end may end them
      too.
    - One process: nothing; the script keeps its exit status.
    - Under ``lit-grpo``, which adds it to every fit and validation: on this rank's own error it only says in the
      store that the rank handles it (``rank_failure.say_handling``); the CLI's error path records the error and
      ends the rank after Lightning's handling (its output and exit status per error), and a rank told of the
      failure (``RankFailed``) ends there once that handling is done, as above.

    The watch runs from ``setup`` to the end of the fit or validation, however it ends: ``teardown`` (a fit that
    ends on its own, by ``max_steps``, ``trainer.should_stop`` or EarlyStopping), or ``on_exception`` (an error or
    a stop such as ``KeyboardInterrupt``, after which Lightning calls no ``teardown``).

    Logs nothing.
    """

    def __init__(self) -> None:
        self._stop: threading.Event | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        place = rank_place(trainer.strategy)
        if place is not None and is_multi_process() and self._stop is None and not watching():
            self._stop = watch_failures(place)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_watch()  # Lightning calls no teardown after an error or a stop: the fit is over here
        if not is_multi_process():
            return
        if caller_ends_failed_ranks():
            # the CLI records the error and ends the rank once Lightning's handling is done; a rank told of the
            # failure meanwhile (RankFailed) waits for that handling, which this says is under way
            if is_failure(exception):
                say_handling()
            return
        if isinstance(exception, RankFailed):  # told that another rank failed: no exit of the script's, 0 included,
            # may report success, nor run exit handlers that could wait on the others; its end waits while the
            # failed ranks handle their errors, as every end does (it may end them too)
            end_at_uncaught_error(record_failure(exception))
            return
        if not is_failure(exception):
            return
        # the other ranks learn now; this one ends once Lightning has called every other callback's on_exception
        # and finalized the loggers, which an end here would cut short (the others wait a bounded time for that:
        # under Lightning's launcher rank 0 ends its node's ranks as it ends, and its observer ends rank 0 once one
        # of them has). Its traceback is shown first, in case that wait runs out
        traceback.print_exception(exception)
        end_at_uncaught_error(record_failure(exception, handling=True), shown_error=exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_watch()

    def _stop_watch(self) -> None:
        """Stop the watch this callback started, if any: no thread asks the store once its fit is over."""
        if self._stop is not None:
            self._stop.set()
            self._stop = None
