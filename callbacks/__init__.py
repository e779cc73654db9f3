"""Lightning callbacks for lit_grpo, usable with any LightningModule (they do more on lit_grpo rollout batches;
``ExportModel`` needs a module holding a ``policy`` and its ``tokenizer``, as ``GRPOModule`` does).

One callback per module; each class docstring lists every key it logs.
"""

from .completion_logger import CompletionLogger
from .export_model import ExportModel
from .fit_summary import FitSummary
from .peak_memory import PeakMemoryMonitor
from .progress_bar import GRPOProgressBar
from .rank_failure_watch import RankFailureWatch
from .reward_forecast import Forecast, RewardForecast, forecast_plateau
from .rollout_profiler import RolloutProfiler
from .run_checkpoint import RunCheckpoint
from .slot_timeline import SlotTimelineLogger, render_slot_timeline, render_slot_timeline_figure, save_slot_timeline

__all__ = [
    "CompletionLogger",
    "ExportModel",
    "FitSummary",
    "Forecast",
    "GRPOProgressBar",
    "PeakMemoryMonitor",
    "RankFailureWatch",
    "RewardForecast",
    "RolloutProfiler",
    "RunCheckpoint",
    "SlotTimelineLogger",
    "forecast_plateau",
    "render_slot_timeline",
    "render_slot_timeline_figure",
    "save_slot_timeline",
]
