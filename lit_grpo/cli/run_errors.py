"""How a command's run ends on an error: a bad setting said as a parse error (exit status 2), a reward
function's error with its own frames, a run folder that cannot be made, and this process's place in the run, to
end the ranks that would wait for it.
"""

from __future__ import annotations

import os
import sys
import traceback
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from lit_grpo.runtime.rank_failure import RankPlace, rank_place
from lit_grpo.runtime.validation import ConfigError
from lit_grpo.rollout.rewards import RewardFunctionError


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


def _say_unread_layout(place: RankPlace | None, node: int | None) -> None:
    """Say what is known of the run's layout where this process's settings could not be read: its place as the
    launcher's environment gives it (``place``), or, under Lightning's own launcher (``NODE_RANK`` and
    ``MASTER_PORT`` set), its ``node``, whose error rank 0's store tells the other ranks (node 0's process runs it).
    ``NODE_RANK`` without ``MASTER_PORT`` says no store: the other ranks, if the run has any, are not told."""
    if place is not None:
        print(f"lit_grpo: the settings could not be read; this process's place comes from its launcher's environment:"
              f" rank {place.rank} of {place.world}, the run's store at {place.address}:{place.port}",
              file=sys.stderr, flush=True)
    elif node is not None:
        print(f"lit_grpo: the settings could not be read, so this process's ranks are unknown (NODE_RANK={node} but "
              "no world size: Lightning's launcher takes it from trainer.num_nodes and trainer.devices): its error "
              f"is told to the other ranks{', if any,' if node == 0 else ''} as node {node}'s"
              f"{'' if node == 0 else ' (for a run of one node, unset NODE_RANK)'}",
              file=sys.stderr, flush=True)
    elif "NODE_RANK" in os.environ:
        print(f"lit_grpo: the settings could not be read, so this process's place in the run is unknown (NODE_RANK="
              f"{os.environ['NODE_RANK']} but no world size: Lightning's launcher takes it from trainer.num_nodes and "
              "trainer.devices; torchrun and SLURM give it): the other ranks, if any, are not told"
              f"{'' if 'MASTER_PORT' in os.environ else ' (no MASTER_PORT says where rank 0 runs the store)'}, and "
              "wait for this one until their process group's timeout",
              file=sys.stderr, flush=True)


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
    # skip_group only helps where a group fails alone and another scores; a function that fails on the whole batch,
    # or on every group (a bug of its own, its signature refusing the call), fails under it too
    tip = ("\ntip: data.on_reward_error: skip_group scores the other groups and gives the failing ones no loss"
           if error.group is not None and error.others_scored is not False else "")
    print(f"error: {error}{tip}", file=sys.stderr)
    raise SystemExit(1) from error
