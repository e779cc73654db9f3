"""A user's own Lightning script (no ``lit-grpo`` command), for the tests of several processes: ``python
fit_without_cli.py CKPT ARGS...`` builds the trainer, ``GRPOModule`` and datamodule that ``lit-grpo fit ARGS`` would
(``build_cli(run=False)``) and fits them with ``trainer.fit(..., ckpt_path=CKPT)``, which the CLI's own checks of a
checkpoint (``_parse_ckpt_path``, ``--ckpt_path last``) never see."""

import sys

from lit_grpo.cli.command import build_cli

if __name__ == "__main__":
    ckpt_path, *args = sys.argv[1:]
    cli = build_cli(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
