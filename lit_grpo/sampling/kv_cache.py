"""KV memory of the rollout: the slot batch's cache rows, cached prompt prefixes, and byte accounting.

Layout invariant (what keeps row operations cheap): every row of the slot cache is *right-aligned*. Row i holds
``lengths[i]`` real positions in the last columns of a ``[rows, kv_heads, width, head_dim]`` tensor per layer, and
left padding before them. Each decode step appends one column to every row, so the invariant survives decoding;
inserting a row left-pads it (or the others) to a common width; removing rows may leave leading columns that no
live row uses, and ``trim`` drops them. The attention mask and position ids follow from ``lengths`` alone.

This is transformers' ``DynamicCache``, manipulated layer by layer: the model's forward keeps doing its own
``update`` (concatenating the new column), and this class only does what the forward cannot: insert, remove,
trim and count.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values of shape [rows, kv_heads, T, head_dim]


def cache_layers_kv(cache: DynamicCache) -> KV:
    """The (keys, values) tensors of every layer of a filled cache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def kv_bytes(kv: KV) -> int:
    """Bytes held by a list of per-layer key/value tensors."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def slice_columns(kv: KV, start: int, stop: int | None = None) -> KV:
    """Columns ``[start:stop]`` of every layer (a copy, so the source can be freed)."""
    return [(k[:, :, start:stop].clone(), v[:, :, start:stop].clone()) for k, v in kv]


def concat_columns(left: KV | None, right: KV | None) -> KV | None:
    """Join two single-row KVs along the sequence axis (a prompt prefix and a parked sample's tail)."""
    if left is None or right is None:
        return right if left is None else left
    return [(torch.cat([lk, rk], dim=2), torch.cat([lv, rv], dim=2)) for (lk, lv), (rk, rv) in zip(left, right)]


class SlotKVCache:
    """The decode batch's KV cache: one right-aligned row per running sample.

    Attributes:
        cache: the ``DynamicCache`` handed to the model's forward.
        lengths: ``[rows]`` int64 real positions per row (prompt prefix + fed tokens).
    """

    def __init__(self, model_config, device: torch.device, dtype: torch.dtype, kv_heads: int, head_dim: int):
        self.cache = DynamicCache(config=model_config)
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:
                raise ValueError(f"the rollout engine needs full-attention cache layers; this model uses "
                                 f"{type(layer).__name__} (sliding-window or hybrid caches are not supported)")
        self.device, self.dtype = device, dtype
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)
        self._empty_rows(0, 0)

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def rows(self) -> int:
        return self.lengths.shape[0]

    @property
    def width(self) -> int:
        return self.cache.layers[0].keys.shape[2]

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position of one row costs across all layers: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * len(self.cache.layers) * self.kv_heads * self.head_dim * self.cache.layers[0].keys.element_size()

    def nbytes(self) -> int:
        """Bytes held by the slot cache, padding included."""
        return self.rows * self.width * self.bytes_per_position

    def attention_mask(self) -> torch.Tensor:
        """``[rows, width + 1]`` mask for a decode step (the +1 is the column the step appends)."""
        columns = torch.arange(self.width + 1, device=self.device)
        return (columns >= (self.width - self.lengths).unsqueeze(1)).long()

    def row_kv(self, row: int, last: int) -> KV:
        """The last ``last`` positions of one row, as a single-row KV (copied)."""
        return [(k[row:row + 1, :, k.shape[2] - last:].clone(), v[row:row + 1, :, v.shape[2] - last:].clone())
                for k, v in cache_layers_kv(self.cache)]

    # --------------------------------------------------------------------------------------------- mutations
    def _empty_rows(self, rows: int, width: int) -> None:
        for layer in self.cache.layers:
            shape = (rows, self.kv_heads, width, self.head_dim)
            layer.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.dtype, layer.device, layer.is_initialized = self.dtype, self.device, True

    def advance(self) -> None:
        """Record that a decode step appended one column to every row."""
        self.lengths += 1

    def insert(self, new_rows: list[KV | None]) -> None:
        """Append rows at the end of the batch, each given as a single-row KV (None: no cached positions).

        Left-pads the new rows, or the existing ones when a new row is wider, to one common width.
        """
        new_lengths = [0 if kv is None else kv[0][0].shape[2] for kv in new_rows]
        old_rows, old_width = self.rows, self.width
        width = max([old_width, *new_lengths])
        old = cache_layers_kv(self.cache)
        self._empty_rows(old_rows + len(new_rows), width)
        for layer_idx, layer in enumerate(self.cache.layers):
            layer.keys[:old_rows, :, width - old_width:] = old[layer_idx][0]
            layer.values[:old_rows, :, width - old_width:] = old[layer_idx][1]
            for j, kv in enumerate(new_rows):
                if kv is not None and new_lengths[j] > 0:
                    layer.keys[old_rows + j, :, width - new_lengths[j]:] = kv[layer_idx][0][0]
                    layer.values[old_rows + j, :, width - new_lengths[j]:] = kv[layer_idx][1][0]
        self.lengths = torch.cat([self.lengths, torch.tensor(new_lengths, dtype=torch.long, device=self.device)])

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order), then drop leading columns that no remaining row uses."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.lengths = self.lengths[index]
        start = self.width - int(self.lengths.max()) if rows else self.width
        for layer in self.cache.layers:
            # index_select on the column view copies exactly the kept block, so trimmed memory is freed now.
            layer.keys = layer.keys[:, :, start:].index_select(0, index)
            layer.values = layer.values[:, :, start:].index_select(0, index)
