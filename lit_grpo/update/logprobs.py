"""Log-probs (and entropies) of completion tokens under a causal LM, with the vocabulary-sized logits bounded.

The update's largest single tensors are the logits: ``[m, T, V]`` float32 for a micro-batch of m completions of T
tokens, the vocabulary V many times the hidden size in current decoders. Through ``logsumexp`` and
``gather`` autograd keeps them for the backward pass and adds three more tensors of that size in it, all while the
decoder's activations are alive. ``completion_logps`` never builds them: the decoder's final hidden states of the
real (unpadded) completion tokens are cut into chunks of about ``LOGITS_CHUNK_BYTES`` of logits (by device type),
and each chunk goes through the model's own output head inside ``torch.utils.checkpoint``, so only one chunk's
logits exist at a time, in the forward pass and again (recomputed) in the backward pass. The recomputation costs
one more LM-head matmul per token: a third of the head's share of a forward, counted against a forward + backward.

Under mixed precision with float32 master weights, autocast (Lightning's keeps no cast cache) would cast the head's
weight to bfloat16 in every chunk and again in every recomputation, a ``[V, H]`` copy each time; the chunks then go
through ``_CastOnceHeadLogps``, which casts it once per micro-batch and gives the same log-probs and gradients. A
head cast to float32 (``cast_lm_head_to_fp32``, lit_grpo.runtime.head_precision) computes in its weight's dtype
whatever the autocast: nothing to cast, its chunks go through the head itself (``head_compute_dtype`` decides).

The chunked path needs the output head applied to the last hidden state, times ``logits_multiplier`` (Granite's
``1 / logits_scaling``, Cohere's ``logit_scale``: folded into the temperature the chunks divide by), to BE the model's
logits. That holds for Llama, Qwen2/3, Mistral and most decoders, but not for models that post-process logits
otherwise: ``head_reproduces_logits`` checks it once per model on four tokens (a config's
``final_logit_softcapping``, Gemma 2's, answers no unchecked: the check's tolerance would pass a small model's
capped logits), and ``completion_logps`` falls back to the full logits (``completion_logits`` + ``token_logps``)
where it fails or the model cannot return hidden states with ``logits_to_keep``.

The entropies are a metric (and the high-entropy mask's ranking), without a gradient, unless ``entropy_grad`` asks
for one (the entropy bonus, lit_grpo.update.entropy_bonus): then every path gives them the gradient of
``-sum(p log p)`` from the logits they already keep or recompute (``_EntropyOfLogits``, or ``_CastOnceHeadLogps``'s
backward), one chunk (or row) at a time; without it nothing more is computed or kept than for the log-probs.

With ``shared_prefix`` the states (or logits) come from ``lit_grpo.update.shared_prefix``: each distinct prompt of the
micro-batch goes forward once and its completions attend to its keys and values; the head, the chunks and the
values are the same.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from lit_grpo.runtime.distributed import is_fsdp_sharded
from lit_grpo.runtime.head_precision import head_compute_dtype
from lit_grpo.runtime.models import accepts, eval_mode
from lit_grpo.runtime.validation import shown_setting
from lit_grpo.update.shared_prefix import (layer_parameters, prompt_groups, saved_positions, shared_prefix_outputs,
                                          shared_prefix_pays)

#: Float32 logits per chunk, by device type. A CPU's: 170 tokens of a 49k vocabulary, 55 of a 152k one. A GPU's are
#: larger: a chunk of 55 tokens is a matmul too small to keep it busy, and a micro-batch would launch a hundred; one
#: chunk's logits stay far below an update's peak there (a GPU other than CUDA takes CUDA's).
LOGITS_CHUNK_BYTES = {"cpu": 32 << 20, "cuda": 512 << 20}

_HEAD_CHECKS: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


#: What a micro-batch dict holds for the log-probs (``RolloutBatch.micro_batch`` gives these and more).
MICRO_BATCH_KEYS = ("input_ids", "attention_mask", "position_ids", "completion_ids", "completion_mask")


def check_micro_batch(micro: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming a missing key or a tensor of the wrong shape in a micro-batch made by hand:
    ``input_ids``, ``attention_mask``, ``position_ids`` ``[m, P + T']``; ``completion_ids``, ``completion_mask``
    ``[m, T']``, the last ``T'`` columns of the input (not compared: that would wait on the device)."""
    missing = [key for key in MICRO_BATCH_KEYS if key not in micro]
    if missing:
        raise ValueError(f"the micro-batch lacks {missing}; it holds {', '.join(MICRO_BATCH_KEYS)} "
                         "(RolloutBatch.micro_batch gives them)")
    inputs, completions = micro["input_ids"], micro["completion_ids"]
    for name, tensor, like, of in (("attention_mask", micro["attention_mask"], inputs, "input_ids"),
                                   ("position_ids", micro["position_ids"], inputs, "input_ids"),
                                   ("completion_mask", micro["completion_mask"], completions, "completion_ids")):
        if tensor.shape != like.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {of}' {tuple(like.shape)}")
    if (inputs.dim() != 2 or completions.dim() != 2 or completions.shape[0] != inputs.shape[0]
            or completions.shape[1] >= inputs.shape[1]):
        raise ValueError(f"completion_ids {tuple(completions.shape)} must be the last T' < {inputs.shape[-1]} columns "
                         f"of input_ids {tuple(inputs.shape)} (a prompt token first), [m, T'] beside [m, P + T']")


def _model_inputs(micro: dict[str, Any]) -> dict[str, Any]:
    return dict(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                position_ids=micro["position_ids"], use_cache=False)


def shares_prefix(model: torch.nn.Module, micro: dict[str, Any], shared_prefix: bool | str) -> bool:
    """Whether the shared forward runs on ``micro``: asked for (``shared_prefix``), some prompt repeats, and under
    "auto" it spares enough work to pay for its second pass (``shared_prefix_pays``). Read from shapes and the
    micro-batch's host-side keys: the device is not waited on."""
    if not shared_prefix:
        return False
    first, group = prompt_groups(micro)
    if len(first) == len(group):
        return False
    per_layer = layer_parameters(model) if shared_prefix == "auto" else 0
    if not per_layer:  # asked for outright, or a model whose layers transformers does not know: shares
        return True
    saved = saved_positions(len(group), len(first), micro["input_ids"].shape[1] - micro["completion_ids"].shape[1])
    return shared_prefix_pays(saved, per_layer, micro["input_ids"].device.type)


def _shared_groups(model: torch.nn.Module, micro: dict[str, Any],
                   shared_prefix: bool | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``prompt_groups(micro)`` where ``shares_prefix``, else None."""
    return prompt_groups(micro) if shares_prefix(model, micro, shared_prefix) else None


def completion_logits(model: torch.nn.Module, micro: dict[str, Any], temperature: float = 1.0,
                      shared_prefix: bool | str = False) -> torch.Tensor:
    """``[m, T', V]`` logits predicting each completion token of a micro-batch (``RolloutBatch.micro_batch``).

    Only the last ``T' + 1`` positions go through the LM head when the model takes ``logits_to_keep``; logits
    are divided by the sampling temperature (0 = greedy counts as 1), as the sampler did. ``shared_prefix``: each
    distinct prompt goes forward once (lit_grpo.update.shared_prefix; "auto": where that pays).
    """
    check_micro_batch(micro)
    return _completion_logits(model, micro, temperature, shared_prefix)


def _completion_logits(model: torch.nn.Module, micro: dict[str, Any], temperature: float,
                       shared_prefix: bool | str) -> torch.Tensor:
    """:func:`completion_logits` of a micro-batch checked already."""
    num_tokens = micro["completion_ids"].shape[1]
    groups = _shared_groups(model, micro, shared_prefix)
    if groups is not None:
        logits = shared_prefix_outputs(model, micro, hidden=False, groups=groups)
    else:
        kwargs = _model_inputs(micro)
        if accepts(model, "logits_to_keep"):
            kwargs["logits_to_keep"] = num_tokens + 1
        logits = model(**kwargs).logits[:, -(num_tokens + 1):-1, :]
    if temperature and temperature != 1.0:
        logits = logits / temperature
    return logits


def token_logps(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``[m, T]`` log-probs of ``token_ids`` ``[m, T]`` (integers) under ``logits`` ``[m, T, V]``, in the logits'
    dtype where it is float32 or float64, else float32.

    float32/64 logits: ``gather - logsumexp`` on the whole tensor (no ``[m, T, V]`` copy). Half-precision logits:
    one row at a time through ``log_softmax`` in their own dtype (as TRL's selective_log_softmax), so no float32
    copy of the logits is kept for the backward pass (for a 150k vocabulary that copy would be GBs).
    """
    if token_ids.shape != logits.shape[:-1]:  # [m, 1] ids would broadcast against the logsumexp's [m, T]
        raise ValueError(f"token_ids has shape {tuple(token_ids.shape)}, expected the logits' rows "
                         f"{tuple(logits.shape[:-1])} (logits [m, T, V] = {tuple(logits.shape)})")
    if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be integer ids, got {token_ids.dtype}")
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, token_ids.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    rows = [torch.gather(torch.log_softmax(row, dim=-1), -1, ids.unsqueeze(-1)).squeeze(-1)
            for row, ids in zip(logits, token_ids)]
    return torch.stack(rows).float()


@torch.no_grad()
def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``[m, T]`` entropy of each position's distribution (float32, no grad; one row at a time to bound memory)."""
    return torch.stack([_row_entropy(row.float()) for row in logits.detach()])


class _EntropyOfLogits(torch.autograd.Function):
    """``[..., T]`` entropies of ``[..., T, V]`` logits (computed in float32 or wider, as ``token_entropy``, one
    ``[T, V]`` row at a time), differentiable. Autograd of ``-(p * log p).sum()`` would keep two more float32 tensors
    of the logits' size until the backward; this keeps only the logits (which the log-probs' backward keeps anyway)
    and recomputes ``log p`` there: ``dH/dz = -p (log p + H)``. One function for every row, whose backward writes each
    row's gradient into one tensor of the logits' shape and dtype: a function per row would hold every row's
    gradient until autograd stacks them, a second tensor of that size."""

    @staticmethod
    def forward(ctx, logits):
        entropy = torch.stack([_row_entropy(row) for row in _rows(logits)]).reshape(logits.shape[:-1])
        ctx.save_for_backward(logits, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad_entropy):
        logits, entropy = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for out, row, row_entropy, row_grad in zip(_rows(grad), _rows(logits), _rows(entropy.unsqueeze(-1)),
                                                   _rows(grad_entropy.unsqueeze(-1))):
            log_probs = torch.log_softmax(row.to(row_entropy.dtype), dim=-1)
            out.copy_(log_probs.exp().mul_(log_probs.add_(row_entropy)).mul_(-row_grad))
        return grad


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[..., T, V]`` as ``[rows, T, V]`` (a view where the layout allows)."""
    return tensor.reshape(-1, *tensor.shape[-2:])


def _row_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``[T]`` entropies of ``[T, V]`` logits, in float32 or wider."""
    log_probs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def entropy_with_grad(logits: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` entropies of ``[..., T, V]`` logits with their gradient (``_EntropyOfLogits``), one ``[T, V]`` row
    at a time, as ``token_entropy``, so no float32 copy of the whole is made."""
    return _EntropyOfLogits.apply(logits)


def _chunk_logps(head: torch.nn.Module, hidden: torch.Tensor, token_ids: torch.Tensor, temperature: float,
                 entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n]`` log-probs (differentiable) and ``[n]`` entropies (differentiable with ``entropy_grad``) of
    ``token_ids`` given ``[n, H]`` states."""
    logits = head(hidden)
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature and temperature != 1.0:
        logits = logits / temperature
    log_normalizer = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - log_normalizer
    if entropy_grad:
        return logps, _EntropyOfLogits.apply(logits)
    with torch.no_grad():
        log_probs = logits - log_normalizer.unsqueeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return logps, entropy


def _low_precision_logits(states: torch.Tensor, low_weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[n, V]`` float32 logits of ``[n, H]`` states by the head's ``[V, H]`` weight in its autocast dtype: what
    autocast's ``F.linear`` computes (both operands in that dtype), upcast, tempered."""
    logits = torch.nn.functional.linear(states.to(low_weight.dtype), low_weight).float()
    return logits / temperature if temperature and temperature != 1.0 else logits


class _CastOnceHeadLogps(torch.autograd.Function):
    """``_chunk_logps`` over every chunk of a micro-batch under autocast, with the head's weight cast to the autocast
    dtype once (kept for the backward) instead of in every chunk's forward and recomputation. The backward
    recomputes each chunk's logits and applies autograd's own formulas in autograd's order (the chunks last to
    first, each weight gradient upcast and summed in float32), so log-probs and gradients are those of the per-chunk
    casts. With ``entropy_grad`` the entropies are differentiable too: the backward adds their gradient to each
    chunk's logits' (``dH/dz = -p (log p + H)``), from the same recomputed logits."""

    @staticmethod
    def forward(ctx, hidden, weight, token_ids, temperature: float, rows: int, dtype: torch.dtype,
                entropy_grad: bool = False):
        low = weight.detach().to(dtype)
        logps, entropies, normalizers = [], [], []
        with torch.autocast(hidden.device.type, enabled=False):
            for states, ids in zip(hidden.split(rows), token_ids.split(rows)):
                logits = _low_precision_logits(states, low, temperature)
                log_normalizer = torch.logsumexp(logits, dim=-1)
                logps.append(logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - log_normalizer)
                log_probs = logits - log_normalizer.unsqueeze(-1)
                entropies.append(-(log_probs.exp() * log_probs).sum(dim=-1))
                normalizers.append(log_normalizer)
        entropy = torch.cat(entropies)
        ctx.save_for_backward(hidden, low, token_ids, torch.cat(normalizers), entropy if entropy_grad else None)
        ctx.temperature, ctx.rows, ctx.weight_dtype = temperature, rows, weight.dtype
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return torch.cat(logps), entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, low, token_ids, log_normalizer, entropy = ctx.saved_tensors
        temperature, rows = ctx.temperature, ctx.rows
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        for start in reversed(range(0, hidden.shape[0], rows)):
            part = slice(start, start + rows)
            states, ids, grad = hidden[part], token_ids[part], grad_logps[part]
            logits = _low_precision_logits(states, low, temperature)
            # logsumexp's backward (its output entered with -grad), then gather's, then the temperature's
            if entropy is None:
                grad_logits = (-grad).unsqueeze(-1) * (logits - log_normalizer[part].unsqueeze(-1)).exp()
            else:  # and the entropy's: -p (log p + H) per unit of its gradient
                log_probs = logits - log_normalizer[part].unsqueeze(-1)
                probs = log_probs.exp()
                scale = log_probs.add_(entropy[part].unsqueeze(-1)).mul_(-grad_entropy[part].unsqueeze(-1))
                grad_logits = probs.mul_(scale.sub_(grad.unsqueeze(-1)))
            grad_logits = grad_logits.scatter_add(-1, ids.unsqueeze(-1), grad.unsqueeze(-1))
            if temperature and temperature != 1.0:
                grad_logits = grad_logits / temperature
            grad_low = grad_logits.to(low.dtype)
            if grad_hidden is not None:
                grad_hidden[part] = grad_low.mm(low).to(hidden.dtype)
            if ctx.needs_input_grad[1]:
                chunk = states.to(low.dtype).t().mm(grad_low).t().to(ctx.weight_dtype)
                grad_weight = chunk if grad_weight is None else grad_weight.add_(chunk)
        return grad_hidden, grad_weight, None, None, None, None, None


def head_cast_dtype(model: torch.nn.Module, head: torch.nn.Module, hidden: torch.Tensor) -> torch.dtype | None:
    """The dtype the output head computes in (``head_compute_dtype``: the autocast dtype, or float32 for a head
    cast to float32) when its weight is in another one (float32 master weights under bf16-mixed) and
    ``_CastOnceHeadLogps`` can take its place: a plain bias-free ``nn.Linear`` that FSDP2 does not shard (its
    forward would gather the weight); else None. A ``Float32Head``'s weight is in its compute dtype: None."""
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    dtype = head_compute_dtype(head, hidden.device.type)
    return dtype if head.weight.dtype != dtype and not is_fsdp_sharded(model) else None


def _vocab_size(model: torch.nn.Module, head: torch.nn.Module) -> int:
    return int(getattr(head, "out_features", 0) or model.config.vocab_size)


def _text_config(model: torch.nn.Module) -> Any:
    """``model``'s config, its text decoder's where it nests one (a multimodal model's); None where it has none."""
    config = getattr(model, "config", None)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def logits_multiplier(model: torch.nn.Module) -> float:
    """What ``model``'s forward multiplies its output head's result by, read from its config: Granite's
    ``1 / logits_scaling`` times Cohere's ``logit_scale`` (1.0 where it has neither). ``head_reproduces_logits``
    checks it with the head, so a field that means something else in another model sends that one to the full
    logits rather than to wrong ones."""
    config = _text_config(model)
    if config is None:
        return 1.0
    multiplier = 1.0
    scaling, scale = getattr(config, "logits_scaling", None), getattr(config, "logit_scale", None)
    if isinstance(scaling, (int, float)) and not isinstance(scaling, bool) and scaling:
        multiplier /= scaling
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale:
        multiplier *= scale
    return float(multiplier)


def _head_temperature(model: torch.nn.Module, temperature: float) -> float:
    """The temperature the chunks divide the head's output by: the sampling temperature (0, greedy, counts as 1)
    over ``logits_multiplier``."""
    return (temperature or 1.0) / logits_multiplier(model)


@torch.no_grad()
def head_reproduces_logits(model: torch.nn.Module) -> bool:
    """Whether ``output head(hidden_states[-1])`` times ``logits_multiplier`` equals the model's logits (checked once
    per model, 4 tokens). A config's ``final_logit_softcapping`` (Gemma 2's ``cap * tanh(logits / cap)``) answers
    no without the check: at small logits the cap moves them by less than its tolerance, the log-probs by more."""
    if model in _HEAD_CHECKS:
        return _HEAD_CHECKS[model]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    ok = False
    capped = getattr(_text_config(model), "final_logit_softcapping", None) is not None
    if not capped and isinstance(head, torch.nn.Module) and accepts(model, "output_hidden_states"):
        device = next(model.parameters()).device
        ids = (torch.arange(4, device=device) * 7919 % _vocab_size(model, head)).unsqueeze(0)
        try:
            with eval_mode(model):  # dropout would make the two sides differ
                out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
                hidden_states = getattr(out, "hidden_states", None)
                if hidden_states is not None:
                    logits = head(hidden_states[-1]).float() * logits_multiplier(model)
                    ok = torch.allclose(logits, out.logits.float(), rtol=1e-3, atol=1e-3)
        except (TypeError, ValueError, RuntimeError, AttributeError) as error:  # a model whose forward differs
            warnings.warn(f"the output head of {type(model).__name__} could not be checked against its logits "
                          f"({type(error).__name__}: {error}); the update computes each micro-batch's whole logits",
                          RuntimeWarning, stacklevel=3)
            ok = False
    _HEAD_CHECKS[model] = ok
    return ok


def _real_tokens(mask: torch.Tensor, count: int | None) -> torch.Tensor:
    """``[n]`` the flat positions of ``mask``'s true entries in row-major order. ``count`` (their number, where the
    host knows it: ``RolloutBatch.micro_batch``'s ``num_tokens``) spares the wait on the device for it."""
    flat = mask.flatten()
    if count is None:
        return flat.nonzero().squeeze(1)
    return torch.nonzero_static(flat, size=count).squeeze(1)


def completion_logps(model: torch.nn.Module, micro: dict[str, Any], temperature: float = 1.0, *,
                     chunk_bytes: int | None = None, chunked: bool = True, shared_prefix: bool | str = False,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``[m, T']`` log-probs (differentiable) and ``[m, T']`` entropies of a micro-batch's completion tokens; both
    are 0 on padding. The entropies are float32 without a gradient, or with ``entropy_grad`` (the entropy bonus)
    differentiable, in the log-probs' dtype.

    With ``chunked`` (and a model that passes ``head_reproduces_logits``) no ``[m, T', V]`` tensor is built (module
    docstring); otherwise the full logits are computed once. ``chunk_bytes``: a chunk's float32 logits (default:
    ``LOGITS_CHUNK_BYTES`` of the micro-batch's device). With ``shared_prefix`` each distinct prompt goes forward once
    (lit_grpo.update.shared_prefix; "auto": where that pays, from this micro-batch alone: under FSDP2 pass every rank
    the same bool, as ``GRPOModule`` does). Every way the values are the same up to float rounding
    (tests/test_logprobs.py, tests/test_shared_prefix.py).
    """
    check_micro_batch(micro)
    if chunk_bytes is None:
        device_type = micro["input_ids"].device.type
        chunk_bytes = LOGITS_CHUNK_BYTES.get(device_type, LOGITS_CHUNK_BYTES["cuda"])
    if chunk_bytes < 1:
        raise ValueError(f"{shown_setting('chunk_bytes', chunk_bytes)} must be >= 1")
    token_ids, mask = micro["completion_ids"], micro["completion_mask"].bool()
    real = _real_tokens(mask, micro.get("num_tokens"))  # [n] flat positions in [m, T']
    # (with no real token at all the chunks would be empty and the result detached from the model: full path)
    if not (chunked and len(real) and accepts(model, "logits_to_keep") and head_reproduces_logits(model)):
        logits = _completion_logits(model, micro, temperature, shared_prefix)
        logps = token_logps(logits, token_ids) * mask
        entropy = entropy_with_grad(logits).to(logps.dtype) if entropy_grad else token_entropy(logits)
        return logps, entropy * mask
    hidden = _completion_hidden(model, micro, shared_prefix, real)
    logps_of_real, entropy_of_real = _head_logps(model, hidden, token_ids.flatten().index_select(0, real),
                                                 _head_temperature(model, temperature), chunk_bytes, entropy_grad)
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    logps = torch.zeros(mask.numel(), dtype=dtype, device=mask.device)
    logps = logps.index_copy(0, real, logps_of_real.to(dtype)).view(mask.shape)
    if entropy_grad:
        entropy = torch.zeros(mask.numel(), dtype=dtype, device=mask.device)
        return logps, entropy.index_copy(0, real, entropy_of_real.to(dtype)).view(mask.shape)
    entropy = torch.zeros(mask.numel(), dtype=torch.float32, device=mask.device)  # a metric: float32, as token_entropy
    entropy = entropy.index_copy(0, real, entropy_of_real.float()).view(mask.shape)
    return logps, entropy.detach()


def _completion_hidden(model: torch.nn.Module, micro: dict[str, Any], shared_prefix: bool | str,
                       real: torch.Tensor) -> torch.Tensor:
    """``[n, H]`` the decoder's final hidden states that predict the ``n`` real completion tokens (``real``: their
    flat positions in ``[m, T']``), each prompt forward once where ``shared_prefix`` shares it."""
    groups = _shared_groups(model, micro, shared_prefix)
    if groups is not None:
        hidden = shared_prefix_outputs(model, micro, hidden=True, groups=groups)
    else:  # logits_to_keep=1: the model's own LM head runs on one position only; _head_logps does the rest
        num_tokens = micro["completion_ids"].shape[1]
        out = model(**_model_inputs(micro), output_hidden_states=True, logits_to_keep=1)
        hidden = out.hidden_states[-1][:, -(num_tokens + 1):-1]
        del out
    return hidden.flatten(0, 1).index_select(0, real)


def _head_logps(model: torch.nn.Module, hidden: torch.Tensor, token_ids: torch.Tensor, temperature: float,
                chunk_bytes: int, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n]`` log-probs of ``token_ids`` (``[n]``) and ``[n]`` entropies from ``hidden`` (``[n, H]``) through the
    model's output head, in chunks of about ``chunk_bytes`` of float32 logits: only one chunk's logits exist at a
    time, in the forward and again (recomputed) in the backward."""
    head = model.get_output_embeddings()
    rows = max(1, chunk_bytes // (4 * _vocab_size(model, head)))
    cast_dtype = head_cast_dtype(model, head, hidden)
    if cast_dtype is not None:  # the head's weight cast once for every chunk, not in each chunk and its recomputation
        return _CastOnceHeadLogps.apply(hidden, head.weight, token_ids, temperature, rows, cast_dtype, entropy_grad)
    logp_parts, entropy_parts = [], []
    for states, ids in zip(hidden.split(rows), token_ids.split(rows)):
        if torch.is_grad_enabled():  # the backward's recomputation redoes the entropy too: cheap next to the matmul
            logps, entropy = checkpoint(_chunk_logps, head, states, ids, temperature, entropy_grad,
                                        use_reentrant=False)
        else:
            logps, entropy = _chunk_logps(head, states, ids, temperature)
        logp_parts.append(logps)
        entropy_parts.append(entropy)
    return torch.cat(logp_parts), torch.cat(entropy_parts)
