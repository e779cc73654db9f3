"""The entropy bonus (``loss.entropy_coef``) and its adaptive control (``loss.use_adaptive_entropy``): the gradient
is autograd's of the written-out objective, off it changes nothing, the control's rule and gate are TRL's, and its
state survives a resume."""

import math
import re

import pytest
import torch

from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.update import logprobs
from lit_grpo.update.entropy_bonus import (EntropyControl, bonus_tokens, bonus_weight, entropy_bonus, entropy_stats,
                                           next_coefficient)
from lit_grpo.update.logprobs import completion_logits, token_logps
from lit_grpo.update.loss_config import LossConfig
from lit_grpo.update.module import ENTROPY_CONTROL_KEY, GRPOModule
from lit_grpo.update.policy_losses import make_loss
from lit_grpo.update.surrogates import high_entropy_mask

from datamodule_helpers import datamodule_arguments


def make_module(**kwargs) -> GRPOModule:
    module = GRPOModule(**{"model": "tiny-llama", "max_grad_norm": None, "dtype": "float64", **kwargs})
    module.configure_model()
    return module


@pytest.fixture(scope="module")
def batch():
    module = make_module()
    dm = RolloutDataModule(**datamodule_arguments({"reward_funcs": ["char_fraction", "accuracy"],
                                                   "temperature": 0.8}))
    dm.attach(module.policy, module.tokenizer)
    dm.setup("fit")
    batch = dm.build_train_batch()
    assert batch.advantages.abs().sum() > 0 and batch.temperature == 0.8
    return batch


def step(module, batch, iterations: int = 1):
    """``iterations`` grpo_steps at lr 0 (the weights stay): the last one's gradients and metrics."""
    optimizer = torch.optim.SGD(module.policy.parameters(), lr=0.0)
    for _ in range(iterations):
        metrics = module.grpo_step(batch, optimizer)
    return {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}, metrics


def written_out_grads(module, batch, coef: float, top: float = 1.0, gather=None):
    """The gradients of the step's objective written out over the whole logits: each micro-batch's policy loss x its
    weight, minus ``coef`` x its mean entropy ``-sum(p log p)`` over the loss tokens (x the high-entropy mask)
    / the micro-batches. ``gather``: the ranks' all_gather, which the loss and the mask each take apart."""
    policy, loss_fn = module.policy, module.loss_fn
    chunks = module._micro_batches(batch)
    total_active = sum(float(module._loss_mask(micro).sum()) for _, micro in chunks)
    policy.zero_grad(set_to_none=True)
    for rows, micro in chunks:
        logits = completion_logits(policy, micro, batch.temperature)
        mask = module._loss_mask(micro)
        logps = token_logps(logits, micro["completion_ids"]) * mask
        log_p = torch.log_softmax(logits, dim=-1)
        entropy = -(log_p.exp() * log_p).sum(dim=-1) * micro["completion_mask"]
        loss = loss_fn(logps, logps.detach(), micro["advantages"], mask, None, batch.max_new_tokens, total_active,
                       None, micro["sampling_logprobs"], entropy.detach(), all_gather=gather)
        loss = loss * loss_fn.micro_batch_weight(len(rows), batch.num_completions, len(chunks))
        tokens = mask.double()
        if top < 1:
            tokens = tokens * high_entropy_mask(entropy, mask, top, gather)
        loss = loss - coef * ((entropy * tokens).sum() / tokens.sum().clamp(min=1.0) / len(chunks))
        loss.backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------------------------ the bonus
@pytest.mark.parametrize("loss_type, top", [("dapo", 1.0), ("grpo", 1.0), ("bnpo", 0.3), ("dr_grpo", 1.0)])
def test_the_bonus_gradient_is_autograds_of_the_written_out_objective(batch, loss_type, top):
    """Three micro-batches (3, 3 and 2 rows): the bonus is each one's mean token entropy at the sampling
    temperature over the tokens the policy term acts on, divided by the micro-batches only, whatever the loss
    type's normalizer; the gradient differs from the one without it."""
    coef = 0.5
    settings = {"loss_type": loss_type, "top_entropy_quantile": top}
    module = make_module(loss={**settings, "entropy_coef": coef}, train_micro_batch_size=3)
    ours, metrics = step(module, batch)
    want = written_out_grads(module, batch, coef, top)
    plain, _ = step(make_module(loss=settings, train_micro_batch_size=3), batch)
    assert ours.keys() == want.keys() and len(want) > 0
    for name in want:
        torch.testing.assert_close(ours[name], want[name], msg=name)
    assert any(not torch.allclose(ours[name], plain[name]) for name in plain)
    assert metrics["train/entropy_coef"] == coef
    assert "train/entropy_coef" not in step(make_module(loss=settings), batch)[1]


def test_under_two_ranks_the_loss_and_the_bonus_share_one_high_entropy_mask_a_micro_batch(batch):
    """With the bonus and ``top_entropy_quantile`` < 1 under a stand-in world of 2 (both ranks this one's rows): the
    update takes each micro-batch's high-entropy mask once, for the policy term and the bonus alike, so the ranks
    meet once for it, in one gather of the values padded to a size every rank knows (rows x max_new_tokens), not
    once each nor after a gather of their lengths; the gradients are those of the objective written out with the
    loss and the mask each gathering on their own."""
    from types import SimpleNamespace

    coef, top = 0.5, 0.3
    module = make_module(loss={"loss_type": "bnpo", "top_entropy_quantile": top, "entropy_coef": coef},
                         train_micro_batch_size=3)
    gathered = []

    def gather(tensor):
        gathered.append(tensor.shape)
        return torch.stack([tensor, tensor])

    strategy = SimpleNamespace(root_device=torch.device("cpu"), all_gather=gather,
                               reduce=lambda t, reduce_op: t * 2, backward=lambda loss, _: loss.backward())
    module._trainer = SimpleNamespace(world_size=2, strategy=strategy)
    try:
        ours, _ = step(module, batch)
    finally:
        module._trainer = None
    chunks = module._micro_batches(batch)
    # one gather a mask, of every rank's bound; the step's end gathers its flag apart from them ([1], once)
    assert gathered.count(torch.Size([3 * batch.max_new_tokens])) == len(chunks) > 1
    assert len(gathered) == len(chunks) + 1 and gathered.count(torch.Size([1])) == 1
    want = written_out_grads(module, batch, coef, top, gather=lambda t: torch.stack([t, t]))
    assert ours.keys() == want.keys() and len(want) > 0
    for name in want:
        torch.testing.assert_close(ours[name], want[name], msg=name)


def test_a_mask_taken_once_gives_the_loss_and_the_bonus_tokens_they_take_themselves():
    g = torch.Generator().manual_seed(1)
    logps = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    old = logps + 0.1 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    advantages, entropy = torch.randn(4, generator=g, dtype=torch.float64), torch.rand(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).long()
    gather = lambda t: torch.stack([t, t.flip(0)])  # noqa: E731  a second rank with other entropies
    kept = high_entropy_mask(entropy, mask, 0.4, gather)
    for loss_type in ("grpo", "dapo", "sapo"):
        loss_fn = make_loss(loss_type, top_entropy_quantile=0.4)
        assert torch.equal(loss_fn(logps, old, advantages, mask, entropy=entropy, all_gather=gather),
                           loss_fn(logps, old, advantages, mask, entropy_mask=kept))
    assert torch.equal(bonus_tokens(entropy, mask, 0.4, gather), bonus_tokens(entropy, mask, 0.4, entropy_mask=kept))


def test_a_high_entropy_mask_given_where_no_quantile_applies_is_refused_by_the_loss_and_the_bonus():
    """At ``top_entropy_quantile`` 1 no mask is taken or applied: one given is refused, naming the quantile, rather
    than dropped unread."""
    logps = -torch.rand(2, 3, dtype=torch.float64)
    mask, entropy = torch.ones(2, 3), torch.rand(2, 3)
    kept = high_entropy_mask(entropy, mask, 0.5)
    refused = r"entropy_mask was given with top_entropy_quantile=1(\.0)?: a high-entropy mask applies only where"
    with pytest.raises(ValueError, match=refused):
        make_loss("grpo")(logps, logps.detach(), torch.ones(2), mask, entropy=entropy, entropy_mask=kept)
    with pytest.raises(ValueError, match=refused):
        bonus_tokens(entropy, mask, 1.0, entropy_mask=kept)


def test_entropy_coef_0_leaves_loss_and_gradients_bit_identical_and_asks_for_no_entropy_gradient(batch, monkeypatch):
    """The default: the update runs as without the feature (the entropy without a graph, nothing added to the
    loss): the gradients and the loss equal, to the bit, those of the policy loss written out alone."""
    asked = []
    original = logprobs.completion_logps

    def recording(*args, **kwargs):
        logps, entropy = original(*args, **kwargs)
        asked.append((kwargs.get("entropy_grad"), entropy.grad_fn))
        return logps, entropy

    monkeypatch.setattr("lit_grpo.update.module.completion_logps", recording)
    module = make_module(train_micro_batch_size=3)
    assert not module.entropy_control.enabled
    grads, metrics = step(module, batch)
    assert asked and all(flag is False and grad_fn is None for flag, grad_fn in asked)
    # the same step by hand from the functions the update has always called
    policy, loss_fn = module.policy, module.loss_fn
    chunks = module._micro_batches(batch)
    total_active = module._total_active_tokens(chunks)
    policy.zero_grad(set_to_none=True)
    total = 0.0
    for rows, micro in chunks:
        logps, entropy = original(policy, micro, batch.temperature, shared_prefix=micro.get("shared_prefix", False))
        mask = module._loss_mask(micro)
        loss = loss_fn(logps, logps.detach(), micro["advantages"], mask, None, batch.max_new_tokens, total_active,
                       None, micro["sampling_logprobs"], entropy)
        loss = loss * loss_fn.micro_batch_weight(len(rows), batch.num_completions, len(chunks))
        loss.backward()
        total += float(loss.detach())
    for name, grad in grads.items():
        assert torch.equal(grad, policy.get_parameter(name).grad), name
    assert metrics["train/loss"] == pytest.approx(total, rel=1e-12) and "train/entropy_coef" not in metrics


def test_bonus_tokens_are_the_policy_terms_and_the_weight_spans_every_ranks_micro_batches():
    g = torch.Generator().manual_seed(0)
    entropy = torch.rand(4, 6, generator=g, dtype=torch.float64).requires_grad_(True)
    mask = (torch.rand(4, 6, generator=g) > 0.3).long()
    assert torch.equal(bonus_tokens(entropy.detach(), mask), mask.double())
    top = bonus_tokens(entropy.detach(), mask, 0.3)
    assert torch.equal(top, (high_entropy_mask(entropy, mask, 0.3) & mask.bool()).double())
    bonus = entropy_bonus(entropy, top)
    torch.testing.assert_close(bonus, entropy[top.bool()].mean())
    bonus.backward()
    torch.testing.assert_close(entropy.grad, top / top.sum())
    stats = entropy_stats(entropy, top)
    assert stats.dtype == torch.float64 and stats.grad_fn is None
    torch.testing.assert_close(stats, torch.stack([entropy[top.bool()].sum(), top.sum()]).detach())
    assert entropy_bonus(entropy, torch.zeros_like(top)) == 0  # no token: no bonus, no NaN
    # TRL's 1 / gradient_accumulation_steps per process, averaged over processes: ours x the world size, over all
    assert bonus_weight(4) == 0.25 and bonus_weight(8, world_size=2) == 0.25 and bonus_weight(5, world_size=2) == 0.4
    with pytest.raises(ValueError, match="num_micro_batches=0"):
        bonus_weight(0)


# ------------------------------------------------------------------------------------------------ adaptive control
def test_the_coefficient_moves_by_delta_within_its_bounds():
    assert next_coefficient(0.1, 0.5, 1.0, 0.02, 0.0, 1.0) == pytest.approx(0.12)  # at or below the target: up
    assert next_coefficient(0.1, 1.0, 1.0, 0.02, 0.0, 1.0) == pytest.approx(0.12)
    assert next_coefficient(0.1, 1.5, 1.0, 0.02, 0.0, 1.0) == pytest.approx(0.08)  # above: down
    assert next_coefficient(0.99, 0.5, 1.0, 0.02, 0.0, 1.0) == 1.0                 # clamped to the bounds
    assert next_coefficient(0.01, 1.5, 1.0, 0.02, 0.0, 1.0) == 0.0
    assert next_coefficient(0.1, math.nan, 1.0, 0.02, 0.05, 1.0) == pytest.approx(0.08)  # NaN is not below


def test_the_control_applies_the_previous_steps_coefficient_only_below_the_target():
    control = EntropyControl(LossConfig(entropy_coef=0.1, use_adaptive_entropy=True, entropy_coef_delta=0.05,
                                        entropy_target=1.0))
    assert control.enabled and control.applied() == 0.0  # no entropy measured yet: none applied
    control.end_step(entropy_sum=6.0, tokens=10.0)  # 0.6 <= 1: up, and applied next step
    assert (control.coef, control.last_world_entropy) == (pytest.approx(0.15), 0.6)
    assert control.applied() == pytest.approx(0.15)
    control.end_step(entropy_sum=30.0, tokens=20.0)  # 1.5 > 1: down, and not applied
    assert (control.coef, control.applied()) == (pytest.approx(0.1), 0.0)
    control.end_step(entropy_sum=0.0, tokens=0.0)  # no token at all: entropy 0
    assert control.last_world_entropy == 0.0 and control.applied() == pytest.approx(0.15)
    restored = EntropyControl(control.config)
    restored.load_state_dict(control.state_dict())
    assert restored.state_dict() == control.state_dict()
    static = EntropyControl(LossConfig(entropy_coef=0.2))
    static.end_step(1.0, 1.0)  # nothing moves without the adaptive control
    assert (static.applied(), static.coef, static.last_world_entropy) == (0.2, 0.2, math.inf)
    assert not EntropyControl(LossConfig()).enabled


@pytest.mark.parametrize("state, message", [
    ([0.1, 0.5], r"^an EntropyControl state must be a mapping of entropy_coef, last_world_entropy, not list$"),
    ({"entropy_coef": 0.1}, r"^an EntropyControl state lacks \['last_world_entropy'\]; it holds entropy_coef, "
                            r"last_world_entropy$"),
    ({"entropy_coef": 0.1, "last_world_entropy": 0.5, "step": 3},
     r"^an EntropyControl state has unknown keys \['step'\]; it holds entropy_coef, last_world_entropy$"),
    ({"entropy_coef": math.nan, "last_world_entropy": 0.5},
     r"^entropy control state entropy_coef=nan is not allowed; entropy control state entropy_coef must be a finite "
     r"number$"),
    ({"entropy_coef": "0.1", "last_world_entropy": 0.5}, r"^entropy control state entropy_coef='0.1' is not allowed"),
    ({"entropy_coef": 0.1, "last_world_entropy": -math.inf},
     r"^entropy control state last_world_entropy=-inf is not allowed; it must be a number: finite, inf \(no step "
     r"measured yet\) or nan \(a step's entropy that was not a number\)$"),
    ({"entropy_coef": 0.1, "last_world_entropy": None}, r"^entropy control state last_world_entropy=None is not "
                                                        r"allowed"),
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed, a long one ran on
    ({"entropy_coef": 0.1, "last_world_entropy": 10**5000},
     r"^entropy control state last_world_entropy=\(an int of 5001 digits\) is not allowed; it must be a number"),
    ({"entropy_coef": 0.1, "last_world_entropy": [0.5] * 1000},
     rf"^entropy control state last_world_entropy={re.escape(repr([0.5] * 1000)[:100])} is not allowed; it must be"),
])
def test_a_bad_entropy_control_state_is_refused_naming_the_bad_key_and_the_control_is_left_as_it_was(state, message):
    """A corrupt or foreign checkpoint's control state is refused naming what is wrong and what is allowed, before
    any of it is taken: a missing key was a bare KeyError, a NaN coefficient was taken and turned the loss NaN."""
    control = EntropyControl(LossConfig(entropy_coef=0.1, use_adaptive_entropy=True, entropy_target=1.0))
    control.end_step(entropy_sum=6.0, tokens=10.0)
    before = control.state_dict()
    with pytest.raises(ValueError, match=message):
        control.load_state_dict(state)
    assert control.state_dict() == before
    for entropy in (math.inf, math.nan, 0.3):  # what end_step can record, and the start's inf
        control.load_state_dict({"entropy_coef": 0.2, "last_world_entropy": entropy})
        assert control.coef == 0.2 and control.applied() == (0.2 if entropy == 0.3 else 0.0)


def test_the_adaptive_update_gates_the_bonus_and_follows_the_steps_entropy(batch):
    """First step: no bonus (the gradient is the plain one's, bit for bit, and the entropy needs no gradient),
    the coefficient moves by the step's token-weighted entropy over every micro-batch; next step: the bonus at
    the moved coefficient, as a static one of that value gives it; a target below the entropy lowers it and closes
    the gate."""
    settings = {"loss_type": "grpo", "top_entropy_quantile": 0.5}
    adaptive = {**settings, "use_adaptive_entropy": True, "entropy_coef": 0.3, "entropy_coef_delta": 0.1,
                "entropy_coef_max": 0.45}
    module = make_module(loss={**adaptive, "entropy_target": 100.0}, train_micro_batch_size=3)
    plain, _ = step(make_module(loss=settings, train_micro_batch_size=3), batch)
    first, metrics = step(module, batch)
    for name in plain:
        assert torch.equal(first[name], plain[name]), name
    # the step's entropy: over every micro-batch's bonus tokens, one token-weighted mean
    sums, counts = 0.0, 0.0
    with torch.no_grad():
        for _, micro in module._micro_batches(batch):
            _, entropy = logprobs.completion_logps(module.policy, micro, batch.temperature)
            tokens = bonus_tokens(entropy, module._loss_mask(micro), 0.5)
            sums, counts = sums + float((entropy * tokens).sum()), counts + float(tokens.sum())
    assert module.entropy_control.last_world_entropy == pytest.approx(sums / counts, rel=1e-6)
    assert metrics["train/entropy_coef"] == module.entropy_control.coef == pytest.approx(0.4)
    second, metrics = step(module, batch)
    want, _ = step(make_module(loss={**settings, "entropy_coef": 0.4}, train_micro_batch_size=3), batch)
    for name in want:
        torch.testing.assert_close(second[name], want[name], msg=name)
    assert metrics["train/entropy_coef"] == 0.45  # at its bound
    low = make_module(loss={**adaptive, "entropy_target": 0.01}, train_micro_batch_size=3)
    low.entropy_control.last_world_entropy = 0.0  # as if the last step had been below the target: applied once
    _, metrics = step(low, batch)
    assert metrics["train/entropy_coef"] == pytest.approx(0.2) and low.entropy_control.applied() == 0.0


def test_each_optimizer_step_of_a_training_step_moves_the_coefficient(batch):
    """num_iterations 2: two optimizer steps, two moves; train/entropy_coef logs their mean, as the other keys."""
    module = make_module(loss={"use_adaptive_entropy": True, "entropy_coef": 0.1, "entropy_coef_delta": 0.1,
                               "entropy_target": 100.0}, num_iterations=2)
    _, metrics = step(module, batch)
    assert module.entropy_control.coef == pytest.approx(0.3)
    assert metrics["train/entropy_coef"] == pytest.approx(0.25)


# ------------------------------------------------------------------------------------------------ checkpoints
def _fit(max_steps, ckpt_path=None, save=None):
    """A tiny fit (Python API) with the adaptive control moving every step; each optimizer step's coefficient and
    last entropy before it, and the weights' sum at the end."""
    import lightning.pytorch as pl

    from lit_grpo.sampling import SamplingConfig

    seen = []

    class Control(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(tuple(pl_module.entropy_control.state_dict().values()))

    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[Control()])
    loss = LossConfig(use_adaptive_entropy=True, entropy_coef=0.5, entropy_coef_delta=0.25, entropy_coef_max=2.0,
                      entropy_target=100.0)
    module = GRPOModule(model="tiny-llama", loss=loss, lr=1e-3)
    sampling = SamplingConfig(group_size=2, micro_group_size=2, max_new_tokens=4)
    trainer.fit(module, RolloutDataModule(**datamodule_arguments({"val_size": 0, "sampling": sampling})),
                ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(save)
    return seen, sum(float(p.double().sum()) for p in module.policy.parameters())


def test_the_controls_state_survives_a_resume_exactly(tmp_path):
    """Two steps, a checkpoint, two more: the same coefficients, entropies and weights, to the bit, as four steps
    in one run (the checkpoint holds the coefficient and the last entropy; without them the resumed run would
    start from the initial coefficient and apply none)."""
    straight, weights = _fit(4)
    assert [coef for coef, _ in straight] == [0.5, 0.75, 1.0, 1.25]
    assert straight[0][1] == math.inf and all(math.isfinite(entropy) for _, entropy in straight[1:])
    checkpoint = tmp_path / "two.ckpt"
    first, _ = _fit(2, save=str(checkpoint))
    assert torch.load(checkpoint, weights_only=True)[ENTROPY_CONTROL_KEY] == {"entropy_coef": 1.0,
                                                                             "last_world_entropy": straight[2][1]}
    resumed, resumed_weights = _fit(4, ckpt_path=str(checkpoint))
    assert first + resumed == straight
    assert resumed_weights == weights


def test_a_run_without_the_adaptive_control_saves_and_reads_no_state():
    module = GRPOModule(model="tiny-llama", loss={"entropy_coef": 0.1})
    checkpoint = {}
    module.on_save_checkpoint(checkpoint)
    assert ENTROPY_CONTROL_KEY not in checkpoint
    module.on_load_checkpoint({ENTROPY_CONTROL_KEY: {"entropy_coef": 0.7, "last_world_entropy": 0.1}})
    assert module.entropy_control.coef == 0.1
    adaptive = GRPOModule(model="tiny-llama", loss={"use_adaptive_entropy": True, "entropy_coef": 0.1})
    adaptive.on_load_checkpoint({})  # an older checkpoint, or one of a run without it: the initial state
    assert adaptive.entropy_control.state_dict() == {"entropy_coef": 0.1, "last_world_entropy": math.inf}


def test_the_steps_entropy_and_micro_batches_are_summed_over_the_ranks_in_the_steps_collectives():
    """Under several processes: the entropy sums and token counts go with the non-finite flag in the optimizer
    step's one gather and add up over the ranks; the micro-batch counts, each mini-batch's, are one reduction a
    training step."""
    from types import SimpleNamespace

    module = GRPOModule(model="tiny-llama", loss={"use_adaptive_entropy": True})
    reduced = []
    strategy = SimpleNamespace(root_device=torch.device("cpu"),
                               all_gather=lambda t: torch.stack([t, torch.cat([t[:1] * 0, t[1:] * 2])]),
                               reduce=lambda t, reduce_op: reduced.append(reduce_op) or t * 2)
    module._trainer = SimpleNamespace(world_size=2, strategy=strategy)
    try:
        assert module._gather_step_end("micro-batch 0 has loss nan", [3.0, 2.0]) == ([0], [9.0, 6.0])
        assert module._gather_step_end(None, []) == ([], [])
        assert module._micro_batches_over_ranks([[None] * 3, [None] * 2]) == [6, 4] and reduced == ["sum"]
    finally:
        module._trainer = None
