"""``lit-grpo`` whose optimizer has one param group of every trainable weight, as before ``weight_decay_groups``:
it writes that code's checkpoints, which tests/test_fsdp.py resumes."""

import sys

import lit_grpo.update.module as module_file
from lit_grpo.cli import main


def one_group(model, weight_decay):
    return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]


if __name__ == "__main__":
    module_file.weight_decay_groups = one_group
    sys.exit(main())
