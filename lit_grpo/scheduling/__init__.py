"""Scheduling policy of the rollout engine: which sample runs next, and whether a running one is parked.

``base`` fixes the engine contract (Scheduler, RolloutWork, SampleKey, Decision) and the plain schedulers of
"full", "micro" and "continuous"; ``driver`` is the one loop that runs the contract, for the engine and the
simulator (``simulate``). The "infinite" strategy's default is ``least_attained`` (continuous slots with
least-attained-service preemption where it pays, no length prediction); ``length_aware`` is the paper's method
(token-conditioned length prediction, FPTAS global grouping, SJF/LPT refill, trust and its gate), opt-in through
``InfiniteSchedulerConfig.length_aware`` (``config``).
"""

from lit_grpo.scheduling.base import (Assignment, Decision, FIFOScheduler, RolloutWork, RoundScheduler, SampleKey,
                                      Scheduler, decision_counts)
from lit_grpo.scheduling.config import InfiniteSchedulerConfig, LengthAwareConfig
from lit_grpo.scheduling.least_attained import LeastAttainedScheduler, preemption_points, rollout_makespan
from lit_grpo.scheduling.simulate import SimulationResult, simulate_rollout

__all__ = [
    "Assignment",
    "Decision",
    "FIFOScheduler",
    "InfiniteSchedulerConfig",
    "LeastAttainedScheduler",
    "LengthAwareConfig",
    "RolloutWork",
    "RoundScheduler",
    "SampleKey",
    "Scheduler",
    "SimulationResult",
    "decision_counts",
    "preemption_points",
    "rollout_makespan",
    "simulate_rollout",
]
