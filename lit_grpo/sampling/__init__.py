"""The rollout engine (mechanism): slots, prefill, decode loop, KV rows, byte accounting, random streams.

It knows nothing about GRPO losses or Lightning; which sample runs next is decided by lit_grpo.scheduling.
``engine`` is the public API, ``rollout_loop`` the loop, ``kv_cache`` the static slot cache and the prefixes and
parked tails beside it (memory), ``decode_step`` the step (compute, a CUDA graph on CUDA), ``cpu_linear`` the
policy's linears on oneDNN on a CPU (a rollout's, and the update's), ``carry`` a group's progress across calls,
``config`` the typed settings.
"""

from lit_grpo.sampling.config import STRATEGIES, SamplingConfig
from lit_grpo.sampling.carry import GroupProgress, SampleProgress
from lit_grpo.sampling.engine import RolloutEngine, RolloutResult
from lit_grpo.sampling.stats import RolloutStats, lower_bound_steps
from lit_grpo.scheduling.driver import IDLE

__all__ = ["IDLE", "STRATEGIES", "GroupProgress", "RolloutEngine", "RolloutResult", "RolloutStats", "SampleProgress",
           "SamplingConfig", "lower_bound_steps"]
