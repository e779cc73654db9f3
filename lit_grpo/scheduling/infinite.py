"""The "infinite" scheduler: continuous slots + length prediction + global grouping + runtime refill.

Predictions are used only as far as they have earned trust (``trust.py``): every finished sample scores the
predictions made for it, and the scheduler works from the *calibrated* prediction (regression of true on predicted
log length, correlation at the lower end of its confidence interval; prompt and probe predictions earn trust
apart). Trust is not enough: with weak predictions the guided order is just another draw of the tail, which can
lose to arrival order. So at planning points a gate (``gate.py``) draws the pool's lengths from the calibrated
lognormal model and compares guided and arrival order on the same draws; the predictions are followed only
where their per-rollout gain is established, the course changes only where the other one is, and probes park
samples only where a plan on probe predictions of the trust they earned would win. Otherwise a freed slot takes
the first waiting sample: plain continuous order.

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
sample before it finished against its true length. Diagnostics of the last rollout are in ``last_info``.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import torch

from lit_grpo.scheduling.base import Assignment, RolloutWork, SampleKey, Scheduler
from lit_grpo.scheduling.config import InfiniteSchedulerConfig
from lit_grpo.scheduling.gate import GAIN_Z, follow_predictions, guided_gain, probes_pay
from lit_grpo.scheduling.grouping import DEFAULT_EPSILON, GroupingFn, make_grouping
from lit_grpo.scheduling.predictors import LengthPredictor, expected_length, kendall_tau, make_predictor, smape
from lit_grpo.scheduling.refill import DEFAULT_REFILL, RefillPolicy, SlotPlanner, make_refill
from lit_grpo.scheduling.trust import PredictionTrust

#: Tokens a sample runs before its length is re-predicted from its own hidden state.
DEFAULT_PROBE_TOKENS = 8
#: The widest log-length spread worth reasoning with (beyond e^4 a spread means "unknown" anyway).
MAX_LOG_STD = 4.0


@dataclass
class _Run:
    """A running sample: since when (decode steps) and from how many generated tokens."""

    start_clock: int
    start_generated: int


class InfiniteScheduler(Scheduler):
    """Length-aware scheduler of "infinite"; one object serves many rollouts (predictors and trust learn).

    Args:
        predictor: "online" | "history" | "oracle" or a :class:`~lit_grpo.scheduling.predictors.LengthPredictor`.
        refill: "lpt" | "sjf" | "fifo" or a :class:`~lit_grpo.scheduling.refill.RefillPolicy`.
        grouping: "fptas" | "lpt" | "kk" or a function ``(lengths, num_slots, ready=None) -> Partition``.
        epsilon: the FPTAS's approximation parameter (plan makespan <= (1 + epsilon) x optimum).
        probe_tokens: k, the tokens generated before a token-conditioned predictor re-predicts (None or 0: no
            probe; every sample is planned from prompt-level predictions).
        park_budget: bound on parked samples, as a fraction of the slots' generation KV (None: unbounded).
        replan_tolerance: re-plan when a slot frees more than this fraction of its job's predicted duration off
            the plan.
        slack_scale: a freed slot runs the pool's longest job instead of its planned pick when that costs the
            plan at most ``slack_scale x`` the calibrated spread of its makespan (0: the refill policy alone).
        critical_fraction: during the probe phase a sample keeps running instead of parking when its expected
            remaining length is at least this fraction of the average slot's remaining work. None disables.
        gain_z: follow predictions (and park at probes) only where their gain over arrival order exceeds this
            many standard deviations of its draws (``gate.py``); None: whenever trusted (no gate).
    """

    def __init__(
        self,
        predictor: str | LengthPredictor = "online",
        refill: str | RefillPolicy = DEFAULT_REFILL,
        grouping: str | GroupingFn = "fptas",
        epsilon: float = DEFAULT_EPSILON,
        probe_tokens: int | None = DEFAULT_PROBE_TOKENS,
        park_budget: float | None = 0.5,
        replan_tolerance: float = 0.1,
        slack_scale: float = 0.0,
        critical_fraction: float | None = 1.0,
        gain_z: float | None = GAIN_Z,
    ) -> None:
        self.predictor = make_predictor(predictor) if isinstance(predictor, str) else predictor
        self.refill = make_refill(refill)
        self.grouping = make_grouping(grouping, epsilon)
        if probe_tokens is not None and probe_tokens < 0:
            raise ValueError(f"probe_tokens must be >= 0 or None, got {probe_tokens}")
        self.park_budget = park_budget
        self.replan_tolerance = replan_tolerance
        self.epsilon = epsilon
        self.slack_scale = slack_scale
        self.critical_fraction = critical_fraction
        self.gain_z = gain_z
        # Engine-facing switches (instance attributes shadow the base class's defaults): a token-conditioned
        # predictor is probed every rollout, parked or not, so that its probes keep being scored.
        self.needs_prompt_features = bool(self.predictor.needs_prompt_features)
        self.probe_tokens = (probe_tokens or None) if self.predictor.token_conditioned else None
        self.trust = {"prompt": PredictionTrust(), "probe": PredictionTrust()}
        self.last_info: dict[str, float] = {}

    @classmethod
    def from_config(cls, config: InfiniteSchedulerConfig) -> InfiniteScheduler:
        """The scheduler a typed config (``SamplingConfig.scheduler``) describes."""
        return cls(**config.as_kwargs())

    # ---- engine contract -------------------------------------------------------------------------------------

    def begin(self, work: RolloutWork) -> None:
        super().begin(work)
        self.clock = 0
        self.runs: dict[SampleKey, _Run] = {}
        self.generated: dict[SampleKey, int] = dict(work.generated)
        self.reserved: dict[int, SampleKey] = {}  # slot -> sample chosen at a probe, admitted next
        self.parked: set[SampleKey] = set()
        self.token_features: dict[SampleKey, torch.Tensor] = {}
        self.prediction: dict[SampleKey, float] = {}  # the latest raw prediction of each sample
        self.prompt_prediction: dict[SampleKey, float] = {}
        self.probe_prediction: dict[SampleKey, float] = {}
        self.finished: dict[SampleKey, int] = {}
        self.finished_prediction: dict[SampleKey, float] = {}
        self.parks = 0
        self.peak_parked = 0
        # Finished samples the predictor has not learned from yet: (key, length, token feature or None). Taught in
        # one batch when predictions are refreshed, and at the end of the rollout, rather than one by one between
        # decode steps, where the host's time is the accelerator's idle time.
        self.unlearned: list[tuple[SampleKey, int, torch.Tensor | None]] = []
        self.rank = {key: i for i, key in enumerate(work.keys())}
        self.planner = SlotPlanner(self.refill, self.grouping, work.num_slots, self.replan_tolerance,
                                   epsilon=self.epsilon)
        keys = work.pending_keys()
        if keys:
            values = [float(v) for v in self.predictor.predict(work, keys).tolist()]
            self.prediction.update(zip(keys, values))
            self.prompt_prediction.update(zip(keys, values))
        # Park at probes only where the plan can use what a probe tells: trusted probes and more samples than
        # slots (with a slot for every sample nothing waits, and parking would only move KV out and back in).
        self.parking = (self.probe_tokens is not None and self.trust["probe"].informative
                        and len(keys) > work.num_slots and (self.gain_z is None or probes_pay(
                            self.trust["probe"], len(keys), work.num_slots, work.max_new_tokens, self.gain_z)))
        self.unprobed = deque()
        self.unprobed_work = 0.0
        if self.parking:  # samples carried past their probe are planned at once, like probed ones
            unprobed = [key for key in keys if self.generated.get(key, 0) < self.probe_tokens]
            candidates = [(self._expected_remaining(key, self.generated.get(key, 0)), self.rank[key])
                          for key in unprobed]
            self.unprobed.extend(unprobed[i] for i in self.refill.order(candidates))
            self.unprobed_work = sum(length for length, _ in candidates)
        probing = set(self.unprobed)
        for key in keys:
            if key not in probing:
                self.planner.add(key, self._expected_remaining(key, self.generated.get(key, 0)), self.rank[key])
        self.max_parked = self._max_parked(work)
        self.gain, self.guided = (0.0, 0.0), False
        self._judge()
        self.first_gain = self.gain + (self.guided,)  # the rollout's opening decision, for last_info

    def admit(self) -> list[Assignment]:
        free = self.free_slots()
        free.sort(key=lambda slot: slot not in self.reserved)  # reserved slots first: their sample is promised
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
        run = self.runs.get(key)
        if run is None or key in self.probe_prediction:
            return False  # not ours to judge (already re-predicted, or unknown)
        self._advance_clock(run, generated)
        self.generated[key] = generated
        feature = feature.detach().to("cpu", torch.float32).reshape(-1)
        self.token_features[key] = feature
        self.prediction[key] = self.probe_prediction[key] = float(
            self.predictor.predict(self.work, [key], feature[None])[0])
        remaining = self._expected_remaining(key, generated)
        slot = self.slot_of[key]
        if not self.parking or not len(self.planner) and not self.unprobed:
            self.planner.note_start(slot, self.clock, remaining)  # nothing to gain from parking: it runs on
            return False
        if self.unprobed:
            if len(self.parked) < self.max_parked and not self._critical(remaining):
                self._park(key, remaining)
                return True
            self.planner.note_start(slot, self.clock, remaining)  # budget full or critical: it keeps its slot
            return False
        if any(self._awaits_probe(other) for other in self.runs if other != key):
            # Other slots are still probing (the probe phase's last round): plan once they have reported.
            self._park(key, remaining)
            return True
        if not self.guided:  # the gate chose arrival order: the running sample keeps its slot
            self.planner.note_start(slot, self.clock, remaining)
            return False
        # Plan phase: the sample competes with the pool for its own slot.
        self.planner.add(key, remaining, self.rank[key])
        chosen = self.planner.choose(slot, self.clock, self._ready(exclude=slot), *self._slack_and_noise())
        if chosen == key:
            return False
        self._park(key, remaining, pooled=True)  # choose() took `chosen`; `key` stays in the pool
        self.reserved[slot] = chosen
        return True

    def finish(self, key: SampleKey, length: int) -> None:
        run = self.runs.pop(key, None)
        if run is not None:
            self._advance_clock(run, length)
        self._vacate(key)
        self.finished[key] = int(length)
        self.finished_prediction[key] = self.prediction.get(key, float("nan"))
        self.unlearned.append((key, int(length), self.token_features.pop(key, None)))
        if key in self.prompt_prediction:
            self.trust["prompt"].observe(self.prompt_prediction[key], length)
        if key in self.probe_prediction:
            self.trust["probe"].observe(self.probe_prediction[key], length)

    def end(self) -> dict[str, float]:
        self._learn()
        for trust in self.trust.values():
            trust.end_rollout()
        keys = [k for k in self.finished if self.finished_prediction[k] == self.finished_prediction[k]]
        predicted = [self.finished_prediction[k] for k in keys]
        true = [self.finished[k] for k in keys]
        metrics = {"length_pred_kendall_tau": kendall_tau(predicted, true), "length_pred_smape": smape(predicted, true)}
        stats = self.planner.stats
        self.last_info = {
            **metrics, "parks": self.parks, "peak_parked": self.peak_parked, "max_parked": self.max_parked,
            "replans": stats.replans, "forced": stats.forced, "plan_seconds": stats.plan_seconds,
            "steals": stats.steals, "parking": float(self.parking),
            "prompt_trust": self.trust["prompt"].rho_low, "probe_trust": self.trust["probe"].rho_low,
            "gain_mean": self.first_gain[0], "gain_std": self.first_gain[1], "guided": float(self.first_gain[2]),
        }
        return metrics

    def state_dict(self) -> dict:
        """What must survive a checkpoint resume: the predictor's learned state and the trust it earned (plans
        are per rollout)."""
        return {"predictor": self.predictor.state_dict(),
                "trust": {kind: trust.state_dict() for kind, trust in self.trust.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.predictor.load_state_dict(state["predictor"])
        for kind, trust_state in state.get("trust", {}).items():
            self.trust[kind].load_state_dict(trust_state)

    # ---- policy ----------------------------------------------------------------------------------------------

    def _next_for(self, slot: int) -> SampleKey | None:
        if slot in self.reserved:
            return self.reserved.pop(slot)
        if self.unprobed and len(self.parked) < self.max_parked:
            key = self.unprobed.popleft()
            self.unprobed_work -= self._expected_remaining(key, self.generated.get(key, 0))
            return key
        if self.unprobed:
            return self.planner.choose_greedy(slot, self.clock)  # budget full: run the best parked sample
        if not self._pool_trust().informative or not self.guided:
            return self.planner.choose_first(slot, self.clock)  # predictions tell nothing: first come, first served
        return self.planner.choose(slot, self.clock, self._ready(exclude=slot), *self._slack_and_noise())

    def _pool_trust(self) -> PredictionTrust:
        """The trust that applies to the waiting samples' predictions (probed ones when parking)."""
        return self.trust["probe" if self.parking else "prompt"]

    def _slack_and_noise(self) -> tuple[float, float]:
        noise = min(self._pool_trust().calibrate(1.0)[1], MAX_LOG_STD)
        return self.slack_scale * noise, noise

    def _critical(self, remaining: float) -> bool:
        """Would this sample, parked until the probe phase ends, set the makespan on its own?"""
        if self.critical_fraction is None:
            return False
        work = self.unprobed_work + self.planner.total_work
        work += sum(self._ready(exclude=-1))
        return remaining >= self.critical_fraction * work / len(self.slots)

    def _start(self, slot: int, key: SampleKey) -> None:
        self.parked.discard(key)
        generated = self.generated.get(key, 0)
        self.runs[key] = _Run(self.clock, generated)
        if self.parking and self._awaits_probe(key):
            self.planner.note_start(slot, self.clock, min(self.probe_tokens, self._expected_remaining(key, 0)))

    def _awaits_probe(self, key: SampleKey) -> bool:
        return key not in self.probe_prediction and self.work.generated.get(key, 0) < self.probe_tokens

    def _park(self, key: SampleKey, remaining: float, pooled: bool = False) -> None:
        del self.runs[key]
        self._vacate(key)
        self.parked.add(key)
        self.parks += 1
        self.peak_parked = max(self.peak_parked, len(self.parked))
        if not pooled:
            self.planner.add(key, remaining, self.rank[key])

    def _ready(self, exclude: int) -> list[float]:
        """``[num_slots]`` expected remaining steps of each slot's running sample (0 for free slots)."""
        ready = [0.0] * len(self.slots)
        for slot, key in enumerate(self.slots):
            if slot == exclude:
                continue
            if key is not None and key in self.runs:
                run = self.runs[key]
                done = run.start_generated + (self.clock - run.start_clock)
                ready[slot] = self._expected_remaining(key, done)
            elif slot in self.reserved:  # promised at a probe, admitted after this step
                reserved = self.reserved[slot]
                ready[slot] = self._expected_remaining(reserved, self.generated.get(reserved, 0))
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
        # At most every slot's worth of finishes, and every quarter pool's worth, so large pools cost O(1) each.
        if len(self.unlearned) < max(len(self.slots), len(self.planner) // 4) or not len(self.planner):
            return
        self._learn()
        keys = list(self.planner.pool)
        with_tokens = [k for k in keys if k in self.token_features]
        without = [k for k in keys if k not in self.token_features]
        if with_tokens:
            features = torch.stack([self.token_features[k] for k in with_tokens])
            values = [float(v) for v in self.predictor.predict(self.work, with_tokens, features).tolist()]
            self.prediction.update(zip(with_tokens, values))
            self.probe_prediction.update(zip(with_tokens, values))
        if without:
            values = [float(v) for v in self.predictor.predict(self.work, without).tolist()]
            self.prediction.update(zip(without, values))
            self.prompt_prediction.update(zip(without, values))
        for key in keys:
            self.planner.update(key, self._expected_remaining(key, self.generated.get(key, 0)), self.replan_tolerance)
        self._judge()

    def _judge(self) -> None:
        """Decide whether the pool follows its predictions or arrival order (``gate.py``), at planning points."""
        if not self._pool_trust().informative or self.unprobed or self.gain_z is None:
            self.guided = self._pool_trust().informative
            return
        keys = sorted(self.planner.pool, key=lambda k: self.planner.pool[k][1])
        waiting = [self._model(key, self.generated.get(key, 0)) for key in keys]
        running = [self._model(key, run.start_generated + self.clock - run.start_clock)
                   for key, run in self.runs.items()]
        expected = [self.planner.pool[k][0] for k in keys]
        self.gain = guided_gain(waiting, running, len(self.slots), self.work.max_new_tokens, expected)
        self.guided = follow_predictions(*self.gain, current=self.guided, z=self.gain_z)

    def _model(self, key: SampleKey, generated: int) -> tuple[float, float, int]:
        """``(calibrated median, calibrated spread, tokens generated)`` of a sample."""
        trust = self.trust["probe" if key in self.probe_prediction else "prompt"]
        median, spread = trust.calibrate(self.prediction[key])
        return median, min(spread, MAX_LOG_STD), generated

    def _learn(self) -> None:
        """Teach the predictor the samples finished since it last learned, in finish order: one call per run of
        probed or unprobed samples (a predictor takes one feature tensor for all the keys of a call, or none)."""
        for probed, run in itertools.groupby(self.unlearned, key=lambda entry: entry[2] is not None):
            keys, lengths, features = zip(*run)
            self.predictor.observe(self.work, list(keys), list(lengths), torch.stack(features) if probed else None)
        self.unlearned = []

    def _advance_clock(self, run: _Run, generated: int) -> None:
        # Every running sample gains one token per decode step, so its token count dates the event.
        self.clock = max(self.clock, run.start_clock + generated - run.start_generated)

    def _max_parked(self, work: RolloutWork) -> int:
        if self.park_budget is None or not self.parking:
            return len(work.keys())
        tokens = self.park_budget * work.num_slots * work.max_new_tokens
        return max(work.num_slots, int(tokens // self.probe_tokens))
