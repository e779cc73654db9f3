"""Resuming a run: a refused checkpoint as a bad setting, the resume and export commands shown, and a resumed run
logging on in its own folder (what a resume compares: ``lit_grpo.runtime.checkpoints`` and
``lit_grpo.update.resume_settings``).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger

from lit_grpo.callbacks._paths import shown_path
from lit_grpo.runtime.checkpoints import check_resumable
from lit_grpo.runtime.validation import ConfigError, config_errors


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
