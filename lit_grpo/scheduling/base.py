"""The contract between the rollout engine (mechanism) and a scheduler (policy).

The scheduler owns which sample runs in which slot, which are parked and how far each has got, as vLLM's scheduler
owns its requests: the engine asks it to fill free slots and executes the ``(slot, sample)`` assignments it
returns; the engine owns the samples' tokens and the KV memory. The scheduler never touches KV tensors, and the
engine never decides order or placement.

One loop drives the protocol (``driver.drive_rollout``), for the engine and the model-free simulator alike. Per
rollout it calls, in this order:

1. ``begin(work)`` once, with the rollout's shape (prompts, G, slots) and, when ``needs_prompt_features`` is set,
   one feature vector per prompt (the policy's own last-layer hidden state, mean-pooled over the prompt).
2. ``admit()`` whenever a slot is free (``free_slots()``) and a sample waits for one (not started yet, or parked);
   it returns ``(slot, key)`` assignments, ``key = (prompt, sample)``, each to a free slot, and records them in
   ``running`` (``_place``). Returning none is allowed while samples are running.
3. ``probe(key, generated, feature)`` when a running sample has generated ``probe_tokens`` tokens (only if that
   attribute is not None); returning True parks the sample (``_park``): its slot frees, the engine keeps its
   generated tokens' KV aside and resumes it when ``admit`` assigns it again.
   ``preempt(key, generated)`` when a running sample (not parked by its probe) has generated one of the token
   counts in ``preempt_points`` (read once ``begin`` returns); returning True parks it, as a probe does.
4. ``finish(key, length)`` when a sample ends (EOS or the length cap); its slot is free from then on.
5. ``end()`` once; returns metrics for RolloutStats (e.g. ``length_pred_kendall_tau``).

Every start, resumption and park is recorded with its reason (``decisions``, :class:`Decision`): what the slot
timeline draws and ``rollout/decisions/*`` counts, so that "why did this sample get this slot?" has an answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from lit_grpo.runtime.validation import check_int_in_range

SampleKey = tuple[int, int]  # (prompt index, sample index within its group)
Assignment = tuple[int, SampleKey]  # (slot, sample)

#: Why a sample started or resumed in a slot, or was parked (the schedulers' docstrings say when each applies).
ARRIVAL = "arrival"  # first come, first served: the first waiting sample in prompt-major order
LEAST_ATTAINED = "least_attained"  # the waiting sample that has generated fewest tokens
PREEMPTION = "preemption"  # parked at a preemption point: a waiting sample has generated fewer tokens


class Decision(NamedTuple):
    """One scheduling decision: at decode step ``step``, ``action`` ("start" | "resume" | "park") of sample ``key``
    in ``slot``, because of ``reason``. (A named tuple, which Lightning moves with a batch like any tuple.)"""

    step: int
    slot: int
    key: SampleKey
    action: str
    reason: str

    @property
    def name(self) -> str:
        """``action_reason``, the key it is counted under (``rollout/decisions/<name>``)."""
        return f"{self.action}_{self.reason}"


def decision_counts(decisions: Sequence[Decision]) -> dict[str, int]:
    """How many decisions of each ``action_reason``."""
    counts: dict[str, int] = {}
    for decision in decisions:
        counts[decision.name] = counts.get(decision.name, 0) + 1
    return counts


#: Every ``action_reason`` a scheduler may record, in the one order ranks gather their counts
#: (``rollout/decisions/<name>``): the default's (arrival order; least attained service with preemption), then
#: the length-aware scheduler's (its probes and plans; ``resume_arrival`` where predictions tell nothing); ``other``
#: counts a custom scheduler's reasons not listed here (RolloutProfiler warns).
DECISION_NAMES: tuple[str, ...] = (
    "start_arrival", "start_least_attained", "resume_least_attained", "park_preemption",
    "start_probe", "park_probe", "start_plan", "resume_plan", "park_plan", "resume_arrival", "other",
)


def lower_bound_steps(lengths: Sequence[int], num_slots: int) -> int:
    """``max(ceil(sum L / g), max L)``: no schedule on ``num_slots`` slots finishes in fewer decode steps."""
    num_slots = check_int_in_range("num_slots", num_slots, minimum=1)
    if not lengths:
        return 0
    return max(math.ceil(sum(lengths) / num_slots), max(lengths))


def whole_tail(tokens: int) -> float:
    """The park cost where every layer holds a parked sample's whole tail: its ``tokens``."""
    return tokens


@dataclass
class RolloutWork:
    """What a scheduler knows about a rollout before it starts.

    Attributes:
        prompt_lengths: tokens of each prompt, ``[B]``.
        group_size: samples per prompt (G).
        num_slots: concurrent sequences (g for micro/continuous/infinite, B x G for full).
        max_new_tokens: the length cap.
        prompt_features: ``[B, H]`` float tensor (pooled last hidden states) or None.
        true_lengths: ``[B][G]`` completion lengths when they are known in advance (forced-length replay);
            only an oracle predictor may read them.
        generated: tokens already generated by samples carried from an earlier rollout (absent: 0).
        done: samples carried already finished; they never run.
        park_cost: what a parked sample that has generated ``tokens`` holds, in tokens of every layer's KV: the
            model's owner knows it (the engine: ``memory_budget.tail_tokens`` of its layers' windows); default
            ``whole_tail``, where every layer holds every token.
    """

    prompt_lengths: list[int]
    group_size: int
    num_slots: int
    max_new_tokens: int
    prompt_features: torch.Tensor | None = None
    true_lengths: list[list[int]] | None = None
    generated: dict[SampleKey, int] = field(default_factory=dict)
    done: set[SampleKey] = field(default_factory=set)
    park_cost: Callable[[int], float] = whole_tail

    def __post_init__(self) -> None:
        for name in ("group_size", "num_slots", "max_new_tokens"):
            setattr(self, name, check_int_in_range(name, getattr(self, name), 1))
        num_prompts, features = len(self.prompt_lengths), self.prompt_features
        if features is not None and (features.dim() != 2 or features.shape[0] != num_prompts):
            raise ValueError(f"prompt_features must be [B, H] = [{num_prompts}, H], got shape {tuple(features.shape)}")
        if self.true_lengths is not None and (len(self.true_lengths) != num_prompts
                                              or any(len(row) != self.group_size for row in self.true_lengths)):
            raise ValueError(f"true_lengths must be [B][G] = [{num_prompts}][{self.group_size}], got rows of "
                             f"{[len(row) for row in self.true_lengths][:8]}")

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_lengths)

    def keys(self) -> list[SampleKey]:
        """All samples in prompt-major order."""
        return [(p, k) for p in range(self.num_prompts) for k in range(self.group_size)]

    def pending_keys(self) -> list[SampleKey]:
        """The samples still to run, in prompt-major order (carried groups come first in a rollout)."""
        return [key for key in self.keys() if key not in self.done]


class Scheduler:
    """Base scheduler: first come, first served, prompt-major. Subclasses choose what runs (``_pick``) and may
    place it (``admit``). The one record of the rollout's samples stays here: which runs in which slot
    (``running``; ``slots`` derived), which are parked, which have not started, and how many tokens each has
    (``generated``, advanced by the driver); the engine and the simulator read it, never copy it."""

    #: Ask the engine for the policy's prompt features in ``begin``.
    needs_prompt_features: bool = False
    #: Call ``probe`` when a running sample has generated this many tokens (None: never).
    probe_tokens: int | None = None
    #: Call ``preempt`` when a running sample has generated one of these many tokens (set by ``begin``).
    preempt_points: frozenset[int] = frozenset()

    def begin(self, work: RolloutWork) -> None:
        self.work = work
        self.step = 0  # decode steps run in this rollout (the driver advances it)
        self.decisions: list[Decision] = []
        self.running: dict[SampleKey, int] = {}  # the running samples and their slots, in the order they started
        self.generated = {key: work.generated.get(key, 0) for key in work.keys()}  # tokens each sample has so far
        self.parked: set[SampleKey] = set()  # samples that left their slot (a probe, a preemption) and wait to resume
        self._order = work.pending_keys()  # prompt-major: the order "full", "micro" and "continuous" start samples
        self._unstarted = set(self._order)
        self._next = 0  # self._order[:self._next] have started
        self.parked_samples = 0  # parks in this rollout (at probes and preemption points)
        self.peak_parked = 0

    @property
    def slots(self) -> list[SampleKey | None]:
        """``[num_slots]``: the sample running in each slot (None: free)."""
        slots: list[SampleKey | None] = [None] * self.work.num_slots
        for key, slot in self.running.items():
            slots[slot] = key
        return slots

    def free_slots(self) -> list[int]:
        return [slot for slot, key in enumerate(self.slots) if key is None]

    def waiting(self) -> bool:
        """Whether a sample waits for a slot: one not started in this rollout yet, or a parked one."""
        return bool(self._unstarted or self.parked)

    def waits(self, key: SampleKey) -> bool:
        """Whether ``key`` waits for a slot (not started in this rollout yet, or parked)."""
        return key in self._unstarted or key in self.parked

    def admit(self) -> list[Assignment]:
        """Fill free slots, lowest first, with the samples ``_pick`` chooses."""
        free = self.free_slots()
        return [self._place(slot, key, ARRIVAL) for slot, key in zip(free, self._pick(len(free), len(self.running)))]

    def _pick(self, num_free: int, num_running: int) -> list[SampleKey]:
        taken = []
        while len(taken) < num_free and self._peek_unstarted() is not None:
            taken.append(self._pop_unstarted())
        return taken

    def _peek_unstarted(self) -> SampleKey | None:
        """The first sample in prompt-major order that has not started (None: all have)."""
        while self._next < len(self._order) and self._order[self._next] not in self._unstarted:
            self._next += 1
        return self._order[self._next] if self._next < len(self._order) else None

    def _pop_unstarted(self) -> SampleKey:
        key = self._peek_unstarted()
        self._next += 1
        return key

    def probe(self, key: SampleKey, generated: int, feature: torch.Tensor) -> bool:
        return False

    def preempt(self, key: SampleKey, generated: int) -> bool:
        return False

    def finish(self, key: SampleKey, length: int) -> None:
        self._vacate(key)

    def end(self) -> dict[str, float]:
        return {}

    def _place(self, slot: int, key: SampleKey, reason: str) -> Assignment:
        """Record ``key`` running in ``slot`` (free: the driver checks it, once per admission) because of
        ``reason``."""
        if key in self.running:
            raise RuntimeError(f"{type(self).__name__} placed sample {key} twice (it runs in slot "
                               f"{self.running[key]})")
        if not self.waits(key):
            raise RuntimeError(f"{type(self).__name__} placed sample {key}, which does not wait for a slot "
                               "(finished, or not part of this rollout)")
        action = "resume" if key in self.parked else "start"
        self._unstarted.discard(key)
        self.parked.discard(key)
        self.running[key] = slot
        self.decisions.append(Decision(self.step, slot, key, action, reason))
        return slot, key

    def _vacate(self, key: SampleKey) -> int | None:
        return self.running.pop(key, None)

    def _park(self, key: SampleKey, reason: str) -> None:
        """A probe or a preemption parks its running sample: its slot frees and it waits to resume."""
        self.decisions.append(Decision(self.step, self.running[key], key, "park", reason))
        self._vacate(key)
        self.parked.add(key)
        self.parked_samples += 1
        self.peak_parked = max(self.peak_parked, len(self.parked))


#: The base scheduler admits samples in prompt-major order: the default of "full", "micro" and "continuous".
FIFOScheduler = Scheduler


class RoundScheduler(Scheduler):
    """Naive micro sampling groups: rounds of up to g samples of one prompt; a round starts only when every
    sample of the previous one has finished (the paper's "micro" baseline, before continuous sampling)."""

    def _pick(self, num_free: int, num_running: int) -> list[SampleKey]:
        first = self._peek_unstarted()
        if num_running or first is None:
            return []
        taken = []
        while len(taken) < num_free and (key := self._peek_unstarted()) is not None and key[0] == first[0]:
            taken.append(self._pop_unstarted())
        return taken
