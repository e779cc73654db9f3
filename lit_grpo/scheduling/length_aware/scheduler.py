"""The paper's length-aware scheduler (opt-in: ``scheduler.length_aware``): token-conditioned length prediction,
global grouping, runtime refill, on top of the default's least-attained-service preemption.

Experimental: on real SmolLM2 rollouts no learned predictor has beaten the default (docs/benchmarks.md, "The
scheduler"); with the oracle, or with a planted signal in the hidden states, it reaches the best plan. It is kept
for that, and for predictors to come.

Predictions are used only as far as they have earned trust (``trust.py``): every finished sample scores the
prediction made for it, and the scheduler works from the *calibrated* prediction (prompt and probe predictions
earn trust apart). At planning points the gate (``trust.py``) compares prediction order with arrival order on
lengths drawn from the calibrated model and follows the predictions only where their gain is established. A
rollout that neither follows predictions nor parks at probes from its start runs as the default scheduler would
(``least_attained.py``: preempting where that pays); one that stops following them midway runs first come, first
served from there.

Before a token is sampled the G samples of a prompt are exchangeable, so only a token-conditioned predictor can
tell them apart, once a sample has started. With one the scheduler probes:

1. Probe: a sample runs ``probe_tokens`` (k) tokens, then the predictor re-predicts its length from its own hidden
   state. Where probe predictions are trusted and samples wait, the sample is parked (reason ``probe``) so that
   the plan sees every sample's probe before it commits; otherwise it runs on and its probe is only scored. A
   sample keeps running when it is critical (its expected remaining work is at least the average slot's) or when
   the park budget is full (``max_parked = max(slots, park_budget x slots x max_new_tokens / k)`` samples parked).
   The budget is checked while unprobed samples remain; the probe phase's last round (the samples that were
   still probing when the last unprobed one started, at most one per slot) parks regardless, so that the plan
   sees their probes, and the first planned pick may swap one more for the sample it resumes: at most
   ``max_parked + slots - 1`` samples are parked at once (``peak_parked``).
2. Plan: the remaining work (calibrated expected remaining lengths of the waiting samples, and of the running ones
   as slot ready times) is partitioned over the slots by the FPTAS and each freed slot runs the job of its share
   that the refill policy prefers (reason ``plan``; ``refill.SlotPlanner`` re-plans when the plan goes stale). At
   its probe a running sample competes with the pool for its own slot, and is parked (reason ``plan``) where the
   plan prefers another job there.

Metrics from ``end``: ``length_pred_kendall_tau`` and ``length_pred_smape`` of the last prediction made for each
sample before it finished against its true length; more diagnostics of the last rollout in ``last_info``.

State: the predictor, the trust and the default's finished groups live across rollouts (``state_dict``); what one
rollout plans with lives in ``now`` (:class:`RolloutPlan`), made by ``begin``; which sample runs where, which are
parked and how far each got is the base Scheduler's record.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_grpo.runtime.validation import shown_keys
from lit_grpo.scheduling.base import ARRIVAL, Assignment, RolloutWork, SampleKey
from lit_grpo.scheduling.config import LengthAwareConfig
from lit_grpo.scheduling.least_attained import LeastAttainedScheduler
from lit_grpo.scheduling.length_aware.predictors import (MAX_LOG_STD, LengthPredictor, expected_length, kendall_tau,
                                                         log_rmse, make_predictor, smape)
from lit_grpo.scheduling.length_aware.refill import RefillPolicy, SlotPlanner
from lit_grpo.scheduling.length_aware.trust import PredictionTrust, follow_predictions, guided_gain, probes_pay

#: Why the length-aware scheduler started, resumed or parked a sample (besides the default's reasons).
PROBE = "probe"  # started to reach its probe, or parked after it until the plan has seen every probe
PLAN = "plan"  # the refill policy's pick from the slot's planned share (or parked for it at its probe)
#: During the probe phase a sample keeps running when its expected remaining length is at least this share of the
#: average slot's remaining work: parked, it would alone set the makespan.
CRITICAL_FRACTION = 1.0


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
    runs: dict[SampleKey, SampleRun] = field(default_factory=dict)  # of the samples started (read for running ones)
    reserved: dict[int, SampleKey] = field(default_factory=dict)  # slot -> sample chosen at a probe, admitted next
    token_features: dict[SampleKey, torch.Tensor] = field(default_factory=dict)  # probe features, until finished
    prompt_predictions: dict[SampleKey, float] = field(default_factory=dict)  # raw predictions by kind: a
    probe_predictions: dict[SampleKey, float] = field(default_factory=dict)  # probed sample's latest is its probe's
    scored: list[tuple[float, int]] = field(default_factory=list)  # (latest prediction, true length), finish order
    # Finished samples the predictor has not learned from yet: (key, length, token feature or None), taught in one
    # batch when predictions are refreshed and at the end, not one by one between decode steps (host time there is
    # the accelerator's idle time).
    unlearned: list[tuple[SampleKey, int, torch.Tensor | None]] = field(default_factory=list)
    # More samples than slots: some wait, so an order is chosen; else the predictor is asked nothing.
    waits: bool = True
    parking: bool = False  # park at probes in this rollout
    unprobed: deque = field(default_factory=deque)  # samples to start for their probe, in refill order
    unprobed_work: float = 0.0  # their expected remaining work
    max_parked: int = 0
    gain: tuple[float, float] = (0.0, 0.0)  # the gate's (mean, std) gain of the guided order
    guided: bool = False  # follow the predictions (else the default scheduler's order)
    first_gain: tuple[float, float, bool] = (0.0, 0.0, False)  # the rollout's opening decision, for last_info

    def prediction(self, key: SampleKey) -> float:
        """The latest raw prediction of a sample (NaN: none)."""
        return self.probe_predictions.get(key, self.prompt_predictions.get(key, float("nan")))


class LengthAwareScheduler(LeastAttainedScheduler):
    """The paper's length-aware scheduler; one object serves many rollouts (the predictor and trust learn).

    Args:
        config: a ``LengthAwareConfig`` (predictor, refill, probe_tokens, gain_z; its docstring says each).
        default: keyword arguments of :class:`LeastAttainedScheduler`, the order used where predictions are not
            followed (its ``park_budget`` bounds the samples parked at probes too).
    """

    def __init__(self, config: LengthAwareConfig | None = None, **default: Any) -> None:
        super().__init__(**default)
        self.config = config if config is not None else LengthAwareConfig()
        predictor = self.config.predictor
        self.predictor: LengthPredictor = make_predictor(predictor) if isinstance(predictor, str) else predictor
        refill = self.config.refill
        self.refill = RefillPolicy(refill) if isinstance(refill, str) else refill
        # Engine-facing switches (instance attributes shadow the base class's defaults): a token-conditioned
        # predictor is probed every rollout, parked or not, so that its probes keep being scored.
        self.needs_prompt_features = bool(self.predictor.needs_prompt_features)
        self.probe_tokens = (self.config.probe_tokens or None) if self.predictor.token_conditioned else None
        self.trust = {"prompt": PredictionTrust(), "probe": PredictionTrust()}

    # ---- engine contract -------------------------------------------------------------------------------------

    def begin(self, work: RolloutWork) -> None:
        super().begin(work)  # the default's decision: preempt in this rollout or not
        default_preempting, self.preempting = self.preempting, False
        now = self.now = RolloutPlan(SlotPlanner(self.refill, work.num_slots),
                                     {key: i for i, key in enumerate(work.keys())})
        keys = work.pending_keys()
        now.waits = len(keys) > work.num_slots
        if now.waits:
            now.prompt_predictions.update(zip(keys, [float(v) for v in self.predictor.predict(work, keys).tolist()]))
        # Park at probes only where the plan can use what a probe tells: trusted probes and samples that wait.
        gain_z = self.config.gain_z
        now.parking = (self.probe_tokens is not None and self.trust["probe"].informative
                       and now.waits and (gain_z is None or probes_pay(
                           self.trust["probe"], len(keys), work.num_slots, work.max_new_tokens, gain_z)))
        if now.parking:  # samples carried past their probe are planned at once, like probed ones
            unprobed = [key for key in keys if self.generated[key] < self.probe_tokens]
            candidates = [(self._expected_remaining(key, self.generated[key]), now.rank[key]) for key in unprobed]
            now.unprobed.extend(unprobed[i] for i in self.refill.order(candidates))
            now.unprobed_work = sum(length for length, _ in candidates)
        probing = set(now.unprobed)
        for key in keys:
            if key not in probing:
                now.planner.add(key, self._expected_remaining(key, self.generated[key]), now.rank[key])
        now.max_parked = self._max_parked(work)
        self._judge()
        now.first_gain = now.gain + (now.guided,)
        # The default's preemption runs where predictions are neither followed nor waited for.
        self.preempting = default_preempting and not now.parking and not now.guided
        if not self.preempting:
            self.preempt_points = frozenset()
        if now.parking or now.guided:
            self.gate_note = "parking at probes" if now.parking else "following predictions"

    def admit(self) -> list[Assignment]:
        if self.preempting:
            return super().admit()  # the default's least attained service; the plan is not consulted
        now = self.now
        free = self.free_slots()
        free.sort(key=lambda slot: slot not in now.reserved)  # reserved slots first: their sample is promised
        assignments = []
        self._refresh_predictions()
        for slot in free:
            key, reason = self._next_for(slot)
            if key is None:
                break
            now.runs[key] = SampleRun(self.step, self.generated[key])
            if now.parking and self._awaits_probe(key):
                now.planner.note_start(slot, self.step, min(self.probe_tokens, self._expected_remaining(key, 0)))
            assignments.append(self._place(slot, key, reason))
        return assignments

    def probe(self, key: SampleKey, generated: int, feature: torch.Tensor) -> bool:
        now = self.now
        if not now.waits or key not in self.running or key in now.probe_predictions:
            return False  # nothing to decide, or not ours to judge (already re-predicted, or not running)
        feature = feature.detach().to("cpu", torch.float32).reshape(-1)
        now.token_features[key] = feature
        now.probe_predictions[key] = float(self.predictor.predict(self.work, [key], feature[None])[0])
        remaining = self._expected_remaining(key, generated)
        slot, planner = self.running[key], now.planner
        if not now.parking or not len(planner) and not now.unprobed:
            planner.note_start(slot, self.step, remaining)  # nothing to gain from parking: it runs on
            return False
        if now.unprobed:
            if len(self.parked) < now.max_parked and not self._critical(remaining):
                self._park_to_pool(key, remaining, PROBE)
                return True
            planner.note_start(slot, self.step, remaining)  # budget full or critical: it keeps its slot
            return False
        if any(self._awaits_probe(other) for other in self.running if other != key):
            # Other slots are still probing (the probe phase's last round): plan once they have reported.
            self._park_to_pool(key, remaining, PROBE)
            return True
        if not now.guided:  # the gate chose arrival order: the running sample keeps its slot
            planner.note_start(slot, self.step, remaining)
            return False
        # Plan phase: the sample competes with the pool for its own slot.
        planner.add(key, remaining, now.rank[key])
        chosen = planner.choose(slot, self.step, self._ready(exclude=slot), self._noise())
        if chosen == key:
            return False
        self._park(key, PLAN)  # choose() took `chosen`; `key` stays in the pool
        now.reserved[slot] = chosen
        return True

    def finish(self, key: SampleKey, length: int) -> None:
        super().finish(key, length)
        now = self.now
        if not now.waits:
            return
        now.scored.append((now.prediction(key), int(length)))
        now.unlearned.append((key, int(length), now.token_features.pop(key, None)))
        if key in now.prompt_predictions:
            self.trust["prompt"].observe(now.prompt_predictions[key], length)
        if key in now.probe_predictions:
            self.trust["probe"].observe(now.probe_predictions[key], length)

    def end(self) -> dict[str, float]:
        now = self.now
        self._learn()
        for trust in self.trust.values():
            trust.end_rollout()
        metrics = super().end()
        default_info = self.last_info
        scored = [(predicted, true) for predicted, true in now.scored if predicted == predicted]  # NaN: unpredicted
        predicted, true = [p for p, _ in scored], [t for _, t in scored]
        # Where nothing waited nothing was predicted: the rollout has no figure for the prediction's quality.
        if now.waits:
            metrics.update(length_pred_kendall_tau=kendall_tau(predicted, true),
                           length_pred_smape=smape(predicted, true))
        stats = now.planner.stats
        self.last_info = {
            "length_pred_kendall_tau": math.nan, "length_pred_smape": math.nan, **metrics, **default_info,
            "length_pred_log_rmse": log_rmse(predicted, true), "max_parked": now.max_parked,
            "replans": stats.replans, "plan_seconds": stats.plan_seconds, "steals": stats.steals,
            "parking": float(now.parking), "prompt_trust": self.trust["prompt"].rho_low,
            "probe_trust": self.trust["probe"].rho_low, "gain_mean": now.first_gain[0],
            "gain_std": now.first_gain[1], "guided": float(now.first_gain[2]),
        }
        return metrics

    def state_dict(self) -> dict:
        """What must survive a checkpoint resume: the predictor's learned state, the trust it earned and the
        default's finished groups (plans are per rollout)."""
        return {**super().state_dict(), "predictor": self.predictor.state_dict(),
                "trust": {kind: trust.state_dict() for kind, trust in self.trust.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Take ``state`` (``state_dict``'s, from a checkpoint): the default's finished groups and the trust states
        are checked before the predictor's is taken (itself checked whole first), the groups and the trust taken
        last, so that a bad one, refused naming which, leaves the predictor, the groups and the trust as they were.
        A kind of trust the state lacks stays as it is."""
        groups = self.checked_groups(state)
        if "predictor" not in state:  # the default scheduler's state: nothing learned to resume
            self.groups = groups
            warnings.warn("the checkpoint's scheduler state is the default scheduler's (no length predictor): the "
                          "length-aware method's predictor and trust start fresh", stacklevel=2)
            return
        trust = self._checked_trust(state.get("trust", {}))
        try:
            self.predictor.load_state_dict(state["predictor"])
        except (KeyError, ValueError) as error:  # KeyError: a predictor of the caller's that checks nothing
            said = f"lacks {error}" if isinstance(error, KeyError) else str(error)
            raise ValueError(f"the checkpoint's length predictor state does not load into this run's "
                             f"{type(self.predictor).__name__}: {said}") from error
        self.groups = groups
        self.trust.update(trust)

    def _checked_trust(self, states: Any) -> dict[str, PredictionTrust]:
        """The trust of each kind in ``states`` (the state's ``trust``), loaded into new ones, else a ValueError
        naming the bad kind."""
        kinds = ", ".join(self.trust)
        if not isinstance(states, Mapping):
            raise ValueError(f"the checkpoint's scheduler state trust must be a mapping of kinds ({kinds}) to trust "
                             f"states, not {type(states).__name__}")
        if unknown := [kind for kind in states if kind not in self.trust]:
            raise ValueError(f"the checkpoint's scheduler state has trust for unknown kinds {shown_keys(unknown)}; a "
                             f"length-aware scheduler keeps {kinds}")
        loaded = {}
        for kind, trust_state in states.items():
            loaded[kind] = PredictionTrust()
            try:
                loaded[kind].load_state_dict(trust_state)
            except ValueError as error:
                raise ValueError(f"the checkpoint's scheduler state trust[{kind!r}] does not load: {error}") from error
        return loaded

    # ---- policy ----------------------------------------------------------------------------------------------

    def _next_for(self, slot: int) -> tuple[SampleKey | None, str]:
        """The sample slot ``slot`` runs next, and why."""
        now = self.now
        if slot in now.reserved:
            return now.reserved.pop(slot), PLAN
        if now.unprobed and len(self.parked) < now.max_parked:
            key = now.unprobed.popleft()
            now.unprobed_work -= self._expected_remaining(key, self.generated[key])
            return key, PROBE
        if now.unprobed:  # park budget full: run the best parked sample
            return now.planner.choose_greedy(slot, self.step), PLAN
        if not self._pool_trust().informative or not now.guided:
            return now.planner.choose_first(slot, self.step), ARRIVAL  # predictions tell nothing
        return now.planner.choose(slot, self.step, self._ready(exclude=slot), self._noise()), PLAN

    def _pool_trust(self) -> PredictionTrust:
        """The trust that applies to the waiting samples' predictions (probed ones when parking)."""
        return self.trust["probe" if self.now.parking else "prompt"]

    def _noise(self) -> float:
        """The calibrated log-length spread of the pool's predictions: the precision plans are computed to."""
        return min(self._pool_trust().calibrate(1.0)[1], MAX_LOG_STD)

    def _critical(self, remaining: float) -> bool:
        """Would this sample, parked until the probe phase ends, set the makespan on its own?"""
        work = self.now.unprobed_work + self.now.planner.total_work + sum(self._ready(exclude=-1))
        return remaining >= CRITICAL_FRACTION * work / self.work.num_slots

    def _awaits_probe(self, key: SampleKey) -> bool:
        return key not in self.now.probe_predictions and self.generated[key] < self.probe_tokens

    def _park_to_pool(self, key: SampleKey, remaining: float, reason: str) -> None:
        self._park(key, reason)
        self.now.planner.add(key, remaining, self.now.rank[key])

    def _ready(self, exclude: int) -> list[float]:
        """``[num_slots]`` expected remaining steps of each slot's running sample (0 for free slots)."""
        now = self.now
        ready = [0.0] * self.work.num_slots
        for slot, key in enumerate(self.slots):
            if slot == exclude:
                continue
            if key is not None:
                # The driver counts a row's tokens as it goes through the step's rows: date them by the clock.
                run = now.runs[key]
                ready[slot] = self._expected_remaining(key, run.start_generated + (self.step - run.start_clock))
            elif slot in now.reserved:  # promised at a probe, admitted after this step
                reserved = now.reserved[slot]
                ready[slot] = self._expected_remaining(reserved, self.generated[reserved])
        return ready

    def _expected_remaining(self, key: SampleKey, generated: int) -> float:
        """Expected remaining tokens of a sample, from its calibrated prediction (``trust.py``)."""
        median, spread, _ = self._model(key, generated)
        return max(expected_length(median, spread, generated, self.work.max_new_tokens) - generated, 1.0)

    def _refresh_predictions(self) -> None:
        """Re-predict the pool once the predictor has learned from a slot's worth of finished samples (and a
        quarter pool's worth, so large pools cost O(1) each)."""
        now, planner = self.now, self.now.planner
        if len(now.unlearned) < max(self.work.num_slots, len(planner) // 4) or not len(planner):
            return
        self._learn()
        keys = list(planner.pool)
        with_tokens = [k for k in keys if k in now.token_features]
        without = [k for k in keys if k not in now.token_features]
        if with_tokens:
            features = torch.stack([now.token_features[k] for k in with_tokens])
            values = self.predictor.predict(self.work, with_tokens, features).tolist()
            now.probe_predictions.update(zip(with_tokens, map(float, values)))
        if without:
            values = self.predictor.predict(self.work, without).tolist()
            now.prompt_predictions.update(zip(without, map(float, values)))
        for key in keys:
            planner.update(key, self._expected_remaining(key, self.generated[key]))
        self._judge()

    def _judge(self) -> None:
        """Decide whether the pool follows its predictions or the default's order (the gate), at planning points."""
        now, gain_z = self.now, self.config.gain_z
        if not now.waits:  # every sample has a slot: nothing was predicted, so there is no order to follow
            now.guided = False
            return
        if not self._pool_trust().informative or now.unprobed or gain_z is None:
            now.guided = self._pool_trust().informative
            return
        pool = now.planner.pool
        keys = sorted(pool, key=lambda k: pool[k][1])
        waiting = [self._model(key, self.generated[key]) for key in keys]
        running = [self._model(key, now.runs[key].start_generated + self.step - now.runs[key].start_clock)
                   for key in self.running]
        expected = [pool[k][0] for k in keys]
        now.gain = guided_gain(waiting, running, self.work.num_slots, self.work.max_new_tokens, expected)
        now.guided = follow_predictions(*now.gain, current=now.guided, z=gain_z)

    def _model(self, key: SampleKey, generated: int) -> tuple[float, float, int]:
        """``(calibrated median, calibrated spread, tokens generated)`` of a sample."""
        trust = self.trust["probe" if key in self.now.probe_predictions else "prompt"]
        median, spread = trust.calibrate(self.now.prediction(key))
        return median, min(spread, MAX_LOG_STD), generated

    def _learn(self) -> None:
        """Teach the predictor the samples finished since it last learned, in finish order: one call per run of
        probed or unprobed samples (a predictor takes one feature tensor for all the keys of a call, or none)."""
        for probed, run in itertools.groupby(self.now.unlearned, key=lambda entry: entry[2] is not None):
            keys, lengths, features = zip(*run)
            self.predictor.observe(self.work, list(keys), list(lengths), torch.stack(features) if probed else None)
        self.now.unlearned = []

    def _max_parked(self, work: RolloutWork) -> int:
        """The park budget in samples at probes (``last_info["max_parked"]``); the probe phase's last round may
        exceed it by ``num_slots - 1`` (the module's docstring, 1.)."""
        if self.park_budget is None or not self.now.parking:
            return len(work.keys())
        return max(work.num_slots, int(self.park_budget * work.num_slots * work.max_new_tokens // self.probe_tokens))
