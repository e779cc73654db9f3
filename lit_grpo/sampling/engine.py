"""The rollout engine: G samples per prompt on g slots, each prompt prefilled once (Infinite Sampling).

One decode loop serves every strategy; they differ only in how many slots there are and which scheduler
(lit_grpo.scheduling) decides admission:

=============  =====================  ==========================================================================
strategy       slots                  admission
=============  =====================  ==========================================================================
"full"         B x G                  everything at once: the baseline that keeps all G KV caches alive
"micro"        g                      rounds of g samples of one prompt; a round waits for its longest member
"continuous"   g                      a freed slot is refilled at once, with the next sample of any group
"infinite"     g                      continuous + length prediction + global plan + refill policy
=============  =====================  ==========================================================================

How a sample runs. Its prompt's first ``P - 1`` tokens are prefilled once (batch of one, no padding) and that
prefix KV is copied into the slot batch for each of the G samples; the prompt's last token is fed by the sample's
first decode step, so every decode step of a sample produces exactly one of its tokens and a completion of L
tokens occupies its slot for exactly L steps (which makes ``lower_bound_steps`` and ``slot_utilization`` exact).
A prompt's prefix is freed once its last sample has started (and no parked sample still needs it). A sample
leaves the batch the step it emits EOS or reaches ``max_new_tokens``; no step ever runs a finished row.

Schedule invariance. Token t of sample (p, k) is drawn by inverse-CDF sampling with a uniform that depends only
on (seed, rollout index, p, k, t) (see random_streams.py), so completions do not depend on the strategy, on g or
on which samples shared a batch, up to batch-dependent floating-point rounding of the logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from lit_grpo.sampling.kv_cache import KV, SlotKVCache, cache_layers_kv, concat_columns, kv_bytes, slice_columns
from lit_grpo.sampling.random_streams import stream_uniforms
from lit_grpo.sampling.stats import IDLE, RolloutStats
from lit_grpo.sampling.token_sampler import sample_tokens
from lit_grpo.scheduling.base import FIFOScheduler, RolloutWork, RoundScheduler, SampleKey, Scheduler
from lit_grpo.validation import check_int

STRATEGIES = ("full", "micro", "continuous", "infinite")


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
    """A started sample: in a slot (``slot >= 0``) or parked with its generated positions' KV aside."""

    key: SampleKey
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    next_input: int = 0  # the token the next decode step feeds
    slot: int = -1
    parked_tail: KV | None = None


class RolloutEngine:
    """Generates G completions per prompt with a bounded number of concurrent sequences.

    Args:
        model: any transformers causal LM that takes ``past_key_values`` (full-attention layers).
        tokenizer: used for string prompts and for the EOS id.
        group_size: G, samples per prompt.
        micro_group_size: g, concurrent slots for "micro", "continuous" and "infinite" (default: G).
        strategy: one of ``STRATEGIES``.
        max_new_tokens: the length cap; a sample that reaches it without EOS is ``truncated``.
        temperature: 0 means greedy. top_p in (0, 1]; top_k 0 disables it.
        seed: base of every per-sample random stream.
        scheduler: a ``lit_grpo.scheduling.Scheduler`` overriding the strategy's default policy.
        eos_token_ids: stop tokens (default: the generation config's EOS ids and the tokenizer's).
        scheduler_options: keyword arguments for the "infinite" strategy's ``InfiniteScheduler``
            (e.g. ``predictor="online"``, ``refill="lpt"``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        group_size: int,
        micro_group_size: int | None = None,
        strategy: str = "continuous",
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        scheduler: Scheduler | None = None,
        eos_token_ids: Sequence[int] | None = None,
        **scheduler_options,
    ):
        micro_group_size = group_size if micro_group_size is None else micro_group_size
        check_int("group_size", group_size, 1)
        check_int("micro_group_size", micro_group_size, 1)
        check_int("max_new_tokens", max_new_tokens, 1)
        check_int("top_k", top_k, 0)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is not one of {list(STRATEGIES)}")
        if not temperature >= 0:
            raise ValueError(f"temperature={temperature!r} must be >= 0 (0 means greedy)")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
        if scheduler_options and strategy != "infinite":
            raise ValueError(f"options {sorted(scheduler_options)} only apply to strategy='infinite', "
                             f"not {strategy!r}")
        self.model, self.tokenizer = model, tokenizer
        self.group_size, self.micro_group_size, self.strategy = group_size, micro_group_size, strategy
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.seed = seed
        self.eos_token_ids = _eos_ids(model, tokenizer) if eos_token_ids is None else sorted(set(eos_token_ids))
        if not self.eos_token_ids:
            raise ValueError("no EOS token id: the tokenizer and the generation config define none; "
                             "pass eos_token_ids=[...]")
        self.scheduler = scheduler if scheduler is not None else _default_scheduler(strategy, scheduler_options)
        #: Rollouts generated so far; part of every random-stream key so successive rollouts differ.
        self.rollout_index = 0
        #: Generate under torch.inference_mode (False: torch.no_grad, needed for FSDP2-sharded models).
        self.inference_mode = True

    # ------------------------------------------------------------------------------------------- public API
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 lengths: Sequence[Sequence[int]] | None = None) -> RolloutResult:
        """Sample G completions for every prompt.

        Args:
            prompts: ``[B]`` strings (tokenized with the tokenizer's defaults) or token-id lists.
            lengths: ``[B][G]`` forced completion lengths (replay): EOS is suppressed before and forced at step L.
        """
        started = time.perf_counter()
        prompt_ids = self._prompt_ids(prompts)
        if lengths is not None:
            lengths = self._check_lengths(lengths, len(prompt_ids))
        # inference_mode, except for models whose forward hooks mutate parameters (FSDP2 gathers shards): no_grad
        with torch.inference_mode() if self.inference_mode else torch.no_grad():
            result = _Rollout(self, prompt_ids, lengths).run()
        self.rollout_index += 1
        result.stats.wall_s = time.perf_counter() - started
        result.stats.finalize([len(c) for group in result.completion_ids for c in group])
        return result

    def state_dict(self) -> dict:
        """The rollout counter and the scheduler's learned state (predictors), for exact resume."""
        state = {"rollout_index": self.rollout_index}
        if hasattr(self.scheduler, "state_dict"):
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.rollout_index = int(state["rollout_index"])
        if "scheduler" in state and hasattr(self.scheduler, "load_state_dict"):
            self.scheduler.load_state_dict(state["scheduler"])

    def num_slots(self, num_prompts: int) -> int:
        total = num_prompts * self.group_size
        return total if self.strategy == "full" else min(self.micro_group_size, total)

    # ------------------------------------------------------------------------------------------ validation
    def _prompt_ids(self, prompts) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError(f"prompts must be a non-empty list of strings or token-id lists, got {prompts!r:.80}")
        ids = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("string prompts need a tokenizer; pass token ids or a tokenizer")
                prompt = self.tokenizer(prompt)["input_ids"]
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            vocab = self.model.get_input_embeddings().num_embeddings
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): "
                                 f"{[t for t in prompt if not 0 <= t < vocab][:5]}")
            limit = getattr(self.model.config, "max_position_embeddings", None)
            if limit is not None and len(prompt) + self.max_new_tokens > limit:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={self.max_new_tokens} "
                                 f"that exceeds the model's max_position_embeddings={limit}")
            ids.append(prompt)
        return ids

    def _check_lengths(self, lengths, num_prompts: int) -> list[list[int]]:
        if len(lengths) != num_prompts or any(len(row) != self.group_size for row in lengths):
            raise ValueError(f"lengths must be [B={num_prompts}][G={self.group_size}], got "
                             f"{[len(row) for row in lengths]}")
        flat = [int(n) for row in lengths for n in row]
        if min(flat) < 1:
            raise ValueError(f"forced lengths must be >= 1, got {min(flat)}")
        return [[min(int(n), self.max_new_tokens) for n in row] for row in lengths]


class _Rollout:
    """The state of one ``generate`` call: a decode loop over slots driven by the engine's scheduler."""

    def __init__(self, engine: RolloutEngine, prompt_ids: list[list[int]], lengths: list[list[int]] | None):
        self.engine, self.model = engine, engine.model
        self.prompt_ids, self.forced = prompt_ids, lengths
        self.G = engine.group_size
        self.num_slots = engine.num_slots(len(prompt_ids))
        self.device = next(self.model.parameters()).device
        self.scheduler = engine.scheduler
        self.stats = RolloutStats(num_slots=self.num_slots, group_size=self.G)
        config = self.model.config.get_text_config(decoder=True)
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.cache = SlotKVCache(self.model.config, self.device, self.model.dtype, self.kv_heads, self.head_dim)
        self.eos = torch.tensor(engine.eos_token_ids, device=self.device)
        self.eos_set = set(engine.eos_token_ids)

        B = len(prompt_ids)
        self.prefixes: dict[int, KV | None] = {}  # prompt -> cached prefix KV, while a sample may still need it
        self.unstarted = [self.G] * B  # samples of each prompt not yet started
        self.parked_count = [0] * B
        self.running: list[_Sample] = []  # in cache-row order
        self.parked: dict[SampleKey, _Sample] = {}
        self.free_slots = list(range(self.num_slots - 1, -1, -1))  # pop() gives the lowest slot id
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
        while len(self.done) < total:
            if self.free_slots:
                self._admit(self.scheduler.admit(len(self.free_slots), len(self.running)))
            if not self.running:
                raise RuntimeError(f"{type(self.scheduler).__name__} admitted nothing while no sample runs and "
                                   f"{total - len(self.done)} samples remain")
            self._decode_step()
        metrics = self.scheduler.end()
        self.stats.length_pred_kendall_tau = metrics.get("length_pred_kendall_tau")
        self.stats.length_pred_smape = metrics.get("length_pred_smape")
        return self._result()

    def _admit(self, keys: list[SampleKey]) -> None:
        if len(keys) > len(self.free_slots):
            raise RuntimeError(f"scheduler admitted {len(keys)} samples for {len(self.free_slots)} free slots")
        rows: list[KV | None] = []
        for key in keys:
            p, _ = key
            if key in self.parked:
                sample = self.parked.pop(key)
                self.parked_count[p] -= 1
                rows.append(concat_columns(self.prefixes[p], sample.parked_tail))
                sample.parked_tail = None
            elif key in self.done or any(s.key == key for s in self.running) or not self.unstarted[p]:
                raise RuntimeError(f"scheduler admitted sample {key} twice")
            else:
                if p not in self.prefixes:
                    self._prefill(p)
                self.unstarted[p] -= 1
                sample = _Sample(key, next_input=self.prompt_ids[p][-1])
                rows.append(self.prefixes[p])
            sample.slot = self.free_slots.pop()
            self.running.append(sample)
        self._release_unused_prefixes()
        if rows:
            self.cache.insert(rows)
            self._record_memory()

    def _decode_step(self) -> None:
        engine = self.engine
        checkpoint = self.scheduler.checkpoint_tokens
        want_hidden = checkpoint is not None and any(len(s.tokens) == checkpoint - 1 for s in self.running)
        input_ids = torch.tensor([[s.next_input] for s in self.running], device=self.device)
        positions = self.cache.lengths.unsqueeze(1)
        attention_mask = self.cache.attention_mask()

        start = time.perf_counter()
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                         past_key_values=self.cache.cache, use_cache=True, logits_to_keep=1,
                         output_hidden_states=want_hidden)
        logits = out.logits[:, -1]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.forward_s += time.perf_counter() - start
        self.cache.advance()
        self.stats.decode_steps += 1
        self._record_memory()

        token_index = torch.tensor([len(s.tokens) for s in self.running], device=self.device)
        prompt_index = torch.tensor([s.key[0] for s in self.running], device=self.device)
        sample_index = torch.tensor([s.key[1] for s in self.running], device=self.device)
        if self.forced is not None:
            logits = self._force_lengths(logits, prompt_index, sample_index, token_index)
        uniforms = stream_uniforms(engine.seed, engine.rollout_index, prompt_index, sample_index, token_index)
        tokens, logprobs = sample_tokens(logits, uniforms, engine.temperature, engine.top_k, engine.top_p)

        timeline = [IDLE] * self.num_slots
        keep, park = [], []
        for row, (sample, token, logprob) in enumerate(zip(self.running, tokens.tolist(), logprobs.tolist())):
            timeline[sample.slot] = sample.key[0] * self.G + sample.key[1]
            sample.tokens.append(token)
            sample.logprobs.append(logprob)
            sample.next_input = token
            if token in self.eos_set or len(sample.tokens) >= engine.max_new_tokens:
                self._finish(sample)
            elif len(sample.tokens) == checkpoint and self.scheduler.checkpoint(
                    sample.key, len(sample.tokens), out.hidden_states[-1][row, -1].float()):
                park.append(row)
            else:
                keep.append(row)
        self.stats.timeline.append(timeline)
        for row in park:
            self._park(row)
        if len(keep) < len(self.running):
            self.running = [self.running[row] for row in keep]
            self.cache.keep(keep)
        self._release_unused_prefixes()

    def _force_lengths(self, logits, prompt_index, sample_index, token_index) -> torch.Tensor:
        """Replay: EOS is impossible before the recorded length and certain at it."""
        forced = torch.tensor(self.forced, device=self.device)[prompt_index, sample_index]
        logits = logits.float().clone()
        is_last = (token_index + 1) == forced
        logits[:, self.eos] = torch.where(is_last.unsqueeze(1), 0.0, float("-inf"))
        logits[is_last] = logits[is_last].masked_fill(
            ~torch.isin(torch.arange(logits.shape[1], device=self.device), self.eos), float("-inf"))
        return logits

    # --------------------------------------------------------------------------------------- sample states
    def _finish(self, sample: _Sample) -> None:
        self.free_slots.append(sample.slot)
        self.free_slots.sort(reverse=True)
        self.done[sample.key] = sample
        self.scheduler.finish(sample.key, len(sample.tokens))

    def _park(self, row: int) -> None:
        sample = self.running[row]
        # The row's KV is prompt prefix + fed tokens (last prompt token and tokens[:-1]): keep only the fed part.
        sample.parked_tail = self.cache.row_kv(row, last=len(sample.tokens))
        self.free_slots.append(sample.slot)
        self.free_slots.sort(reverse=True)
        sample.slot = -1
        self.parked[sample.key] = sample
        self.parked_count[sample.key[0]] += 1

    def _prefill(self, p: int, with_features: bool = False) -> torch.Tensor | None:
        """Run prompt p once and cache its first P - 1 positions; optionally return its pooled features [H]."""
        ids = self.prompt_ids[p]
        prefix = ids if with_features else ids[:-1]  # features see the whole prompt; the cache keeps P - 1
        features = None
        if prefix:
            cache = DynamicCache(config=self.model.config)
            start = time.perf_counter()
            out = self.model(input_ids=torch.tensor([prefix], device=self.device), past_key_values=cache,
                             use_cache=True, logits_to_keep=1, output_hidden_states=with_features)
            self.stats.forward_s += time.perf_counter() - start
            self.stats.prefill_tokens += len(prefix)
            kv = cache_layers_kv(cache)
            self.prefixes[p] = slice_columns(kv, 0, len(ids) - 1) if len(ids) > 1 else None
            if with_features:
                features = out.hidden_states[-1][0].float().mean(0)
        else:
            self.prefixes[p] = None
        self._record_memory()
        return features

    def _release_unused_prefixes(self) -> None:
        """Free the cached prefix of every prompt no sample can need again: all started, none parked, and none
        still running short of its checkpoint (it may be parked, and resuming needs the prefix)."""
        checkpoint = self.scheduler.checkpoint_tokens
        may_park = set() if checkpoint is None else {s.key[0] for s in self.running if len(s.tokens) < checkpoint}
        for p in [p for p in self.prefixes if not self.unstarted[p] and not self.parked_count[p]]:
            if p not in may_park:
                del self.prefixes[p]

    def _record_memory(self) -> None:
        held = self.cache.nbytes() + sum(kv_bytes(kv) for kv in self.prefixes.values() if kv is not None)
        held += sum(kv_bytes(s.parked_tail) for s in self.parked.values())
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, held)

    def _result(self) -> RolloutResult:
        B, eos = len(self.prompt_ids), self.eos_set
        samples = [[self.done[(p, k)] for k in range(self.G)] for p in range(B)]
        return RolloutResult(
            prompt_ids=self.prompt_ids,
            completion_ids=[[s.tokens for s in group] for group in samples],
            logprobs=[[s.logprobs for s in group] for group in samples],
            truncated=[[s.tokens[-1] not in eos for s in group] for group in samples],
            stats=self.stats,
        )


def _default_scheduler(strategy: str, options: dict) -> Scheduler:
    if strategy == "infinite":
        from lit_grpo.scheduling import InfiniteScheduler

        return InfiniteScheduler(**options)
    return RoundScheduler() if strategy == "micro" else FIFOScheduler()


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))
