"""Turning next-token logits into tokens: the repetition penalty, temperature, top-k, top-p, min-p, forced lengths,
replayed tokens, and the sampling log-probs.

Every function here keeps the shapes it is given and never reads a value back to the host, so the whole sampling
runs inside the decode step's CUDA graph; but for top-p's search for its nucleus on a CPU (``top_p_floor``), where
no graph runs.
"""

from __future__ import annotations

import math

import torch

#: On a CPU, top-p without top-k looks for each row's nucleus among its top k logits first, for each k here in turn,
#: and sorts the whole vocabulary only of the rows whose nucleus they do not hold: a CPU sorts a whole vocabulary
#: slowly beside a small model's decode step (docs/benchmarks.md has the figures). The nucleus is the same either
#: way (the top k are the sort's first k, and their masses and running sums the same numbers).
NUCLEUS_SEARCH = (256, 4096)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k, outside the top-p nucleus, and below min-p.

    Each filter keeps every token whose logit reaches a per-row floor, so tokens tied with the last one kept are
    all kept, whatever order a sort puts equal logits in (it differs between devices).

    Args:
        logits: ``[n, V]`` float, already divided by the temperature.
        top_k: keep the k most likely tokens (0 keeps all).
        top_p: keep the smallest set whose probability reaches top_p, renormalized over the top-k (1.0 keeps all;
            the most likely token always stays). With top-k on, only its k tokens are sorted: a sort of the whole
            vocabulary costs far more than the rest of the draw (on a CPU ``top_p_floor`` avoids it where it can).
        min_p: keep the tokens at least min_p times as likely as the most likely one (0 keeps all); a ratio of
            two probabilities, so it does not matter whether top-k and top-p have renormalized them first.
    Returns:
        ``[n, V]`` logits with filtered entries at -inf.
    """
    top_k = top_k if 0 < top_k < logits.shape[-1] else 0
    floor = None
    if top_k:
        candidates = torch.topk(logits, top_k, dim=-1).values                               # [n, k] descending
        dropped = logits < candidates[:, -1:]
        logits = logits.masked_fill(dropped, float("-inf"))
        # top-k keeps the tokens tied with its last candidate too: their mass is part of what top-p renormalizes
        tied = logits.shape[-1] - top_k - torch.count_nonzero(dropped, -1).unsqueeze(-1)     # [n, 1]
        if top_p < 1.0:
            floor = nucleus_floor(candidates, top_p, tied)
    elif top_p < 1.0:
        floor = top_p_floor(logits, top_p)
    if floor is not None:
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if min_p > 0.0:
        floor = logits.amax(-1, keepdim=True) + math.log(min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


def top_p_floor(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The least logit of each row's top-p nucleus over the whole vocabulary: ``[n, 1]``.

    On a CPU each row is looked for among its top k logits, for each k of ``NUCLEUS_SEARCH`` in turn, and only the
    rows none of them holds are sorted whole. A row whose top k cannot reach top_p within the next k' either (its
    top k's mass plus k' - k more tokens, each at most as likely as its k-th) goes to the sort at once: the bound
    only saves a search that would fail, it never decides a floor. Elsewhere (and compiled) every row is sorted:
    the search reads its outcome on the host, which a CUDA graph cannot.

    Why no cheaper exact method on CUDA: the kernels that skip the sort (FlashInfer's rejection sampling, which
    vLLM's v1 sampler calls; its pivot search for a top-p threshold) draw by other arithmetic, or sum the nucleus's
    mass in another order than the sorted running sum ``nucleus_floor`` takes, so a row near its boundary may keep
    another token set and draw another token for the same uniform; vLLM's own fallback sorts the whole row too.

    Args:
        logits: ``[n, V]``.
        top_p: in (0, 1).
    """
    log_total = logits.logsumexp(-1, keepdim=True)                                           # [n, 1]
    if logits.device.type != "cpu" or torch.compiler.is_compiling():  # no host read in a graph
        return nucleus_floor(torch.sort(logits, dim=-1, descending=True).values, top_p, log_total=log_total)
    floor = torch.empty_like(log_total)
    pending = torch.arange(logits.shape[0])                                                 # rows still to find
    searches = [k for k in NUCLEUS_SEARCH if k < logits.shape[-1]]
    for index, k in enumerate(searches):
        rows = logits if len(pending) == logits.shape[0] else logits.index_select(0, pending)
        top = torch.topk(rows, k, dim=-1).values                                             # [m, k]
        probs = (top - log_total[pending]).exp()
        # as nucleus_floor counts: the mass before the (k+1)-th token reaches top_p, so it is left out
        mass = probs.cumsum(-1)[:, -1]                                                       # [m]
        held = mass >= top_p
        if bool(held.any()):
            floor[pending[held]] = nucleus_floor(top[held], top_p, log_total=log_total[pending[held]])
        hopeful = ~held
        if index + 1 < len(searches):
            hopeful &= mass + (searches[index + 1] - k) * probs[:, -1] >= top_p
        sorted_now = pending[~held & ~hopeful]
        pending = pending[hopeful]
        if len(sorted_now):
            floor[sorted_now] = _sorted_floor(logits, sorted_now, top_p, log_total)
        if not len(pending):
            return floor
    if len(pending):
        floor[pending] = _sorted_floor(logits, pending, top_p, log_total)
    return floor


def _sorted_floor(logits: torch.Tensor, rows: torch.Tensor, top_p: float, log_total: torch.Tensor) -> torch.Tensor:
    """``nucleus_floor`` of the whole of ``logits``' ``rows`` (``[m]`` indices), sorted: ``[m, 1]``."""
    chosen = logits if len(rows) == logits.shape[0] else logits.index_select(0, rows)       # every row: no copy
    ordered = torch.sort(chosen, dim=-1, descending=True).values                             # [m, V]
    return nucleus_floor(ordered, top_p, log_total=log_total[rows])


def nucleus_floor(candidates: torch.Tensor, top_p: float, tied: torch.Tensor | None = None,
                  log_total: torch.Tensor | None = None) -> torch.Tensor:
    """The least logit of the top-p nucleus of ``candidates``: ``[n, 1]``.

    Args:
        candidates: ``[n, c]`` the row's logits that may be sampled (all of them, or the top-k), descending.
        top_p: in (0, 1).
        tied: ``[n, 1]`` how many more tokens may be sampled, each with the last candidate's logit (those top-k
            keeps beyond its k); they share the mass the nucleus is a fraction of. None: no more.
        log_total: ``[n, 1]`` the log of the total mass the nucleus is a fraction of, where the candidates are
            only the row's largest logits (``top_p_floor``); None: the candidates' own.
    """
    if log_total is not None:
        probs = (candidates - log_total).exp()                                                # [n, c]
    else:
        probs = candidates.softmax(-1)                                                        # [n, c]
    if tied is not None:  # the candidates' share of a total that also holds the tied tokens' mass
        probs = probs / (1 + tied * probs[:, -1:])
    # A token is in the nucleus while the mass strictly before it is below top_p: the running sum up to the token
    # before, not the running sum minus the token's own probability, which rounds once more.
    before = torch.nn.functional.pad(probs.cumsum(-1)[:, :-1], (1, 0))                       # [n, c]
    kept = (before < top_p).sum(-1, keepdim=True)                                             # [n, 1], >= 1
    return candidates.gather(-1, kept - 1)


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int = 0,
                  top_p: float = 1.0, min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverse-CDF sampling with the row's own uniform.

    Inverse-CDF with an externally supplied uniform (rather than ``torch.multinomial``) is what lets every row draw
    from its own random stream inside a shared batch.

    Args:
        logits: ``[n, V]`` raw next-token logits.
        uniforms: ``[n]`` float64 in (0, 1).
        temperature: 0 means greedy (argmax); the uniforms are then unused.
        top_k, top_p, min_p: the filters (``filter_logits``), after the temperature.
    Returns:
        tokens ``[n]`` int64 and their log-probs ``[n]`` float32 under the distribution they were drawn from
        (after temperature and filtering; for greedy, the untempered softmax).
    """
    tokens, logprobs = _draw(logits, uniforms, temperature, top_k, top_p, min_p)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def replay_tokens(logits: torch.Tensor, uniforms: torch.Tensor, forced: torch.Tensor, replaying: torch.Tensor,
                  temperature: float, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Emit recorded tokens: each replaying row's token is ``forced``, with its log-prob under the distribution
    ``sample_tokens`` draws from. The other rows draw as ``sample_tokens`` does.

    Every row still draws (and ignores the draw when replaying), so a replay runs the sampler's own arithmetic
    and needs no other shape.

    Args:
        logits: ``[n, V]`` raw next-token logits.
        uniforms: ``[n]`` float64 in (0, 1).
        forced: ``[n]`` int64 recorded token of each row, in ``[0, V)``.
        replaying: ``[n]`` bool, the rows that emit ``forced``.
        temperature, top_k, top_p, min_p: as for ``sample_tokens``.
    Returns:
        tokens ``[n]`` int64 and their log-probs ``[n]`` float32 (-inf for a recorded token the filters exclude).
    """
    drawn, logprobs = _draw(logits, uniforms, temperature, top_k, top_p, min_p)
    tokens = torch.where(replaying, forced, drawn)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _draw(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int, top_p: float,
          min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[n]`` drawn from ``logits`` ``[n, V]`` and the ``[n, V]`` float32 log-probs they were drawn from."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1), torch.log_softmax(logits, -1)
    logprobs = torch.log_softmax(filter_logits(logits / temperature, top_k, top_p, min_p), -1)
    return inverse_cdf(logprobs.exp(), uniforms.to(logits.device)), logprobs


#: Tokens per block of ``inverse_cdf``'s first level.
CDF_BLOCK = 128


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor, block: int = CDF_BLOCK) -> torch.Tensor:
    """The first token whose cumulative probability reaches ``uniform * total``, found in two levels.

    A scan over the whole vocabulary with few rows keeps a GPU almost idle (one row is one sequential scan), so the
    draw first picks a block of ``block`` tokens from the cumulative block sums, then the token inside that block.
    The token drawn always has a probability above zero.

    Args:
        probs: ``[n, V]`` non-negative, each row with a positive sum.
        uniforms: ``[n]`` in (0, 1).
    Returns:
        ``[n]`` int64 token ids.
    """
    n, vocab = probs.shape
    if vocab % block:
        probs = torch.nn.functional.pad(probs, (0, -vocab % block))
    # A block's sum is float32 (within about 1e-7 of its mass); the running sums across blocks and inside the
    # chosen block are float64. A float64 copy of the whole [n, V] would cost more than the rest of the draw.
    probs = probs.reshape(n, -1, block)                                                      # [n, blocks, block]
    block_cdf = probs.sum(-1).double().cumsum(-1)                                            # [n, blocks]
    targets = (uniforms.double() * block_cdf[:, -1]).unsqueeze(-1)                           # [n, 1]
    chosen = torch.searchsorted(block_cdf, targets).clamp_(max=block_cdf.shape[1] - 1)        # [n, 1]
    before = torch.where(chosen > 0, block_cdf.gather(-1, (chosen - 1).clamp(min=0)), 0.0)   # [n, 1]
    inside = probs.gather(1, chosen[:, :, None].expand(n, 1, block)).squeeze(1).double().cumsum(-1) + before
    # The block's own sum and its running sum round differently: keep the target inside the block's last
    # positive entry, so a zero-probability token is never drawn.
    targets = torch.minimum(targets, inside[:, -1:])
    offset = torch.searchsorted(inside, targets)                                             # [n, 1]
    # Only a row of NaN probabilities reaches past the vocabulary: kept in range, it draws a token the decode step
    # then refuses by its NaN log-prob (``check_finite_logits``) instead of failing inside an index.
    return (chosen * block + offset).squeeze(-1).clamp_(max=vocab - 1)


def penalize_repetitions(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' ``RepetitionPenaltyLogitsProcessor`` (and vLLM's repetition penalty) on each row's seen ids: a
    seen token's logit is multiplied by ``penalty`` where negative, else divided by it.

    The same comparison and float32 operations as transformers' (which penalizes the float32 copy ``generate``
    makes of the logits), so the penalized logits are its own, bit for bit.

    Args:
        logits: ``[n, V]`` raw next-token logits (any float dtype; penalized in float32).
        seen: ``[n, V]`` bool, the ids in each row's sequence so far (prompt and completion).
        penalty: > 0; 1.0 changes nothing (the caller skips the call then).
    Returns:
        ``[n, V]`` float32 logits.
    """
    logits = logits.float()
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


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
