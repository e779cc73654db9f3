"""The rollout engine: G samples per prompt on g slots, each prompt prefilled once (Infinite Sampling).

One decode loop serves every strategy; they differ only in how many slots there are and which scheduler
(lit_grpo.scheduling) decides admission:

=============  =====================  ==========================================================================
strategy       slots                  admission
=============  =====================  ==========================================================================
"full"         B x G                  everything at once: the baseline that keeps all G KV caches alive
"micro"        g                      rounds of g samples of one prompt; a round waits for its longest member
"continuous"   g                      a freed slot is refilled at once, with the next sample of any group
"infinite"     g                      continuous + least-attained-service preemption where it pays (the
                                      paper's length-aware method: ``scheduler.length_aware``)
=============  =====================  ==========================================================================

Three parts, as in vLLM's core: the scheduler decides which sample runs next (lit_grpo.scheduling), the slot cache
and the store beside it hold KV memory (``kv_cache.SlotKVCache``, ``kv_cache.PrefixTailStore``: prompts' prefixes
and parked samples' tails), and the decode step computes (``decode_step.DecodeStep``, a CUDA graph on CUDA);
``rollout_loop.RolloutLoop`` executes one rollout as the scheduling loop (``lit_grpo.scheduling.driver.drive_rollout``,
the one the simulator runs too) directs it, and this module is the public API.

How a sample runs. Its prompt's first ``P - 1`` tokens are prefilled once (with the consecutive prompts of its
prefill chunk, ``prefill.py``) and that prefix KV is written into a slot's row each time one of the G samples
starts there; the prompt's last token is fed by the sample's first decode step, so every decode step of a sample
produces exactly one of its tokens and a completion of L tokens occupies its slot for exactly L steps (which makes
``lower_bound_steps`` and ``slot_utilization`` exact). A prompt's prefix is freed once its last sample has started
(and no parked sample still needs it). A sample leaves its slot the step it emits EOS or reaches
``max_new_tokens``.

Replays. ``lengths=`` forces each sample's length (EOS impossible before it, certain at it); ``tokens=`` makes each
sample emit its recorded tokens (the model still runs every step, so hidden states, probes and predictors see what
they saw live) and ends it where they end. Both fill ``RolloutWork.true_lengths``, which the oracle predictor reads.

Schedule invariance. Token t of sample (p, k) is drawn by inverse-CDF sampling with a uniform that depends only on
(seed, rollout index, p, k, t) (random_streams.py), and every decode step has the same shapes whatever runs in the
other slots, so a row's arithmetic never depends on its neighbours: "micro", "continuous" and "infinite" with the
same g return bit-identical completions (and "full", whose batch is wider, equal ones up to rounding). On CUDA a
step attends the bucket of its longest live row (``decode_step``, "Attended width"), which follows the schedule,
so there the same g gives equal completions up to the rounding of attention at another width.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Iterable, Mapping
from numbers import Integral
from typing import Any, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_grpo.runtime.distributed import check_decodable, is_fsdp_sharded
from lit_grpo.runtime.models import eval_mode
from lit_grpo.runtime.validation import check_int_in_range, check_state_keys, shown_setting, shown_value
from lit_grpo.sampling.config import STRATEGIES, SamplingConfig
from lit_grpo.sampling.cpu_linear import onednn_linears, resolve_cpu_linear
from lit_grpo.sampling.decode_attention import attention_dispatch_problem
from lit_grpo.sampling.decode_step import DecodeStep, StepSettings, resolve_compile, vocab_size
from lit_grpo.sampling.kv_cache import SlotKVCache, kv_cache_dtype
from lit_grpo.sampling.memory_budget import aligned_width, decode_step_bytes, kv_row_bytes, row_width
from lit_grpo.sampling.carry import GroupProgress, SampleProgress
from lit_grpo.sampling.rollout_loop import LoopSettings, RolloutLoop
from lit_grpo.sampling.stop_strings import StopStrings
from lit_grpo.sampling.stats import RolloutResult
from lit_grpo.scheduling.base import RoundScheduler, Scheduler
from lit_grpo.scheduling.config import InfiniteSchedulerConfig

__all__ = ["STRATEGIES", "GroupProgress", "RolloutEngine", "RolloutResult", "SampleProgress"]

#: Attention implementations that take the slot cache's 4-D mask (flash-attention kernels take none).
SUPPORTED_ATTENTION = ("sdpa", "eager")

#: On CUDA, and wherever the step is compiled, the slot cache's width is rounded up to this many positions, so
#: rollouts whose prompts differ by a few tokens reuse one cache, its captured graph and its compiled code (and
#: attention rows stay aligned).
WIDTH_ALIGNMENT = 64


def row_alignment(device: torch.device, compiled: bool) -> int:
    """The multiple the slot cache's row width is rounded up to: ``WIDTH_ALIGNMENT`` on CUDA or for a compiled
    step, else 1 (what ``micro_group_size: auto`` prices, ``memory_budget.slot_positions``)."""
    return WIDTH_ALIGNMENT if device.type == "cuda" or compiled else 1


class RolloutEngine:
    """Generates G completions per prompt with a bounded number of concurrent sequences.

    Args:
        model: any transformers causal LM whose cache layers are full or sliding-window attention (attention
            "sdpa" or "eager"; ``kv_cache.attention_layout`` refuses what the engine cannot compute exactly).
        tokenizer: used for string prompts and for the EOS id.
        config: a :class:`~lit_grpo.sampling.config.SamplingConfig`; or give its fields (and the "infinite"
            scheduler's options) as keywords: ``RolloutEngine(model, tokenizer, group_size=32,
            micro_group_size=8, strategy="infinite", max_new_tokens=1024, preempt_tokens=16)``.
        scheduler: a ``lit_grpo.scheduling.Scheduler`` overriding the strategy's default policy.
        eos_token_ids: stop tokens (default: the generation config's EOS ids and the tokenizer's).

    The slot cache and the decode step (with its CUDA graph) are kept between ``generate`` calls while they fit
    the next rollout; ``release()`` frees them.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None,
                 config: SamplingConfig | None = None, *, scheduler: Scheduler | None = None,
                 eos_token_ids: Sequence[int] | None = None, **options: Any):
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"{shown_setting('model', model, 80)} must be a transformers causal LM "
                            "(lit_grpo.load_model_and_tokenizer gives one)")
        if tokenizer is not None and not callable(tokenizer):
            raise TypeError(f"{shown_setting('tokenizer', tokenizer, 80)} must be a transformers tokenizer or None "
                            "(token-id prompts with eos_token_ids=[...])")
        if config is not None and not isinstance(config, SamplingConfig):
            raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}; give the sampling "
                            "settings as keywords (group_size=..., strategy=...) or as a SamplingConfig")
        if isinstance(scheduler, (Mapping, InfiniteSchedulerConfig)):  # SamplingConfig's field, not an override
            raise TypeError(f"{shown_setting('scheduler', scheduler)} is the 'infinite' strategy's options: give them "
                            "flat (preempt_tokens=..., predictor=...) or inside a SamplingConfig(scheduler=...); the "
                            "scheduler argument takes a lit_grpo.scheduling.Scheduler object that replaces the "
                            "strategy's own")
        self.config = SamplingConfig.from_kwargs(config, **options)
        if self.config.micro_group_size == "auto":
            raise ValueError("micro_group_size='auto' must be resolved to an integer before the engine is built "
                             "(lit_grpo.sampling.memory_budget.auto_micro_group_size; RolloutBuilder does it)")
        attention = getattr(model.config, "_attn_implementation", None)
        if attention not in SUPPORTED_ATTENTION:
            raise ValueError(f"the model's attention implementation is {attention!r}; the slot cache passes a 4-D "
                             f"attention mask, which {list(SUPPORTED_ATTENTION)} take: load the model with "
                             "attn_implementation='sdpa'")
        if (problem := attention_dispatch_problem(model)) is not None:
            raise ValueError(f"the rollout engine cannot run this model exactly: {problem}")
        self.model, self.tokenizer = model, tokenizer
        self.eos_token_ids = stop_token_ids(model, tokenizer) if eos_token_ids is None else \
            _check_stop_ids(eos_token_ids, vocab_size(model))
        if not self.eos_token_ids:
            raise ValueError("no EOS token id: the tokenizer and the generation config define none; "
                             "pass eos_token_ids=[...]")
        if self.config.stop_strings and tokenizer is None:
            raise ValueError(f"stop_strings={list(self.config.stop_strings)} need a tokenizer to read the completions' "
                             "text; pass one")
        self.stop_strings = StopStrings(tokenizer, self.config.stop_strings) if self.config.stop_strings else None
        if scheduler is not None and (missing := [name for name in SCHEDULER_METHODS
                                                  if not callable(getattr(scheduler, name, None))]):
            raise TypeError(f"scheduler={type(scheduler).__name__} object has no {', '.join(missing)}: give a "
                            "lit_grpo.scheduling.Scheduler (or a subclass), or None for the strategy's own")
        self.scheduler = scheduler if scheduler is not None else _default_scheduler(self.config)
        #: Whether ``scheduler`` was given in place of the strategy's own: a resume's warnings name it then.
        self._scheduler_given = scheduler is not None
        #: Rollouts generated so far; part of every random-stream key so successive rollouts differ.
        self.rollout_index = 0
        #: Generate under torch.inference_mode; torch.no_grad for FSDP2-sharded models (their hooks write parameters).
        self.inference_mode = not is_fsdp_sharded(model)
        self._cache: SlotKVCache | None = None
        self._step: DecodeStep | None = None
        #: Why the decode step runs eagerly on CUDA although ``cuda_graph`` was left automatic (None: it does not).
        self.graph_failure: str | None = None
        #: Why the decode step runs uncompiled although ``compile`` asked for it (None: it does not): after a failed
        #: capture, it failed to compile without a graph too.
        self.compile_failure: str | None = None

    # ------------------------------------------------------------------------------------------ settings
    group_size = property(lambda self: self.config.group_size, doc="G, samples per prompt.")
    micro_group_size = property(lambda self: self.config.micro_group_size, doc="g, slots (None: G).")
    strategy = property(lambda self: self.config.strategy)
    max_new_tokens = property(lambda self: self.config.max_new_tokens)
    temperature = property(lambda self: self.config.temperature)
    top_p = property(lambda self: self.config.top_p)
    top_k = property(lambda self: self.config.top_k)
    min_p = property(lambda self: self.config.min_p)
    repetition_penalty = property(lambda self: self.config.repetition_penalty)
    seed = property(lambda self: self.config.seed)

    def num_slots(self, num_prompts: int) -> int:
        """The rollout's rows: B x G for "full"; else g, at most the samples there are, and for "micro" (whose
        rounds hold one prompt's samples) at most G."""
        total = num_prompts * self.group_size
        g = self.micro_group_size or self.group_size
        if self.strategy == "micro":
            g = min(g, self.group_size)
        return total if self.strategy == "full" else min(g, total)

    # ------------------------------------------------------------------------------------------- public API
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 lengths: Sequence[Sequence[int]] | None = None, *,
                 tokens: Sequence[Sequence[Sequence[int]]] | None = None,
                 streams: Sequence[int] | None = None) -> RolloutResult:
        """Sample G completions for every prompt.

        Args:
            prompts: ``[B]`` strings (tokenized with the tokenizer's defaults) or token-id lists.
            lengths: ``[B][G]`` forced completion lengths (replay): EOS is suppressed before and forced at step L;
                a length past ``max_new_tokens`` runs to the cap without EOS, truncated.
            tokens: ``[B][G]`` recorded completions (token replay): sample k of prompt p emits ``tokens[p][k]``
                (its first ``max_new_tokens``), each with its log-prob under this engine's sampling settings; the
                model runs every step as it would live. A recording without a final EOS ends at its last token,
                truncated. Not with ``lengths`` (a token replay's lengths are its tokens').
            streams: ``[B]`` distinct ints, the prompt part of each group's random-stream key (default: its
                position in ``prompts``). A caller that splits one set of prompts over several calls (or ranks)
                passes each prompt's index in the set, so that every prompt draws its own numbers.
        """
        # keywords only when given: subclasses that override new_groups(prompts, lengths, tags) keep working
        extra = {k: v for k, v in (("tokens", tokens), ("streams", streams)) if v is not None}
        return self.generate_groups(self.new_groups(prompts, lengths, **extra))

    def new_groups(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                   lengths: Sequence[Sequence[int]] | None = None, tags: Sequence | None = None, *,
                   tokens: Sequence[Sequence[Sequence[int]]] | None = None,
                   streams: Sequence[int] | None = None) -> list[GroupProgress]:
        """Fresh groups for ``prompts`` (and forced ``lengths`` or replayed ``tokens``), their random streams keyed
        to this engine's next rollout and ``streams`` (default: their positions; see ``generate``)."""
        if lengths is not None and tokens is not None:
            raise ValueError("give lengths= or tokens=, not both: a token replay's lengths are its tokens' lengths")
        prompt_ids = self._prompt_ids(prompts)
        streams = range(len(prompt_ids)) if streams is None else self._check_streams(streams, len(prompt_ids))
        if tokens is not None:
            tokens = self._check_tokens(tokens, len(prompt_ids))
            lengths = [[len(row) for row in group] for group in tokens]
        if lengths is not None:
            lengths = self._check_lengths(lengths, len(prompt_ids))
        if tags is not None and (not isinstance(tags, Sequence) or len(tags) != len(prompt_ids)):
            count = f"has {len(tags)} entries" if isinstance(tags, Sequence) else f"is {shown_value(tags, 40)}"
            raise ValueError(f"tags {count} for {len(prompt_ids)} prompts: give a list of one per prompt")
        return [GroupProgress(ids, [SampleProgress() for _ in range(self.group_size)],
                              (self.rollout_index, streams[p]), None if lengths is None else lengths[p],
                              None if tags is None else tags[p], None if tokens is None else tokens[p])
                for p, ids in enumerate(prompt_ids)]

    def generate_groups(self, groups: Sequence[GroupProgress], complete: int | None = None,
                        finish: Sequence[int] = ()) -> RolloutResult:
        """Run groups, fresh (``new_groups``) or carried from an earlier call, until ``complete`` of them are
        complete (default: all). The result holds the completed groups in input order; the others are in
        ``result.carried``, to pass to a later call.

        Args:
            groups: the groups, carried ones first (they are admitted first).
            complete: groups that end the rollout; None for all.
            finish: indices of groups that must complete in this call whatever ``complete`` says (a carried
                group that may not be carried again); they are picked first (the result keeps the input order).
        """
        started = time.perf_counter()
        check_decodable(self.model)
        groups, finish = self._checked_groups(groups, complete, finish)
        width = row_width(max(len(g.prompt_ids) for g in groups), self.max_new_tokens)
        settings = LoopSettings(self.group_size, self.max_new_tokens, frozenset(self.eos_token_ids), self.seed,
                                self.rollout_index, width, self.stop_strings)
        forced = any(g.forced_lengths is not None for g in groups)
        replayed = any(g.forced_tokens is not None for g in groups)
        # inference_mode, except for models whose forward hooks mutate parameters (FSDP2 gathers shards): no_grad
        sharded = is_fsdp_sharded(self.model)
        step_settings = self._step_settings(forced, replayed, sharded)
        linear_kernel = resolve_cpu_linear(self.config.cpu_linear, self.model, step_settings.compile, sharded)
        slots = self.num_slots(len(groups))
        with (torch.inference_mode() if self.inference_mode else torch.no_grad(), eval_mode(self.model),
              onednn_linears(self.model, linear_kernel, rows=slots)):
            _, step, built = self._slots(slots, width, step_settings)
            captured_before = 0.0 if built else step.capture_s  # a kept step captures new buckets' graphs too
            loop = RolloutLoop(self.model, self.scheduler, step, settings, groups, complete, frozenset(finish))
            result = loop.run()
        self.graph_failure = self.graph_failure or step.graph_failure  # a later bucket's capture may have failed
        self.compile_failure = self.compile_failure or step.compile_failure
        result.stats.capture_s = step.capture_s - captured_before
        self.rollout_index += 1
        result.stats.wall_s = time.perf_counter() - started
        drawn = [sum(v == settings.rollout_index for v in s.versions) for g in loop.groups for s in g.samples]
        result.stats.finalize([n for n in drawn if n])
        return result

    def _checked_groups(self, groups: Sequence[GroupProgress], complete: int | None,
                        finish: Sequence[int]) -> tuple[list[GroupProgress], list[int]]:
        """``generate_groups``' ``groups`` and ``finish`` as lists, each argument checked against the others and
        this engine's G; a bad one raises naming it."""
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable):
            raise TypeError(f"{shown_setting('groups', groups, 80)} must be a list of GroupProgress (from new_groups, "
                            "or a result's carried groups)")
        groups = list(groups)
        if not groups:
            raise ValueError("generate_groups needs at least one group")
        if not all(isinstance(g, GroupProgress) for g in groups):
            raise TypeError(f"groups holds {[type(g).__name__ for g in groups][:5]}; each must be a GroupProgress "
                            "(engine.new_groups(prompts) makes them; generate(prompts) takes the prompts themselves)")
        if complete is not None and (isinstance(complete, bool) or not isinstance(complete, Integral)
                                     or not 1 <= complete <= len(groups)):
            raise ValueError(f"{shown_setting('complete', complete)} must be an integer between 1 and the number of "
                             f"groups ({len(groups)})")
        if isinstance(finish, (str, bytes)) or not isinstance(finish, Iterable):
            raise ValueError(f"{shown_setting('finish', finish, 80)} must be a list of indices of the groups, integers "
                             f"in [0, {len(groups)})")
        finish = list(finish)
        if any(isinstance(p, bool) or not isinstance(p, Integral) or not 0 <= p < len(groups) for p in finish):
            raise ValueError(f"{shown_setting('finish', finish, 80)} must be indices of the groups, integers in "
                             f"[0, {len(groups)})")
        if any(len(g.samples) != self.group_size for g in groups):
            raise ValueError(f"every group needs group_size={self.group_size} samples, got "
                             f"{[len(g.samples) for g in groups]}")
        return groups, finish

    def release(self) -> None:
        """Free the slot cache and the decode step (and its CUDA graph); the next rollout allocates them again."""
        self._cache = self._step = None

    def slot_cache_bytes(self) -> int:
        """Bytes the slot cache holds now (0 once released): what keeping it between rollouts costs, its graphs'
        memory pool aside (``graph_pool_bytes``)."""
        return self._cache.nbytes() if self._cache is not None else 0

    def widest_slot_cache_bytes(self, num_prompts: int, longest_prompt: int) -> int:
        """Bytes of the slot cache of a rollout of ``num_prompts`` groups whose longest prompt has
        ``longest_prompt`` tokens (its rows aligned, as on CUDA): the most a kept cache can grow to. Under mixed
        precision, ask inside the rollout's autocast: the cache's dtype is the autocast one."""
        width = row_width(longest_prompt, self.max_new_tokens, WIDTH_ALIGNMENT)
        return self.num_slots(num_prompts) * kv_row_bytes(self.model.config, kv_cache_dtype(self.model), width)

    def graph_pool_bytes(self, num_prompts: int | None = None, longest_prompt: int | None = None) -> int:
        """Bytes the decode step's CUDA graphs keep in their private memory pool between rollouts, priced from the
        shapes (``memory_budget.decode_step_bytes``): of the slot cache held now, or with ``num_prompts`` and
        ``longest_prompt`` of the widest one (as ``widest_slot_cache_bytes``, whose note on autocast holds here);
        with the blocks of the weight casts the captured steps make (``DecodeStep.graph_cast_bytes``: autocast over
        weights no ``CastWeights`` copy stands in for); 0 where no graph is captured (an eager step's activations
        and casts are freed after it)."""
        if self._step is None or not self._step.graphs:
            return 0
        if longest_prompt is None:
            slots, width = self._cache.num_slots, self._cache.width
        else:
            slots = self.num_slots(num_prompts)
            width = row_width(longest_prompt, self.max_new_tokens, WIDTH_ALIGNMENT)
        return (decode_step_bytes(self.model.config, kv_cache_dtype(self.model), slots, width, vocab_size(self.model))
                + self._step.graph_cast_bytes)

    def state_dict(self) -> dict:
        """The rollout counter and the scheduler's state (the default's finished groups; a length predictor and its
        trust under the length-aware method), for exact resume."""
        state = {"rollout_index": self.rollout_index}
        if hasattr(self.scheduler, "state_dict"):
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Take ``state`` (``state_dict``'s, from a checkpoint), checked whole first (``checked_rollout_index``; the
        scheduler checks its own state before taking any of it): a bad one leaves the engine as it was. Saved with
        another strategy, it resumes (the strategy schedules the samples, it does not change them), said where the
        scheduler's state is dropped or starts fresh (``_warn_other_scheduler``)."""
        rollout_index = checked_rollout_index(state)
        keeps_state = hasattr(self.scheduler, "load_state_dict")
        if "scheduler" in state and keeps_state:
            self.scheduler.load_state_dict(state["scheduler"])
        self._warn_other_scheduler("scheduler" in state, keeps_state)
        self.rollout_index = rollout_index

    def _warn_other_scheduler(self, saved: bool, keeps_state: bool) -> None:
        """Warn where the checkpoint holds a scheduler state (``saved``) and this run's scheduler keeps none, or the
        other way round, as a resume with another scheduler's settings says what it drops
        (``LeastAttainedScheduler.load_state_dict``)."""
        strategy = self.config.strategy
        # a scheduler given in place of the strategy's is what drops or starts the state, whatever the strategy
        given = f"scheduler ({type(self.scheduler).__name__}, given in place of strategy {strategy!r}'s)"
        if saved and not keeps_state:
            run = given if self._scheduler_given else f"strategy={strategy!r}"
            advice = "" if self._scheduler_given else ": resume with strategy 'infinite' to keep it"
            warnings.warn(f"the checkpoint's engine state holds its scheduler's state (the 'infinite' strategy keeps "
                          f"one); this run's {run} keeps none and drops it{advice}", stacklevel=3)
        elif keeps_state and not saved:
            fresh = f"{given} starts fresh" if self._scheduler_given else (
                f"strategy={strategy!r} starts its scheduler fresh")
            warnings.warn(f"the checkpoint's engine state holds no scheduler state (its strategy keeps none); this "
                          f"run's {fresh}", stacklevel=3)

    # ------------------------------------------------------------------------------- slot cache and step
    def _slots(self, num_slots: int, width: int, settings: StepSettings) -> tuple[SlotKVCache, DecodeStep, bool]:
        """The slot cache and decode step for a rollout, reused when they fit; True when newly built."""
        device, dtype = next(self.model.parameters()).device, kv_cache_dtype(self.model)
        width = aligned_width(width, row_alignment(device, settings.compile))
        if (self._cache is not None and self._cache.fits(num_slots, width, dtype, device)
                and self._step.settings == settings and self._step.model is self.model):
            return self._cache, self._step, False
        self.release()  # free the old cache before allocating the new one
        try:
            self._cache = SlotKVCache(self.model.config, num_slots, width, dtype, device)
        except torch.cuda.OutOfMemoryError as error:
            raise torch.cuda.OutOfMemoryError(self._cache_too_large(num_slots, width, dtype)) from error
        try:
            self._step = self._build_step(settings)
        except BaseException:
            self.release()  # no cache without its step: the next rollout starts from scratch
            raise
        return self._cache, self._step, True

    def _cache_too_large(self, num_slots: int, width: int, dtype: torch.dtype) -> str:
        gib = kv_row_bytes(self.model.config, dtype, width) * num_slots / 2**30
        if self.strategy == "full":
            fix = (f"strategy 'full' keeps all B x G = {num_slots} sequences alive: use 'continuous' or 'infinite' "
                   "with a micro_group_size (or micro_group_size: auto under kv_budget_bytes)")
        else:
            fix = (f"lower micro_group_size (now {num_slots} slots), or let micro_group_size: auto pick g under "
                   "kv_budget_bytes")
        return (f"out of memory allocating the rollout's slot cache: {num_slots} rows x {width} positions of KV "
                f"({gib:.2f} GiB in {str(dtype).removeprefix('torch.')}); {fix}; or lower max_new_tokens "
                f"(now {self.max_new_tokens}) or the prompt length")

    def _build_step(self, settings: StepSettings) -> DecodeStep:
        """The decode step, its first graph captured when ``settings.cuda_graph`` (later buckets' when first
        needed). A capture that fails raises when ``cuda_graph=True`` was asked for; when it was left automatic,
        the step warns once and runs without a graph from then on (compiled where it compiles without one), and so
        do the engine's later steps (``graph_failure``, ``compile_failure``;
        ``DecodeStep.capture_or_give_up_graphs``)."""
        step = DecodeStep(self.model, self._cache, settings, self.eos_token_ids,
                          graph_required=bool(self.config.cuda_graph))
        if settings.cuda_graph:
            step.capture_or_give_up_graphs()
        elif settings.compile:
            step.precompile()
        return step

    def _step_settings(self, forced: bool, replayed: bool, sharded: bool) -> StepSettings:
        """``forced``: some group has forced lengths; ``replayed``: recorded tokens (their lengths then need no
        forced EOS); ``sharded``: FSDP2 shards the policy."""
        device = next(self.model.parameters()).device
        graph = self.config.cuda_graph
        if graph is None:
            graph = _graphs_available(device) and not sharded and self.graph_failure is None
        elif graph and not _graphs_available(device):
            raise ValueError(f"cuda_graph=True needs a CUDA model; this one is on {device}")
        compiled = resolve_compile(self.config.compile, device, sharded) and self.compile_failure is None
        # Live-width buckets on CUDA only: on a CPU a row's rounding must not follow its neighbours' lengths
        # (decode_step's module doc).
        return StepSettings(temperature=float(self.temperature), top_k=self.top_k, top_p=float(self.top_p),
                            min_p=float(self.min_p), repetition_penalty=float(self.repetition_penalty),
                            force_lengths=forced and not replayed, force_tokens=replayed,
                            hidden_states=self.scheduler.probe_tokens is not None, cuda_graph=bool(graph),
                            compile=compiled,
                            live_width=device.type == "cuda", attention=self.config.decode_attention)

    # ------------------------------------------------------------------------------------------ validation
    def _prompt_ids(self, prompts) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError(f"prompts must be a non-empty list of strings or token-id lists, got "
                             f"{shown_value(prompts, 80)}")
        ids = []
        vocab = self.model.get_input_embeddings().num_embeddings
        limit = getattr(self.model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("string prompts need a tokenizer; pass token ids or a tokenizer")
                prompt = self.tokenizer(prompt)["input_ids"]
            elif hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1:  # a tensor or array of ids
                prompt = prompt.tolist()
            if isinstance(prompt, bytes) or not isinstance(prompt, Sequence):
                head = ", ".join(map(shown_value, list(prompts)[:5])) + (", ..." if len(prompts) > 5 else "")
                hint = f"; for one prompt of token ids pass [[{head}]]" if isinstance(prompt, Integral) else ""
                raise ValueError(f"prompt {i} is {shown_value(prompt, 60)}; each prompt is a string or a list of token "
                                 f"ids{hint}")
            # int() would take 1.7 as 1 and "5" as 5: a token id is an integer, nothing converted to one
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, Integral)]
            if bad:
                raise ValueError(f"prompt {i} has token ids that are not integers: {shown_value(bad[:5], 80)}; a "
                                 "prompt is a string or a list of ints")
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): "
                                 f"{shown_value([t for t in prompt if not 0 <= t < vocab][:5])}")
            if limit is not None and len(prompt) + self.max_new_tokens > limit:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={self.max_new_tokens} "
                                 f"that exceeds the model's max_position_embeddings={limit}")
            ids.append(prompt)
        return ids

    def _check_lengths(self, lengths, num_prompts: int) -> list[list[int]]:
        lengths = lengths.tolist() if hasattr(lengths, "tolist") else lengths  # a tensor or an array
        shape = _shape(lengths)
        if shape is None or len(shape) != num_prompts or any(n != self.group_size for n in shape):
            raise ValueError(f"lengths must be [B={num_prompts}][G={self.group_size}], got "
                             f"{shape if shape is not None else shown_value(lengths, 80)}")
        flat = [n for row in lengths for n in row]
        bad = [n for n in flat if isinstance(n, bool) or not isinstance(n, Integral)]
        if bad:
            raise ValueError(f"forced lengths must be integers, got {shown_value(bad[:5])}")
        if min(flat) < 1:
            raise ValueError(f"forced lengths must be >= 1, got {shown_value(min(flat))}")
        # a recorded length past the cap becomes cap + 1: EOS is suppressed up to the cap, which cuts the sample
        # there, truncated, as a live run would (EOS forced at the cap would end it untruncated)
        return [[min(int(n), self.max_new_tokens + 1) for n in row] for row in lengths]

    @staticmethod
    def _check_streams(streams, num_prompts: int) -> list[int]:
        """``streams`` as ``[B]`` distinct ints in [0, 2**32) (the key's width); a ValueError names what is wrong."""
        message = f"{shown_setting('streams', streams, 80)} must be [B={num_prompts}] ints in [0, 2**32)"
        streams = _int_list(streams, 2**32, message)
        if len(streams) != num_prompts:
            raise ValueError(message)
        if len(set(streams)) != num_prompts:
            raise ValueError(f"{shown_setting('streams', streams, 80)} repeat a value: two groups would draw the same "
                             "numbers")
        return streams

    def _check_tokens(self, tokens, num_prompts: int) -> list[list[list[int]]]:
        """``tokens`` as ``[B][G]`` int lists, each cut to ``max_new_tokens``; a ValueError names what is wrong."""
        shape = _shape(tokens)
        if shape is None or len(shape) != num_prompts or any(n != self.group_size for n in shape):
            raise ValueError(f"tokens must be [B={num_prompts}][G={self.group_size}] lists of token ids, got "
                             f"{shape if shape is not None else type(tokens).__name__}")
        vocab = min(self.model.get_input_embeddings().num_embeddings, vocab_size(self.model))
        eos = set(self.eos_token_ids)
        checked = []
        for p, group in enumerate(tokens):
            checked.append([])
            for k, row in enumerate(group):
                if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or not row:
                    raise ValueError(f"tokens[{p}][{k}] is {shown_value(row, 40)}; every replayed sample needs a "
                                     "non-empty list of token ids")
                for i, t in enumerate(row):
                    if isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < vocab:
                        raise ValueError(f"tokens[{p}][{k}][{i}] = {shown_value(t)} (prompt {p}, sample {k}); token "
                                         f"ids are ints in [0, {vocab})")
                    if t in eos and i < len(row) - 1:
                        raise ValueError(f"tokens[{p}][{k}][{i}] = {t} is a stop token {sorted(eos)} before the "
                                         f"end of its {len(row)} tokens; a sample ends at its first stop token")
                checked[p].append([int(t) for t in row[:self.max_new_tokens]])
        return checked


def _shape(rows) -> list[int] | None:
    """Lengths of the inner lists of a ``[B][G]`` nest (None when it is not one)."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        return None
    inner = [len(row) if isinstance(row, Sequence) and not isinstance(row, (str, bytes)) else None for row in rows]
    return None if None in inner else inner


def _check_stop_ids(ids: Any, vocab: int) -> list[int]:
    """``eos_token_ids`` as sorted distinct ints in [0, ``vocab``): the decode step marks them in a ``[vocab]`` mask,
    where -1 would mark the last token and a float or a string would fail deep inside torch."""
    message = f"{shown_setting('eos_token_ids', ids, 80)} must be a list of token ids, ints in [0, {vocab})"
    return sorted(set(_int_list(ids, vocab, message)))


def _int_list(values: Any, end: int, message: str) -> list[int]:
    """``values`` (a sequence, a tensor or an array) as a list of ints in [0, ``end``), else a ValueError with
    ``message``: a string, a mapping or a scalar would be read item by item, or fail inside ``len``."""
    values = values.tolist() if hasattr(values, "tolist") else values  # a 0-d tensor gives a scalar: refused below
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise ValueError(message)
    values = list(values)
    if any(isinstance(v, bool) or not isinstance(v, Integral) or not 0 <= v < end for v in values):
        raise ValueError(message)
    return [int(v) for v in values]


#: The methods the rollout loop calls on a scheduler (``lit_grpo.scheduling.Scheduler``'s), checked when an engine
#: is given one: duck-typed, so a wrapper that forwards them serves too.
SCHEDULER_METHODS = ("begin", "waiting", "admit", "waits", "probe", "preempt", "finish", "end")


def _default_scheduler(config: SamplingConfig) -> Scheduler:
    if config.strategy == "infinite":
        return config.scheduler.build()
    return RoundScheduler() if config.strategy == "micro" else Scheduler()


def _graphs_available(device: torch.device) -> bool:
    """CUDA graphs capture CUDA kernels only."""
    return device.type == "cuda"


def checked_rollout_index(state: Any) -> int:
    """The rollout index of an engine's ``state`` (``RolloutEngine.state_dict``'s), its keys checked, else a
    ValueError naming the bad key or value. The scheduler's state beside it is its scheduler's to check."""
    if not isinstance(state, Mapping) or "rollout_index" not in state:
        raise ValueError(f"{shown_setting('state', state, 80)} is not an engine's state_dict: it needs 'rollout_index'")
    check_state_keys("an engine state", state, ("rollout_index", "scheduler"), ("scheduler",))
    # the stream key holds 32 bits of it: a larger index would draw an earlier rollout's numbers again
    return check_int_in_range("rollout_index", state["rollout_index"], 0, 2**32 - 1)


def check_engine_state(state: Any, config: SamplingConfig) -> None:
    """Refuse ``state`` (``RolloutEngine.state_dict``'s) as ``load_state_dict`` of an engine of ``config`` would
    (a ValueError naming the bad key or value), without an engine: for the owner of a state kept until its engine is
    built, checked now and not at its first rollout. The scheduler's state is loaded into a scratch scheduler of the
    strategy, its warnings left to the load that takes it."""
    checked_rollout_index(state)
    # a copy: the config holds the caller's length predictor, the engine's to be, which only the load that takes
    # the state may change (a state refused after this check must leave it as it was)
    scheduler = copy.deepcopy(_default_scheduler(config))
    if "scheduler" in state and hasattr(scheduler, "load_state_dict"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scheduler.load_state_dict(state["scheduler"])


def stop_token_ids(model, tokenizer) -> list[int]:
    """The ids the engine stops on by default: the generation config's EOS ids and the tokenizer's EOS (an
    exported model's generation config is given the same, so it stops where the rollouts did)."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))
