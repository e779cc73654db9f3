"""What one rollout cost: decode steps, tokens, KV bytes, time, and the slot timeline behind them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from lit_grpo.sampling.carry import GroupProgress

from lit_grpo.scheduling.base import lower_bound_steps  # noqa: F401  (part of this module's API)
from lit_grpo.scheduling.base import Decision
from lit_grpo.scheduling.driver import IDLE


@dataclass
class RolloutStats:
    """Counters of one ``RolloutEngine.generate`` call (ints are counts, bytes are bytes).

    Attributes:
        decode_steps: forward passes of the decode loop (each produces one token per running slot).
        prefill_tokens: tokens run through prefill forwards: each prompt once, and the tails of samples carried
            from an earlier call (partial rollouts), prefilled again.
        generated_tokens: completion tokens produced, EOS included.
        lower_bound_steps: ``max(ceil(sum L / slots), max L)``, the fewest decode steps any schedule needs.
        slot_utilization: ``generated_tokens / (decode_steps * slots)``.
        peak_kv_bytes: the most bytes held at once by KV tensors (slot cache with padding, cached prompts, parked
            tails, and what a prefill holds for a moment: a chunk while it is split, a carried sample's KV).
        wall_s: seconds spent in ``generate``.
        tokens_per_s: ``generated_tokens / wall_s``.
        forward_s: seconds spent in prefill forwards and decode steps (forward, sampling and the step's one
            device-to-host copy); the rest of ``wall_s`` is the engine's and the scheduler's bookkeeping.
        prefill_s: seconds spent in prefill forwards (prompt prefixes, and carried samples' tails): on CPU the
            prefills' part of ``forward_s``; on CUDA the device's time, from events read after the rollout's last
            synchronisation (no host sync of their own). Per token: ``prefill_ms_per_token``.
        decode_s: seconds spent in decode steps (forward, sampling and the step's one device-to-host copy): on CPU
            the steps' part of ``forward_s``; on CUDA the device's time, from events around each step (its
            synchronisation also waits for the prefills queued before it, which this leaves out). Per step:
            ``decode_ms_per_step``.
        decode_read_bytes: bytes the decode steps had to read, added up over the steps (``sampling.roofline``:
            the weights once a step, and each running row's embedding row and attended keys and values).
        capture_s: seconds spent preparing the decode step in this rollout: capturing its CUDA graph, and compiling
            it (``compile``); 0 when the engine reused the previous rollout's step, or the step runs eagerly
            uncompiled; a failed attempt's time when a capture failed.
        num_slots: concurrent sequences the rollout ran with.
        parked_samples: times the scheduler parked a running sample, after its length probe or at a preemption
            point ("infinite" only).
        parked_kv_bytes: the most bytes held at once by parked samples' KV (part of ``peak_kv_bytes``).
        length_pred_kendall_tau / length_pred_smape: quality of the length predictions (the length-aware scheduler
            only; None where a slot held every sample, since nothing was predicted).
        preempting: 1.0 where the "infinite" scheduler preempted by least attained service in this rollout, 0.0
            where it ran first come, first served (None for the other strategies).
        decisions: every start, resumption and park with its step, slot and reason (``scheduling.Decision``).
        timeline: ``timeline[t][s]`` is the flat sample index ``p * G + k`` that slot ``s`` ran at decode step
            ``t``, or ``IDLE``. Kept for pictures (see lit_grpo.callbacks.SlotTimelineLogger).
        group_size: G, to map flat sample indices back to prompts.
    """

    decode_steps: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    lower_bound_steps: int = 0
    slot_utilization: float = 0.0
    peak_kv_bytes: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    forward_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_read_bytes: int = 0
    capture_s: float = 0.0
    num_slots: int = 0
    group_size: int = 0
    parked_samples: int = 0
    parked_kv_bytes: int = 0
    length_pred_kendall_tau: float | None = None
    length_pred_smape: float | None = None
    preempting: float | None = None
    timeline: list[list[int]] = field(default_factory=list, repr=False)
    decisions: list[Decision] = field(default_factory=list, repr=False)

    def finalize(self, lengths: list[int]) -> None:
        """Fill the derived fields from the completion lengths once the rollout is over."""
        self.generated_tokens = sum(lengths)
        self.lower_bound_steps = lower_bound_steps(lengths, self.num_slots)
        denominator = self.decode_steps * self.num_slots
        self.slot_utilization = self.generated_tokens / denominator if denominator else 0.0
        self.tokens_per_s = self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def slot_steps(self) -> float:
        """Decode steps times the slots they ran on, summed over rounds (``merge_stats``: a later round may have
        fewer slots than ``num_slots``, the most of any), read back from ``slot_utilization``."""
        if self.slot_utilization:
            return self.generated_tokens / self.slot_utilization
        return float(self.decode_steps * self.num_slots)

    @property
    def ms_per_step(self) -> float:
        """Milliseconds per decode step, the one-off graph capture left out (prefill and refills stay in)."""
        return 1000 * (self.wall_s - self.capture_s) / self.decode_steps if self.decode_steps else 0.0

    @property
    def decode_ms_per_step(self) -> float | None:
        """Milliseconds a decode step itself took (``decode_s``), prefill and bookkeeping left out; None without
        decode steps."""
        return 1000 * self.decode_s / self.decode_steps if self.decode_steps else None

    @property
    def read_bytes_per_step(self) -> float | None:
        """Bytes a decode step read, the mean over the steps (``decode_read_bytes``); None without decode steps."""
        return self.decode_read_bytes / self.decode_steps if self.decode_steps else None

    @property
    def prefill_ms_per_token(self) -> float | None:
        """Milliseconds of prefill per prompt token (``prefill_s``); None when nothing was prefilled."""
        return 1000 * self.prefill_s / self.prefill_tokens if self.prefill_tokens else None

    def scalars(self) -> dict[str, float]:
        """The numeric fields (no timeline), None dropped: what loggers and benchmarks record."""
        out = asdict(self)
        out.pop("timeline")
        out.pop("decisions")
        return {k: v for k, v in out.items() if v is not None}


@dataclass
class RolloutResult:
    """Completions of one rollout, indexed ``[group][sample]``: every prompt's for ``generate``; the groups that
    completed for ``generate_groups``, whose other groups are in ``carried``.

    Attributes:
        prompt_ids: ``[B]`` the groups' prompts.
        completion_ids, logprobs: ``[B][G]`` token ids (EOS included if drawn) and their sampling log-probs.
        truncated: ``[B][G]`` the sample hit ``max_new_tokens`` without EOS or a stop string.
        stats: what the rollout cost.
        versions: ``[B][G]`` the rollout index each token was drawn in (all the current one without carrying).
        tags: ``[B]`` each returned group's ``GroupProgress.tag`` (None for ``generate``).
        carried: the groups not returned, to continue in a later call: those that did not complete, and those
            that completed in the same step as the ``complete``-th but past it (returned by the next call).
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    truncated: list[list[bool]]
    stats: RolloutStats
    versions: list[list[list[int]]] = field(default_factory=list, repr=False)
    tags: list = field(default_factory=list, repr=False)
    carried: list[GroupProgress] = field(default_factory=list, repr=False)


def merge_stats(parts: list[RolloutStats], same_samples: bool = False) -> RolloutStats:
    """Add up the stats of several engine calls: the rounds of one step (dynamic sampling), or a run's rollouts
    (``FitSummary``, with their timelines left out).

    Counts and times (capture included) add; ``peak_kv_bytes`` and ``parked_kv_bytes`` are maxima; ratios are
    recomputed; the timelines and decisions are concatenated in time, with steps shifted by the earlier rounds'
    decode steps and samples by their samples, a narrower round's rows padded with ``IDLE`` to the widest;
    ``preempting`` is the share of rounds that preempted, and each length-prediction figure the mean over the parts
    that predicted (as over ranks: ``lit_grpo.rollout.metrics.ROLLOUT_REDUCTIONS``; None where none did).
    ``same_samples``: the parts ran one rollout's samples under the same indices (its tool rounds, each continuing
    some of them), whose indices are kept.
    """
    if not parts:
        return RolloutStats()
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    merged = RolloutStats(num_slots=first.num_slots, group_size=first.group_size)
    offset = 0
    for part in parts:
        group = max(1, part.group_size)  # a sample's flat index shifts as the timeline's does
        merged.decisions.extend(d._replace(step=d.step + merged.decode_steps,
                                           key=divmod(d.key[0] * group + d.key[1] + offset, group))
                                for d in part.decisions)
        merged.decode_steps += part.decode_steps
        merged.prefill_tokens += part.prefill_tokens
        merged.generated_tokens += part.generated_tokens
        merged.lower_bound_steps += part.lower_bound_steps
        merged.peak_kv_bytes = max(merged.peak_kv_bytes, part.peak_kv_bytes)
        merged.parked_samples += part.parked_samples
        merged.parked_kv_bytes = max(merged.parked_kv_bytes, part.parked_kv_bytes)
        merged.wall_s += part.wall_s
        merged.forward_s += part.forward_s
        merged.prefill_s += part.prefill_s
        merged.decode_s += part.decode_s
        merged.decode_read_bytes += part.decode_read_bytes
        merged.capture_s += part.capture_s
        merged.timeline.extend([[cell + offset if cell != IDLE else IDLE for cell in row] for row in part.timeline])
        if not same_samples:
            offset += 1 + max((cell for row in part.timeline for cell in row), default=-1)
    merged.preempting = _mean_of_present([part.preempting for part in parts])
    merged.length_pred_kendall_tau = _mean_of_present([part.length_pred_kendall_tau for part in parts])
    merged.length_pred_smape = _mean_of_present([part.length_pred_smape for part in parts])
    slot_steps = sum(part.slot_steps for part in parts)  # rounds may have fewer slots
    merged.num_slots = max(part.num_slots for part in parts)
    # a narrower round's slots beyond its own are idle: the timeline stays a [steps, slots] grid for its pictures
    width = max((len(row) for row in merged.timeline), default=0)
    merged.timeline = [row + [IDLE] * (width - len(row)) for row in merged.timeline]
    merged.slot_utilization = merged.generated_tokens / slot_steps if slot_steps else 0.0
    merged.tokens_per_s = merged.generated_tokens / merged.wall_s if merged.wall_s > 0 else 0.0
    return merged


def _mean_of_present(values: list[float | None]) -> float | None:
    """The mean of ``values`` that are not None (a part that did not measure the figure is left out); None where
    none is."""
    present = [value for value in values if value is not None]
    return sum(present) / len(present) if present else None
