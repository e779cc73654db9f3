"""The decode step's attention: each row's one query against its slot-cache row, reading each KV head once.

Owns: nothing past a decode step. ``step_attention`` switches the policy's attention implementation, on every
device, eager, compiled or captured, for the forward of a decode step, and restores it after; prefills and the
update keep SDPA. Its switch, ``instead_of_sdpa``, also serves the packed prefill's attention (``prefill.py``).

Two kernels, chosen by ``SamplingConfig.decode_attention`` (one validated setting rather than a module switch: the
choice is part of ``StepSettings``, so a step built with one kernel is never replayed for the other):

- "matmul" (the default): ``decode_attention``, two batched matmuls and a softmax over the query heads that share
  a key/value head packed into a ``[rows, kv_heads, group, dim]`` view. Each KV head is read once, with no copy
  (transformers' SDPA path copies K and V to every query head, ``repeat_kv``), and every row is its own batch
  entry, so a row's result does not depend on the others (strategies of the same g stay bit-identical). On a CPU
  it also spends less time than SDPA's fused kernel, whose tiling costs more than the few positions of a step.
  Half-precision scores are written in float32 where the device's matmul can (``float32_scores``, CUDA): rounded
  to bfloat16 a peaked score (|s| ~ 30) would move its probability by several percent, where SDPA's fused kernels,
  which the update's forward runs, keep scores in float32. Elsewhere (a CPU) they are rounded.
- "sdpa_gqa" (experimental, for measuring on a GPU): ``sdpa_gqa_decode_attention``, torch's SDPA with
  ``enable_gqa=True`` on the same operands; whether a fused GQA kernel with a mask beats the matmuls depends on
  the GPU and the torch build.

Both attend the key/value columns the slot cache returns (its ``attended`` width, ``decode_step`` picks it).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Literal, get_args

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lit_grpo.runtime.validation import shown_value
from lit_grpo.sampling.devices import indexed_device

#: The names the implementations are registered under in transformers' attention (and mask) registries.
DECODE_ATTENTION = "lit_grpo_decode"
SDPA_GQA_DECODE_ATTENTION = "lit_grpo_decode_sdpa_gqa"

DecodeKernel = Literal["matmul", "sdpa_gqa"]
DECODE_KERNELS: tuple[str, ...] = get_args(DecodeKernel)
_REGISTERED = {"matmul": DECODE_ATTENTION, "sdpa_gqa": SDPA_GQA_DECODE_ATTENTION}

#: Whether a device's half-precision matmul writes float32 (``torch.bmm(..., out_dtype=torch.float32)``), probed once
#: per device by ``step_attention``, outside any capture or compilation.
_FLOAT32_SCORES: dict[torch.device, bool] = {}

#: Attention options the decode kernels do not compute; a call with any of them set goes to SDPA (attention sinks
#: are refused before, ``refuse_sinks``). Not ``sliding_window``: a sliding layer's window is in the mask the decode
#: step gives it (``AttentionLayout``).
_SDPA_ONLY = ("softcap", "position_bias")


def refuse_sinks(module: torch.nn.Module, kwargs: dict) -> None:
    """Raise where an attention call carries attention sinks (gpt-oss's ``s_aux``): transformers' SDPA, which the
    engine's attention falls back to, ignores them; transformers loads such a model in eager attention, which does
    not reach the engine's attention at all."""
    for name in ("s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__} passes attention sinks ({name}), which SDPA does not compute; "
                             "load the model with attn_implementation='eager'")


def _is_decode_call(query: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float, kwargs: dict) -> bool:
    """A decode step's call: one query per row, an additive float mask, no option only SDPA computes."""
    return (query.shape[2] == 1 and attention_mask is not None and attention_mask.dtype != torch.bool
            and not dropout and all(kwargs.get(name) is None for name in _SDPA_ONLY))


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
    refuse_sinks(module, kwargs)
    if not _is_decode_call(query, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, _, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    scale = dim ** -0.5 if scaling is None else scaling
    group = heads // kv_heads
    grouped = query.view(rows, kv_heads, group, dim)                               # [rows, kv_heads, group, dim]
    if key.dtype in (torch.bfloat16, torch.float16) and _FLOAT32_SCORES.get(key.device, False):
        # the query in the cache's dtype, as autocast would cast it (under bf16-mixed the rotary embedding hands it
        # over in float32); rows and heads merge into one batch: the cache's width slice keeps them contiguous
        flat_keys = key.reshape(rows * kv_heads, width, dim).transpose(1, 2)
        flat_query = grouped.to(key.dtype).reshape(rows * kv_heads, group, dim)
        scores = torch.bmm(flat_query, flat_keys, out_dtype=torch.float32)
        scores = scores.view(rows, kv_heads, group, width)
    else:
        scores = torch.matmul(grouped, key.transpose(-1, -2))                     # [rows, kv_heads, group, width]
    scores.mul_(scale).add_(attention_mask[..., :width])
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)                                               # [rows, kv_heads, group, dim]
    return out.view(rows, 1, heads, dim), None


def sdpa_gqa_decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Experimental: ``decode_attention``'s contract, a decode step's call computed by torch's SDPA with
    ``enable_gqa=True`` (no ``repeat_kv`` copy; which backend runs it is torch's choice), any other by
    transformers' SDPA. Shapes as ``decode_attention``."""
    refuse_sinks(module, kwargs)
    if not _is_decode_call(query, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask[..., :key.shape[2]], scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None                                               # [rows, 1, heads, dim]


for _name, _function in ((DECODE_ATTENTION, decode_attention), (SDPA_GQA_DECODE_ATTENTION, sdpa_gqa_decode_attention)):
    AttentionInterface.register(_name, _function)
    AttentionMaskInterface.register(_name, sdpa_mask)  # what a 2-D mask becomes, as for SDPA


def attention_dispatch_problem(model: torch.nn.Module) -> str | None:
    """Why the rollout engine cannot run ``model``'s attention exactly, or None where it can: none of its modules'
    forwards looks its attention function up in transformers' registry (``ALL_ATTENTION_FUNCTIONS``), which the
    engine's decode and packed-prefill attention are registered in (``instead_of_sdpa``) and whose functions take
    the slot cache's 4-D additive mask. In transformers 5.24 Falcon's attention picks its kernel by comparing the
    implementation's name with "sdpa", and BLOOM's and MPT's build their ALiBi biases from a 2-D mask."""
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
        if code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names:
            return None
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    return (f"{type(model).__name__} ({model_type}) does not look its attention up in transformers' attention "
            "interface (ALL_ATTENTION_FUNCTIONS), where the engine's decode and packed-prefill attention are "
            "registered and whose functions take the slot cache's 4-D mask")


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


def float32_scores(device: torch.device) -> bool:
    """Whether ``decode_attention`` writes half-precision scores in float32 on ``device``: its matmul can
    (``torch.bmm``'s ``out_dtype``, on CUDA in recent torch builds). Probed once per device on two tiny tensors,
    keyed as a tensor's ``device`` reads (``cuda:0``, never bare ``cuda``), which ``decode_attention`` looks up."""
    device = indexed_device(device)
    if device not in _FLOAT32_SCORES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False  # not probed inside a capture; the eager steps before it probe
        probe = torch.ones(1, 1, 2, dtype=torch.bfloat16, device=device)
        try:
            torch.bmm(probe, probe.transpose(1, 2), out_dtype=torch.float32)
            _FLOAT32_SCORES[device] = True
        except (RuntimeError, NotImplementedError, TypeError):
            _FLOAT32_SCORES[device] = False
    return _FLOAT32_SCORES[device]


@contextlib.contextmanager
def step_attention(model: torch.nn.Module, kernel: str = "matmul") -> Iterator[None]:
    """Within the block, ``model``'s attention layers call the decode ``kernel`` ("matmul": ``decode_attention``,
    "sdpa_gqa": ``sdpa_gqa_decode_attention``). Nothing happens when the model's attention is not SDPA
    (``instead_of_sdpa``)."""
    if kernel not in _REGISTERED:
        raise ValueError(f"decode attention kernel {shown_value(kernel)} is not known; use one of "
                         f"{list(DECODE_KERNELS)}")
    if kernel == "matmul":
        float32_scores(next(model.parameters()).device)  # probed here, before any traced or captured call reads it
    with instead_of_sdpa(model, _REGISTERED[kernel]):
        yield
