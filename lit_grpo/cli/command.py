"""The ``lit-grpo`` command: ``GRPOCLI`` (LightningCLI restricted to fit and validate, with lit_grpo's default
callbacks, thread settings, checkpoint checks and error endings), ``build_cli`` and ``main``, the console script's
entry point.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from lit_grpo.callbacks import ExportModel, FitSummary, GRPOProgressBar, RankFailureWatch, RunCheckpoint
from lit_grpo.callbacks.run_checkpoint import last_checkpoint_callback
from lit_grpo.runtime.checkpoints import (SettingsDiffer, find_last_checkpoint, finish_interrupted_swaps,
                                          mark_settings_checked, newest_run_hint, run_checkpoint_folders)
from lit_grpo.runtime.distributed import data_parallel_only, is_multi_process
from lit_grpo.runtime.rank_failure import (end_failed_rank, end_unconnected_rank, end_unread_node, ended_by_caller,
                                           launched_node, launched_place, rank_place, watch_failures)
from lit_grpo.runtime.validation import ConfigError, check_thread_count, default_threads, shown_setting
from lit_grpo.runtime.memory import DEFAULT_MMAP_THRESHOLD, fix_mmap_threshold
from lit_grpo.rollout.rewards import RewardFunctionError, reward_changes
from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.update.module import GRPOModule
from lit_grpo.update.resume_settings import unread_settings

from lit_grpo.cli.messages import configured_class_key, optional_group_reason, qualified_error
from lit_grpo.cli.setting_warnings import warnings_at_settings
from lit_grpo.cli.setting_checks import (check_accelerator, check_distinct_stateful_callbacks,
                                         check_groups_are_mappings, check_manual_optimization_settings, check_processes)
from lit_grpo.cli.checkpoint_agreement import SameCheckpointOnEveryRank
from lit_grpo.cli.resume import (_continue_in_folder_of, _nothing_to_evaluate, _refusal, export_command,
                                 resume_command)
from lit_grpo.cli.run_errors import (_exit_on_reward_error, _exit_with, _say_config_error, _say_unread_layout,
                                     planned_place, unwritable_run_folder)
from lit_grpo.cli.parser import GRPOArgumentParser, _HelpFormatter


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
    process's share of the cores it may use (``available_cores()``: its CPU affinity's, or its cgroup CPU quota's
    where that grants fewer, as a container's does, divided by the trainer's devices per node, each a process of its
    own), so an idle machine is used whole and ranks on one node do not each take all of it: OpenMP threads
    spin-waiting for a core another process holds, or for a quota's next period, slow every parallel op down. For
    the same reason fewer threads can be faster on a CPU that other jobs keep busy (configs/demo.yaml says what it
    picks and why).

    ``malloc_mmap_threshold`` (top level, default 4 MiB) fixes glibc's mmap threshold before anything is built
    (``lit_grpo.runtime.memory.fix_mmap_threshold``): without it a CPU step's resident memory grows with the number
    of its micro-batches. It is process-wide, so it is set in ``lit-grpo``'s own process, not by the modules.
    """

    #: Under several processes, the ``--ckpt_path`` file and this rank's refusal of it (None: accepted), for every
    #: rank to compare and end on once they can talk (``_parse_ckpt_path``); None: one process, or no file given.
    _given_checkpoint: tuple[str, str | None] | None = None
    #: The checkpoint whose settings this command compared with the run's (``_parse_ckpt_path``, ``--ckpt_path
    #: last``): the module is told (``_mark_checked``), so that its own check as Lightning loads it is not run twice.
    _checked_checkpoint: str | None = None

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
        launcher's environment (torchrun's, SLURM's: ``launched_place``; under Lightning's own launcher of several
        nodes only the node is known, ``launched_node``, whose error rank 0's store is told as that node's, node
        0's process running that store itself: ``end_unread_node``). A run of one process ends here at once; so do
        rank 0 of one node under Lightning's launcher and an error of the ranks' connecting itself (a rank that
        never came, the store's port taken), which no store is there to tell: with the node's ranks the launcher
        started, which would wait for this one's store."""
        if not torch.distributed.is_available() or torch.distributed.is_initialized():
            return  # main ends every rank
        config = getattr(self, "config", None)
        if config is None:  # the settings could not be read: the layout is known only from a launcher's environment
            place, node = launched_place(), launched_node()
            _say_unread_layout(place, node)
            if node is not None:  # Lightning's launcher of several nodes: told in rank 0's store (node 0 runs it)
                if isinstance(error, SystemExit):  # a bad setting, said already: its cause is what the others name
                    status = error.code if isinstance(error.code, int) else 1
                    end_unread_node(error.__cause__ or error, node, exit_status=status, show_traceback=False)
                end_unread_node(error, node)
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
                writer = writers[0]
                raise ValueError(f"{type(writer).__name__}({shown_setting('save_last', writer.save_last)}) would "
                                 "write last.ckpt beside lit_grpo's RunCheckpoint, which keeps it current (atomic, "
                                 "saved on a stop): set its save_last to false, or configure a RunCheckpoint yourself")
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
            threads = default_threads(local_processes)
            if threads is None:  # OMP_NUM_THREADS
                return
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
        self._given_checkpoint = self._checked_checkpoint = None
        if not self.config.get("subcommand"):
            return
        config = self.config[self.config.subcommand]
        ckpt_path = config.get("ckpt_path")
        if ckpt_path and ckpt_path not in ("last", "best", "hpc", "registry") and "://" not in str(ckpt_path):
            # first: it sets the rank that rank_zero_warn reads (a node's process given only NODE_RANK, as under
            # Lightning's launcher, takes itself for rank 0 until then), so that rank 0 alone warns of other rewards
            place = planned_place(config.get("trainer"))
            refusal = _refusal("--ckpt_path", ckpt_path, config.get("model") or {}, config.get("data"),
                               evaluate=self.config.subcommand != "fit",
                               defaults=self._parser(self.config.subcommand).get_defaults(), unread=unread_settings,
                               reward_changes=reward_changes)
            self._checked_checkpoint = str(ckpt_path)
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
        self._mark_checked(config.get("ckpt_path"))

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
        self._mark_checked(config.get("ckpt_path"))

    def _mark_checked(self, ckpt_path: Any) -> None:
        """Tell the module that ``ckpt_path``, which the run loads, was compared with its settings here (before
        anything loaded it, with the parser's defaults; ``mark_settings_checked``): its ``on_load_checkpoint`` then
        neither compares it again nor warns of its reward functions a second time. A path not compared here
        (``best``, a URL) is compared there."""
        if ckpt_path is not None and self._checked_checkpoint == str(ckpt_path):
            mark_settings_checked(self.model, ckpt_path, evaluate=self.subcommand != "fit")

    def _last_checkpoint(self, evaluate: bool) -> tuple[Path, Path | None]:
        """The root searched and the newest ``last.ckpt`` of any run under it (None: none yet), checked against
        this run's settings (``evaluate``: a run that only evaluates it)."""
        root, folders = self._checkpoint_folders()
        if rank_zero_only.rank == 0:  # a sharded save killed between its renames leaves no last.ckpt until then
            for folder in folders:  # other runs' folders too, maybe saving from other hosts: no deleting here
                finish_interrupted_swaps(folder, clean=False)
        found = find_last_checkpoint(folders)  # the same before and after rank 0's renames
        self._checked_checkpoint = None if found is None else str(found)
        refusal = None if found is None else _refusal(
            "--ckpt_path last", found, self.model.hparams, getattr(self.datamodule, "hparams", None),
            evaluate=evaluate, defaults=self._parser(self.subcommand).get_defaults(), unread=unread_settings,
            reward_changes=reward_changes)
        if refusal is not None and isinstance(refusal.__cause__, SettingsDiffer):  # another experiment's run
            refusal = ConfigError(f"{refusal}\n{newest_run_hint(root)}")
        self._last_root = None if found is None else root  # a refusal while it loads (its prompts) says it too
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
                                 "set, else this process's share of the cores: the cores it may use (its CPU "
                                 "affinity's, or its cgroup CPU quota's if fewer) divided by the devices per node)")
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
                seed = self._get(self.config, "seed_everything")
                raise ValueError(f"{shown_setting('seed_everything', seed)}: {error}") from None

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
            if isinstance(err.__cause__, SettingsDiffer) and getattr(self, "_last_root", None) is not None:
                err = ConfigError(f"{err}\n{newest_run_hint(self._last_root)}")  # --ckpt_path last's pick, loading
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


class _DropAdvertisingTips(logging.Filter):
    """Lightning's "💡 Tip: try installing litlogger / litmodels" lines (printed on every run)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_known_noise() -> None:
    """Silence what every lit-grpo run printed without saying anything about the run. Real warnings stay."""
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
                                  parser_kwargs={"prog": "lit-grpo", "description": DESCRIPTION,
                                                 "formatter_class": _HelpFormatter})
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
