"""What the "infinite" scheduler plans one rollout with: made by ``InfiniteScheduler.begin``, dropped by the next.

Everything here lives for one rollout; what lives across rollouts (the predictor, the trust it earned, the groups
preemption draws from) stays on the scheduler, and which sample runs where, which are parked and how far each got
is the base Scheduler's record (``base.py``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from lit_grpo.scheduling.base import SampleKey
from lit_grpo.scheduling.refill import SlotPlanner


@dataclass
class SampleRun:
    """When a running sample started (decode steps) and from how many generated tokens."""

    start_clock: int
    start_generated: int


@dataclass
class RolloutPlan:
    """What one rollout plans with; made by ``begin``, dropped by the next one."""

    planner: SlotPlanner
    rank: dict[SampleKey, int]  # arrival order (prompt-major)
    clock: int = 0  # decode steps so far, as the samples' token counts date them
    runs: dict[SampleKey, SampleRun] = field(default_factory=dict)  # of the samples started (read for running ones)
    reserved: dict[int, SampleKey] = field(default_factory=dict)  # slot -> sample chosen at a probe, admitted next
    token_features: dict[SampleKey, torch.Tensor] = field(default_factory=dict)  # probe features, until finished
    prompt_predictions: dict[SampleKey, float] = field(default_factory=dict)  # raw predictions by kind: a
    probe_predictions: dict[SampleKey, float] = field(default_factory=dict)  # probed sample's latest is its probe's
    # (latest prediction, true length) of each finished sample, in finish order
    scored: list[tuple[float, int]] = field(default_factory=list)
    # Finished samples the predictor has not learned from yet: (key, length, token feature or None). Taught in one
    # batch when predictions are refreshed, and at the end of the rollout, rather than one by one between decode
    # steps, where the host's time is the accelerator's idle time.
    unlearned: list[tuple[SampleKey, int, torch.Tensor | None]] = field(default_factory=list)
    # More samples than slots: some wait, so an order is chosen. Else no prediction could change anything, and
    # the rollout asks nothing of the predictor (on a GPU the host's work is the accelerator's idle time).
    waits: bool = True
    parking: bool = False  # park at probes in this rollout
    unprobed: deque = field(default_factory=deque)  # samples to start for their probe, in refill order
    unprobed_work: float = 0.0  # their expected remaining work
    max_parked: int = 0
    gain: tuple[float, float] = (0.0, 0.0)  # the gate's (mean, std) gain of the guided order
    guided: bool = False  # follow the predictions (else arrival order, or least attained when preempting)
    preempting: bool = False  # preempt by attained service (``preemption.py``); never guided while it does
    finished: dict[SampleKey, int] = field(default_factory=dict)  # each finished sample's length
    first_gain: tuple[float, float, bool] = (0.0, 0.0, False)  # the rollout's opening decision, for last_info

    def prediction(self, key: SampleKey) -> float:
        """The latest raw prediction of a sample (NaN: none)."""
        return self.probe_predictions.get(key, self.prompt_predictions.get(key, float("nan")))
