"""``lit-grpo``: LightningCLI(GRPOModule, RolloutDataModule) with the ``fit`` and ``validate`` subcommands.

    lit-grpo fit --config configs/demo.yaml
    lit-grpo validate --config configs/demo.yaml            # greedy accuracy of the (untrained) policy
    lit-grpo fit --config configs/tiny.yaml --print_config  # the fully resolved configuration

Notes for configs: GRPOModule uses manual optimization, so ``trainer.gradient_clip_val`` and
``trainer.accumulate_grad_batches`` must stay unset (use ``model.max_grad_norm`` and
``model.train_micro_batch_size``); ``trainer.max_steps`` counts optimizer steps (training steps x num_iterations x
num_mini_batches).

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

The modules: ``command`` (``GRPOCLI``, ``build_cli``, ``main``), ``parser`` (the argument parser), ``messages`` (a
refused setting said on one line, with hints), ``setting_checks`` and ``setting_warnings`` (the settings checked
before anything is built, and the warnings of what is built placed at them), ``checkpoint_agreement`` (the same
checkpoint on every rank), ``resume`` (a resumed run's checks and commands) and ``run_errors`` (how a run ends
on an error). Importing this package loads none of them: ``main`` and the names above load ``command`` on first use.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import sys

__all__ = ["GRPOCLI", "build_cli", "main"]


def main(args: list[str] | None = None) -> None:
    """Entry point of ``lit-grpo``: ``command.main(args)`` (``args`` defaults to ``sys.argv[1:]``).

    A run's torch, Lightning and transformers are millions of objects that live as long as the process, and Python's
    cyclic garbage collector would walk all of them at each full collection: a call that finds ``command`` not
    imported yet imports it with the collector paused, collects once and freezes what is alive (``gc.freeze``: later
    collections skip it), and at exit whatever is still alive is frozen too, before the interpreter's final
    collections would walk it once more. Objects freed by reference counting are still freed and finalized; Python
    does not promise finalizers of objects left in cycles at exit.
    """
    if "lit_grpo.cli.command" not in sys.modules:
        _import_untraced("lit_grpo.cli.command")
    from lit_grpo.cli.command import main as run_command

    atexit.unregister(gc.freeze)  # once, however often main runs in a process
    atexit.register(gc.freeze)
    run_command(args)


def _import_untraced(module: str) -> None:
    """Import ``module`` with the collector paused (as it was after), free the little garbage importing left with one
    collection, and freeze what is alive."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        importlib.import_module(module)
        gc.collect()
        gc.freeze()
    finally:
        if enabled:
            gc.enable()


def __getattr__(name: str):
    """``GRPOCLI`` and ``build_cli``, loaded on first use, so that importing this package loads no torch (``main``
    loads it)."""
    if name not in ("GRPOCLI", "build_cli"):
        raise AttributeError(f"module 'lit_grpo.cli' has no attribute {name!r}")
    return getattr(importlib.import_module("lit_grpo.cli.command"), name)
