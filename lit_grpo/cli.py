"""``lit-grpo``: LightningCLI(GRPOModule, RolloutDataModule) with the ``fit`` and ``validate`` subcommands.

    lit-grpo fit --config configs/demo.yaml
    lit-grpo validate --config configs/demo.yaml            # greedy accuracy of the (untrained) policy
    lit-grpo fit --config configs/tiny.yaml --print_config  # the fully resolved configuration

Notes for configs: GRPOModule uses manual optimization, so ``trainer.gradient_clip_val`` and
``trainer.accumulate_grad_batches`` must stay unset (use ``model.max_grad_norm`` and
``model.train_micro_batch_size``); ``trainer.max_steps`` counts optimizer steps (rollouts x num_iterations).

Multi-process and resume:

    lit-grpo fit --config configs/tiny.yaml --trainer.strategy ddp --trainer.devices 2 --trainer.accelerator cpu
    lit-grpo fit --config configs/fsdp_gpu.yaml            # FSDP2 (ModelParallelStrategy + model.fsdp: true)
    lit-grpo fit --config configs/tiny.yaml --ckpt_path PATH/step=K.ckpt   # exact resume after step K

``data.prompts_per_step`` is per rank. A checkpoint holds, besides weights, optimizer and loops, the DataModule's
state (steps built, the prompt sampler / curriculum, the engine's rollout counter and length predictor, the global
random states), so steps K+1.. repeat an uninterrupted run's prompts, completions, rewards and losses. Under ddp
the DataModule state is rank 0's; the other ranks' completions are still exact (the per-sample random streams are
keyed by seed, rollout counter, prompt and sample), only their length predictor restarts from rank 0's state.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning.pytorch.cli import LightningCLI

from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.module import GRPOModule

SUBCOMMANDS = ("fit", "validate")


class GRPOCLI(LightningCLI):
    """LightningCLI restricted to fit and validate, plus ``torch_num_threads``.

    ``torch_num_threads`` (top level of the config) calls ``torch.set_num_threads`` before anything is built. On a
    small shared CPU, 1 avoids OpenMP threads spin-waiting for cores other processes hold (measured on the 2-core
    dev machine under load: a SmolLM2 rollout 13x faster with 1 thread than with the default 2).
    """

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name in SUBCOMMANDS}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--torch_num_threads", type=Optional[int], default=None,
                            help="torch.set_num_threads(N) before building anything (None: torch's default)")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        threads = config.get("torch_num_threads")
        if threads is not None:
            if threads < 1:
                raise ValueError(f"torch_num_threads={threads} must be >= 1 (or null for torch's default)")
            torch.set_num_threads(threads)


def build_cli(args: list[str] | None = None, run: bool = True) -> GRPOCLI:
    """The CLI object; with ``run=False`` it only parses ``args`` (no subcommand) and instantiates the
    trainer, the module and the datamodule (``cli.trainer``, ``cli.model``, ``cli.datamodule``)."""
    kwargs: dict[str, Any] = dict(args=args, run=run)
    if run:
        kwargs["save_config_kwargs"] = {"overwrite": True}
    return GRPOCLI(GRPOModule, RolloutDataModule, **kwargs)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``lit-grpo``; ``args`` defaults to ``sys.argv[1:]``."""
    build_cli(args)


if __name__ == "__main__":
    main()
