"""Scheduling policy of the rollout engine: which sample runs next, and whether a running one is parked.

``base`` fixes the engine contract (Scheduler, RolloutWork, SampleKey) and the plain schedulers of "full", "micro"
and "continuous"; ``driver`` is the one loop that runs the contract, for the engine and the simulator; the rest
builds the "infinite" strategy: length predictors, global grouping (FPTAS, LPT, Karmarkar-Karp), runtime refill
policies (SJF, LPT, FIFO), the trust a predictor has earned (``trust``) and InfiniteScheduler, plus a model-free
simulator.
"""

from lit_grpo.scheduling.base import Assignment, FIFOScheduler, RolloutWork, RoundScheduler, SampleKey, Scheduler
from lit_grpo.scheduling.grouping import (
    Partition,
    fptas_partition,
    karmarkar_karp_partition,
    lpt_partition,
    make_grouping,
    makespan_lower_bound,
)
from lit_grpo.scheduling.infinite import InfiniteScheduler
from lit_grpo.scheduling.predictors import (
    HistoryLengthPredictor,
    LengthPredictor,
    OnlineLengthPredictor,
    OracleLengthPredictor,
    kendall_tau,
    make_predictor,
    smape,
)
from lit_grpo.scheduling.refill import (
    DEFAULT_REFILL,
    FIFORefill,
    SlotPlanner,
    LPTRefill,
    RefillPolicy,
    SJFRefill,
    make_refill,
)
from lit_grpo.scheduling.simulate import SimulationResult, planted_rollout, simulate_rollout
from lit_grpo.scheduling.trust import PredictionTrust

__all__ = [
    "Assignment",
    "DEFAULT_REFILL",
    "FIFORefill",
    "FIFOScheduler",
    "HistoryLengthPredictor",
    "InfiniteScheduler",
    "LPTRefill",
    "SlotPlanner",
    "LengthPredictor",
    "OnlineLengthPredictor",
    "OracleLengthPredictor",
    "Partition",
    "PredictionTrust",
    "RefillPolicy",
    "RolloutWork",
    "RoundScheduler",
    "SJFRefill",
    "SampleKey",
    "Scheduler",
    "SimulationResult",
    "fptas_partition",
    "karmarkar_karp_partition",
    "kendall_tau",
    "lpt_partition",
    "make_grouping",
    "make_predictor",
    "make_refill",
    "makespan_lower_bound",
    "planted_rollout",
    "simulate_rollout",
    "smape",
]
