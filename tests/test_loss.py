"""Each loss_type (and beta > 0) against a direct computation with explicit loops over sequences and tokens."""

import math

import numpy as np
import pytest
import torch

from lit_grpo.update.loss import micro_batch_weight, policy_loss, policy_loss_metrics
from lit_grpo.update.policy_losses import make_loss

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _inputs(seed=0, n=4, t=5):
    """float64: the losses computed from these agree with the hand loops (and with each other) to ~1e-15 whatever
    the CPU's vectorized exp and reduction order, so the comparisons below hold at 1e-10."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(n, t, generator=g) * 2
    old = logps + (torch.rand(n, t, generator=g) - 0.5) * 0.8  # ratios on both sides of the clip range
    ref = logps + (torch.rand(n, t, generator=g) - 0.5) * 0.5
    adv = torch.tensor([1.0, -0.5, 0.0, 2.0])[:n]
    lengths = [5, 3, 1, 4][:n]
    mask = torch.zeros(n, t)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    return logps.double(), old.double(), ref.double(), adv.double(), mask.double()


def _token_loss(lp, olp, rlp, a, beta):
    ratio = math.exp(lp - olp)
    clipped = min(max(ratio, 1 - EPS_LOW), 1 + EPS_HIGH)
    loss = -min(ratio * a, clipped * a)
    if beta:
        loss += beta * (math.exp(rlp - lp) - (rlp - lp) - 1)
    return loss


def _hand(logps, old, ref, adv, mask, loss_type, beta=0.0, max_len=None, total=None):
    n, t = logps.shape
    per_seq_sums, per_seq_counts = [], []
    for i in range(n):
        s, c = 0.0, 0
        for j in range(t):
            if mask[i, j]:
                s += _token_loss(logps[i, j].item(), old[i, j].item(), ref[i, j].item(), adv[i].item(), beta)
                c += 1
        per_seq_sums.append(s)
        per_seq_counts.append(c)
    total_sum, active = sum(per_seq_sums), sum(per_seq_counts)
    if loss_type == "grpo":
        return sum(s / max(c, 1) for s, c in zip(per_seq_sums, per_seq_counts)) / n
    if loss_type == "bnpo":
        return total_sum / active
    if loss_type == "dr_grpo":
        return total_sum / (n * max_len)
    return total_sum / (total if total is not None else active)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_types_match_hand_computation(loss_type, beta):
    logps, old, ref, adv, mask = _inputs()
    kwargs = dict(loss_type=loss_type, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, beta=beta,
                  ref_logps=ref if beta else None, max_completion_length=8)
    got = policy_loss(logps, old, adv, mask, **kwargs)
    expected = _hand(logps, old, ref, adv, mask, loss_type, beta, max_len=8)
    assert got.shape == ()
    # float64 end to end (inputs, torch's loss, the hand loops): the two differ by ~1e-15 whatever the CPU's
    # vectorized exp and sums, so 1e-10
    assert got.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_dapo_uses_the_whole_step_token_count():
    logps, old, ref, adv, mask = _inputs()
    got = policy_loss(logps, old, adv, mask, loss_type="dapo", total_active_tokens=40)
    assert got.item() == pytest.approx(_hand(logps, old, ref, adv, mask, "dapo", total=40), rel=1e-10)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batch_weights_sum_to_the_full_loss(loss_type):
    logps, old, ref, adv, mask = _inputs()
    total = mask.sum()
    full = policy_loss(logps, old, adv, mask, loss_type=loss_type, max_completion_length=8, total_active_tokens=total)
    parts = 0.0
    for rows in (slice(0, 3), slice(3, 4)):
        n_rows = rows.stop - rows.start
        part = policy_loss(logps[rows], old[rows], adv[rows], mask[rows], loss_type=loss_type,
                           max_completion_length=8, total_active_tokens=total)
        parts = parts + part * micro_batch_weight(loss_type, n_rows, 4, 2)
    assert parts.item() == pytest.approx(full.item(), rel=1e-10)
    assert micro_batch_weight("bnpo", 2, 4, 2) == 0.5
    # bnpo averages the micro-batches' token means, whatever their sizes (TRL's accumulation): not rows / total
    assert micro_batch_weight("bnpo", 1, 4, 2) == micro_batch_weight("bnpo", 3, 4, 2) == 0.5


def test_gradient_of_unclipped_ratio_is_minus_advantage():
    logps = torch.zeros(1, 2, requires_grad=True)
    loss = policy_loss(logps, logps.detach(), torch.tensor([2.0]), torch.ones(1, 2), loss_type="bnpo")
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.0, -1.0]]))  # -A / active tokens


def test_metrics_clip_ratios_and_kl():
    logps = torch.log(torch.tensor([[0.5, 1.5, 1.0]]))  # ratio vs old=0: 0.5 (low), 1.5 (high), 1.0
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    neg = policy_loss_metrics(logps, old, torch.tensor([-1.0]), mask)
    pos = policy_loss_metrics(logps, old, torch.tensor([1.0]), mask)
    assert neg["clip_ratio_low"].item() == pytest.approx(1 / 3) and neg["clip_ratio_high"].item() == 0
    assert pos["clip_ratio_high"].item() == pytest.approx(1 / 3) and pos["clip_ratio_low"].item() == 0
    assert "kl" not in pos
    ref = torch.zeros(1, 3)
    kl = policy_loss_metrics(logps, old, torch.tensor([1.0]), mask, ref_logps=ref)["kl"]
    k3 = [math.exp(-lp) + lp - 1 for lp in (math.log(0.5), math.log(1.5), 0.0)]  # d = ref - logp = -logp
    assert kl.item() == pytest.approx(sum(k3) / 3, rel=1e-6)
    # a padded token (mask 0) with a huge KL counts in no mean
    padded = policy_loss_metrics(torch.cat([logps, torch.full((1, 1), -30.0)], 1), torch.zeros(1, 4),
                                 torch.tensor([1.0]), torch.tensor([[1.0, 1.0, 1.0, 0.0]]), ref_logps=torch.zeros(1, 4))
    assert padded["kl"].item() == pytest.approx(sum(k3) / 3, rel=1e-6)
    # cispo caps the weight of tokens with a positive advantage only: a high ratio with A < 0 is not clipped
    cispo = policy_loss_metrics(logps, old, torch.tensor([-1.0]), mask, loss_type="cispo", epsilon_high=1.2)
    assert cispo["clip_ratio_high"].item() == 0 and cispo["clip_ratio_low"].item() == 0
    assert policy_loss_metrics(logps, old, torch.tensor([1.0]), mask, loss_type="cispo",
                               epsilon_high=1.2)["clip_ratio_high"].item() == pytest.approx(1 / 3)


def test_bad_inputs_name_the_value():
    logps, old, ref, adv, mask = _inputs()
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        policy_loss(logps, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="beta=0.1 > 0 needs ref_logps"):
        policy_loss(logps, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logps, old, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="epsilon_low=-0.1"):
        policy_loss(logps, old, adv, mask, epsilon_low=-0.1)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(logps, old, adv[:2], mask)
    with pytest.raises(ValueError, match="mask has shape"):
        policy_loss(logps, old, adv, mask[:, :2])
    with pytest.raises(ValueError, match="beta=-1"):
        policy_loss(logps, old, adv, mask, beta=-1, ref_logps=ref)


# ------------------------------------------------------------------------------------------------ loss objects
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_a_loss_object_matches_the_hand_computation(loss_type):
    """The object ``make_loss`` builds from a ``LossConfig`` computes the loops written out above (KL on, dapo with
    a step-wide token count), and its micro-batch weight is the variant's (rows / step rows; bnpo 1 / micro-batches;
    dapo the world size)."""
    from lit_grpo.update.loss_config import LossConfig
    from lit_grpo.update.policy_losses import make_loss

    logps, old, ref, adv, mask = _inputs(seed=1)
    config = LossConfig(loss_type=loss_type, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, beta=0.04)
    loss_fn = make_loss(config)
    assert loss_fn.name == loss_type and loss_fn.config == config
    got = loss_fn(logps, old, adv, mask, ref, max_completion_length=8, total_active_tokens=17)
    want = _hand(logps, old, ref, adv, mask, loss_type, beta=0.04, max_len=8, total=17)
    assert got.item() == pytest.approx(want, rel=1e-10, abs=1e-12)  # float64 end to end, as above
    weight = {"grpo": 3 / 12, "bnpo": 1 / 4, "dr_grpo": 3 / 12, "dapo": 2.0}[loss_type]
    assert loss_fn.micro_batch_weight(3, 12, 4, world_size=2) == pytest.approx(weight)
    assert loss_fn.needs_step_tokens == (loss_type == "dapo")
    assert make_loss(loss_type, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, beta=0.04) is loss_fn  # built once


def test_loss_objects_are_checked_once_when_built():
    import dataclasses

    from lit_grpo.update.loss_config import LOSS_TYPES, LossConfig
    from lit_grpo.update.policy_losses import LOSSES, GRPOLoss, make_loss

    assert tuple(LOSSES) == LOSS_TYPES  # every name the config accepts has its variant
    with pytest.raises(ValueError, match=r"loss_type='ppo' is not known; use one of \['grpo', 'bnpo', "):
        make_loss("ppo")
    with pytest.raises(ValueError, match=r"^epsilon_low=1.0 is not allowed; epsilon_low must be a finite number >= 0 "
                                         r"and < 1 \(1 - epsilon_low is the ratio's lower clip\)$"):
        make_loss("grpo", epsilon_low=1.0)
    for value in (-0.5, math.nan, "0.3"):
        with pytest.raises(ValueError, match=rf"^epsilon_high={value!r} is not allowed; epsilon_high must be a number "
                                             r">= 0 \(inf: no upper clip\)$"):
            make_loss("dapo", epsilon_high=value)
    with pytest.raises(ValueError, match=r"^beta=nan is not allowed; beta must be a finite number >= 0$"):
        make_loss("bnpo", beta=float("nan"))
    # a string failed a comparison with a TypeError, a bool weighed as 1, an infinite beta made the loss inf or NaN
    for name, value, allowed in (("epsilon_low", "0.2", r">= 0 and < 1 \("), ("beta", True, ">= 0$"),
                                 ("beta", math.inf, ">= 0$"), ("sapo_temperature_pos", math.inf, "> 0$")):
        with pytest.raises(ValueError, match=rf"^{name}={value!r} is not allowed; {name} must be a finite number "
                                             rf"{allowed}"):
            LossConfig(**{name: value})
    assert LossConfig(epsilon_high=math.inf).epsilon_high == math.inf  # no upper clip
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_loss("dapo").config = LossConfig(beta=1.0)
    with pytest.raises(ValueError, match=r"GRPOLoss is loss_type='grpo', its config says loss_type='dapo'"):
        GRPOLoss(LossConfig(loss_type="dapo"))
    with pytest.raises(TypeError, match=r"make_loss got a LossConfig and settings \['beta'\]"):
        make_loss(LossConfig(), beta=0.1)


def test_loss_settings_are_kept_as_plain_floats():
    # a setting computed with numpy is the float it holds, as the module stores it and a checkpoint saves it
    from dataclasses import fields

    from lit_grpo.update.loss_config import LossConfig

    numeric = [f.name for f in fields(LossConfig) if f.type in ("float", "float | None")]
    values = {f.name: np.float64(f.default) for f in fields(LossConfig) if f.name in numeric and f.default is not None}
    values.update(delta=np.float64(2.0), off_policy_mask_threshold=np.float32(0.5), entropy_coef=np.int64(0))
    config = LossConfig(**values, use_adaptive_entropy=True)
    assert {name: type(getattr(config, name)) for name in numeric} == {name: float for name in numeric}
    assert (config.delta, config.entropy_coef, config.off_policy_mask_threshold) == (2.0, 0.0, 0.5)
    assert LossConfig().delta is None and LossConfig().off_policy_mask_threshold is None


def test_micro_batch_weights_of_the_objects_span_the_ranks():
    from lit_grpo.update.policy_losses import make_loss

    # dapo's normalizer spans every rank while ddp averages gradients: its weight is the world size
    assert make_loss("dapo").micro_batch_weight(2, 8, 4, world_size=3) == 3.0
    assert make_loss("grpo").micro_batch_weight(2, 8, 4, world_size=3) == 0.25
    assert make_loss("dr_grpo").micro_batch_weight(2, 8, 4) == 0.25
    assert make_loss("bnpo").micro_batch_weight(2, 8, 4, world_size=3) == 0.25
    with pytest.raises(ValueError, match="world_size=0"):
        make_loss("grpo").micro_batch_weight(2, 8, 4, world_size=0)
    with pytest.raises(ValueError, match="num_sequences=9, total_sequences=8"):
        micro_batch_weight("dapo", 9, 8, 1)


# ------------------------------------------------------------------------------------------------ the API boundary
def test_metrics_check_their_inputs_as_the_loss_does():
    logps, old, ref, adv, mask = _inputs()
    with pytest.raises(ValueError, match=r"old_logps has shape \(4, 2\)"):
        policy_loss_metrics(logps, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match=r"advantages must be \[N\] = \[4\], got shape \(2, 2\)"):
        policy_loss_metrics(logps, old, adv.view(2, 2), mask)


def test_a_tensor_on_another_device_or_of_a_wrong_dtype_is_named():
    """A stand-in for advantages left on the CPU beside CUDA log-probs: the meta device, on any machine."""
    logps, old, ref, adv, mask = _inputs()
    for name, args in (("advantages", (logps, old, adv.to("meta"), mask)),
                       ("mask", (logps, old, adv, mask.to("meta"))),
                       ("old_logps", (logps, old.to("meta"), adv, mask))):
        with pytest.raises(ValueError, match=rf"{name} is on meta, logps on cpu"):
            policy_loss(*args)
    with pytest.raises(ValueError, match=r"ref_logps is on meta, logps on cpu"):
        policy_loss(logps, old, adv, mask, beta=0.1, ref_logps=ref.to("meta"))
    with pytest.raises(ValueError, match=r"logps must be floating point \(log-probs\), got torch.int64"):
        policy_loss(logps.long(), old, adv, mask)
    with pytest.raises(ValueError, match=r"old_logps must be floating point \(log-probs\), got torch.int64"):
        policy_loss_metrics(logps, old.long(), adv, mask)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("pad", [math.nan, -math.inf, math.inf])
def test_what_padding_holds_changes_neither_the_loss_nor_its_gradient(loss_type, level, pad):
    """NaN or -inf where ``mask`` is 0 (a log-prob nobody computed) are ignored, as the docstrings' "mask marks the
    real tokens" says; the all-masked row (``_inputs``' third has one token: masked here) too. The sampler's
    log-probs and the entropies, which only their masked consumers read, take ``pad`` (an infinite entropy would
    rank first)."""
    logps, old, ref, adv, mask = _inputs()
    mask[2] = 0
    settings = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, max_completion_length=5,
                    off_policy_mask_threshold=0.5, top_entropy_quantile=0.5)
    if loss_type == "cispo":
        settings["epsilon_high"] = 5.0
    entropy = torch.rand(logps.shape, dtype=logps.dtype, generator=torch.Generator().manual_seed(1))
    weights = torch.full_like(logps, 0.9)
    pads = {"logps": math.nan, "old": -math.inf, "ref": math.nan, "sampled": pad, "entropy": pad,
            "weights": math.nan}

    def loss_and_grad(fill):
        def padded(name, tensor):
            return tensor.masked_fill(~mask.bool(), pads[name]) if fill else tensor
        current = padded("logps", logps).detach().clone().requires_grad_()
        loss = policy_loss(current, padded("old", old), adv, mask, ref_logps=padded("ref", ref),
                           sampling_logps=padded("sampled", old), entropy=padded("entropy", entropy),
                           sampling_weights=padded("weights", weights), **settings)
        loss.backward()
        # the object's metrics, which take the sampler correction's weights as GRPOModule passes them (vespo's)
        metrics = make_loss(**{k: v for k, v in settings.items() if k != "max_completion_length"}).metrics(
            current.detach(), padded("old", old), adv, mask, padded("ref", ref), padded("weights", weights))
        return loss.detach(), current.grad, metrics

    with _quiet():  # the settings' warnings of an unusual combination
        clean, clean_grad, clean_metrics = loss_and_grad(False)
        padded_loss, padded_grad, padded_metrics = loss_and_grad(True)
    assert torch.isfinite(clean) and torch.isfinite(clean_grad).all()
    torch.testing.assert_close(padded_loss, clean)
    torch.testing.assert_close(padded_grad, clean_grad)
    assert padded_grad[2].eq(0).all()
    torch.testing.assert_close(padded_metrics, clean_metrics)


def _quiet():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def ignoring():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    return ignoring()


def test_a_tensor_step_token_count_is_a_scalar_and_is_not_read_to_the_host():
    """A count summed on the device over the step's micro-batches is used where it is: reading it back for the
    ``>= 0`` check would wait on the device at every micro-batch."""
    logps, old, ref, adv, mask = _inputs()

    class OnTheDevice(torch.Tensor):
        def __float__(self):
            raise AssertionError("total_active_tokens was read to the host")

        item = __float__

    total = torch.tensor(20.0, dtype=torch.float64).as_subclass(OnTheDevice)
    loss = policy_loss(logps, old, adv, mask, loss_type="dapo", total_active_tokens=total)
    expected = _hand(logps, old, ref, adv, mask, "dapo", total=20.0)
    assert loss.shape == () and float(loss.as_subclass(torch.Tensor)) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match=r"total_active_tokens must be a number or a one-element tensor, got a "
                                         r"tensor of shape \(2,\)"):
        policy_loss(logps, old, adv, mask, loss_type="dapo", total_active_tokens=torch.tensor([20.0, 20.0]))
    with pytest.raises(ValueError, match=r"total_active_tokens=-1 must be >= 0"):
        policy_loss(logps, old, adv, mask, loss_type="dapo", total_active_tokens=-1)
    # a repr of an int of more than 4300 digits failed in place of the refusal
    with pytest.raises(ValueError, match=r"^total_active_tokens=\(a negative int of 5001 digits\) must be >= 0$"):
        policy_loss(logps, old, adv, mask, loss_type="dapo", total_active_tokens=-10**5000)
    with pytest.raises(ValueError, match=r"^loss_type='dr_grpo' needs max_completion_length >= 1 \(the rollout's "
                                         r"max_new_tokens\), got a negative int of 5001 digits$"):
        policy_loss(logps, old, adv, mask, loss_type="dr_grpo", max_completion_length=-10**5000)
