"""The sampler correction: its weights per mode against the formulas written out, on-policy ratios of a real
rollout (tiny model, CPU float32), and its effect on the update."""

import math

import numpy as np
import pytest
import torch

from lit_grpo.update.sampler_correction import (
    IMPORTANCE_SAMPLING_MODES,
    SamplerCorrection,
    CorrectionStats,
    importance_sampling_weights,
)
from lit_grpo.update.logprobs import completion_logps
from test_module import make_datamodule, make_module

SHIFTS = [[0.1, -0.3, 0.9, 2.0], [-1.2, 0.4, 0.0, 0.0], [0.5, 0.5, 0.6, 0.0]]  # trainer - sampler, per token
LENGTHS = [4, 2, 3]


def _perturbed(clip_min, clip_max):
    trainer = -torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    shifts = torch.tensor(SHIFTS)
    mask = torch.tensor([[1 if j < n else 0 for j in range(4)] for n in LENGTHS])
    return trainer, trainer - shifts, mask


def _expected(mode, clip_min, clip_max):
    """Per row: one weight per token (token modes) or one per completion (sequence modes), from the shifts."""
    low, high = (clip_min if clip_min is not None else -math.inf), (clip_max if clip_max is not None else math.inf)
    bound = (lambda w: min(max(w, low), high)) if mode.endswith("truncate") else (
        lambda w: w if low <= w <= high else 0.0)
    rows = []
    for shifts, length in zip(SHIFTS, LENGTHS):
        if mode.startswith("token"):
            rows.append([bound(math.exp(s)) if j < length else 1.0 for j, s in enumerate(shifts)])
        else:
            rows.append([bound(math.prod(math.exp(s) for s in shifts[:length]))])
    return torch.tensor(rows)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip_min, clip_max", [(None, 3.0), (0.5, 2.0), (0.5, None)])
def test_each_mode_corrects_a_shifted_sampler_as_its_formula_says(mode, clip_min, clip_max):
    trainer, sampling, mask = _perturbed(clip_min, clip_max)
    got = SamplerCorrection(mode, clip_min, clip_max).weights(trainer, sampling, mask)
    want = _expected(mode, clip_min, clip_max)
    assert got.shape == ((3, 4) if mode.startswith("token") else (3, 1))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if mode == "sequence_mask" and clip_max == 3.0:  # exp(2.7), exp(1.6) > 3: masked
        assert got[0, 0] == got[2, 0] == 0 and got[1, 0] == pytest.approx(math.exp(-0.8))
    if mode == "token_truncate" and clip_max == 2.0:  # exp(0.9), exp(2.0) > 2 are cut to 2; exp(-1.2) to 0.5
        assert got[0, 2] == got[0, 3] == 2.0 and got[1, 0] == 0.5


def test_none_mode_and_nan_sampling_log_probs():
    trainer, sampling, mask = _perturbed(None, 3.0)
    assert importance_sampling_weights(trainer, sampling, mask, "none") is None
    sampling = sampling.clone()
    sampling[1, 0] = float("nan")  # a token the sampler could not score: no correction for it
    weights = importance_sampling_weights(trainer, sampling, mask, "token_truncate", None, 3.0)
    assert weights[1, 0] == 1.0 and weights[1, 1] == pytest.approx(math.exp(0.4))
    stats = CorrectionStats()
    stats.update(trainer, sampling, mask, weights)
    metrics = stats.as_metrics()
    active = [abs(s) for row, n in zip(SHIFTS, LENGTHS) for s in row[:n]]
    active.remove(1.2)  # the NaN token is left out of the difference
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(sum(active) / len(active))
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(2.0)
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(3.0)  # exp(2.0) truncated


def test_the_bounds_are_kept_as_plain_floats():
    # a bound computed with numpy is the float it holds, as the config's owner stores it and a checkpoint saves it
    correction = SamplerCorrection("token_mask", np.float32(0.5), np.int64(4))
    assert (correction.clip_min, correction.clip_max) == (0.5, 4.0)
    assert (type(correction.clip_min), type(correction.clip_max)) == (float, float)


def test_bad_settings_name_the_value_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"sampler_correction.mode='tis' is not known; use one of \['auto', 'none', "):
        SamplerCorrection("tis")
    with pytest.raises(ValueError, match=r"sampler_correction.clip_min=2.0 must be < sampler_correction.clip_max=1"):
        SamplerCorrection("token_mask", 2.0, 1.0)
    for value in (-1.0, math.nan, "2"):  # an upper bound of inf is none, as None
        with pytest.raises(ValueError, match=rf"^sampler_correction.clip_max={value!r} is not allowed; "
                                             r"sampler_correction.clip_max must be a number > 0 or None$"):
            SamplerCorrection("token_mask", None, value)
    for value in ("2", True, math.inf):  # a string failed a comparison with a TypeError; a bool was taken as 1
        # (an infinite lower bound truncated every weight to inf)
        with pytest.raises(ValueError, match=rf"^sampler_correction.clip_min={value!r} is not allowed; "
                                             r"sampler_correction.clip_min must be a finite number > 0 or None$"):
            SamplerCorrection("token_mask", value, None)
    assert SamplerCorrection("token_truncate", None, math.inf).clip_max == math.inf  # an upper bound of inf: none
    with pytest.raises(ValueError, match=r"mode='token_truncate' needs sampler_correction.clip_min or"):
        SamplerCorrection("token_truncate", None, None)
    with pytest.raises(ValueError, match=r"importance_sampling_mode='auto' is not known"):  # resolve it first
        importance_sampling_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "auto")
    SamplerCorrection("sequence_mask", None, None)  # masking nothing is allowed, as in TRL
    from lit_grpo.update.module import GRPOModule

    with pytest.raises(ValueError, match="sampler_correction.mode='sequence'"):
        GRPOModule(model="tiny-llama", sampler_correction={"mode": "sequence"})
    with pytest.raises(ValueError, match="sampler_correction.clip_min=5.0 must be <"):
        GRPOModule(model="tiny-llama", sampler_correction={"clip_min": 5.0})


# ------------------------------------------------------------------------------------------------ real rollouts
@pytest.fixture(scope="module")
def rollout():
    module = make_module()
    batch = make_datamodule(module, reward_funcs=["char_fraction", "accuracy"]).build_train_batch()
    assert batch.advantages.abs().sum() > 0, "the test needs a rollout with a learning signal"
    return module, batch


@pytest.mark.parametrize("mode", IMPORTANCE_SAMPLING_MODES[1:])
def test_on_policy_ratios_are_one(rollout, mode):
    """No carried tokens, float32 on CPU: the update's log-probs reproduce the sampler's, every ratio is 1."""
    module, batch = rollout
    micro = batch.micro_batch(torch.arange(batch.num_completions))
    with torch.no_grad():
        trainer, _ = completion_logps(module.policy, micro, batch.temperature)
    mask = micro["completion_mask"]
    weights = SamplerCorrection(mode, None, 3.0).weights(trainer, micro["sampling_logprobs"], mask)
    torch.testing.assert_close(weights, torch.ones_like(weights), atol=1e-4, rtol=0)

    optimizer = torch.optim.SGD(module.policy.parameters(), lr=0.0)
    metrics = make_module(sampler_correction={"mode": mode}).grpo_step(batch, optimizer)
    for key in ("min", "mean", "max"):
        assert metrics[f"sampling/importance_sampling_ratio/{key}"] == pytest.approx(1.0, abs=1e-4)
    assert 0 <= metrics["sampling/sampling_logp_difference/mean"] <= metrics["sampling/sampling_logp_difference/max"]
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-4


def _grads(batch, **kwargs):
    module = make_module(**kwargs)
    metrics = module.grpo_step(batch, torch.optim.SGD(module.policy.parameters(), lr=0.0))
    return {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}, metrics


def _assert_same_grads(a, b):
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-4, msg=name)


def _with_shifted_sampler(batch, ratio: float = 5.0):
    """A copy of ``batch`` whose largest-advantage completion (p, k) has sampling log-probs shifted so that its
    sequence ratio trainer / sampler is ``ratio``; returns (copy, p, k, its length)."""
    row = int(batch.advantages.flatten().abs().argmax())
    p, k = divmod(row, batch.group_size)
    length = int(batch.completion_lengths[p, k])
    shifted = batch.to("cpu")
    shifted.sampling_logprobs = batch.sampling_logprobs.clone()
    shifted.sampling_logprobs[p, k, :length] -= math.log(ratio) / length
    return shifted, p, k, length


def test_vespo_logs_its_weights_mean_over_the_steps_completions(rollout):
    """train/phi_seq_mean (TRL's vespo/phi_seq_mean): vespo's weight averaged over the step's completions, each
    counted once however the micro-batches cut them. On policy every weight is phi(1) = 1; a completion the
    default correction's sequence_mask drops weighs 0, so over micro-batches of 3, 3 and 2 rows the mean is
    (N - 1) / N. A loss without the weight logs no such key."""
    _, batch = rollout
    n = batch.num_completions
    assert n == 8
    vespo = {"loss": {"loss_type": "vespo"}, "train_micro_batch_size": 3}
    assert _grads(batch, **vespo)[1]["train/phi_seq_mean"] == pytest.approx(1.0, abs=1e-4)
    shifted, _, _, length = _with_shifted_sampler(batch)
    shifted.offpolicy_tokens = length
    assert _grads(shifted, **vespo)[1]["train/phi_seq_mean"] == pytest.approx((n - 1) / n, abs=1e-4)
    assert "train/phi_seq_mean" not in _grads(batch, loss={"loss_type": "dapo"})[1]


def test_the_update_masks_and_truncates_a_perturbed_sequence(rollout):
    """Shift one completion's sampling log-probs so that its sequence ratio is 5: sequence_mask drops it (as if its
    advantage were 0) and sequence_truncate weighs it 3 (as if its advantage were 3 A); the others keep ratio ~1."""
    _, batch = rollout
    shifted, p, k, length = _with_shifted_sampler(batch)  # trainer / sampler = 5 over the sequence

    def with_advantage(scale):
        changed = batch.to("cpu")
        changed.advantages = batch.advantages.clone()
        changed.advantages[p, k] *= scale
        return changed

    masked, metrics = _grads(shifted, sampler_correction={"mode": "sequence_mask", "clip_max": 3.0})
    _assert_same_grads(masked, _grads(with_advantage(0.0), sampler_correction={"mode": "none"})[0])
    assert metrics["sampling/importance_sampling_ratio/min"] == 0.0
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(5.0) / length, rel=1e-3)

    truncated, metrics = _grads(shifted, sampler_correction={"mode": "sequence_truncate"})
    _assert_same_grads(truncated, _grads(with_advantage(3.0), sampler_correction={"mode": "none"})[0])
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(3.0)

    untouched, metrics = _grads(shifted, sampler_correction={"mode": "none"})
    _assert_same_grads(untouched, _grads(batch, sampler_correction={"mode": "none"})[0])
    assert "sampling/importance_sampling_ratio/max" not in metrics  # no correction: no weights to report


def test_auto_corrects_exactly_the_batches_that_carry_samples_from_older_weights(rollout):
    """The default ("auto"): a batch whose tokens all come from this step's weights is left alone even when its
    sampling log-probs disagree; the same batch marked as carrying older samples gets TRL's sequence_mask (ratio 5
    > clip_max 3: the perturbed completion is dropped, as if its advantage were 0)."""
    _, batch = rollout
    shifted, p, k, length = _with_shifted_sampler(batch)
    assert SamplerCorrection().mode == "auto" and batch.offpolicy_tokens == 0

    on_policy, metrics = _grads(shifted)
    _assert_same_grads(on_policy, _grads(shifted, sampler_correction={"mode": "none"})[0])
    assert "sampling/importance_sampling_ratio/max" not in metrics

    shifted.offpolicy_tokens = length  # as the builder marks a carried group's tokens
    dropped = batch.to("cpu")
    dropped.advantages = batch.advantages.clone()
    dropped.advantages[p, k] = 0.0
    corrected, metrics = _grads(shifted)
    _assert_same_grads(corrected, _grads(dropped, sampler_correction={"mode": "none"})[0])
    assert metrics["sampling/importance_sampling_ratio/min"] == 0.0
    assert SamplerCorrection("token_mask").for_batch(True).mode == "token_mask"  # a chosen mode is kept


@pytest.mark.parametrize("k", [0.0, 2.0])
def test_vespo_under_auto_drops_the_completion_the_mask_drops(rollout, k):
    """vespo takes the correction into its sequence ratio: a completion the default's sequence_mask drops weighs 0,
    also at vespo_k 0, where its ratio's floor (1e-8) would weigh it exp(lambda), the most."""
    _, batch = rollout
    shifted, p, k_row, length = _with_shifted_sampler(batch)
    shifted.offpolicy_tokens = length
    dropped = batch.to("cpu")
    dropped.advantages = batch.advantages.clone()
    dropped.advantages[p, k_row] = 0.0
    loss = {"loss_type": "vespo", "vespo_k_pos": k, "vespo_k_neg": k}
    corrected, metrics = _grads(shifted, loss=loss)
    _assert_same_grads(corrected, _grads(dropped, loss=loss, sampler_correction={"mode": "none"})[0])
    assert metrics["sampling/importance_sampling_ratio/min"] == 0.0


def test_the_weights_name_an_unresolved_auto_mode_and_a_tensor_of_another_shape():
    trainer = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"mode='auto' is resolved per batch: call "
                                         r"for_batch\(has_older_samples\) first"):
        SamplerCorrection().weights(trainer, trainer, torch.ones(2, 3))
    for name, args in (("sampling_logps", (trainer, trainer[:, :2], torch.ones(2, 3))),
                       ("mask", (trainer, trainer, torch.ones(3)))):
        with pytest.raises(ValueError, match=rf"{name} has shape .*, expected trainer_logps' shape \(2, 3\)"):
            SamplerCorrection(mode="token_mask").weights(*args)
