"""The roofline of a decode step and of prefill: the fewest milliseconds this machine could spend on them.

A forward's floor is the longer of two times: its FLOPs at the machine's matmul rate, and the bytes it must read
at the machine's memory read bandwidth::

    floor_s = max(flops / matmul_flops_per_s, bytes / read_bytes_per_s)      bound = "compute" | "memory"

The bytes a decode step reads and the read bandwidth are the library's (``lit_grpo.sampling.roofline``, which the
fit path logs as ``rollout/floor_ms_per_step``); this module adds FLOPs, prefill and the matmul rate. Both rates
are measured in this process, with torch's own kernels (``measure_machine``; on a CPU the matmul rate is
the faster of ``torch.mm`` and oneDNN's inner product, the two the engine can run its linears on), so a ratio
``measured / floor`` says how far the engine is from what torch's kernels can do on this machine, not from a data
sheet. The costs come from the model's config (``decode_step_cost``, ``prefill_cost``), for the decoders this
project runs (Llama, Qwen2, Qwen3: attention with q, k, v, o projections and a gated MLP).

Notation: L layers, H hidden size, n_h attention heads, n_kv key/value heads, d head dim, I MLP width, V vocabulary,
b bytes per element of the model's dtype. The linear weights of one layer (elements)::

    W_layer = H·n_h·d (q) + 2·H·n_kv·d (k, v) + n_h·d·H (o) + 3·H·I (gate, up, down)

and of the whole model ``W = L·W_layer + V·H``: the output head is read once per forward whether it is tied to the
input embedding or not (tied, the embedding's rows looked up are among the head's; untied, only the looked-up
rows of the embedding are read, ``H`` elements per token, counted below).
"""

from __future__ import annotations

import math
import platform
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lit_grpo.sampling.cpu_linear import onednn_linear
from lit_grpo.sampling.devices import indexed_device
from lit_grpo.sampling.memory_budget import dtype_bytes, held_positions, kv_windows
from lit_grpo.sampling.read_probe import median_seconds
from lit_grpo.sampling.roofline import bandwidth_buffer_bytes, decode_reads, measure_read_bandwidth, model_shape

#: What ``measure_machine`` keeps of its measurements, per (device, dtype, threads), so a process measures once.
_MEASURED: dict[tuple[str, str, int], dict] = {}


@dataclass(frozen=True)
class Cost:
    """The work of one forward: ``flops`` (multiply and add counted as 2) and ``bytes`` read from memory."""

    flops: float
    bytes: float


def decode_step_cost(config: Any, rows: int, context_len: float, dtype: torch.dtype | str) -> Cost:
    """The work of one decode step: ``rows`` rows each feed one token and attend ``context_len`` positions (its own
    included; the mean over the rows), keeping the logits of that one token::

        flops = 2·rows·W + 4·rows·L·n_h·d·context_len          (the linear layers; q·K and p·V)
        bytes = b·(W + rows·H + 2·rows·L·n_kv·d·context_len)   (the weights; embedding rows; each row's K and V)

    Left out, as small beside these at decode sizes: norms, rotary embeddings, the softmax, activations, the
    sampling over ``rows·V`` logits, biases, and writing the new keys and values (``2·rows·L·n_kv·d`` elements).
    A static cache that attends its whole width (masked) does more; the floor counts only the positions needed, a
    sliding-window layer's at most its window (``DecodeReads.rows_bytes``, every row at ``context_len``).

    Args:
        config: the model's transformers config.
        rows: sequences in the step (>= 1), e.g. the engine's slot count.
        context_len: mean positions each row attends (>= 1).
        dtype: the weights' and the KV cache's dtype.
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows={rows!r} must be an integer >= 1")
    if not isinstance(context_len, (int, float)) or not context_len >= 1:
        raise ValueError(f"context_len={context_len!r} must be a number >= 1 (positions attended, its own included)")
    s = model_shape(config)
    attention = s.heads * s.head_dim * held_positions(kv_windows(config), context_len)
    return Cost(flops=2 * rows * s.weights + 4 * rows * attention,
                bytes=decode_reads(config, dtype).rows_bytes([context_len] * rows))


def prefill_cost(config: Any, tokens: int, dtype: torch.dtype | str, cached: int = 0) -> Cost:
    """The work of one prefill forward of ``tokens`` tokens of one sequence after ``cached`` cached positions,
    keeping the last token's logits only (as the engine does)::

        flops = 2·tokens·L·W_layer + 2·V·H + 4·L·n_h·d·(tokens·cached + tokens·(tokens + 1)/2)
        bytes = b·(W + tokens·H + 2·L·n_kv·d·(cached + tokens))

    Causal attention: token i attends ``cached + i`` positions; an ideal kernel reads each layer's keys and values
    once per forward. Left out as in ``decode_step_cost`` (norms, rotary, softmax, activations, biases, KV writes).

    Args:
        config: the model's transformers config.
        tokens: tokens run in this forward (>= 1).
        dtype: the weights' and the KV cache's dtype.
        cached: positions already in the cache (a carried sample's tail runs after its prompt's prefix).
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens={tokens!r} must be an integer >= 1")
    if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
        raise ValueError(f"cached={cached!r} must be an integer >= 0")
    s, b = model_shape(config), dtype_bytes(dtype)
    attended = tokens * cached + tokens * (tokens + 1) / 2
    return Cost(flops=2 * tokens * s.layers * s.layer_weights + 2 * s.vocab * s.hidden
                + 4 * s.layers * s.heads * s.head_dim * attended,
                bytes=b * (s.weights + tokens * s.hidden + 2 * s.layers * s.kv_heads * s.head_dim * (cached + tokens)))


def prefill_token_cost(config: Any, tokens: int, dtype: torch.dtype | str, cached: int = 0) -> Cost:
    """``prefill_cost`` per token of that forward: what one prompt token costs when ``tokens`` run together."""
    cost = prefill_cost(config, tokens, dtype, cached)
    return Cost(flops=cost.flops / tokens, bytes=cost.bytes / tokens)


def prefill_batch_cost(config: Any, token_counts: list[int], dtype: torch.dtype | str) -> Cost:
    """The work of one prefill forward of several sequences (``token_counts``: each one's tokens, no cached
    positions), each attending only itself and keeping its last token's logits: the ``prefill_cost`` of each,
    added, but with the weights read once (``W`` bytes counted once, not once per sequence)."""
    if not token_counts:
        raise ValueError("token_counts=[] must name at least one sequence")
    costs = [prefill_cost(config, tokens, dtype) for tokens in token_counts]
    weights = dtype_bytes(dtype) * model_shape(config).weights
    return Cost(flops=sum(c.flops for c in costs), bytes=sum(c.bytes for c in costs) - (len(costs) - 1) * weights)


def floor_s(cost: Cost, machine: dict) -> tuple[float, str]:
    """``(seconds, bound)``: the longer of ``cost.flops / matmul_flops_per_s`` ("compute") and ``cost.bytes /
    read_bytes_per_s`` ("memory"), the rates of ``machine`` (a ``measure_machine`` record)."""
    compute = cost.flops / machine["matmul_flops_per_s"]
    memory = cost.bytes / machine["read_bytes_per_s"]
    return (compute, "compute") if compute >= memory else (memory, "memory")


def floor_ms(cost: Cost, machine: dict) -> tuple[float, str]:
    """``floor_s`` in milliseconds: ``(ms, bound)``."""
    seconds, bound = floor_s(cost, machine)
    return 1000 * seconds, bound


def mean_decode_context(prompt_lengths: list[int], completion_lengths: list[int]) -> float:
    """Mean positions a decode step's row attends, over every (sample, step) of a rollout.

    A sample with a P-token prompt feeds, at its j-th step (j = 0 .. L-1), the token at position P - 1 + j and
    attends P + j positions, so its steps average ``P + (L - 1) / 2``; samples weigh by their L. Lists ``[N]``, one
    entry per sample; samples with L = 0 take no step.
    """
    if len(prompt_lengths) != len(completion_lengths):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(completion_lengths)} completions")
    steps = sum(completion_lengths)
    if steps < 1:
        raise ValueError("no completion took a decode step (every length is 0)")
    return sum(n * (p + (n - 1) / 2) for p, n in zip(prompt_lengths, completion_lengths)) / steps


# --------------------------------------------------------------------------------------------- the machine
def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name as ``lscpu`` gives it (``/proc/cpuinfo`` when lscpu is missing)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if shutil.which("lscpu"):
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                                 env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"}).stdout
            match = re.search(r"^Model name:\s*(.+)$", out, re.MULTILINE)
            if match:
                return match.group(1).strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _cpu_flags() -> list[str]:
    """The vector extensions torch's CPU kernels may use, as /proc/cpuinfo lists them."""
    try:
        flags = set(re.search(r"^flags\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
                    .group(1).split())
    except (OSError, AttributeError):
        return []
    return [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]


#: The matmul kernels measured: name -> ``(a, b) -> a @ b.T`` (the same FLOPs either way).
MATMUL_KERNELS = {
    "torch.mm": lambda a, b: torch.mm(a, b),
    "onednn": onednn_linear,
}


def _matmul_seconds(device: torch.device, dtype: torch.dtype, n: int, inner: int, budget_s: float,
                    kernel: str = "torch.mm") -> float:
    """Median seconds of one ``kernel`` product of two ``n x n`` matrices in ``dtype`` (``inner`` per timed call)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    product = MATMUL_KERNELS[kernel]

    def run():
        for _ in range(inner):
            product(a, b)

    return median_seconds(run, device, budget_s) / inner


def measure_machine(device: torch.device | str, dtype: torch.dtype | str, seconds_budget: float = 1.0) -> dict:
    """This machine's matmul rate (FLOP/s, in ``dtype``) and memory read bandwidth (bytes/s), with torch's kernels.

    Matmul: ``torch.mm`` of two square matrices in ``dtype`` (2048 on a CPU, 8192 on a GPU: large enough to be
    compute-bound), ``2·n³`` FLOPs per call; in float32 on a CPU with oneDNN (``torch.backends.mkldnn``) the same
    product by oneDNN's inner product too, and the faster of the two is the rate (``matmul_kernel`` names it).
    Bandwidth: ``torch.sum`` over a float32 buffer at least 4 x the last-level cache (the CPU's largest cache from
    sysfs, the GPU's L2) and at least 256 MiB on a CPU, 1 GiB on a GPU, its bytes per call. Each: one warm-up, then
    the median of timed calls within half the budget (at least 3; on a GPU a call is 10 back-to-back kernels).
    The result is kept per (device, dtype, threads), so a process measures once.

    Returns:
        ``{"device", "device_name", "dtype", "threads", "matmul_flops_per_s", "matmul_kernel", "read_bytes_per_s",
        "method", "measured_s"}``; on a CPU also ``"cpu_flags"``. ``device_name`` is ``lscpu``'s model name or the
        GPU's.
    """
    device = indexed_device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r}: the roofline is measured on 'cpu' or 'cuda' only")
    if not isinstance(seconds_budget, (int, float)) or not seconds_budget > 0:
        raise ValueError(f"seconds_budget={seconds_budget!r} must be a number > 0")
    dtype_bytes(dtype)  # a bad name is refused here, naming it
    dtype_name = str(dtype).removeprefix("torch.")
    dtype = getattr(torch, dtype_name)
    threads = torch.get_num_threads()
    key = (str(device), dtype_name, threads)
    if key in _MEASURED:
        return dict(_MEASURED[key])
    started = time.perf_counter()
    gpu = device.type == "cuda"
    inner = 10 if gpu else 1
    n = 8192 if gpu else 2048
    buffer_bytes = bandwidth_buffer_bytes(device, 2**30 if gpu else 2**28)
    # oneDNN's is the kernel the engine's float32 linears run on on a CPU (sampling.cpu_linear)
    onednn = not gpu and dtype == torch.float32 and torch.backends.mkldnn.is_available()
    kernels = ["torch.mm"] + (["onednn"] if onednn else [])
    with torch.inference_mode():  # each helper's tensors are freed when it returns
        matmul = {kernel: _matmul_seconds(device, dtype, n, inner, seconds_budget / 2 / len(kernels), kernel)
                  for kernel in kernels}
        read_bytes_per_s = measure_read_bandwidth(device, buffer_bytes, seconds_budget / 2, inner)
    kernel = min(matmul, key=matmul.get)
    record = {
        "device": str(device), "device_name": device_name(device), "dtype": dtype_name, "threads": threads,
        "matmul_flops_per_s": 2 * n**3 / matmul[kernel], "matmul_kernel": kernel,
        "read_bytes_per_s": read_bytes_per_s,
        "method": {"matmul": f"the faster of {' and '.join(kernels)} on two {n} x {n} {dtype_name} matrices, 2·n³ "
                             "FLOPs, median after a warm-up",
                   "read": f"torch.sum over a {buffer_bytes / 2**20:.0f} MiB float32 buffer (at least 4 x the "
                           "last-level cache), median after a warm-up"},
        "measured_s": time.perf_counter() - started,
    }
    if not gpu:
        record["cpu_flags"] = _cpu_flags()
    _MEASURED[key] = record
    return dict(record)


def ratio(measured: float | None, floor: float | None) -> float | None:
    """``measured / floor``, or None when either is unknown (or the floor is 0)."""
    if measured is None or not floor or math.isnan(floor):
        return None
    return measured / floor


def prefill_floor(model_config, dtype, prompts: list[list[int]], machine: dict) -> tuple[float, str] | None:
    """``(ms per prefill token, bound)`` at the floor: every prompt's first P - 1 tokens in one forward
    (``prefill_batch_cost``: the weights read once), divided by their tokens; None when no prompt has a prefix.
    The engine runs them in chunks of consecutive prompts (lit_grpo.sampling.prefill), packed end to end: its
    chunks' extra weight reads count against it."""
    forwards = [len(p) - 1 for p in prompts if len(p) > 1]
    if not forwards:
        return None
    ms, bound = floor_ms(prefill_batch_cost(model_config, forwards, dtype), machine)
    return ms / sum(forwards), bound


def add_to_record(record: dict, model_config, dtype, machine: dict, prefill: tuple[float, str] | None) -> None:
    """Fill a ``tools.bench_rollout`` record's floor and ratio fields (its docstring) from its rows, mean context
    and timings."""
    record["floor_ms_per_step"] = record["floor_bound"] = None
    if record.get("decode_steps") and record.get("mean_context") and record.get("num_slots"):
        cost = decode_step_cost(model_config, int(record["num_slots"]), record["mean_context"], dtype)
        record["floor_ms_per_step"], record["floor_bound"] = floor_ms(cost, machine)
    record["roofline_ratio"] = ratio(record.get("ms_per_step"), record["floor_ms_per_step"])
    record["decode_roofline_ratio"] = ratio(record.get("decode_ms_per_step"), record["floor_ms_per_step"])
    timed = record.get("prefill_ms_per_token") is not None and prefill is not None
    record["prefill_floor_ms_per_token"], record["prefill_floor_bound"] = prefill if timed else (None, None)
    record["prefill_roofline_ratio"] = ratio(record.get("prefill_ms_per_token"), record["prefill_floor_ms_per_token"])
