"""docs/training.md's table of verl's GRPO settings, held to a hand computation of verl's definitions
(verl/trainer/ppo/core_algos.py: the vanilla policy loss with dual-clip, ``agg_loss``'s modes, ``low_var_kl``):
each lit_grpo counterpart it names gives the same loss and gradient on one micro-batch."""

import pytest
import torch

from lit_grpo.update.loss import policy_loss

EPS_LOW, EPS_HIGH, CLIP_C, KL_COEF = 0.2, 0.2, 3.0, 0.05


def _batch():
    """Four completions of up to five tokens in float64, with ratios far below the clip range and above clip_ratio_c,
    advantages of both signs and a padded tail."""
    generator = torch.Generator().manual_seed(0)
    logps = (-torch.rand(4, 5, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    shift = torch.tensor([[0.0, 1.6, -0.5, 0.1, 2.0], [-1.5, 0.05, 1.3, 0.0, 0.0], [0.3, -0.3, 1.9, -2.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)  # log-ratios: exp(1.6) > 3, exp(-1.5)
    old_logps = logps.detach() - shift
    ref_logps = logps.detach() + torch.randn(4, 5, generator=generator, dtype=torch.float64) * 0.3
    advantages = torch.tensor([-1.0, 0.7, -0.4, 1.2], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.float64)
    return logps, old_logps, ref_logps, advantages, mask


def _verl_token_losses(logps, old_logps, advantages):
    """verl's vanilla loss per token: PPO's clip, and for a negative advantage dual-clip's bound ``-A clip_ratio_c``."""
    ratio = torch.exp(logps - old_logps)
    adv = advantages[:, None]
    clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH))
    return torch.where(adv < 0, torch.minimum(clipped, -adv * CLIP_C), clipped)


def _verl_aggregate(losses, mask, mode):
    if mode == "token-mean":
        return (losses * mask).sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return ((losses * mask).sum(1) / mask.sum(1)).mean()
    if mode == "seq-mean-token-sum":
        return (losses * mask).sum(1).mean()
    assert mode == "seq-mean-token-sum-norm"  # loss_scale_factor unset: the mask's width
    return (losses * mask).sum() / mask.shape[1]


@pytest.mark.parametrize("mode, settings, scale", [
    ("token-mean", {"loss_type": "bnpo"}, 1.0),
    ("token-mean", {"loss_type": "dapo"}, 1.0),  # one micro-batch: its tokens are the step's
    ("seq-mean-token-mean", {"loss_type": "grpo"}, 1.0),
    ("seq-mean-token-sum", {"loss_type": "luspo", "importance_sampling_level": "token"}, 1.0),
    ("seq-mean-token-sum-norm", {"loss_type": "dr_grpo"}, 4.0),  # verl's divides by no count of completions
])
def test_verls_loss_aggregation_dual_clip_and_kl_loss_are_lit_grpos_loss_types_delta_and_beta(mode, settings,
                                                                                               scale, recwarn):
    logps, old_logps, ref_logps, advantages, mask = _batch()
    log_ratio = ref_logps - logps
    low_var_kl = torch.exp(log_ratio) - log_ratio - 1  # verl's k3, within its clamps here
    verl = _verl_aggregate(_verl_token_losses(logps, old_logps, advantages), mask, mode) + \
        KL_COEF * _verl_aggregate(low_var_kl, mask, mode)
    (verl_grad,) = torch.autograd.grad(verl, logps)
    ours = policy_loss(logps, old_logps, advantages, mask, ref_logps=ref_logps, max_completion_length=5,
                       epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, delta=CLIP_C, beta=KL_COEF, **settings)
    (our_grad,) = torch.autograd.grad(ours, logps)
    torch.testing.assert_close(ours * scale, verl, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(our_grad * scale, verl_grad, rtol=1e-12, atol=1e-12)
    # and dual-clip binds here: without delta the loss differs
    unbounded = policy_loss(logps, old_logps, advantages, mask, ref_logps=ref_logps, max_completion_length=5,
                            epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, beta=KL_COEF, **settings)
    assert not torch.isclose(unbounded * scale, verl)
