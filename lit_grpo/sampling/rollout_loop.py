"""One rollout's executor: rows started where the scheduler placed samples, prefixes prefilled once, tokens kept.

``RolloutLoop`` is what ``RolloutEngine.generate_groups`` runs: ``lit_grpo.scheduling.driver.drive_rollout`` asks
the scheduler (policy, owner of which sample runs in which slot, which are parked and how far each got) what to
run, and this loop executes it: it starts samples in rows of the ``DecodeStep`` (compute, owner of the rows' state
in the ``SlotKVCache``), runs one step per decode step and hands each row's token to its sample. It owns the
samples' tokens and decides when a prompt's prefix KV is freed; a ``PrefixTailStore`` holds the prefixes and parked
samples' KV, and ``prefill`` says which prompts prefill together.
See lit_grpo.sampling.engine for the design.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from lit_grpo.runtime.head_precision import layers_dtype
from lit_grpo.sampling.carry import GroupProgress, SampleProgress
from lit_grpo.sampling.decode_step import DecodeStep
from lit_grpo.sampling.roofline import DecodeReads, decode_reads
from lit_grpo.sampling.kv_cache import (KV, PrefillCache, PrefixTailStore, cache_layers_kv, kept_positions, kv_bytes,
                                       kv_cache_dtype, take_columns)
from lit_grpo.sampling.memory_budget import tail_tokens
from lit_grpo.sampling.prefill import (PREFILL_CHUNK_TOKENS, pack_chunk, packed_forward, prefill_chunks,
                                      split_prefixes, tail_attention_inputs)
from lit_grpo.sampling.stats import RolloutResult, RolloutStats
from lit_grpo.sampling.stop_strings import StopStrings
from lit_grpo.scheduling.base import Assignment, RolloutWork, SampleKey, Scheduler
from lit_grpo.scheduling.driver import Row, drive_rollout


@dataclass(frozen=True)
class LoopSettings:
    """What one rollout's loop needs of its engine."""

    group_size: int
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    seed: int
    rollout_index: int
    width: int  # the rollout's own slot width: its longest prompt - 1 + max_new_tokens
    stop_strings: StopStrings | None = None


class RolloutLoop:
    """The state of one rollout: the samples' tokens and KV, run in the slots a scheduler assigns.

    Args:
        groups: the groups to run, fresh or carried (their progress is copied, not changed).
        complete: stop once this many groups are complete (None: all of them); every unfinished group is then
            returned in ``RolloutResult.carried``.
        finish: indices of groups that must complete before the rollout stops, whatever ``complete`` says.
    """

    def __init__(self, model: torch.nn.Module, scheduler: Scheduler, step: DecodeStep, settings: LoopSettings,
                 groups: list[GroupProgress], complete: int | None = None, finish: frozenset[int] = frozenset()):
        self.model, self.scheduler, self.decode_step, self.settings = model, scheduler, step, settings
        self.groups = [GroupProgress(g.prompt_ids, [_copy(s) for s in g.samples], g.stream, g.forced_lengths, g.tag,
                                     g.forced_tokens) for g in groups]
        _check_replay(self.groups)
        _check_progress(self.groups, settings.max_new_tokens, settings.eos_token_ids)
        self.complete = len(groups) if complete is None else complete
        self.must_finish = finish
        self.G = settings.group_size
        self.num_slots = step.cache.num_slots
        self.device = step.device
        self.stats = RolloutStats(num_slots=self.num_slots, group_size=self.G)
        # the weights are priced in the cache's dtype: the rollout's (the autocast one, which the rollout weights
        # are cast or gathered into, under mixed precision); a model whose shape the roofline does not know (no
        # gated MLP) counts no bytes
        try:
            self.reads: DecodeReads | None = decode_reads(model.config, step.cache.layers[0].dtype)
        except ValueError:
            self.reads = None
        # CUDA prefills and decode steps, (start, end) events each, read once the rollout is over
        self._prefill_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._decode_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.decode_step.start_rollout(settings.seed, settings.width)

        self.samples = {(p, k): s for p, g in enumerate(self.groups) for k, s in enumerate(g.samples)}
        # A sample ends on EOS or at its limit: the cap, or its replayed length (a truncated token recording ends
        # there without EOS).
        self.limits = {(p, k): _limit(self.groups[p], k, settings.max_new_tokens) for p, k in self.samples}
        self.store = PrefixTailStore()  # a prompt's prefix while a sample may still need it, parked samples' tails
        self.chunks = prefill_chunks([len(g.prompt_ids) - 1 for g in self.groups], PREFILL_CHUNK_TOKENS)
        self._chunk_of = {p: chunk for chunk in self.chunks for p in chunk}
        self.unfinished = [sum(not s.done for s in g.samples) for g in self.groups]
        self.completed = [p for p, left in enumerate(self.unfinished) if not left]  # groups in completion order
        self._out = None  # the last decode step's output
        self._hidden_row: dict[int, int] = {}  # probing slot -> its row in the last step's hidden states

    # ------------------------------------------------------------------------------------------ main loop
    def run(self) -> RolloutResult:
        groups = self.groups
        work = RolloutWork(prompt_lengths=[len(g.prompt_ids) for g in groups], group_size=self.G,
                           num_slots=self.num_slots, max_new_tokens=self.settings.max_new_tokens,
                           true_lengths=self._forced_lengths(),
                           generated={key: len(s.tokens) for key, s in self.samples.items() if s.tokens},
                           done={key for key, s in self.samples.items() if s.done},
                           park_cost=self._park_cost())
        if self.scheduler.needs_prompt_features:
            work.prompt_features = self._prefill_with_features()
        self._record_memory()
        try:
            driven = drive_rollout(self.scheduler, work, self, keep_timeline=True)
        finally:
            self.decode_step.stop_all()  # leave every row idle for the next rollout
        self._count_device_time()
        self.stats.decode_steps, self.stats.timeline = driven.decode_steps, driven.timeline
        self.stats.decisions = driven.decisions
        self.stats.preempting = driven.metrics.get("preempting")
        self.stats.parked_samples = self.scheduler.parked_samples
        self.stats.length_pred_kendall_tau = driven.metrics.get("length_pred_kendall_tau")
        self.stats.length_pred_smape = driven.metrics.get("length_pred_smape")
        return self._result()

    def _park_cost(self) -> Callable[[int], float]:
        """A parked tail's KV in tokens of every layer, ``tail_tokens`` of the cache's windows: memoized, since the
        gate's simulation asks it at the preemption points of every rollout it draws, and each answer sums the
        layers."""
        return functools.cache(functools.partial(tail_tokens, self.decode_step.cache.piece_windows))

    # ------------------------------------------------------------------- the executor (scheduling.driver)
    def over(self) -> bool:
        if len(self.completed) == len(self.groups):
            return True
        return len(self.completed) >= self.complete and all(not self.unfinished[p] for p in self.must_finish)

    def start(self, assignments: list[Assignment]) -> None:
        store = self.store
        unprefilled = {key[0] for _, key in assignments if not store.has_tail(key) and not store.has_prefix(key[0])}
        if unprefilled:
            self._prefill(unprefilled)
        for slot, key in assignments:
            p, k = key
            sample, group = self.samples[key], self.groups[key[0]]
            tail = store.take_tail(key)  # resumed after a park
            if tail is None and sample.tokens:  # carried from an earlier rollout: its positions are computed anew
                tail = self._prefill_tail(p, sample.tokens)
            next_input = sample.tokens[-1] if sample.tokens else group.prompt_ids[-1]
            forced = group.forced_lengths[k] if group.forced_lengths is not None else 0
            recorded = group.forced_tokens[k] if group.forced_tokens is not None else None
            # the span of each part explicitly: a sliding layer's piece may hold only its last window of it
            positions = (len(group.prompt_ids) - 1, 0 if tail is None else len(sample.tokens))
            self.decode_step.start_row(slot, (store.prefix(p), tail), stream=group.stream, sample=k,
                                       generated=len(sample.tokens), next_input=next_input, forced_length=forced,
                                       forced_tokens=recorded, seen=(group.prompt_ids, sample.tokens),
                                       positions=positions)
            del tail  # the row has its copy: free this one before the next sample starts
        self._release_unused_prefixes()
        self._record_memory()

    def step(self, rows: list[Row], probing: list[int]) -> list[bool]:
        self.decode_step.prepare()  # a new bucket's capture or compilation is capture_s, not the step's time
        with self._timed("decode_s", self._decode_events):
            out = self._out = self.decode_step.step(probing)
        self._hidden_row = {slot: i for i, slot in enumerate(probing)}
        eos, version = self.settings.eos_token_ids, self.settings.rollout_index
        if self.reads is not None:  # each row attended its cached positions, the one it just wrote included
            self.stats.decode_read_bytes += self.reads.rows_bytes(self.decode_step.live_lengths.values())
        ended = []
        for slot, key in rows:
            token, progress = out.tokens[slot], self.samples[key]
            progress.tokens.append(token)
            progress.logprobs.append(out.logprobs[slot])
            progress.versions.append(version)
            ended.append(token in eos or len(progress.tokens) >= self.limits[key])
        if self.settings.stop_strings is not None:
            live = [i for i, (_, key) in enumerate(rows) if not ended[i] and self._stops(key)]
            for i, stop in zip(live, self._stopped([rows[i][1] for i in live])):
                ended[i] = stop
        return ended

    def _stops(self, key: SampleKey) -> bool:
        """Stop strings end sample ``key`` (not one with a replayed length, which ends where it was recorded)."""
        return self.settings.stop_strings is not None and self.groups[key[0]].forced_lengths is None

    def _stopped(self, keys: list[SampleKey]) -> list[bool]:
        """``[len(keys)]``: each sample's tokens so far end on a stop string. A resumed sample's tokens before its
        ``resumed_at`` (the turn that ended, the caller's own) are its prompt now: a string there ends nothing."""
        if not keys:
            return []
        return self.settings.stop_strings.ended([self.samples[key].tokens[self.samples[key].resumed_at:]
                                                 for key in keys])

    def feature(self, slot: int, key: SampleKey) -> torch.Tensor:
        return self._out.hidden[self._hidden_row[slot]]

    def finish(self, slot: int, key: SampleKey) -> None:
        self.decode_step.stop_row(slot)
        self.samples[key].done = True
        p = key[0]
        self.unfinished[p] -= 1
        if not self.unfinished[p]:
            self.completed.append(p)

    def park(self, slot: int, key: SampleKey) -> None:
        """The scheduler parked the sample (and freed its slot): keep its row's generated positions aside."""
        sample = self.samples[key]
        # The row holds the prompt prefix, then the fed tokens (the last prompt token and tokens[:-1]): keep those
        # (a ring layer's last window of them).
        prefix = len(self.groups[key[0]].prompt_ids) - 1
        self.store.put_tail(key, self.decode_step.read_row(slot, prefix, prefix + len(sample.tokens)))
        self.decode_step.stop_row(slot)
        self._record_memory()

    def settle(self) -> None:
        self._release_unused_prefixes()

    def _forward(self, input_ids: torch.Tensor, cache: DynamicCache, **kwargs):
        """A prefill forward of ``input_ids`` ``[1, tokens]``, timed."""
        with self._timed("prefill_s", self._prefill_events):
            out = self.model(input_ids=input_ids, **{self.decode_step.cache_keyword: cache}, use_cache=True,
                             logits_to_keep=1, **kwargs)
        self.stats.prefill_tokens += input_ids.shape[-1]
        return out

    @contextlib.contextmanager
    def _timed(self, field: str, pending: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> Iterator[None]:
        """Time the block's forward: the host's time goes to ``stats.forward_s``, and the device's to
        ``stats.<field>``: on a CPU the host's clock is that time; on CUDA kernels run asynchronously, so a pair of
        events brackets the block and goes to ``pending``, read once the rollout's last decode step has
        synchronised (``_count_device_time``), with no host sync of its own."""
        events = None
        start = time.perf_counter()
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record(torch.cuda.current_stream(self.device))
        yield
        elapsed = time.perf_counter() - start
        self.stats.forward_s += elapsed
        if events is None:
            setattr(self.stats, field, getattr(self.stats, field) + elapsed)
        else:
            events[1].record(torch.cuda.current_stream(self.device))
            pending.append(events)

    def _count_device_time(self) -> None:
        """Add the CUDA prefills' and decode steps' device time to ``prefill_s`` and ``decode_s`` (their events
        completed by the last step's synchronisation)."""
        self.stats.prefill_s += _elapsed_s(self._prefill_events)
        self.stats.decode_s += _elapsed_s(self._decode_events)

    def _prefill(self, needed: set[int]) -> None:
        """Cache the prefix KV (first P - 1 tokens) of each prompt in ``needed``, by one forward of each one's
        prefill chunk. Of a chunk's other prompts, those whose samples still wait keep theirs too (``prefill``:
        every strategy runs the same chunks, so a prompt's KV never depends on the schedule)."""
        for p in [p for p in needed if p not in self._chunk_of]:  # a one-token prompt: no prefix
            self.store.put_prefix(p, None)
        for chunk in self.chunks:
            if not needed.intersection(chunk):
                continue
            prefixes, _ = self._run_chunk(chunk, with_features=False)
            for q, kv in zip(chunk, prefixes):
                if q in needed or (not self.store.has_prefix(q)
                                   and any(self.scheduler.waits((q, k)) for k in range(self.G))):
                    self.store.put_prefix(q, kv)
        self._record_memory()

    def _prefill_with_features(self) -> torch.Tensor:
        """Cache every prompt's prefix KV and return the prompts' features ``[B, H]``: the mean of each prefix's
        last hidden states (zeros for a one-token prompt). Runs before the scheduler begins, for predictors that
        read prompts."""
        hidden = self.model.config.get_text_config(decoder=True).hidden_size
        features = torch.zeros(len(self.groups), hidden, device=self.device)
        for p in range(len(self.groups)):  # a one-token prompt keeps None: it has no prefix
            self.store.put_prefix(p, None)
        for chunk in self.chunks:
            prefixes, chunk_features = self._run_chunk(chunk, with_features=True)
            for row, (p, kv) in enumerate(zip(chunk, prefixes)):
                self.store.put_prefix(p, kv)
                features[p] = chunk_features[row]
        self._record_memory()
        return features

    def _run_chunk(self, chunk: list[int], with_features: bool) -> tuple[list[KV], torch.Tensor | None]:
        """One prefill forward of the chunk's prompts, packed: each one's prefix KV, and with ``with_features``
        their features ``[members, H]``."""
        packed = pack_chunk([self.groups[p].prompt_ids[:-1] for p in chunk], self.device)
        cache = PrefillCache(self.model.config, kv_cache_dtype(self.model))
        with packed_forward(self.model, packed) as inputs:
            out = self._forward(packed.input_ids, cache, output_hidden_states=with_features, **inputs)
        features = None
        if with_features:
            last = out.hidden_states[-1][0]
            features = torch.stack([last[start:start + n].float().mean(0)
                                    for start, n in zip(packed.offsets, packed.lengths)])
        kv = cache_layers_kv(cache)
        del out, cache  # the chunk's KV is held by kv alone, and split_prefixes frees it a layer at a time
        self._record_memory(transient=kv_bytes(kv) + kv_bytes(kv[:1]))  # the split's peak: its first layer copied
        return split_prefixes(kv, packed, self.decode_step.cache.piece_windows), features

    def _prefill_tail(self, p: int, tokens: list[int]) -> KV:
        """The KV of a carried sample's fed positions (the last prompt token and ``tokens[:-1]``), computed under
        the current weights after prompt p's cached prefix; a ring layer's last window of them."""
        cache = PrefillCache(self.model.config, kv_cache_dtype(self.model))
        prefix = self.store.prefix(p)
        for layer, (keys, values) in enumerate(prefix or []):
            cache.update(keys, values, layer)
        start = len(self.groups[p].prompt_ids) - 1  # the prefix's positions
        fed = [self.groups[p].prompt_ids[-1], *tokens[:-1]]
        inputs = {}
        kept = kept_positions(self.decode_step.cache.ring_width, start)  # what split_prefixes left a ring layer
        if kept < start:  # the sliding layers hold the prefix's last window: positions and masks said explicitly
            # masks in the layers' dtype, as the packed prefill's (a float32 head tied to the embedding aside)
            inputs = tail_attention_inputs(self.decode_step.cache.layout, start, len(fed), kept,
                                           layers_dtype(self.model), self.device)
        self._forward(torch.tensor([fed], device=self.device), cache, **inputs)
        kv = cache_layers_kv(cache)
        del cache  # the prefix and tail are held by kv alone: each layer is freed once its tail is copied
        width = kv[0][0].shape[-2]
        self._record_memory(transient=kv_bytes(kv) + kv_bytes(kv[:1]) // width * len(fed))
        (tail,) = take_columns(kv, [(-len(fed), None)], self.decode_step.cache.piece_windows)
        return tail

    def _release_unused_prefixes(self) -> None:
        """Free the cached prefix of every prompt no sample can need again: none waits for a slot (not started,
        or parked), and none runs short of its probe or its last preemption point (it may be parked, and resuming
        needs the prefix)."""
        held = self.store.prompts()
        if not held:
            return
        scheduler = self.scheduler
        last = max(scheduler.probe_tokens or 0, max(scheduler.preempt_points, default=0))
        may_park = {key[0] for key in scheduler.running if len(self.samples[key].tokens) < last}
        for p in held:
            if p not in may_park and not any(scheduler.waits((p, k)) for k in range(self.G)):
                self.store.drop_prefix(p)

    def _record_memory(self, transient: int = 0) -> None:
        """Count the KV held now: the slot cache, parked tails, cached prefixes, and ``transient`` bytes a prefill
        holds besides them for a moment."""
        held = self.decode_step.cache.nbytes() + self.store.nbytes() + transient
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, held)
        self.stats.parked_kv_bytes = max(self.stats.parked_kv_bytes, self.store.parked_bytes)

    def _forced_lengths(self) -> list[list[int]] | None:
        if all(g.forced_lengths is None for g in self.groups):
            return None
        if any(g.forced_lengths is None for g in self.groups):
            raise ValueError("forced lengths must be given for every group of a rollout or for none")
        cap = self.settings.max_new_tokens  # a replayed length past the cap (cap + 1) runs to the cap
        return [[min(n, cap) for n in g.forced_lengths] for g in self.groups]

    def _result(self) -> RolloutResult:
        # Groups that had to finish go first, then the others in completion order; returned in input order.
        must = [p for p in self.completed if p in self.must_finish]
        chosen = set((must + [p for p in self.completed if p not in self.must_finish])[:max(self.complete, len(must))])
        groups = [g for p, g in enumerate(self.groups) if p in chosen]
        eos = self.settings.eos_token_ids
        # a sample that ended on a stop string, here or in an earlier rollout (carried), ends on it still
        capped = [(p, k) for p in sorted(chosen) for k, s in enumerate(self.groups[p].samples)
                  if s.tokens[-1] not in eos and self._stops((p, k))]
        stopped = {key for key, stop in zip(capped, self._stopped(capped)) if stop}
        return RolloutResult(
            prompt_ids=[g.prompt_ids for g in groups],
            completion_ids=[[s.tokens for s in g.samples] for g in groups],
            logprobs=[[s.logprobs for s in g.samples] for g in groups],
            truncated=[[s.tokens[-1] not in eos and (p, k) not in stopped for k, s in enumerate(g.samples)]
                       for p, g in enumerate(self.groups) if p in chosen],
            stats=self.stats,
            versions=[[s.versions for s in g.samples] for g in groups],
            tags=[g.tag for g in groups],
            carried=[g for p, g in enumerate(self.groups) if p not in chosen],
        )


def _check_replay(groups: list[GroupProgress]) -> None:
    """A rollout replays tokens for every group or for none, and each group's recorded tokens cover its lengths."""
    replayed = [g.forced_tokens is not None for g in groups]
    if any(replayed) and not all(replayed):
        raise ValueError(f"forced tokens must be given for every group of a rollout or for none; groups "
                         f"{[p for p, r in enumerate(replayed) if not r]} of {len(groups)} have none")
    for p, g in enumerate(groups):
        if g.forced_tokens is None:
            continue
        sizes = [len(t) for t in g.forced_tokens]
        if g.forced_lengths is None or len(sizes) != len(g.forced_lengths) or any(
                not 0 < n <= size for n, size in zip(g.forced_lengths, sizes)):
            raise ValueError(f"group {p}: forced_lengths {g.forced_lengths} must give each replayed sample a length "
                             f"in [1, its recorded tokens]; the recorded tokens have {sizes}")


def _check_progress(groups: list[GroupProgress], cap: int, eos: frozenset[int]) -> None:
    """Every sample's progress (carried from an earlier call, or a checkpoint) is one this rollout can continue: a
    log-prob and a version per token, tokens in a finished sample, and in an unfinished one fewer tokens than it may
    have and no stop token. A carried sample at or past the cap (a checkpoint of a run with a higher
    ``max_new_tokens``) would otherwise draw a token more, or write past its slot's row."""
    for p, group in enumerate(groups):
        for k, sample in enumerate(group.samples):
            n, where = len(sample.tokens), f"group {p}, sample {k}"
            if len(sample.logprobs) != n or len(sample.versions) != n:
                raise ValueError(f"{where} holds {n} tokens, {len(sample.logprobs)} log-probs and "
                                 f"{len(sample.versions)} versions; a sample's progress has one of each per token")
            if sample.done and not n:
                raise ValueError(f"{where} is done without a token; a finished sample holds its tokens")
            if sample.done:
                continue
            limit = _limit(group, k, cap)
            if n >= limit:
                raise ValueError(f"{where} is unfinished with {n} tokens, but a sample of this rollout ends at {limit} "
                                 f"(max_new_tokens={cap}, or its replayed length): continue it with max_new_tokens "
                                 f"> {n}")
            if stops := sorted(eos.intersection(sample.tokens[sample.resumed_at:])):
                raise ValueError(f"{where} is unfinished but its tokens hold the stop tokens {stops} after "
                                 f"resumed_at={sample.resumed_at}; a sample ends at its first stop token")


def _limit(group: GroupProgress, k: int, cap: int) -> int:
    """Tokens sample k of ``group`` may generate: its replayed length, if any, within the cap."""
    return cap if group.forced_lengths is None else min(group.forced_lengths[k], cap)


def _copy(sample: SampleProgress) -> SampleProgress:
    return SampleProgress(list(sample.tokens), list(sample.logprobs), list(sample.versions), sample.done,
                          sample.resumed_at)


def _elapsed_s(events: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
    """Seconds between each (start, end) pair of recorded CUDA events, summed; empties ``events``."""
    if not events:
        return 0.0
    events[-1][1].synchronize()  # already complete after a decode step; a no-op wait then
    seconds = sum(start.elapsed_time(end) for start, end in events) / 1000
    events.clear()
    return seconds
