"""Turning next-token logits into tokens: temperature, top-k, top-p, forced lengths, and the sampling log-probs.

Every function here keeps the shapes it is given and never reads a value back to the host, so the whole sampling
runs inside the decode step's CUDA graph.
"""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k and outside the top-p nucleus.

    Args:
        logits: ``[n, V]`` float, already divided by the temperature.
        top_k: keep the k most likely tokens (0 keeps all).
        top_p: keep the smallest set whose probability reaches top_p (1.0 keeps all; the most likely token always
            stays).
    Returns:
        ``[n, V]`` logits with filtered entries at -inf.
    """
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass strictly before it already reaches top_p.
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverse-CDF sampling with the row's own uniform.

    Inverse-CDF with an externally supplied uniform (rather than ``torch.multinomial``) is what lets every row draw
    from its own random stream inside a shared batch.

    Args:
        logits: ``[n, V]`` raw next-token logits.
        uniforms: ``[n]`` float64 in (0, 1).
        temperature: 0 means greedy (argmax); the uniforms are then unused.
    Returns:
        tokens ``[n]`` int64 and their log-probs ``[n]`` float32 under the distribution they were drawn from
        (after temperature and filtering; for greedy, the untempered softmax).
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    logits = filter_logits(logits / temperature, top_k, top_p)
    logprobs = torch.log_softmax(logits, -1)
    cdf = logprobs.exp().double().cumsum(-1)
    targets = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, targets).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def force_lengths(logits: torch.Tensor, token_index: torch.Tensor, forced_length: torch.Tensor,
                  is_eos: torch.Tensor) -> torch.Tensor:
    """Replay recorded lengths: EOS is impossible before a row's forced length and certain at it.

    Args:
        logits: ``[n, V]`` raw next-token logits.
        token_index: ``[n]`` int64, the index of the token each row draws now (tokens generated so far).
        forced_length: ``[n]`` int64 completion length of each row's sample; 0 leaves the row alone.
        is_eos: ``[V]`` bool, the stop tokens.
    Returns:
        ``[n, V]`` float logits: at the last token only EOS ids stay (at logit 0, so they are equally likely),
        before it EOS ids are at -inf.
    """
    logits = logits.float()
    forced = forced_length > 0
    last = (forced & (token_index + 1 == forced_length)).unsqueeze(1)
    before = (forced & (token_index + 1 < forced_length)).unsqueeze(1)
    eos = is_eos.unsqueeze(0)
    logits = torch.where(last & eos, 0.0, logits)
    return logits.masked_fill((last & ~eos) | (before & eos), float("-inf"))
