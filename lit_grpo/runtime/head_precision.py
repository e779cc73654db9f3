"""The output head in float32 (TRL's ``cast_lm_head_to_fp32``, the ScaleRL recipe): ``cast_lm_head_to_fp32(model)``
makes the language-model head compute its logits in float32 from float32 weights, whatever the model's dtype
(``model.dtype: bfloat16``) and whatever autocast is on (bf16-mixed, 16-mixed).

Why: a bfloat16 logit keeps 8 bits of mantissa, so two logits of 20 that differ by 0.05 round to one value, and the
log-probs the policy loss compares (the new policy's, the sampler's, the reference's) differ by that rounding more
than by the update.

How: the head's class becomes ``Float32Head``, an ``nn.Linear`` whose forward turns autocast off and multiplies the
hidden states, cast to float32, by its float32 weight. Everything that computes logits calls the head module: the
model's own forward (the rollout engine's prefill and decode steps, the full logits, the shared-prefix forward) and
the update's chunked log-probs, so the one module decides for all of them (``head_compute_dtype`` says what it decided,
for the places that compute with the head's weight themselves). A weight the head shares with the input embedding
(tied) becomes float32 too, as in TRL: the embedding's output is cast back to the dtype the model held it in, so the
layers see what they saw before. A float64 model keeps its float64 head: the cast never narrows.

What cannot honour it is refused with a ValueError: a head that is not a plain ``nn.Linear`` (another class may
compute otherwise), a LoRA adapter on the head (``check_float32_head``: it would add its product in the autocast
dtype) and a head FSDP2 has sharded (its weight a DTensor): FSDP2 gathers a sharded weight for each forward in its
``MixedPrecisionPolicy``'s ``param_dtype`` (bfloat16 under bf16-mixed), with the root's other weights where the head
is tied, so the head would compute from a rounded weight whatever its class. For that reason
``shard_decoder_layers`` (lit_grpo.runtime.distributed) refuses a float32 head where its gather would narrow it.
"""

from __future__ import annotations

import torch


class Float32Head(torch.nn.Linear):
    """An output head whose logits are computed in float32 (or wider: a float64 head stays float64) from its weight
    in that dtype, with autocast off: ``[..., H]`` hidden states in any dtype -> ``[..., V]`` float32 logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            weight, bias = _at_least_float32(self.weight), _at_least_float32(self.bias)
            return torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias)


def _at_least_float32(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor`` itself where it is float32 or float64 (cast_lm_head_to_fp32 made the head's so: no cast inside a
    decode step), else a float32 copy (a model narrowed after the cast still gets float32 logits)."""
    if tensor is None or tensor.dtype in (torch.float32, torch.float64):
        return tensor
    return tensor.float()


def _widened(dtype: torch.dtype) -> torch.dtype:
    """float32 for a narrower float dtype, ``dtype`` itself for float32 and float64."""
    return torch.promote_types(dtype, torch.float32)


def cast_lm_head_to_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model``'s output head a ``Float32Head`` with float32 weights (in place; ``model`` is returned). A tied
    input embedding shares the float32 weight and casts its output back to the model's dtype. Idempotent.

    Call it before wrapping the model with peft (``modules_to_save`` copies then keep the float32 head) and check
    afterwards with ``check_float32_head``.

    Raises:
        ValueError: the model has no output head, or its head is not a plain ``torch.nn.Linear``.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, Float32Head):
        return model
    if type(head) is not torch.nn.Linear:
        what = "no output head (get_output_embeddings())" if head is None else \
            f"an output head of type {type(head).__module__}.{type(head).__qualname__}"
        raise ValueError(f"cast_lm_head_to_fp32 needs a plain torch.nn.Linear output head; "
                         f"{type(model).__name__} has {what}, whose forward cannot be made to compute in float32; "
                         "set cast_lm_head_to_fp32: false")
    if is_sharded(head.weight):
        raise ValueError(f"cast_lm_head_to_fp32 needs an unsharded output head; {type(model).__name__}'s is sharded "
                         "by FSDP2 (its weight is a DTensor), which gathers it for each forward in its "
                         "MixedPrecisionPolicy's param_dtype, so the head would not compute from float32 weights; set "
                         "cast_lm_head_to_fp32: false, or do not shard the model (fsdp: false)")
    model_dtype = head.weight.dtype
    head.to(_widened(model_dtype))  # in place: a tied embedding holds the same Parameter, now float32 too
    head.__class__ = Float32Head  # the same module (hooks, ties, its name): only its forward changes
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is not None and getattr(embedding, "weight", None) is head.weight and \
            model_dtype != head.weight.dtype:
        embedding.register_forward_hook(_ModelDtypeOutput(model_dtype))
    return model


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2 shards a parameter into one)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class _ModelDtypeOutput:
    """A forward hook on an embedding tied to a float32 head: its float32 output back in ``dtype``, the model's, so
    the layers compute as without the cast (a class, not a closure, so deep copies of the model keep it)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return output.to(self.dtype) if output.dtype == _widened(self.dtype) else output


def check_float32_head(model: torch.nn.Module) -> None:
    """Raise where ``model``'s output head no longer computes in float32 after wrapping (a peft LoRA adapter on it:
    its product would be added in the autocast dtype, and merging it would change the float32 weight's values)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no peft: no adapter
        return
    if isinstance(model.get_output_embeddings(), BaseTunerLayer):
        raise ValueError("cast_lm_head_to_fp32 does not support a LoRA adapter on the output head (the adapter's "
                         "product would be computed in the autocast dtype): remove the head (e.g. 'lm_head') from "
                         "peft_config.target_modules, or set cast_lm_head_to_fp32: false")


def computes_in_float32(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an output head that computes its logits in float32 from its own weight, with autocast
    off (``cast_lm_head_to_fp32``): nothing may cast its weight for it."""
    return isinstance(module, Float32Head)


def head_compute_dtype(head: torch.nn.Module, device_type: str) -> torch.dtype:
    """The dtype the output head's matmul runs in here: float32 for a ``Float32Head`` (float64 for a float64 one),
    else the autocast dtype where autocast is on for ``device_type``, else its weight's."""
    if computes_in_float32(head):
        return _widened(head.weight.dtype)
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return head.weight.dtype


def layers_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of ``model``'s weights, leaving out a ``Float32Head``'s (tied or not): the dtype its layers, its
    keys and values compute in without autocast. float32 for a model without floating weights."""
    pinned = {id(module.weight) for module in model.modules() if computes_in_float32(module)}
    return next((p.dtype for p in model.parameters() if p.is_floating_point() and id(p) not in pinned),
                torch.float32)
