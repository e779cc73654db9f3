"""KV-cache memory budgets: how many concurrent sequences (slots, ``micro_group_size`` g) fit in a byte budget.

Pure functions of the model config; no model is loaded. One cached position costs, across all layers::

    kv_bytes_per_token = 2 (keys and values) x num_hidden_layers x num_key_value_heads x head_dim x dtype bytes

and one slot holds at most ``longest prompt + max_new_tokens`` positions. A sliding-window layer holds at most its
window of a row's positions (the slot cache keeps it as a ring, ``kv_cache``), and of a prefix's or a parked tail's
(its last ones): ``kv_row_bytes(positions)`` counts them so (``kv_bytes_per_token x positions`` for a model without
sliding layers). Besides its slots the engine holds KV
that does not depend on g: the prompts' prefixes (at most every prompt's at once: a predictor that reads prompt
features prefills them all before the first step) and, under "infinite", each parked sample's ``parked_tokens``
positions whatever g is (at most every sample's: the length-aware method's probes, or preemption without a park
budget, up to the last preemption point). Samples preempted within a park budget (``least_attained.py``) hold at
most ``park_fraction`` (its ``park_budget``) of the slots' generation KV, which grows with g: the budget counts a
parked tail's KV (``tail_tokens``), so a sliding layer's share of it is at most its window. For a moment a prefill
holds more: while a chunk of prompts (up to ``PREFILL_CHUNK_TOKENS`` positions, or one longer prompt) is split into
their prefixes, one layer of it twice, and where its prompts are longer than a sliding layer's window, the positions
past it that the split then cuts from their prefixes (every layer of a chunk holds every position); and under partial
rollouts, while a carried sample's KV is computed again,
its prompt and tokens (up to ``max_prompt_len + max_new_tokens`` positions) plus one layer of its tokens. A slot's
row of the decode step may hold more than KV: ``row_state_bytes`` (a repetition penalty's seen ids, one byte per
vocabulary entry; ``decode_step.row_state_bytes``). So::

    slot_bytes    = kv_row_bytes(max_prompt_len + max_new_tokens) + park_fraction x kv_row_bytes(max_new_tokens)
                    + row_state_bytes
    held_bytes    = num_prompts x (kv_row_bytes(max_prompt_len) + group_size x kv_row_bytes(parked_tokens))
    prefill_bytes = the larger of those two moments (kv_prefill_bytes)
    g             = min(floor((kv_budget_bytes - held_bytes - prefill_bytes) / slot_bytes), group_size x num_prompts)

(the engine never runs more slots than the rollout has samples), and a rollout's ``peak_kv_bytes`` stays within
``kv_budget_bytes``. Every row of the slot cache is ``longest prompt - 1 + max_new_tokens`` positions wide from the
start, rounded up to a multiple of the engine's ``WIDTH_ALIGNMENT`` on CUDA or when the step is compiled; where
that rounding is wider than ``max_prompt_len + max_new_tokens`` the slot is priced at its width
(``slot_positions``).

Used by ``data.sampling: {micro_group_size: auto, kv_budget_bytes: ...}``. Without ``kv_budget_bytes`` the budget
comes from the device (``kv_budget_from_free_memory``): its free memory less what the run will still allocate
beside the KV cache and a safety margin::

    kv_budget_bytes = free_bytes - reserved_bytes - margin_bytes

A budget from the device also prices one decode step's activations (``decode_step_bytes``), which grow with g: a
slot's share of them is added to its ``slot_bytes`` (a configured ``kv_budget_bytes`` is the cache's alone).

The slots are priced for the rollout alone: between rollouts the slot cache is released, so the update has that
memory. ``keep_kv_cache: auto`` keeps it (and the rollout weights' copy, which its CUDA graphs read, and the graphs'
private memory pool: ``decode_step_bytes``, and under autocast over weights no copy stands in for, the blocks of
their casts, ``cast_pool_bytes``) only where they fit beside the update's measured peak
(``kv_cache_fits_beside_update``)::

    update_peak_bytes + kept_bytes <= total_bytes - margin_bytes
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lit_grpo.runtime.validation import check_int, check_real, shown_setting

__all__ = ["DEVICE_MARGIN_FRACTION", "auto_micro_group_size", "cast_pool_bytes", "decode_step_bytes", "dtype_bytes",
           "held_positions", "kv_budget_from_free_memory", "kv_bytes_per_token", "kv_cache_fits_beside_update",
           "kv_geometry", "kv_held_bytes", "kv_prefill_bytes", "kv_row_bytes", "kv_slot_bytes", "kv_windows",
           "tail_tokens"]


#: The share of the device's total memory a budget from free memory leaves out: what no count here covers (the
#: update's activations, the allocator's fragmentation, the prefill's activations).
DEVICE_MARGIN_FRACTION = 0.1

#: Bytes per next-token logit a decode step holds at its sampler's peak: the head's output (float32 at most), its
#: float32 copy and tempered copy, top-p's sorted copy with its int64 indices, and the nucleus's probabilities, their
#: running sums and those shifted by one (``token_sampler``): seven float32 ``[slots, V]`` tensors and one int64, and
#: a repetition penalty's copy.
STEP_BYTES_PER_LOGIT = 40


def kv_budget_from_free_memory(free_bytes: int, reserved_bytes: int, margin_bytes: int) -> int:
    """The KV-cache byte budget of ``micro_group_size="auto"`` without ``kv_budget_bytes``: ``free_bytes -
    reserved_bytes - margin_bytes``.

    Args:
        free_bytes: the device's memory free for new tensors now (bytes).
        reserved_bytes: what the run will still allocate beside the KV cache (bytes; see
            ``SlotMemory._kv_budget``).
        margin_bytes: kept free besides (bytes; ``DEVICE_MARGIN_FRACTION`` of the device's memory).

    Raises:
        ValueError: a count that is not an integer >= 0, or nothing left for the KV cache (the message names the
            three numbers).
    """
    free_bytes = check_int("free_bytes", free_bytes, 0)
    reserved_bytes = check_int("reserved_bytes", reserved_bytes, 0)
    margin_bytes = check_int("margin_bytes", margin_bytes, 0)
    budget = free_bytes - reserved_bytes - margin_bytes
    if budget < 1:
        raise ValueError(f"no device memory left for the KV cache: free_bytes={free_bytes} - reserved_bytes="
                         f"{reserved_bytes} (the rollout weights' copy and the update's state still to "
                         f"come) - margin_bytes={margin_bytes} = {budget}, but micro_group_size: auto needs a budget "
                         ">= 1 byte; set sampling.kv_budget_bytes, or a fixed micro_group_size")
    return budget


def kv_cache_fits_beside_update(update_peak_bytes: int, kept_bytes: int, total_bytes: int,
                                margin_bytes: int) -> bool:
    """Whether what a rollout would leave allocated through the update fits beside it: ``update_peak_bytes +
    kept_bytes <= total_bytes - margin_bytes``.

    Args:
        update_peak_bytes: the device's peak while an update ran with nothing kept (bytes, measured).
        kept_bytes: the slot cache and the rollout weights' copy, which keeping would hold through the update.
        total_bytes: the device's memory.
        margin_bytes: kept free besides (``DEVICE_MARGIN_FRACTION`` of ``total_bytes``).
    """
    for name, value in [("update_peak_bytes", update_peak_bytes), ("kept_bytes", kept_bytes),
                        ("total_bytes", total_bytes), ("margin_bytes", margin_bytes)]:
        check_int(name, value, 0)
    return update_peak_bytes + kept_bytes <= total_bytes - margin_bytes


def decode_step_bytes(config: Any, dtype: torch.dtype | str, slots: int, width: int, vocab_size: int) -> int:
    """Bytes one decode step's activations take at their peak, over-counted: what its CUDA graph's private memory
    pool keeps between replays (a captured step's blocks are never given back; the graphs of every attended width
    share one pool, so the widest one's step prices it), and what an eager step holds for a moment beside the cache::

        slots x (V x STEP_BYTES_PER_LOGIT                          the logits and the sampler's copies
                 + dtype bytes x (3 x intermediate + 4 x hidden    one layer: the MLP's and the residual's
                                  + (heads + 2 x kv_heads) x head_dim)   its query, key and value
                 + heads x width x (8 + dtype bytes))              its attention scores, float32, and probabilities

    One layer's: a layer's blocks are freed before the next layer allocates its own, which the pool reuses. The
    sampler's and the last layer's are summed, although the layer's are freed first: an upper bound.

    Args:
        config: a transformers config (as ``kv_geometry``; ``intermediate_size`` where it has one, else 4 x hidden).
        dtype: the layers' activations' dtype (the KV cache's).
        slots: the step's rows (g).
        width: the columns a row attends (the cache's width: the widest bucket).
        vocab_size: the logits' width (``decode_step.vocab_size``).
    """
    for name, value in (("slots", slots), ("width", width), ("vocab_size", vocab_size)):
        check_int(name, value, 1)
    layers, kv_heads, head_dim = kv_geometry(config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    size = dtype_bytes(dtype)
    layer = size * (3 * intermediate + 4 * hidden + (heads + 2 * kv_heads) * head_dim) + heads * width * (8 + size)
    return slots * (vocab_size * STEP_BYTES_PER_LOGIT + layer)


def cast_pool_bytes(cast_sizes: Sequence[int]) -> int:
    """Bytes the blocks of a decode step's weight casts take in a memory pool (its CUDA graphs'), from the casts'
    sizes in the order the step makes them (``decode_step.weight_cast_sizes``): each cast is freed before the next,
    whose allocation takes the freed block where it is no larger, so only a cast larger than every earlier one
    takes a block of its own. The sum of those running maxima; 0 for no cast.

    Args:
        cast_sizes: bytes of each cast (each an integer >= 0).
    """
    total = largest = 0
    for index, size in enumerate(cast_sizes):
        check_int(f"cast_sizes[{index}]", size, 0)
        if size > largest:
            total, largest = total + size, size
    return total


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of a ``torch.dtype`` or its name ("float32", "torch.bfloat16")."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        resolved = getattr(torch, name, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"{shown_setting('dtype', dtype)} is not a torch dtype (e.g. 'float32', 'bfloat16')")
        dtype = resolved
    return torch.empty((), dtype=dtype).element_size()


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a model config: what one cached position is made of.

    Args:
        config: a transformers ``PretrainedConfig`` (``num_hidden_layers``, ``num_attention_heads``, optional
            ``num_key_value_heads`` (GQA; default: the attention heads) and ``head_dim`` (default:
            ``hidden_size // num_attention_heads``)). A multimodal config's text config is used.
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    if not layers or not heads:
        raise ValueError(f"model config {type(config).__name__} has no num_hidden_layers / num_attention_heads; "
                         "cannot size the KV cache")
    try:
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    except RuntimeError as error:  # a heterogeneous config (Gemma 4's) will not give one value for every layer
        widths = [(getattr(layer, "num_key_value_heads", None), getattr(layer, "head_dim", None))
                  for layer in config.per_layer_config]
        raise ValueError(f"model config {type(config).__name__} ({getattr(config, 'model_type', None)}) gives its "
                         f"layers their own key/value widths (num_key_value_heads, head_dim by layer: {widths}); the "
                         "rollout engine's slot cache holds one num_key_value_heads x head_dim for every layer") \
            from error
    return int(layers), int(kv_heads), int(head_dim)


def kv_bytes_per_token(config: Any, dtype: torch.dtype | str) -> int:
    """Bytes one cached position costs across all layers: ``2 x layers x kv_heads x head_dim x dtype bytes``
    (``config`` as in :func:`kv_geometry`; ``dtype``: the KV cache's, a ``torch.dtype`` or its name). What a row's
    positions cost where no layer slides; ``kv_row_bytes`` counts a sliding layer's window."""
    layers, kv_heads, head_dim = kv_geometry(config)
    return 2 * layers * kv_heads * head_dim * dtype_bytes(dtype)


def kv_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window, None for a full-attention layer (``kv_cache.layer_windows``); every layer
    full (priced at every position: never less than it holds) for a config transformers builds no cache from (a
    plain namespace standing in for one, a sliding layer without a window, which the engine refuses by name)."""
    from lit_grpo.sampling.kv_cache import layer_windows  # kv_cache imports this module

    layers = kv_geometry(config)[0]
    try:
        windows = layer_windows(config) if hasattr(config, "get_text_config") else []
    except (TypeError, ValueError):
        windows = []
    return windows if len(windows) == layers else [None] * layers


def kv_row_bytes(config: Any, dtype: torch.dtype | str, positions: int) -> int:
    """Bytes ``positions`` positions of one row cost across all layers, as the slot cache and the prefix and tail
    pieces hold them: every position in a full-attention layer, at most the last ``window`` in a sliding one
    (``kv_cache.kept_positions``)::

        kv_row_bytes = kv_bytes_per_token / layers x sum over layers of min(positions, window)

    ``kv_bytes_per_token x positions`` for a model without sliding layers, or whose window holds ``positions``."""
    positions = check_int("positions", positions, 0)
    windows = kv_windows(config)
    return kv_bytes_per_token(config, dtype) // len(windows) * held_positions(windows, positions)


def held_positions(windows: Sequence[int | None], positions: float) -> float:
    """Positions of a span of ``positions`` that all layers together hold, each its ``kept_positions`` of them
    (``windows``: by layer, None for a full one): ``layers x positions`` where no layer slides."""
    from lit_grpo.sampling.kv_cache import kept_positions  # kv_cache imports this module

    return sum(kept_positions(window, positions) for window in windows)


def tail_tokens(windows: Sequence[int | None], tokens: int) -> float:
    """A parked tail of ``tokens`` positions' KV in tokens of every layer, ``kv_row_bytes / kv_bytes_per_token``
    (``held_positions`` per layer). The cost the default strategy's park budget counts a parked sample at
    (``RolloutWork.park_cost``)."""
    return held_positions(windows, tokens) / len(windows)


def aligned_width(width: int, alignment: int) -> int:
    """``width`` rounded up to a multiple of ``alignment``."""
    alignment = check_int("alignment", alignment, 1)
    return -(-width // alignment) * alignment


def row_width(longest_prompt: int, max_new_tokens: int, alignment: int = 1) -> int:
    """Positions a slot's row of the engine's cache holds at most, rounded up to a multiple of ``alignment``: the
    prompt's ``P - 1`` cached positions plus the ``L`` tokens fed (its last token is never fed)."""
    return aligned_width(longest_prompt - 1 + max_new_tokens, alignment)


def slot_positions(max_prompt_len: int, max_new_tokens: int, alignment: int = 1) -> int:
    """Positions one slot holds at most: ``max_prompt_len + max_new_tokens``, or the engine's ``row_width`` where
    that is larger."""
    return max(max_prompt_len + max_new_tokens, row_width(max_prompt_len, max_new_tokens, alignment))


def kv_slot_bytes(config: Any, dtype: torch.dtype | str, max_prompt_len: int, max_new_tokens: int,
                  alignment: int = 1) -> int:
    """Worst-case KV bytes of one slot: ``kv_row_bytes`` of ``slot_positions(...)`` (a sliding layer's row holds
    at most its window)."""
    max_prompt_len = check_int("max_prompt_len", max_prompt_len, 0)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    return kv_row_bytes(config, dtype, slot_positions(max_prompt_len, max_new_tokens, alignment))


def kv_held_bytes(config: Any, dtype: torch.dtype | str, max_prompt_len: int, group_size: int, num_prompts: int,
                  parked_tokens: int = 0) -> int:
    """Worst-case KV bytes the engine holds besides its slot cache (module docstring): ``num_prompts x
    (kv_row_bytes(max_prompt_len) + group_size x kv_row_bytes(parked_tokens))`` (each prefix and parked tail a
    piece of its own, a sliding layer's holding at most its window); ``parked_tokens``: 0 where no sample is parked
    outside a park budget."""
    parked_tokens = check_int("parked_tokens", parked_tokens, 0)
    return num_prompts * (kv_row_bytes(config, dtype, max_prompt_len)
                          + group_size * kv_row_bytes(config, dtype, parked_tokens))


def kv_prefill_bytes(config: Any, dtype: torch.dtype | str, max_prompt_len: int, num_prompts: int,
                     max_new_tokens: int, carried: bool = False) -> int:
    """The most KV bytes a prefill holds for a moment besides the slots, prefixes and parked tails (module
    docstring): one layer of a prefill chunk, plus where its prompts pass a sliding layer's window the positions
    the split then cuts from their prefixes (``kv_held_bytes`` prices the prefixes cut), or with ``carried``
    samples (partial rollouts) a carried sample's recomputed prompt and tokens plus one layer of its tokens,
    whichever is larger."""
    from lit_grpo.sampling.prefill import PREFILL_CHUNK_TOKENS  # prefill imports kv_cache, which imports this

    per_token = kv_bytes_per_token(config, dtype)
    per_layer = per_token // kv_geometry(config)[0]
    chunk = min(num_prompts * max_prompt_len, max(PREFILL_CHUNK_TOKENS, max_prompt_len))
    cut = 0
    if kv_row_bytes(config, dtype, max_prompt_len) < per_token * max_prompt_len:  # a prompt may pass the window
        # the chunk's prompts drop at most (sum of their lengths) - window positions of a sliding layer in all
        cut = per_token * chunk - kv_row_bytes(config, dtype, chunk)
    tail = per_token * (max_prompt_len + max_new_tokens) + per_layer * max_new_tokens if carried else 0
    return max(per_layer * chunk + cut, tail)


def auto_micro_group_size(config: Any, dtype: torch.dtype | str, kv_budget_bytes: int, max_prompt_len: int,
                          max_new_tokens: int, group_size: int, num_prompts: int = 1, parked_tokens: int = 0,
                          park_fraction: float = 0.0, carried: bool = False, alignment: int = 1,
                          row_state_bytes: int = 0, step_bytes: int = 0) -> int:
    """The largest ``g`` whose worst-case KV bytes, its slots' and what the engine holds besides them, fit
    ``kv_budget_bytes`` (module docstring), capped at the rollout's ``group_size x num_prompts`` samples.
    ``park_fraction``: the share of a slot's generation KV (``kv_row_bytes(max_new_tokens)``, a ring layer's at
    most its window, as a parked tail holds it) preempted samples may hold parked (0: none);
    ``carried``: partial rollouts may carry samples into the rollout; ``alignment``: the engine rounds its rows'
    width up to a multiple of it (``slot_positions``); ``row_state_bytes``: what a slot's row holds besides its KV;
    ``step_bytes``: a slot's share of a decode step's activations (``decode_step_bytes`` of one slot; 0: not priced).

    Raises:
        ValueError: a bad argument, or a budget smaller than one slot and the held KV (the message names the
            numbers).
    """
    kv_budget_bytes = check_int("kv_budget_bytes", kv_budget_bytes, 1)
    group_size = check_int("group_size", group_size, 1)
    num_prompts = check_int("num_prompts", num_prompts, 1)
    per_token = kv_bytes_per_token(config, dtype)
    check_real("park_fraction", park_fraction, 0)
    slot = kv_slot_bytes(config, dtype, max_prompt_len, max_new_tokens, alignment)
    row_state_bytes = check_int("row_state_bytes", row_state_bytes, 0)
    step_bytes = check_int("step_bytes", step_bytes, 0)
    slot += math.ceil(park_fraction * kv_row_bytes(config, dtype, max_new_tokens)) + row_state_bytes + step_bytes
    held = kv_held_bytes(config, dtype, max_prompt_len, group_size, num_prompts, parked_tokens)
    held += kv_prefill_bytes(config, dtype, max_prompt_len, num_prompts, max_new_tokens, carried)
    fits = (kv_budget_bytes - held) // slot
    if fits < 1:
        positions = slot_positions(max_prompt_len, max_new_tokens, alignment)
        windowed = kv_row_bytes(config, dtype, positions) < per_token * positions
        parked = f" + {park_fraction:g} x a parked tail of {max_new_tokens}" if park_fraction else ""
        raise ValueError(f"kv_budget_bytes={kv_budget_bytes} is smaller than one slot's KV cache, {slot} bytes "
                         f"({per_token} bytes/token x ({max_prompt_len} prompt + {max_new_tokens} new tokens"
                         + (f", a row rounded up to a multiple of {alignment}" if alignment > 1 else "")
                         + f"{parked}"
                         + (", sliding layers holding at most their window" if windowed else "") + ")"
                         + (f" + {row_state_bytes} bytes of its row's seen ids" if row_state_bytes else "")
                         + (f" + {step_bytes} bytes of a decode step's activations" if step_bytes else "")
                         + f"), plus the {held} bytes held besides the slots ({num_prompts} prompts' prefixes"
                         + (f", parked samples' {parked_tokens} tokens" if parked_tokens else "")
                         + " and a prefill's moment"
                         + f"); raise kv_budget_bytes to at least {slot + held}, or lower max_new_tokens")
    return int(min(fits, group_size * num_prompts))
