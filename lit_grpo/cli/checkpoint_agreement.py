"""The same checkpoint on every rank: under several processes each rank's ``--ckpt_path`` finding or file, and
any refusal of it, compared once the ranks can talk, every rank ending on the same error where they differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

from lit_grpo.runtime.checkpoints import CheckpointIdentity, checkpoint_identity
from lit_grpo.runtime.distributed import RaisedOnEveryRank, is_multi_process
from lit_grpo.runtime.validation import ConfigError


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
