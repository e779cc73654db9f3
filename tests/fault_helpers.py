"""Planted failures for the tests of several processes: ``PlantedFault``, a callback that raises on one rank at one
place of a ``lit-grpo fit``, ``Stall``, which keeps one rank away from any collective, ``rank_split_reward``, a
reward that makes two ranks draw unequally, ``lookup_reward``, a reward function with a bug of its own, and
``end_unconnected``, a rank failing before the ranks connect, in a process of its own.

Places (``PLACES``), each at its first occurrence on the planted rank:

- ``build``: the callback's construction, before the ranks connect (the rank is the environment's ``NODE_RANK``
  plus ``LOCAL_RANK``: 2 nodes x 1 process, or 1 node x 2 processes);
- ``rollout``: inside a training rollout's decode (a forward of the rollout weights' module, no grad, eval mode):
  under FSDP2 this is the gathered copy, or the sharded policy in lockstep, mid-forward;
- ``reward``: a reward function, scored inside the rollout scope (between two forwards under lockstep);
- ``loss``: a non-finite advantage, so this rank's loss is not finite (the check that spans the ranks);
- ``update``: the backward of the update (a gradient hook), while the other ranks reduce their gradients;
- ``validation``: the rollout of a validation batch;
- ``checkpoint``: a save of ``last.ckpt`` (``on_save_checkpoint``, which every rank calls);
- ``setup``: the callbacks' ``setup``, once the ranks can talk (the others go on to set up the model);
- ``load``: the restore of a resumed checkpoint (``on_load_checkpoint``), the others restoring theirs;
- ``train_end``: the end of training (``on_train_end``), the others going on to the end of fit's gathers;
- ``export``: ``ExportModel``'s write of the trained model on rank 0, the others at the end of fit.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch
from lightning.pytorch import Callback

from lit_grpo.runtime.validation import ConfigError

PLACES = ("build", "rollout", "reward", "loss", "update", "validation", "checkpoint", "setup", "load", "train_end",
          "export")


class PlantedError(RuntimeError):
    """The planted failure."""


class PlantedSettingError(ConfigError):
    """The planted failure as a bad setting found on one rank (``micro_group_size: auto`` sized from that rank's
    own GPU memory), which the CLI reports as a setting."""


class PlantedFault(Callback):
    """Raise ``PlantedError`` (with ``setting``: ``PlantedSettingError``) on rank ``rank`` at ``place``
    (``PLACES``), once."""

    def __init__(self, place: str, rank: int, setting: bool = False):
        if place not in PLACES:
            raise ValueError(f"place={place!r} is not one of {PLACES}")
        self.place, self.rank, self.setting = place, rank, setting
        self.message = f"planted {place} failure on rank {rank}"
        if place == "build" and int(os.environ.get("NODE_RANK", 0)) + int(os.environ.get("LOCAL_RANK", 0)) == rank:
            self._fire()

    def _fire(self, *_: Any, **__: Any) -> None:
        raise (PlantedSettingError if self.setting else PlantedError)(self.message)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.global_rank != self.rank:
            return
        data = trainer.datamodule
        if self.place == "setup":
            self._fire()
        elif self.place == "export":
            from lit_grpo.callbacks import export_model

            export_model.export_policy = self._fire
        elif self.place == "reward":
            reward = data.reward_funcs[0]
            data.reward_funcs[0] = type(reward)(self._fire, reward.weight, reward.name)
        elif self.place == "validation":
            data.build_val_batch = self._fire

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != self.rank:
            return
        if self.place == "rollout":  # after the module's hand-over: the weights a rollout decodes with exist
            def in_rollout(module, args, kwargs):
                if not torch.is_grad_enabled() and not module.training:
                    self._fire()
            pl_module.rollout_weights().module.register_forward_pre_hook(in_rollout, with_kwargs=True)
        elif self.place == "update":
            parameter = next(p for p in pl_module.policy.parameters() if p.requires_grad)
            parameter.register_hook(self._fire)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.place == "loss" and trainer.global_rank == self.rank:
            batch.advantages = torch.full_like(batch.advantages, float("nan"))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if self.place == "checkpoint" and trainer.global_rank == self.rank:
            self._fire()

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if self.place == "load" and trainer.global_rank == self.rank:
            self._fire()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.place == "train_end" and trainer.global_rank == self.rank:
            self._fire()


class Stall(Callback):
    """On rank ``rank``, sleep ``seconds`` in the reward function before scoring: a rank away from any collective
    (computing alone, or in an NCCL collective that does not notice a peer's end) for that long."""

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.global_rank != self.rank:
            return
        data = trainer.datamodule
        reward = data.reward_funcs[0]

        def stalled(*args: Any, **kwargs: Any) -> list[float]:
            time.sleep(self.seconds)
            return reward.fn(*args, **kwargs)

        data.reward_funcs[0] = type(reward)(stalled, reward.weight, reward.name)


def rank_split_reward(prompts: list[str], completions: list[str], path: str = "", **columns: Any) -> list[float]:
    """A reward for the tests of several processes that draw unequally: 0 for every completion on rank 1 (so with
    dynamic sampling each of its groups is dropped and it draws again, as often as allowed), the completion's
    length on rank 0 (its groups kept at once). Appends the prompts it scored, one JSON line per call, to
    ``{path}.rank{R}``."""
    rank = torch.distributed.get_rank()
    with open(f"{path}.rank{rank}", "a") as handle:
        handle.write(json.dumps(list(dict.fromkeys(prompts))) + "\n")
    return [0.0 if rank == 1 else float(len(text)) for text in completions]


def lookup_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """A reward function whose author's bug raises a KeyError, for the report of a reward function's error."""
    answers: dict[str, float] = {}
    return [answers[prompt] for prompt in prompts]


def end_unconnected(rank: int, port: int, wait_s: float, log: str, agent_store: bool = False) -> None:
    """In a process of its own (it ends it): rank ``rank`` of a 2-node run (1 process per node, Lightning's
    launcher) fails before the ranks connect, its store at 127.0.0.1:``port``, waiting at most ``wait_s`` seconds
    for the other rank; its output goes to ``log``. ``agent_store``: the store is the launcher's, as torchrun's
    (``TORCHELASTIC_USE_AGENT_STORE``)."""
    from lit_grpo.runtime import rank_failure

    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if agent_store:
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    rank_failure.SETUP_WAIT_S = wait_s
    place = rank_failure.RankPlace(rank, 2, rank, 0, 2, "127.0.0.1", port, starts_node=True)
    rank_failure.end_unconnected_rank(PlantedError(f"planted failure on rank {rank}"), place)


def end_unread_node(node: int, port: int, wait_s: float, unknown_nodes_wait_s: float, log: str) -> None:
    """In a process of its own (it ends it): the process started on node ``node`` under Lightning's launcher of
    several nodes fails before its settings were read, its run's store at 127.0.0.1:``port``, waiting at most
    ``wait_s`` (``SETUP_WAIT_S``) and ``unknown_nodes_wait_s`` (``UNKNOWN_NODES_WAIT_S``); its output goes to
    ``log``."""
    from lit_grpo.runtime import rank_failure

    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # as in a terminal: the fork server may hand SIGINT on ignored (a background job's; a handler a test left when
    # it started), and the wait leaves an ignored SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rank_failure.SETUP_WAIT_S, rank_failure.UNKNOWN_NODES_WAIT_S = wait_s, unknown_nodes_wait_s
    rank_failure.end_unread_node(PlantedError(f"planted failure on node {node}"), node)
