"""Prompt prefills: which prompts run in one forward, that forward's inputs, and its split into each prompt's prefix KV.

Owns no state: ``RolloutLoop`` decides when a prompt needs its prefix and ``kv_cache.PrefixTailStore`` keeps it;
this module says which other prompts run with it and how.

Why several prompts in one forward: one prompt's prefill is a forward of ``P - 1`` rows, too few for a CPU's
matmuls to reach their rate; a chunk of prompts reads the weights once and gives the matmuls all their rows.
The chunk is packed, not padded: its prompts are laid end to end in one sequence, each with its own positions
(from 0), so no position is computed for nothing. Attention must not cross from one prompt into another: on an SDPA
model, ``packed_attention`` runs each prompt's causal attention on its own (SDPA per prompt, as if it ran alone,
instead of one masked ``[T, T]`` product that costs the square of the whole chunk); any other attention
implementation gets a block-diagonal causal mask. A sliding-window layer attends only its window here too: its SDPA
call gets the windowed causal mask of a prefix longer than the window, and a block mask is windowed for it.

The chunk's lengths reach ``packed_attention`` beside the forward (``packed_forward`` holds them for its block), not
as a keyword argument of it: some decoder layers (StableLM's, Nemotron's in transformers 5.24) do not pass their
keyword arguments on to their attention, which would then run SDPA's causal attention over the whole chunk, every
prompt attending to those before it. A layer whose attention does not call the registered function at all (one
that picks its kernel by the implementation's name) is refused after the forward, by name, rather than its
prefixes kept.

Why fixed chunks: a prompt's prefix KV may depend (in its rounding) on the shape of the forward it ran in (a
matmul kernel may pick its blocking by the rows). The chunks are a function of the rollout's prompts alone (their
order and lengths), never of the schedule, so every strategy computes the same prefix KV and same-g schedules
stay bit-identical. Chunks are consecutive prompts, so a strategy that starts the groups in order (``micro``,
``continuous``) holds at most one chunk's prefixes ahead of the group it runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from lit_grpo.runtime.head_precision import layers_dtype
from lit_grpo.runtime.validation import check_int
from lit_grpo.sampling.decode_attention import instead_of_sdpa, refuse_sinks
from lit_grpo.sampling.kv_cache import KV, AttentionLayout, attention_layout, layer_windows, take_columns

__all__ = ["PACKED_ATTENTION", "PREFILL_CHUNK_TOKENS", "PackedChunk", "block_causal_mask", "pack_chunk",
           "packed_attention", "packed_forward", "prefill_chunks", "split_prefixes", "tail_attention_inputs",
           "window_causal"]

#: The most tokens one prefill forward packs (a longer prefix runs alone): enough rows for a CPU's matmuls to
#: reach their rate, and small beside the slot cache in activations and in the prefixes held ahead.
PREFILL_CHUNK_TOKENS = 1024


def prefill_chunks(prefix_lengths: Sequence[int], max_tokens: int = PREFILL_CHUNK_TOKENS) -> list[list[int]]:
    """The prompts' prefill forwards: the indices of the prompts with a prefix (length > 0), in order, cut into runs
    of consecutive prompts of at most ``max_tokens`` tokens together (a longer prefix runs alone).

    >>> prefill_chunks([60, 0, 39, 36, 700, 44], max_tokens=200)
    [[0, 2, 3], [4], [5]]
    """
    max_tokens = check_int("max_tokens", max_tokens, 1)
    chunks: list[list[int]] = []
    tokens = 0
    for p, length in enumerate(prefix_lengths):
        check_int(f"prefix_lengths[{p}]", length, 0)
        if not length:
            continue
        if chunks and tokens + length <= max_tokens:
            chunks[-1].append(p)
            tokens += length
        else:
            chunks.append([p])
            tokens = length
    return chunks


#: The name ``packed_attention`` is registered under in transformers' attention (and mask) registries.
PACKED_ATTENTION = "lit_grpo_packed_prefill"


@dataclass(frozen=True)
class PackedChunk:
    """One prefill forward's inputs: the chunk's prefixes end to end.

    Attributes:
        input_ids: ``[1, T]``, T the prefixes' tokens together.
        position_ids: ``[1, T]``, each prefix's own positions from 0.
        lengths: each prefix's tokens; prefix i is columns ``[offsets[i], offsets[i] + lengths[i])``.
        offsets: where each prefix starts.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    lengths: list[int]
    offsets: list[int]


def pack_chunk(prefixes: Sequence[Sequence[int]], device: torch.device) -> PackedChunk:
    """The ``PackedChunk`` of ``prefixes`` (each non-empty)."""
    lengths = [len(prefix) for prefix in prefixes]
    if not prefixes or not all(lengths):
        raise ValueError(f"a prefill chunk needs one or more non-empty prefixes; got lengths {lengths}")
    input_ids = torch.tensor([[t for prefix in prefixes for t in prefix]], dtype=torch.long, device=device)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    return PackedChunk(input_ids, position_ids, lengths, [0, *itertools.accumulate(lengths)][:-1])


def block_causal_mask(lengths: Sequence[int], dtype: torch.dtype, device: torch.device,
                      sliding_window: int | None = None) -> torch.Tensor:
    """``[1, 1, T, T]`` additive mask (0, or ``dtype``'s lowest): each position attends the earlier positions of its
    own prefix (``lengths``: the prefixes' tokens, end to end), with a ``sliding_window`` only the last that many
    (its own included)."""
    member = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    allowed = window_causal(len(member), sliding_window, device) & (member[:, None] == member[None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def window_causal(n: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """``[n, n]`` bool: query q attends key k where k <= q, and with a ``sliding_window``, q - window < k
    (transformers' rule)."""
    query, key = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]
    allowed = key <= query
    return allowed if sliding_window is None else allowed & (key > query - sliding_window)


@dataclass
class _PackedCalls:
    """A packed forward's chunk: its prefixes' ``lengths``, the model's ``windows`` (``kv_cache.layer_windows``,
    by layer index), the ``calls`` of ``packed_attention`` over them and the attention modules that made them
    (``callers``, by id: a layer may call it more than once, as DiffLlama's do)."""

    lengths: list[int]
    windows: list[int | None]
    calls: int = 0
    callers: set[int] = field(default_factory=set)


#: The packed chunk whose forward runs now (``packed_forward``'s block): its prefixes' lengths, the layers' windows,
#: and which attention modules split a forward over them by ``packed_attention`` (each attention layer).
_PACKED_CHUNK: contextvars.ContextVar[_PackedCalls | None] = contextvars.ContextVar("lit_grpo_packed_chunk",
                                                                                   default=None)


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: inside ``packed_forward``'s block, each of the chunk's prefixes'
    causal attention by SDPA on its own; outside it, SDPA unchanged. A sliding-window layer (its config's window, by
    its ``layer_idx``: some layers do not pass ``sliding_window``) gives a prefix longer than the window the mask
    that also hides the keys outside it, as transformers' own mask does.

    Args:
        query: ``[1, heads, T, dim]``; key, value: ``[1, kv_heads, T, dim]`` (T = the chunk's tokens).
        attention_mask: None (the registered mask function builds none; each prefix's causal mask is SDPA's own).
    Returns:
        ``[1, T, heads, dim]`` and no attention weights.
    """
    refuse_sinks(module, kwargs)
    packed = _PACKED_CHUNK.get()
    if packed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or query.shape[2] != sum(packed.lengths) or key.shape[2] != query.shape[2]:
        raise ValueError(f"a packed prefill's attention takes one row of the chunk's {sum(packed.lengths)} tokens; "
                         f"got query {tuple(query.shape)} and key {tuple(key.shape)}")
    packed.calls += 1
    packed.callers.add(id(module))
    window = _layer_window(module, packed.windows, kwargs.get("sliding_window"))
    outputs, start = [], 0
    for n in packed.lengths:
        part = slice(start, start + n)
        mask = None if window is None or n <= window else window_causal(n, window, query.device)[None, None]
        out, _ = sdpa_attention_forward(module, query[:, :, part], key[:, :, part], value[:, :, part], mask,
                                        dropout=dropout, scaling=scaling, **kwargs)
        outputs.append(out)
        start += n
    return torch.cat(outputs, dim=1), None


def _layer_window(module: torch.nn.Module, windows: list[int | None], told: int | None) -> int | None:
    """The sliding window of the attention layer ``module``: its config's, by its ``layer_idx`` (what the model's
    own mask would hide), else the window its call passed (``told``)."""
    layer = getattr(module, "layer_idx", None)
    if isinstance(layer, int) and 0 <= layer < len(windows):
        return windows[layer]
    if told is None and any(window is not None for window in windows):
        raise ValueError(f"a packed prefill cannot tell which window the attention layer {type(module).__name__} "
                         f"(layer_idx={layer!r}) of a model with sliding-window layers attends: it has no layer_idx "
                         f"within the {len(windows)} layers and passed no sliding_window")
    return told


def _no_mask(*args, **kwargs) -> None:
    return None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, _no_mask)


@contextlib.contextmanager
def packed_forward(model: torch.nn.Module, chunk: PackedChunk) -> Iterator[dict[str, Any]]:
    """The keyword arguments that keep ``chunk``'s prefixes apart in one forward of ``model`` within the block (its
    ``position_ids``, and for an attention other than SDPA an ``attention_mask``). An SDPA model's attention is
    switched to ``packed_attention`` for the block, which finds the chunk's lengths here, and restored after.

    Raises:
        ValueError: on leaving the block, where the forward's attention layers did not each call
            ``packed_attention`` (module doc): the prefixes would have attended to each other.
    """
    inputs: dict[str, Any] = {"position_ids": chunk.position_ids}
    if len(chunk.lengths) == 1:  # one prefix: the model's own causal attention, as if no chunk
        yield inputs
        return
    with instead_of_sdpa(model, PACKED_ATTENTION) as switched:
        if not switched:
            # the layers' dtype: a float32 head (cast_lm_head_to_fp32) tied to the embedding makes model.dtype float32
            mask = functools.partial(block_causal_mask, chunk.lengths, layers_dtype(model), chunk.input_ids.device)
            layout = attention_layout(model.config)
            yield inputs | {"attention_mask": layout.mask_argument(mask(), lambda: mask(layout.sliding_window))}
            return
        calls = _PackedCalls(list(chunk.lengths), layer_windows(model.config))
        token = _PACKED_CHUNK.set(calls)
        try:
            yield inputs
        finally:
            _PACKED_CHUNK.reset(token)
        layers = len(calls.windows)  # one a layer, as the model's cache layers
        if len(calls.callers) != layers:
            config = model.config
            raise ValueError(
                f"a packed prefill of {type(model).__name__} ({config.model_type}) called the registered attention "
                f"function {calls.calls} times for its {layers} attention layers, from {len(calls.callers)} "
                "attention modules: its attention does not go through transformers' attention interface "
                "(AttentionInterface), so the rollout engine cannot keep its prompts apart; load the model with "
                "attn_implementation='eager' (a block-diagonal mask), or use a model whose attention does")


def split_prefixes(kv: KV, chunk: PackedChunk, windows: Sequence[int | None] | None = None) -> list[KV]:
    """Each prefix's KV from its chunk's cache (every layer's keys and values ``[1, kv_heads, T, head_dim]``):
    ``[1, kv_heads, lengths[i], head_dim]`` each, copied so the chunk's cache can be freed; ``kv`` is consumed a
    layer at a time (``take_columns``), so the split holds at most one layer of the chunk twice. With ``windows``
    (by layer, ``SlotKVCache.piece_windows``) a sliding layer keeps each prefix's last window only
    (``kv_cache.kept_positions``): all its ring will hold."""
    return take_columns(kv, [(start, start + n) for start, n in zip(chunk.offsets, chunk.lengths)], windows)


def tail_attention_inputs(layout: AttentionLayout, start: int, fed: int, kept: int, dtype: torch.dtype,
                          device: torch.device) -> dict[str, Any]:
    """The ``position_ids`` and ``attention_mask`` of a forward of ``fed`` positions ``[start, start + fed)``
    after a prefix of ``start`` positions whose sliding layers hold only its last ``kept`` (a cut prefix,
    ``split_prefixes``): transformers would read the positions and the masks' sizes from a layer's cached columns,
    which a cut sliding layer no longer tells (Mistral has no full layer to read them from). Additive masks
    ``[1, 1, fed, keys]``: a full layer's keys are positions ``[0, start + fed)``, a sliding layer's ``[start -
    kept, start + fed)``, admitted where k <= q and, sliding, q - window < k."""
    query = torch.arange(start, start + fed, device=device)[:, None]

    def mask(first: int, window: int | None) -> torch.Tensor:
        key = torch.arange(first, start + fed, device=device)[None, :]
        allowed = (key <= query) if window is None else (key <= query) & (key > query - window)
        additive = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return additive.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]

    window = layout.sliding_window
    return {"position_ids": query.view(1, fed),
            "attention_mask": layout.mask_argument(mask(0, None), lambda: mask(start - kept, window))}
