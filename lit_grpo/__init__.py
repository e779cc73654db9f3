"""lit_grpo: GRPO training of language models with PyTorch Lightning and Infinite Sampling.

The package follows a batch's way (docs/index.md has the map):

- ``lit_grpo.rollout``: prompts -> the engine -> rewards -> advantages -> a ``RolloutBatch`` (no Lightning);
  the engine is ``lit_grpo.sampling`` (slots, decode step, KV cache) and ``lit_grpo.scheduling`` decides which
  sample runs where;
- ``lit_grpo.batch``: ``RolloutBatch``, the one hand-over between the halves;
- ``lit_grpo.update``: ``GRPOModule`` (log-probs, shared-prefix update, losses, sampler correction);
- ``lit_grpo.datamodules`` and ``lit_grpo.callbacks``: the Lightning side; ``lit_grpo.runtime``: what both run on;
  ``lit_grpo.cli``: ``lit-grpo fit`` and ``lit-grpo export``.

The names a user imports are available here (loaded on first use, so ``import lit_grpo.sampling`` stays light).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> the module that defines it
_PUBLIC = {
    "GRPOModule": "lit_grpo.update.module",
    "RolloutDataModule": "lit_grpo.datamodules.rollout",
    "RolloutBatch": "lit_grpo.batch",
    "RolloutEngine": "lit_grpo.sampling",
    "RolloutResult": "lit_grpo.sampling",
    "SamplingConfig": "lit_grpo.sampling",
    "InfiniteSchedulerConfig": "lit_grpo.scheduling.config",
    "LossConfig": "lit_grpo.update.loss_config",
    "SamplerCorrection": "lit_grpo.update.sampler_correction",
    "ReferenceSync": "lit_grpo.update.reference_sync",
    "PolicyLoss": "lit_grpo.update.policy_losses",
    "GRPOLoss": "lit_grpo.update.policy_losses",
    "BNPOLoss": "lit_grpo.update.policy_losses",
    "DrGRPOLoss": "lit_grpo.update.policy_losses",
    "DAPOLoss": "lit_grpo.update.policy_losses",
    "CISPOLoss": "lit_grpo.update.policy_losses",
    "SAPOLoss": "lit_grpo.update.policy_losses",
    "LUSPOLoss": "lit_grpo.update.policy_losses",
    "VESPOLoss": "lit_grpo.update.policy_losses",
    "make_loss": "lit_grpo.update.policy_losses",
    "accuracy_reward": "lit_grpo.rollout.reward_functions",
    "format_reward": "lit_grpo.rollout.reward_functions",
    "char_fraction_reward": "lit_grpo.rollout.reward_functions",
    "OverlongPenalty": "lit_grpo.rollout.reward_functions",
    "math_reward": "lit_grpo.rollout.math_reward",
    "RewardModel": "lit_grpo.rollout.reward_model",
    "load_model_and_tokenizer": "lit_grpo.runtime.models",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lit_grpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
