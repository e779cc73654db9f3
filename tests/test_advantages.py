import math

import pytest
import torch

from lit_grpo.rollout.advantages import STD_EPS, group_advantages, zero_std_groups


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
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages(torch.tensor([[0.0, float("nan")]]), "group")
    with pytest.raises(ValueError, match="empty"):
        group_advantages(torch.zeros(0, 4), "group")
