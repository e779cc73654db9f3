"""``InfiniteSchedulerConfig``: the "infinite" strategy's options, typed and checked once.

A frozen dataclass, so LightningCLI shows it under ``--print_config`` and rejects a wrong name when the YAML is
parsed (``Literal`` types); numbers are checked when the object is built, with errors that name the key::

    data:
      sampling:
        strategy: infinite
        scheduler: {predictor: online, refill: lpt, probe_tokens: 8}

Python callers may pass objects instead of names (a ``LengthPredictor``, a ``RefillPolicy``, a grouping function);
``InfiniteScheduler`` takes this config, or any of its fields as keyword arguments, and has no defaults of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Union, get_args

from lit_grpo.runtime.validation import check_choice
from lit_grpo.scheduling.gate import GAIN_Z
from lit_grpo.scheduling.grouping import DEFAULT_EPSILON, GroupingName
from lit_grpo.scheduling.predictors import PredictorName, parse_predictor_name
from lit_grpo.scheduling.preemption import preemption_points
from lit_grpo.scheduling.refill import DEFAULT_REFILL, RefillName


@dataclass(frozen=True)
class InfiniteSchedulerConfig:
    """Settings of :class:`~lit_grpo.scheduling.infinite.InfiniteScheduler`, declared here only.

    Attributes:
        predictor: length predictor: "online" (token-conditioned, learned from finished rollouts), "history"
            (per prompt), "group" (the finished siblings in this rollout), "oracle" (true lengths; replay only),
            "noisy:S" (the oracle with log-normal error of spread S; replay only), names joined by "+" (combined,
            e.g. "online+group"); or a :class:`~lit_grpo.scheduling.predictors.LengthPredictor`.
        refill: which job a freed slot runs: "lpt" (longest first; the measured default), "sjf", "fifo"; or a
            :class:`~lit_grpo.scheduling.refill.RefillPolicy`.
        grouping: the global plan: "fptas", "lpt", "kk" (Karmarkar-Karp); or a function
            ``(lengths, num_slots, ready=None) -> Partition``.
        epsilon: the FPTAS's approximation parameter (plan makespan <= (1 + epsilon) x optimum), > 0.
        probe_tokens: k, the tokens a sample runs before a token-conditioned predictor re-predicts its length
            (None or 0: no probe; every sample is planned from prompt-level predictions).
        park_budget: bound on parked samples as a fraction of the slots' generation KV, > 0 (None: unbounded).
        preempt_tokens: q; while predictions are not followed, preempt a running sample at q, 2q, 4q, ... tokens,
            then every eighth of the cap, for one that has generated fewer, where that is established to pay
            (``preemption.py``; None or 0: first-come order).
        replan_tolerance: re-plan when a slot frees more than this fraction of its job's predicted duration off
            the plan, >= 0.
        slack_scale: >= 0; a freed slot runs the pool's longest job instead of its planned pick when that costs
            the plan at most ``slack_scale x`` the calibrated spread of its makespan (0: the refill policy alone).
        critical_fraction: > 0; during the probe phase a sample keeps running instead of parking when its
            expected remaining length is at least this fraction of the average slot's remaining work (None: never).
        gain_z: > 0, the confidence (standard deviations) a prediction-guided order's gain over arrival order
            needs before the scheduler follows it, and parks at probes (``gate.py``; preemption has its own test,
            ``preemption.LOSS_SHARE``); None: follow trusted predictions ungated, and preempt wherever the drawn
            gain is positive.
    """

    predictor: Union[PredictorName, str] = "online"
    refill: RefillName = DEFAULT_REFILL
    grouping: GroupingName = "fptas"
    epsilon: float = DEFAULT_EPSILON
    probe_tokens: int | None = 8
    park_budget: float | None = 0.5
    preempt_tokens: int | None = 8
    replan_tolerance: float = 0.1
    slack_scale: float = 0.0
    critical_fraction: float | None = 1.0
    gain_z: float | None = GAIN_Z

    def __post_init__(self) -> None:
        if isinstance(self.predictor, str):
            try:
                parse_predictor_name(self.predictor)
            except ValueError as error:
                raise ValueError(f"scheduler.predictor: {error}") from None
        for name, choice in (("refill", RefillName), ("grouping", GroupingName)):
            if isinstance(getattr(self, name), str):  # else an object (a RefillPolicy, a grouping function)
                check_choice(f"scheduler.{name}", getattr(self, name), get_args(choice))
        if not (isinstance(self.epsilon, (int, float)) and self.epsilon > 0):
            raise ValueError(f"scheduler.epsilon={self.epsilon!r} must be a number > 0")
        for name in ("probe_tokens", "preempt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"scheduler.{name}={value!r} must be an integer >= 0 or None")
        optional = ("park_budget", "critical_fraction", "gain_z")
        for name, minimum, strict in (("park_budget", 0, True), ("replan_tolerance", 0, False),
                                      ("slack_scale", 0, False), ("critical_fraction", 0, True), ("gain_z", 0, True)):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or (
                    value <= minimum if strict else value < minimum):
                relation = ">" if strict else ">="
                none = " or None" if name in optional else ""
                raise ValueError(f"scheduler.{name}={value!r} must be a number {relation} {minimum}{none}")

    @classmethod
    def from_options(cls, options: dict[str, Any] | InfiniteSchedulerConfig | None) -> InfiniteSchedulerConfig:
        """A config from a dict of options (``sampling.scheduler`` given as a plain mapping), naming any unknown
        key."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown scheduler options {unknown}; allowed: {known}")
        return cls(**options)

    def parked_kv_bounds(self, max_new_tokens: int) -> tuple[int, float]:
        """What parked samples may hold, for a KV budget (``memory_budget.auto_micro_group_size``): ``(tokens each
        sample may hold parked whatever g is, share of the slots' generation KV)``. Probes park a sample's first
        ``probe_tokens``; preemption parks within ``park_budget`` of the slots' KV, or, unbounded, each sample up to
        its last preemption point."""
        probe = self.probe_tokens or 0
        points = preemption_points(self.preempt_tokens, max_new_tokens)
        if not points:
            return probe, 0.0
        if self.park_budget is None:
            return max(probe, max(points)), 0.0
        return probe, float(self.park_budget)

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments of ``InfiniteScheduler``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
