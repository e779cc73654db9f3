"""The "infinite" scheduler: continuous slots + length prediction + global grouping + runtime refill.

Predictions are used only as far as they have earned trust (``trust.py``): every finished sample scores the
predictions made for it, and the scheduler works from the *calibrated* prediction (regression of true on predicted
log length, correlation at the lower end of its confidence interval; prompt and probe predictions earn trust
apart). Trust is not enough: with weak predictions the guided order is just another draw of the tail, which can
lose to arrival order. So at planning points a gate (``gate.py``) draws the pool's lengths from the calibrated
lognormal model and compares guided and arrival order on the same draws; the predictions are followed only
where their per-rollout gain is established, the course changes only where the other one is, and probes park
samples only where a plan on probe predictions of the trust they earned would win. Otherwise a freed slot takes
the first waiting sample (plain continuous order), or, where the lengths seen so far establish that it pays, the
waiting sample that has generated least, running samples being preempted at ``preempt_tokens`` x 1, 2, 4, ...
tokens, then every eighth of the cap (``preemption.py``: least attained service, which needs no prediction).

Before a token is sampled the G samples of a prompt are exchangeable, so only a token-conditioned predictor can
tell them apart, once a sample has started. With such a predictor the scheduler probes:

1. Probe: a sample runs ``probe_tokens`` (k) tokens, then the predictor re-predicts its length from its own hidden
   state. If probe predictions are trusted and samples wait for a slot, the sample is parked: the engine keeps
   its k tokens' KV aside and its slot takes the next unprobed sample, so that the plan sees every sample's probe
   before it commits. Otherwise parking cannot improve the plan and the sample runs on; its probe prediction is
   still scored, which is how probes earn trust. A sample keeps running when it is *critical* (its expected
   remaining work is at least the average slot's, so parked it would alone set the makespan) or when the park
   budget is full (``park_budget``: at most ``park_budget * slots * max_new_tokens / k`` samples parked at once).
2. Plan: the remaining work (calibrated expected remaining lengths of the waiting samples, and of the running
   ones as slot ready times) is partitioned over the slots (FPTAS by default) and each freed slot runs the job
   of its planned share that the refill policy prefers; a slot that frees off the plan, a used-up share or new
   predictions re-plan the pool (:class:`~lit_grpo.scheduling.refill.SlotPlanner`). Lengths are expected values
   given survival (:func:`~lit_grpo.scheduling.lognormal.expected_length`) under the calibrated spread, and plans
   are computed to that precision: planning finer than the lengths are known buys nothing.

Default refill: "lpt" (a slot runs its longest, most uncertain job first, so an error shows while short jobs
remain to absorb it; SJF leaves long jobs and their errors for the tail).

Metrics from ``end``: ``length_pred_kendall_tau`` and ``length_pred_smape`` of the last prediction made for each
sample before it finished against its true length. Diagnostics of the last rollout are in ``last_info`` (with
``length_pred_log_rmse``, the root-mean-square log error of the same predictions).

State: the settings (``config``), the predictor, the trust and the preemption gate's groups live across rollouts;
everything a rollout plans with lives in one ``RolloutPlan`` (``rollout_plan.py``) made by ``begin``; which sample
runs where, which are parked and how far each got is the base Scheduler's record.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from lit_grpo.scheduling.base import Assignment, RolloutWork, SampleKey, Scheduler
from lit_grpo.scheduling.config import InfiniteSchedulerConfig
from lit_grpo.scheduling.gate import follow_predictions, guided_gain, probes_pay
from lit_grpo.scheduling.grouping import make_grouping
from lit_grpo.scheduling.prediction_metrics import log_rmse
from lit_grpo.scheduling.predictors import LengthPredictor, expected_length, kendall_tau, make_predictor, smape
from lit_grpo.scheduling.preemption import LOSS_SHARE, AttainedService, preemption_points
from lit_grpo.scheduling.refill import SlotPlanner, make_refill
from lit_grpo.scheduling.rollout_plan import RolloutPlan, SampleRun
from lit_grpo.scheduling.trust import PredictionTrust

#: The widest log-length spread worth reasoning with (beyond e^4 a spread means "unknown" anyway).
MAX_LOG_STD = 4.0


class InfiniteScheduler(Scheduler):
    """Length-aware scheduler of "infinite"; one object serves many rollouts (predictors and trust learn).

    Args:
        predictor: "online" | "history" | "oracle" | "noisy:S" or a
            :class:`~lit_grpo.scheduling.predictors.LengthPredictor` (default: the config's).
        config: the settings (default: ``InfiniteSchedulerConfig()``, whose docstring describes each one).
        options: fields of the config to change (``refill``, ``probe_tokens``, ...).
    """

    def __init__(self, predictor: str | LengthPredictor | None = None, *,
                 config: InfiniteSchedulerConfig | None = None, **options: Any) -> None:
        if predictor is not None:
            options["predictor"] = predictor
        config = config if config is not None else InfiniteSchedulerConfig()
        self.config = InfiniteSchedulerConfig.from_options({**config.as_kwargs(), **options}) if options else config
        predictor = self.config.predictor
        self.predictor = make_predictor(predictor) if isinstance(predictor, str) else predictor
        self.refill = make_refill(self.config.refill)
        self.grouping = make_grouping(self.config.grouping, self.config.epsilon)
        # Engine-facing switches (instance attributes shadow the base class's defaults): a token-conditioned
        # predictor is probed every rollout, parked or not, so that its probes keep being scored.
        self.needs_prompt_features = bool(self.predictor.needs_prompt_features)
        self.probe_tokens = (self.config.probe_tokens or None) if self.predictor.token_conditioned else None
        self.trust = {"prompt": PredictionTrust(), "probe": PredictionTrust()}
        self.preemption = AttainedService(self.config.preempt_tokens,
                                          None if self.config.gain_z is None else LOSS_SHARE)
        self.last_info: dict[str, float] = {}

    @classmethod
    def from_config(cls, config: InfiniteSchedulerConfig) -> InfiniteScheduler:
        """The scheduler a typed config (``SamplingConfig.scheduler``) describes."""
        return cls(config=config)

    # ---- engine contract -------------------------------------------------------------------------------------

    def begin(self, work: RolloutWork) -> None:
        super().begin(work)
        planner = SlotPlanner(self.refill, self.grouping, work.num_slots, self.config.replan_tolerance,
                              epsilon=self.config.epsilon)
        # the rollout under way: everything this rollout plans with, dropped by the next begin()
        now = self.now = RolloutPlan(planner, {key: i for i, key in enumerate(work.keys())})
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
                planner.add(key, self._expected_remaining(key, self.generated[key]), now.rank[key])
        now.max_parked = self._max_parked(work)
        self._judge()
        now.first_gain = now.gain + (now.guided,)
        now.preempting = now.waits and not now.parking and not now.guided and self.preemption.pays(
            work.num_prompts, work.group_size, work.num_slots, work.max_new_tokens, self._park_tokens())
        points = preemption_points(self.config.preempt_tokens, work.max_new_tokens)
        self.preempt_points = points if now.preempting else frozenset()

    def admit(self) -> list[Assignment]:
        free = self.free_slots()
        free.sort(key=lambda slot: slot not in self.now.reserved)  # reserved slots first: their sample is promised
        assignments = []
        self._refresh_predictions()
        for slot in free:
            key = self._next_for(slot)
            if key is None:
                break
            self._start(slot, key)
            assignments.append(self._place(slot, key))
        return assignments

    def probe(self, key: SampleKey, generated: int, feature: torch.Tensor) -> bool:
        now = self.now
        if not now.waits or key not in self.running or key in now.probe_predictions:
            return False  # nothing to decide, or not ours to judge (already re-predicted, or not running)
        self._advance_clock(now.runs[key], generated)
        feature = feature.detach().to("cpu", torch.float32).reshape(-1)
        now.token_features[key] = feature
        now.probe_predictions[key] = float(self.predictor.predict(self.work, [key], feature[None])[0])
        remaining = self._expected_remaining(key, generated)
        slot, planner = self.running[key], now.planner
        if not now.parking or not len(planner) and not now.unprobed:
            planner.note_start(slot, now.clock, remaining)  # nothing to gain from parking: it runs on
            return False
        if now.unprobed:
            if len(self.parked) < now.max_parked and not self._critical(remaining):
                self._park(key, remaining)
                return True
            planner.note_start(slot, now.clock, remaining)  # budget full or critical: it keeps its slot
            return False
        if any(self._awaits_probe(other) for other in self.running if other != key):
            # Other slots are still probing (the probe phase's last round): plan once they have reported.
            self._park(key, remaining)
            return True
        if not now.guided:  # the gate chose arrival order: the running sample keeps its slot
            planner.note_start(slot, now.clock, remaining)
            return False
        # Plan phase: the sample competes with the pool for its own slot.
        planner.add(key, remaining, now.rank[key])
        chosen = planner.choose(slot, now.clock, self._ready(exclude=slot), *self._slack_and_noise())
        if chosen == key:
            return False
        self._park(key, remaining, pooled=True)  # choose() took `chosen`; `key` stays in the pool
        now.reserved[slot] = chosen
        return True

    def preempt(self, key: SampleKey, generated: int) -> bool:
        """Park a running sample at a preemption point for a waiting one that has generated fewer tokens, while
        the parked samples' tokens stay within the park budget (``preemption.py``)."""
        now = self.now
        if not now.preempting or key not in self.running:
            return False
        self._advance_clock(now.runs[key], generated)
        parked_tokens = sum(self.generated[other] for other in self.parked)
        if parked_tokens + generated > self._park_tokens() or all(
                self.generated[other] >= generated for other in now.planner.pool):
            return False
        self._park(key, self._expected_remaining(key, generated))
        return True

    def finish(self, key: SampleKey, length: int) -> None:
        now = self.now
        if key in self.running:
            self._advance_clock(now.runs[key], length)
        self._vacate(key)
        now.finished[key] = int(length)
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
        for p in range(self.work.num_prompts):  # the groups that ended here, whole: what preemption draws from
            if all((p, k) in now.finished for k in range(self.work.group_size)):
                self.preemption.observe([now.finished[p, k] for k in range(self.work.group_size)])
        scored = [(predicted, true) for predicted, true in now.scored if predicted == predicted]  # NaN: unpredicted
        predicted, true = [p for p, _ in scored], [t for _, t in scored]
        # Where nothing waited nothing was predicted: the rollout has no figure for the prediction's quality.
        metrics = {"length_pred_kendall_tau": kendall_tau(predicted, true),
                   "length_pred_smape": smape(predicted, true)} if now.waits else {}
        stats = now.planner.stats
        self.last_info = {
            "length_pred_kendall_tau": math.nan, "length_pred_smape": math.nan, **metrics,
            "length_pred_log_rmse": log_rmse(predicted, true), "parked_samples": self.parked_samples,
            "peak_parked": self.peak_parked,
            "max_parked": now.max_parked, "replans": stats.replans, "forced": stats.forced,
            "plan_seconds": stats.plan_seconds, "steals": stats.steals, "parking": float(now.parking),
            "prompt_trust": self.trust["prompt"].rho_low, "probe_trust": self.trust["probe"].rho_low,
            "gain_mean": now.first_gain[0], "gain_std": now.first_gain[1], "guided": float(now.first_gain[2]),
            "preempting": float(now.preempting),
        }
        return metrics

    def state_dict(self) -> dict:
        """What must survive a checkpoint resume: the predictor's learned state and the trust it earned (plans
        are per rollout)."""
        return {"predictor": self.predictor.state_dict(), "preemption": self.preemption.state_dict(),
                "trust": {kind: trust.state_dict() for kind, trust in self.trust.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.predictor.load_state_dict(state["predictor"])
        if "preemption" in state:  # absent from checkpoints written before preemption existed
            self.preemption.load_state_dict(state["preemption"])
        for kind, trust_state in state.get("trust", {}).items():
            self.trust[kind].load_state_dict(trust_state)

    # ---- policy ----------------------------------------------------------------------------------------------

    def _next_for(self, slot: int) -> SampleKey | None:
        now = self.now
        if slot in now.reserved:
            return now.reserved.pop(slot)
        if now.unprobed and len(self.parked) < now.max_parked:
            key = now.unprobed.popleft()
            now.unprobed_work -= self._expected_remaining(key, self.generated[key])
            return key
        if now.unprobed:
            return now.planner.choose_greedy(slot, now.clock)  # budget full: run the best parked sample
        if now.preempting:
            return now.planner.choose_least_attained(slot, now.clock, self.generated)
        if not self._pool_trust().informative or not now.guided:
            return now.planner.choose_first(slot, now.clock)  # predictions tell nothing: first come, first served
        return now.planner.choose(slot, now.clock, self._ready(exclude=slot), *self._slack_and_noise())

    def _pool_trust(self) -> PredictionTrust:
        """The trust that applies to the waiting samples' predictions (probed ones when parking)."""
        return self.trust["probe" if self.now.parking else "prompt"]

    def _slack_and_noise(self) -> tuple[float, float]:
        noise = min(self._pool_trust().calibrate(1.0)[1], MAX_LOG_STD)
        return self.config.slack_scale * noise, noise

    def _critical(self, remaining: float) -> bool:
        """Would this sample, parked until the probe phase ends, set the makespan on its own?"""
        if self.config.critical_fraction is None:
            return False
        work = self.now.unprobed_work + self.now.planner.total_work
        work += sum(self._ready(exclude=-1))
        return remaining >= self.config.critical_fraction * work / self.work.num_slots

    def _start(self, slot: int, key: SampleKey) -> None:
        now = self.now
        now.runs[key] = SampleRun(now.clock, self.generated[key])
        if now.parking and self._awaits_probe(key):
            now.planner.note_start(slot, now.clock, min(self.probe_tokens, self._expected_remaining(key, 0)))

    def _awaits_probe(self, key: SampleKey) -> bool:
        return key not in self.now.probe_predictions and self.generated[key] < self.probe_tokens

    def _park(self, key: SampleKey, remaining: float, pooled: bool = False) -> None:
        super()._park(key)
        if not pooled:
            self.now.planner.add(key, remaining, self.now.rank[key])

    def _ready(self, exclude: int) -> list[float]:
        """``[num_slots]`` expected remaining steps of each slot's running sample (0 for free slots)."""
        now = self.now
        ready = [0.0] * self.work.num_slots
        for slot, key in enumerate(self.slots):
            if slot == exclude:
                continue
            if key is not None:
                run = now.runs[key]
                ready[slot] = self._expected_remaining(key, run.start_generated + (now.clock - run.start_clock))
            elif slot in now.reserved:  # promised at a probe, admitted after this step
                reserved = now.reserved[slot]
                ready[slot] = self._expected_remaining(reserved, self.generated[reserved])
        return ready

    def _expected_remaining(self, key: SampleKey, generated: int) -> float:
        """Expected remaining tokens of a sample, from its calibrated prediction (see ``trust.py``)."""
        median, spread, _ = self._model(key, generated)
        total = expected_length(median, spread, generated, self.work.max_new_tokens)
        return max(total - generated, 1.0)

    def _refresh_predictions(self) -> None:
        """Re-predict the pool after the predictor learned from a slot's worth of finished samples.

        Within the first rollouts the online predictor improves quickly, and per-prompt history learns from a
        group's first finished samples; the plan then follows the better numbers.
        """
        now, planner = self.now, self.now.planner
        # At most every slot's worth of finishes, and every quarter pool's worth, so large pools cost O(1) each.
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
            planner.update(key, self._expected_remaining(key, self.generated[key]), self.config.replan_tolerance)
        self._judge()

    def _judge(self) -> None:
        """Decide whether the pool follows its predictions or arrival order (``gate.py``), at planning points."""
        now, gain_z = self.now, self.config.gain_z
        if now.preempting:
            # The gate weighs predictions against arrival order; preemption was chosen over arrival order at the
            # rollout's start, and a prediction that beats arrival order has not been shown to beat preemption.
            return
        if not self._pool_trust().informative or now.unprobed or gain_z is None:
            now.guided = self._pool_trust().informative
            return
        pool = now.planner.pool
        keys = sorted(pool, key=lambda k: pool[k][1])
        waiting = [self._model(key, self.generated[key]) for key in keys]
        running = [self._model(key, now.runs[key].start_generated + now.clock - now.runs[key].start_clock)
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

    def _advance_clock(self, run: SampleRun, generated: int) -> None:
        # Every running sample gains one token per decode step, so its token count dates the event.
        self.now.clock = max(self.now.clock, run.start_clock + generated - run.start_generated)

    def _park_tokens(self) -> float:
        """The most tokens preemption may keep parked: ``park_budget`` of the slots' generation KV."""
        budget = self.config.park_budget
        return math.inf if budget is None else budget * self.work.num_slots * self.work.max_new_tokens

    def _max_parked(self, work: RolloutWork) -> int:
        if self.config.park_budget is None or not self.now.parking:
            return len(work.keys())
        tokens = self.config.park_budget * work.num_slots * work.max_new_tokens
        return max(work.num_slots, int(tokens // self.probe_tokens))
