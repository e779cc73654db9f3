"""A user's own Lightning script that resumes with ``trainer.fit(ckpt_path=...)`` (tests/fit_without_cli.py) and
then saves its policy's weights, for a test of what a refused resume left in the module: ``python
fit_keeping_weights.py CKPT WEIGHTS ARGS...`` fits as ``fit_without_cli.py CKPT ARGS...`` does, then writes the
policy's weights by name to WEIGHTS (each parameter's local shard: the whole tensor under one process), whether the
fit ended or failed; a failure then leaves the script as it would without the save. Every warning is shown each time
it is given (a test counts them), not once per place in the code."""

import sys
import warnings

import torch
from torch.distributed.tensor import DTensor

from lit_grpo.cli.command import build_cli

if __name__ == "__main__":
    ckpt_path, weights_path, *args = sys.argv[1:]
    warnings.simplefilter("always")
    cli = build_cli(args, run=False)
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    finally:
        policy = cli.model.policy
        named = policy.named_parameters() if policy is not None else ()
        torch.save({name: (value.to_local() if isinstance(value, DTensor) else value).detach().clone()
                    for name, value in named}, weights_path)
