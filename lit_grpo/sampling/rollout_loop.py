"""One rollout's decode loop: slots filled by the scheduler, prefixes prefilled once, samples finished or parked.

``RolloutLoop`` is what ``RolloutEngine.generate`` runs: it asks the scheduler (policy) which samples start, writes
their KV into slot rows of the ``SlotKVCache`` (memory), runs ``DecodeStep`` (compute) once per decode step and
hands each row's token back to its sample. See lit_grpo.sampling.engine for the design.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from lit_grpo.sampling.decode_step import DecodeStep
from lit_grpo.sampling.kv_cache import KV, SlotKVCache, cache_layers_kv, kv_bytes, slice_columns
from lit_grpo.sampling.stats import IDLE, RolloutStats
from lit_grpo.scheduling.base import Assignment, RolloutWork, SampleKey

if TYPE_CHECKING:
    from lit_grpo.sampling.engine import RolloutEngine


@dataclass
class RolloutResult:
    """Completions of one rollout, indexed ``[prompt][sample]``."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    truncated: list[list[bool]]
    stats: RolloutStats


@dataclass
class _Sample:
    """A started sample's tokens; while parked, its generated positions' KV aside. Where it runs is the
    scheduler's record (``Scheduler.slots``)."""

    key: SampleKey
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    parked_tail: KV | None = None


class RolloutLoop:
    """The state of one ``generate`` call: a decode loop over slots driven by the engine's scheduler."""

    def __init__(self, engine: RolloutEngine, prompt_ids: list[list[int]], lengths: list[list[int]] | None,
                 cache: SlotKVCache, step: DecodeStep):
        self.engine, self.model = engine, engine.model
        self.prompt_ids, self.forced = prompt_ids, lengths
        self.G = engine.group_size
        self.cache, self.step = cache, step
        self.num_slots = cache.num_slots
        self.device = cache.lengths.device
        self.scheduler = engine.scheduler
        self.stats = RolloutStats(num_slots=self.num_slots, group_size=self.G)
        self.step.start_rollout(engine.seed, engine.rollout_index)
        self.eos = set(engine.eos_token_ids)

        B = len(prompt_ids)
        self.prefixes: dict[int, KV | None] = {}  # prompt -> cached prefix KV, while a sample may still need it
        self.unstarted = [self.G] * B  # samples of each prompt not yet started
        self.parked_count = [0] * B
        self.running: dict[SampleKey, _Sample] = {}
        self.parked: dict[SampleKey, _Sample] = {}
        self.done: dict[SampleKey, _Sample] = {}

    # ------------------------------------------------------------------------------------------ main loop
    def run(self) -> RolloutResult:
        work = RolloutWork(prompt_lengths=[len(p) for p in self.prompt_ids], group_size=self.G,
                           num_slots=self.num_slots, max_new_tokens=self.engine.max_new_tokens,
                           prompt_ids=self.prompt_ids, true_lengths=self.forced)
        if self.scheduler.needs_prompt_features:
            work.prompt_features = torch.stack([self._prefill(p, with_features=True)
                                                for p in range(len(self.prompt_ids))])
        self.scheduler.begin(work)
        total = len(self.prompt_ids) * self.G
        self._record_memory()
        try:
            while len(self.done) < total:
                if len(self.running) < self.num_slots and self._waiting():
                    # Once nothing waits, the tail runs without asking the scheduler.
                    self._admit(self.scheduler.admit())
                if not self.running:
                    raise RuntimeError(f"{type(self.scheduler).__name__} admitted nothing while no sample runs and "
                                       f"{total - len(self.done)} samples remain")
                self._decode_step()
        finally:
            self.step.stop_all()  # leave every row idle for the next rollout
        metrics = self.scheduler.end()
        self.stats.length_pred_kendall_tau = metrics.get("length_pred_kendall_tau")
        self.stats.length_pred_smape = metrics.get("length_pred_smape")
        return self._result()

    def _waiting(self) -> bool:
        """Whether a sample waits for a slot: one not started yet, or a parked one."""
        return bool(self.parked) or any(self.unstarted)

    def _admit(self, assignments: list[Assignment]) -> None:
        for slot, key in assignments:
            p, k = key
            if key in self.parked:
                sample = self.parked.pop(key)
                self.parked_count[p] -= 1
            elif key in self.done or key in self.running or not self.unstarted[p]:
                raise RuntimeError(f"scheduler admitted sample {key} twice")
            else:
                if p not in self.prefixes:
                    self._prefill(p)
                self.unstarted[p] -= 1
                sample = _Sample(key)
            length = self.cache.write_row(slot, 0, self.prefixes[p])
            length += self.cache.write_row(slot, length, sample.parked_tail)
            sample.parked_tail = None
            next_input = sample.tokens[-1] if sample.tokens else self.prompt_ids[p][-1]
            forced = self.forced[p][k] if self.forced is not None else 0
            self.step.start_row(slot, prompt=p, sample=k, generated=len(sample.tokens), length=length,
                                next_input=next_input, forced_length=forced)
            self.running[key] = sample
        self._release_unused_prefixes()
        self._record_memory()

    def _decode_step(self) -> None:
        engine, probe = self.engine, self.scheduler.probe_tokens
        # The slots' samples as this step runs them: finishing and parking below change the scheduler's record.
        rows = [(slot, self.running[key]) for slot, key in enumerate(self.scheduler.slots) if key is not None]
        probing = [] if probe is None else [  # slots whose token of this step is their probe's
            slot for slot, sample in rows if len(sample.tokens) == probe - 1]
        start = time.perf_counter()
        out = self.step.step(probing)
        self.stats.forward_s += time.perf_counter() - start
        self.stats.decode_steps += 1

        timeline = [IDLE] * self.num_slots
        hidden_row = {slot: i for i, slot in enumerate(probing)}
        for slot, sample in rows:
            timeline[slot] = sample.key[0] * self.G + sample.key[1]
            token = out.tokens[slot]
            sample.tokens.append(token)
            sample.logprobs.append(out.logprobs[slot])
            if token in self.eos or len(sample.tokens) >= engine.max_new_tokens:
                self._finish(slot, sample)
            elif len(sample.tokens) == probe and self.scheduler.probe(
                    sample.key, len(sample.tokens), out.hidden[hidden_row[slot]]):
                self._park(slot, sample)
        self.stats.timeline.append(timeline)
        self._release_unused_prefixes()

    # --------------------------------------------------------------------------------------- sample states
    def _finish(self, slot: int, sample: _Sample) -> None:
        self._vacate(slot, sample)
        self.done[sample.key] = sample
        self.scheduler.finish(sample.key, len(sample.tokens))

    def _park(self, slot: int, sample: _Sample) -> None:
        """The scheduler parked the sample (and freed its slot): keep its row's generated positions aside."""
        # The row holds the prompt prefix, then the fed tokens (the last prompt token and tokens[:-1]): keep those.
        prefix = len(self.prompt_ids[sample.key[0]]) - 1
        sample.parked_tail = self.cache.read_row(slot, prefix, prefix + len(sample.tokens))
        self._vacate(slot, sample)
        self.parked[sample.key] = sample
        self.parked_count[sample.key[0]] += 1
        self.stats.parked_samples += 1
        self._record_memory()

    def _vacate(self, slot: int, sample: _Sample) -> None:
        self.step.stop_row(slot)
        del self.running[sample.key]

    def _prefill(self, p: int, with_features: bool = False) -> torch.Tensor | None:
        """Run prompt p's first P - 1 tokens once and cache their KV; optionally return its features [H] (the
        mean of their last hidden states; zeros for a one-token prompt)."""
        prefix = self.prompt_ids[p][:-1]
        features = None
        self.prefixes[p] = None
        if prefix:
            cache = DynamicCache(config=self.model.config)
            start = time.perf_counter()
            out = self.model(input_ids=torch.tensor([prefix], device=self.device), past_key_values=cache,
                             use_cache=True, logits_to_keep=1, output_hidden_states=with_features)
            self.stats.forward_s += time.perf_counter() - start
            self.stats.prefill_tokens += len(prefix)
            self.prefixes[p] = slice_columns(cache_layers_kv(cache), 0, len(prefix))
            if with_features:
                features = out.hidden_states[-1][0].float().mean(0)
        elif with_features:
            features = torch.zeros(self.model.config.get_text_config(decoder=True).hidden_size, device=self.device)
        self._record_memory()
        return features

    def _release_unused_prefixes(self) -> None:
        """Free the cached prefix of every prompt no sample can need again: all started, none parked, and none
        still running short of its probe (it may be parked, and resuming needs the prefix)."""
        probe = self.scheduler.probe_tokens
        may_park = set() if probe is None else {
            s.key[0] for s in self.running.values() if len(s.tokens) < probe}
        for p in [p for p in self.prefixes if not self.unstarted[p] and not self.parked_count[p]]:
            if p not in may_park:
                del self.prefixes[p]

    def _record_memory(self) -> None:
        parked = sum(kv_bytes(s.parked_tail) for s in self.parked.values())
        held = self.cache.nbytes() + parked + sum(kv_bytes(kv) for kv in self.prefixes.values() if kv is not None)
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, held)
        self.stats.parked_kv_bytes = max(self.stats.parked_kv_bytes, parked)

    def _result(self) -> RolloutResult:
        B, eos = len(self.prompt_ids), self.eos
        samples = [[self.done[(p, k)] for k in range(self.G)] for p in range(B)]
        return RolloutResult(
            prompt_ids=self.prompt_ids,
            completion_ids=[[s.tokens for s in group] for group in samples],
            logprobs=[[s.logprobs for s in group] for group in samples],
            truncated=[[s.tokens[-1] not in eos for s in group] for group in samples],
            stats=self.stats,
        )
