"""The policy's features of a token recording, as the rollout engine computes them live, from one forward per group.

The engine hands a length predictor two features (``lit_grpo/sampling/rollout_loop.py``):

- a prompt's feature: the mean of the last hidden states of its first ``P - 1`` tokens (the prefill);
- a sample's token feature at k: the last hidden state of the decode step that generated its k-th token, whose
  input is the token before it, i.e. position ``P - 2 + k`` of ``prompt + completion``.

A causal model's hidden state at a position depends only on the tokens up to it, so one teacher-forced forward of
``prompt + completion[:K - 1]`` per sample gives every feature with k <= K. The engine's step computes the same
values with its slot cache (``tests/test_predictor_study.py`` checks the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RecordingFeatures:
    """``prompt``: ``[B, H]``; ``token[k]``: ``[B, G, H]`` (zeros where a sample ended before token k + 1, so
    never reached a probe at k)."""

    prompt: torch.Tensor
    token: dict[int, torch.Tensor]


@torch.inference_mode()
def recording_features(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[list[int]]],
                       probe_tokens: list[int], pad_id: int = 0) -> RecordingFeatures:
    """Features of every prompt and of every sample at each k in ``probe_tokens`` (module docstring)."""
    if not probe_tokens or min(probe_tokens) < 1:
        raise ValueError(f"probe_tokens={probe_tokens!r} must be a non-empty list of integers >= 1")
    device = next(model.parameters()).device
    reach = max(probe_tokens) - 1  # completion tokens a probe at the largest k has fed
    prompts, tokens = [], {k: [] for k in probe_tokens}
    for prompt, group in zip(prompt_ids, completion_ids):
        rows = [prompt + completion[:reach] for completion in group]
        width = max(map(len, rows))
        batch = torch.tensor([row + [pad_id] * (width - len(row)) for row in rows], device=device)
        # Right padding: a causal model's positions before the padding do not see it.
        out = model(input_ids=batch, output_hidden_states=True, logits_to_keep=1)  # no logits wanted
        hidden = out.hidden_states[-1].float()  # [G, T, H]
        P = len(prompt)
        prompts.append(hidden[0, : P - 1].mean(0) if P > 1 else torch.zeros(hidden.shape[-1], device=device))
        for k in probe_tokens:
            reached = torch.tensor([len(c) > k for c in group], device=device)
            position = min(P - 2 + k, hidden.shape[1] - 1)  # beyond every row: no sample reached k
            tokens[k].append(hidden[:, position] * reached[:, None])
    return RecordingFeatures(torch.stack(prompts).cpu(), {k: torch.stack(v).cpu() for k, v in tokens.items()})
