"""cispo, sapo, luspo, vespo, importance_sampling_level="sequence" (GSPO), kl_bias_correction and the token masks
against direct computations written out per sequence and per token, their gradients, and their bad values."""

import math
import re
import warnings

import pytest
import torch

from lit_grpo.update.loss import policy_loss, policy_loss_metrics
from lit_grpo.update.loss_config import LossConfig
from lit_grpo.update.policy_losses import make_loss
from lit_grpo.update.surrogates import high_entropy_mask, vespo_weight
from tools.compare_trl_loss import run_ranks  # ranks as threads, meeting in their all_gather

EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04
LENGTHS = [5, 3, 0, 4]  # a completion without any active token included


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    n, t = len(LENGTHS), 5
    logps = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2
    old = logps + (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5) * 0.8
    ref = logps + (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5) * 0.5
    adv = torch.tensor([1.0, -0.5, 0.7, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1.0 if j < length else 0.0 for j in range(t)] for length in LENGTHS], dtype=torch.float64)
    return logps, old, ref, adv, mask


# ------------------------------------------------------------------------------------------------ references
def _entropy_threshold(entropy, m, top_quantile):
    """The ``1 - top_quantile`` quantile of the active tokens' entropies, linearly interpolated between the two
    sorted values around position ``(1 - top_quantile) (n - 1)`` (torch.quantile's default), written out."""
    values = sorted(float(entropy[i, j]) for i in range(m.shape[0]) for j in range(m.shape[1]) if m[i, j])
    position = (1 - top_quantile) * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (position - low) * (values[high] - values[low])


def _ratios(lp, olp, m, level):
    """Each row's per-token ratios as a list of scalar tensors (autograd flows through them)."""
    rows = []
    for i in range(lp.shape[0]):
        if level == "token":
            rows.append([torch.exp(lp[i, j] - olp[i, j]) for j in range(lp.shape[1])])
        else:
            active = [j for j in range(lp.shape[1]) if m[i, j]]
            mean = sum((lp[i, j] - olp[i, j] for j in active), torch.zeros((), dtype=lp.dtype)) / max(len(active), 1)
            rows.append([torch.exp(mean)] * lp.shape[1])
    return rows


def _vespo_phi(lp, olp, m, i, a, weights, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
    """Row ``i``'s VESPO weight, a float (no gradient): phi(w) = exp(lam + k log w - lam w)."""
    active = [j for j in range(lp.shape[1]) if m[i, j]]
    log_w = sum(min(max(float(lp[i, j].detach() - olp[i, j]), -20.0), 20.0) for j in active)
    if weights is not None:
        columns = active if weights.shape[1] > 1 else [0]
        if any(weights[i, j] == 0 for j in columns):  # masked by a mask mode: dropped
            return 0.0
        log_w += sum(max(math.log(float(weights[i, j])) if weights[i, j] > 0 else -math.inf, math.log(1e-8))
                     for j in columns)
    log_w = min(max(log_w, math.log(1e-8)), 20.0)
    k, lam = (k_pos, lambda_pos) if a >= 0 else (k_neg, lambda_neg)
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


def _reference(lp, olp, rlp, adv, m, loss_type, level="token", beta=0.0, kl_bc=False, eps_high=EPS_HIGH,
               tau_pos=1.0, tau_neg=1.05, weights=None, vespo=None, delta=None, entropy=None, top_entropy_quantile=1.0):
    """The loss written out token by token; aggregation as grpo (sapo), per sequence's sum (luspo) or over all
    active tokens (the rest). Below ``top_entropy_quantile`` a token whose entropy is under the threshold keeps only
    its KL, and still counts."""
    sums, counts = [], []
    threshold = _entropy_threshold(entropy, m, top_entropy_quantile) if top_entropy_quantile < 1 else -math.inf
    for i, row in enumerate(_ratios(lp, olp, m, level)):
        s, c = torch.zeros((), dtype=lp.dtype), 0
        a = float(adv[i])
        for j, r in enumerate(row):
            if not m[i, j]:
                continue
            if loss_type == "vespo":  # the sampler's weights enter phi, not the term
                term = -_vespo_phi(lp, olp, m, i, a, weights, **(vespo or {})) * a * lp[i, j]
            elif loss_type == "cispo":
                term = -min(r.item(), eps_high) * a * lp[i, j]  # the weight carries no gradient
            elif loss_type == "sapo":
                tau = tau_pos if a > 0 else tau_neg
                term = -(4.0 / tau) * torch.sigmoid(tau * (r - 1.0)) * a
            else:
                clipped = torch.clamp(r, 1 - EPS_LOW, 1 + eps_high)
                term = -torch.min((r if delta is None else torch.clamp(r, max=delta)) * a, clipped * a)
            if weights is not None and loss_type != "vespo":
                term = term * float(weights[i, j if weights.shape[1] > 1 else 0])
            if top_entropy_quantile < 1 and float(entropy[i, j]) < threshold:
                term = 0.0
            if beta:
                to_ref = rlp[i, j] - lp[i, j]
                kl = torch.exp(to_ref) - to_ref - 1
                term = term + beta * (kl * r if kl_bc else kl)
            s, c = s + term, c + 1
        sums.append(s)
        counts.append(c)
    if loss_type in ("grpo", "sapo"):
        return sum(s / max(c, 1) for s, c in zip(sums, counts)) / len(sums)
    if loss_type == "luspo":
        return sum(sums) / len(sums)
    return sum(sums) / sum(counts)


def _loss_and_grad(fn, advantages=None):
    logps, old, ref, adv, mask = _inputs()
    adv = adv if advantages is None else advantages
    leaf = logps.clone().requires_grad_(True)
    loss = fn(leaf, old, ref, adv, mask)
    loss.backward()
    return loss.detach(), leaf.grad


def _compare(loss_type, **options):
    eps_high = options.pop("eps_high", EPS_HIGH)
    weights = options.pop("weights", None)
    advantages = options.pop("advantages", None)
    vespo = {f"vespo_{key}": value for key, value in (options.get("vespo") or {}).items()}
    ours = _loss_and_grad(lambda lp, olp, rlp, a, m: policy_loss(
        lp, olp, a, m, loss_type=loss_type, epsilon_low=EPS_LOW, epsilon_high=eps_high,
        ref_logps=rlp if options.get("beta") else None, beta=options.get("beta", 0.0),
        importance_sampling_level=options.get("level", "token"), kl_bias_correction=options.get("kl_bc", False),
        sapo_temperature_pos=options.get("tau_pos", 1.0), sapo_temperature_neg=options.get("tau_neg", 1.05),
        sampling_weights=weights, delta=options.get("delta"), entropy=options.get("entropy"),
        top_entropy_quantile=options.get("top_entropy_quantile", 1.0), **vespo), advantages)
    want = _loss_and_grad(lambda lp, olp, rlp, a, m: _reference(lp, olp, rlp, a, m, loss_type, eps_high=eps_high,
                                                                 weights=weights, **options), advantages)
    # float64 end to end (inputs, loss and reference): they differ by ~1e-15 on any CPU, so 1e-10 and 1e-9
    torch.testing.assert_close(ours[0], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours[1], want[1], rtol=1e-9, atol=1e-12)
    return ours


# ------------------------------------------------------------------------------------------------ each option
@pytest.mark.parametrize("loss_type", ["bnpo", "dapo", "grpo"])
@pytest.mark.parametrize("beta", [0.0, BETA])
def test_sequence_level_uses_each_completions_mean_log_ratio(loss_type, beta):
    loss, grad = _compare(loss_type, level="sequence", beta=beta)
    token_loss, _ = _compare(loss_type, level="token", beta=beta)
    assert abs(float(loss - token_loss)) > 1e-4  # the level changes the loss on these inputs
    assert torch.all(grad[2] == 0)  # the completion without active tokens gets no gradient


def test_sequence_level_gradient_spreads_evenly_over_a_completions_tokens():
    """Unclipped, grpo's loss of one completion is -r A with r = exp(mean log-ratio): d/dlogp_t = -r A / L for
    each of its L active tokens."""
    logps = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.05, -0.05, 0.02, 9.0]], dtype=torch.float64)  # the last token is padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    loss = policy_loss(logps, old, torch.tensor([2.0], dtype=torch.float64), mask, loss_type="grpo",
                       importance_sampling_level="sequence")
    loss.backward()
    r = math.exp(-(0.05 - 0.05 + 0.02) / 3)
    torch.testing.assert_close(logps.grad, torch.tensor([[-r * 2 / 3] * 3 + [0.0]], dtype=torch.float64))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, BETA])
def test_cispo_weights_log_probs_by_the_capped_ratio(level, beta):
    _compare("cispo", level=level, beta=beta, eps_high=1.1)  # a low cap so that some ratios are capped
    _compare("cispo", level=level, beta=beta, eps_high=5.0)


def test_cispo_gradient_is_the_capped_ratio_times_the_advantage():
    logps = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64)).requires_grad_(True)
    old = torch.log(torch.tensor([[0.25, 0.5]], dtype=torch.float64))  # ratios 2 and 1
    loss = policy_loss(logps, old, torch.tensor([3.0], dtype=torch.float64), torch.ones(1, 2), loss_type="cispo",
                       epsilon_high=1.5)
    loss.backward()
    # the weight carries no gradient: d/dlogp = -min(r, 1.5) A / active tokens
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.5 * 3 / 2, -1.0 * 3 / 2]], dtype=torch.float64))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, BETA])
def test_sapo_soft_gate_per_advantage_sign(level, beta):
    _compare("sapo", level=level, beta=beta)
    _compare("sapo", level=level, beta=beta, tau_pos=2.0, tau_neg=0.5)


def test_sapo_on_policy_is_the_plain_policy_gradient():
    """At r = 1 the gate's slope is 1: the gradient is -A per token (then grpo's means), for either temperature."""
    logps = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.5, -2.0], dtype=torch.float64)
    loss = policy_loss(logps, logps.detach(), adv, torch.ones(2, 3), loss_type="sapo", sapo_temperature_pos=3.0,
                       sapo_temperature_neg=0.7)
    loss.backward()
    torch.testing.assert_close(logps.grad, (-adv / 3 / 2).unsqueeze(1).expand(2, 3))
    # the value there is -(4 / tau) sigmoid(0) A = -2 A / tau
    assert loss.item() == pytest.approx((-2 * 1.5 / 3.0 + 2 * 2.0 / 0.7) / 2)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "luspo"])
@pytest.mark.filterwarnings("ignore:loss_type='luspo'")  # at the token level, off its paper's
def test_delta_caps_the_unclipped_ratio_of_the_clip_losses(loss_type):
    negative = torch.tensor([-1.0, -0.5, 0.7, 2.0], dtype=torch.float64)  # the first row has a ratio of 1.37
    capped, capped_grad = _compare(loss_type, delta=1.3, beta=BETA, advantages=negative)
    plain, plain_grad = _compare(loss_type, beta=BETA, advantages=negative)
    assert not torch.allclose(capped_grad, plain_grad)


def test_delta_stops_the_gradient_of_a_negative_advantage_beyond_it():
    """PPO's clip leaves -r A unclipped for A < 0 whatever r; with delta the term is -min(r, delta) A, flat above."""
    logps = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64)).requires_grad_(True)
    old = torch.log(torch.tensor([[0.25, 0.5]], dtype=torch.float64))  # ratios 2 and 1
    adv = torch.tensor([-1.0], dtype=torch.float64)
    for delta, far in ((None, 2.0 / 2), (1.5, 0.0)):  # d/dlogp of -r A / 2 tokens = r / 2 at r = 2, or flat
        logps.grad = None
        policy_loss(logps, old, adv, torch.ones(1, 2), loss_type="bnpo", delta=delta).backward()
        torch.testing.assert_close(logps.grad, torch.tensor([[far, 0.5]], dtype=torch.float64))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo", "vespo"])
def test_the_off_policy_mask_drops_the_policy_term_of_negative_advantages_that_drifted(loss_type):
    """DeepSeek-V3.2's mask: a completion is dropped when A < 0 and its mean sampler - policy log-prob gap exceeds
    the threshold; its KL stays, and the others are untouched."""
    logps = torch.log(torch.tensor([[0.5, 0.5, 0.5]] * 4, dtype=torch.float64)).requires_grad_(True)
    # the gap is to the current log-probs (off the old ones after num_iterations' first step), not to the old ones:
    # against these the last row's would be (0.5 + 0 + 0.5) / 3 = 0.33, dropped
    old = logps.detach() - 0.1
    sampling = logps.detach() + torch.tensor([[0.6], [0.6], [0.1], [0.4]], dtype=torch.float64)  # mean gaps
    # a token the sampler could not score adds 0 over all 3 tokens: (0.4 + 0 + 0.4) / 3 = 0.27, kept (a NaN left in
    # the mean, or the token left out of its count, 0.4, would drop the completion)
    sampling[3, 1] = math.nan
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    ref, mask = logps.detach() - 0.2, torch.ones(4, 3, dtype=torch.float64)
    settings = {"loss_type": loss_type, "epsilon_high": 5.0 if loss_type == "cispo" else 0.28, "beta": BETA,
                "max_completion_length": 3, "ref_logps": ref}
    kept = [True, False, True, True]  # gaps 0.6 with A > 0, 0.6, 0.1 and 0.27 with A < 0; threshold 0.3
    masked = policy_loss(logps, old, adv, mask, off_policy_mask_threshold=0.3, sampling_logps=sampling, **settings)
    # the same as the plain loss with the dropped rows' policy term gone: their advantage at 0 for the clip, cispo
    # and vespo terms alike, which leaves only their KL
    zeroed = policy_loss(logps, old, adv * torch.tensor(kept, dtype=torch.float64), mask, **settings)
    torch.testing.assert_close(masked, zeroed)
    # without the sampler's log-probs the old ones stand for them: gaps of -0.1, nothing dropped
    plain = policy_loss(logps, old, adv, mask, **settings)
    torch.testing.assert_close(policy_loss(logps, old, adv, mask, off_policy_mask_threshold=0.3, **settings), plain)
    assert not torch.allclose(masked, plain)


#: Per-token entropies for ``_inputs`` (lengths 5, 3, 0, 4); 9.0 on padding, which is never ranked. The 12 active
#: ones sorted: 0.25 0.5 0.75 1 1.5 2 2 2 2 2.5 3 4.
ENTROPY = torch.tensor([[0.5, 2.0, 1.0, 3.0, 2.0],
                        [2.0, 0.25, 4.0, 9.0, 9.0],
                        [9.0, 9.0, 9.0, 9.0, 9.0],
                        [1.5, 2.0, 0.75, 2.5, 9.0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_high_entropy_mask_keeps_the_active_tokens_at_or_above_the_quantile(dtype):
    """The ``1 - top`` quantile of the active tokens' entropies (padding left out of it, and never kept); a token at
    it is kept, ties and all."""
    mask = _inputs()[4]
    entropy = ENTROPY.to(dtype)
    kept = lambda top: high_entropy_mask(entropy, mask, top).tolist()  # noqa: E731
    # top 0.3: position 0.7 x 11 = 7.7 between two 2.0s: every 2.0 stays (with padding in the quantile, 9.0 x 8,
    # the threshold would be 2.5 and the padding kept)
    assert kept(0.3) == [[False, True, False, True, True], [True, False, True, False, False], [False] * 5,
                         [False, True, False, True, False]]
    # top 0.2: position 8.8, 2.0 + 0.8 x 0.5 = 2.4: the 2.0s go (reading 0.2 as the quantile would keep 1.0 and up)
    assert kept(0.2) == [[False, False, False, True, False], [False, False, True, False, False], [False] * 5,
                         [False, False, False, True, False]]
    assert kept(0.0) == [[False] * 5, [False, False, True, False, False], [False] * 5, [False] * 5]  # the highest
    assert kept(1.0) == mask.bool().tolist()  # the lowest is the threshold: every active token
    for top in (0.0, 0.2, 0.3, 0.55, 1.0):
        threshold = torch.quantile(entropy.float()[mask.bool()], 1 - top)
        torch.testing.assert_close(high_entropy_mask(entropy, mask, top), (entropy.float() >= threshold) & mask.bool())
    assert not high_entropy_mask(entropy, torch.zeros_like(mask), 0.2).any()  # no active token: nothing kept


def test_under_two_ranks_the_high_entropy_quantile_spans_both_ranks_micro_batches():
    """TRL's ``get_high_entropy_mask`` takes its quantile over every process's non-pad entropies (padded across
    processes and gathered): with the ranks' all_gather, each rank's mask is the quantile of both micro-batches'
    active tokens, of their own widths; the loss and the entropy bonus rank by it too."""
    from lit_grpo.update.entropy_bonus import bonus_tokens

    logps, old, _, adv, mask = _inputs()
    other = torch.tensor([[0.1, 0.2, 5.0, 6.0, 7.0, 9.0, 9.0], [0.3, 8.0, 9.0, 9.0, 9.0, 9.0, 9.0]])
    other_mask = torch.tensor([[1.0] * 5 + [0.0] * 2, [1.0] * 2 + [0.0] * 5], dtype=torch.float64)
    entropies, masks = [ENTROPY, other], [mask, other_mask]
    every = torch.cat([e[m.bool()] for e, m in zip(entropies, masks)])
    for top in (0.2, 0.3):
        threshold = torch.quantile(every, 1 - top)
        want = [(e >= threshold) & m.bool() for e, m in zip(entropies, masks)]
        got = run_ranks(2, lambda rank, gather: high_entropy_mask(entropies[rank], masks[rank], top, gather))
        assert [g.tolist() for g in got] == [w.tolist() for w in want], top
        alone = [high_entropy_mask(e, m, top) for e, m in zip(entropies, masks)]
        assert any(not torch.equal(a, w) for a, w in zip(alone, want)), top  # a rank's own quantile differs
        tokens = run_ranks(2, lambda rank, gather: bonus_tokens(entropies[rank].double(), masks[rank], top, gather))
        assert [t.bool().tolist() for t in tokens] == [w.tolist() for w in want], top
    # the loss: rank 0's with both ranks' quantile, as the loss of its tokens below that quantile left out
    loss_fn = make_loss("grpo", top_entropy_quantile=0.3)
    plain = make_loss("grpo")
    second = _inputs(seed=1)
    inputs = [(logps, old, adv, mask, ENTROPY.double()),
              (second[0][:2], second[1][:2], second[3][:2], other_mask[:, :5], other[:, :5].double())]
    losses = run_ranks(2, lambda rank, gather: loss_fn(*inputs[rank][:4], entropy=inputs[rank][4], all_gather=gather))
    kept = run_ranks(2, lambda rank, gather: high_entropy_mask(inputs[rank][4], inputs[rank][3], 0.3, gather))
    assert any(not torch.equal(high_entropy_mask(e, m, 0.3), k) for (*_, m, e), k in zip(inputs, kept))
    for rank in range(2):
        lp, olp, a, m, _ = inputs[rank]
        # a token left out of the policy term is an importance ratio of 1 on a zero advantage, token by token
        per_token = plain.per_token_loss(lp, olp, a, m) * kept[rank].double()
        torch.testing.assert_close(losses[rank], plain.aggregate(per_token, m, None, None))


def test_with_a_bound_every_rank_knows_the_high_entropy_mask_meets_the_ranks_in_one_gather_and_is_the_same():
    """Each rank's micro-batch has its own width; a bound on its values every rank knows alike (rows x the rollout's
    max_new_tokens) sizes the padding, so one gather carries every rank's entropies instead of a gather of their
    lengths (read back to the host) and then one of them: the mask is exactly the one of the two gathers."""
    generator = torch.Generator().manual_seed(0)
    widths, rows, max_new_tokens = (3, 7), 2, 8
    # ties across ranks (rounded entropies) and a rank with an inactive row: the quantile's interpolation and the
    # ties at the threshold decide the mask
    entropies = [torch.rand(rows, w, generator=generator).mul(4).round().div(2) for w in widths]
    masks = [torch.ones(rows, widths[0]), torch.cat([torch.ones(1, widths[1]), torch.zeros(1, widths[1])])]
    masks[0][1, 2] = 0

    def counted(rank, gather, capacity):
        def counting(tensor):
            calls[rank] += 1
            return gather(tensor)

        return high_entropy_mask(entropies[rank], masks[rank], top, counting, capacity=capacity)

    for top in (0.0, 0.2, 0.5, 0.9):
        calls = [0, 0]
        two_gathers = run_ranks(2, lambda rank, gather: counted(rank, gather, None))
        assert calls == [2, 2]
        calls = [0, 0]
        one_gather = run_ranks(2, lambda rank, gather: counted(rank, gather, rows * max_new_tokens))
        assert calls == [1, 1], top
        assert [m.tolist() for m in one_gather] == [m.tolist() for m in two_gathers], top
    with pytest.raises(ValueError, match=r"14 entropies .* capacity=8"):
        high_entropy_mask(entropies[1], masks[1], 0.2, lambda tensor: tensor[None], capacity=8)


def test_a_padded_gather_past_torchs_quantile_limit_gives_the_mask_of_the_active_tokens():
    """torch.quantile takes at most 2**24 values: a bound every rank knows (rows x max_new_tokens) times the ranks
    can pass it where the active tokens are few (long caps, short completions, many ranks); the padding is NaN, left
    out of the quantile, so the mask is the one of the active tokens alone."""
    generator = torch.Generator().manual_seed(1)
    entropies = [torch.rand(2, w, generator=generator) for w in (3, 5)]
    masks = [torch.ones(2, 3), torch.ones(2, 5)]
    capacity = 2 ** 23 + 1  # two ranks' padded values: just past the limit
    expected = run_ranks(2, lambda rank, gather: high_entropy_mask(entropies[rank], masks[rank], 0.3, gather))
    padded = run_ranks(2, lambda rank, gather: high_entropy_mask(entropies[rank], masks[rank], 0.3, gather,
                                                                  capacity=capacity))
    assert [m.tolist() for m in padded] == [m.tolist() for m in expected]
    assert 0 < sum(int(m.sum()) for m in padded) < 16  # some tokens kept, not all
    # no active token anywhere: none kept, as with fewer values
    nothing = high_entropy_mask(entropies[0], torch.zeros(2, 3), 0.3, lambda tensor: torch.stack([tensor] * 2),
                                capacity=capacity)
    assert not nothing.any()


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "vespo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("top", [0.3, 0.2])
@pytest.mark.filterwarnings("ignore:loss_type='vespo'")  # at the sequence level, off its paper's
def test_top_entropy_quantile_drops_the_policy_term_of_the_low_entropy_tokens(loss_type, level, top):
    """Written out token by token: a token below the quantile keeps its KL and its place in the normalizers; its
    policy term goes. top 0.3 keeps the ties at the threshold (2.0), top 0.2 interpolates past them."""
    masked, masked_grad = _compare(loss_type, level=level, beta=BETA, kl_bc=True, entropy=ENTROPY,
                                   top_entropy_quantile=top)
    plain, plain_grad = _compare(loss_type, level=level, beta=BETA, kl_bc=True)
    assert not torch.allclose(masked_grad, plain_grad)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
@pytest.mark.filterwarnings("ignore:loss_type='luspo'")  # at the token level, off its paper's
def test_top_entropy_quantile_1_leaves_the_loss_as_it_was_and_reads_no_entropy(loss_type):
    """At 1 nothing is ranked: NaN entropies (which no token is at or above) change nothing, and none are needed."""
    settings = {"loss_type": loss_type, "epsilon_high": 5.0 if loss_type == "cispo" else EPS_HIGH, "beta": BETA,
                "max_completion_length": 5}
    plain, plain_grad = _loss_and_grad(lambda lp, olp, rlp, a, m: policy_loss(lp, olp, a, m, ref_logps=rlp,
                                                                              **settings))
    nan = torch.full_like(ENTROPY, math.nan)
    at_one, at_one_grad = _loss_and_grad(lambda lp, olp, rlp, a, m: policy_loss(
        lp, olp, a, m, ref_logps=rlp, entropy=nan, top_entropy_quantile=1.0, **settings))
    assert torch.equal(at_one, plain) and torch.equal(at_one_grad, plain_grad)


@pytest.mark.parametrize("level", ["sequence", "token"])
@pytest.mark.parametrize("beta", [0.0, BETA])
def test_luspo_sums_each_sequences_tokens_then_means_the_sequences(level, beta):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the token level departs from the paper's setup, and says so
        _compare("luspo", level=level, beta=beta)


def test_luspo_is_gspos_sequence_loss_weighed_by_its_length():
    logps, old, _, adv, mask = _inputs()
    settings = {"importance_sampling_level": "sequence", "epsilon_low": EPS_LOW, "epsilon_high": EPS_HIGH}
    lengths = mask.sum(dim=1)
    gspo_rows = [policy_loss(logps[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], loss_type="grpo",
                             **settings) for i in range(len(LENGTHS))]
    luspo = policy_loss(logps, old, adv, mask, loss_type="luspo", **settings)
    torch.testing.assert_close(luspo, sum(row * length for row, length in zip(gspo_rows, lengths)) / len(LENGTHS))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, BETA])
def test_vespo_weighs_log_probs_by_phi_of_each_sequences_ratio(level, beta):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sequence level changes only the KL's ratio, and says so
        _compare("vespo", level=level, beta=beta, kl_bc=bool(beta))
        _compare("vespo", level=level, beta=beta, vespo={"k_pos": 1.0, "lambda_pos": 0.5, "k_neg": 0.0,
                                                         "lambda_neg": 4.0})


def test_vespo_takes_the_sampler_correction_into_its_ratio():
    token_w = torch.rand(4, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    token_w[0, 1] = 0.0  # masked by a mask mode: drops the completion
    with_weights, _ = _compare("vespo", beta=BETA, weights=token_w)
    _compare("vespo", weights=token_w[:, :1])  # a sequence mode's weight
    without, _ = _compare("vespo", beta=BETA)
    assert abs(float(with_weights - without)) > 1e-4


@pytest.mark.parametrize("k", [0.0, 0.1, 2.0])
def test_vespo_drops_a_completion_a_mask_mode_zeroed_whatever_its_k(k):
    """A 0 weight (a mask mode's) drops its completion, a token's or the completion's own; counted as 1e-8 it would
    weigh exp(lam) 1e-8^k: 20 (exp(3)) at k = 0, 3.2 at k = 0.1. A 0 on padding is no token's."""
    logps = torch.full((3, 3), -1.0, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    token_w = torch.ones(3, 3, dtype=torch.float64)
    token_w[0, 1] = 0.0  # an active token's
    token_w[1, 2] = 0.0  # padding's
    shapes = {"k_pos": k, "lambda_pos": 3.0, "k_neg": k, "lambda_neg": 2.0}
    phi = vespo_weight(logps, logps, mask, adv, *shapes.values(), sampling_weights=token_w)
    assert phi.squeeze(1).tolist() == [0.0, 1.0, 1.0]
    sequence_w = torch.tensor([[1.0], [0.0], [0.0]], dtype=torch.float64)
    phi = vespo_weight(logps, logps, mask, adv, *shapes.values(), sampling_weights=sequence_w)
    assert phi.squeeze(1).tolist() == [1.0, 0.0, 0.0]


def test_vespo_on_policy_is_the_plain_policy_gradient():
    """At w = 1, phi = exp(lam + 0 - lam) = 1 for either sign: the gradient is -A per token over the step's
    active tokens, as dapo's on policy; a ratio away from 1 changes the weight."""
    logps = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.5, -2.0], dtype=torch.float64)
    loss = policy_loss(logps, logps.detach(), adv, torch.ones(2, 3), loss_type="vespo")
    loss.backward()
    torch.testing.assert_close(logps.grad, (-adv / 6).unsqueeze(1).expand(2, 3))
    # log w = 3 x 0.1 = 0.3: phi = exp(lambda + k 0.3 - lambda exp(0.3)), (k, lambda) = (2, 3) for A >= 0, else (3, 2)
    phi = vespo_weight(logps.detach(), logps.detach() - 0.1, torch.ones(2, 3), adv, 2.0, 3.0, 3.0, 2.0)
    assert phi.squeeze(1).tolist() == pytest.approx([math.exp(3 + 0.6 - 3 * math.exp(0.3)),
                                                     math.exp(2 + 0.9 - 2 * math.exp(0.3))])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "sapo", "cispo", "luspo", "vespo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.filterwarnings("ignore:loss_type='(luspo|vespo)'")  # each off its paper's level
def test_kl_bias_correction_weighs_the_kl_by_the_ratio(loss_type, level):
    eps_high = 5.0 if loss_type == "cispo" else EPS_HIGH
    corrected, corrected_grad = _compare(loss_type, level=level, beta=BETA, kl_bc=True, eps_high=eps_high)
    plain, plain_grad = _compare(loss_type, level=level, beta=BETA, kl_bc=False, eps_high=eps_high)
    assert not torch.allclose(corrected_grad, plain_grad)


def test_kl_bias_correction_changes_the_gradient_on_policy():
    """With old = logps the ratio is 1 but still differentiable, so the KL's gradient changes all the same."""
    logps = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    loss = policy_loss(logps, logps.detach(), torch.zeros(1, dtype=torch.float64), torch.ones(1, 2), loss_type="bnpo",
                       ref_logps=ref, beta=1.0, kl_bias_correction=True)
    loss.backward()
    # d/dlogp [r * k3] at r = 1: k3 + dk3/dlogp = (e^d - d - 1) + (1 - e^d) = -d, with d = ref - logp
    d = ref - logps.detach()
    torch.testing.assert_close(logps.grad, -d / 2)


def test_sampling_weights_scale_the_policy_term_only():
    logps, old, ref, adv, mask = _inputs()
    token_w = torch.rand(4, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    _compare("dapo", beta=BETA, weights=token_w)
    _compare("sapo", level="sequence", beta=BETA, weights=token_w[:, :1])


@pytest.mark.filterwarnings("ignore:loss_type='luspo'")  # at the token level, off its paper's
def test_metrics_follow_the_level_and_the_variant():
    logps = torch.log(torch.tensor([[0.5, 2.0]]))
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    token = policy_loss_metrics(logps, old, torch.tensor([1.0]), mask)
    assert token["clip_ratio_high"].item() == pytest.approx(0.5)  # ratio 2 > 1.28; ratio 0.5 is not clipped for A > 0
    seq = policy_loss_metrics(logps, old, torch.tensor([1.0]), mask, importance_sampling_level="sequence")
    assert seq["clip_ratio_high"].item() == 0 and seq["clip_ratio_low"].item() == 0  # geometric mean is 1
    cispo = policy_loss_metrics(logps, old, torch.tensor([1.0]), mask, epsilon_high=1.5, loss_type="cispo")
    assert cispo["clip_ratio_high"].item() == pytest.approx(0.5) and cispo["clip_ratio_low"].item() == 0
    for soft in ("sapo", "vespo"):
        gated = policy_loss_metrics(logps, old, torch.tensor([-1.0]), mask, loss_type=soft)
        assert gated["clip_ratio_low"].item() == 0 and gated["clip_ratio_high"].item() == 0  # no hard clip
    luspo = policy_loss_metrics(logps, old, torch.tensor([1.0]), mask, loss_type="luspo")
    assert luspo["clip_ratio_high"].item() == pytest.approx(0.5)  # the clip's, as grpo's
    # GSPO clips whole completions: its shares count completions with an active token (none in the third row)
    logps = torch.log(torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 1.0], [3.0, 1.0, 1.0]]))
    seq_mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    shares = policy_loss_metrics(logps, torch.zeros(3, 3), torch.ones(3), seq_mask,
                                 importance_sampling_level="sequence")
    assert shares["clip_ratio_high"].item() == pytest.approx(1 / 2) and shares["clip_units"].item() == 2
    assert shares["active_tokens"].item() == 4
    logps = torch.log(torch.tensor([[0.5, 2.0]]))
    ref = torch.full((1, 2), -0.5)
    plain = policy_loss_metrics(logps, old, torch.tensor([1.0]), mask, ref_logps=ref)["kl"]
    weighted = policy_loss_metrics(logps, old, torch.tensor([1.0]), mask, ref_logps=ref, kl_bias_correction=True,
                                   beta=0.1)
    delta = ref - logps
    k3 = torch.exp(delta) - delta - 1
    assert plain.item() == pytest.approx(k3.mean().item())
    assert weighted["kl"].item() == pytest.approx((k3 * torch.tensor([[0.5, 2.0]])).mean().item())


# ------------------------------------------------------------------------------------------------ bad values
def test_bad_option_values_name_the_value_and_what_is_allowed():
    logps, old, ref, adv, mask = _inputs()
    with pytest.raises(ValueError, match=r"importance_sampling_level='seq' is not known; use one of "
                                         r"\['token', 'sequence'\]"):
        policy_loss(logps, old, adv, mask, importance_sampling_level="seq")
    with pytest.raises(ValueError, match=r"loss_type='cispo' caps the ratio at epsilon_high itself; "
                                         r"epsilon_high=0.28 must be >= 1"):
        policy_loss(logps, old, adv, mask, loss_type="cispo")
    with pytest.raises(ValueError, match=r"^sapo_temperature_neg=0.0 is not allowed; sapo_temperature_neg must be a "
                                         r"finite number > 0$"):
        make_loss("sapo", sapo_temperature_neg=0.0)
    with pytest.raises(ValueError, match=r"sapo_temperature_pos=-1.0 is not allowed; .* must be a finite number > 0"):
        policy_loss(logps, old, adv, mask, loss_type="sapo", sapo_temperature_pos=-1.0)
    with pytest.raises(ValueError, match=r"kl_bias_correction='yes' must be True or False"):
        make_loss("dapo", kl_bias_correction="yes")
    with pytest.raises(ValueError, match=r"sampling_weights has shape \(4, 2\), expected \(4, 5\) or \(4, 1\)"):
        policy_loss(logps, old, adv, mask, sampling_weights=torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"loss_type='gspo' is not known; use one of \[.*'sapo', 'luspo', "
                                         r"'vespo'\]"):
        make_loss("gspo")
    with pytest.raises(ValueError, match=r"vespo_lambda_neg=0.0 is not allowed; .* must be a finite number > 0$"):
        make_loss("vespo", vespo_lambda_neg=0.0)
    with pytest.raises(ValueError, match=r"vespo_k_pos=-1.0 is not allowed; .* must be a finite number >= 0$"):
        make_loss("vespo", vespo_k_pos=-1.0)
    with pytest.raises(ValueError, match=r"vespo_lambda_pos=inf is not allowed; .* must be a finite number > 0$"):
        make_loss("vespo", vespo_lambda_pos=math.inf)
    with pytest.raises(ValueError, match=r"vespo_k_neg=True is not allowed; .* must be a finite number >= 0$"):
        make_loss("vespo", vespo_k_neg=True)
    with pytest.raises(ValueError, match=r"delta=1.28 must be > 1 \+ epsilon_high = 1.28 \(it caps the ratio above "
                                         r"the clip range\), or None"):
        make_loss("dapo", delta=1.28)
    with pytest.raises(ValueError, match=r"^delta='2' is not allowed; delta must be a number or None \(no cap\)$"):
        make_loss("grpo", delta="2")
    with pytest.raises(ValueError, match=r"^delta=nan is not allowed"):  # outside the clip losses too
        make_loss("sapo", delta=math.nan)
    for threshold in (-0.1, math.inf, "0.5", True):
        with pytest.raises(ValueError, match=rf"^off_policy_mask_threshold={re.escape(repr(threshold))} is not "
                                             r"allowed; off_policy_mask_threshold must be a finite number >= 0 \(a "
                                             r"mean log-prob gap to the sampler, e.g. 0.5\) or None \(off\)$"):
            make_loss("dapo", off_policy_mask_threshold=threshold)
    with pytest.raises(ValueError, match=r"sampling_logps has shape \(4, 2\), expected logps' shape \(4, 5\)"):
        policy_loss(logps, old, adv, mask, sampling_logps=torch.zeros(4, 2))
    for top in (-0.1, 1.5, math.nan, math.inf, "0.2", True, None):
        with pytest.raises(ValueError, match=rf"^top_entropy_quantile={re.escape(repr(top))} is not allowed; "
                                             r"top_entropy_quantile must be a finite number >= 0 and <= 1 \(the "
                                             r"share of tokens by entropy whose policy term is kept"):
            make_loss("dapo", top_entropy_quantile=top)
    with pytest.raises(ValueError, match=r"top_entropy_quantile=0.2 < 1 needs entropy \(each token's entropy, "
                                         r"\[N, T\]\), got None"):
        policy_loss(logps, old, adv, mask, top_entropy_quantile=0.2)
    with pytest.raises(ValueError, match=r"entropy has shape \(4, 2\), expected logps' shape \(4, 5\)"):
        policy_loss(logps, old, adv, mask, top_entropy_quantile=0.2, entropy=torch.zeros(4, 2))


def test_module_checks_the_options_when_built():
    from lit_grpo.update.module import GRPOModule

    with pytest.raises(ValueError, match="importance_sampling_level='tokens'"):
        GRPOModule(model="tiny-llama", loss={"importance_sampling_level": "tokens"})
    with pytest.raises(ValueError, match="epsilon_high=0.28 must be >= 1"):
        GRPOModule(model="tiny-llama", loss={"loss_type": "cispo"})
    with pytest.raises(ValueError, match="sapo_temperature_pos=0"):
        GRPOModule(model="tiny-llama", loss={"loss_type": "sapo", "sapo_temperature_pos": 0})
    module = GRPOModule(model="tiny-llama", loss={"loss_type": "sapo", "importance_sampling_level": "sequence",
                                                  "kl_bias_correction": True, "beta": 0.1, "sapo_temperature_neg": 2.0})
    loss_fn = module.loss_fn
    assert (loss_fn.name, loss_fn.config.importance_sampling_level, loss_fn.config.kl_bias_correction,
            loss_fn.config.sapo_temperature_neg) == ("sapo", "sequence", True, 2.0)


@pytest.mark.parametrize("settings, ignored", [
    ({"kl_bias_correction": True}, ["kl_bias_correction"]),  # beta 0: no KL term to weigh
    ({"loss_type": "grpo", "sapo_temperature_pos": 2.0}, ["sapo_temperature_pos"]),
    ({"loss_type": "cispo", "epsilon_low": 0.1, "epsilon_high": 5.0}, ["epsilon_low"]),
    ({"loss_type": "sapo", "epsilon_low": 0.1, "epsilon_high": 0.3}, ["epsilon_low", "epsilon_high"]),
    ({"loss_type": "dapo", "vespo_k_pos": 1.0}, ["vespo_k_pos"]),
    ({"loss_type": "vespo", "epsilon_high": 0.3}, ["epsilon_high"]),
    ({"loss_type": "cispo", "epsilon_high": 5.0, "delta": 2.0}, ["delta"]),
    ({"loss_type": "sapo", "delta": 2.0}, ["delta"])])
def test_a_loss_setting_the_loss_never_reads_is_named_not_dropped_in_silence(settings, ignored):
    with pytest.warns(UserWarning, match=rf"loss settings {re.escape(str(ignored))} have no effect with loss_type="):
        LossConfig(**settings)
    with warnings.catch_warnings():  # where the loss reads each of them, nothing is said
        warnings.simplefilter("error")
        LossConfig(loss_type="sapo", sapo_temperature_pos=2.0, beta=0.1, kl_bias_correction=True)
        LossConfig(loss_type="cispo", epsilon_high=5.0)
        LossConfig(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_neg=0.5)
        LossConfig(loss_type="dr_grpo", delta=2.0)
        LossConfig(loss_type="luspo", importance_sampling_level="sequence")


def test_luspo_and_vespo_off_their_papers_level_say_so():
    with pytest.warns(UserWarning, match=r"loss_type='luspo' is GSPO's sequence-level loss .* its paper uses "
                                         r"importance_sampling_level='sequence'"):
        LossConfig(loss_type="luspo")
    with pytest.warns(UserWarning, match=r"loss_type='vespo' weighs each completion by its own sequence ratio; "
                                         r"importance_sampling_level='sequence' changes only kl_bias_correction"):
        LossConfig(loss_type="vespo", importance_sampling_level="sequence")


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo", "cispo"])
def test_gspos_sequence_level_under_a_token_summing_loss_says_so(loss_type):
    # as TRL warns: dapo (the default) at the sequence level weighs completions by length, not GSPO's objective
    settings = {"epsilon_high": 5.0} if loss_type == "cispo" else {}
    with pytest.warns(UserWarning, match=rf"importance_sampling_level='sequence' with loss_type='{loss_type}', which "
                                         r"sums its tokens' terms, weighs each completion by its length .* "
                                         r"loss_type='grpo' is GSPO's setup"):
        LossConfig(loss_type=loss_type, importance_sampling_level="sequence", **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LossConfig(loss_type="grpo", importance_sampling_level="sequence")
        LossConfig(loss_type=loss_type, **settings)


def test_bad_entropy_bonus_values_name_the_value_and_what_is_allowed():
    for coef in (math.inf, math.nan, "0.1", True, None):
        with pytest.raises(ValueError, match=rf"^entropy_coef={re.escape(repr(coef))} is not allowed; entropy_coef "
                                             r"must be a finite number$"):
            LossConfig(entropy_coef=coef)
    with pytest.raises(ValueError, match=r"use_adaptive_entropy='yes' must be True or False"):
        LossConfig(use_adaptive_entropy="yes")
    with pytest.raises(ValueError, match=r"^entropy_target=inf is not allowed; .* must be a finite number >= 0$"):
        LossConfig(use_adaptive_entropy=True, entropy_target=math.inf)
    with pytest.raises(ValueError, match=r"^entropy_coef_delta=-0.01 is not allowed; .* must be a finite number >= 0$"):
        LossConfig(use_adaptive_entropy=True, entropy_coef_delta=-0.01)
    with pytest.raises(ValueError, match=r"^entropy_target=-1.0 is not allowed; .* must be a finite number >= 0$"):
        LossConfig(use_adaptive_entropy=True, entropy_target=-1.0)
    with pytest.raises(ValueError, match=r"entropy_coef_min=0.5 must be <= entropy_coef_max=0.1"):
        LossConfig(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1)
    with pytest.raises(ValueError, match=r"entropy_coef=2.0 is the initial coefficient under use_adaptive_entropy; "
                                         r"it must be within \[entropy_coef_min, entropy_coef_max\] = \[0.0, 1.0\]"):
        LossConfig(use_adaptive_entropy=True, entropy_coef=2.0)
    from lit_grpo.update.module import GRPOModule
    with pytest.raises(ValueError, match=r"entropy_coef_min=0.5 must be <= entropy_coef_max=0.1"):
        GRPOModule(model="tiny-llama", loss={"use_adaptive_entropy": True, "entropy_coef_min": 0.5,
                                             "entropy_coef_max": 0.1})
    # TRL's defaults, a negative coefficient (an entropy penalty) and a coefficient outside the adaptive bounds
    # without the control are taken
    assert LossConfig(use_adaptive_entropy=True).entropy_bonus_on and not LossConfig().entropy_bonus_on
    assert LossConfig(entropy_coef=-0.01).entropy_bonus_on
    LossConfig(entropy_coef=3.0, entropy_coef_min=0.0, entropy_coef_max=1.0)


def test_the_adaptive_entropy_settings_are_ignored_without_the_control():
    with pytest.warns(UserWarning, match=r"loss settings \['entropy_coef_max', 'entropy_target'\] have no effect "
                                         r"with loss_type='dapo', beta=0.0 and use_adaptive_entropy=False"):
        LossConfig(entropy_coef=0.1, entropy_coef_max=0.5, entropy_target=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LossConfig(use_adaptive_entropy=True, entropy_coef_max=0.5, entropy_target=2.0)
        LossConfig(entropy_coef=0.1)
    from lit_grpo.update.loss_config import ADAPTIVE_ENTROPY_SETTINGS, unread_settings
    assert set(ADAPTIVE_ENTROPY_SETTINGS) <= unread_settings("dapo", 0.0)
    assert not set(ADAPTIVE_ENTROPY_SETTINGS) & unread_settings("dapo", 0.0, use_adaptive_entropy=True)
    assert "entropy_coef" not in unread_settings("dapo", 0.0) | unread_settings("sapo", 0.0, True)
