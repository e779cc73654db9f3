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

The modules: ``command`` (``GRPOCLI``, ``build_cli``, ``main``), ``parser`` (the argument parser), ``messages`` (a
refused setting said on one line, with hints), ``setting_checks`` and ``setting_warnings`` (the settings checked
before anything is built, and the warnings of what is built placed at them), ``checkpoint_agreement`` (the same
checkpoint on every rank), ``resume`` (a resumed run's checks and commands) and ``run_errors`` (how a run ends
on an error).
"""

from __future__ import annotations

from lit_grpo.cli.command import GRPOCLI, build_cli, main

__all__ = ["GRPOCLI", "build_cli", "main"]
