"""``RunCheckpoint``: the run's one resume point, ``last.ckpt``, kept current, written atomically, and a clean stop
on SIGTERM or Ctrl-C."""

from __future__ import annotations

import numbers
import os
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lit_grpo.runtime.checkpoints import (AtomicCheckpointIO, check_writable, finish_interrupted_swaps,
                                          remove_stale_partials, remove_staged, staging_path, swap_in_staged)
from lit_grpo.runtime.stop_signal import STOP_SIGNAL, StopRequested
from lit_grpo.runtime.validation import (ConfigError, check_bool, check_folder, check_int, check_state_keys,
                                         shown_setting, shown_value)

from ._paths import shown_path
from ._rollout import accumulating

DEFAULT_INTERVAL = timedelta(minutes=30)


class RunCheckpoint(ModelCheckpoint):
    r"""Keeps ``last.ckpt`` (in the logger's ``version_N/checkpoints``, or ``dirpath``) current during the run, and
    stops the run cleanly, saved, when SIGTERM or Ctrl-C comes.

    **When it saves**, each time over the same file, always at a step boundary (the whole state of the last
    completed step: weights, optimizer, loops, the DataModule's stream position, carried samples, the scheduler's
    state, callback states, random states):

    - after every validation (``save_on_validation``);
    - every ``every_n_train_steps`` optimizer steps (after the training step that passes each multiple of it:
      a GRPO step makes several optimizer steps), and after the first step that ends ``train_time_interval``
      (a ``timedelta``; in YAML ``"0:30:00"``) after the last save; the interval bounds what a kill (SIGKILL, a
      lost machine) can cost, the README states what a save costs; where a validation follows that step, the save
      waits for it (with ``save_on_validation``), so the checkpoint holds what the validation changed;
    - at the end of fit, and when a stop signal comes.

    Lightning's own ``ModelCheckpoint(save_last=True, save_top_k=0)`` writes ``last.ckpt`` only when fit ends, and
    under manual optimization (``GRPOModule``) it ignores ``train_time_interval``: this subclass decides when, and
    Lightning's machinery writes (``Trainer.save_checkpoint``, the callback's own state, ``--ckpt_path last``).

    **How it writes**: atomically (:class:`~lit_grpo.runtime.checkpoints.AtomicCheckpointIO`, set on the strategy where
    it uses Lightning's default ``TorchCheckpointIO``): a killed save leaves the previous ``last.ckpt`` whole. Under
    ``ModelParallelStrategy`` (FSDP2) ``last.ckpt`` is a folder of every rank's shards: it is written beside its place
    (``.last.ckpt.PID.staging``) and swapped in once every rank has finished. At setup it deletes partial files of
    killed saves and checks that the folder can be written and has room for one more checkpoint, so a bad folder fails
    before the first step rather than hours later.

    **Stop signals** (installed for the training loop): the first SIGTERM or Ctrl-C stops the run at the next step
    boundary: it saves ``last.ckpt`` of the last completed step, prints where it is and the command that resumes
    it, and exits with 128 + the signal's number (143, 130). A signal during a training step's rollout does not
    wait for the step: the rollout is abandoned (the DataModule rolls its stream back to the step's start, and the
    weights have not moved yet), so the saved step is the one before, redone exactly on resume. A signal during the
    update lets the update finish (an optimizer step cut in half cannot be redone). A signal during a validation
    (the one before the first step too) cuts it: one process abandons its rollout at once, several processes stop
    after the validation batch under way; a validation changes nothing of the training state, so nothing is lost,
    and the resume goes on with the next step. Under several processes the
    ranks agree at each step boundary (one all-reduce of a flag) and stop after the same step; a training rollout
    is abandoned on each rank the stop reaches (a signal that came to one rank only reaches the others through the
    run's store within seconds, where ``RankFailureWatch``'s watch runs: ``StopSignal.relay``), and the ranks meet
    right after their rollouts (``StopSignal.abandonable_together``): where any rank abandoned, every rank rolls
    the step back and raises an agreed stop, saved here in ``on_exception`` as one process's is. A second signal
    (to the same process) stops at once, unsaved.

    Args:
        dirpath: the checkpoint folder (default: Lightning's, ``<logger dir>/checkpoints``).
        every_n_train_steps: save every N optimizer steps (None: by time only).
        train_time_interval: save once this much training time has passed since the last save (None: never).
        save_on_validation: save after every validation.

    Logs no keys. ``saves`` and ``save_seconds`` count the saves of this run and their time (the fit summary
    prints them); ``resume_command``, when set (the CLI does), is printed as the way back after a stop, else
    ``trainer.fit(..., ckpt_path=...)`` with the checkpoint's path.
    """

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int | None = None,
                 train_time_interval: timedelta | None = DEFAULT_INTERVAL, save_on_validation: bool = True,
                 verbose: bool = False) -> None:
        check_folder("dirpath", dirpath, "Lightning's checkpoint folder")
        if every_n_train_steps is not None:
            # a plain int: it is part of the state_key a checkpoint's callback state is found by
            every_n_train_steps = check_int("every_n_train_steps", every_n_train_steps, 1)
        if train_time_interval is not None and not isinstance(train_time_interval, timedelta):
            raise ValueError(f"{shown_setting('train_time_interval', train_time_interval)} must be a "
                             "datetime.timedelta (in YAML \"0:30:00\") or None: never")
        check_bool("save_on_validation", save_on_validation)
        check_bool("verbose", verbose)
        if train_time_interval is not None and train_time_interval.total_seconds() < 0:
            raise ValueError(f"train_time_interval={train_time_interval} must not be negative (or None: never)")
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0, verbose=verbose,
                         save_on_train_epoch_end=False, enable_version_counter=False)
        # Lightning's triggers, set after its __init__, which takes steps and time as mutually exclusive; they
        # name this callback's state_key and are read by the hooks below.
        self._every_n_train_steps = every_n_train_steps or 0
        self._train_time_interval = train_time_interval
        self._every_n_epochs = 0
        self.save_on_validation = save_on_validation
        self._step_before = 0  # the optimizer steps made when the last training batch ended
        self.resume_command: str | None = None
        self.saves = 0
        self.save_seconds = 0.0
        self._stopped = False

    # ------------------------------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if self.dirpath is not None and "://" not in str(self.dirpath):
            def check() -> None:
                for path in remove_stale_partials(self.dirpath):
                    rank_zero_info(f"lit_grpo: removed {path}, the partial file of a save that was killed")
                for path in finish_interrupted_swaps(self.dirpath):
                    rank_zero_info(f"lit_grpo: {path}: finished or removed what a killed sharded save left")
                check_writable(self.dirpath)
            _on_rank_zero_for_all(trainer, check)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self.dirpath is not None and "://" not in str(self.dirpath):
            _on_rank_zero_for_all(
                trainer, lambda: check_writable(self.dirpath, needed_bytes=checkpoint_bytes(pl_module)))
        self.listen_for_stops()
        self._stopped = False
        self._step_before = trainer.global_step  # where the last training batch ended (a resumed run: its step)

    def listen_for_stops(self) -> None:
        """From here on a SIGTERM or Ctrl-C stops the run saved (``STOP_SIGNAL``). Installed once training starts,
        after Lightning's own handler (which would exit 0 between validation batches); ``FitSummary`` calls it
        first, before the validation it runs ahead of the first step."""
        STOP_SIGNAL.install()

    # ------------------------------------------------------------------------------------------ when
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if accumulating(trainer, batch_idx):  # saves and stops wait for the batch that ends the optimizer step
            return
        stop = self._stop_agreed(trainer)
        # a step that a validation follows is saved after it (save_on_validation): saved here, the checkpoint
        # would miss what the validation changed (other callbacks' state, FitSummary's curve) and hold the step
        # twice, since the save after the validation is of the same step and skipped
        if stop or (self._interval_due(trainer) and not (self.save_on_validation and _validation_follows(trainer))):
            self._save_last(trainer)
        self._step_before = trainer.global_step
        if stop:
            self._stop(trainer)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        """A stop cuts the validation after this batch. One process abandons the rollout itself, at once
        (``build_val_batch``); several agree here, where every rank is (each runs as many validation batches)."""
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if self._stop_agreed(trainer):
            self._save_last(trainer)
            self._stop(trainer, cut=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        stop = self._stop_agreed(trainer)
        if stop or self.save_on_validation:
            self._save_last(trainer)
        if stop:
            self._stop(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Nothing: saves follow steps, time and validations, not epochs (one GRPO epoch is arbitrary)."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        STOP_SIGNAL.restore()
        self._save_last(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        STOP_SIGNAL.restore()
        if isinstance(exception, StopRequested) and not self._stopped and (trainer.world_size == 1 or
                                                                           exception.agreed):
            # A rollout was abandoned and rolled back: the state is the last completed step's. Anything else
            # that fails mid-step leaves no consistent state to save, and last.ckpt stays as it was. Under several
            # processes only a stop every rank raised at one point (agreed: a training rollout abandoned on some
            # rank, StopSignal.abandonable_together): a save runs collectives, which ranks elsewhere would not pair
            # (at step boundaries the ranks agree on a stop and save before raising it, in _stop's callers)
            self._save_last(trainer)
            self._announce(trainer, exception.signum, cut=trainer.validating)

    # ------------------------------------------------------------------------------------------ how
    def _interval_due(self, trainer: pl.Trainer) -> bool:
        every = self._every_n_train_steps  # a batch may make several optimizer steps (GRPOModule's)
        if every >= 1 and trainer.global_step // every > self._step_before // every:
            return True
        if self._train_time_interval is None or self._last_time_checked is None:
            return False
        due = time.monotonic() - self._last_time_checked >= self._train_time_interval.total_seconds()
        return bool(trainer.strategy.broadcast(due))  # rank 0's clock decides, so every rank saves together

    @staticmethod
    def _stop_agreed(trainer: pl.Trainer) -> bool:
        """Whether any rank has a stop request (a collective under several processes, so all stop together)."""
        if trainer.world_size > 1:
            return bool(trainer.strategy.reduce_boolean_decision(STOP_SIGNAL.requested, all=False))
        return STOP_SIGNAL.requested

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's restore of a state checked whole first (``_check_lightning_state``: a corrupt or foreign one
        is refused naming the bad key or value, and leaves the callback as it was), except for a checkpoint saved in
        another folder (validated, or resumed by its path into a new run): this callback ranks no checkpoints and
        keeps this run's own ``last.ckpt``, so nothing of the other folder's applies, and Lightning's warning that its
        top-k state is not reloaded says nothing."""
        self._check_lightning_state(state_dict)
        if state_dict.get("dirpath", self.dirpath) == self.dirpath:
            super().load_state_dict(state_dict)

    def _check_lightning_state(self, state: Any) -> None:
        """Refuse, naming the bad key or value, a state that is not Lightning's ``ModelCheckpoint.state_dict`` (the
        keys Lightning writes; those its restore reads by name required, the others may be absent, as in an older
        Lightning's) with values of the types it writes. A key this Lightning does not write (another version's) is
        left to Lightning's restore, which reads its keys by name: an upgrade between runs keeps them resumable."""
        written = keys = tuple(super().state_dict())
        if isinstance(state, Mapping):
            keys += tuple(key for key in state if isinstance(key, str) and key not in keys)
        check_state_keys("a RunCheckpoint state", state, keys,
                         [key for key in keys if key not in ("best_model_score", "best_model_path")])
        prefix = "RunCheckpoint state "
        for key, value in state.items():
            if key not in written:  # another version's: Lightning's restore does not read it
                continue
            name = prefix + key
            if key == "dirpath":
                check_folder(name, value, "Lightning's checkpoint folder")
            elif key == "monitor" and not (value is None or isinstance(value, str)):
                raise ValueError(f"{name}={shown_value(value)} is not allowed; it must be None or a logged key (a "
                                 "string)")
            elif key in ("best_model_score", "current_score", "kth_value"):
                _check_score(name, value, none=key != "kth_value")
            elif key.endswith("_path") and not isinstance(value, str):
                raise ValueError(f"{name}={shown_value(value)} is not allowed; it must be a path (a string, empty "
                                 "for none)")
            elif key == "best_k_models":
                _check_scores_by_path(name, value)

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Lightning's save, or for a sharded checkpoint (a folder every rank writes, bypassing ``checkpoint_io``)
        a save into a staging folder that replaces ``filepath`` once every rank is done (``swap_in_staged``)."""
        if not _writes_a_folder(trainer.strategy):
            super()._save_checkpoint(trainer, filepath)
            return
        pid = trainer.strategy.broadcast(os.getpid())  # rank 0's: one staging folder for every rank
        if trainer.is_global_zero:
            remove_staged(filepath, pid)  # what a killed save of this process left
        trainer.strategy.barrier()
        super()._save_checkpoint(trainer, str(staging_path(filepath, pid)))
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            swap_in_staged(filepath, pid)
        trainer.strategy.barrier()
        self._last_checkpoint_saved = filepath

    def _save_last(self, trainer: pl.Trainer) -> None:
        if trainer.global_step == 0 or self._last_global_step_saved == trainer.global_step:
            return  # nothing trained yet, or this step is saved already
        started = time.perf_counter()
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        self.save_seconds += time.perf_counter() - started
        self.saves += 1
        self._last_time_checked = time.monotonic()

    def _stop(self, trainer: pl.Trainer, cut: bool = False) -> None:
        signum = STOP_SIGNAL.signum or 15  # a rank that got no signal itself stops as SIGTERM
        self._stopped = True
        self._announce(trainer, signum, cut)
        raise StopRequested(signum)

    def _announce(self, trainer: pl.Trainer, signum: int, cut: bool = False) -> None:
        """Where the run stopped, and the command that resumes it where a step was saved. ``cut``: in the middle
        of a validation, which ends there (it changes nothing of the training state, so nothing is lost)."""
        if not trainer.is_global_zero:
            return
        where = "before the first step" if trainer.global_step == 0 else f"after step {trainer.global_step}"
        if cut:
            where = (f"during the validation {where}, cut short (a validation changes nothing of the training "
                     "state: nothing is lost)")
        stopped = f"lit_grpo: stopped by {StopRequested(signum).signal_name} {where}"
        if not self.last_model_path or trainer.global_step == 0:
            print(f"{stopped}; nothing to save", flush=True)
            return
        path = shown_path(self.last_model_path)
        print(f"{stopped}; saved to {path}", flush=True)
        print(f"  resume: {self.resume_command or fit_resume(path)}", flush=True)


def _check_score(name: str, value: Any, none: bool = False) -> None:
    """Refuse, naming it, a ``ModelCheckpoint`` score that is not a real number or a tensor of one (or None where
    ``none``): a monitored metric's value, which may be infinite or NaN."""
    number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    if (value is None and none) or (isinstance(number, numbers.Real) and not isinstance(number, bool)):
        return
    raise ValueError(f"{name}={shown_value(value)} is not allowed; it must be " + ("None or " if none else "")
                     + "a score (a number, or a tensor of one)")


def _check_scores_by_path(name: str, value: Any) -> None:
    """Refuse, naming the bad entry, a ``best_k_models`` that is not a mapping of checkpoint paths to scores."""
    if not isinstance(value, Mapping) or not all(isinstance(path, str) for path in value):
        raise ValueError(f"{name}={shown_value(value)} is not allowed; it must be a mapping of checkpoint paths to "
                         "scores")
    for path, score in value.items():
        _check_score(f"{name}[{path!r}]", score)


def fit_resume(path: str) -> str:
    """How a script of its own resumes from the checkpoint at ``path``: ``trainer.fit``'s ``ckpt_path`` with the path
    itself, since its next run's default folder is another logger version, in which ``"last"`` finds nothing (the
    CLI's ``--ckpt_path last`` searches every version; ``RunCheckpoint.resume_command``)."""
    return f'trainer.fit(..., ckpt_path="{path}")'


def last_checkpoint_callback(trainer: pl.Trainer) -> ModelCheckpoint | None:
    """The callback that keeps the run's ``last.ckpt``: its ``RunCheckpoint``, else Lightning's first
    ``ModelCheckpoint`` (``trainer.checkpoint_callback``), which may be one that only keeps a history."""
    return next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, RunCheckpoint)),
                trainer.checkpoint_callback)


def _validation_follows(trainer: pl.Trainer) -> bool:
    """Whether the fit loop runs a validation right after this training batch (its own rule: the epoch, the batch
    or time interval, a stop; read from its private state, Lightning has no public view of it). A validation
    without batches (no held-out prompts: an empty val dataloader) is skipped before any validation hook, so it
    does not count; nor does one whose dataloaders are not set up yet (its batches unknown)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    check = getattr(loop, "_should_check_val_fx", None)
    if check is None or getattr(loop, "_skip_next_val", False) or getattr(loop.val_loop, "skip", True):
        return False
    return bool(check(trainer.fit_loop._data_fetcher))


def _writes_a_folder(strategy: Any) -> bool:
    """Whether ``strategy`` saves a checkpoint as a folder of shards (ModelParallelStrategy's default)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    # Lightning keeps this choice in a private field; it has no public view of it
    return isinstance(strategy, ModelParallelStrategy) and bool(getattr(strategy, "_save_distributed_checkpoint", True))


def _on_rank_zero_for_all(trainer: pl.Trainer, check: Callable[[], None]) -> None:
    """Run ``check`` on rank 0 and raise its error on every rank: a rank left out would wait at the next collective
    until it timed out (under torchrun or SLURM no launcher stops it). A collective: every rank calls it."""
    error = None
    if trainer.is_global_zero:
        try:
            check()
        except OSError as caught:  # a folder that cannot hold the checkpoints: a setting, said as one
            error = ConfigError(str(caught))
        except Exception as caught:  # whatever it is, every rank must learn of it
            error = caught
    error = trainer.strategy.broadcast(error)
    if error is not None:
        raise error


def checkpoint_bytes(pl_module: pl.LightningModule) -> int:
    """About what one checkpoint of ``pl_module`` takes on disk: its weights (GRPOModule's frozen reference model
    only where it saves it, ``saves_reference``: under FSDP or with a reference sync) and two AdamW moments per
    trainable parameter."""
    # From the parameters and buffers, not state_dict(): under FSDP2 that runs hooks with collectives.
    tensors = [*pl_module.named_parameters(), *pl_module.named_buffers()]
    saves_reference = getattr(pl_module, "saves_reference", None)
    saved_ref = saves_reference() if saves_reference is not None else bool(pl_module.hparams.get("fsdp", False))
    weights = sum(t.numel() * t.element_size() for name, t in tensors if saved_ref or not name.startswith("ref_model."))
    moments = 2 * sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
    return weights + moments
