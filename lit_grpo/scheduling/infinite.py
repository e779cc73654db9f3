"""The "infinite" scheduler: continuous slots + length prediction + global grouping + runtime refill.

Before a token is sampled the G samples of a prompt are exchangeable: no predictor can tell them apart, so the
per-sample length can only be predicted once a sample has started. The scheduler therefore works in two phases,
using the engine's park/resume mechanism (``checkpoint``):

1. Probe: every sample first runs ``probe_tokens`` (k = 8) tokens, prompt-major (or in the refill policy's order
   of prompt-level predictions). At its checkpoint the token-conditioned predictor re-predicts its total length
   from the prompt feature and the hidden state of its k-th token, and the sample is parked: the engine keeps
   only those k tokens' KV aside (plus the prompt's, which is cached anyway). Probing costs no decode steps:
   the k tokens are part of the sample and the slot is refilled at once. A sample that ends within k tokens
   is simply done. Two exceptions keep a sample running at its checkpoint: it is *critical* (its predicted
   remaining work is at least the average slot's remaining work, so parked it would wait for the probe phase to
   end and then alone set the makespan), or the park budget is full. The probe's one real cost: a sample probed
   in the last round cannot continue before ``(n / g - 1) * k`` steps, which matters when one sample's length
   is the lower bound; hence a small k.
2. Plan: once every sample has been probed, the remaining work (predicted remaining lengths of the parked
   samples, and of the running ones as lane ready times) is partitioned over the g slots by the grouping
   (FPTAS by default), and each freed slot runs the job of its planned share that the refill policy prefers.
   Mispredictions are corrected at refill time: a lane that frees off-plan, a used-up share or fresh predictions
   re-plan the remaining pool (see :class:`~lit_grpo.scheduling.refill.LanePlanner`). Lengths are expected
   values given survival (:func:`~lit_grpo.scheduling.predictors.expected_length`): a sample running past its
   prediction is expected to run on, by the predictor's measured error spread. Plans are computed to precision
   ``max(epsilon, spread)``: planning finer than the lengths are known buys nothing.

Predictors that are not token-conditioned (oracle, history) skip the probe: every sample is planned at ``begin``.

Parking memory is bounded by ``park_budget``: at most ``park_budget * slots * max_new_tokens / k`` samples are
parked at once (0.5: the parked tokens take at most half the KV the slots themselves may fill; the last probe
round may park up to one slot's worth more). When the budget is full and unprobed samples remain (rollouts of
thousands of samples), a freed slot takes the refill policy's favourite of the parked pool instead.

Default refill: "lpt", the measured winner. In the simulator (``lit_grpo.scheduling.simulate``, planted length
signal, 10 seeds; ratio = decode steps / lower bound) all policies tie with exact lengths (the plan balances the
lanes, and order inside a lane does not change its sum), but with real predictions LPT wins the makespan
(online predictor after 5 warm-up rollouts: B1 G32 g8 LPT 1.038, FIFO 1.080, SJF 1.180; B8 G16 g8 LPT 1.004,
FIFO 1.035, SJF 1.106): a lane runs its longest, most uncertain job first, so an error shows early and the re-plan
absorbs it with short jobs still pending, whereas SJF leaves the long jobs, and their errors, for the tail where
nothing can absorb them. SJF stays available ("sjf", the paper's choice: lowest mean completion time).
``slack_scale > 0`` makes any policy robust: a freed slot then starts the pool's longest job whenever that costs
the plan at most ``slack_scale x spread`` (with it SJF and FIFO match LPT; LPT itself gains little).

Metrics from ``end``: ``length_pred_kendall_tau`` and ``length_pred_smape`` of the last prediction made for each
sample before it finished (the token-conditioned one for probed samples, the prompt-level one for samples that
ended within the probe) against its true length. Diagnostics of the last rollout are in ``last_info``.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import torch

from lit_grpo.scheduling.base import RolloutWork, SampleKey, Scheduler
from lit_grpo.scheduling.grouping import DEFAULT_EPSILON, GroupingFn, make_grouping
from lit_grpo.scheduling.predictors import (
    LengthPredictor,
    expected_length,
    kendall_tau,
    make_predictor,
    smape,
)
from lit_grpo.scheduling.refill import DEFAULT_REFILL, LanePlanner, RefillPolicy, make_refill

#: Tokens a sample runs before its length is re-predicted from its own hidden state.
DEFAULT_PROBE_TOKENS = 8


@dataclass
class _Run:
    """A running sample: where and since when."""

    lane: int
    start_clock: int
    start_generated: int


class InfiniteScheduler(Scheduler):
    """Length-aware scheduler of the "infinite" strategy; one object serves many rollouts (predictors learn).

    Args:
        predictor: "online" | "history" | "oracle" or a :class:`~lit_grpo.scheduling.predictors.LengthPredictor`.
        refill: "lpt" | "sjf" | "fifo" or a :class:`~lit_grpo.scheduling.refill.RefillPolicy`.
        grouping: "fptas" | "lpt" | "kk" or a function ``(lengths, num_lanes, ready=None) -> Partition``.
        epsilon: the FPTAS's approximation parameter (plan makespan <= (1 + epsilon) x optimum).
        probe_tokens: k, the tokens generated before a token-conditioned predictor re-predicts (None or 0: no
            probe; every sample is planned from prompt-level predictions).
        park_budget: bound on parked samples, as a fraction of the slots' generation KV (None: unbounded).
        replan_tolerance: re-plan when a slot frees more than this fraction of its job's predicted duration off
            the plan.
        slack_scale: a freed slot runs the longest job of the whole pool instead of its planned pick when that
            costs the plan at most ``slack_scale x log_std`` of its makespan (``log_std``: the predictor's error
            spread; 0 for the oracle, so its plan is followed exactly). 0 (default): the refill policy alone
            orders each slot's share, so policies can be compared.
        critical_fraction: during the probe phase a sample keeps running instead of parking when its predicted
            remaining length is at least this fraction of the average slot's remaining work: parked, it would
            wait for the probe phase to end and then alone set the makespan. None disables.
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
        critical_fraction: float = 1.0,
    ) -> None:
        self.predictor = make_predictor(predictor) if isinstance(predictor, str) else predictor
        self.refill = make_refill(refill)
        self.grouping = make_grouping(grouping, epsilon)
        if probe_tokens is not None and probe_tokens < 0:
            raise ValueError(f"probe_tokens must be >= 0 or None, got {probe_tokens}")
        self.probe_tokens = probe_tokens or None
        self.park_budget = park_budget
        self.replan_tolerance = replan_tolerance
        self.epsilon = epsilon
        self.slack_scale = slack_scale
        self.critical_fraction = critical_fraction
        # Engine-facing switches (instance attributes shadow the base class's defaults).
        self.needs_prompt_features = bool(self.predictor.needs_prompt_features)
        self.probing = bool(self.predictor.token_conditioned and self.probe_tokens)
        self.checkpoint_tokens = self.probe_tokens if self.probing else None
        self.last_info: dict[str, float] = {}

    # ---- engine contract -------------------------------------------------------------------------------------

    def begin(self, work: RolloutWork) -> None:
        self.work = work
        self.clock = 0
        self.slots: list[SampleKey | None] = [None] * work.num_slots
        self.running: dict[SampleKey, _Run] = {}
        self.generated: dict[SampleKey, int] = {}
        self.reserved: dict[int, SampleKey] = {}  # lane -> sample chosen at a checkpoint, admitted next
        self.parked: set[SampleKey] = set()
        self.token_features: dict[SampleKey, torch.Tensor] = {}
        self.prediction: dict[SampleKey, float] = {}
        self.conditioned: set[SampleKey] = set()
        self.finished: dict[SampleKey, int] = {}
        self.finished_prediction: dict[SampleKey, float] = {}
        self.parks = 0
        self.peak_parked = 0
        # Finished samples the predictor has not learned from yet: (key, length, token feature or None). Taught in
        # one batch when predictions are refreshed, and at the end of the rollout, rather than one by one between
        # decode steps, where the host's time is the accelerator's idle time.
        self.unlearned: list[tuple[SampleKey, int, torch.Tensor | None]] = []
        self.rank = {key: i for i, key in enumerate(work.keys())}
        self.planner = LanePlanner(self.refill, self.grouping, work.num_slots, self.replan_tolerance,
                                   epsilon=self.epsilon)
        keys = work.keys()
        if keys:
            for key, value in zip(keys, self.predictor.predict(work, keys).tolist()):
                self.prediction[key] = float(value)
        if self.probing:
            candidates = [(self._expected_remaining(key, 0), self.rank[key]) for key in keys]
            self.unprobed = deque(keys[i] for i in self.refill.order(candidates))
            self.unprobed_work = sum(length for length, _ in candidates)
        else:
            self.unprobed = deque()
            self.unprobed_work = 0.0
            for key in keys:
                self.planner.add(key, self._expected_remaining(key, 0), self.rank[key])
        self.max_parked = self._max_parked(work)

    def admit(self, num_free: int, num_running: int) -> list[SampleKey]:
        free = [lane for lane in range(len(self.slots)) if self.slots[lane] is None]
        free.sort(key=lambda lane: lane not in self.reserved)  # reserved lanes first: their sample is promised
        taken = []
        self._refresh_predictions()
        for lane in free[:num_free]:
            key = self._next_for(lane)
            if key is None:
                break
            self._start(lane, key)
            taken.append(key)
        return taken

    def checkpoint(self, key: SampleKey, generated: int, feature: torch.Tensor) -> bool:
        run = self.running.get(key)
        if run is None or key in self.conditioned:
            return False  # not ours to judge (already re-predicted, or unknown)
        self._advance_clock(run, generated)
        self.generated[key] = generated
        feature = feature.detach().to("cpu", torch.float32).reshape(-1)
        self.token_features[key] = feature
        self.prediction[key] = float(self.predictor.predict(self.work, [key], feature[None])[0])
        self.conditioned.add(key)
        remaining = self._expected_remaining(key, generated)
        lane = run.lane
        if self.unprobed:
            if len(self.parked) < self.max_parked and not self._critical(remaining):
                self._park(key, remaining)
                return True
            self.planner.note_start(lane, self.clock, remaining)  # budget full or critical: it keeps its slot
            return False
        if not len(self.planner):
            # Nothing waits for a slot (e.g. g >= all samples): there is no choice to plan, and parking would only
            # copy the sample's KV out and straight back in.
            self.planner.note_start(lane, self.clock, remaining)
            return False
        if any(other not in self.conditioned for other in self.running if other != key):
            # Other slots are still probing (the probe phase's last round): plan once they have reported.
            self._park(key, remaining)
            return True
        # Plan phase: the sample competes with the pool for its own lane.
        self.planner.add(key, remaining, self.rank[key])
        chosen = self.planner.choose(lane, self.clock, self._ready(exclude=lane), *self._slack_and_noise())
        if chosen == key:
            return False
        self._park(key, remaining, pooled=True)  # choose() took `chosen`; `key` stays in the pool
        self.reserved[lane] = chosen
        return True

    def finish(self, key: SampleKey, length: int) -> None:
        run = self.running.pop(key, None)
        if run is not None:
            self._advance_clock(run, length)
            if self.slots[run.lane] == key:
                self.slots[run.lane] = None
        self.finished[key] = int(length)
        self.finished_prediction[key] = self.prediction.get(key, float("nan"))
        self.unlearned.append((key, int(length), self.token_features.pop(key, None)))

    def end(self) -> dict[str, float]:
        self._learn()
        keys = [k for k in self.finished if self.finished_prediction[k] == self.finished_prediction[k]]
        predicted = [self.finished_prediction[k] for k in keys]
        true = [self.finished[k] for k in keys]
        metrics = {"length_pred_kendall_tau": kendall_tau(predicted, true), "length_pred_smape": smape(predicted, true)}
        stats = self.planner.stats
        self.last_info = {
            **metrics, "parks": self.parks, "peak_parked": self.peak_parked, "max_parked": self.max_parked,
            "replans": stats.replans, "forced": stats.forced, "plan_seconds": stats.plan_seconds,
            "steals": stats.steals,
        }
        return metrics

    def state_dict(self) -> dict:
        """What must survive a checkpoint resume: the predictor's learned state (plans are per rollout)."""
        return {"predictor": self.predictor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.predictor.load_state_dict(state["predictor"])

    # ---- policy ----------------------------------------------------------------------------------------------

    def _next_for(self, lane: int) -> SampleKey | None:
        if lane in self.reserved:
            return self.reserved.pop(lane)
        if self.unprobed and len(self.parked) < self.max_parked:
            key = self.unprobed.popleft()
            self.unprobed_work -= self._expected_remaining(key, 0)
            return key
        if self.unprobed:
            return self.planner.choose_greedy(lane, self.clock)  # budget full: run the best parked sample
        return self.planner.choose(lane, self.clock, self._ready(exclude=lane), *self._slack_and_noise())

    def _slack_and_noise(self) -> tuple[float, float]:
        noise = self.predictor.log_std(self.probing)
        return self.slack_scale * noise, noise

    def _critical(self, remaining: float) -> bool:
        """Would this sample, parked until the probe phase ends, set the makespan on its own?"""
        if self.critical_fraction is None:
            return False
        work = self.unprobed_work + self.planner.total_work
        work += sum(self._ready(exclude=-1))
        return remaining >= self.critical_fraction * work / len(self.slots)

    def _start(self, lane: int, key: SampleKey) -> None:
        self.parked.discard(key)
        generated = self.generated.get(key, 0)
        self.slots[lane] = key
        self.running[key] = _Run(lane, self.clock, generated)
        if self.probing and key not in self.conditioned:
            self.planner.note_start(lane, self.clock, min(self.probe_tokens, self._expected_remaining(key, 0)))

    def _park(self, key: SampleKey, remaining: float, pooled: bool = False) -> None:
        run = self.running.pop(key)
        self.slots[run.lane] = None
        self.parked.add(key)
        self.parks += 1
        self.peak_parked = max(self.peak_parked, len(self.parked))
        if not pooled:
            self.planner.add(key, remaining, self.rank[key])

    def _ready(self, exclude: int) -> list[float]:
        """``[num_slots]`` expected remaining steps of each lane's running sample (0 for free lanes)."""
        ready = [0.0] * len(self.slots)
        for lane, key in enumerate(self.slots):
            if lane == exclude:
                continue
            if key is not None and key in self.running:
                run = self.running[key]
                done = run.start_generated + (self.clock - run.start_clock)
                ready[lane] = self._expected_remaining(key, done)
            elif lane in self.reserved:  # promised at a checkpoint, admitted after this step
                reserved = self.reserved[lane]
                ready[lane] = self._expected_remaining(reserved, self.generated.get(reserved, 0))
        return ready

    def _expected_remaining(self, key: SampleKey, generated: int) -> float:
        total = expected_length(self.prediction[key], self.predictor.log_std(key in self.conditioned), generated,
                                self.work.max_new_tokens)
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
            values = self.predictor.predict(self.work, with_tokens, features).tolist()
            self.prediction.update(zip(with_tokens, map(float, values)))
        if without:
            self.prediction.update(zip(without, map(float, self.predictor.predict(self.work, without).tolist())))
        for key in keys:
            self.planner.update(key, self._expected_remaining(key, self.generated.get(key, 0)), self.replan_tolerance)

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
        if self.park_budget is None or not self.probing:
            return len(work.keys())
        tokens = self.park_budget * work.num_slots * work.max_new_tokens
        return max(work.num_slots, int(tokens // self.probe_tokens))
