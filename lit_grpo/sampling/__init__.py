"""The rollout engine (mechanism): slots, prefill, decode loop, KV rows, byte accounting, random streams.

It knows nothing about GRPO losses or Lightning; which sample runs next is decided by lit_grpo.scheduling.
"""

from lit_grpo.sampling.engine import STRATEGIES, RolloutEngine, RolloutResult
from lit_grpo.sampling.stats import IDLE, RolloutStats, lower_bound_steps

__all__ = ["IDLE", "STRATEGIES", "RolloutEngine", "RolloutResult", "RolloutStats", "lower_bound_steps"]
