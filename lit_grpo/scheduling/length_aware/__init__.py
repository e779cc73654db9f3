"""The paper's length-aware scheduling (opt-in, experimental): ``scheduler`` (LengthAwareScheduler), its length
``predictors`` (on ``ridge``), global ``grouping`` (the FPTAS), runtime ``refill`` and the ``trust`` predictions
earn, with the gate that decides whether to follow them."""

from lit_grpo.scheduling.length_aware.grouping import Partition, fptas_partition, lpt_partition, makespan_lower_bound
from lit_grpo.scheduling.length_aware.predictors import (LengthPredictor, NoisyOraclePredictor, OnlineLengthPredictor,
                                                         OracleLengthPredictor, kendall_tau, make_predictor, smape)
from lit_grpo.scheduling.length_aware.refill import RefillPolicy, SlotPlanner
from lit_grpo.scheduling.length_aware.scheduler import LengthAwareScheduler
from lit_grpo.scheduling.length_aware.trust import PredictionTrust

__all__ = [
    "LengthAwareScheduler",
    "LengthPredictor",
    "NoisyOraclePredictor",
    "OnlineLengthPredictor",
    "OracleLengthPredictor",
    "Partition",
    "PredictionTrust",
    "RefillPolicy",
    "SlotPlanner",
    "fptas_partition",
    "kendall_tau",
    "lpt_partition",
    "make_predictor",
    "makespan_lower_bound",
    "smape",
]
