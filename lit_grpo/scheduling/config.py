"""The "infinite" strategy's options, typed and checked once: ``InfiniteSchedulerConfig`` (the default scheduler)
and, inside it, ``LengthAwareConfig`` (the paper's method, off unless given).

Frozen dataclasses, so LightningCLI shows them under ``--print_config`` and rejects a wrong name when the YAML is
parsed (``Literal`` types); numbers are checked when the object is built, with errors that name the key::

    data:
      sampling:
        strategy: infinite
        scheduler: {preempt_tokens: 8, park_budget: 0.5, loss_share: 0.1}        # the default
        # scheduler: {length_aware: {predictor: online, refill: lpt}}            # the paper's method
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, Union, get_args

from lit_grpo.runtime.validation import check_choice, check_field, check_int, check_real, shown_setting
from lit_grpo.scheduling.base import Scheduler
from lit_grpo.scheduling.least_attained import (LOSS_SHARE, PARK_BUDGET, PREEMPT_TOKENS, LeastAttainedScheduler,
                                                preemption_points)

# The length-aware method's option vocabulary lives here, not in ``length_aware/``, so that the default path
# (InfiniteSchedulerConfig, the CLI's parser of it) loads nothing of that package; its modules import these names
# from here, and this module imports them only where a LengthAwareConfig is checked or built.

#: The predictors named without an argument; "noisy:S" is the oracle with log-normal error of spread S.
PredictorName = Literal["online", "oracle"]
#: The refill policies (``length_aware.refill.RefillPolicy``): longest first, shortest first, arrival order.
RefillName = Literal["lpt", "sjf", "fifo"]
#: The guided order is followed when mean gain > GAIN_Z x std of the per-draw gain (about 84% of draws win at 1).
GAIN_Z = 1.0


def _check_number(name: str, value: Any, minimum: float, strict: bool,
                  maximum: float | None = None) -> float | None:
    """``value`` as a plain float if it is a finite number > (or >=) ``minimum`` (and <= ``maximum``), or None; else
    a ValueError naming the key."""
    if value is None:
        return None
    try:
        return check_real(f"scheduler.{name}", value, minimum, maximum, low_open=strict)
    except ValueError as error:
        raise ValueError(f"{error}, or None") from None


def _check_tokens(name: str, value: Any) -> int | None:
    """``value`` as a plain int if it is an integer >= 0 (a numpy one too), or None; else a ValueError naming the
    key."""
    return check_int(f"scheduler.{name}", value, 0, none=True)


@dataclass(frozen=True)
class LengthAwareConfig:
    """The paper's length-aware method (``lit_grpo.scheduling.length_aware``), experimental.

    Attributes:
        predictor: "online" (token-conditioned, learned from finished rollouts), "oracle" (true lengths; replay
            only), "noisy:S" (the oracle with log-normal error of spread S; replay only); or a
            :class:`~lit_grpo.scheduling.length_aware.predictors.LengthPredictor`.
        refill: which job of its planned share a freed slot runs: "lpt" (longest first), "sjf" (the paper's),
            "fifo"; or a :class:`~lit_grpo.scheduling.length_aware.refill.RefillPolicy`.
        probe_tokens: k, the tokens a sample runs before a token-conditioned predictor re-predicts its length
            (None or 0: no probe).
        gain_z: > 0, the standard deviations by which the predicted order's gain over arrival order must be
            established before it is followed (None: follow trusted predictions ungated).
    """

    predictor: Union[PredictorName, str] = "online"
    refill: RefillName = "lpt"
    probe_tokens: int | None = 8
    gain_z: float | None = GAIN_Z

    def __post_init__(self) -> None:
        # Imported here: only a run that asks for the method loads it (the default path never builds this class).
        from lit_grpo.scheduling.length_aware.predictors import LengthPredictor, parse_predictor_name
        from lit_grpo.scheduling.length_aware.refill import RefillPolicy

        if isinstance(self.predictor, str):
            try:
                parse_predictor_name(self.predictor)
            except ValueError as error:
                raise ValueError(f"scheduler.length_aware.predictor: {error}") from None
        elif not isinstance(self.predictor, LengthPredictor):
            raise ValueError(f"{shown_setting('scheduler.length_aware.predictor', self.predictor)} must be a "
                             "predictor's name or a LengthPredictor")
        if isinstance(self.refill, str):
            check_choice("scheduler.length_aware.refill", self.refill, get_args(RefillName))
        elif not isinstance(self.refill, RefillPolicy):
            raise ValueError(f"{shown_setting('scheduler.length_aware.refill', self.refill)} must be one of "
                             f"{get_args(RefillName)} or a RefillPolicy")
        check_field(self, "probe_tokens", _check_tokens, prefix="length_aware.")
        check_field(self, "gain_z", _check_number, 0, strict=True, prefix="length_aware.")


@dataclass(frozen=True)
class InfiniteSchedulerConfig:
    """Settings of the "infinite" strategy's scheduler (``least_attained.py`` says what each one does there).

    Attributes:
        preempt_tokens: q, the first preemption point (then 2q, 4q, ..., then every eighth of the cap); None or 0:
            no preemption (plain continuous sampling).
        park_budget: parked samples' KV as a share of the slots' generation KV, > 0 (None: unbounded).
        loss_share: the most drawn rollouts, in [0, 1], that may lose to first-come order where preemption is
            chosen (None: preempt wherever the drawn rollouts gain on average).
        length_aware: the paper's length-aware method on top (a ``LengthAwareConfig`` or a dict of its fields;
            None: off).
    """

    preempt_tokens: int | None = PREEMPT_TOKENS
    park_budget: float | None = PARK_BUDGET
    loss_share: float | None = LOSS_SHARE
    length_aware: LengthAwareConfig | None = None

    def __post_init__(self) -> None:
        check_field(self, "preempt_tokens", _check_tokens)
        check_field(self, "park_budget", _check_number, 0, strict=True)
        check_field(self, "loss_share", _check_number, 0, strict=False, maximum=1)
        if isinstance(self.length_aware, dict):
            object.__setattr__(self, "length_aware", _from_options(LengthAwareConfig, self.length_aware,
                                                                   "scheduler.length_aware"))
        if self.length_aware is not None and not isinstance(self.length_aware, LengthAwareConfig):
            raise ValueError(f"{shown_setting('scheduler.length_aware', self.length_aware)} must be a "
                             f"LengthAwareConfig, a dict of its fields {[f.name for f in fields(LengthAwareConfig)]}, "
                             "or None")

    @classmethod
    def from_options(cls, options: dict[str, Any] | InfiniteSchedulerConfig | None) -> InfiniteSchedulerConfig:
        """A config from a dict of options (``sampling.scheduler`` given as a plain mapping), naming any unknown
        key."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        return _from_options(cls, options, "scheduler")

    def build(self) -> Scheduler:
        """The scheduler this config describes."""
        default = {"preempt_tokens": self.preempt_tokens, "park_budget": self.park_budget,
                   "loss_share": self.loss_share}
        if self.length_aware is None:
            return LeastAttainedScheduler(**default)
        from lit_grpo.scheduling.length_aware.scheduler import LengthAwareScheduler

        return LengthAwareScheduler(self.length_aware, **default)

    def parked_kv_bounds(self, max_new_tokens: int) -> tuple[int, float]:
        """What parked samples may hold, for a KV budget (``memory_budget.auto_micro_group_size``): ``(tokens each
        sample may hold parked whatever g is, share of the slots' generation KV)``. The length-aware method's probes
        park a sample's first ``probe_tokens``; preemption parks within ``park_budget`` of the slots' KV, or,
        unbounded, each sample up to its last preemption point."""
        probe = (self.length_aware.probe_tokens or 0) if self.length_aware is not None else 0
        points = preemption_points(self.preempt_tokens, max_new_tokens)
        if not points:
            return probe, 0.0
        if self.park_budget is None:
            return max(probe, max(points)), 0.0
        return probe, float(self.park_budget)

    def replace(self, **changes: Any) -> InfiniteSchedulerConfig:
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)


#: Scheduler options that belong elsewhere or nowhere, each with where it is set instead: the hint a config naming
#: one gets in its error.
_MOVED = {**{name: "moved under length_aware" for name in ("predictor", "refill", "probe_tokens", "gain_z")},
          **{name: "removed (it measured nothing)" for name in ("grouping", "epsilon", "replan_tolerance",
                                                                "slack_scale", "critical_fraction")}}


def _from_options(cls: type, options: dict[str, Any], where: str) -> Any:
    known = [f.name for f in fields(cls)]
    if not isinstance(options, Mapping):  # a string or a list would be read key by key
        raise ValueError(f"{shown_setting(where, options, 80)} must be a mapping of its options {known}")
    unknown = sorted(set(options) - set(known))
    if unknown:
        notes = "; ".join(f"{name}: {_MOVED[name]}" for name in unknown
                          if name in _MOVED and cls is not LengthAwareConfig)
        raise ValueError(f"unknown {where} options {unknown}; allowed: {known}" + (f" ({notes})" if notes else ""))
    return cls(**options)
