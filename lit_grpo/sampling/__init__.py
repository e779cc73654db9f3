"""The rollout engine (mechanism): slots, prefill, decode loop, KV rows, byte accounting, random streams.

It knows nothing about GRPO losses or Lightning; which sample runs next is decided by lit_grpo.scheduling.
``engine`` is the loop, ``kv_cache`` the static slot cache (memory), ``decode_step`` the step (compute, a CUDA
graph on CUDA), ``config`` the typed settings.
"""

from lit_grpo.sampling.config import STRATEGIES, SamplingConfig
from lit_grpo.sampling.engine import RolloutEngine, RolloutResult
from lit_grpo.sampling.stats import IDLE, RolloutStats, lower_bound_steps

__all__ = ["IDLE", "STRATEGIES", "RolloutEngine", "RolloutResult", "RolloutStats", "SamplingConfig",
           "lower_bound_steps"]
