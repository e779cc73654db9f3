"""``lit-grpo``: LightningCLI(GRPOModule, RolloutDataModule) with the ``fit`` and ``validate`` subcommands.

    lit-grpo fit --config configs/demo.yaml
    lit-grpo validate --config configs/demo.yaml            # greedy accuracy of the (untrained) policy
    lit-grpo fit --config configs/tiny.yaml --print_config  # the fully resolved configuration

Notes for configs: GRPOModule uses manual optimization, so ``trainer.gradient_clip_val`` and
``trainer.accumulate_grad_batches`` must stay unset (use ``model.max_grad_norm`` and
``model.train_micro_batch_size``); ``trainer.max_steps`` counts optimizer steps (training steps x num_iterations).

Multi-process and resume:

    lit-grpo fit --config configs/tiny.yaml --trainer.strategy ddp --trainer.devices 2 --trainer.accelerator cpu
    lit-grpo fit --config configs/fsdp_gpu.yaml            # FSDP2 (ModelParallelStrategy + model.fsdp: true)
    lit-grpo fit --config configs/tiny.yaml --ckpt_path last   # exact resume from the newest last.ckpt

A fit keeps ``last.ckpt`` current (``RunCheckpoint``: after each validation, every 30 minutes, at the end) and
stops cleanly on SIGTERM or Ctrl-C: it saves the last completed step, prints the command that resumes it and
exits 143 / 130.

``data.prompts_per_step`` is per rank. A checkpoint holds, besides weights, optimizer and loops, the DataModule's
state (steps built, the prompt sampler / curriculum, the global random states, and every rank's own engine state:
its rollout counter, scheduler state and carried groups), so steps K+1.. repeat an uninterrupted run's prompts,
completions, rewards and losses on every rank. A run that carries partial rollouts resumes with as many ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import inspect
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import traceback
import types
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, Optional, get_args

import torch
import yaml
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from jsonargparse import DefaultHelpFormatter, Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from lit_grpo.callbacks import ExportModel, FitSummary, GRPOProgressBar, RankFailureWatch, RunCheckpoint
from lit_grpo.callbacks.run_checkpoint import last_checkpoint_callback
from lit_grpo.callbacks._paths import shown_path
from lit_grpo.runtime.checkpoints import (CheckpointIdentity, SettingsDiffer, check_resumable, checkpoint_identity,
                                          find_last_checkpoint, finish_interrupted_swaps, run_checkpoint_folders)
from lit_grpo.runtime.distributed import RaisedOnEveryRank, data_parallel_only, is_multi_process
from lit_grpo.runtime.rank_failure import (RankPlace, end_failed_rank, end_unconnected_rank, ended_by_caller,
                                           launched_place, rank_place, watch_failures)
from lit_grpo.runtime.validation import ConfigError, available_cores, check_thread_count, config_errors
from lit_grpo.runtime.memory import DEFAULT_MMAP_THRESHOLD, fix_mmap_threshold
from lit_grpo.rollout.rewards import RewardFunctionError
from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.update.loss_config import LossConfig, unread_settings as loss_unread_settings
from lit_grpo.update.module import GRPOModule

SUBCOMMANDS = ("fit", "validate")

DESCRIPTION = """\
lit-grpo: GRPO training of language models with PyTorch Lightning and Infinite Sampling (the G completions of a
prompt decoded on g slots, so memory follows g, not G).

  lit-grpo fit --config configs/demo.yaml           train SmolLM2-135M-Instruct on arithmetic (CPU, minutes)
  lit-grpo validate --config configs/demo.yaml      greedy accuracy of the untrained policy
  lit-grpo fit --config configs/tiny.yaml           a tiny random model, seconds
  lit-grpo fit --config configs/demo.yaml --print_config    every option, resolved
  lit-grpo export --ckpt_path CKPT --out DIR        a transformers model directory (lit-grpo export --help)

A fit validates before its first step, keeps one checkpoint to resume from current (last.ckpt; --ckpt_path last
resumes it, and Ctrl-C or SIGTERM save the last step before stopping) and ends with a summary: accuracy before ->
after, reward, time per step, memory, and where the logs and the checkpoint are.
Then: tensorboard --logdir lightning_logs"""


class GRPOCLI(LightningCLI):
    """LightningCLI restricted to fit and validate, plus ``torch_num_threads`` and ``malloc_mmap_threshold``.

    ``torch_num_threads`` (top level of the config) calls ``torch.set_num_threads`` before the model is loaded. Left
    unset it is ``OMP_NUM_THREADS`` where the environment sets it (a launcher's choice: torchrun sets 1), else this
    process's share of the cores it may run on (``available_cores()`` divided by the trainer's devices per node,
    each a process of its own), so an idle machine is used whole and ranks on one node do not each take all of it:
    OpenMP threads spin-waiting for a core another process holds slow every parallel op down. For the same reason
    fewer threads can be faster on a CPU that other jobs keep busy (configs/demo.yaml says what it picks and why).

    ``malloc_mmap_threshold`` (top level, default 4 MiB) fixes glibc's mmap threshold before anything is built
    (``lit_grpo.runtime.memory.fix_mmap_threshold``): without it a CPU step's resident memory grows with the number
    of its micro-batches. It is process-wide, so it is set in ``lit-grpo``'s own process, not by the modules.
    """

    #: Under several processes, the ``--ckpt_path`` file and this rank's refusal of it (None: accepted), for every
    #: rank to compare and end on once they can talk (``_parse_ckpt_path``); None: one process, or no file given.
    _given_checkpoint: tuple[str, str | None] | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        command_args = kwargs.get("args")
        self.command_args = list(command_args) if command_args is not None else sys.argv[1:]
        try:
            super().__init__(*args, **kwargs)
        except (Exception, SystemExit) as error:
            if not (isinstance(error, SystemExit) and error.code in (0, None)):
                self._end_before_ranks_connect(error)
            raise

    def _end_before_ranks_connect(self, error: BaseException) -> None:
        """Before the ranks connect (no process group yet), in a run whose other ranks exist or will, an error on
        this rank alone (a model path missing on one node, a config file missing there) would leave them waiting
        in the process group's setup until its timeout: its record in the run's store ends them
        (``end_unconnected_rank``). The run's layout is read from the settings, or for a parse error from the
        launcher's environment (torchrun's, SLURM's: ``launched_place``). A run of one process, or a parse error
        whose layout no launcher gives (Lightning's own: said so), ends here at once; so do rank 0 of one
        node under Lightning's launcher and an error of the ranks' connecting itself (a rank that never came, the
        store's port taken), which no store is there to tell: with the node's ranks the launcher started, which
        would wait for this one's store."""
        if not torch.distributed.is_available() or torch.distributed.is_initialized():
            return  # main ends every rank
        config = getattr(self, "config", None)
        if config is None:  # the settings could not be read: the layout is known only from a launcher's environment
            place = launched_place()
            _say_unread_layout(place)
        else:
            place = planned_place((config[config.subcommand] if config.get("subcommand") else config).get("trainer"))
        if place is None:
            return
        if not place.others_wait or isinstance(error, torch.distributed.DistError):
            self._end_launched_ranks()
            return
        if isinstance(error, SystemExit):  # a bad setting, said already: its cause is what the others name
            status = error.code if isinstance(error.code, int) else 1
            end_unconnected_rank(error.__cause__ or error, place, exit_status=status, show_traceback=False)
        end_unconnected_rank(error, place)

    def _end_launched_ranks(self) -> None:
        """End the node's ranks that Lightning's launcher has started (in ``fit``, before the ranks connect): they
        would wait for this process's store until their own timeout, their launcher gone."""
        from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

        launcher = getattr(getattr(getattr(self, "trainer", None), "strategy", None), "launcher", None)
        if not isinstance(launcher, _SubprocessScriptLauncher) or not launcher.procs:
            return
        launcher.kill(signal.SIGKILL)
        for process in launcher.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # a process in a driver call may go only later
                process.wait(timeout=5)
        # its process observer would take their end for a failure and kill this process before its error is said
        launcher.procs.clear()

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name in SUBCOMMANDS}

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]):
        """The configured callbacks plus lit_grpo's defaults for what the config leaves out: FitSummary,
        RankFailureWatch (several processes), the GRPO progress bar (when the bar is on) and ``RunCheckpoint`` (when
        checkpointing is on): ``last.ckpt`` kept current, atomic saves, a saved stop on SIGTERM / Ctrl-C. Identical
        stateful callbacks are refused here, with their settings named. Then the threads, which depend on the
        trainer's devices per node."""
        given = config.get("callbacks")  # the Trainer takes one callback or a list of them
        configured = [*([] if given is None else given if isinstance(given, list) else [given]), *callbacks]
        if not any(isinstance(cb, FitSummary) for cb in configured):
            callbacks = [*callbacks, FitSummary()]
        if not any(isinstance(cb, RankFailureWatch) for cb in configured):
            callbacks = [*callbacks, RankFailureWatch()]
        if config.get("enable_progress_bar", True) is not False and not any(
                isinstance(cb, ProgressBar) for cb in configured):
            callbacks = [*callbacks, GRPOProgressBar()]
        if config.get("enable_checkpointing", True) is not False and not any(
                isinstance(cb, RunCheckpoint) for cb in configured):  # beside a ModelCheckpoint keeping a history too
            writers = [cb for cb in configured if isinstance(cb, ModelCheckpoint) and cb.save_last]
            if writers:
                raise ValueError(f"{type(writers[0]).__name__}(save_last={writers[0].save_last!r}) would write "
                                 "last.ckpt beside lit_grpo's RunCheckpoint, which keeps it current (atomic, saved "
                                 "on a stop): set its save_last to false, or configure a RunCheckpoint yourself")
            callbacks = [*callbacks, RunCheckpoint()]
        if self._given_checkpoint is not None:  # compared once the ranks can talk (_parse_ckpt_path)
            path, refused = self._given_checkpoint
            agreement = SameCheckpointOnEveryRank(Path(path), refused=refused, flag="--ckpt_path")
            agreement.check_before_setup_of(self.datamodule)
            callbacks = [*callbacks, agreement]
        check_distinct_stateful_callbacks([*configured, *callbacks])
        trainer = super()._instantiate_trainer(config, callbacks)
        data_parallel_only(trainer.strategy)
        self._settle_threads(trainer.num_devices)
        return trainer

    def _settle_threads(self, local_processes: int) -> None:
        """The threads of this process, where ``local_processes`` run on this node, and of the ranks it starts:
        ``torch_num_threads`` (set already), else ``OMP_NUM_THREADS`` where set (torch took it when it started),
        else this process's share of the cores. The ranks re-run this command and Lightning's launcher sets a share
        of its own unless ``OMP_NUM_THREADS`` is set, so the choice is handed to them there."""
        threads = self._get(self.config, "torch_num_threads")
        if threads is None:
            if "OMP_NUM_THREADS" in os.environ:
                return
            threads = max(1, available_cores() // local_processes)
            torch.set_num_threads(threads)
        if local_processes > 1:
            os.environ["OMP_NUM_THREADS"] = str(threads)

    def _parse_ckpt_path(self) -> None:
        """A ``--ckpt_path`` file is checked before anything loads it: a missing, cut-short or foreign file, or one
        trained with other settings, fails naming the file and what is wrong. (Lightning's own version of this
        hook loads the whole file and replaces the config's model settings with the checkpoint's; here the
        config stays what the user gave, and the settings that must agree are compared.) Under several processes,
        each of which loads the file itself and may see another one there (another node's, or one being replaced),
        the file and any refusal are compared once the ranks can talk, and a difference or a refusal ends every
        rank then; only a rank that no other waits for yet (Lightning's launcher of one node) ends on it at once."""
        self._given_checkpoint = None
        if not self.config.get("subcommand"):
            return
        config = self.config[self.config.subcommand]
        ckpt_path = config.get("ckpt_path")
        if ckpt_path and ckpt_path not in ("last", "best", "hpc", "registry") and "://" not in str(ckpt_path):
            refusal = _refusal("--ckpt_path", ckpt_path, config.get("model") or {}, config.get("data"),
                               evaluate=self.config.subcommand != "fit",
                               defaults=self._parser(self.config.subcommand).get_defaults(), unread=unread_settings)
            place = planned_place(config.get("trainer"))
            if refusal is not None and (place is None or not place.others_wait):
                _exit_with(refusal, self.config.subcommand)
            if place is not None:  # every rank must take part in the comparison: the ranks it will start too
                self._given_checkpoint = (str(ckpt_path), None if refusal is None else str(refusal))

    def before_fit(self) -> None:
        """``--ckpt_path last``: the newest ``last.ckpt`` of any run under this one's root (Lightning's own looks in
        the new run's folder only), checked like any other, and continued in its folder."""
        config = self.config_init[self.subcommand]
        ckpt_path = config.get("ckpt_path")
        checkpoint = last_checkpoint_callback(self.trainer)
        if isinstance(checkpoint, RunCheckpoint):
            checkpoint.resume_command = resume_command(self.command_args)
        if ckpt_path == "last":
            root, found = self._last_checkpoint(evaluate=False)
            if found is None:
                rank_zero_info(f"lit_grpo: --ckpt_path last: no last.ckpt under {root} yet; starting a new run")
                config["ckpt_path"] = None
                return
            rank_zero_info(f"lit_grpo: --ckpt_path last: resuming from {found}")
            _continue_in_folder_of(self.trainer, found)
            config["ckpt_path"] = str(found)

    def before_validate(self) -> None:
        """``--ckpt_path last``: the newest ``last.ckpt`` under the root, as ``fit`` finds it, whose weights are
        validated; with none there the command fails (it would validate the untrained model)."""
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") == "last":
            root, found = self._last_checkpoint(evaluate=True)
            # under several processes a rank ending now, before the ranks can talk, would leave those that found one
            # waiting to connect: SameCheckpointOnEveryRank ends every rank at setup instead
            if found is None and self.trainer.world_size == 1:
                _exit_with(ConfigError(_nothing_to_evaluate(root)), self.subcommand)
            if found is not None:
                rank_zero_info(f"lit_grpo: --ckpt_path last: validating {found}")
            config["ckpt_path"] = None if found is None else str(found)

    def _last_checkpoint(self, evaluate: bool) -> tuple[Path, Path | None]:
        """The root searched and the newest ``last.ckpt`` of any run under it (None: none yet), checked against
        this run's settings (``evaluate``: a run that only evaluates it)."""
        root, folders = self._checkpoint_folders()
        if rank_zero_only.rank == 0:  # a sharded save killed between its renames leaves no last.ckpt until then
            for folder in folders:  # other runs' folders too, maybe saving from other hosts: no deleting here
                finish_interrupted_swaps(folder, clean=False)
        found = find_last_checkpoint(folders)  # the same before and after rank 0's renames
        refusal = None if found is None else _refusal(
            "--ckpt_path last", found, self.model.hparams, getattr(self.datamodule, "hparams", None),
            evaluate=evaluate, defaults=self._parser(self.subcommand).get_defaults(), unread=unread_settings)
        if refusal is not None and isinstance(refusal.__cause__, SettingsDiffer):  # another experiment's run
            refusal = ConfigError(f"{refusal}\n--ckpt_path last takes the newest run under {root}, whatever its "
                                  "config: name the run you meant with --ckpt_path PATH, or give each experiment its "
                                  "own trainer.default_root_dir")
        if self.trainer.world_size > 1:  # each rank looked on its own, before the ranks can talk: compared, and a
            # refusal ended on by every rank, once they can (a rank ending alone now would leave the others waiting)
            missing = _nothing_to_evaluate(root) if evaluate else None
            agreement = SameCheckpointOnEveryRank(found, missing, root, None if refusal is None else str(refusal))
            agreement.check_before_setup_of(self.datamodule)
            self.trainer.callbacks.append(agreement)
        elif refusal is not None:
            _exit_with(refusal, self.subcommand)
        return root, found

    def _checkpoint_folders(self) -> tuple[Path, list[Path]]:
        """Where this run's checkpoints go (the root) and the folders ``--ckpt_path last`` looks in."""
        checkpoint = last_checkpoint_callback(self.trainer)
        if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath is not None:
            return Path(checkpoint.dirpath), [Path(checkpoint.dirpath)]
        logger = self.trainer.logger
        root = Path(getattr(logger, "root_dir", None) or self.trainer.default_root_dir)  # save_dir/name
        return root, run_checkpoint_folders(root)

    def after_fit(self) -> None:
        """Under the fit summary: the command that turns the run's checkpoint into a transformers model directory,
        unless an ``ExportModel`` callback wrote one already (it prints its own line)."""
        trainer = self.trainer
        if not trainer.is_global_zero or any(isinstance(cb, ExportModel) for cb in trainer.callbacks):
            return
        checkpoint = last_checkpoint_callback(trainer)
        path = getattr(checkpoint, "last_model_path", None) if isinstance(checkpoint, ModelCheckpoint) else None
        if path and Path(path).is_file():
            print(f"  {'export':<14} {export_command(path)}", flush=True)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--torch_num_threads", type=Optional[int], default=None,
                            help="torch.set_num_threads(N) before building anything (None: OMP_NUM_THREADS where "
                                 "set, else this process's share of the cores: the cores it may run on divided "
                                 "by the devices per node)")
        parser.add_argument("--malloc_mmap_threshold", type=Optional[int], default=DEFAULT_MMAP_THRESHOLD,
                            help="glibc's mmap threshold in bytes, fixed at start: larger freed blocks go back to "
                                 "the system at once, so a CPU step's memory does not grow with G (null: glibc's "
                                 "own, self-raising; MALLOC_MMAP_THRESHOLD_ in the environment wins)")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        with self._config_errors():
            check_groups_are_mappings(config, self._parser(self.subcommand).get_defaults())
            check_manual_optimization_settings(config.get("trainer") or {})
            check_accelerator((config.get("trainer") or {}).get("accelerator"))
            check_processes(config.get("trainer") or {})
            if self.subcommand == "fit" and (config.get("trainer") or {}).get("limit_train_batches") == 0:
                raise ValueError("trainer.limit_train_batches=0 trains no step, so fit would only validate: remove "
                                 "it, or run lit-grpo validate")
            threads = config.get("torch_num_threads")
            if threads is not None:
                try:
                    check_thread_count("torch_num_threads", threads)
                except ValueError as error:
                    raise ValueError(f"{error}, or null for OMP_NUM_THREADS where set, else this process's share of "
                                     "those cores") from None
            threshold = config.get("malloc_mmap_threshold")
            if threshold is not None:
                fix_mmap_threshold(threshold)
        if threads is not None:  # else OMP_NUM_THREADS, which torch took when it started, or _settle_threads
            torch.set_num_threads(threads)

    def _set_seed(self) -> None:
        with self._config_errors():
            try:
                super()._set_seed()
            except ValueError as error:  # outside numpy's range: Lightning's message does not name the setting
                raise ValueError(f"seed_everything={self._get(self.config, 'seed_everything')!r}: {error}") from None

    def instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        with self._config_errors(), warnings_at_settings(config, self.command_args):
            super().instantiate_classes()

    def _run_subcommand(self, subcommand: str) -> None:
        # a setting found bad while the run sets itself up (the prompts, the model, a checkpoint path) is reported
        # like a parse error; any other error keeps its traceback. Under several processes the failure watch starts
        # before the ranks connect: a rank that failed before then ends this one (RankFailureWatch starts later)
        place = rank_place(self.trainer.strategy)
        watch = None if place is None or torch.distributed.is_initialized() else watch_failures(place)
        try:
            try:
                super()._run_subcommand(subcommand)
            except OSError as err:
                raise unwritable_run_folder(err, self._run_folders()) or err
        except ConfigError as err:
            if is_multi_process():
                # a setting may be bad on one rank only (micro_group_size auto from its own GPU's free memory): its
                # exit must be recorded for the others, which would wait for it in a collective or at their next one
                _say_config_error(err, subcommand)
                end_failed_rank(err, exit_status=2, show_traceback=False)
            _exit_with(err, subcommand)
        except RewardFunctionError as err:
            if is_multi_process():
                raise  # main ends every rank, naming this one's error
            _exit_on_reward_error(err)
        finally:
            if watch is not None:
                watch.set()

    def _run_folders(self) -> list[Path]:
        """The folders this run writes its logs, config and checkpoints under: the trainer's root and its loggers'."""
        loggers = self.trainer.loggers
        folders = [getattr(logger, "root_dir", None) or getattr(logger, "save_dir", None) for logger in loggers]
        return [Path(folder) for folder in (self.trainer.default_root_dir, *folders) if folder is not None]

    @contextlib.contextmanager
    def _config_errors(self) -> Iterator[None]:
        """A bad value in the config (a ValueError, a TypeError or Lightning's MisconfigurationException while the
        classes are built from it: a YAML list where a mapping belongs, ``trainer.devices: 0``) ends a command's
        run with its message, as a parse error does, not with a traceback; in Python (``build_cli(run=False)``)
        it is raised."""
        try:
            yield
        except (ValueError, TypeError, MisconfigurationException) as err:
            if self.subcommand is None:
                raise
            if not isinstance(err, ValueError):
                err = ValueError(f"{type(err).__name__}: {err}")
            config = self.config[self.subcommand]
            keys = config.keys()
            message = optional_group_reason(str(err), keys, building=True)
            if owner := configured_class_key(config, message):  # a class built from a list: named with its key
                message = f"{owner}: {message}"
            _exit_with(qualified_error(ValueError(message), keys), self.subcommand)


_LEADING_SETTING = re.compile(r"^([A-Za-z_][\w.]*)=")


def qualified_error(error: ValueError, keys: Sequence[str]) -> ValueError:
    """``error`` with the setting its message starts with (``sampling.temperature=-1.0 must be ...``: a class
    names its own field) named by its full config key (``data.sampling.temperature=...``), where exactly one of
    ``keys`` (the config's dotted keys) ends with it; else ``error`` itself."""
    match = _LEADING_SETTING.match(str(error))
    if match is None:
        return error
    name = match.group(1)
    owners = [key for key in keys if key.endswith("." + name)]
    if len(owners) != 1 or name in keys:
        return error
    return ValueError(owners[0] + str(error)[len(name):])


#: The top-level packages of the code that builds the configured classes: a warning a class's constructor raises
#: for its caller (``stacklevel=2``, right in Python) lands there under the CLI.
_BUILDERS = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "jsonargparse", "warnings")


def _is_builder(frame: types.FrameType) -> bool:
    return str(frame.f_globals.get("__name__", "")).split(".")[0] in _BUILDERS


@contextlib.contextmanager
def warnings_at_settings(config: Namespace, args: Sequence[str]) -> Iterator[None]:
    """Re-issue the warnings raised in this block (the configured classes being built) where the user can act on
    them: a class warns at its constructor's caller, here Lightning's and jsonargparse's code, so such a warning
    names its setting by its full key (``warned_setting`` in ``config``) and points at the line of the config file
    that sets it (``setting_location`` over the command's ``args``), else at the line of the class that warned.
    Others keep their place. The user's filters apply where a warning is raised (an error filter, ``-W error``, raises
    it there, in the class that warned) and again to the re-issued warnings, as placed."""
    caught: list[tuple[warnings.WarningMessage, dict[str, Any], tuple[str, int, dict[str, Any]] | None]] = []

    def record(message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: Any) -> None:
        frames, frame = [], sys._getframe(1)
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        at = next((i for i, f in enumerate(frames) if (f.f_code.co_filename, f.f_lineno) == (filename, lineno)), None)
        placed = None if at is None else frames[at]
        # the code that warned, called by the builder: not the builder's own warnings (a deprecation of its own)
        warned = next((f for f in frames[:at] if not _is_builder(f)), None) if at is not None else None
        caught.append((warnings.WarningMessage(message, category, filename, lineno),
                       {} if placed is None else placed.f_globals,
                       None if warned is None or not _is_builder(placed)
                       else (warned.f_code.co_filename, warned.f_lineno, warned.f_globals)))

    try:
        with warnings.catch_warnings():
            warnings.showwarning = record
            yield
    finally:
        for caught_warning, module_globals, warned in caught:
            message, filename, lineno = caught_warning.message, caught_warning.filename, caught_warning.lineno
            if warned is not None:
                filename, lineno, module_globals = warned
                message = warned_setting(str(message), config)
                setting = _LEADING_SETTING.match(message)
                filename, lineno = (setting and setting_location(setting.group(1), args)) or (filename, lineno)
            warnings.warn_explicit(message, caught_warning.category, filename, lineno,
                                   module=module_globals.get("__name__"),
                                   registry=module_globals.setdefault("__warningregistry__", {}) if module_globals
                                   else None)


def warned_setting(message: str, config: Namespace) -> str:
    """A class's warning ``message`` with the setting it starts with (``min_lr_ratio=0.5 is ...``) named by its full
    key in ``config`` (``qualified_error``), where the config holds that value there; else ``message`` as it is: a
    class listed in a setting (a callback) has settings that are no config keys, one maybe named as a key is."""
    named = str(qualified_error(ValueError(message), list(config.keys())))
    if named == message:
        return message
    key = _LEADING_SETTING.match(named).group(1)
    value = config.get(key)
    return named if named[len(key) + 1:].startswith((repr(value), str(value))) else message


def setting_location(key: str, args: Sequence[str]) -> tuple[str, int] | None:
    """The config file (as ``args`` give it with ``--config``) and the line in it (from 1) that sets ``key`` (a dotted
    config key), where the last of ``args`` to set it is a config file; None where it is the command line itself, or
    nothing."""
    found = None
    for at, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name == f"--{key}":
            found = None
        elif name == "--config" and (equals or at + 1 < len(args)):
            path = value if equals else args[at + 1]
            line = yaml_key_line(path, key)
            found = (path, line) if line is not None else found
    return found


def yaml_key_line(path: str, key: str) -> int | None:
    """The line (from 1) of the YAML file ``path`` where the dotted ``key`` is set, nested mapping by mapping; None
    where it is not, or ``path`` is no readable YAML file."""
    try:
        node = yaml.compose(Path(path).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    line = None
    for part in key.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        entry = next(((name, value) for name, value in node.value if name.value == part), None)
        if entry is None:
            return None
        line, node = entry[0].start_mark.line + 1, entry[1]
    return line


def unread_settings(name: str, group: dict[str, Any]) -> set[str]:
    """The fields of the module's group of settings ``name`` that a resumed run with the values ``group`` never
    reads (the loss's for another loss type or without the KL, the starting ``entropy_coef`` under the adaptive
    control, a sampler correction's bounds with mode none): a resume does not compare them (``check_resumable``)."""
    if name == "loss":
        adaptive = group.get("use_adaptive_entropy", LossConfig.use_adaptive_entropy)
        unread = loss_unread_settings(group.get("loss_type", LossConfig.loss_type),
                                      group.get("beta", LossConfig.beta), adaptive)
        # the adaptive control's checkpointed state holds the coefficient a resume goes on from: the starting one
        # is read only at a run's start
        return unread | {"entropy_coef"} if adaptive else unread
    if name == "sampler_correction" and group.get("mode") == "none":
        return {"clip_min", "clip_max"}
    return set()


def unwritable_run_folder(error: OSError, folders: Sequence[Path]) -> ConfigError | None:
    """``error`` (Lightning or a logger creating the run's folders) as a bad setting where it names one of
    ``folders`` (the run's), or a folder above one, that could not be made; else None."""
    if error.filename is None:
        return None
    failed = Path(os.path.abspath(error.filename))
    if not any(failed == folder or failed in folder.parents for folder in map(Path.absolute, folders)):
        return None
    return ConfigError(f"the run's folder {error.filename} cannot be created ({error.strerror or error}): set "
                       "trainer.default_root_dir (or the logger's save_dir) to a folder that can be written")


def _nothing_to_evaluate(root: Path) -> str:
    return f"--ckpt_path last: no last.ckpt under {root} to validate; give a checkpoint path"


def _refusal(flag: str, *args: Any, **kwargs: Any) -> ConfigError | None:
    """Why ``check_resumable(*args, **kwargs)`` refuses the checkpoint, as a bad setting named ``flag`` (None: it
    does not)."""
    try:
        with config_errors(flag):
            check_resumable(*args, **kwargs)
    except ConfigError as err:
        return err
    return None


def planned_place(trainer: Any) -> RankPlace | None:
    """This process's place in the run the ``trainer`` settings (the config's, not yet built) describe, as the
    Trainer would set it from them and the launcher's environment (``RANK``, ``NODE_RANK``, ``LOCAL_RANK``, SLURM's
    ...); None for one process, or where the settings are not what a Trainer takes (every rank finds that)."""
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    trainer = trainer or {}

    def plain(name: str) -> str:  # a strategy or accelerator given as a class (a mapping here) counts no processes
        value = trainer.get(name, "auto")
        return value if isinstance(value, str) else "auto"

    try:
        connector = _AcceleratorConnector(devices=trainer.get("devices", "auto"), num_nodes=trainer.get("num_nodes", 1),
                                          accelerator=plain("accelerator"), strategy=plain("strategy"))
        return rank_place(connector.strategy)
    except Exception:
        return None


def _say_unread_layout(place: RankPlace | None) -> None:
    """Say what is known of the run's layout where this process's settings could not be read: its place as the
    launcher's environment gives it (``place``), or, in a run of several nodes under Lightning's own launcher
    (``NODE_RANK`` set), that the other ranks are not told."""
    if place is not None:
        print(f"lit-grpo: the settings could not be read; this process's place comes from its launcher's environment:"
              f" rank {place.rank} of {place.world}, the run's store at {place.address}:{place.port}",
              file=sys.stderr, flush=True)
    elif "NODE_RANK" in os.environ:
        print(f"lit-grpo: the settings could not be read, so this process's place in the run is unknown (NODE_RANK="
              f"{os.environ['NODE_RANK']} but no world size: Lightning's launcher takes it from trainer.num_nodes and "
              "trainer.devices; torchrun and SLURM give it): the other ranks are not told, and wait for this one "
              "until their process group's timeout", file=sys.stderr, flush=True)


def _exit_with(error: Exception, subcommand: str) -> None:
    """End a command's run on a bad setting as a parse error does: its message, a tip, exit status 2."""
    _say_config_error(error, subcommand)
    raise SystemExit(2) from error


def _say_config_error(error: Exception, subcommand: str) -> None:
    print(f"error: {error}\ntip: lit-grpo {subcommand} --help lists the options", file=sys.stderr)


def _is_lit_grpo_frame(frame: types.TracebackType) -> bool:
    """A frame of lit_grpo's calling of a reward function (its scoring and its event loop), not of a built-in
    function's own code."""
    from lit_grpo.rollout import async_loop, rewards

    return frame.tb_frame.f_code.co_filename in (rewards.__file__, async_loop.__file__)


def _exit_on_reward_error(error: RewardFunctionError) -> NoReturn:
    """End the run on a reward function's error with that function's own frames, then the message naming it and the
    prompt; exit status 1. The frames of lit_grpo and Lightning above its call point at nothing its author can
    fix, and would push its frames out of view."""
    cause = error.__cause__
    if cause is not None and cause.__traceback__ is not None:
        # the traceback's first frames are lit_grpo's calls of the function; a function's own frames follow
        frames = cause.__traceback__
        while frames.tb_next is not None and _is_lit_grpo_frame(frames):
            frames = frames.tb_next
        print("".join(traceback.format_exception(type(cause), cause, frames)), file=sys.stderr)
    # skip_group only helps where a group fails alone; a function that fails on the whole batch fails under it too
    tip = ("\ntip: data.on_reward_error: skip_group scores the other groups and gives the failing ones no loss"
           if error.group is not None else "")
    print(f"error: {error}{tip}", file=sys.stderr)
    raise SystemExit(1) from error


#: The trainer precisions GRPOModule runs under, each with Lightning's short name after it.
PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16", "16-mixed", "16")


def check_groups_are_mappings(config: Namespace, defaults: Namespace) -> None:
    """Refuse a list given for a group of settings (a settings dataclass such as ``data.sampling``), which the
    parser would otherwise take positionally, field by field in declaration order."""
    for key, default in defaults.items(branches=True):
        if not isinstance(default, Namespace):
            continue
        with contextlib.suppress(KeyError, AttributeError):  # under a group given as a list itself
            value = config.get(key)
            if isinstance(value, (list, tuple)):
                names = list(vars(default))
                raise ValueError(f"{key}={value!r} must be a mapping of its settings by name ({', '.join(names[:4])}"
                                 f"{', ...' if len(names) > 4 else ''}), not a list")


def check_manual_optimization_settings(trainer: Any) -> None:
    """``GRPOModule`` steps its optimizer itself, so Lightning's clipping and accumulation cannot apply; name the
    module's own settings instead of Lightning's advice to switch to automatic optimization."""
    for name in ("gradient_clip_val", "gradient_clip_algorithm"):
        if trainer.get(name) is not None:
            raise ValueError(f"trainer.{name}={trainer[name]!r} does not apply to GRPOModule (it steps its optimizer "
                             "itself): set model.max_grad_norm instead")
    if trainer.get("accumulate_grad_batches", 1) != 1:
        raise ValueError(f"trainer.accumulate_grad_batches={trainer['accumulate_grad_batches']!r} does not apply to "
                         "GRPOModule (a step's rows are already accumulated in micro-batches): set "
                         "model.train_micro_batch_size, the rows per backward pass, instead")
    precision = trainer.get("precision")
    if precision is not None and str(precision) not in PRECISIONS:
        # Lightning's "-true" plugins convert every batch, which a rollout batch (frozen dataclasses) cannot take
        raise ValueError(f"trainer.precision={precision!r} is not supported; use one of {list(PRECISIONS[::2])} "
                         "(for weights held in bf16: model.dtype: bfloat16 under 32-true or bf16-mixed)")


def check_accelerator(accelerator: Any) -> None:
    """Refuse a GPU ``trainer.accelerator`` on a machine without one torch can use, before a model is loaded for
    it: Lightning says only "No supported gpu backend found!", once the model is built."""
    if accelerator not in ("gpu", "cuda") or torch.cuda.is_available():
        return
    if accelerator == "gpu" and torch.backends.mps.is_available():  # Lightning's "gpu" is CUDA or Apple's MPS
        return
    raise ValueError(f"trainer.accelerator={accelerator!r}, but torch finds no GPU on this machine "
                     "(torch.cuda.is_available() is False): use 'cpu', or 'auto' for whatever is here")


def check_processes(trainer: Any) -> None:
    """Refuse a ``trainer.strategy`` name, ``trainer.devices`` or ``trainer.num_nodes`` Lightning would refuse,
    naming the setting and what it takes: Lightning's own messages name neither the setting's key nor, for
    devices, what is allowed (``Trainer(devices='0')`` is not a valid input). Classes and values Lightning takes
    are left to it."""
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = trainer.get("strategy")
    if isinstance(strategy, str) and strategy.lower() != "auto" and strategy.lower() not in StrategyRegistry:
        names = ["auto", *StrategyRegistry.available_strategies()]
        close = difflib.get_close_matches(strategy.lower(), names, n=1)
        plain = [name for name in names if "find_unused_parameters" not in name]  # not each ddp one's two variants
        meant = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"trainer.strategy={strategy!r} is not known{meant}; use one of {plain} (the ddp ones also "
                         "as NAME_find_unused_parameters_true or _false), or a Strategy class (class_path, init_args)")
    nodes = trainer.get("num_nodes")
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1):
        raise ValueError(f"trainer.num_nodes={nodes!r} is not allowed; trainer.num_nodes must be an integer >= 1")
    devices = trainer.get("devices")
    if devices is None or devices == "auto":
        return
    count = _int_or_none(devices) if isinstance(devices, (int, str)) and not isinstance(devices, bool) else None
    shown = count if count is not None and str(devices).strip() == str(count) else repr(devices)  # '0' read as 0
    accelerator = trainer.get("accelerator")
    on_cpu = accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available()
                                      and not torch.backends.mps.is_available())
    if on_cpu:
        if count is None or count < 1:
            raise ValueError(f"trainer.devices={shown} is not allowed; on the CPU trainer.devices must be a number "
                             "of processes >= 1, or 'auto'")
        return
    listed = isinstance(devices, list) and devices and all(isinstance(i, int) and i >= 0 for i in devices)
    if not (listed or (count is not None and (count >= 1 or count == -1)) or (
            count is None and isinstance(devices, str) and re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*,?", devices))):
        raise ValueError(f"trainer.devices={shown} is not allowed; trainer.devices must be a number of devices >= 1, "
                         "-1 (all of them), 'auto', or a list of device indices such as [0, 1]")


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def resume_command(args: Sequence[str]) -> str:
    """The command that resumes this run: its own arguments with ``--ckpt_path last``."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return shlex.join(["lit-grpo", *kept, "--ckpt_path", "last"])


def export_command(ckpt_path: str | os.PathLike) -> str:
    """``lit-grpo export --ckpt_path CKPT --out DIR`` for a checkpoint, writing ``model/`` beside its run's logs;
    paths relative to the working directory where they lie under it."""
    path = Path(ckpt_path).resolve()
    run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return shlex.join(["lit-grpo", "export", "--ckpt_path", shown_path(path), "--out", shown_path(run / "model")])


def _continue_in_folder_of(trainer: Any, checkpoint: Path) -> None:
    """Log to the version whose ``checkpoints/`` holds ``checkpoint`` (TensorBoard's logger), so a resumed run keeps
    one folder: one curve in TensorBoard and one ``last.ckpt`` for the next ``--ckpt_path last``. CSV's logger
    starts a new version: its writer deletes the ``metrics.csv`` of a folder it continues."""
    logger = trainer.logger
    version = checkpoint.parent.parent
    if (isinstance(logger, TensorBoardLogger) and checkpoint.parent.name == "checkpoints"
            and version.parent.resolve() == Path(logger.root_dir).resolve()):
        logger._version = version.name  # no public setter; read lazily, when the first thing is logged


class SameCheckpointOnEveryRank(Callback):
    """``--ckpt_path last`` under several processes: each rank finds the newest ``last.ckpt`` itself, before the
    process group exists (a rank started by torchrun or SLURM runs the CLI on its own), and loads what it found.
    Once the ranks can talk (``setup``, or the data module's before it: ``check_before_setup_of``; before Lightning
    restores anything) every rank's finding is gathered, and where any differs from rank 0's every rank ends on the
    same error: ranks that resumed different checkpoints (or one a checkpoint, another none) would train on as one
    run with different weights, steps and data states. A finding is compared by what identifies the checkpoint
    (``checkpoint_identity``: its path under ``root``, the folder searched, its step and content), not by its path,
    which differs between nodes that mount one file system at different places. ``missing``: where the command
    needs a checkpoint (``validate``), the error every rank ends on when no rank found one (None: none found is a
    new run). ``refused``: why this rank's checkpoint cannot be resumed; where any rank's is refused, every rank ends
    on the refusals first. ``flag``: ``--ckpt_path`` for a file given by its path, compared so too (each rank
    loads the file it sees there)."""

    def __init__(self, found: Path | None, missing: str | None = None, root: Path | None = None,
                 refused: str | None = None, flag: str = "--ckpt_path last") -> None:
        self.found = None if found is None else (str(found), checkpoint_identity(found, root))
        self.missing, self.refused, self.flag = missing, refused, flag
        self._checked = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._checked:
            return
        self._checked = True
        if not is_multi_process():
            check_no_checkpoint_refused([self.refused])
            return
        gathered: list[tuple[tuple[str, CheckpointIdentity] | None, str | None]] = [
            (None, None)] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, (self.found, self.refused))
        check_no_checkpoint_refused([refused for _, refused in gathered])
        found = [finding for finding, _ in gathered]
        check_same_checkpoint(found, self.flag)
        if found[0] is None and self.missing is not None:
            raise NoCheckpointFound(self.missing)

    def check_before_setup_of(self, datamodule: Any) -> None:
        """Compare the findings first thing in ``datamodule``'s ``setup`` (None: no data module), which Lightning
        calls before any callback's, once the ranks can talk: its prompts (a data set read, a task's generated)
        would be built on every rank only to end."""
        if datamodule is not None:
            datamodule.setup = _CheckedSetup(self, datamodule)


class _CheckedSetup:
    """A data module's own ``setup``, after ``agreement``'s check (an object, not a closure: a launcher that spawns
    the ranks pickles the data module)."""

    def __init__(self, agreement: SameCheckpointOnEveryRank, datamodule: Any) -> None:
        self.agreement = agreement
        self.datamodule = datamodule

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.agreement.setup(None, None, "")
        return type(self.datamodule).setup(self.datamodule, *args, **kwargs)


class CheckpointsDiffer(ConfigError, RaisedOnEveryRank):
    """The ranks found different checkpoints for ``--ckpt_path last`` (every rank raises it, by agreement)."""


class NoCheckpointFound(ConfigError, RaisedOnEveryRank):
    """No rank found a checkpoint for a command that needs one (every rank raises it, by agreement)."""


class CheckpointRefused(ConfigError, RaisedOnEveryRank):
    """A rank's checkpoint cannot be resumed (every rank raises it, by agreement)."""


def check_no_checkpoint_refused(refused: Sequence[str | None]) -> None:
    """Raise :class:`CheckpointRefused` where a rank's checkpoint was refused (``refused[rank]``: why, or None),
    naming each refusal once with the ranks it came from."""
    ranks: dict[str, list[int]] = {}
    for rank, reason in enumerate(refused):
        if reason is not None:
            ranks.setdefault(reason, []).append(rank)
    if ranks:
        raise CheckpointRefused("; ".join(f"rank {', '.join(map(str, where))}: {reason}"
                                          for reason, where in ranks.items()))


def check_same_checkpoint(found: Sequence[tuple[str, CheckpointIdentity] | None],
                          flag: str = "--ckpt_path last") -> None:
    """Raise :class:`CheckpointsDiffer` unless every rank's ``flag`` finding (``found[rank]``: the path it found, or
    was given with ``--ckpt_path``, and that checkpoint's identity, or None for none) identifies rank 0's checkpoint,
    naming rank 0's and each rank's that differs."""
    identity = lambda finding: None if finding is None else finding[1]  # noqa: E731
    differing = [rank for rank, finding in enumerate(found) if identity(finding) != identity(found[0])]
    if not differing:
        return
    others = "; ".join(f"rank {rank}: {_shown_finding(found[rank])}" for rank in differing)
    where = ("(one file system shared by every node, mounted anywhere, or a copy at the same place under the run's "
             "root); or give one checkpoint's path with --ckpt_path PATH" if flag == "--ckpt_path last" else
             "at that path (one file system shared by every node, or a copy of the file)")
    raise CheckpointsDiffer(f"{flag}: the ranks found different checkpoints: rank 0: {_shown_finding(found[0])}; "
                            f"{others}. Each rank loads the checkpoint itself, so every rank must see rank 0's "
                            f"checkpoint {where}")


def _shown_finding(finding: tuple[str, CheckpointIdentity] | None) -> str:
    if finding is None:
        return "no last.ckpt (a new run)"
    path, identity = finding
    step = "no step" if identity.global_step is None else f"step {identity.global_step}"
    return f"{path} ({identity.name}, {step}, content {identity.fingerprint})"


def check_distinct_stateful_callbacks(callbacks: list[Callback]) -> None:
    """Raise when two callbacks with a checkpointed state share a ``state_key`` (the same type and settings): their
    states would overwrite each other in a checkpoint."""
    seen: dict[str, Callback] = {}
    for callback in callbacks:
        if not is_overridden("state_dict", instance=callback, parent=Callback):
            continue
        if callback.state_key in seen:
            name = type(callback).__name__
            raise ValueError(f"two {name} callbacks with the same settings ({callback.state_key}): their checkpointed "
                             f"states would collide. Give the second one different settings (any of those named) "
                             f"or remove it from trainer.callbacks.")
        seen[callback.state_key] = callback


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help, with the description's line breaks kept."""


_NEGATIVE_NUMBER = re.compile(r"^-((\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|\.?(inf|infinity|nan))$", re.IGNORECASE)
#: Python's spellings of infinity and NaN, which the parser's YAML reads as text, as YAML spells them.
_NON_FINITE = {"inf": ".inf", "+inf": ".inf", "infinity": ".inf", "+infinity": ".inf", "-inf": "-.inf",
               "-infinity": "-.inf", "nan": ".nan", "+nan": ".nan", "-nan": ".nan"}


def takes_float(typehint: Any) -> bool:
    """Whether a setting of type ``typehint`` takes a float (``float``, ``float | None``, ``int | float``...)."""
    return typehint is float or any(takes_float(arg) for arg in get_args(typehint))


class GRPOArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose error for an option it does not know names the known one it most likely meant,
    and which leaves out the usage listing before an error (its length hid the one line that matters; ``--help``
    has it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # argparse would read --model.beta as --model.betas, the prefix of another setting
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})
        # a negative number in exponent notation (--model.lr -1e-5), or -inf, is a value too, not an unknown option
        # that left its setting without one; argparse knows only -1 and -0.5 (its own attribute: it has no setting)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        """A float setting's ``inf``, ``-inf`` or ``nan`` read as the number it spells, so that its class refuses it
        (``lr=inf is not allowed; lr must be a finite number > 0``) or takes it, as it does YAML's ``.inf``:
        jsonargparse read it as text and said only that it expected a float."""
        if takes_float(getattr(action, "_typehint", None)):
            arg_strings = [_NON_FINITE.get(value.strip().lower(), value) if isinstance(value, str) else value
                           for value in arg_strings]
        return super()._get_values(action, arg_strings)

    def parse_args(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Namespace:
        # kept for an error's account of every unknown key in the configs given (jsonargparse stops at the first)
        self._given_args = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, *rest, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        parser = getattr(ex, "subcommand_parser", None) or self
        shown = message
        if self.exit_on_error:  # the message shown; a nested type's parser raises it into its group's message
            message = optional_group_reason(message)
            shown = one_line_reason(message)
        known = _option_names(parser)
        also = other_unknown_keys(message, config_paths(getattr(self, "_given_args", [])), known)
        shown += did_you_mean(message, known) + trl_value_hint(message) + also
        try:
            super().error(shown, ex)
        except SystemExit as exit_:  # its cause is what a rank failing here records for the others to name
            raise exit_ from ConfigError(shown)

    def print_usage(self, file: Any = None) -> None:
        """Nothing: argparse prints the usage only before an error, and ``--help`` shows it."""


#: jsonargparse's account of a value no type of an optional setting's Union takes (``reference_sync:
#: ReferenceSync | None``): this line, the subtypes, then each type's reason as an indented list, then the value.
_UNION_FAILURE = "Does not validate against any of the Union subtypes"
#: A reason that says what type was expected but not what was given (an optional number's).
_BARE_TYPE = re.compile(r"Expected a <class '[\w.]+'>")
#: Any type's reason that names only the type expected (an int's, a Literal's).
_EXPECTED = re.compile(r"Expected a (.+)")
_NOT_NONE = "Expected a <class 'NoneType'>"
#: The list's reason where the value given is no list (one class spec, or a string that is not one).
_NOT_LIST = "Expected a <class 'list'>"
#: A list of classes or one of them (``trainer.callbacks``): a list given fails for its own reason; anything else
#: fails as the lone class, whose reason names the class spec and the option at fault.
_LIST_OR_ITEM = re.compile(r"Subtypes: \[list\[([\w.]+)\], <class '\1'>, <class 'NoneType'>\]")
#: One class or several of them, or a switch (``trainer.logger``): the lone class's reason applies, or the iterable's
#: where a list is given.
_ITEM_OR_ITERABLE = re.compile(r"Subtypes: \[<class '([\w.]+)'>, collections\.abc\.Iterable\[\1\], <class 'bool'>, "
                               r"<class 'NoneType'>\]")
_CLASS_PATH_PROBLEM = re.compile(r"Problem with given class_path '([\w.]+)':")


#: jsonargparse's refusal of one setting's value: its key on a line of its own, then the reason.
_KEY_THEN_REASON = re.compile(r'Parser key "([\w.]+)":\n\s+(Expected [^\n]*)')


#: jsonargparse's refusal of a ``--config`` path: nothing there, or no file.
_CONFIG_NOT_FOUND = re.compile(r"Parser key \"config\": (File does not exist|Path is not a file): '(.*)'", re.DOTALL)


def one_line_reason(message: str) -> str:
    """``KEY: REASON`` for jsonargparse's two-line refusal of one setting's value (``Parser key "KEY":`` then the
    reason), and ``--config FILE: no such file`` for its refusal of a config path, as the other refusals are said;
    any other ``message`` as it is."""
    if missing := _CONFIG_NOT_FOUND.fullmatch(message):
        path, found = Path(missing.group(2)).resolve(), "no such file" if "exist" in missing.group(1) else "not a file"
        where = "" if shown_path(path) == str(path) else f" ({path})"  # a relative path: where it was looked for
        return f"--config {shown_path(path)}: {found}{where}; --config takes a YAML file of settings"
    refused = _KEY_THEN_REASON.fullmatch(message)
    return f"{refused.group(1)}: {refused.group(2)}" if refused else message


def optional_group_reason(message: str, keys: Sequence[str] = (), building: bool = False) -> str:
    """The group's own reason for refusing a value, from jsonargparse's message for an optional settings group,
    which lists a reason for each type of the Union, the value's repr and the Union's spelling, the one line that
    names the bad setting and what is allowed lost among them; any other ``message`` as it is. ``keys``: the
    config's dotted keys, which name the setting in full (``qualified_error``). ``building``: the message is a
    class's refusal while the classes are built, not the parser's."""
    found = _own_reason(message, keys, building)
    if found is None:
        return message
    key, reason, nullable = found
    return f"{key + ': ' if key else ''}{reason}" + (f" (or {nullable}: null)" if nullable else "")


def _own_reason(message: str, keys: Sequence[str], building: bool = False) -> tuple[str | None, str, str | None] | None:
    """(the bad setting's key, its reason, the key that may be null instead) from the first optional Union's failure
    in ``message``; None where there is none, or its reasons are not one type's besides None's. An optional setting
    inside an optional group fails in the group's type's reason: read there, its key is the group's and its own."""
    failure = _union_failure(message.splitlines())
    if failure is None:
        return None
    group, subtypes, reasons, value = failure
    own = [lines for lines in reasons if lines != [_NOT_NONE]]
    classes = _LIST_OR_ITEM.fullmatch(subtypes) or _ITEM_OR_ITERABLE.fullmatch(subtypes)
    listed = classes is not None
    own_types = [lines for lines in own if len(lines) == 1 and _EXPECTED.fullmatch(lines[0])]
    if listed:  # the reason of the form given: the list's, or the lone class's where it is no list
        if _ITEM_OR_ITERABLE.fullmatch(subtypes):  # the lone class first, then the iterable
            own = own[1:2] if (value or "").startswith("[") and len(own) > 1 else own[:1]
        else:
            own = own[1:2] if own[0] == [_NOT_LIST] and len(own) > 1 else own[:1]
    elif len(own) == len(reasons) - 1 and len(own_types) == len(own) > 1:  # each type says only what it expects
        own = [["Expected a " + " or ".join(_EXPECTED.fullmatch(lines[0]).group(1) for lines in own_types)]]
    elif len(own) != 1 or len(reasons) != 2:
        return None
    head, rest = own[0][0], own[0][1:]
    class_path = _CLASS_PATH_PROBLEM.fullmatch(head)
    if rest and class_path:  # the group's own parser's message
        nested = _own_reason(textwrap.dedent("\n".join(rest)), keys, building)
        if nested is not None and nested[0] is not None and group is not None:
            key, reason, nullable = nested
            if listed:  # a setting of one class of the list: named inside its class
                named = f"{class_path.group(1)}."
                return group, f"{named}{key}: {reason}" + (f" (or {named}{nullable}: null)" if nullable else ""), None
            return f"{group}.{key}", reason, nullable and f"{group}.{nullable}"
    reason = re.sub(r"^Problem with given class_path '[\w.]+': ", "", " ".join(line.strip() for line in own[0]))
    if class_path:
        reason += class_path_hint(class_path.group(1), reason)
    elif listed:
        reason += short_name_hint(classes.group(1), reason)
    if listed:  # one class of several: named; a list given with a bad class is not meant to be null
        if class_path:
            reason = in_class(class_path.group(1), reason)
        elif building and (spec := re.search(r"Namespace\(class_path='([\w.]+)'", value or "")):
            # the first not yet built (those built show as objects); while parsing, a Namespace is an entry read
            # well, and the reason names the entry at fault by its value
            reason = in_class(spec.group(1), reason)
        return group, reason, None
    key = group
    if group and (inner := _PARSER_KEY.match(reason)):  # a setting inside the group
        key, reason = f"{group}.{inner.group(1)}", reason[inner.end():]
    elif group is None:  # the group's own check names its setting
        reason = str(qualified_error(ValueError(reason), keys))
        if (setting := _LEADING_SETTING.match(reason)) and "." in setting.group(1):
            group = setting.group(1).rsplit(".", 1)[0]
    if _BARE_TYPE.fullmatch(reason) or len(own_types) > 1:  # as jsonargparse says it where the value is not optional
        reason += f". Got value: {value}"
    return key, reason, group


#: jsonargparse's name for the setting of a class or group it refuses, before the reason.
_PARSER_KEY = re.compile(r'Parser key "([\w.]+)": ')


def in_class(class_path: str, reason: str) -> str:
    """``reason`` for refusing a setting of the class ``class_path`` (jsonargparse's ``Parser key "stop": ...``, or
    the class's own ``patience=0 must be ...``) naming it inside the class: ``lit_grpo.callbacks.RewardForecast.stop:
    ...``; a reason that names no setting follows the class's name."""
    if inner := _PARSER_KEY.match(reason):
        return f"{class_path}.{inner.group(1)}: {reason[inner.end():]}"
    if _LEADING_SETTING.match(reason):
        return f"{class_path}.{reason}"
    return f"{class_path}: {reason}"


def configured_class_key(config: Namespace, message: str) -> str | None:
    """The key of ``config`` (a subcommand's) that lists the class whose path ``message`` starts with
    (``trainer.callbacks`` for ``lit_grpo.callbacks.RewardForecast.patience=0 ...``); None where none does."""
    for key, value in config.items(branches=True):
        for spec in value if isinstance(value, list) else [value]:
            path = spec.get("class_path") if isinstance(spec, Namespace) else None
            if isinstance(path, str) and re.match(rf"{re.escape(path)}[.:]", message):
                return key
    return None


def _union_failure(lines: list[str]) -> tuple[str | None, str, list[list[str]], str | None] | None:
    """The first optional Union's failure in a message's ``lines``: the key the parser names before it (None if
    none), its ``Subtypes: [...]`` line, each type's reason (its lines, the first without its ``- ``, the others as
    indented), the value given."""
    at = next((i for i, line in enumerate(lines) if line.strip().removeprefix("- ") == _UNION_FAILURE), None)
    if at is None or at + 2 >= len(lines):
        return None
    subtypes, errors = lines[at + 1].strip(), lines[at + 2].strip()
    if not (subtypes.startswith("Subtypes: [") and "NoneType" in subtypes and errors == "Errors:"):
        return None
    # the nearest key named before it: a group's message names the group, then the setting in it that is bad
    named = next((match for line in reversed(lines[:at]) if (match := re.search(r'Parser key "([\w.]+)":', line))),
                 None)
    indent = _indent(lines[at])
    reasons: list[list[str]] = []
    end, item_indent = at + 3, 0
    while end < len(lines) and _indent(lines[end]) > indent:
        line = lines[end]
        if line.lstrip().startswith("- ") and (not reasons or _indent(line) <= item_indent):
            item_indent = _indent(line)
            reasons.append([line.lstrip()[2:]])
        elif reasons:
            reasons[-1].append(line)
        end += 1
    given = [line.strip().removeprefix("Given value: ") for line in lines[end:end + 2]
             if line.strip().startswith("Given value: ")]
    return (named.group(1) if named else None), subtypes, reasons, (given[0] if given else None)


def class_path_hint(class_path: str, reason: str) -> str:
    """`` (did you mean 'NAME'?)`` for jsonargparse's ``reason`` why ``class_path`` failed, where it names an option
    the class does not take or a class its module lacks, and a close name exists; else an empty string."""
    if option := re.fullmatch(r"Option '(\w+)' is not accepted", reason):
        module_name, _, name = class_path.rpartition(".")
        try:
            known = list(inspect.signature(getattr(importlib.import_module(module_name), name)).parameters)
        except (ImportError, AttributeError, TypeError, ValueError):
            return ""
        close = difflib.get_close_matches(option.group(1), known, n=1, cutoff=0.6)
        return f" (did you mean '{close[0]}'?)" if close else ""
    if missing := re.fullmatch(r"module '([\w.]+)' has no attribute '(\w+)'", reason):
        module_name = missing.group(1)
        try:
            known = [name for name in dir(importlib.import_module(module_name)) if not name.startswith("_")]
        except ImportError:
            return ""
        close = difflib.get_close_matches(missing.group(2), known, n=1, cutoff=0.6)
        return f" (did you mean '{module_name}.{close[0]}'?)" if close else ""
    return ""


def short_name_hint(base: str, reason: str) -> str:
    """`` (did you mean 'NAME'?)`` for jsonargparse's ``reason`` why a class named without its module
    (``RewardForcast``) is not one of the subclasses of ``base`` (a class path) it resolves such names among, where a
    close name exists; else an empty string."""
    given = re.fullmatch(r"Expected a dot import path string: (\w+)", reason)
    module_name, _, name = base.rpartition(".")
    try:
        base_class = getattr(importlib.import_module(module_name), name) if given else None
    except (ImportError, AttributeError):
        return ""
    if not isinstance(base_class, type):
        return ""
    close = difflib.get_close_matches(given.group(1), sorted(_short_names(base_class)), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _short_names(base: type) -> set[str]:
    """The names of ``base``'s subclasses (imported ones, at any depth) that a config may give without their module,
    as jsonargparse finds them: not defined inside a function, nor in a private module."""
    names, pending = set(), [base]
    while pending:
        cls = pending.pop()
        if "<locals>" not in cls.__qualname__ and "._" not in f"{cls.__module__}.{cls.__qualname__}":
            names.add(cls.__name__)
        pending.extend(cls.__subclasses__())
    return names


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _option_names(parser: argparse.ArgumentParser) -> list[str]:
    """Every option ``parser`` takes, its subcommands' included (argparse keeps those in ``_name_parser_map``)."""
    names = []
    for action in parser._actions:
        names.append(action.dest)
        for subparser in getattr(action, "_name_parser_map", {}).values():
            names.extend(_option_names(subparser))
    return names


#: An unknown config key in jsonargparse's messages (a group's keys are named relative to it).
_UNKNOWN_KEY = re.compile(r"(?:Group '([\w.]+)'|Subcommand '\w+') does not accept option '([\w.]+)'")


#: TRL GRPOConfig's names of settings lit_grpo names otherwise (docs/training.md maps them all).
TRL_NAMES = {"num_generations": "data.sampling.group_size", "max_completion_length": "data.sampling.max_new_tokens",
             "learning_rate": "model.lr", "per_device_train_batch_size": "model.train_micro_batch_size",
             "epsilon": "model.loss.epsilon_low", "use_bias_correction_kl": "model.loss.kl_bias_correction",
             "reward_weights": "data.reward_funcs", "adam_beta1": "model.betas", "adam_beta2": "model.betas",
             "lr_scheduler_type": "model.lr_schedule", "lr_scheduler_kwargs": "model.min_lr_ratio",
             "logging_steps": "trainer.log_every_n_steps", "num_train_epochs": "trainer.max_epochs",
             "sync_ref_model": "model.reference_sync", "ref_model_sync_steps": "model.reference_sync",
             "ref_model_mixup_alpha": "model.reference_sync",
             "vllm_importance_sampling_correction": "model.sampler_correction.mode",
             "vllm_importance_sampling_mode": "model.sampler_correction.mode",
             "vllm_importance_sampling_clip_max": "model.sampler_correction.clip_max",
             "vllm_importance_sampling_cap": "model.sampler_correction.clip_max",
             "vllm_importance_sampling_clip_min": "model.sampler_correction.clip_min",
             "shuffle_dataset": "data.curriculum", "num_generations_eval": "data.val_num_samples",
             "model_init_kwargs": "model.dtype", "torch_dtype": "model.dtype", "bf16": "trainer.precision",
             "fp16": "trainer.precision", "warmup_ratio": "model.warmup_steps",
             "output_dir": "trainer.default_root_dir", "eval_steps": "trainer.val_check_interval",
             "per_device_eval_batch_size": "data.val_batch_size",
             # TRL's ModelConfig and ScriptArguments, which `trl grpo --config` reads from the same flat YAML
             "model_name_or_path": "model.model", "dataset_name": "data.dataset", "dataset_train_split": "data.split",
             "reward_model_name_or_path": "data.reward_funcs", "seed": "seed_everything",
             "logging_dir": "trainer.default_root_dir", "resume_from_checkpoint": "ckpt_path",
             **dict.fromkeys(["use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
                              "lora_target_parameters", "lora_modules_to_save", "lora_task_type", "use_rslora",
                              "use_dora"], "model.peft_config")}
#: TRL's settings with no key of lit_grpo's to name instead: what takes their place.
TRL_ELSEWHERE = {
    "use_vllm": "has no counterpart: rollouts run on lit_grpo's own engine, data.sampling",
    "generation_batch_size": "has no counterpart: a step is one rollout of data.prompts_per_step prompts x "
                             "data.sampling.group_size completions",
    "steps_per_generation": "has no counterpart: a step is one rollout of data.prompts_per_step prompts x "
                            "data.sampling.group_size completions, model.num_iterations optimizer steps on it",
    "gradient_accumulation_steps": "has no counterpart: a step's micro-batches, model.train_micro_batch_size "
                                   "completions each, all accumulate into its one optimizer step",
    "max_prompt_length": "has no counterpart, nor has TRL 1.16",
    "save_steps": "is RunCheckpoint's every_n_train_steps here, in trainer.callbacks",
    "log_completions": "is the CompletionLogger callback here, in trainer.callbacks",
    "num_completions_to_print": "is the CompletionLogger callback's num_completions here, in trainer.callbacks",
    "generation_kwargs": "has no counterpart but its stop strings: data.sampling.stop_strings",
    "remove_unused_columns": "has no counterpart: every column but the prompt reaches the reward functions",
    "report_to": "has no counterpart: logs go to TensorBoard under trainer.default_root_dir (another Lightning "
                 "logger in trainer.logger)",
    "push_to_hub": "has no counterpart: lit-grpo export writes a model directory to upload",
    "trust_remote_code": "has no counterpart: a model is loaded without code of its own",
    "dataset_config": "has no counterpart: data.dataset reads local files or a saved dataset, nothing from the Hub",
}


#: TRL GRPOConfig's values of a setting lit_grpo spells otherwise (by the setting's last key part, then TRL's value
#: lowercased, as the parser shows it): what the value is here.
TRL_VALUES = {
    "scale_rewards": {"true": "TRL's scale_rewards: true is 'group' here",
                      "false": "TRL's scale_rewards: false is 'none' here"},
    "lr_schedule": {"constant_with_warmup": "TRL's lr_scheduler_type constant_with_warmup is 'constant' here, "
                                            "after model.warmup_steps",
                    "cosine_with_min_lr": "TRL's lr_scheduler_type cosine_with_min_lr is 'cosine' here, down to "
                                          "model.min_lr_ratio"},
}
#: jsonargparse's refusal of a value none of a setting's choices is.
_NOT_A_CHOICE = re.compile(r'Parser key "([\w.]+)":\s+Expected a typing\.Literal\[.*\]\. Got value: (\S+)\s*')


def trl_value_hint(message: str) -> str:
    """`` (TRL's ...)`` where the parser's ``message`` refuses a value of TRL's for a setting that lit_grpo spells
    otherwise (``TRL_VALUES``), saying what it is here; else an empty string."""
    refused = _NOT_A_CHOICE.fullmatch(message)
    if refused is None:
        return ""
    meaning = TRL_VALUES.get(refused.group(1).rsplit(".", 1)[-1], {}).get(refused.group(2).lower())
    return f" ({meaning})" if meaning else ""


def _meant_key(name: str, known: Sequence[str]) -> str | None:
    """The known option ``name`` most likely means: one with the same last part (``model.beta`` ->
    ``model.loss.beta``, not ``model.betas``), TRL's name's counterpart (``TRL_NAMES``), else the closest spelling;
    failing all three, the same for the key of a mapping put in the wrong place
    (``chat_template_kwargs.enable_thinking`` -> ``data.chat_template_kwargs``)."""
    meant = _meant_whole_key(name, known)
    groups = {key.rsplit(".", 1)[0] for key in known} | set(known)
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if meant is not None or ".".join(parts[:end]) in groups:  # a known group's own key is what is wrong
            break
        meant = _meant_whole_key(".".join(parts[:end]), known)
    return meant


def _meant_whole_key(name: str, known: Sequence[str]) -> str | None:
    last = name.rsplit(".", 1)[-1]
    if name in TRL_NAMES and TRL_NAMES[name] in known:  # TRL's flat name, before a nested key that shares it
        return TRL_NAMES[name]
    same_last = [key for key in known if key.rsplit(".", 1)[-1] == last]
    if same_last:
        return max(same_last, key=lambda key: difflib.SequenceMatcher(None, name, key).ratio())
    if last in TRL_NAMES and TRL_NAMES[last] in known:
        return TRL_NAMES[last]
    if last in TRL_ELSEWHERE:  # said in its note, not taken for a key spelled alike
        return None
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    return close[0] if close else None


def config_paths(args: Sequence[str]) -> list[str]:
    """The files given with ``--config`` in ``args`` (``--config F`` or ``--config=F``), in order."""
    paths = [arg.split("=", 1)[1] for arg in args if arg.startswith("--config=")]
    paths += [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--config"]
    return paths


#: Keys inside a setting that take a class or a mapping: their contents are that class's, not options.
_OPAQUE_KEYS = {"class_path", "init_args", "dict_kwargs"}


def unknown_config_keys(config: Any, known: Sequence[str], prefix: str = "") -> list[str]:
    """The dotted keys of a loaded YAML ``config`` that no option in ``known`` takes: a known option's value is
    taken whole; a key that only begins known options (a section) is looked into."""
    known_set = set(known)
    sections = {key.rsplit(".", n)[0] for key in known for n in range(1, key.count(".") + 1)}
    unknown = []
    for key, value in (config.items() if isinstance(config, dict) else ()):
        name = f"{prefix}{key}"
        if key in _OPAQUE_KEYS or (name in known_set and name not in sections):
            continue
        if name in sections and isinstance(value, dict):
            unknown += unknown_config_keys(value, known, f"{name}.")
        elif name not in known_set:
            unknown.append(name)
    return unknown


def other_unknown_keys(message: str, paths: Sequence[str], known: Sequence[str]) -> str:
    """Where ``message`` refuses one unknown key of a config file in ``paths`` (the parser stops at the first), the
    file's other unknown keys, one a line, each with the option it likely means; else an empty string. A port of
    TRL's flat config gets all its renames at once."""
    refused = _UNKNOWN_KEY.search(message)
    if refused is None:
        return ""
    first = f"{refused.group(1)}.{refused.group(2)}" if refused.group(1) else refused.group(2)
    for path in paths:
        try:
            unknown = unknown_config_keys(yaml.safe_load(Path(path).read_text()), known)
        except (OSError, yaml.YAMLError):
            continue
        if first not in unknown:
            continue
        others = [name for name in unknown if name != first]
        if not others:
            return ""
        shown = [f"'{name}'" + did_you_mean(f"unrecognized arguments: --{name}", known) for name in others]
        return f"\n{path} also holds these unknown keys:\n  " + "\n  ".join(shown)
    return ""


def _trl_note(name: str) -> str | None:
    """What takes the place of TRL's setting ``name`` (its last part), where lit_grpo has no key for it."""
    last = name.rsplit(".", 1)[-1]
    if last.startswith("vllm_") and last not in TRL_ELSEWHERE:
        last = "use_vllm"
    return f"TRL's {name.rsplit('.', 1)[-1]} {TRL_ELSEWHERE[last]}" if last in TRL_ELSEWHERE else None


def did_you_mean(message: str, known: Sequence[str]) -> str:
    """`` (did you mean 'KEY'?)`` for the unknown option(s) of a parser's ``message``, each with the one of
    ``known`` closest to it (where one is close), else an empty string."""
    if match := _UNKNOWN_KEY.search(message):
        unknown = [f"{match.group(1)}.{match.group(2)}" if match.group(1) else match.group(2)]
    elif "unrecognized arguments:" in message:
        unknown = [token[2:] for token in message.split("unrecognized arguments:", 1)[1].split()
                   if token.startswith("--")]
    else:
        return ""
    unknown = [name.split("=", 1)[0] for name in unknown]
    pairs = [(name, meant) for name in unknown if (meant := _meant_key(name, known))]
    notes = [note for name in unknown if name not in dict(pairs) and (note := _trl_note(name))]
    hint = "".join(f" ({note})" for note in notes)
    if not pairs:
        return hint
    if len(unknown) == 1:
        return f" (did you mean '{pairs[0][1]}'?)"
    return " (did you mean " + ", ".join(f"'{meant}' for '{name}'" for name, meant in pairs) + "?)" + hint


class _DropAdvertisingTips(logging.Filter):
    """Lightning's "💡 Tip: try installing litlogger / litmodels" lines (printed on every run)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_known_noise() -> None:
    """Silence what every lit-grpo run printed without saying anything about the run. Real warnings stay."""
    # Lightning's own pytree helper with torch >= 2.9; nothing a user can act on.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # RolloutDataModule's request stream is an IterableDataset with a __len__ on purpose (so Lightning does not
    # pre-fetch a rollout); it runs without worker processes, where the length is exact.
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    # ModelCheckpoint's advice for manual optimization to snapshot the weights before the optimizer step: GRPOModule
    # checkpoints after the step on purpose (a resume continues from the completed step).
    warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropAdvertisingTips) for f in logger.filters):
            logger.addFilter(_DropAdvertisingTips())


def build_cli(args: list[str] | None = None, run: bool = True) -> GRPOCLI:
    """The CLI object; with ``run=False`` it only parses ``args`` (no subcommand) and instantiates the
    trainer, the module and the datamodule (``cli.trainer``, ``cli.model``, ``cli.datamodule``)."""
    quiet_known_noise()
    # GRPOModule builds its optimizer and schedule from model.lr, betas, weight_decay and warmup_steps, so Lightning's
    # --optimizer / --lr_scheduler would be parsed and then ignored: they are not offered.
    kwargs: dict[str, Any] = dict(args=args, run=run, auto_configure_optimizers=False,
                                  parser_class=GRPOArgumentParser,
                                  parser_kwargs={"description": DESCRIPTION, "formatter_class": _HelpFormatter})
    if run:
        kwargs["save_config_kwargs"] = {"overwrite": True}
    return GRPOCLI(GRPOModule, RolloutDataModule, **kwargs)


def import_from_working_folder() -> None:
    """Make the working folder's modules importable, so that a config can name the user's own reward function
    (``my_rewards:fn``) or callback next to it, as under ``python -m lit_grpo.cli`` or a ``python train.py``: a
    console script's ``sys.path`` holds its own folder instead. Appended: an installed package keeps its name."""
    folder = os.getcwd()
    if not any(entry in ("", folder) or os.path.abspath(entry) == folder for entry in sys.path):
        sys.path.append(folder)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``lit-grpo``; ``args`` defaults to ``sys.argv[1:]``. ``export`` is not a Trainer method, so
    it has its own parser (lit_grpo.export); the rest is the LightningCLI. Under several processes an error ends
    this rank at once, naming it and the run's first failure (``lit_grpo.runtime.rank_failure``)."""
    import_from_working_folder()
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["export"]:
        from lit_grpo.export import main as export_main

        export_main(argv[1:])
        return
    try:
        with ended_by_caller():  # here, not in RankFailureWatch: each error's output and exit status are the CLI's
            build_cli(args)
    except Exception as error:
        if is_multi_process():  # the other ranks would wait for this one: end now, naming the error everywhere
            end_failed_rank(error)
        raise


if __name__ == "__main__":
    main()
