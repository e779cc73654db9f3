"""KV memory of the rollout: a static slot cache that the model writes into, the prefixes and parked tails held
beside it, byte accounting.

``SlotKVCache`` is a transformers ``Cache``: the model's attention layers call its ``update`` unmodified. Per layer
it holds keys and values of shape ``[slots, kv_heads, width, head_dim]``, allocated once and never reallocated by a
decode step, a refill or a removal. Row ``s`` belongs to whichever sample runs in slot ``s``; its positions sit in
columns ``[0, lengths[s])``. Keys are cached after the rotary embedding, so a column only needs to be admitted by
the attention mask, not to sit at its position's index; in a full-attention layer column = position id, which keeps
the mask a plain comparison (``column <= lengths[s]``).

A sliding-window layer (Gemma 3's five in six, Mistral's) whose window W is narrower than the cache's width holds a
ring of W columns per row instead: position p sits in column ``p % W``. Once a decode step has written position p
the ring holds positions p - W + 1 .. p, exactly what a query at p attends (transformers' rule, q - W < k <= q), so
its mask is the same comparison over its W columns (``column <= lengths[s]``: all of them once the row is W - 1
long), and its memory is W columns, not the width. Where the window holds the whole row (width <= W), and in a
model without sliding layers, every layer is as wide as the cache, column = position, and the masks are positional
(a sliding layer's then also hides ``column <= lengths[s] - W``, ``attention_layout``). The ring reorders a
sliding layer's columns, so its softmax sums them in another order than a positional layout would: the same
tokens and log-probs to rounding, not bit for bit.

A decode step writes every row's new key/value at that row's own column (one ``index_put_`` per layer, no host
round trip): ``lengths[s]``, or in a ring layer ``ring_columns[s] = lengths[s] % W``, which the step computes on
the device before its forward (``locate_writes``), so a compiled step or a captured graph replays it. It attends
over the cache's first ``attended`` columns (``attend``: the rollout's own width, the whole width when the step is
compiled on a CPU, or, on CUDA, the bucket of the longest live row, see ``decode_step``; a ring layer at most its
W); the mask hides what another sample left behind in the row's later columns (stale but finite values,
multiplied by an exact zero). Refilling a slot writes a prompt's cached prefix (and, for a resumed sample, its
parked tail) into the row in place; removing a sample just stops using the row. So every step of a rollout has
one of a few shapes, which is what CUDA graphs need, and on a CPU a row's arithmetic never depends on its
neighbours, which is what makes every schedule return the same completions.

The pieces of a row held outside the cache (prefixes, parked tails: single-row KVs) follow one rule,
``kept_positions``: each layer's piece holds the *last* positions of its span, all of them in a full-attention
layer, at most the last W in a ring layer (``SlotKVCache.piece_windows``); the span's length is passed with it
(``write_row(..., positions=)``), since a model whose every layer slides (Mistral) has no layer that tells it. So
a prompt longer than W keeps its last W positions in each ring layer's prefix, and a parked tail its last W.

Why a rollout's own width rather than the whole cache: a cache is reused while it fits, so its width is the widest
rollout's so far, and attention's kernels round a row differently at different widths (a matmul computes a width's
last partial block of columns apart, and its reduction over the columns is blocked by their number). Attending the
rollout's own width makes a rollout's completions and log-probs a function of the rollout alone, the same in the
fresh cache of a resumed run as in the cache an uninterrupted run's earlier rollouts widened.

``PrefixTailStore`` holds the rest of a rollout's KV: the prompts' prefixes that rows are refilled from, and the
tails of parked samples until they resume. It frees what it is told to; which prefixes may go depends on the
schedule, so ``RolloutLoop`` decides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from lit_grpo.runtime.head_precision import layers_dtype
from lit_grpo.sampling.memory_budget import kv_geometry
from lit_grpo.scheduling.base import SampleKey

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values of shape [rows, kv_heads, T, head_dim]


def kv_cache_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype ``model``'s keys and values come out in here, so the dtype a slot cache stores them in: the
    autocast dtype where autocast is on for the model's device (bf16-mixed with float32 weights), else the
    layers' weights' (``layers_dtype``: not a float32 head's, nor the embedding tied to it)."""
    device_type = next(model.parameters()).device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return layers_dtype(model)


def cache_layers_kv(cache: DynamicCache) -> KV:
    """The (keys, values) tensors of every layer of a filled cache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def kv_bytes(kv: KV) -> int:
    """Bytes held by a list of per-layer key/value tensors."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def kept_positions(window: int | None, positions: int) -> int:
    """How many of a span's ``positions`` a layer's piece of it holds (its last ones): all of them for a
    full-attention layer (``window`` None), at most the last ``window`` for a sliding one, all that a later query of
    the row attends (transformers' rule: q - window < k <= q). The one rule for every piece of a row: the slot
    cache's ring layers, prefixes, parked tails (module doc)."""
    return positions if window is None else min(positions, window)


def slice_columns(kv: KV, start: int, stop: int | None = None,
                  windows: Sequence[int | None] | None = None) -> KV:
    """Columns ``[start:stop]`` of every layer (a copy, so the source can be freed; a negative ``start`` counts from
    the layer's end); with ``windows`` (by layer, None for a full one) a sliding layer's only the last
    ``kept_positions`` of them."""
    parts = []
    for index, (k, v) in enumerate(kv):
        begin = start + k.shape[2] if start < 0 else start
        end = k.shape[2] if stop is None else stop
        first = end - kept_positions(None if windows is None else windows[index], end - begin)
        parts.append((k[:, :, first:end].clone(), v[:, :, first:end].clone()))
    return parts


def take_columns(kv: KV, spans: list[tuple[int, int | None]],
                 windows: Sequence[int | None] | None = None) -> list[KV]:
    """``slice_columns(kv, start, stop, windows)`` of each ``(start, stop)`` span, consuming ``kv`` (the list is
    emptied) a layer at a time: where nothing else holds a layer, its tensors are freed once copied, so at most one
    layer is held twice, not the whole source."""
    parts: list[KV] = [[] for _ in spans]
    index = 0
    while kv:
        layer = [kv.pop(0)]
        window = None if windows is None else [windows[index]]
        for part, (start, stop) in zip(parts, spans):
            part.extend(slice_columns(layer, start, stop, window))
        index += 1
    return parts


@dataclass(frozen=True)
class AttentionLayout:
    """How a model's layers attend, as the decode step and the packed prefill must mask them.

    Attributes:
        sliding_window: None where every layer attends in full; else the window of its sliding-window layers
            (transformers' rule: a query at position q attends the keys at positions k with q - window < k <= q).
        keyed_masks: the model takes its ready-made masks as a dict keyed by layer type (``"full_attention"``,
            ``"sliding_attention"``: transformers' models with ``layer_types``, such as Gemma 3 and Qwen2) rather
            than one mask for every layer (Mistral, all of whose layers slide).
    """

    sliding_window: int | None = None
    keyed_masks: bool = False

    def mask_argument(self, full: torch.Tensor,
                      sliding: Callable[[], torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
        """The ``attention_mask`` a forward takes: ``full`` alone for a model without sliding layers (the very
        tensor, so nothing changes for it); else ``sliding()`` (the mask that also hides keys outside the window)
        for every layer, or keyed by layer type."""
        if self.sliding_window is None:
            return full
        if self.keyed_masks:
            return {"full_attention": full, "sliding_attention": sliding()}
        return sliding()


def attention_layout(model_config) -> AttentionLayout:
    """The ``AttentionLayout`` of a model the rollout engine computes exactly: every cache layer full attention or
    sliding-window attention of one window. Refused, naming why: linear, hybrid, chunked or latent attention (keys
    and values not ``num_key_value_heads x head_dim`` wide), bidirectional attention, Doge's dynamic mask, a sliding
    layer without a window, and attention logit soft-capping under SDPA (which does not compute it)."""
    if getattr(model_config, "kv_lora_rank", None):
        raise ValueError(f"the rollout engine needs keys and values of num_key_value_heads x head_dim each; this "
                         f"model ({model_config.model_type}) caches latent attention (kv_lora_rank="
                         f"{model_config.kv_lora_rank}), whose keys and values have other widths")
    text = model_config.get_text_config(decoder=True)
    if getattr(text, "use_bidirectional_attention", False):
        raise ValueError(f"the rollout engine needs causal attention; this model ({text.model_type}) sets "
                         "use_bidirectional_attention=True")
    keep = getattr(text, "keep_window_size", None)
    if keep is not None:
        raise ValueError(f"this model ({text.model_type}) masks its attention dynamically (keep_window_size={keep}): "
                         "past that many keys its cached decode attends other keys than its whole-sequence forward, "
                         "so the update would not reproduce the sampled log-probs")
    implementation = getattr(model_config, "_attn_implementation", None)
    if getattr(text, "attn_logit_softcapping", None) is not None and implementation == "sdpa":
        raise ValueError(f"this model ({text.model_type}) sets attn_logit_softcapping="
                         f"{text.attn_logit_softcapping}, which SDPA attention does not compute; load it with "
                         "attn_implementation='eager'")
    layer_types = getattr(text, "layer_types", None)
    try:
        cache_layers = DynamicCache(config=model_config).layers
    except TypeError as error:  # a sliding layer whose window is None: its cache layer takes an integer
        windowless = [index for index, (kind, layer) in enumerate(zip(layer_types or (), text.per_layer_config))
                      if kind == "sliding_attention" and getattr(layer, "sliding_window", None) is None]
        if not windowless:
            raise
        raise ValueError(f"this model ({text.model_type}) has sliding_attention layers {windowless} (layer_types "
                         f"{layer_types}) whose sliding_window is None; an integer >= 1 is needed") from error
    kinds = {type(layer).__name__ for layer in cache_layers}
    if not kinds <= {"DynamicLayer", "DynamicSlidingWindowLayer"}:
        shared = getattr(text, "num_kv_shared_layers", None)
        sharing = (f", and layers that reuse another layer's keys and values (num_kv_shared_layers={shared}),"
                   if "DummyLayer" in kinds and shared else "")
        raise ValueError(f"the rollout engine needs full-attention or sliding-window cache layers; this model uses "
                         f"{', '.join(sorted(kinds))} (hybrid or linear caches{sharing} are not supported)")
    if "DynamicSlidingWindowLayer" not in kinds:
        return AttentionLayout()
    chunk = getattr(text, "attention_chunk_size", None)
    other = sorted(set(layer_types or ()) - {"full_attention", "sliding_attention"})
    if other or chunk is not None:
        found = f"layer_types {other}" if other else f"attention_chunk_size={chunk}"
        raise ValueError(f"the rollout engine computes full and sliding-window attention; this model "
                         f"({text.model_type}) has {found} (chunked attention is not supported)")
    # the windows transformers' own cache keeps (a heterogeneous config may give each layer its own)
    windows = sorted(set(_cache_windows(cache_layers)) - {None}, key=repr)
    if len(windows) > 1:
        raise ValueError(f"this model ({text.model_type}) has sliding-window layers of {len(windows)} windows "
                         f"{windows}; the rollout engine masks every sliding layer with one window")
    window = windows[0]
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"this model ({text.model_type}) has sliding-window layers but sliding_window={window!r}; "
                         "an integer >= 1 is needed")
    return AttentionLayout(sliding_window=window, keyed_masks=layer_types is not None)


def layer_windows(model_config) -> list[int | None]:
    """Each layer's sliding window, None for a full-attention layer, as transformers builds the model's cache layers
    from its config (its ``layer_types``; without them, every layer where ``sliding_window`` is set): the rule the
    model's own masks follow, whether or not a layer's attention is also told its window (Qwen2-MoE's, PhiMoE's and,
    without ``use_sliding_window``, SmolLM3's are not)."""
    return _cache_windows(DynamicCache(config=model_config).layers)


def _cache_windows(cache_layers: list[CacheLayerMixin]) -> list[int | None]:
    """Each of transformers' cache layers' sliding window, None for a full-attention one: the one reading of which
    layers slide, for ``attention_layout`` (one window) and ``layer_windows`` (by layer index) alike."""
    return [layer.sliding_window if type(layer) is DynamicSlidingWindowLayer else None for layer in cache_layers]


class _StoringLayer(DynamicLayer):
    """A ``DynamicLayer`` that stores keys and values in ``store_dtype``."""

    def __init__(self, store_dtype: torch.dtype):
        super().__init__()
        self.store_dtype = store_dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return super().update(key_states.to(self.store_dtype), value_states.to(self.store_dtype), *args, **kwargs)


class PrefillCache(DynamicCache):
    """The ``DynamicCache`` of a prefill, storing keys and values in ``dtype``, the slot cache's (``kv_cache_dtype``):
    under autocast the keys arrive in float32 (the rotary embedding multiplies the bfloat16 projection by float32
    cos/sin), and attention computes in the autocast dtype anyway, so storing them in it changes no result and
    halves the keys' memory, for the prefill's moment and for the prefixes split from it. Every layer keeps every
    position of the forward, a sliding-window layer's too (transformers' ``DynamicSlidingWindowLayer`` keeps only
    the last window, and a packed chunk's prompts each need their own): the split keeps a ring layer's last window
    of each prefix (``prefill.split_prefixes``), so the prefixes held for a rollout take a ring layer's W columns
    at most; the masks hide the keys outside a window (``attention_layout``)."""

    def __init__(self, config, dtype: torch.dtype):
        super().__init__(config=config)
        self.layers = [_StoringLayer(dtype) for _ in self.layers]


class SlotCacheLayer(CacheLayerMixin):
    """One decoder layer's keys and values for every slot, written in place at each row's own column.

    Args:
        keys, values: ``[slots, kv_heads, columns, head_dim]`` storage: the slot cache's width, or a ring layer's
            window.
        write_columns: ``[slots]`` int64, shared with the owning cache: the column each row's next update writes
            (its ``lengths``, or for a ring layer its ``ring_columns``, ``lengths % window``).
        ring: None for a layer whose column is the position; else the ring's width (the sliding window, narrower
            than the slot cache): position p sits in column ``p % ring``.
    """

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, write_columns: torch.Tensor,
                 ring: int | None = None):
        super().__init__()
        self.keys, self.values = keys, values
        self.ring = ring
        self.attended = keys.shape[2]  # the columns update returns (SlotKVCache.attend sets it)
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        slots, kv_heads, _, _ = keys.shape
        # Row s, head h is written at column write_columns[s]: three indices that broadcast to [slots, kv_heads].
        # The column is a view of `write_columns` (no copy): it follows its in-place updates, so a captured graph
        # reads the current columns on every replay. `index_put_` rather than `scatter_`: compiled, Inductor writes
        # an `index_put_` into the layer in place, where a `scatter_` into a graph input becomes a copy of the whole
        # layer, the write, and a copy back, on every step.
        self._write_index = (torch.arange(slots, device=keys.device).view(slots, 1),
                             torch.arange(kv_heads, device=keys.device).view(1, kv_heads),
                             write_columns.view(slots, 1))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # allocated up front

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write one new column per row (``key_states``: ``[slots, kv_heads, 1, head_dim]``) at ``write_columns``."""
        if key_states.shape[2] != 1 or key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(f"SlotKVCache takes one token for each of its {self.keys.shape[0]} slots per step, got "
                             f"key states of shape {tuple(key_states.shape)}")
        # Under autocast the keys arrive in float32 (the rotary embedding multiplies the bfloat16 projection by
        # float32 cos/sin) and the values in bfloat16; both are stored in the cache's dtype, the one attention
        # computes in under autocast anyway, so the cast changes no result and halves the keys' memory.
        self.keys.index_put_(self._write_index, key_states[:, :, 0].to(self.keys.dtype))
        self.values.index_put_(self._write_index, value_states[:, :, 0].to(self.values.dtype))
        if self.attended == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[:, :, :self.attended], self.values[:, :, :self.attended]

    def _column_runs(self, first: int, count: int) -> list[tuple[int, int, int]]:
        """Where positions ``[first, first + count)`` sit: ``(column, offset, n)`` runs, positions ``first + offset``
        on in columns ``[column, column + n)``; one run, or two where a ring wraps (``count`` at most its width)."""
        if self.ring is None:
            return [(first, 0, count)]
        column = first % self.ring
        head = min(count, self.ring - column)
        return [(column, 0, head)] + ([(0, head, count - head)] if count > head else [])

    def write_positions(self, slot: int, first: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Row ``slot``'s positions ``[first, first + n)`` from ``keys``/``values`` ``[kv_heads, n, head_dim]``."""
        for column, offset, n in self._column_runs(first, keys.shape[1]):
            self.keys[slot, :, column:column + n].copy_(keys[:, offset:offset + n])
            self.values[slot, :, column:column + n].copy_(values[:, offset:offset + n])

    def read_positions(self, slot: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``slot``'s positions ``[first, first + count)``, ``[1, kv_heads, count, head_dim]`` each (copies)."""
        runs = self._column_runs(first, count)
        keys = [self.keys[slot:slot + 1, :, column:column + n] for column, _, n in runs]
        values = [self.values[slot:slot + 1, :, column:column + n] for column, _, n in runs]
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.attended, 0

    def get_seq_length(self) -> int:
        return self.keys.shape[2]

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotKVCache(Cache):
    """The decode batch's KV cache: ``slots`` rows of ``width`` columns per layer, allocated once; a sliding layer
    whose window is narrower than ``width`` holds a ring of ``window`` columns instead (module doc).

    Attributes:
        lengths: ``[slots]`` int64 on the device: cached positions of each row (= the column and the position id
            of the token its next decode step feeds). Idle rows keep 0.
        ring_width: the ring layers' width (the sliding window), None where no layer keeps a ring.
        ring_columns: ``[slots]`` int64 on the device, ``lengths % ring_width``: the column each row's next decode
            step writes in a ring layer (``locate_writes``); None without ring layers.
    """

    def __init__(self, model_config, num_slots: int, width: int, dtype: torch.dtype, device: torch.device):
        #: How the model's layers attend (the decode step masks sliding-window layers by it).
        self.layout = attention_layout(model_config)
        self.model_type = model_config.get_text_config(decoder=True).model_type
        num_layers, kv_heads, head_dim = kv_geometry(model_config)
        self.num_slots, self.width = num_slots, width
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        window = self.layout.sliding_window
        self.ring_width = window if window is not None and window < width else None
        self.ring_columns = None if self.ring_width is None else torch.zeros_like(self.lengths)
        layers = []
        for layer_window in (layer_windows(model_config) if self.ring_width is not None else [None] * num_layers):
            ring = self.ring_width if layer_window is not None else None
            shape = (num_slots, kv_heads, width if ring is None else ring, head_dim)
            layers.append(SlotCacheLayer(torch.zeros(shape, dtype=dtype, device=device),
                                         torch.zeros(shape, dtype=dtype, device=device),
                                         self.lengths if ring is None else self.ring_columns, ring))
        super().__init__(layers=layers)
        self._attended = width

    @property
    def attended(self) -> int:
        """The columns a decode step attends (``attend``; the whole width until it is called); a ring layer its
        ``ring_attended``."""
        return self._attended

    def attend(self, columns: int) -> None:
        """From the next decode step on, attend columns ``[0, columns)`` of every row (of a ring layer, its first
        ``ring_attended``); a rollout's rows must fit them (``columns`` at least its longest prompt - 1 +
        ``max_new_tokens``)."""
        if not 0 < columns <= self.width:
            raise ValueError(f"attended columns must be in [1, {self.width}] (the slot cache's width), got {columns}")
        self._attended = columns
        for layer in self.layers:
            layer.attended = columns if layer.ring is None else self.ring_attended

    @property
    def ring_attended(self) -> int | None:
        """The columns a ring layer attends: ``attended``, at most its ring's (all of it once a row may be longer);
        None without ring layers."""
        return None if self.ring_width is None else min(self._attended, self.ring_width)

    def locate_writes(self) -> None:
        """Where ring layers write each row's next position: ``ring_columns = lengths % ring_width``, in place, on
        the device (the decode step calls it inside the step, before the forward, so a compiled or captured step
        computes it from the current lengths on every run). Nothing without ring layers."""
        if self.ring_columns is not None:
            torch.remainder(self.lengths, self.ring_width, out=self.ring_columns)

    @property
    def piece_windows(self) -> list[int | None]:
        """Each layer's window as pieces written into this cache may cut it (``kept_positions``): a ring layer's
        ring width, None for a layer that needs every position."""
        return [layer.ring for layer in self.layers]

    def nbytes(self) -> int:
        """Bytes held by the slot cache (every row at full width, a ring layer's at its ring's)."""
        return kv_bytes(cache_layers_kv(self))

    def fits(self, num_slots: int, width: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a rollout of ``num_slots`` rows up to ``width`` positions can reuse this cache."""
        layer = self.layers[0]
        return (num_slots == self.num_slots and width <= self.width and layer.dtype == dtype
                and layer.device == device)

    def write_row(self, slot: int, start: int, kv: KV | None, positions: int | None = None) -> int:
        """Write a piece of a row (a single-row KV, ``[1, kv_heads, n, head_dim]`` per layer) into row ``slot`` as
        its positions ``[start, start + positions)``; returns ``positions``. Each layer's piece holds the span's
        last ``n`` positions: all of them for a layer whose column is the position, at least
        ``kept_positions(ring_width, positions)`` for a ring layer, whose last ones it writes. ``positions`` None:
        every layer holds the whole span (then of one ``n``)."""
        if kv is None:
            return 0
        if positions is None:
            held = {keys.shape[2] for keys, _ in kv}
            if len(held) != 1:
                raise ValueError(f"a piece whose layers hold {sorted(held)} positions needs its span's length "
                                 "(positions=) to be written")
            positions = held.pop()
        if start + positions > self.width:
            raise ValueError(f"{start + positions} positions do not fit the slot cache's width {self.width}")
        for index, (layer, (keys, values)) in enumerate(zip(self.layers, kv)):
            if keys.shape[1::2] != layer.keys.shape[1::2] or values.shape[1::2] != layer.values.shape[1::2]:
                # per-layer widths (MiMo-V2-Flash's sliding layers: more key/value heads, a v_head_dim)
                raise ValueError(
                    f"layer {index} of this model ({self.model_type}) caches keys of {keys.shape[1]} heads x "
                    f"{keys.shape[3]} and values of {values.shape[1]} heads x {values.shape[3]}, where the slot "
                    f"cache, sized by the config's num_key_value_heads x head_dim, holds {layer.keys.shape[1]} x "
                    f"{layer.keys.shape[3]}; the rollout engine needs every layer's keys and values that wide")
            held, needed = keys.shape[2], kept_positions(layer.ring, positions)
            if not needed <= held <= positions:
                raise ValueError(f"layer {index}'s piece holds {held} positions of a span of {positions}; this slot "
                                 f"cache's layer needs the span's last {needed}, and a piece holds at most the span")
            layer.write_positions(slot, start + positions - needed, keys[0, :, held - needed:],
                                  values[0, :, held - needed:])
        return positions

    def read_row(self, slot: int, start: int, stop: int) -> KV:
        """Positions ``[start, stop)`` of row ``slot`` as a single-row KV (copies): a ring layer's last
        ``kept_positions(ring_width, stop - start)`` of them, which it holds while ``stop`` is the row's length."""
        return [layer.read_positions(slot, stop - kept_positions(layer.ring, stop - start),
                                     kept_positions(layer.ring, stop - start))
                for layer in self.layers]


class PrefixTailStore:
    """The KV a rollout holds outside the slot cache, each piece a single-row KV (per layer keys and values of
    shape ``[1, kv_heads, positions, head_dim]``):

    - prefixes: prompt index -> the KV of its first ``P - 1`` tokens; None for a one-token prompt, which has no
      prefix but is held as prefilled all the same;
    - parked tails: sample key -> the KV of a parked sample's fed positions (its last prompt token and its tokens
      but the last), read from its row when it left its slot.

    A ring layer's piece holds the last window of those positions only (``kept_positions``, module doc); the
    spans' lengths are the caller's to pass when it writes them (the prompt's and the sample's, which it knows).
    """

    def __init__(self):
        self._prefixes: dict[int, KV | None] = {}
        self._tails: dict[SampleKey, KV] = {}
        self.parked_bytes = 0  # kept as tails come and go, not summed over every parked sample at each count

    def has_prefix(self, p: int) -> bool:
        return p in self._prefixes

    def prefix(self, p: int) -> KV | None:
        return self._prefixes[p]

    def put_prefix(self, p: int, kv: KV | None) -> None:
        self._prefixes[p] = kv

    def drop_prefix(self, p: int) -> None:
        del self._prefixes[p]

    def prompts(self) -> list[int]:
        """The prompts whose prefix is held."""
        return list(self._prefixes)

    def has_tail(self, key: SampleKey) -> bool:
        return key in self._tails

    def put_tail(self, key: SampleKey, tail: KV) -> None:
        self._tails[key] = tail
        self.parked_bytes += kv_bytes(tail)

    def take_tail(self, key: SampleKey) -> KV | None:
        """The parked tail of ``key``, no longer held here; None if it is not parked."""
        tail = self._tails.pop(key, None)
        if tail is not None:
            self.parked_bytes -= kv_bytes(tail)
        return tail

    def nbytes(self) -> int:
        """Bytes held by the prefixes and parked tails."""
        return self.parked_bytes + sum(kv_bytes(kv) for kv in self._prefixes.values() if kv is not None)
