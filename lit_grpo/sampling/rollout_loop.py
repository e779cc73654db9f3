"""One rollout's decode loop: slots filled by the scheduler, prefixes prefilled once, samples finished or parked.

``RolloutLoop`` is what ``RolloutEngine.generate_groups`` runs: it asks the scheduler (policy) which samples start
in which slots, starts them in those rows of the ``DecodeStep`` (compute, owner of the rows' state in the
``SlotKVCache``), runs one step per decode step and hands each row's token back to its sample. It owns the samples' tokens; the scheduler
owns which sample runs where. See lit_grpo.sampling.engine for the design.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from lit_grpo.sampling.carry import GroupProgress, SampleProgress
from lit_grpo.sampling.decode_step import DecodeStep
from lit_grpo.sampling.kv_cache import KV, cache_layers_kv, kv_bytes, slice_columns
from lit_grpo.sampling.stats import IDLE, RolloutResult, RolloutStats
from lit_grpo.scheduling.base import Assignment, RolloutWork, SampleKey, Scheduler


@dataclass(frozen=True)
class LoopSettings:
    """What one rollout's loop needs of its engine."""

    group_size: int
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    seed: int
    rollout_index: int


@dataclass
class _Sample:
    """A sample's progress in this rollout; while parked, its generated positions' KV aside."""

    key: SampleKey
    progress: SampleProgress
    parked_tail: KV | None = None

    @property
    def tokens(self) -> list[int]:
        return self.progress.tokens


class RolloutLoop:
    """The state of one rollout: a decode loop over slots driven by a scheduler.

    Args:
        groups: the groups to run, fresh or carried (their progress is copied, not changed).
        complete: stop once this many groups are complete (None: all of them); every unfinished group is then
            returned in ``RolloutResult.carried``.
        finish: indices of groups that must complete before the rollout stops, whatever ``complete`` says.
    """

    def __init__(self, model: torch.nn.Module, scheduler: Scheduler, step: DecodeStep, settings: LoopSettings,
                 groups: list[GroupProgress], complete: int | None = None, finish: frozenset[int] = frozenset()):
        self.model, self.scheduler, self.step, self.settings = model, scheduler, step, settings
        self.groups = [GroupProgress(g.prompt_ids, [_copy(s) for s in g.samples], g.stream, g.forced_lengths, g.tag)
                       for g in groups]
        self.complete = len(groups) if complete is None else complete
        self.finish = finish
        self.G = settings.group_size
        self.num_slots = step.cache.num_slots
        self.device = step.device
        self.stats = RolloutStats(num_slots=self.num_slots, group_size=self.G)
        self._prefill_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA prefills, timed at the end
        self.step.start_rollout(settings.seed)

        self.samples = {(p, k): _Sample((p, k), s) for p, g in enumerate(self.groups) for k, s in enumerate(g.samples)}
        self.prefixes: dict[int, KV | None] = {}  # prompt -> cached prefix KV, while a sample may still need it
        self.unstarted = [sum(not s.done for s in g.samples) for g in self.groups]  # not yet run in this rollout
        self.unfinished = list(self.unstarted)
        self.parked_count = [0] * len(self.groups)
        self.running: dict[SampleKey, _Sample] = {}
        self.parked: dict[SampleKey, _Sample] = {}
        self.completed = [p for p, left in enumerate(self.unfinished) if not left]  # groups in completion order

    # ------------------------------------------------------------------------------------------ main loop
    def run(self) -> RolloutResult:
        groups = self.groups
        work = RolloutWork(prompt_lengths=[len(g.prompt_ids) for g in groups], group_size=self.G,
                           num_slots=self.num_slots, max_new_tokens=self.settings.max_new_tokens,
                           prompt_ids=[g.prompt_ids for g in groups], true_lengths=self._forced_lengths(),
                           generated={key: len(s.tokens) for key, s in self.samples.items() if s.tokens},
                           done={key for key, s in self.samples.items() if s.progress.done})
        if self.scheduler.needs_prompt_features:
            work.prompt_features = torch.stack([self._prefill(p, with_features=True) for p in range(len(groups))])
        self.scheduler.begin(work)
        self._record_memory()
        try:
            while not self._over():
                if len(self.running) < self.num_slots and self._waiting():
                    # Once nothing waits, the tail runs without asking the scheduler.
                    self._admit(self.scheduler.admit())
                if not self.running:
                    raise RuntimeError(f"{type(self.scheduler).__name__} admitted nothing while no sample runs and "
                                       f"{sum(self.unfinished)} samples remain")
                self._decode_step()
        finally:
            self.step.stop_all()  # leave every row idle for the next rollout
        self._count_prefill_events()
        metrics = self.scheduler.end()
        self.stats.length_pred_kendall_tau = metrics.get("length_pred_kendall_tau")
        self.stats.length_pred_smape = metrics.get("length_pred_smape")
        return self._result()

    def _over(self) -> bool:
        if len(self.completed) == len(self.groups):
            return True
        return len(self.completed) >= self.complete and all(not self.unfinished[p] for p in self.finish)

    def _waiting(self) -> bool:
        """Whether a sample waits for a slot: one not started in this rollout yet, or a parked one."""
        return bool(self.parked) or any(self.unstarted)

    def _admit(self, assignments: list[Assignment]) -> None:
        for slot, key in assignments:
            p, k = key
            sample = self.samples.get(key)
            if key in self.parked:
                del self.parked[key]
                self.parked_count[p] -= 1
            elif sample is None or sample.progress.done or key in self.running or not self.unstarted[p]:
                raise RuntimeError(f"scheduler admitted sample {key} twice, or one that does not wait")
            else:
                self.unstarted[p] -= 1
                if p not in self.prefixes:
                    self._prefill(p)
                if sample.tokens:  # carried from an earlier rollout: its positions are computed anew
                    sample.parked_tail = self._prefill_tail(p, sample.tokens)
            group = self.groups[p]
            next_input = sample.tokens[-1] if sample.tokens else group.prompt_ids[-1]
            forced = group.forced_lengths[k] if group.forced_lengths is not None else 0
            self.step.start_row(slot, (self.prefixes[p], sample.parked_tail), stream=group.stream, sample=k,
                                generated=len(sample.tokens), next_input=next_input, forced_length=forced)
            sample.parked_tail = None
            self.running[key] = sample
        self._release_unused_prefixes()
        self._record_memory()

    def _decode_step(self) -> None:
        probe = self.scheduler.probe_tokens
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
            token, progress = out.tokens[slot], sample.progress
            progress.tokens.append(token)
            progress.logprobs.append(out.logprobs[slot])
            progress.versions.append(self.settings.rollout_index)
            if token in self.settings.eos_token_ids or len(progress.tokens) >= self.settings.max_new_tokens:
                self._finish(slot, sample)
            elif len(progress.tokens) == probe and self.scheduler.probe(
                    sample.key, len(progress.tokens), out.hidden[hidden_row[slot]]):
                self._park(slot, sample)
        self.stats.timeline.append(timeline)
        self._release_unused_prefixes()

    # --------------------------------------------------------------------------------------- sample states
    def _finish(self, slot: int, sample: _Sample) -> None:
        self._vacate(slot, sample)
        sample.progress.done = True
        p = sample.key[0]
        self.unfinished[p] -= 1
        if not self.unfinished[p]:
            self.completed.append(p)
        self.scheduler.finish(sample.key, len(sample.tokens))

    def _park(self, slot: int, sample: _Sample) -> None:
        """The scheduler parked the sample (and freed its slot): keep its row's generated positions aside."""
        # The row holds the prompt prefix, then the fed tokens (the last prompt token and tokens[:-1]): keep those.
        prefix = len(self.groups[sample.key[0]].prompt_ids) - 1
        sample.parked_tail = self.step.read_row(slot, prefix, prefix + len(sample.tokens))
        self._vacate(slot, sample)
        self.parked[sample.key] = sample
        self.parked_count[sample.key[0]] += 1
        self.stats.parked_samples += 1
        self._record_memory()

    def _vacate(self, slot: int, sample: _Sample) -> None:
        self.step.stop_row(slot)
        del self.running[sample.key]

    def _forward(self, input_ids: list[int], cache: DynamicCache, **kwargs):
        start = time.perf_counter()
        events = None
        if self.device.type == "cuda":  # kernels run asynchronously: the device's time comes from events
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        out = self.model(input_ids=torch.tensor([input_ids], device=self.device), past_key_values=cache,
                         use_cache=True, logits_to_keep=1, **kwargs)
        elapsed = time.perf_counter() - start
        self.stats.forward_s += elapsed
        if events is None:
            self.stats.prefill_s += elapsed
        else:  # read once the rollout's last decode step has synchronised: no host sync of its own
            events[1].record()
            self._prefill_events.append(events)
        self.stats.prefill_tokens += len(input_ids)
        return out

    def _count_prefill_events(self) -> None:
        """Add the CUDA prefills' device time to ``prefill_s`` (their events completed before the last step's
        synchronisation)."""
        if self._prefill_events:
            self._prefill_events[-1][1].synchronize()  # already complete after a decode step; a no-op wait then
            self.stats.prefill_s += sum(start.elapsed_time(end) for start, end in self._prefill_events) / 1000
            self._prefill_events.clear()

    def _prefill(self, p: int, with_features: bool = False) -> torch.Tensor | None:
        """Run prompt p's first P - 1 tokens once and cache their KV; optionally return its features [H] (the
        mean of their last hidden states; zeros for a one-token prompt)."""
        prefix = self.groups[p].prompt_ids[:-1]
        features = None
        self.prefixes[p] = None
        if prefix:
            cache = DynamicCache(config=self.model.config)
            out = self._forward(prefix, cache, output_hidden_states=with_features)
            self.prefixes[p] = slice_columns(cache_layers_kv(cache), 0, len(prefix))
            if with_features:
                features = out.hidden_states[-1][0].float().mean(0)
        elif with_features:
            features = torch.zeros(self.model.config.get_text_config(decoder=True).hidden_size, device=self.device)
        self._record_memory()
        return features

    def _prefill_tail(self, p: int, tokens: list[int]) -> KV:
        """The KV of a carried sample's fed positions (the last prompt token and ``tokens[:-1]``), computed under
        the current weights after prompt p's cached prefix."""
        cache = DynamicCache(config=self.model.config)
        prefix = self.prefixes[p]
        for layer, (keys, values) in enumerate(prefix or []):
            cache.update(keys, values, layer)
        start = 0 if prefix is None else prefix[0][0].shape[-2]
        self._forward([self.groups[p].prompt_ids[-1], *tokens[:-1]], cache)
        return slice_columns(cache_layers_kv(cache), start)

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
        held = self.step.cache.nbytes() + parked + sum(kv_bytes(kv) for kv in self.prefixes.values() if kv is not None)
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, held)
        self.stats.parked_kv_bytes = max(self.stats.parked_kv_bytes, parked)

    def _forced_lengths(self) -> list[list[int]] | None:
        if all(g.forced_lengths is None for g in self.groups):
            return None
        if any(g.forced_lengths is None for g in self.groups):
            raise ValueError("forced lengths must be given for every group of a rollout or for none")
        return [list(g.forced_lengths) for g in self.groups]

    def _result(self) -> RolloutResult:
        # Groups that had to finish go first, then the others in completion order; returned in input order.
        must = [p for p in self.completed if p in self.finish]
        chosen = set((must + [p for p in self.completed if p not in self.finish])[:max(self.complete, len(must))])
        groups = [g for p, g in enumerate(self.groups) if p in chosen]
        eos = self.settings.eos_token_ids
        return RolloutResult(
            prompt_ids=[g.prompt_ids for g in groups],
            completion_ids=[[s.tokens for s in g.samples] for g in groups],
            logprobs=[[s.logprobs for s in g.samples] for g in groups],
            truncated=[[s.tokens[-1] not in eos for s in g.samples] for g in groups],
            stats=self.stats,
            versions=[[s.versions for s in g.samples] for g in groups],
            tags=[g.tag for g in groups],
            carried=[g for p, g in enumerate(self.groups) if p not in chosen],
        )


def _copy(sample: SampleProgress) -> SampleProgress:
    return SampleProgress(list(sample.tokens), list(sample.logprobs), list(sample.versions), sample.done)
