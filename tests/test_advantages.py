import math

import pytest
import torch

from lit_grpo.rollout.advantages import (STD_EPS, group_advantages, normalize_then_sum, normalize_then_sum_advantages,
                                         zero_std_groups)


def _manual(rewards, scale):
    out = []
    flat = [r for row in rewards for r in row]
    batch_mean = sum(flat) / len(flat)
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in flat) / (len(flat) - 1))
    for row in rewards:
        mean = sum(row) / len(row)
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (len(row) - 1))
        div = {"group": std + STD_EPS, "batch": batch_std + STD_EPS, "none": 1.0}[scale]
        out.append([(r - mean) / div for r in row])
    return torch.tensor(out)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_matches_hand_computation(scale):
    rewards = [[1.0, 0.0, 0.5, 0.25], [2.0, -1.0, 0.0, 3.0], [0.3, 0.3, 0.3, 0.3]]
    got = group_advantages(torch.tensor(rewards), scale)
    torch.testing.assert_close(got, _manual(rewards, scale), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_groups_give_zero_not_nan(scale):
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    adv = group_advantages(rewards, scale)
    assert torch.isfinite(adv).all()
    # exact on any CPU: a group of equal small integers has an exact mean in any summation order, so it centers to 0
    assert torch.equal(adv, torch.zeros_like(adv))
    assert zero_std_groups(rewards).tolist() == [True, True]


def test_group_size_one_is_zero():
    adv = group_advantages(torch.tensor([[0.5], [2.0]]), "group")
    assert torch.equal(adv, torch.zeros(2, 1))
    assert torch.equal(group_advantages(torch.tensor([[0.5], [2.0]]), "batch"), torch.zeros(2, 1))


def test_std_is_unbiased_like_torch_std():
    rewards = torch.tensor([[0.0, 1.0]])
    # unbiased std of [0, 1] = sqrt(0.5); A = +-0.5 / (sqrt(0.5) + 1e-4)
    expected = 0.5 / (math.sqrt(0.5) + STD_EPS)
    torch.testing.assert_close(group_advantages(rewards), torch.tensor([[-expected, expected]]))


def test_batch_scaling_uses_one_std_for_all_groups():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 10.0]])
    adv = group_advantages(rewards, "batch")
    std = rewards.std()
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 0.5], [-5.0, 5.0]]) / (std + STD_EPS))
    # exact: the means of these pairs (0.5 and 5.0) and the differences from them are exact in float32
    assert torch.equal(group_advantages(rewards, "none"), torch.tensor([[-0.5, 0.5], [-5.0, 5.0]]))


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="scale='std'"):
        group_advantages(torch.zeros(2, 2), "std")
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        group_advantages(torch.zeros(4), "group")
    with pytest.raises(ValueError, match="infinite values: \\[inf\\]"):
        group_advantages(torch.tensor([[0.0, float("inf")]]), "group")
    with pytest.raises(ValueError, match="empty"):
        group_advantages(torch.zeros(0, 4), "group")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_unscored_completions_are_left_out_of_the_baseline(scale):
    """NaN (every reward function returned None) counts in no mean or standard deviation and gets advantage 0, as
    in TRL 1.16; the scored completions get what they would without it."""
    nan = float("nan")
    rewards = torch.tensor([[1.0, nan, 0.0, 0.5], [nan, 2.0, nan, 3.0]])
    got = group_advantages(rewards, scale)
    scored = [[1.0, 0.0, 0.5], [2.0, 3.0]]
    flat = [r for row in scored for r in row]
    batch_mean = sum(flat) / len(flat)
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in flat) / (len(flat) - 1))
    for b, row in enumerate(scored):
        mean = sum(row) / len(row)
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (len(row) - 1))
        div = {"group": std + STD_EPS, "batch": batch_std + STD_EPS, "none": 1.0}[scale]
        expected = iter([(r - mean) / div for r in row])
        for g in range(4):
            want = 0.0 if math.isnan(rewards[b, g]) else next(expected)
            assert got[b, g].item() == pytest.approx(want, rel=1e-6, abs=1e-7), (b, g)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_group_with_fewer_than_two_scored_completions_gets_zero(scale):
    nan = float("nan")
    got = group_advantages(torch.tensor([[nan, 5.0, nan], [nan, nan, nan], [1.0, 2.0, 4.0]]), scale)
    assert got[:2].eq(0).all() and not got.isnan().any()
    assert got[2].abs().gt(0.1).all()  # the scored group is unaffected by the others


# ------------------------------------------------------------------------------------------ normalize_then_sum
#: [B=3][G=4][K=3] each function's value (None: no opinion). Group 0: the third function is silent throughout;
#: group 1: the first function is constant, a completion is unscorable (every function None); group 2: the second
#: function has a single value (no standard deviation: it adds nothing), the third a spread of 1e-3 (the 1e-4 of
#: its divisor matters).
COMPONENTS = [
    [[1.0, 0.5, None], [0.0, None, None], [1.0, 0.25, None], [None, 1.0, None]],
    [[1.0, 0.0, None], [1.0, 2.0, 3.0], [None, None, None], [1.0, 1.0, 4.0]],
    [[0.0, None, 0.001], [2.0, 5.0, 0.002], [1.0, None, 0.0], [3.0, None, 0.001]],
]
WEIGHTS = [1.0, 0.5, -2.0]


def _tensor(rows):
    return torch.tensor([[[math.nan if v is None else v for v in c] for c in g] for g in rows], dtype=torch.float64)


def _mean_std(values):
    """Python floats: the mean and the unbiased standard deviation of ``values`` (None where fewer than two)."""
    if len(values) < 2:
        return None, None
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _manual_normalize_then_sum(rows, weights):
    """GDPO written out element by element: ``[B][G]`` summed rewards (None: unscorable) and advantages."""
    sums = []
    for group in rows:
        stats = [_mean_std([c[k] for c in group if c[k] is not None]) for k in range(len(weights))]
        sums.append([])
        for completion in group:
            if all(v is None for v in completion):
                sums[-1].append(None)
                continue
            total = 0.0
            for k, value in enumerate(completion):
                mean, std = stats[k]
                if value is not None and std is not None:
                    total += weights[k] * (value - mean) / (std + STD_EPS)
            sums[-1].append(total)
    mean, std = _mean_std([s for group in sums for s in group if s is not None])
    advantages = [[0.0 if s is None else (s - mean) / (std + STD_EPS) for s in group] for group in sums]
    return sums, advantages


def test_normalize_then_sum_matches_the_hand_computation():
    sums, advantages = _manual_normalize_then_sum(COMPONENTS, WEIGHTS)
    components, weights = _tensor(COMPONENTS), torch.tensor(WEIGHTS)
    got = normalize_then_sum(components, weights)
    expected = torch.tensor([[math.nan if s is None else s for s in g] for g in sums], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9, equal_nan=True)
    assert got[1, 2].isnan() and not got[0].isnan().any()  # only the unscorable completion
    torch.testing.assert_close(normalize_then_sum_advantages(components, weights),
                               torch.tensor(advantages, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    assert normalize_then_sum_advantages(components, weights)[1, 2] == 0  # unscorable: 0
    # float32 components compute in float32, within its rounding
    torch.testing.assert_close(normalize_then_sum_advantages(components.float(), weights),
                               torch.tensor(advantages, dtype=torch.float32), rtol=1e-4, atol=1e-4)


def _trl_advantages(rewards_per_func, weights, num_generations, eps_under_root=False):
    """TRL 1.16's normalize_then_sum from its definition: ``[N, K]`` rewards (NaN: None) -> ``[N]`` advantages,
    ``(x - mean) / (std + 1e-4)`` in the group and then over the batch (``eps_under_root``: ``sqrt(var + 1e-4)``
    instead, a placement the test must tell apart). Its nanstd is the NaN-ignoring mean of the squared deviations
    times ``n / (n - 1)`` (NaN for n < 2), a division of integer counts: float32 (torch's default dtype) even
    for float64 rewards, so the two agree to that rounding."""
    def nanstd(x, dim):
        n = (~x.isnan()).sum(dim=dim, keepdim=True)
        variance = ((x - x.nanmean(dim=dim, keepdim=True)) ** 2).nanmean(dim=dim, keepdim=True)
        return (variance * torch.where(n > 1, n / (n - 1), torch.full_like(variance, math.nan))).sqrt()

    def scale(x, dim):
        return (nanstd(x, dim) ** 2 + 1e-4).sqrt() if eps_under_root else nanstd(x, dim) + 1e-4

    k = rewards_per_func.shape[1]
    unscorable = rewards_per_func.isnan().all(dim=1)
    grouped = rewards_per_func.view(-1, num_generations, k)
    normalized = (grouped - grouped.nanmean(dim=1, keepdim=True)) / scale(grouped, 1)
    rewards = (normalized.view(-1, k) * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = math.nan
    advantages = (rewards - rewards.nanmean()) / scale(rewards, 0)
    return advantages.nan_to_num(nan=0.0)


def test_normalize_then_sum_equals_trls_formula():
    g = torch.Generator().manual_seed(0)
    B, G, K = 5, 6, 3
    components = torch.randint(0, 4, (B, G, K), generator=g).double() / 4
    components[0, :, 1] = 0.75                                        # a constant function
    components[1, :, 2] = 1e-3 * torch.rand(G, generator=g).double()  # a spread the 1e-4 weighs on
    components[torch.rand(B, G, K, generator=g) < 0.25] = math.nan    # None values
    components[2, 3] = math.nan                                       # an unscorable completion
    components[3, :, 0] = math.nan                                    # a function silent in a group
    components[4, 1:, 1] = math.nan                                   # a function with a single value
    weights = torch.tensor([1.0, 0.3, -2.0], dtype=torch.float64)
    flat = components.reshape(B * G, K)
    ours = normalize_then_sum_advantages(components, weights)
    torch.testing.assert_close(ours, _trl_advantages(flat, weights, G).view(B, G), rtol=1e-7, atol=1e-7)
    assert ours[2, 3] == 0
    # the comparison can fail: the 1e-4 under the square root, or None read as 0, differ
    assert not torch.allclose(ours, _trl_advantages(flat, weights, G, eps_under_root=True).view(B, G), atol=1e-3)
    assert not torch.allclose(ours, normalize_then_sum_advantages(components.nan_to_num(0.0), weights), atol=1e-3)


def test_a_group_without_signal_under_normalize_then_sum_is_one_whose_every_function_is_constant():
    """Group 0: every function is constant over the values it gave, yet the totals vary (the functions answer
    different completions): no signal, its summed normalized rewards are all equal. Group 1: the totals are equal
    (2 each) while the functions vary: signal. Group 2: varies in both."""
    rows = [[[1.0, None], [1.0, None], [None, 3.0], [None, 3.0]],
            [[2.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 1.0]],
            [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]]]
    components, weights = _tensor(rows), torch.tensor([1.0, 2.0])
    totals = (components.nan_to_num(0.0) * weights).sum(dim=2)
    assert zero_std_groups(totals).tolist() == [False, True, False]
    assert zero_std_groups(components).tolist() == [True, False, False]
    sums = normalize_then_sum(components, weights)
    assert torch.equal(sums[0], torch.zeros(4, dtype=torch.float64)) and sums[1].std() > 0.5
    # None is left out, not compared: a function silent in a whole group is constant there
    assert zero_std_groups(_tensor([[[None, 1.0], [None, 1.0]]])).tolist() == [True]
    with pytest.raises(ValueError, match=r"\[B, G\] or \[B, G, K\]"):
        zero_std_groups(torch.zeros(4))


def test_normalize_then_sum_with_a_gathered_batch_and_degenerate_shapes():
    components, weights = _tensor(COMPONENTS), torch.tensor(WEIGHTS)
    sums = normalize_then_sum(components, weights)
    # the statistics of the batch handed in: here the whole batch's while the advantages are of group 0 only
    torch.testing.assert_close(normalize_then_sum_advantages(components[:1], weights, batch_sums=sums),
                               normalize_then_sum_advantages(components, weights)[:1])
    assert not torch.allclose(normalize_then_sum_advantages(components[:1], weights),
                              normalize_then_sum_advantages(components, weights)[:1])
    # one completion per group: nothing to compare it with, 0 (as TRL)
    assert torch.equal(normalize_then_sum_advantages(torch.rand(3, 1, 2), torch.ones(2)), torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"\[B, G, K\]"):
        normalize_then_sum(torch.zeros(2, 4), torch.ones(1))
    with pytest.raises(ValueError, match=r"weights must be \[K\] = \[2\]"):
        normalize_then_sum(torch.zeros(2, 4, 2), torch.ones(3))
    with pytest.raises(ValueError, match="infinite"):
        normalize_then_sum(torch.tensor([[[0.0], [math.inf]]]), torch.ones(1))


def test_rewards_that_are_not_a_tensor_are_named():
    with pytest.raises(TypeError, match=r"rewards must be a \[B, G\] tensor, got list"):
        group_advantages([[1.0, 0.0]])
    with pytest.raises(TypeError, match=r"batch_rewards must be a \[B', G\] tensor or None, got list"):
        group_advantages(torch.tensor([[1.0, 0.0]]), scale="batch", batch_rewards=[[1.0, 0.0]])
