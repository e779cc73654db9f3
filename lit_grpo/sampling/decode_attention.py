"""The decode step's attention on a CPU: each row's one query against its slot-cache row, as two matmuls.

Owns: nothing past a decode step. ``cpu_decode_attention`` switches the policy's attention implementation to
``decode_attention`` for the forward of a decode step on a CPU, eager or compiled, and restores it after; prefills,
the update and CUDA keep SDPA. Its switch, ``instead_of_sdpa``, also serves the packed prefill's attention
(``prefill.py``).

Why: for one query per row, transformers packs the query heads that share a key/value head into a
``[rows, kv_heads, group, dim]`` query and calls SDPA, whose fused CPU kernel spends more time on its own tiling
than on the few positions of a decode step. Two batched matmuls and a softmax do the same arithmetic in about half
the time. Every row is its own batch entry, so a row's result does not depend on the others (strategies of the
same g stay bit-identical); against SDPA the results differ by float32 rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: The name the implementation is registered under in transformers' attention (and mask) registries.
DECODE_ATTENTION = "lit_grpo_decode"

#: Attention options ``decode_attention`` does not compute; a call with any of them set goes to SDPA.
_SDPA_ONLY = ("softcap", "s_aux", "sinks", "sliding_window", "position_bias")


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract; a decode step's call computed by matmuls, any other by SDPA.

    Args:
        query: ``[rows, heads, 1, dim]``.
        key, value: ``[rows, kv_heads, width, dim]``, the slot cache's layer (``heads`` a multiple of ``kv_heads``;
            query head ``h`` reads key/value head ``h // (heads // kv_heads)``, as transformers' ``repeat_kv``).
        attention_mask: ``[rows, 1, 1, >= width]`` additive float mask.
    Returns:
        ``[rows, 1, heads, dim]`` and no attention weights.
    """
    if (query.shape[2] != 1 or attention_mask is None or attention_mask.dtype == torch.bool or dropout
            or any(kwargs.get(name) is not None for name in _SDPA_ONLY)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, _, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    scale = dim ** -0.5 if scaling is None else scaling
    grouped = query.view(rows, kv_heads, heads // kv_heads, dim)                   # [rows, kv_heads, group, dim]
    scores = torch.matmul(grouped, key.transpose(-1, -2)).mul_(scale)              # [rows, kv_heads, group, width]
    scores.add_(attention_mask[..., :width])
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)                                               # [rows, kv_heads, group, dim]
    return out.view(rows, 1, heads, dim), None


AttentionInterface.register(DECODE_ATTENTION, decode_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)  # what a 2-D mask becomes, as for SDPA


@contextlib.contextmanager
def instead_of_sdpa(model: torch.nn.Module, implementation: str) -> Iterator[bool]:
    """Within the block, an SDPA ``model``'s attention layers call the registered ``implementation`` (this module's
    ``decode_attention``, or ``prefill.packed_attention``); restored after. Yields whether it switched: a model
    whose attention is not SDPA keeps it (another implementation was chosen on purpose)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield False
        return
    config._attn_implementation = implementation
    try:
        yield True
    finally:
        config._attn_implementation = "sdpa"


@contextlib.contextmanager
def cpu_decode_attention(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, ``model``'s attention layers call ``decode_attention``. Nothing happens when ``enabled``
    is False or the model's attention is not SDPA (``instead_of_sdpa``)."""
    if not enabled:
        yield
        return
    with instead_of_sdpa(model, DECODE_ATTENTION):
        yield
