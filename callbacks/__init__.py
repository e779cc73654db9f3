"""Lightning callbacks for lit_grpo, usable with any LightningModule (they do more on lit_grpo rollout batches).

One callback per module; each class docstring lists every key it logs.
"""

from .completion_logger import CompletionLogger
from .peak_memory import PeakMemoryMonitor
from .reward_forecast import Forecast, RewardForecast, forecast_plateau
from .rollout_profiler import RolloutProfiler
from .slot_timeline import SlotTimelineLogger, render_slot_timeline, save_slot_timeline

__all__ = [
    "CompletionLogger",
    "Forecast",
    "PeakMemoryMonitor",
    "RewardForecast",
    "RolloutProfiler",
    "SlotTimelineLogger",
    "forecast_plateau",
    "render_slot_timeline",
    "save_slot_timeline",
]
