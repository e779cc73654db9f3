"""The contract between the rollout engine (mechanism) and a scheduler (policy).

The scheduler owns which sample runs in which slot, as vLLM's scheduler owns its running requests: the engine asks
it to fill free slots and executes the ``(slot, sample)`` assignments it returns; the engine owns the samples'
tokens, the KV memory and the decode loop. The scheduler never touches KV tensors, and the engine never decides
order or placement.

Per rollout the engine calls, in this order:

1. ``begin(work)`` once, with the rollout's shape (prompts, G, slots) and, when ``needs_prompt_features`` is set,
   one feature vector per prompt (the policy's own last-layer hidden state, mean-pooled over the prompt).
2. ``admit()`` whenever a slot is free (``free_slots()``) and a sample waits for one (not started yet, or parked);
   it returns ``(slot, key)`` assignments, ``key = (prompt, sample)``, each to a free slot, and records them in
   ``slots``. Returning none is allowed while samples are running.
3. ``probe(key, generated, feature)`` when a running sample has generated ``probe_tokens`` tokens (only if that
   attribute is not None); returning True parks the sample: the scheduler frees its slot, the engine keeps its
   generated tokens' KV aside and resumes it when ``admit`` assigns it again.
4. ``finish(key, length)`` when a sample ends (EOS or the length cap); its slot is free from then on.
5. ``end()`` once; returns metrics for RolloutStats (e.g. ``length_pred_kendall_tau``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

SampleKey = tuple[int, int]  # (prompt index, sample index within its group)
Assignment = tuple[int, SampleKey]  # (slot, sample)


def lower_bound_steps(lengths: Sequence[int], num_slots: int) -> int:
    """``max(ceil(sum L / g), max L)``: no schedule on ``num_slots`` slots finishes in fewer decode steps."""
    if not lengths:
        return 0
    return max(math.ceil(sum(lengths) / num_slots), max(lengths))


@dataclass
class RolloutWork:
    """What a scheduler knows about a rollout before it starts.

    Attributes:
        prompt_lengths: tokens of each prompt, ``[B]``.
        group_size: samples per prompt (G).
        num_slots: concurrent sequences (g for micro/continuous/infinite, B x G for full).
        max_new_tokens: the length cap.
        prompt_features: ``[B, H]`` float tensor (pooled last hidden states) or None.
        prompt_ids: the prompts' token ids, for predictors keyed on prompt identity (history).
        true_lengths: ``[B][G]`` completion lengths when they are known in advance (forced-length replay);
            only an oracle predictor may read them.
    """

    prompt_lengths: list[int]
    group_size: int
    num_slots: int
    max_new_tokens: int
    prompt_features: torch.Tensor | None = None
    prompt_ids: list[list[int]] = field(default_factory=list)
    true_lengths: list[list[int]] | None = None

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_lengths)

    def keys(self) -> list[SampleKey]:
        """All samples in prompt-major order."""
        return [(p, k) for p in range(self.num_prompts) for k in range(self.group_size)]


class Scheduler:
    """Base scheduler: first come, first served, prompt-major. Subclasses choose what runs (``_pick``) and may
    place it (``admit``); the record of which sample is in which slot stays here."""

    #: Ask the engine for the policy's prompt features in ``begin``.
    needs_prompt_features: bool = False
    #: Call ``probe`` when a running sample has generated this many tokens (None: never).
    probe_tokens: int | None = None

    def begin(self, work: RolloutWork) -> None:
        self.work = work
        self.slots: list[SampleKey | None] = [None] * work.num_slots  # slot -> the sample running there
        self.slot_of: dict[SampleKey, int] = {}  # the same record, by sample
        self._pending = work.keys()
        self._pending.reverse()  # pop() from the end is O(1)

    def free_slots(self) -> list[int]:
        return [slot for slot, key in enumerate(self.slots) if key is None]

    def admit(self) -> list[Assignment]:
        """Fill free slots, lowest first, with the samples ``_pick`` chooses."""
        free = self.free_slots()
        return [self._place(slot, key) for slot, key in zip(free, self._pick(len(free), len(self.slot_of)))]

    def _pick(self, num_free: int, num_running: int) -> list[SampleKey]:
        taken = []
        while self._pending and len(taken) < num_free:
            taken.append(self._pending.pop())
        return taken

    def probe(self, key: SampleKey, generated: int, feature: torch.Tensor) -> bool:
        return False

    def finish(self, key: SampleKey, length: int) -> None:
        self._vacate(key)

    def end(self) -> dict[str, float]:
        return {}

    def _place(self, slot: int, key: SampleKey) -> Assignment:
        if self.slots[slot] is not None:
            raise RuntimeError(f"{type(self).__name__} placed sample {key} in slot {slot}, which runs "
                               f"{self.slots[slot]}")
        if key in self.slot_of:
            raise RuntimeError(f"{type(self).__name__} placed sample {key} twice (it runs in slot "
                               f"{self.slot_of[key]})")
        self.slots[slot] = key
        self.slot_of[key] = slot
        return slot, key

    def _vacate(self, key: SampleKey) -> int | None:
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.slots[slot] = None
        return slot


#: The base scheduler admits samples in prompt-major order: the default of "full", "micro" and "continuous".
FIFOScheduler = Scheduler


class RoundScheduler(Scheduler):
    """Naive micro sampling groups: rounds of up to g samples of one prompt; a round starts only when every
    sample of the previous one has finished (the paper's "micro" baseline, before continuous sampling)."""

    def _pick(self, num_free: int, num_running: int) -> list[SampleKey]:
        if num_running or not self._pending:
            return []
        prompt = self._pending[-1][0]
        taken = []
        while self._pending and self._pending[-1][0] == prompt and len(taken) < num_free:
            taken.append(self._pending.pop())
        return taken
