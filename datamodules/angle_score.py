"""GAIN-RL's prompt score ("Angles Don't Lie", arXiv 2506.02281): the angle concentration of a prompt's token states.

For a prompt of n tokens with hidden states h_1..h_n, the score is the mean pairwise cosine similarity over the
n (n - 1) ordered pairs i != j (the diagonal, always 1, is excluded):

    score = sum_{i != j} cos(h_i, h_j) / (n (n - 1)) = (||sum_i u_i||^2 - sum_i ||u_i||^2) / (n (n - 1)),

with u_i = h_i / ||h_i||, so no n x n matrix is built. Exactly which vectors:

- Tokens: every token of the prompt as given (the caller's token ids, chat template and special tokens included);
  the left padding added for micro-batching is excluded through the attention mask, so a padded prompt scores the
  same as the prompt alone. A one-token prompt scores 1.0 (a vector is perfectly concentrated with itself); an
  empty prompt is an error.
- Layer: ``model(..., output_hidden_states=True).hidden_states[-1]``. In transformers 5 that entry is tied to
  ``last_hidden_state``, i.e. the output of the final norm (``model.model.norm`` for Llama/Qwen2), the vector the
  LM head reads; it is *not* the raw residual stream of the last decoder layer (tests pin this).
- One prefill per prompt under ``torch.no_grad`` with the model in eval mode (its previous mode is restored);
  prompts are micro-batched by length (longest first, to waste little padding) with left padding, the attention
  mask, and position ids counted from each prompt's first real token, so padding changes neither positions nor
  attention. Only the last position's logits are computed when the model accepts ``logits_to_keep``.

The authors' code differs: it hooks the *input* of the last layer's ``mlp.up_proj`` (the last decoder layer's
post-attention norm), keeps the diagonal, and for the offline ranking combines prompt segments (system prompt vs
question) with hand-set weights and offsets. We keep the paper's plain definition (mean pairwise cosine of the last
layer's token states) because it is model-agnostic and exactly testable.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_grpo.runtime.models import accepts
from lit_grpo.runtime.validation import check_int


def mean_pairwise_cosine(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cosine similarity over the ordered pairs i != j of each row's real tokens.

    Args:
        hidden: ``[B, T, H]`` token hidden states.
        mask: ``[B, T]`` bool or 0/1, true for real tokens (padding excluded). Every row needs a real token.
    Returns:
        ``[B]`` float64: (||sum u_i||^2 - sum ||u_i||^2) / (n (n - 1)) with u_i = h_i / ||h_i||; 1.0 where n = 1.
    """
    mask = mask.bool()
    unit = torch.nn.functional.normalize(hidden.float(), dim=-1).double()
    # where(), not a product: the hidden states of padding positions are never read, even if they are not finite.
    unit = torch.where(mask[..., None], unit, torch.zeros((), dtype=unit.dtype, device=unit.device))
    total = unit.sum(dim=1)  # [B, H]
    self_dots = unit.pow(2).sum(dim=(1, 2))  # [B]; n, except for zero vectors, whose cosines count as 0
    n = mask.sum(dim=1).double()
    pairs = n * (n - 1)
    mean = (total.pow(2).sum(dim=-1) - self_dots) / pairs.clamp(min=1)
    return torch.where(n > 1, mean, torch.ones_like(mean))


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into ``input_ids [B, T]`` (long) and ``mask [B, T]`` (bool, true for real tokens)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        mask[row, width - len(ids):] = True
    return input_ids, mask


def _device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def last_hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One prefill; returns ``hidden_states[-1]`` ``[B, T, H]`` (after the final norm in transformers 5).

    Position ids count from each row's first real token, so left padding shifts nothing (models with absolute
    position embeddings included).
    """
    position_ids = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
    kwargs: dict[str, Any] = dict(input_ids=input_ids, attention_mask=mask.long(), position_ids=position_ids,
                                  output_hidden_states=True, use_cache=False, return_dict=True)
    if accepts(model, "logits_to_keep"):  # the scores need no logits; skip the [B, T, vocab] LM-head output
        kwargs["logits_to_keep"] = 1
    return model(**kwargs).hidden_states[-1]


def angle_concentration(model: torch.nn.Module, tokenizer: Any, prompts: list[list[int]],
                        batch_size: int = 8) -> torch.Tensor:
    """GAIN-RL's angle concentration of each prompt: see the module docstring for the exact tokens and layer.

    Args:
        model: a causal LM (transformers); left in the train/eval mode it had.
        tokenizer: its tokenizer; only ``pad_token_id`` (else ``eos_token_id``, else 0) is read. The pad id never
            reaches a score: padding is masked out.
        prompts: ``N`` lists of token ids (at least one token each).
        batch_size: prompts per prefill micro-batch.
    Returns:
        ``[N]`` float32 on the CPU, in the order of ``prompts``.
    """
    batch_size = check_int("batch_size", batch_size, 1)
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of token id lists, got {type(prompts).__name__}")
    for i, ids in enumerate(prompts):
        if len(ids) == 0:
            raise ValueError(f"prompts[{i}] is empty; angle concentration needs at least one token per prompt")
    pad_id = next((t for t in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None))
                   if isinstance(t, int)), 0)
    device = _device(model)
    # Longest first: neighbours in a micro-batch have similar lengths, so little compute goes to padding.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    scores = torch.empty(len(prompts), dtype=torch.float32)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                input_ids, mask = left_pad([list(prompts[i]) for i in rows], pad_id)
                input_ids, mask = input_ids.to(device), mask.to(device)
                hidden = last_hidden_states(model, input_ids, mask)
                scores[rows] = mean_pairwise_cosine(hidden, mask).float().cpu()
    finally:
        model.train(was_training)
    return scores
