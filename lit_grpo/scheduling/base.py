"""The contract between the rollout engine (mechanism) and a scheduler (policy).

The engine owns slots, KV memory and the decode loop; a scheduler only decides *which* sample runs next and
whether a running sample should be parked. As in vLLM's v1 core, the scheduler never touches tensors of the KV
cache, and the engine never decides order.

Per rollout the engine calls, in this order:

1. ``begin(work)`` once, with the rollout's shape (prompts, G, slots) and, when ``needs_prompt_features`` is set,
   one feature vector per prompt (the policy's own last-layer hidden state, mean-pooled over the prompt).
2. ``admit(num_free, num_running)`` whenever slots are free and a sample waits for one (not started yet, or
   parked); it returns the keys ``(prompt, sample)`` to start or resume, at most ``num_free`` of them. Returning
   fewer (even none) is allowed while samples are running.
3. ``checkpoint(key, generated, feature)`` when a running sample has generated ``checkpoint_tokens`` tokens
   (only if that attribute is not None); returning True parks the sample: the engine frees its slot, keeps its
   generated tokens' KV aside, and resumes it when ``admit`` returns its key again.
4. ``finish(key, length)`` when a sample ends (EOS or the length cap).
5. ``end()`` once; returns metrics for RolloutStats (e.g. ``length_pred_kendall_tau``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

SampleKey = tuple[int, int]  # (prompt index, sample index within its group)


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
    """Base scheduler: first-in first-out, prompt-major. Subclasses override what they need."""

    #: Ask the engine for the policy's prompt features in ``begin``.
    needs_prompt_features: bool = False
    #: Call ``checkpoint`` when a running sample has generated this many tokens (None: never).
    checkpoint_tokens: int | None = None

    def begin(self, work: RolloutWork) -> None:
        self.work = work
        self._pending = work.keys()
        self._pending.reverse()  # pop() from the end is O(1)

    def admit(self, num_free: int, num_running: int) -> list[SampleKey]:
        taken = []
        while self._pending and len(taken) < num_free:
            taken.append(self._pending.pop())
        return taken

    def checkpoint(self, key: SampleKey, generated: int, feature: torch.Tensor) -> bool:
        return False

    def finish(self, key: SampleKey, length: int) -> None:
        pass

    def end(self) -> dict[str, float]:
        return {}


#: The base scheduler admits samples in prompt-major order: the default of "full", "micro" and "continuous".
FIFOScheduler = Scheduler


class RoundScheduler(Scheduler):
    """Naive micro sampling groups: rounds of up to g samples of one prompt; a round starts only when every
    sample of the previous one has finished (the paper's "micro" baseline, before continuous sampling)."""

    def admit(self, num_free: int, num_running: int) -> list[SampleKey]:
        if num_running or not self._pending:
            return []
        prompt = self._pending[-1][0]
        taken = []
        while self._pending and self._pending[-1][0] == prompt and len(taken) < num_free:
            taken.append(self._pending.pop())
        return taken
