"""The small RolloutDataModule arguments that the module and reliability tests build on."""

from dataclasses import fields
from typing import Any

from lit_grpo.sampling import SamplingConfig

PROMPTS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(12)]
SAMPLING_FIELDS = {f.name for f in fields(SamplingConfig)}


def datamodule_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    """RolloutDataModule's keywords: 12 arithmetic prompts, 2 held out, B 2, G 4 on 4 continuous slots, 8 new tokens,
    the char_fraction reward; ``kwargs`` override them, SamplingConfig's fields among them going to ``sampling``."""
    sampling = {"group_size": 4, "micro_group_size": 4, "strategy": "continuous", "max_new_tokens": 8,
                **{key: value for key, value in kwargs.items() if key in SAMPLING_FIELDS}}
    rest = {key: value for key, value in kwargs.items() if key not in SAMPLING_FIELDS}
    return {"prompts": PROMPTS, "val_size": 2, "prompts_per_step": 2, "reward_funcs": ["char_fraction"], **rest,
            "sampling": sampling}
