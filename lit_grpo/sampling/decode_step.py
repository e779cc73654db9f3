"""The decode step (compute): one forward over every slot plus sampling, with the same shapes every step.

``DecodeStep`` is this engine's model runner (vLLM's name): it owns the static input buffers of a decode step and
the step itself, and on CUDA captures it once as a CUDA graph and replays it. It owns every per-row state of
the slots (a row's cached positions, its length, next input and random-stream key; the ``SlotKVCache`` is the
memory they live in; under a repetition penalty, the ids each row has seen), set through ``start_row`` /
``stop_row``; which sample runs in which row is the scheduler's business, and the loop's to tell it.

One step, all on the device, no host round trip until the end:

1. attention mask ``[slots, 1, 1, attended]`` from the rows' lengths (a row attends to its columns ``<= lengths``;
   ``attended``: see "Attended width" below); a model with sliding-window layers also gets, for those layers, the
   mask that hides the columns ``<= lengths - window`` (``kv_cache.AttentionLayout``), or where they hold a ring of
   ``window`` columns (``kv_cache``), the same mask's first ``window`` columns, and the ring's write columns
   (``lengths % window``, ``SlotKVCache.locate_writes``);
2. the model's forward with ``position_ids = lengths`` and the ``SlotKVCache``, which writes each row's new
   key/value at its own column; its attention is ``decode_attention``'s (``SamplingConfig.decode_attention``);
3. the optional repetition penalty on the ids each row has seen (its prompt and tokens so far, ``[slots, V]``
   bool), optional forced lengths (replay), the per-sample uniforms (``random_streams``, keyed on device tensors) and
   inverse-CDF sampling; in a token replay, the row's recorded token at its token index replaces the draw (the
   rows' recorded tokens wait in a static ``[slots, width]`` buffer written by ``start_row``);
4. the advance: the sampled token becomes the row's next input (and one of the ids it has seen), running rows'
   lengths and token counts grow by 1.

Then ``step`` copies the tokens, their log-probs and, when asked, some rows' last hidden states to the host with
one synchronisation: the engine must learn which rows ended before it refills them. Idle rows run too (the
shapes never change); they sit at length 0, write into their own column 0 and are ignored.

With ``compile`` the step runs as ``torch.compile`` fused it (fewer, larger kernels: what a step of a few rows
spends most of its time launching), and that is what the graph captures.

Attended width. With ``live_width`` (on CUDA) a step attends ``[0, bucket)``: the smallest of a few
``width_buckets`` that holds the longest live row and its new column. The host knows every row's length (set by
``start_row``, grown by one per step), so picking the bucket needs no device read. Each bucket has its own CUDA
graph, captured the first time it is needed and kept while the step lives (all in one memory pool), and its own
compilation: a handful per step, under torch._dynamo's recompile limit. Without it (on a CPU, eager or compiled)
a step attends the rollout's fixed width: a row's result must not depend on how wide its neighbours make the step,
or strategies of the same g would stop being bit-identical, and a reduction over more (masked) columns may be
blocked, and so rounded, differently. On CUDA a row's attention may then round differently from one schedule to
another (its bucket follows the longest live row); the graphs and compiled code stay those of a few shapes.

A graph is captured while the rows hold whatever runs: the warm-up forwards before it advance the rows, so their
state (lengths, token indices, next inputs) is put back after; the keys and values they wrote sit at each row's
next column, which the replayed step writes again before it reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import shutil
import time
import types
import warnings
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

from lit_grpo.runtime.head_precision import computes_in_float32
from lit_grpo.runtime.models import cache_keyword
from lit_grpo.runtime.validation import shown_setting
from lit_grpo.sampling.decode_attention import step_attention
from lit_grpo.sampling.devices import indexed_device
from lit_grpo.sampling.kv_cache import KV, SlotKVCache
from lit_grpo.sampling.memory_budget import cast_pool_bytes
from lit_grpo.sampling.random_streams import stream_uniforms
from lit_grpo.sampling.token_sampler import force_lengths, penalize_repetitions, replay_tokens, sample_tokens

#: Eager forwards before a capture, so lazy initialisations (cuBLAS handles and workspaces, autocast state) happen
#: outside the graph: two before the first capture on a device, one before later ones (those are process-wide).
WARMUP_STEPS = 2
_warmed_up_devices: set[torch.device] = set()

#: Most buckets per step: each is a CUDA graph and a compilation, and torch._dynamo recompiles a function at most
#: 8 times (its recompile limit) before it falls back to eager.
MAX_BUCKETS = 6
#: The narrowest bucket: attending fewer columns saves next to nothing (and keeps rows aligned).
MIN_BUCKET = 64


def width_buckets(width: int, count: int = MAX_BUCKETS, smallest: int = MIN_BUCKET) -> tuple[int, ...]:
    """The attended widths of a step over a cache ``width`` columns wide, ascending: the largest ``count - 1``
    powers of two from ``smallest`` up to two thirds of ``width`` (a bucket barely narrower than the cache saves
    too little to be worth a graph), then ``width`` itself; ``(width,)`` when no power fits. Powers of two are the
    same for every cache, so the ladder is a function of the width alone, a handful of widths however wide."""
    for name, value in (("width", width), ("count", count), ("smallest", smallest)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"width_buckets: {shown_setting(name, value)} must be an integer >= 1")
    powers = []
    power = 1 << (smallest - 1).bit_length()  # the smallest power of two >= smallest
    while 3 * power <= 2 * width:
        powers.append(power)
        power *= 2
    kept = powers[max(len(powers) - (count - 1), 0):] if count > 1 else []
    return (*kept, width)


def bucket_for(buckets: Sequence[int], columns: int) -> int:
    """The smallest of ``buckets`` (ascending) that holds ``columns`` columns."""
    for bucket in buckets:
        if bucket >= columns:
            return bucket
    raise ValueError(f"{columns} columns do not fit the widest bucket {buckets[-1]} (buckets {list(buckets)})")


@dataclass(frozen=True)
class StepSettings:
    """What a built decode step bakes in (a captured graph cannot change them).

    Attributes:
        temperature, top_k, top_p, min_p: sampling (temperature 0: greedy).
        repetition_penalty: ``SamplingConfig.repetition_penalty``; 1.0 builds a step without it (no seen ids kept,
            nothing more per step).
        force_lengths: replay recorded lengths (``RolloutEngine.generate(lengths=...)``).
        force_tokens: replay recorded tokens (``RolloutEngine.generate(tokens=...)``). Their lengths end the
            samples (the loop ends a sample at its last recorded token), so no EOS is forced and each token's
            log-prob is the free run's; hence not with ``force_lengths``.
        hidden_states: also keep each row's last hidden state (for a length predictor's checkpoint).
        cuda_graph: capture and replay a CUDA graph (CUDA only), one per attended width.
        compile: run the step compiled by ``torch.compile`` (``resolve_compile``); with ``cuda_graph`` the compiled
            step is what the graph captures.
        live_width: attend the bucket of the longest live row (``width_buckets``) rather than the rollout's fixed
            width (module doc: why on CUDA only, by default).
        attention: the decode attention kernel (``SamplingConfig.decode_attention``).
    """

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    force_lengths: bool
    hidden_states: bool
    cuda_graph: bool
    compile: bool = False
    force_tokens: bool = False
    live_width: bool = False
    attention: str = "matmul"
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if self.force_lengths and self.force_tokens:
            raise ValueError("StepSettings: force_lengths and force_tokens are exclusive (a token replay's lengths "
                             "are its tokens'; forcing EOS would change the log-probs it reports)")


@dataclass
class StepOutput:
    """What one decode step returns to the host: ``tokens[s]`` and ``logprobs[s]`` for every slot ``s`` (idle ones
    included, to be ignored) and ``hidden[i]``, the float32 last hidden state of the i-th requested slot."""

    tokens: list[int]
    logprobs: list[float]
    hidden: torch.Tensor | None


def check_finite_logits(logprobs: list[float], live_slots: Iterable[int]) -> None:
    """Raise, naming the slots, where a live row's log-prob is NaN: its logits were not finite, so the token it
    drew means nothing (idle rows are not checked: they compute on stale inputs)."""
    broken = [slot for slot in live_slots if math.isnan(logprobs[slot])]
    if broken:
        raise FloatingPointError(
            f"the policy's next-token logits are NaN or inf in {len(broken)} decoding rows (slots {broken[:8]}): "
            "its weights have diverged or its forward overflows; lower model.lr, set model.max_grad_norm, or run "
            "in float32 or bfloat16 rather than float16")


class DecodeStep:
    """A decode step over all slots of a ``SlotKVCache``, built once per (cache, settings).

    Args:
        model: the causal LM (called unmodified, with the cache as its ``cache_keyword``).
        cache: the slot cache the step reads and writes.
        settings: see ``StepSettings``.
        eos_token_ids: stop tokens (for forced lengths).
        graph_required: a failed capture raises instead of falling back to the eager step.

    With ``settings.force_tokens`` the rows' recorded tokens live in ``forced_tokens``, ``[slots, width]`` int64:
    a row holds ``P - 1 + L`` positions of the cache's ``width``, so its L tokens always fit. With a
    ``settings.repetition_penalty`` the ids each row has seen live in ``seen``, ``[slots, V]`` bool.
    """

    def __init__(self, model: torch.nn.Module, cache: SlotKVCache, settings: StepSettings,
                 eos_token_ids: list[int], graph_required: bool = False):
        device = cache.lengths.device
        slots, width = cache.num_slots, cache.width
        self.model, self.cache, self.settings = model, cache, settings
        #: A capture that fails raises (True: ``cuda_graph=True`` was asked for) or gives graphs up, saying why in
        #: ``graph_failure`` (``capture_or_give_up_graphs``).
        self.graph_required = graph_required
        self.graph_failure: str | None = None
        #: Why the compiled step was given up, after a failed capture, where it failed to compile without a graph.
        self.compile_failure: str | None = None
        self.cache_keyword = cache_keyword(model)
        self.device = device
        long = dict(dtype=torch.long, device=device)
        # Static inputs: a graph replay reads these very tensors, so they are only ever updated in place.
        self.input_ids = torch.zeros(slots, 1, **long)
        self.active = torch.zeros(slots, **long)          # 1 where a sample runs
        self.stream_rollout = torch.zeros(slots, **long)  # random-stream key of each row's sample ...
        self.prompt_index = torch.zeros(slots, **long)
        self.sample_index = torch.zeros(slots, **long)
        self.token_index = torch.zeros(slots, **long)     # ... and of its next token
        self.forced_length = torch.zeros(slots, **long)   # replay: the sample's recorded length (0: free)
        self.forced_tokens = torch.zeros(slots, width, **long) if settings.force_tokens else None
        self.seen = None
        if row_state_bytes(model, settings.repetition_penalty):
            self.seen = torch.zeros(slots, vocab_size(model), dtype=torch.bool, device=device)
        self.seed = torch.zeros((), **long)
        self.columns = torch.arange(width, **long)
        self.is_eos = torch.zeros(vocab_size(model), dtype=torch.bool, device=device)
        self.is_eos[torch.tensor(eos_token_ids, device=device)] = True
        self.mask_value = torch.finfo(cache.layers[0].dtype).min
        # Static outputs (written by the step).
        self.tokens = torch.zeros(slots, **long)
        self.logprobs = torch.zeros(slots, dtype=torch.float32, device=device)
        self.hidden: torch.Tensor | None = None
        if settings.hidden_states:
            hidden_size = model.config.get_text_config(decoder=True).hidden_size
            self.hidden = torch.zeros(slots, hidden_size, dtype=torch.float32, device=device)
        #: Attended widths a step may pick (``width_buckets``; only the cache's width without ``live_width``).
        self.buckets = width_buckets(width) if settings.live_width else (width,)
        #: The captured graph of each attended width, captured when first needed, sharing one memory pool.
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_pool = None
        #: Bytes the captured graphs' pool holds for the weight casts their steps make (``cast_pool_bytes`` of
        #: ``weight_cast_sizes`` under each capture's autocast; 0 where every weight is in the dtype it computes in).
        self.graph_cast_bytes = 0
        #: The attended widths the compiled step has run at: one compilation each.
        self.compiled_widths: set[int] = set()
        # The host's copy of each running row's cached positions (cache.lengths), so a step's bucket needs no
        # device read: set by start_row, grown by one per step, dropped by stop_row.
        self.live_lengths: dict[int, int] = {}
        # The class's function, not the bound method: storing a bound method on self would make a reference cycle
        # that keeps the cache and the graph's memory alive after the engine lets go of the step. The first
        # torch.compile of a process loads the compiler, which is part of what compiling costs.
        started = time.perf_counter()
        shape = (slots, width, cache.layers[0].dtype, device, settings)
        self._compiled_run = compiled_step(DecodeStep._run, shape) if settings.compile else None
        if settings.compile and settings.hidden_states:
            self._install_output_hooks()
        self.capture_s = time.perf_counter() - started if settings.compile else 0.0

    def _install_output_hooks(self) -> None:
        """One eager step asking for hidden states (the rows kept): transformers installs the hooks that collect
        them on a model's first forward that asks, under a lock torch.compile cannot trace. Met inside the compiled
        step, that lock breaks its graph, and the model's frames are then compiled one by one (each layer's
        attention apart, guarded on its layer index, past the recompile limit on a deep model)."""
        with self.rows_kept(), step_attention(self.model, self.settings.attention):
            self._run(hidden_states=True)

    # ------------------------------------------------------------------------------------------ host side
    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """A captured graph of this step (None: it runs eagerly or compiled, without graphs)."""
        return next(iter(self.graphs.values()), None)

    def start_rollout(self, seed: int, width: int) -> None:
        """Key the random streams of the next rollout. Without ``live_width``, attend the rollout's own ``width``
        columns (its longest prompt - 1 + ``max_new_tokens``), however wide an earlier rollout left the cache
        (``kv_cache.py`` says why), or the cache's whole width when the step is captured or compiled (once, for
        that width); with ``live_width`` each step picks its bucket."""
        self.seed.fill_(seed)
        if not self.settings.live_width:
            fixed = self.settings.cuda_graph or self._compiled_run is not None
            self.cache.attend(self.cache.width if fixed else width)

    def live_bucket(self) -> int:
        """The width the next step attends under ``live_width``: the bucket holding the longest running row and
        the column it writes (a row of n cached positions attends n + 1 columns)."""
        return bucket_for(self.buckets, max(self.live_lengths.values(), default=0) + 1)

    def start_row(self, slot: int, kv: Sequence[KV | None], *, stream: tuple[int, int], sample: int,
                  generated: int, next_input: int, forced_length: int = 0,
                  forced_tokens: Sequence[int] | None = None, seen: Sequence[Sequence[int]] = (),
                  positions: Sequence[int] | None = None) -> None:
        """Run a sample in ``slot``: its cached positions are the ``kv`` parts in order (the prompt's prefix, then
        a resumed sample's tail), ``positions[i]`` of them in part i (``SlotKVCache.write_row``: a sliding layer's
        piece may hold only its last window of them; None: each part's layers hold all); it has generated
        ``generated`` tokens and feeds ``next_input`` next. ``stream`` = (rollout, prompt) keys its random stream
        with ``sample``. A replayed sample has its recorded length
        (``forced_length``) and, in a token replay, all its recorded tokens (``forced_tokens``, from the first: it
        emits token ``generated`` next). ``seen``: the sample's ids so far in parts (its prompt's, then the tokens
        it generated, a resumed sample's included), which the repetition penalty penalizes; read only under one."""
        if forced_tokens is not None:
            self._write_forced_tokens(slot, forced_tokens, forced_length)
        if self.seen is not None:
            self._write_seen(slot, seen)
        length = 0
        for index, part in enumerate(kv):
            length += self.cache.write_row(slot, length, part, None if positions is None else positions[index])
        self.stream_rollout[slot], self.prompt_index[slot] = stream
        self.sample_index[slot], self.token_index[slot] = sample, generated
        self.input_ids[slot, 0], self.forced_length[slot] = next_input, forced_length
        self.cache.lengths[slot] = length
        self.active[slot] = 1
        self.live_lengths[slot] = length

    def _write_forced_tokens(self, slot: int, tokens: Sequence[int], forced_length: int) -> None:
        """Row ``slot``'s recorded tokens, zero-padded to the buffer's width."""
        if self.forced_tokens is None:
            raise RuntimeError("this decode step was built without force_tokens=True; it replays no tokens")
        width = self.forced_tokens.shape[1]
        if not 0 < forced_length <= min(len(tokens), width):
            raise ValueError(f"a token replay's row needs 0 < forced_length <= min(recorded tokens, row width): "
                             f"got forced_length={forced_length} for {len(tokens)} tokens, width {width}")
        row = torch.zeros(width, dtype=torch.long)
        row[:forced_length] = torch.as_tensor(list(tokens[:forced_length]), dtype=torch.long)
        self.forced_tokens[slot].copy_(row, non_blocking=True)  # a pageable source is staged at once: no wait

    def _write_seen(self, slot: int, parts: Sequence[Sequence[int]]) -> None:
        """Row ``slot``'s seen ids: those in ``parts``, less any the output head has no logit for (transformers
        drops them too)."""
        vocab = self.seen.shape[1]
        ids = [t for part in parts for t in part if t < vocab]
        if not ids:
            raise ValueError("a row under a repetition penalty needs the ids it has seen (its prompt's at least)")
        row = self.seen[slot]
        row.zero_()
        row[torch.tensor(ids).to(self.device, non_blocking=True)] = True  # staged at once, without a wait

    def read_row(self, slot: int, start: int, stop: int) -> KV:
        """A copy of the row's positions ``[start, stop)`` (a parked sample's tail; ``stop`` the row's length: a
        ring layer's piece holds the last window of them, ``SlotKVCache.read_row``).

        Raises:
            ValueError: ``stop`` is not the row's length where the cache has ring layers (they no longer hold the
                positions before it: their columns hold later ones).
        """
        length = self.live_lengths.get(slot)
        if self.cache.ring_width is not None and stop != length:
            raise ValueError(f"row {slot} holds {length} positions: a span of it up to {stop} cannot be read, as its "
                             f"sliding layers hold a ring of their last {self.cache.ring_width} positions, read up "
                             "to its length")
        return self.cache.read_row(slot, start, stop)

    def stop_row(self, slot: int) -> None:
        """Leave ``slot`` idle: length 0, so its writes land in column 0 and nothing of it is read."""
        self.active[slot] = 0
        self.cache.lengths[slot] = 0
        self.live_lengths.pop(slot, None)

    def stop_all(self) -> None:
        """Leave every slot idle (``stop_row`` of each)."""
        self.active.zero_()
        self.cache.lengths.zero_()
        self.live_lengths.clear()

    def prepare(self) -> None:
        """Attend the next step's width (under ``live_width``, its bucket) and, the first time the step attends it,
        capture its graph or compile it (the rows kept), counted in ``capture_s``. ``step`` calls it too; a caller
        that times steps calls it first, so that a step's time is the step's alone."""
        if self.settings.live_width:
            self.cache.attend(self.live_bucket())
        width = self.cache.attended
        if self.settings.cuda_graph and width not in self.graphs:
            self.capture_or_give_up_graphs()
        elif not self.settings.cuda_graph and self._compiled_run is not None and width not in self.compiled_widths:
            self.precompile()

    def step(self, hidden_slots: list[int]) -> StepOutput:
        """Run one decode step and bring its results to the host (one synchronisation).

        Raises:
            FloatingPointError: a decoding row's logits were NaN or inf (``check_finite_logits``).
        """
        self.prepare()
        if self.settings.cuda_graph:
            self.graphs[self.cache.attended].replay()
        else:
            self._forward(hidden_states=bool(hidden_slots))
        for slot in self.live_lengths:
            self.live_lengths[slot] += 1
        non_blocking = self.device.type == "cuda"  # device-to-host copies into pinned memory, then one sync
        tokens = self.tokens.to("cpu", non_blocking=non_blocking)
        logprobs = self.logprobs.to("cpu", non_blocking=non_blocking)
        hidden = None
        if hidden_slots:  # all rows come over (one small copy): indexing on the device needs the index there first
            if not self.settings.hidden_states:
                raise RuntimeError("this decode step was built without hidden_states=True")
            hidden = self.hidden.to("cpu", non_blocking=non_blocking)
        if non_blocking:
            torch.cuda.current_stream(self.device).synchronize()
        output = StepOutput(tokens.tolist(), logprobs.tolist(), None if hidden is None else hidden[hidden_slots])
        check_finite_logits(output.logprobs, self.live_lengths)
        return output

    # ------------------------------------------------------------------------------------------ device side
    def _forward(self, hidden_states: bool = True) -> None:
        """The step, compiled where it was built so, its attention the settings' decode kernel. Eager, it leaves the
        hidden states out unless ``hidden_states``: asking the model for them costs time on every step, and a row
        is probed on one step of its whole run. A compiled step, like a captured graph, has one shape per attended
        width and computes them every step."""
        with step_attention(self.model, self.settings.attention):
            if self._compiled_run is not None:
                self._compiled_run(self)
                self.compiled_widths.add(self.cache.attended)
            else:
                self._run(hidden_states)

    def _run(self, hidden_states: bool = True) -> None:
        """The step itself: forward, sampling, advance. Captured as is into the CUDA graph. ``hidden_states=False``
        leaves ``hidden`` as it was, even when the settings keep it."""
        settings, cache = self.settings, self.cache
        lengths = cache.lengths
        hidden_states = hidden_states and settings.hidden_states
        columns = self.columns[:cache.attended].unsqueeze(0)                                 # [1, attended]
        admitted = columns <= lengths.unsqueeze(1)                                          # [slots, attended]
        mask = self._additive(admitted)
        cache.locate_writes()  # the ring layers' write columns, from the same lengths
        window = cache.layout.sliding_window
        if cache.ring_width is None:  # sliding layers (if any) also hide the columns outside the window
            sliding = lambda: self._additive(admitted & (columns > (lengths - window).unsqueeze(1)))  # noqa: E731
        else:  # a ring holds the window alone: its columns up to the length, all once the ring is full
            sliding = lambda: mask[..., :cache.ring_attended]  # noqa: E731
        masks = cache.layout.mask_argument(mask, sliding)
        out = self.model(input_ids=self.input_ids, attention_mask=masks, position_ids=lengths.unsqueeze(1),
                         **{self.cache_keyword: self.cache}, use_cache=True, logits_to_keep=1,
                         output_hidden_states=hidden_states)
        logits = out.logits[:, -1]
        if self.seen is not None:
            logits = penalize_repetitions(logits, self.seen, settings.repetition_penalty)
        if settings.force_lengths:
            logits = force_lengths(logits, self.token_index, self.forced_length, self.is_eos)
        uniforms = stream_uniforms(self.seed, self.stream_rollout, self.prompt_index, self.sample_index,
                                   self.token_index)
        if settings.force_tokens:
            tokens, logprobs = self._replay(logits, uniforms)
        else:
            tokens, logprobs = sample_tokens(logits, uniforms, settings.temperature, settings.top_k, settings.top_p,
                                             settings.min_p)
        self.tokens.copy_(tokens)
        self.logprobs.copy_(logprobs)
        if self.seen is not None:  # a running row has seen its token; an idle one (every row in a warm-up) has not
            index = tokens.unsqueeze(1)                                                      # [slots, 1]
            self.seen.scatter_(1, index, self.seen.gather(1, index) | self.active.bool().unsqueeze(1))
        if hidden_states:
            self.hidden.copy_(out.hidden_states[-1][:, -1])
        self.input_ids.copy_(tokens.unsqueeze(1))
        lengths.add_(self.active)
        self.token_index.add_(self.active)

    def _additive(self, admitted: torch.Tensor) -> torch.Tensor:
        """The additive mask ``[slots, 1, 1, attended]`` (0, or the cache dtype's lowest) of ``admitted`` columns."""
        mask = torch.zeros(admitted.shape, dtype=self.cache.layers[0].dtype, device=self.device)
        return mask.masked_fill(~admitted, self.mask_value)[:, None, None, :]

    def _replay(self, logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[slots]`` and log-probs ``[slots]`` of a token replay: each replayed row's recorded token at its
        token index. Idle rows' indices may sit one past their last token: clamped, as they are ignored anyway."""
        settings = self.settings
        index = self.token_index.clamp(max=self.forced_tokens.shape[1] - 1).unsqueeze(1)     # [slots, 1]
        forced = self.forced_tokens.gather(1, index).squeeze(1)                              # [slots]
        return replay_tokens(logits, uniforms, forced, self.forced_length > 0, settings.temperature,
                             settings.top_k, settings.top_p, settings.min_p)

    def capture(self) -> None:
        """Warm up on a side stream, then capture ``_run`` at the attended width into a CUDA graph (the rows' state
        is put back after the warm-up, see module doc); ``step`` replays it whenever it attends that width.
        ``capture_s`` counts the time (with the compilation), also when the capture fails."""
        if not self.settings.cuda_graph:
            raise RuntimeError("this decode step was built with cuda_graph=False; it runs eagerly")
        started = time.perf_counter()
        try:
            self._capture()
        finally:
            self.capture_s += time.perf_counter() - started

    def capture_or_give_up_graphs(self) -> None:
        """``capture``, and where that fails (a model whose forward reads a device value on the host, an op CUDA
        graphs do not support): raise when the graph was required (``graph_required``), else warn once, give the
        graphs up and run without them from then on (``graph_failure`` says why). A compiled step is first compiled in
        the capture's warm-up, so the failure may be the compiler's: it is compiled again without a graph, and
        where that fails too, given up (``compile_failure``). Running out of memory is no reason to give graphs
        up: it is raised as it is."""
        try:
            self.capture()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as error:
            reason = f"{type(error).__name__}: {error}"
            name = type(self.model).__name__
            if self.graph_required:
                raise RuntimeError(f"cuda_graph=True, but capturing the decode step of {name} as a CUDA graph failed "
                                   f"({reason}); leave cuda_graph unset to fall back to the eager step, or set it to "
                                   "False") from error
            self.graph_failure = reason
            warnings.warn(f"capturing the decode step of {name} as a CUDA graph failed ({reason}); this engine runs "
                          "it without a graph from now on (same results, more time per step). Set cuda_graph=False "
                          "to skip the attempt.", RuntimeWarning, stacklevel=2)
            self.give_up_graphs()
            if self._compiled_run is not None:
                self._compile_or_run_uncompiled()

    def _compile_or_run_uncompiled(self) -> None:
        """``precompile`` after graphs were given up; where that fails too (not for want of memory), warn and run
        the step uncompiled from then on (``compile_failure`` says why)."""
        try:
            self.precompile()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as error:
            self.compile_failure = f"{type(error).__name__}: {error}"
            warnings.warn(f"compiling the decode step of {type(self.model).__name__} failed "
                          f"({self.compile_failure}); this engine runs it uncompiled from now on (same results, "
                          "more time per step). Set compile=False to skip the attempt.", RuntimeWarning, stacklevel=3)
            self._compiled_run = None
            self.settings = dataclasses.replace(self.settings, compile=False)

    def precompile(self) -> None:
        """Without a graph: run the compiled step once at the width the next step attends (the rows kept), so that
        compilation (paid once per step shape, attended width and process) is counted in ``capture_s`` rather than
        in a decode step's time. Built, the step compiles its first width; ``prepare`` each later bucket's."""
        started = time.perf_counter()
        try:
            if self.settings.live_width:
                self.cache.attend(self.live_bucket())
            with self.rows_kept():
                self._forward()
        finally:
            self.capture_s += time.perf_counter() - started

    def give_up_graphs(self) -> None:
        """Give up the graphs (a capture failed): the same step, without a graph from now on."""
        self.graphs.clear()
        self.settings = dataclasses.replace(self.settings, cuda_graph=False)

    @contextlib.contextmanager
    def rows_kept(self):
        """Within the block, steps run (warm-ups, a compilation) without advancing the rows: every row counts as
        idle, so no length grows (a row one column short of the cache's width is never written past it) and no
        row's seen ids change, and the rows' lengths, token indices, next inputs and activity are put back after.
        The keys and values those steps wrote sit at each row's next column, which the next real step writes again
        before it reads it."""
        state = (self.cache.lengths, self.token_index, self.input_ids, self.active)
        saved = [tensor.clone() for tensor in state]
        self.active.zero_()
        try:
            yield
        finally:
            for tensor, kept in zip(state, saved):
                tensor.copy_(kept)

    def _capture(self) -> None:
        if self.settings.live_width:
            self.cache.attend(self.live_bucket())
        stream, previous = _side_stream(self.device), torch.cuda.current_stream(self.device)
        # The warm-ups run under the capture's autocast: a compiled step guards on autocast's cache flag, and
        # would otherwise compile again inside the capture, where compiling cannot run.
        with self.rows_kept(), _graph_safe_autocast():
            stream.wait_stream(previous)  # after the rows' state is saved
            with torch.cuda.stream(stream):
                for _ in range(1 if self.device in _warmed_up_devices else WARMUP_STEPS):
                    self._forward()
            _warmed_up_devices.add(self.device)
            previous.wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        casts = cast_pool_bytes(weight_cast_sizes(self.model, self.device.type))
        graph = torch.cuda.CUDAGraph()
        began, broke = False, []
        try:
            # on the step's own stream: torch's default capture stream is made once, on the device current then,
            # and a model on another device would run its kernels outside the capture
            with _graph_safe_autocast(), torch.cuda.graph(graph, pool=self._graph_pool, stream=stream):
                began = True
                try:
                    self._forward()
                except Exception as error:
                    broke.append(error)
                    raise
        except Exception as error:
            _end_failed_capture(graph, self.device, previous, self._graph_pool, began)
            if not self.graphs:  # no graph holds the pool now: torch refuses to share a pool nobody holds
                self._graph_pool = None
            # An op that breaks the capture makes ending it fail too; that second error would hide the first.
            if broke and error is not broke[0]:
                raise broke[0] from None
            raise
        self.graphs[self.cache.attended] = graph
        self.graph_cast_bytes = max(self.graph_cast_bytes, casts)


@functools.cache
def compiled_step(run: Callable, shape: Hashable) -> Callable:
    """``run`` (``DecodeStep._run``) compiled with static shapes, as a function of its own for each step ``shape``.

    Why a copy of its code per shape: torch._dynamo keeps compiled versions per code object and recompiles one at
    most ``recompile_limit`` (8) times, then runs it uncompiled. A step compiles once per bucket, and its guards
    hold the slot cache's whole shape, so a process that builds steps of several shapes (a new cache width or slot
    count per rollout) would soon spend one code object's budget. Each shape's own code object has at most
    ``MAX_BUCKETS`` versions; steps of one shape share them."""
    code = run.__code__.replace()  # an equal but distinct code object
    own = types.FunctionType(code, run.__globals__, run.__name__, run.__defaults__, run.__closure__)
    return torch.compile(own, dynamic=False)


def row_state_bytes(model: torch.nn.Module, repetition_penalty: float) -> int:
    """Bytes a step's row holds besides its KV and a few scalars: under a repetition penalty its seen ids, one
    bool per vocabulary entry; else 0."""
    return vocab_size(model) if repetition_penalty != 1.0 else 0


def weight_cast_sizes(model: torch.nn.Module, device_type: str) -> list[int]:
    """Bytes of each weight cast a forward of ``model`` makes on ``device_type`` as things stand (autocast on or
    off), in the modules' order: under autocast each ``nn.Linear`` whose weight or bias is not in the autocast dtype
    (the policy's own float32 weights, where no ``CastWeights`` copy stands in) has them cast at every call; a
    float32 head (``cast_lm_head_to_fp32``) casts only a weight narrower than float32, to float32. Each cast is freed
    after its call; captured, it takes its block in the graphs' pool (``memory_budget.cast_pool_bytes``)."""
    autocast = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else None
    sizes = []
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        params = [p for p in (module.weight, module.bias) if p is not None and p.is_floating_point()]
        if computes_in_float32(module):
            sizes.append(sum(p.numel() * 4 for p in params if p.element_size() < 4))
        elif autocast:
            sizes.append(sum(p.numel() * dtype.itemsize for p in params if p.dtype != dtype))
    return sizes


def vocab_size(model: torch.nn.Module) -> int:
    """Width of the logits: the output head's rows (the config's vocab_size when the head is not reachable)."""
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.get_text_config(decoder=True).vocab_size


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a device's warm-ups and captures run on: one per device, as each stream holds its own cuBLAS
    workspace, which is never freed."""
    return torch.cuda.Stream(device)


def _end_failed_capture(graph: torch.cuda.CUDAGraph, device: torch.device, previous: torch.cuda.Stream, pool,
                        began: bool) -> None:
    """Undo what ``torch.cuda.graph`` leaves behind when a capture fails: its exit raises before it restores the
    current stream (the process would go on running on the capture stream); the allocator may still route
    allocations to the pool (which keeps ``empty_cache`` from freeing cached blocks); and the capture's hold on
    the pool, taken when it began, is dropped only by a graph whose capture ended. The pool is shared by the
    step's graphs of every bucket: a hold left behind would keep all their memory for the life of the process.
    ``began``: the capture's block was entered (its hold was taken)."""
    torch.cuda.set_stream(previous)
    index = indexed_device(device).index
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
        routed = True
    except (RuntimeError, AttributeError):  # already ended where torch ends it first, or never begun
        routed = False
    try:
        graph.pool()  # raises unless the capture ended: then the graph drops its hold itself when it is freed
        return
    except RuntimeError:
        pass
    if began or routed:
        with contextlib.suppress(AttributeError):  # a torch without the binding; its assert on a count is raised
            torch._C._cuda_releasePool(index, pool)


def _graph_safe_autocast():
    """Autocast's weight-cast cache must be off inside a captured graph (its cached casts would be freed after the
    capture while the graph still reads them); the casts are then recorded in the graph and rerun each replay."""
    if torch.is_autocast_enabled("cuda"):
        return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
    return contextlib.nullcontext()


_warned_compilers: set[str] = set()


@functools.cache
def compiler_problem(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot build kernels for ``device_type`` here (None: it can): Inductor writes Triton
    kernels for CUDA and C++ for the CPU. Asked once per process and device type (every rollout resolves it)."""
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed"
    if device_type == "cpu":
        found = any(shutil.which(name) for name in ("g++", "c++", "clang++"))
        return None if found else "no C++ compiler (g++, c++ or clang++) on PATH"
    return f"the step is not compiled on {device_type}"


def resolve_compile(setting: bool | str, device: torch.device, sharded: bool) -> bool:
    """Whether the decode step is compiled: ``setting`` is ``SamplingConfig.compile``. "auto" compiles on CUDA only
    (where the fused step pays); True compiles wherever a compiler is present and otherwise warns once and runs
    eagerly."""
    if setting is False:
        return False
    problem = compiler_problem(device.type)
    if setting == "auto":
        return device.type == "cuda" and problem is None and not sharded
    if problem is not None:
        if problem not in _warned_compilers:
            _warned_compilers.add(problem)
            warnings.warn(f"sampling.compile=True, but the decode step cannot be compiled here ({problem}); it runs "
                          "eagerly (same results, more time per step)", RuntimeWarning, stacklevel=3)
        return False
    return True
