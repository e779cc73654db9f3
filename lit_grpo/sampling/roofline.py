"""A decode step's floor: the bytes it must read over this machine's measured read bandwidth.

A decode step on a GPU (and mostly on a CPU) is memory-bound: it reads every linear weight once and each running
row's cached keys and values, and does little arithmetic per byte. Its floor, the fewest milliseconds it could
take, is those bytes over the memory's read bandwidth::

    step_bytes = b·W + rows·b·H + kv_bytes_per_token·attended        floor_ms = 1000 · step_bytes / read_bytes_per_s

with W the linear weights a forward reads (elements, output head included), H the hidden size (one embedding row
looked up per row), b bytes per element in the rollout's dtype, and ``attended`` the positions the step's rows
attend, summed over its rows (a row feeding the token at position i attends i + 1; a sliding-window layer's keys and
values at most its window of them, ``DecodeReads.rows_bytes``). The engine adds up every
step's bytes (``RolloutStats.decode_read_bytes``); ``rollout/floor_ms_per_step`` is their mean over the
bandwidth, and ``rollout/roofline_ratio`` the measured ``ms_per_step`` over it. tools/roofline.py adds FLOPs
(a compute floor) and prefill for the benchmarks, on these pieces.

The bandwidth is measured once per device and process (``read_bandwidth``): ``torch.sum`` over a buffer much
larger than the last-level cache, the median of a few timed calls after a warm-up. A CPU's buffer is filled in a
child process with this process's threads (``read_probe``), so that it never counts in this process's resident
peak; a GPU's lives in the GPU's memory, outside the host's.
"""

from __future__ import annotations

import re
import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from lit_grpo.runtime.validation import shown_setting
from lit_grpo.sampling.devices import indexed_device
from lit_grpo.sampling.kv_cache import kept_positions
from lit_grpo.sampling.memory_budget import dtype_bytes, kv_bytes_per_token, kv_geometry, kv_windows
from lit_grpo.sampling.read_probe import sum_seconds, sum_seconds_in_child

__all__ = ["DecodeReads", "ModelShape", "decode_reads", "floor_ms", "measure_read_bandwidth", "model_shape",
           "read_bandwidth", "set_read_bandwidth"]

#: The bandwidth of each device (its ``str``) this process measured or was given, bytes/s.
_BANDWIDTH: dict[str, float] = {}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder (Llama, Qwen2, Qwen3: q, k, v, o projections and a gated MLP) that its costs depend
    on: layers, hidden size, attention heads, key/value heads, head dim, MLP width, vocabulary."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def layer_weights(self) -> int:
        """Elements of one layer's linear weights: ``H·n_h·d (q) + 2·H·n_kv·d (k, v) + n_h·d·H (o) + 3·H·I``."""
        h, d = self.hidden, self.head_dim
        return h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h + 3 * h * self.intermediate

    @property
    def weights(self) -> int:
        """``W = L·W_layer + V·H``: elements of every linear weight a forward reads, the output head included (read
        once per forward, tied to the input embedding or not)."""
        return self.layers * self.layer_weights + self.vocab * self.hidden


def model_shape(config: Any) -> ModelShape:
    """The ``ModelShape`` of a transformers config (a multimodal config's text config is used)."""
    layers, kv_heads, head_dim = kv_geometry(config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    missing = [name for name in ("hidden_size", "intermediate_size", "vocab_size") if not getattr(text, name, None)]
    if missing:
        raise ValueError(f"model config {type(text).__name__} has no {missing}; the roofline needs a decoder with a "
                         "gated MLP (Llama, Qwen2, Qwen3)")
    return ModelShape(layers=layers, hidden=int(text.hidden_size), heads=int(text.num_attention_heads),
                      kv_heads=kv_heads, head_dim=head_dim, intermediate=int(text.intermediate_size),
                      vocab=int(text.vocab_size))


@dataclass(frozen=True)
class DecodeReads:
    """What a decode step reads, in bytes: ``weights`` once, ``per_row`` for each row (its embedding row) and
    ``per_position`` for each position a row attends (its keys and values across all layers); of those, the
    sliding layers' (``windowed_per_position``) for at most ``window`` positions of a row (0 and None: no layer
    slides, or the layers slide by several windows, counted in full)."""

    weights: int
    per_row: int
    per_position: int
    window: int | None = None
    windowed_per_position: int = 0

    def step_bytes(self, rows: int, attended: int) -> int:
        """Bytes one step of ``rows`` rows reads, ``attended`` positions summed over its rows, every layer reading
        all of them (``rows_bytes`` counts a sliding layer's window)."""
        return self.weights + rows * self.per_row + attended * self.per_position

    def rows_bytes(self, positions: Iterable[int]) -> int:
        """Bytes one step reads whose rows attend ``positions[i]`` positions each: a sliding layer at most its
        window of a row (``kv_cache.kept_positions``); ``step_bytes`` where no layer slides."""
        positions = list(positions)
        total = self.step_bytes(len(positions), sum(positions))
        if self.window is None:
            return total
        beyond = sum(n - kept_positions(self.window, n) for n in positions)  # positions a sliding layer skips
        return total - beyond * self.windowed_per_position


def decode_reads(config: Any, dtype: torch.dtype | str) -> DecodeReads:
    """The ``DecodeReads`` of a model: weights, embedding rows, keys and values in ``dtype`` (the rollout's), its
    sliding layers' at most their window (``memory_budget.kv_windows``)."""
    shape, b = model_shape(config), dtype_bytes(dtype)
    per_position = kv_bytes_per_token(config, dtype)
    windows = kv_windows(config)
    sliding = {window for window in windows if window is not None}
    window = sliding.pop() if len(sliding) == 1 else None
    windowed = per_position // len(windows) * sum(w is not None for w in windows) if window is not None else 0
    return DecodeReads(weights=b * shape.weights, per_row=b * shape.hidden, per_position=per_position,
                       window=window, windowed_per_position=windowed)


def floor_ms(read_bytes: float, read_bytes_per_s: float) -> float:
    """Milliseconds reading ``read_bytes`` takes at ``read_bytes_per_s``: ``1000 · read_bytes / read_bytes_per_s``.

    Raises:
        ValueError: ``read_bytes`` < 0 or a bandwidth that is not a finite number > 0 (the message names it).
    """
    if isinstance(read_bytes, bool) or not isinstance(read_bytes, (int, float)) or not read_bytes >= 0:
        raise ValueError(f"{shown_setting('read_bytes', read_bytes)} must be a number >= 0")
    if isinstance(read_bytes_per_s, bool) or not isinstance(read_bytes_per_s, (int, float)) or \
            not 0 < read_bytes_per_s < float("inf"):
        raise ValueError(f"{shown_setting('read_bytes_per_s', read_bytes_per_s)} must be a finite number > 0 (bytes "
                         "per second)")
    return 1000 * read_bytes / read_bytes_per_s


# --------------------------------------------------------------------------------------------- the machine
def last_level_cache_bytes() -> int:
    """The CPU's largest cache (sysfs), 0 when unknown: a bandwidth buffer must be much larger."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        match = re.fullmatch(r"(\d+)([KMG]?)", path.read_text().strip())
        if match:
            sizes.append(int(match.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match.group(2)])
    return max(sizes, default=0)


def bandwidth_buffer_bytes(device: torch.device, minimum: int = 2**28) -> int:
    """The bandwidth buffer: at least ``minimum`` and 4 x the last-level cache (the CPU's, or the GPU's L2)."""
    llc = (getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) if device.type == "cuda"
           else last_level_cache_bytes())
    return max(minimum, 4 * llc)


def measure_read_bandwidth(device: torch.device | str, buffer_bytes: int | None = None, budget_s: float = 0.1,
                           inner: int | None = None) -> float:
    """Bytes/s ``torch.sum`` reads from a float32 buffer of ``buffer_bytes`` on ``device`` (default
    ``bandwidth_buffer_bytes``): the median of timed calls within ``budget_s`` (at least 3, after a warm-up; on
    a GPU a call is ``inner`` = 10 back-to-back sums, 1 on a CPU). Measured afresh at every call; on a CPU in a
    child process (``read_probe.sum_seconds_in_child``), so the buffer is not this process's memory."""
    device = torch.device(device)
    buffer_bytes = buffer_bytes or bandwidth_buffer_bytes(device)
    inner = inner or (10 if device.type == "cuda" else 1)
    seconds = _cpu_sum_seconds(buffer_bytes, budget_s, inner) if device.type == "cpu" else \
        sum_seconds(device, buffer_bytes, budget_s, inner)
    if device.type == "cuda":  # the buffer's cached block would count in the reserved peaks measured after
        torch.cuda.empty_cache()
    return buffer_bytes / seconds


def _cpu_sum_seconds(buffer_bytes: int, budget_s: float, inner: int) -> float:
    """``sum_seconds`` on the CPU in a child process (``read_probe``): its buffer never counts in this process's
    resident peak. Where no child can run, in this process, with a warning that says so."""
    try:
        return sum_seconds_in_child(buffer_bytes, budget_s, inner)
    except RuntimeError as error:
        warnings.warn(f"{error}; the read bandwidth is measured in this process instead, its "
                      f"{buffer_bytes / 2**20:.0f} MiB buffer counting in this process's peak memory", RuntimeWarning,
                      stacklevel=3)
        return sum_seconds(torch.device("cpu"), buffer_bytes, budget_s, inner)


def read_bandwidth(device: torch.device | str,
                   around_probe: Callable[[], AbstractContextManager[Any]] = nullcontext) -> float:
    """This process's read bandwidth of ``device`` (bytes/s): measured on first use (``measure_read_bandwidth``,
    once, briefly, inside ``around_probe()``: a caller that keeps the probe's buffer out of its memory peaks) and
    kept, or what ``set_read_bandwidth`` gave. The one record of what was measured: every caller reads it here."""
    key = _device_key(device)
    if key not in _BANDWIDTH:
        with around_probe():
            _BANDWIDTH[key] = measure_read_bandwidth(key)
    return _BANDWIDTH[key]


def set_read_bandwidth(device: torch.device | str, read_bytes_per_s: float) -> None:
    """Use ``read_bytes_per_s`` as ``device``'s bandwidth for the rest of the process (measured elsewhere; tests)."""
    floor_ms(0, read_bytes_per_s)  # a bad value is refused here, naming it
    _BANDWIDTH[_device_key(device)] = float(read_bytes_per_s)


def _device_key(device: torch.device | str) -> str:
    """``device`` as its cache key: "cuda" is the current CUDA device."""
    return str(indexed_device(device))
