"""GRPOModule's update and RolloutDataModule's rollouts on the tiny random model (real engine, CPU, seconds)."""

import dataclasses
import inspect
import io
import json
import math
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.update.logprobs import completion_logits, token_entropy, token_logps
from lit_grpo.update.module import GRPOModule
from lit_grpo.update.policy_losses import PolicyLoss
from lit_grpo.update.surrogates import high_entropy_mask

from datamodule_helpers import PROMPTS, datamodule_arguments


def make_module(**kwargs) -> GRPOModule:
    kwargs = {"model": "tiny-llama", "max_grad_norm": None, **kwargs}
    module = GRPOModule(**kwargs)
    module.configure_model()
    return module


def make_datamodule(module, **kwargs) -> RolloutDataModule:
    """A DataModule over PROMPTS; SamplingConfig's fields among ``kwargs`` go to ``sampling``."""
    dm = RolloutDataModule(**datamodule_arguments(kwargs))
    dm.attach(module.policy, module.tokenizer)
    dm.setup("fit")
    return dm


@pytest.fixture(scope="module")
def batch():
    module = make_module()
    batch = make_datamodule(module, reward_funcs=["char_fraction", "accuracy"]).build_train_batch()
    assert batch.advantages.abs().sum() > 0, "the test needs a rollout with a learning signal"
    return batch


def grads_after_step(module, batch):
    optimizer = torch.optim.SGD(module.policy.parameters(), lr=0.0)
    metrics = module.grpo_step(batch, optimizer)
    return {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}, metrics


def test_rollout_batch_contract(batch):
    B, G = 2, 4
    assert len(batch.prompts) == B and len(batch.completions) == B and len(batch.completions[0]) == G
    assert batch.rewards.shape == (B, G) and batch.rewards.dtype == torch.float32
    assert batch.completion_lengths.shape == (B, G) and batch.completion_lengths.dtype == torch.long
    assert batch.truncated.shape == (B, G) and batch.truncated.dtype == torch.bool
    assert batch.completion_ids.shape[:2] == (B, G) and batch.sampling_logprobs.shape == batch.completion_ids.shape
    assert set(batch.reward_components) == {"char_fraction", "accuracy"}
    assert batch.stats.generated_tokens == int(batch.completion_lengths.sum())
    assert batch.columns["answer"] == [PROMPTS[i]["answer"] for i in batch.indices]
    moved = batch.to("cpu")
    assert moved is not batch and torch.equal(moved.rewards, batch.rewards)


def test_update_log_probs_match_the_sampler(batch):
    """The update's forward (left-padded prompts, right-padded completions, position ids) reproduces the
    engine's sampling log-probs: the tensors line up token for token."""
    module = make_module()
    micro = batch.micro_batch(torch.arange(batch.num_completions))
    with torch.no_grad():
        logps = token_logps(completion_logits(module.policy, micro, batch.temperature), micro["completion_ids"])
    mask = micro["completion_mask"].bool()
    torch.testing.assert_close(logps[mask], micro["sampling_logprobs"][mask], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "luspo", "vespo"])
@pytest.mark.filterwarnings("ignore:loss_type='luspo'")  # at the token level, off its paper's
def test_micro_batched_update_equals_one_big_batch(batch, loss_type):
    small, _ = grads_after_step(make_module(loss={"loss_type": loss_type}, train_micro_batch_size=3), batch)
    big, metrics = grads_after_step(make_module(loss={"loss_type": loss_type}, train_micro_batch_size=8), batch)
    assert small.keys() == big.keys() and len(big) > 0
    for name in big:
        torch.testing.assert_close(small[name], big[name], atol=1e-6, rtol=1e-4, msg=name)
    assert metrics["train/grad_norm"] > 0
    for key in ("train/loss", "train/clip_ratio_low", "train/clip_ratio_high", "train/entropy", "reward/mean",
                "reward/std", "reward/frac_zero_std", "reward/char_fraction/mean", "completions/mean_length",
                "completions/min_length", "completions/max_length", "completions/clipped_ratio"):
        assert key in metrics, key
    assert "train/kl" not in metrics  # beta = 0: no reference model, no KL


def test_the_off_policy_mask_reads_the_samplers_log_probs(batch):
    """The update hands the batch's sampling log-probs to the loss: drifted by 1 (> the threshold 0.5) they drop
    every negative-advantage completion's policy term, as zeroing those advantages does."""
    drifted = dataclasses.replace(batch, sampling_logprobs=batch.sampling_logprobs + 1.0)
    assert (drifted.advantages < 0).any()
    masked, _ = grads_after_step(make_module(loss={"off_policy_mask_threshold": 0.5}), drifted)
    want, _ = grads_after_step(make_module(), dataclasses.replace(drifted, advantages=drifted.advantages.clamp(min=0)))
    plain, _ = grads_after_step(make_module(), drifted)
    for name in want:
        torch.testing.assert_close(masked[name], want[name], atol=1e-7, rtol=1e-5, msg=name)
    assert any(not torch.allclose(masked[name], plain[name]) for name in plain)


def test_the_high_entropy_mask_ranks_the_policys_entropies_at_the_sampling_temperature(batch, monkeypatch):
    """The update hands the loss each token's entropy of softmax(logits / temperature), as TRL's, and the mask
    changes the gradient."""
    hot = dataclasses.replace(batch, temperature=0.7)
    handed = []
    call = PolicyLoss.__call__

    def recording(self, logps, old_logps, advantages, mask, *args, **kwargs):
        handed.append((mask.clone(), args[-1]))  # entropy: the last positional argument
        return call(self, logps, old_logps, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(PolicyLoss, "__call__", recording)
    masked, _ = grads_after_step(make_module(loss={"top_entropy_quantile": 0.3}), hot)
    monkeypatch.undo()
    plain, _ = grads_after_step(make_module(), hot)
    assert any(not torch.allclose(masked[name], plain[name]) for name in plain)
    (mask, entropy), = handed  # one micro-batch of 8 rows
    micro = hot.micro_batch(torch.arange(hot.num_completions))
    with torch.no_grad():
        at = {t: token_entropy(completion_logits(make_module().policy, micro, t)) for t in (0.7, 1.0)}
    active = mask.bool()
    torch.testing.assert_close(entropy[active], at[0.7][active], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(at[1.0][active], at[0.7][active], atol=1e-3)
    # about the top 30% of the micro-batch's tokens keep their policy term (the quantile interpolates)
    assert 0.25 < float(high_entropy_mask(entropy, mask, 0.3).sum() / active.sum()) < 0.35


@pytest.mark.parametrize("world", [1, 2])
def test_under_several_ranks_the_high_entropy_quantile_is_handed_the_ranks_gather(batch, monkeypatch, world):
    """``top_entropy_quantile`` < 1: each micro-batch's tokens are ranked once, for its loss and its entropy bonus
    both, with the strategy's all_gather under several ranks (every rank's micro-batch of that index, as TRL's), with
    none for one process."""
    from types import SimpleNamespace

    from lit_grpo.update import entropy_bonus, module as module_file, policy_losses

    handed = []

    def recording(entropy, mask, top_quantile, all_gather=None, capacity=None):
        handed.append(all_gather)
        return high_entropy_mask(entropy, mask, top_quantile, all_gather, capacity)

    for owner in (module_file, policy_losses, entropy_bonus):
        monkeypatch.setattr(owner, "high_entropy_mask", recording)
    gathered = []

    def all_gather(tensor):  # the other rank as this one: a stand-in collective
        gathered.append(tensor.shape)
        return torch.stack([tensor] * world)

    module = make_module(train_micro_batch_size=4, loss={"top_entropy_quantile": 0.3, "entropy_coef": 0.01})
    strategy = SimpleNamespace(root_device=torch.device("cpu"), all_gather=all_gather,
                               backward=lambda loss, optimizer, *args, **kwargs: loss.backward(),
                               reduce=lambda tensor, reduce_op: tensor * world)
    module._trainer = SimpleNamespace(world_size=world, strategy=strategy, precision_plugin=None)
    try:
        grads_after_step(module, batch)
    finally:
        module._trainer = None
    assert len(handed) == 2  # two micro-batches of 4 rows, one mask each for the loss and the bonus
    if world == 1:
        assert handed == [None] * 2
    else:
        assert all(gather is not None for gather in handed)
        # each mask's values in one gather, padded to every rank's bound (rows x max_new_tokens); the step's own
        assert gathered == [torch.Size([4 * batch.max_new_tokens])] * 2 + [torch.Size([1])]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_the_update_runs_its_linears_on_onednn_by_default_off_intel_with_torchs_gradients(batch, monkeypatch):
    from lit_grpo.sampling import cpu_linear
    from lit_grpo.sampling.cpu_linear import OneDNNLinear

    calls = []
    apply = OneDNNLinear.apply
    monkeypatch.setattr(OneDNNLinear, "apply", lambda *args: calls.append(args[1].shape) or apply(*args))
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "AuthenticAMD")
    ours, _ = grads_after_step(make_module(), batch)  # cpu_linear "auto": a float32 policy on a CPU
    assert len(calls) >= 7 * make_module().policy.config.num_hidden_layers  # every projection of every layer
    calls.clear()
    theirs, _ = grads_after_step(make_module(cpu_linear="torch"), batch)
    assert not calls and ours.keys() == theirs.keys()
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "GenuineIntel")
    on_intel, _ = grads_after_step(make_module(), batch)  # auto: torch's kernel (MKL) on an Intel CPU
    assert not calls
    for name in theirs:  # exact: both ran torch's kernels on the same shapes in one process (determinism)
        assert torch.equal(on_intel[name], theirs[name]), name
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=1e-4, msg=name)


def test_non_finite_loss_stops_before_any_optimizer_step(batch):
    module = make_module(train_micro_batch_size=4)
    bad = batch.to("cpu")
    bad.advantages = bad.advantages.clone()
    bad.advantages[1, 2] = float("inf")
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    optimizer = torch.optim.AdamW(module.policy.parameters(), lr=1e-2)
    with pytest.raises(FloatingPointError, match="non-finite GRPO loss.*micro-batch of rows 4..7.*step was not taken"):
        module.grpo_step(bad, optimizer)
    for name, param in module.policy.named_parameters():
        assert torch.equal(param, before[name]), name
    assert not optimizer.state  # AdamW never stepped


def test_beta_loads_a_reference_and_logs_kl(batch):
    module = make_module(loss={"beta": 0.1}, num_iterations=2, lr=1e-2)
    assert module.ref_model is not None and not any(p.requires_grad for p in module.ref_model.parameters())
    optimizer = torch.optim.AdamW([p for p in module.policy.parameters() if p.requires_grad], lr=1e-2)
    metrics = module.grpo_step(batch, optimizer)
    assert metrics["train/kl"] > 0  # averaged over 2 iterations: the second one has moved away from the reference
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    assert not any(k.startswith("ref_model.") for k in checkpoint["state_dict"])
    module.on_load_checkpoint(checkpoint)  # put back for strict loading
    module.load_state_dict(checkpoint["state_dict"])
    assert make_module().ref_model is None


def test_disable_dropout_zeroes_every_dropout_of_the_policy_and_the_reference(tmp_path):
    from transformers import AutoModelForCausalLM

    from lit_grpo.runtime.models import DROPOUTS, _tiny_model, tiny_tokenizer

    config = _tiny_model("tiny-llama").config
    config.attention_dropout = 0.5
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.3}
    ids = torch.arange(3, 19).unsqueeze(0)
    for kwargs, rates in (({"loss": {"beta": 0.1}}, {0.5}), ({"peft_config": lora}, {0.5, 0.3})):
        for disable in (False, True):
            module = make_module(model=str(tmp_path), disable_dropout=disable, **kwargs)
            trained = [module.policy] + ([module.ref_model] if module.ref_model is not None else [])
            assert len(trained) == 1 + ("loss" in kwargs)
            for model in trained:
                found = {m.p for m in model.modules() if isinstance(m, DROPOUTS)} | {
                    m.attention_dropout for m in model.modules() if isinstance(getattr(m, "attention_dropout", None),
                                                                                float)}
                assert found == ({0.0} if disable else rates), (kwargs, disable, found)
            # the policy trains in train mode: two forwards of one input agree only without dropout
            assert module.policy.training
            with torch.no_grad():
                agree = torch.equal(module.policy(ids).logits, module.policy(ids).logits)
            assert agree == disable
            # the model's config keeps its value, so an export writes the model that was loaded
            assert module.policy.config.attention_dropout == 0.5


def test_lora_uses_the_disabled_adapter_as_reference(batch):
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    module = make_module(loss={"beta": 0.1}, peft_config=lora)
    assert module.ref_model is None
    trainable = [n for n, p in module.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    optimizer = torch.optim.AdamW([p for p in module.policy.parameters() if p.requires_grad], lr=1e-3)
    metrics = module.grpo_step(batch, optimizer)
    assert metrics["train/kl"] == pytest.approx(0.0, abs=1e-6)  # LoRA B starts at 0: policy == reference


def test_dynamic_sampling_drops_groups_without_signal():
    def half_flat(prompts, completions, **kwargs):  # constant reward for even prompts: zero-std groups
        return [1.0 if int(p.split()[2]) % 2 == 0 else float(sum(map(ord, c)) % 5)
                for p, c in zip(prompts, completions)]

    module = make_module()
    dm = make_datamodule(module, reward_funcs=[half_flat], dynamic_sampling=True, max_rollouts_per_step=8)
    batch = dm.build_train_batch()
    assert batch.rewards.std(dim=1).gt(0).all()
    assert all(PROMPTS[i]["answer"] and int(PROMPTS[i]["answer"]) % 4 == 2 for i in batch.indices)  # odd i
    assert batch.num_groups_generated > 2 and batch.num_groups_zero_std >= 1
    assert batch.metrics["rollout/rollouts_per_step"] >= 2

    plain = make_datamodule(module, reward_funcs=[half_flat], dynamic_sampling=False).build_train_batch()
    assert plain.num_groups_generated == 2 and plain.metrics["rollout/rollouts_per_step"] == 1


def test_prompt_stream_resumes_where_it_stopped():
    module = make_module()
    first = make_datamodule(module)
    first.build_train_batch()
    state = first.state_dict()
    expected = first.build_train_batch()

    resumed = RolloutDataModule(**datamodule_arguments({}))
    resumed.load_state_dict(state)  # before setup, as Lightning may do
    resumed.attach(module.policy, module.tokenizer)
    resumed.setup("fit")
    got = resumed.build_train_batch()
    assert got.indices == expected.indices
    assert got.completions == expected.completions
    assert resumed.steps_built == 2


def test_validation_batch_is_greedy_and_scored():
    module = make_module()
    dm = make_datamodule(module, reward_funcs=["accuracy"])
    val = dm.build_val_batch([0, 1])
    assert val.rewards.shape == (2, 1) and val.split == "val"
    assert val.completions == dm.build_val_batch([0, 1]).completions  # greedy: deterministic


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        GRPOModule(model="tiny-llama", loss={"loss_type": "ppo"})
    with pytest.raises(ValueError, match="scale_rewards='std'"):
        GRPOModule(model="tiny-llama", scale_rewards="std")
    with pytest.raises(ValueError, match=r"multi_objective_aggregation='gdpo' is not known; use one of "
                                         r"\['sum_then_normalize', 'normalize_then_sum'\]"):
        GRPOModule(model="tiny-llama", multi_objective_aggregation="gdpo")
    with pytest.raises(ValueError, match="train_micro_batch_size=0"):
        GRPOModule(model="tiny-llama", train_micro_batch_size=0)
    with pytest.raises(ValueError, match=r"cpu_linear='mkl' is not known; use one of \['auto', 'onednn', 'torch'\]"):
        GRPOModule(model="tiny-llama", cpu_linear="mkl")
    with pytest.raises(ValueError, match="epsilon_high=-1"):
        GRPOModule(model="tiny-llama", loss={"epsilon_high": -1})
    with pytest.raises(ValueError, match=r"betas=\[0.9\] must be two numbers in \[0, 1\)"):
        GRPOModule(model="tiny-llama", betas=(0.9,))
    with pytest.raises(ValueError, match=r"betas=0.9 must be two numbers in \[0, 1\)"):
        GRPOModule(model="tiny-llama", betas=0.9)
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed, a long value ran on
    with pytest.raises(ValueError, match=r"^betas=a list holding an int of more than \d+ digits must be two numbers"):
        GRPOModule(model="tiny-llama", betas=(10**5000, 0.9))
    with pytest.raises(ValueError, match=rf"^betas={re.escape(repr('9' * 500)[:100])} must be two numbers in "):
        GRPOModule(model="tiny-llama", betas="9" * 500)
    # TRL's (transformers 5's) warmup_steps takes a share of the steps below 1: here it is a count
    with pytest.raises(ValueError, match=r"warmup_steps=0.1 must be an integer >= 0 \(a count of optimizer steps; "
                                         r"TRL's warmup_ratio, a share of them, is warmup_ratio x trainer.max_steps\)"):
        GRPOModule(model="tiny-llama", warmup_steps=0.1)
    for count in (10.5, -1, -1.0):  # not a count, nor a share: no word of warmup_ratio
        with pytest.raises(ValueError, match=rf"warmup_steps={count!r} must be an integer >= 0$"):
            GRPOModule(model="tiny-llama", warmup_steps=count)
    # a count written as a float (transformers' TrainingArguments takes 10.0) is that count, saved as an int
    for count in (10.0, 0.0):
        module = GRPOModule(model="tiny-llama", warmup_steps=count)
        assert module.hparams.warmup_steps == int(count) and type(module.hparams.warmup_steps) is int
    # a string is truthy: fsdp="false" turned FSDP on, and the other switches alike
    for name in ("gradient_checkpointing", "disable_dropout", "mask_truncated_completions", "fsdp",
                 "move_to_cpu_after_fit"):
        with pytest.raises(ValueError, match=rf"{name}='false' must be True or False"):
            GRPOModule(model="tiny-llama", **{name: "false"})
    with pytest.raises(ValueError, match=r"shared_prefix=1 is not known; use one of \[True, False, 'auto'\]"):
        GRPOModule(model="tiny-llama", shared_prefix=1)
    with pytest.raises(ValueError, match=r"^shared_prefix=\(an int of 5001 digits\) is not known; use one of "):
        GRPOModule(model="tiny-llama", shared_prefix=10**5000)
    for model in (None, 3, ""):
        with pytest.raises(ValueError, match=rf"model={model!r} must be a non-empty string"):
            GRPOModule(model=model)
    # an empty or falsy LoRA setting was read as none: every weight trained
    with pytest.raises(ValueError, match=r"model.peft_config=\{\} gives no LoRA setting; give peft.LoraConfig's "
                                         r"fields \(e.g. \{r: 16, .*or None \(null\) to train all weights"):
        GRPOModule(model="tiny-llama", peft_config={})
    for falsy in (0, "", []):
        with pytest.raises(ValueError, match=re.escape(f"model.peft_config={falsy!r} must be a mapping of peft.")):
            GRPOModule(model="tiny-llama", peft_config=falsy)
    with pytest.raises(ValueError, match=r"unknown loss options \['eps'\]; allowed: \['loss_type', 'epsilon_low'"):
        GRPOModule(model="tiny-llama", loss={"eps": 0.1})
    with pytest.raises(ValueError, match=r"unknown sampler_correction options \['max'\]; allowed: \['mode', "):
        GRPOModule(model="tiny-llama", sampler_correction={"max": 2.0})
    with pytest.raises(ValueError, match=r"unknown sampling options \['G'\]; allowed: \['group_size', "):
        RolloutDataModule(prompts=PROMPTS, sampling={"G": 4})
    with pytest.raises(ValueError, match=r"dynamic_sampling='false' must be True or False"):
        RolloutDataModule(prompts=PROMPTS, dynamic_sampling="false")
    with pytest.raises(ValueError, match=r"curriculum_kwargs='x' must be a mapping of the curriculum's options"):
        RolloutDataModule(prompts=PROMPTS, curriculum_kwargs="x")
    with pytest.raises(ValueError, match=r"curriculum_kwargs=\['foo'\] are not options of curriculum='angle'; its "
                                         r"options: \['n', 'alpha', "):  # when built, before any model is loaded
        RolloutDataModule(prompts=PROMPTS, curriculum="angle", curriculum_kwargs={"foo": 1})
    with pytest.raises(ValueError, match=r"system_prompt=3 must be a string or None"):
        RolloutDataModule(prompts=PROMPTS, system_prompt=3)
    # '' sent no system message in silence: a chat template such as Qwen2.5's then adds its own default one
    with pytest.raises(ValueError, match=r"system_prompt='' is empty: use None \(null\) for no system message"):
        RolloutDataModule(prompts=PROMPTS, system_prompt="")
    with pytest.raises(ValueError, match=r"prompt_template=3 must be a string that contains '\{prompt\}'"):
        RolloutDataModule(prompts=PROMPTS, prompt_template=3)
    with pytest.raises(ValueError, match=r"dataset=3 must be a path \(a local file or folder\) or a datasets.Dataset"):
        RolloutDataModule(dataset=3)
    with pytest.warns(UserWarning, match=r"fsdp_rollout='gathered' applies with fsdp only; it is ignored"):
        GRPOModule(model="tiny-llama", fsdp_rollout="gathered")
    with pytest.raises(ValueError, match="model path './nope' does not exist"):
        GRPOModule(model="./nope")
    with pytest.raises(ValueError, match="give exactly one prompt source"):
        RolloutDataModule(task="basic_arithmetic", prompts=PROMPTS).setup("fit")
    with pytest.raises(ValueError, match="curriculum='hard'"):
        RolloutDataModule(prompts=PROMPTS, curriculum="hard")
    with pytest.raises(ValueError, match="prompts_per_step=0"):
        RolloutDataModule(prompts=PROMPTS, prompts_per_step=0)
    with pytest.raises(ValueError, match=r"accuracy_reward='mathh' is not one of the reward functions' names"):
        RolloutDataModule(prompts=PROMPTS, reward_funcs=["math"], accuracy_reward="mathh")
    with pytest.raises(ValueError, match=r"'math' takes no option \['timeout'\]"):
        RolloutDataModule(prompts=PROMPTS, reward_funcs=[{"name": "math", "kwargs": {"timeout": 5}}])
    # prompts without a gold answer, scored by rewards that need one (beside others or not): refused before any
    # rollout, which would train on the other rewards alone
    for reward_funcs in (["math"], ["math", "format"]):
        with pytest.raises(ValueError, match=r"the reward functions \['math'\] score against a gold answer, but none "
                                             r"of the 3 prompts has one \(data.prompts: \{prompt, answer\} entries\)"):
            RolloutDataModule(prompts=["a", "b", "c"], reward_funcs=reward_funcs, val_size=0,
                              prompts_per_step=1).setup()
    for prompts, reward_funcs in ((["a", "b", "c"], ["format"]),  # a reward that needs no answer
                                  (["a", {"prompt": "b", "answer": "2"}, "c"], ["accuracy"])):  # one answer
        RolloutDataModule(prompts=prompts, reward_funcs=reward_funcs, val_size=0, prompts_per_step=1).setup()
    # scheduler options another strategy would ignore are named, not dropped in silence
    with pytest.warns(UserWarning, match=r"options \['preempt_tokens', 'length_aware'\] apply to strategy 'infinite' "
                                         r"only; strategy 'micro' ignores them"):
        RolloutDataModule(prompts=PROMPTS, sampling={"strategy": "micro", "scheduler": {
            "preempt_tokens": 16, "length_aware": {"predictor": "oracle", "refill": "fifo"}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutDataModule(prompts=PROMPTS, sampling={"strategy": "infinite", "scheduler": {
            "preempt_tokens": 16, "length_aware": {"predictor": "online"}}})
    # the true lengths exist in a replay only: a training rollout refuses the predictors that read them
    for predictor in ("oracle", "noisy:0.5"):
        with pytest.raises(ValueError, match=rf"length_aware.predictor='{predictor}' reads the true lengths"):
            RolloutDataModule(prompts=PROMPTS, sampling={"scheduler": {"length_aware": {"predictor": predictor}}})
    # and a setting that acts only beside another one that is off
    for setting, needs in (({"max_rollouts_per_step": 2}, "dynamic_sampling"),
                           ({"max_staleness": 5}, "over_provision > 1"),
                           ({"val_temperature": 0.5}, "val_num_samples > 1")):
        name, value = next(iter(setting.items()))
        with pytest.warns(UserWarning, match=rf"{name}={value} applies with {needs} only; it is ignored"):
            RolloutDataModule(prompts=PROMPTS, **setting)
    # a value refused outright is not also called ignored
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"val_temperature=-1.0 is not allowed"):
            RolloutDataModule(prompts=PROMPTS, val_temperature=-1.0)
    # a task's settings where the prompts come from elsewhere (a config that switched its source)
    for setting in ({"task_config": {"min_terms": 2}}, {"size": 40}):
        name, value = next(iter(setting.items()))
        with pytest.warns(UserWarning, match=rf"data.{name}={re.escape(repr(value))} applies to data.task only"):
            RolloutDataModule(prompts=PROMPTS, **setting)
    # a first preemption point at or past the cap: the scheduler never preempts
    with pytest.warns(UserWarning, match=r"preempt_tokens=64 is not below max_new_tokens=64, so no sample is ever "
                                         r"preempted"):
        RolloutDataModule(prompts=PROMPTS, sampling={"strategy": "infinite", "max_new_tokens": 64,
                                                     "scheduler": {"preempt_tokens": 64}})
    with warnings.catch_warnings():  # the default quantum past a short cap was not asked for
        warnings.simplefilter("error")
        RolloutDataModule(prompts=PROMPTS, sampling={"strategy": "infinite", "max_new_tokens": 4})
        RolloutDataModule(prompts=PROMPTS, sampling={"strategy": "infinite", "max_new_tokens": 64,
                                                     "scheduler": {"preempt_tokens": 63}})
    # the sampler correction's bounds under mode none, named once when the module is built
    with pytest.warns(UserWarning, match=r"sampler_correction settings \['clip_max'\] have no effect with "
                                         r"mode='none'") as said:
        GRPOModule(model="tiny-llama", sampler_correction={"mode": "none", "clip_max": 2.0})
    assert len([w for w in said if "sampler_correction" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOModule(model="tiny-llama", sampler_correction={"mode": "auto", "clip_max": 2.0})
        GRPOModule(model="tiny-llama", sampler_correction={"mode": "none"})
    # so is a slot count the strategy does not use
    with pytest.warns(UserWarning, match=r"micro_group_size=2 is ignored by strategy 'full'"):
        RolloutDataModule(prompts=PROMPTS, sampling={"strategy": "full", "micro_group_size": 2})
    with pytest.warns(UserWarning, match=r"micro_group_size=16 is more than group_size=8: strategy 'micro'"):
        RolloutDataModule(prompts=PROMPTS, sampling={"strategy": "micro", "micro_group_size": 16})
    with pytest.warns(UserWarning, match=r"kv_budget_bytes=1000000 is the budget of micro_group_size 'auto' only; "
                                         r"micro_group_size=4 ignores it"):
        RolloutDataModule(prompts=PROMPTS, sampling={"micro_group_size": 4, "kv_budget_bytes": 10**6})
    # unset, the correctness reward follows the reward functions
    assert RolloutDataModule(prompts=PROMPTS, reward_funcs=["format", "math"]).scoring.accuracy_reward == "math"
    assert RolloutDataModule(prompts=PROMPTS).scoring.accuracy_reward == "accuracy"


def test_numpy_integer_settings_are_kept_as_plain_ints():
    """A count computed with numpy (np.int64) is the integer it is, kept as a plain int: a checkpoint's
    hyperparameters are read back by torch.load(weights_only=True), which refuses numpy scalars."""
    n = np.int64
    module = GRPOModule(model="tiny-llama", num_iterations=n(2), num_mini_batches=n(1),
                        train_micro_batch_size=n(4), warmup_steps=n(3))
    data = RolloutDataModule(prompts=PROMPTS, data_seed=n(1), steps_per_epoch=n(2), score_batch_size=n(4),
                             prompts_per_step=n(2), max_rollouts_per_step=n(4), max_staleness=n(2),
                             over_provision=n(2), val_size=n(4), val_batch_size=n(8), val_num_samples=n(1),
                             val_temperature=np.float64(0.5),
                             sampling={"group_size": n(4), "max_new_tokens": n(16), "seed": n(3), "top_k": n(5),
                                       "strategy": "infinite", "scheduler": {"preempt_tokens": n(8),
                                                                             "length_aware": {"probe_tokens": n(4)}}})
    with pytest.warns(UserWarning, match="max_tool_calling_iterations"):  # no tools: unread, but checked and saved
        rounds = RolloutDataModule(prompts=PROMPTS, max_tool_calling_iterations=n(2))
    # the initial copy too: the loggers write it (TensorBoard's hparams.yaml, which a numpy scalar leaves unreadable)
    for hparams in (module.hparams, data.hparams, module.hparams_initial, data.hparams_initial):
        assert_loads_back(hparams)
    assert type(module.hparams.warmup_steps) is int and type(data.training.prompts_per_step) is int
    assert type(data.sampling.scheduler.preempt_tokens) is int
    assert type(data.sampling.scheduler.length_aware.probe_tokens) is int
    assert type(data.sampling.group_size) is int and type(data.validation.val_batch_size) is int
    assert type(data.hparams.val_size) is int and type(rounds.hparams.max_tool_calling_iterations) is int
    assert data.training.over_provision == 2.0 and type(data.training.over_provision) is float
    assert type(data.val_size) is int  # a count of prompts, not a fraction


def test_a_reward_object_that_cannot_be_copied_is_taken_and_saved_by_its_class():
    """A reward function given as an object that holds a lock (an API client's, a thread pool's) or a model (a
    RewardModel) is used as given and saved by its class: Lightning deep-copies what save_hyperparameters stores,
    again at each read of hparams_initial, and a lock cannot be copied (the data module failed to build), a model is
    copied whole."""
    import threading

    class Judge:
        def __init__(self):
            self.lock = threading.Lock()

        def __call__(self, prompts, completions, **columns):
            return [0.0] * len(completions)

    judge = Judge()
    data = RolloutDataModule(prompts=PROMPTS, reward_funcs=[judge, {"name": "format", "weight": 0.5}])
    assert [reward.fn for reward in data.reward_funcs][0] is judge
    saved = [f"<not importable (an instance of {__name__}:{Judge.__qualname__})>", {"name": "format", "weight": 0.5}]
    assert data.hparams.reward_funcs == saved and data.hparams_initial["reward_funcs"] == saved


def test_numpy_float_settings_are_kept_as_plain_floats():
    """A number computed with numpy (np.float64, a float subclass numpy pickles as its own scalar) is kept as a
    plain float: a checkpoint's hyperparameters are read back by torch.load(weights_only=True), which refuses it."""
    f = np.float64
    module = GRPOModule(model="tiny-llama", lr=f(1e-5), weight_decay=f(0.1), lr_schedule="cosine",
                        min_lr_ratio=f(0.1), max_grad_norm=f(0.5), loss={"beta": 0.04},
                        reference_sync={"mixup_alpha": f(0.5)})
    data = RolloutDataModule(prompts=PROMPTS, val_num_samples=2, val_temperature=f(0.7), over_provision=f(1.5),
                             sampling={"strategy": "infinite",
                                       "scheduler": {"park_budget": f(0.5), "loss_share": f(0.25),
                                                     "length_aware": {"gain_z": f(1.5)}}})
    for hparams in (module.hparams, data.hparams):
        assert_loads_back(hparams)
    assert [type(module.hparams[name]) for name in ("lr", "weight_decay", "min_lr_ratio", "max_grad_norm")] == \
        [float] * 4
    assert type(module.reference_sync.mixup_alpha) is float and type(data.validation.val_temperature) is float
    assert type(data.training.over_provision) is float
    assert type(data.sampling.scheduler.park_budget) is float and type(data.sampling.scheduler.loss_share) is float
    assert type(data.sampling.scheduler.length_aware.gain_z) is float


def test_numpy_numbers_in_the_settings_groups_are_saved_as_plain_numbers():
    """The loss's, the sampler correction's and the sampling's settings, AdamW's betas and a fraction val_size,
    each checked by its own rules, are saved with a numpy number as the plain number it is."""
    f = np.float64
    module = GRPOModule(model="tiny-llama", betas=(f(0.9), f(0.95)), sampler_correction={"clip_max": f(2.0)},
                        loss={"epsilon_low": f(0.2), "epsilon_high": f(0.3), "beta": f(0.04),
                              "top_entropy_quantile": f(0.5), "entropy_coef": f(0.01)})
    data = RolloutDataModule(prompts=PROMPTS, val_size=f(0.25),
                             sampling={"temperature": f(0.9), "top_p": f(0.95), "min_p": f(0.05),
                                       "repetition_penalty": f(1.1)})
    for hparams in (module.hparams, data.hparams):
        assert_loads_back(hparams)
    assert module.hparams.betas == (0.9, 0.95) and module.hparams.loss["beta"] == 0.04
    assert module.hparams.sampler_correction["clip_max"] == 2.0 and data.hparams.sampling["top_p"] == 0.95
    assert type(data.val_size) is float and data.val_size == 0.25
    # a float32 or integer beta is a number in [0, 1) too
    betas = GRPOModule(model="tiny-llama", betas=[np.float32(0.5), np.int64(0)]).hparams.betas
    assert betas == [0.5, 0] and [type(beta) for beta in betas] == [float, int]


def test_numpy_numbers_in_lora_and_curriculum_options_are_saved_as_plain_numbers():
    """``peft_config`` and ``curriculum_kwargs``, mappings handed on to peft and the sampler, are saved with a numpy
    number in them (at any depth) as the plain number it is, which torch.load(weights_only=True) reads back."""
    module = GRPOModule(model="tiny-llama", peft_config={"r": np.int64(4), "lora_alpha": np.float64(8.0),
                                                         "lora_dropout": np.float64(0.1),
                                                         "layers_to_transform": [np.int64(0), 1]})
    data = RolloutDataModule(prompts=PROMPTS, curriculum="angle",
                             curriculum_kwargs={"sigma": np.float64(2.0), "rescore_every_n_epochs": np.int64(2)})
    for hparams in (module.hparams, data.hparams):
        assert_loads_back(hparams)
    assert module.hparams.peft_config == {"r": 4, "lora_alpha": 8.0, "lora_dropout": 0.1, "layers_to_transform": [0, 1]}
    assert [type(module.hparams.peft_config[name]) for name in ("r", "lora_alpha")] == [int, float]
    assert type(module.hparams.peft_config["layers_to_transform"][0]) is int
    assert [type(value) for value in data.hparams.curriculum_kwargs.values()] == [float, int]


def test_a_numpy_value_in_any_saved_setting_is_saved_as_the_plain_value_it_is():
    """One rule for what is saved, not one per setting: a numpy value where no check of its own converts it (a reward
    function's weight, a task's option, a text read through numpy) is saved as the plain value it is, in the hparams
    and in their initial copy, which torch.load(weights_only=True) and the loggers read back."""
    module = GRPOModule(model="tiny-llama", dtype=np.str_("float32"), lr_schedule=np.str_("cosine"))
    data = RolloutDataModule(prompts=PROMPTS, reward_funcs=[{"name": "accuracy", "weight": np.float64(0.5)}],
                             system_prompt=np.str_("Be brief."),
                             chat_template_kwargs={"enable_thinking": np.bool_(False)})
    task = RolloutDataModule(task="leg_counting", task_config={"min_animals": np.int64(3)})
    for owner in (module, data, task):
        for hparams in (owner.hparams, owner.hparams_initial):
            assert_loads_back(hparams)
    assert type(module.hparams.lr_schedule) is str and type(data.hparams.system_prompt) is str
    assert type(data.hparams.reward_funcs[0]["weight"]) is float
    assert type(data.hparams_initial.chat_template_kwargs["enable_thinking"]) is bool
    assert task.hparams.task_config == {"min_animals": 3} and type(task.hparams.task_config["min_animals"]) is int


def test_a_numpy_value_set_into_the_hparams_after_they_are_saved_is_saved_as_the_plain_value_it_is(tmp_path):
    """What the data module sets into its hparams after save_hyperparameters (a dataset by its path, a tool by its
    name) follows the same rule: a path read through numpy (np.str_, which os.fspath hands back as it is) is saved
    as the plain text it is, and the checkpoint's hyperparameters load back with torch.load(weights_only=True)."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    data = RolloutDataModule(dataset=np.str_(path), val_size=0, prompts_per_step=1)
    assert data.hparams["dataset"] == str(path) and type(data.hparams["dataset"]) is str
    checkpoint = tmp_path / "hparams.ckpt"
    torch.save({"datamodule_hyper_parameters": dict(data.hparams)}, checkpoint)  # as Lightning's dump_checkpoint
    assert torch.load(checkpoint, weights_only=True)["datamodule_hyper_parameters"]["dataset"] == str(path)


def test_the_hparams_set_after_they_are_saved_are_logged_too(tmp_path):
    """The data module's dataset path and tools' names, set after save_hyperparameters, reach what a logger writes
    (Lightning logs hparams_initial, copied when they are saved): they were missing from hparams.yaml."""
    from types import SimpleNamespace

    from lightning.pytorch import LightningModule
    from lightning.pytorch.core.saving import load_hparams_from_yaml
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.loggers.utilities import _log_hyperparams

    from test_tool_calling import add

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    data = RolloutDataModule(dataset=np.str_(path), val_size=0, prompts_per_step=1, tools=[add])
    tools = [f"{add.__module__}:{add.__qualname__}"]
    assert data.hparams_initial["dataset"] == str(path) and type(data.hparams_initial["dataset"]) is str
    assert data.hparams_initial["tools"] == tools
    logger = CSVLogger(tmp_path / "logs")
    _log_hyperparams(SimpleNamespace(loggers=[logger], lightning_module=LightningModule(), datamodule=data))
    logged = load_hparams_from_yaml(tmp_path / "logs" / "lightning_logs" / "version_0" / "hparams.yaml", False)
    assert logged["dataset"] == str(path) and logged["tools"] == tools
    data.hparams["tools"].append("changed")  # the initial copy is its own, as Lightning's
    assert data.hparams_initial["tools"] == tools


def test_the_saved_hyperparameters_are_plain_yaml_while_the_run_keeps_its_tuples(tmp_path):
    """What a run writes of its settings, a logger's hparams.yaml and a checkpoint's hyperparameters, holds each tuple
    given in Python (AdamW's betas, stop strings, LoRA's target modules and layer pairs) as a list: Python's yaml
    tags a tuple (``!!python/tuple``), which yaml.safe_load (TensorBoard's hparams reader, a user's script) refuses.
    The module and the data module keep the tuples they were given."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.loggers.utilities import _log_hyperparams

    module = GRPOModule(model="tiny-llama", betas=(0.9, 0.95), peft_config={
        "r": 4, "target_modules": ("q_proj", "v_proj"), "layer_replication": [(0, 1), (1, 2)]})
    data = RolloutDataModule(prompts=PROMPTS, sampling={"stop_strings": ("\n\n",)})
    logger = TensorBoardLogger(tmp_path / "logs")
    _log_hyperparams(SimpleNamespace(loggers=[logger], lightning_module=module, datamodule=data))
    logged = yaml.safe_load((Path(logger.log_dir) / "hparams.yaml").read_text())
    assert logged["betas"] == [0.9, 0.95] and logged["sampling"]["stop_strings"] == ["\n\n"]
    assert logged["peft_config"] == {"r": 4, "target_modules": ["q_proj", "v_proj"],
                                     "layer_replication": [[0, 1], [1, 2]]}
    checkpoint = {"state_dict": {}, "hyper_parameters": dict(module.hparams),
                  "datamodule_hyper_parameters": dict(data.hparams)}  # as Lightning's dump_checkpoint, before the hook
    module.on_save_checkpoint(checkpoint)
    for section in ("hyper_parameters", "datamodule_hyper_parameters"):
        assert yaml.safe_load(yaml.safe_dump(checkpoint[section])) == checkpoint[section]
    assert checkpoint["hyper_parameters"]["betas"] == [0.9, 0.95]
    assert checkpoint["datamodule_hyper_parameters"]["sampling"]["stop_strings"] == ["\n\n"]
    # what the run reads is as it was given
    assert module.hparams.betas == (0.9, 0.95) and module.hparams.peft_config["layer_replication"] == [(0, 1), (1, 2)]
    assert data.hparams.sampling["stop_strings"] == ("\n\n",) and data.sampling.stop_strings == ("\n\n",)


def test_the_hparams_are_the_init_arguments_each_class_saves():
    """``PlainHyperparameters.save_hyperparameters`` has Lightning read the init arguments from its own caller's
    frame, as Lightning's reads its caller's: the hparams are the class's arguments (less those it ignores, with
    those it sets after), none of the override's own names, in ``hparams`` and in the initial copy alike."""
    module = GRPOModule(model="tiny-llama")
    data = RolloutDataModule(prompts=PROMPTS)
    for hparams in (module.hparams, module.hparams_initial):
        assert set(hparams) == set(inspect.signature(GRPOModule).parameters)
    for hparams in (data.hparams, data.hparams_initial):
        assert set(hparams) == set(inspect.signature(RolloutDataModule).parameters) - {"prompts", "dataset"}


def test_a_hparam_set_before_they_are_saved_is_refused():
    """save_hyperparameters replaces the hparams, so a setting set before would be dropped without a word."""
    from lightning.pytorch import LightningDataModule

    from lit_grpo.runtime.checkpoints import PlainHyperparameters

    class Data(PlainHyperparameters, LightningDataModule):
        def __init__(self, size: int = 3):
            super().__init__()
            self.set_hparam("dataset", "train.jsonl")

    with pytest.raises(RuntimeError, match=r"^set_hparam\('dataset', 'train.jsonl'\) before save_hyperparameters: "
                                           r"save_hyperparameters would drop it; set it after$"):
        Data()

    class Huge(PlainHyperparameters, LightningDataModule):
        def __init__(self):
            super().__init__()
            self.set_hparam("size", 10**5000)

    # an int too long to print (Python's int-to-str limit) failed with repr's ValueError in place of the refusal
    with pytest.raises(RuntimeError, match=r"^set_hparam\('size', an int of 5001 digits\) before "
                                           r"save_hyperparameters: "):
        Huge()


def test_a_model_folder_given_as_a_path_is_the_setting_its_text_is(tmp_path):
    """``GRPOModule(model=Path(folder))`` loads, saves and resumes as ``model=str(folder)`` does: it was refused as
    no string. Its hyperparameters hold the text (a path's YAML tag is what yaml.safe_load refuses)."""
    from lit_grpo.runtime.checkpoints import check_resumable
    from lit_grpo.runtime.models import load_model_and_tokenizer

    folder = tmp_path / "model"
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    by_path, by_text = GRPOModule(model=folder), GRPOModule(model=str(folder))
    for hparams in (by_path.hparams, by_path.hparams_initial):
        assert hparams["model"] == str(folder) and type(hparams["model"]) is str
    assert dict(by_path.hparams) == dict(by_text.hparams)
    by_path.configure_model()
    for name, weight in model.state_dict().items():
        torch.testing.assert_close(by_path.policy.state_dict()[name], weight)
    # a checkpoint of either resumes the other, a null dtype read as the folder's (float32) on either side
    checkpoint = tmp_path / "last.ckpt"
    for saved, now in ((by_path.hparams, by_text.hparams), (by_text.hparams, {**by_text.hparams, "model": folder})):
        torch.save({"state_dict": {}, "loops": {}, "optimizer_states": [], "hyper_parameters": dict(saved)},
                   checkpoint)
        check_resumable(checkpoint, now, None)
        check_resumable(checkpoint, {**now, "dtype": "float32"}, None)
    torch.save({"state_dict": {}, "loops": {}, "optimizer_states": [],
                "hyper_parameters": {**by_text.hparams, "dtype": "float32"}}, checkpoint)
    check_resumable(checkpoint, {**by_text.hparams, "model": folder}, None)
    with pytest.raises(ValueError, match=r"model.dtype: 'float32' in the checkpoint, 'bfloat16' now"):
        check_resumable(checkpoint, {**by_text.hparams, "model": folder, "dtype": "bfloat16"}, None)


def assert_loads_back(hparams):
    """``hparams`` saved by torch.save read back equal by torch.load(weights_only=True), as a checkpoint's are."""
    buffer = io.BytesIO()
    torch.save(dict(hparams), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == dict(hparams)


@pytest.mark.parametrize("setting, message", [
    (dict(size=0), r"size=0 must be an integer >= 1"),
    (dict(data_seed=-1), r"data_seed=-1"),
    (dict(data_seed=1.5), r"data_seed=1.5"),
    (dict(steps_per_epoch=0), r"steps_per_epoch=0 must be an integer >= 1"),
    (dict(score_batch_size=0), r"score_batch_size=0 must be an integer >= 1"),
    # a curriculum option's value, refused at setup once the prompts had loaded, is named with its key when built
    (dict(curriculum="angle", curriculum_kwargs={"alpha": "2"}),
     r"^data.curriculum_kwargs.alpha='2' is not allowed; alpha must be a finite number >= 0$"),
    (dict(curriculum="angle", curriculum_kwargs={"sigma": 0}),
     r"^data.curriculum_kwargs.sigma=0 is not allowed; sigma must be a finite number > 0$"),
    (dict(curriculum="angle", curriculum_kwargs={"rescore_every_n_epochs": 1.5}),
     r"^data.curriculum_kwargs.rescore_every_n_epochs=1.5 is not allowed; rescore_every_n_epochs must be an integer "
     r">= 1$"),
    (dict(curriculum="angle", curriculum_kwargs={"angle_normalization": "zscore"}),
     r"^data.curriculum_kwargs.angle_normalization='zscore' is not known; use one of \['minmax', 'none'\]$"),
    (dict(curriculum="angle", curriculum_kwargs={"adj_min": 5.0, "adj_max": 1.0}),
     r"adj_min=5 is not allowed with adj_max=1; adj_min must be <= adj_max$"),
    (dict(val_batch_size=0), r"val_batch_size=0 must be an integer >= 1"),
    (dict(on_reward_error="ignore"), r"on_reward_error='ignore'"),
    (dict(chat_template_kwargs=[1]), r"chat_template_kwargs=\[1\] must be a mapping"),
    # a number failed inside reasoning-gym ("'float' object is not iterable"), a string was read as its keys
    (dict(task_config=1.5), r"task_config=1.5 must be a mapping of the reasoning-gym task's options"),
    (dict(task_config="min_terms"), r"task_config='min_terms' must be a mapping"),
    # a column that is not a name failed with an AttributeError ('bool' object has no attribute 'split')
    (dict(answer_column=True), r"answer_column=True must be a non-empty string or None"),
    (dict(prompt_column=""), r"prompt_column='' must be a non-empty string or None"),
    (dict(split=None), r"split=None must be a non-empty string"),
    # an empty path is the current folder: datasets' own error named neither the setting nor the value
    (dict(dataset=""), r"dataset='' must be a path \(a local file or folder\) or a datasets.Dataset"),
    (dict(jsonl_path=""), r"jsonl_path='' must be a JSONL file's path or None"),
])
def test_each_data_setting_is_refused_when_the_data_module_is_built_naming_it(setting, message):
    """Each setting's owner checks it (the config groups, the prompt source and shaping, the curriculum) when
    RolloutDataModule is built, before any prompt or model is loaded; the refusal names the value."""
    with pytest.raises(ValueError, match=message):
        RolloutDataModule(prompts=PROMPTS, **setting)


def test_setting_warnings_point_at_the_caller():
    """Each warning of RolloutDataModule and GRPOModule about a setting names the line that built it."""
    for kwargs in ({"sampling": {"strategy": "full", "micro_group_size": 2}}, {"max_staleness": 5},
                   {"size": 40}, {"sampling": {"strategy": "infinite", "max_new_tokens": 64,
                                               "scheduler": {"preempt_tokens": 64}}}):
        with pytest.warns(UserWarning) as said:
            RolloutDataModule(prompts=PROMPTS, **kwargs)
        assert [w.filename for w in said] == [__file__] * len(said), kwargs
    for kwargs in ({"fsdp_rollout": "gathered"}, {"min_lr_ratio": 0.1},
                   {"sampler_correction": {"mode": "none", "clip_max": 2.0}}):
        with pytest.warns(UserWarning) as said:
            GRPOModule(model="tiny-llama", **kwargs)
        assert [w.filename for w in said] == [__file__] * len(said), kwargs


def test_angle_curriculum_is_wired_in():
    module = make_module()
    dm = make_datamodule(module, curriculum="angle", curriculum_kwargs={"sigma": 2.0})
    batch = dm.build_train_batch()
    assert dm.sampler.scores is not None and dm.sampler.scores.shape == (len(dm.train_indices),)
    # the step logs the sampler's own state after its update: mu moved off its start, and the mean angle is the
    # mean score of the prompts this step drew
    logged = module.grpo_step(batch, torch.optim.SGD(module.policy.parameters(), lr=0.0))
    assert logged["curriculum/mu"] == dm.sampler.mu > 0.0
    drawn = [dm.train_indices.index(i) for i in batch.indices]
    assert logged["curriculum/mean_angle"] == pytest.approx(float(dm.sampler.scores[drawn].mean()))
    assert "sampler" in dm.state_dict() and dm.state_dict()["sampler"]["kind"] == "AngleCurriculumSampler"


def test_a_steps_extra_rounds_draw_prompts_it_has_not_drawn(monkeypatch):
    """One process, dynamic sampling under the angle curriculum: the refills avoid the prompts just filtered."""
    module = make_module()
    dm = make_datamodule(module, curriculum="angle", dynamic_sampling=True, max_rollouts_per_step=4, max_new_tokens=4,
                         reward_funcs=["char_fraction"], prompts_per_step=4, val_size=2)
    draws, draw = [], dm.sampler.draw
    monkeypatch.setattr(dm.sampler, "draw", lambda count, avoid=(): draws.append(draw(count, avoid)) or draws[-1])
    for _ in range(3):
        draws.clear()
        dm.build_train_batch()
        assert len(draws) > 1, "the test needs extra rounds"
        drawn = [index for batch in draws for index in batch]
        assert len(set(drawn)) == len(drawn), draws


def test_jsonl_source_and_its_errors(tmp_path):
    from lit_grpo.rollout.prompts import jsonl_prompts, split_examples

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "What is 2 + 2?", "answer": 4, "level": 1}\n\n{"question": "Capital of France?"}\n')
    examples = jsonl_prompts(path)
    assert [(e.prompt, e.answer) for e in examples] == [("What is 2 + 2?", 4), ("Capital of France?", None)]
    assert examples[0].entry["level"] == 1
    train, val = split_examples(examples, 1, seed=0)
    assert sorted(train + val) == [0, 1] and len(val) == 1
    with pytest.raises(ValueError, match="does not exist"):
        jsonl_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=r"jsonl_path=3 must be a JSONL file's path"):
        jsonl_prompts(3)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        jsonl_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"text": "hi"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no prompt field; the row has keys \['text'\]"):
        jsonl_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="val_size=2 leaves no training prompt"):
        split_examples(examples, 2)
    with pytest.raises(ValueError, match=r"val_size=True must be a count >= 0 or a fraction"):
        split_examples(examples, True)
    with pytest.raises(ValueError, match=r"val_size=0.01 of 2 distinct prompts holds none out \(it rounds to 0\)"):
        split_examples(examples, 0.01)


def test_the_prompt_settings_refusals_show_the_bad_value_bounded_and_a_huge_int_by_its_digits():
    """Each refusal shows the bad value as the shared checks do: a repr of an int of more than 4300 digits failed
    with Python's int-to-str ValueError in place of the refusal, a long value ran on."""
    from types import SimpleNamespace

    from lit_grpo.rollout.prompts import (PromptExample, check_chat_template_kwargs, check_messages,
                                          check_prompt_shaping, check_prompt_source, check_val_size, inline_prompts,
                                          jsonl_prompts, reasoning_gym_prompts, split_examples)

    huge, holding = 10**5000, r"a (dict|list) holding an int of more than \d+ digits"
    user = {"role": "user", "content": "hi"}
    two = [PromptExample("a?", None, {}), PromptExample("b?", None, {})]
    cases = [
        (lambda: check_messages(huge, "here"), r"^here: expected a non-empty string or a list of chat messages, got "
                                               r"an int of 5001 digits$"),
        (lambda: check_messages([huge], "here"), r"^here: message 0 must be \{'role': str, 'content': str\}, got an "
                                                 r"int of 5001 digits$"),
        (lambda: check_messages([{**user, huge: "x"}], "here"), r"^here: message 0 has the key an int of 5001 "
                                                                r"digits \(int\); a chat message's keys must be "),
        (lambda: check_messages([{"role": "r" * 500, "content": "hi"}], "here"),
         rf"^here: the messages must end with a non-empty user turn .*; the last is {re.escape(repr('r' * 500)[:100])}"
         r" with content 'hi'$"),
        (lambda: inline_prompts(huge), r"^prompts must be a non-empty list of strings or dicts, got an int of 5001 "
                                       r"digits$"),
        (lambda: inline_prompts([{"prompt": huge}]), r"^prompts\[0\]: field 'prompt' must be a non-empty string or a "
                                                     r"list of chat messages .*, got an int of 5001 digits$"),
        (lambda: jsonl_prompts(huge), r"^jsonl_path=\(an int of 5001 digits\) must be a JSONL file's path$"),
        (lambda: check_prompt_source(8, 0, huge), r"^dataset=\(an int of 5001 digits\) must be a path"),
        (lambda: check_prompt_source(8, 0, None, jsonl_path=huge), r"^jsonl_path=\(an int of 5001 digits\) must be a "
                                                                   r"JSONL file's path or None$"),
        (lambda: check_prompt_source(8, 0, None, task_config=huge), r"^task_config=\(an int of 5001 digits\) must be "
                                                                    r"a mapping of the reasoning-gym task's options"),
        (lambda: check_chat_template_kwargs(None, huge), r"^chat_template_kwargs=\(an int of 5001 digits\) must be a "
                                                         r"mapping of the chat template's variable names"),
        (lambda: check_chat_template_kwargs(SimpleNamespace(chat_template=None), {"enable_thinking": huge}),
         rf"^chat_template_kwargs={holding} need a chat template; this tokenizer has none"),
        (lambda: check_val_size(-huge), r"^val_size=\(a negative int of 5001 digits\) must be a count >= 0 or a "
                                        r"fraction in \[0, 1\)$"),
        (lambda: split_examples(two, huge), r"^val_size=\(an int of 5001 digits\) leaves no training prompt out of 2 "
                                            r"distinct prompts"),
        (lambda: check_prompt_shaping(huge, "{prompt}", None), r"^system_prompt=\(an int of 5001 digits\) must be a "
                                                               r"string or None$"),
        (lambda: check_prompt_shaping(None, "x" * 500, None),
         rf"^prompt_template={re.escape(repr('x' * 500)[:100])} must be a string that contains '\{{prompt\}}'$"),
        (lambda: reasoning_gym_prompts("basic_arithmetic", -huge), r"^size=\(a negative int of 5001 digits\) must be "
                                                                   r">= 1 \(prompts to generate from task "
                                                                   r"'basic_arithmetic'\)$"),
        (lambda: reasoning_gym_prompts(huge, 2), r"^task=\(an int of 5001 digits\) is not a reasoning-gym task "),
        (lambda: inline_prompts([{huge: "x", "text": "y", 2: "z"}]), r"^prompts\[0\]: no prompt field; the row has "
                                                                   r"keys \[2, an int of 5001 digits, 'text'\] but "),
        (lambda: reasoning_gym_prompts("basic_arithmetic", 2, config={huge: 1, "min_term": 2, 3: 4}),
         r"^task_config \[3, an int of 5001 digits, 'min_term'\] is not an option of reasoning-gym task "
         r"'basic_arithmetic'; its options: "),
        (lambda: reasoning_gym_prompts("basic_arithmetic", 2, config={"min_terms": huge, "max_terms": 2}),
         rf"^reasoning-gym task='basic_arithmetic' with task_config {holding} failed: AssertionError: max_terms must "
         r"be >= min_terms$"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()


def test_a_jsonl_file_that_starts_with_a_byte_order_mark_reads_as_one_without(tmp_path):
    """A UTF-8 file some editors save with a BOM (as data.dataset's JSON reader takes it): its first row is read, not
    refused as invalid JSON with advice to decode it otherwise, which the setting cannot do."""
    from lit_grpo.rollout.prompts import jsonl_prompts

    text = '{"prompt": "Wie viel ist 2 + 2?", "answer": 4}\n{"prompt": "Größte Stadt?", "answer": "Zürich"}\n'
    (tmp_path / "plain.jsonl").write_text(text, encoding="utf-8")
    (tmp_path / "bom.jsonl").write_text(text, encoding="utf-8-sig")
    assert (tmp_path / "bom.jsonl").read_bytes().startswith(b"\xef\xbb\xbf")
    read = [(e.prompt, e.answer, e.entry) for e in jsonl_prompts(tmp_path / "bom.jsonl")]
    assert read == [(e.prompt, e.answer, e.entry) for e in jsonl_prompts(tmp_path / "plain.jsonl")]
    assert read[1][:2] == ("Größte Stadt?", "Zürich")


def test_a_jsonl_rows_chat_messages_are_taken_and_checked_as_data_dataset_takes_them(tmp_path):
    """TRL's conversational rows (``{"prompt": [{"role", "content"}, ...]}``) from data.jsonl_path: the same
    example data.dataset makes of the file, and the same checks with the line named."""
    import json

    from lit_grpo.rollout.hf_dataset import dataset_prompts
    from lit_grpo.rollout.prompts import jsonl_prompts

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": chat, "answer": 4}) + "\n")
    (tmp_path / "mixed.jsonl").write_text(json.dumps({"prompt": chat}) + "\n" + json.dumps({"prompt": "Plain?"}))
    assert [(e.prompt, e.messages) for e in jsonl_prompts(tmp_path / "mixed.jsonl")] == [("What is 2 + 2?", chat),
                                                                                        ("Plain?", None)]
    for bad, match in (([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}],
                        r"bad.jsonl:1, field 'prompt': the messages must end with a non-empty user turn"),
                       ([{"role": "user"}], r"bad.jsonl:1, field 'prompt': message 0 must be \{'role': str, "),
                       ([], r"bad.jsonl:1, field 'prompt': expected a non-empty string or a list of chat messages"),
                       (3, r"bad.jsonl:1: field 'prompt' must be a non-empty string or a list of chat messages")):
        (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": bad}) + "\n")
        with pytest.raises(ValueError, match=match):
            jsonl_prompts(tmp_path / "bad.jsonl")
    pytest.importorskip("datasets")  # the data extra
    (taken,), (read,) = jsonl_prompts(tmp_path / "chat.jsonl"), dataset_prompts(str(tmp_path / "chat.jsonl"))
    assert (taken.prompt, taken.messages, taken.answer, taken.entry) == (read.prompt, read.messages, 4, read.entry)


def test_an_inline_prompt_holding_an_int_too_long_to_print_is_refused_naming_the_row():
    """Python turns no int of more than sys.get_int_max_str_digits() digits (4300) into text, as the prompt set's
    fingerprint takes a row's answer and messages (and the math reward its answer): such a data.prompts row failed
    with Python's bare ValueError, naming no prompt. It is refused naming the row and the fix, as a JSONL file's is;
    a long int Python prints is taken."""
    from lit_grpo.rollout.prompts import load_prompts, prompt_set_fingerprint
    from lit_grpo.runtime.validation import ConfigError

    limit = sys.get_int_max_str_digits()
    fix = (rf"more than Python turns into text \(sys.get_int_max_str_digits\(\): {limit}\); give so long a number "
           "as a string")
    for answer, shown in ((10**5000, "an int of 5001 digits"),
                          ([1, 10**5000], f"a list holding an int of more than {limit} digits")):
        with pytest.raises(ValueError, match=rf"^prompts\[1\]: the answer is {shown}, {fix}$"):
            load_prompts(prompts=[{"prompt": "a?", "answer": 3}, {"prompt": "b?", "answer": answer}])
    with pytest.raises(ValueError, match=rf"^prompts\[0\]: the messages hold an int of more than {limit} digits, "
                                         rf"{fix}$"):
        load_prompts(prompts=[{"prompt": [{"role": "user", "content": "b?", "count": 10**5000}]}])
    for rewards in (["char_fraction"], ["math"]):  # the fingerprint's answer as text; the math reward's check's
        data = RolloutDataModule(prompts=[{"prompt": "a?", "answer": 3}, {"prompt": "b?", "answer": -10**5000}],
                                 val_size=0, prompts_per_step=1, reward_funcs=rewards)
        with pytest.raises(ConfigError, match=r"^data: prompts\[1\]: the answer is a negative int of 5001 digits, "):
            data.setup("fit")
    long = 10 ** (limit - 1)  # as many digits as Python prints
    assert prompt_set_fingerprint(load_prompts(prompts=[{"prompt": "a?", "answer": long}]))


def test_a_rows_ints_are_refused_exactly_where_python_would_not_turn_them_into_text():
    """A row of plain values (strings, floats, ints whose bits allow no more digits than the limit) is taken without
    turning it into text; any other is turned into text as the prompt set's fingerprint does. The refusal falls
    exactly where Python's does: an int of the limit's digits is taken at its most bits, one of a digit more is
    refused, wherever it is held (a tuple, a dict's key, a Fraction)."""
    from fractions import Fraction

    from lit_grpo.rollout.prompts import load_prompts

    limit = sys.get_int_max_str_digits()

    def answer_taken(answer):
        try:
            load_prompts(prompts=[{"prompt": "a?", "answer": answer}])
        except ValueError as error:
            assert "more than Python turns into text" in str(error)
            return False
        return True

    # the most bits of an int Python prints, and the fewest of one it does not
    assert answer_taken(10**limit - 1) and answer_taken(-(10**limit - 1)) and answer_taken([True, 2.5, None, b"x"])
    for held in (10**limit, -10**limit, (1, 10**limit), {10**limit: 1}, {"a": [{"b": 10**limit}]},
                 Fraction(10**limit, 3)):
        assert not answer_taken(held), held
    with pytest.raises(ValueError, match=r"^prompts\[0\]: the messages hold an int"):
        load_prompts(prompts=[{"prompt": [{"role": "user", "content": "b?", "ids": (1, -10**limit)}]}])


def test_chat_messages_keep_their_other_keys_and_drop_those_a_table_row_holds_as_none():
    """A chat turn's keys beyond role and content (name, tool_calls, tool_call_id, reasoning_content) are kept, as
    TRL passes a prompt's messages as they are; a key whose value is None is absent (a datasets row holds every key
    of the column's struct type, None where the turn lacks it). Keys are the template's names: strings only."""
    from lit_grpo.rollout.prompts import check_messages

    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]
    given = [{"role": "system", "content": "Be brief.", "name": "setup", "tool_calls": None},
             {"role": "user", "content": "2 + 2?"},
             {"role": "assistant", "content": "", "tool_calls": calls, "reasoning_content": "add them"},
             {"role": "tool", "content": "4", "tool_call_id": "call_0", "name": None},
             {"role": "user", "content": "And 3 + 3?", "name": "ada"}]
    assert check_messages(given, "here") == [
        {"role": "system", "content": "Be brief.", "name": "setup"}, {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "", "tool_calls": calls, "reasoning_content": "add them"},
        {"role": "tool", "content": "4", "tool_call_id": "call_0"},
        {"role": "user", "content": "And 3 + 3?", "name": "ada"}]
    with pytest.raises(ValueError, match=r"here: message 0 has the key 1 \(int\); a chat message's keys must be "
                                         r"strings"):
        check_messages([{"role": "user", "content": "hi", 1: "x"}], "here")
    with pytest.raises(ValueError, match=r"here: message 0 must be \{'role': str, 'content': str"):
        check_messages([{"role": "user", "content": None, "name": "ada"}], "here")  # role and content: never None


def test_a_chat_prompts_other_message_keys_reach_the_chat_template_and_the_reward_functions():
    """A chat prompt's turns go to the chat template with every key they have (a user turn's name too, whose
    content the prompt template shapes), as TRL passes them, and reach the reward functions so: a template that
    renders names rendered none where only role and content were kept."""
    chat = [{"role": "system", "content": "Be brief.", "name": "setup"},
            {"role": "user", "content": "What is 2 + 2?", "name": "ada"}]
    seen = []

    def record(prompts, completions, **kwargs):
        seen.append(prompts)
        return [0.0] * len(completions)

    module = make_module()
    module.tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}{{ ' ' + m.name if m.name else '' }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    dm = make_datamodule(module, prompts=[{"prompt": chat}], val_size=0, prompts_per_step=1, reward_funcs=[record],
                         prompt_template="Q: {prompt}", group_size=2, micro_group_size=2, max_new_tokens=2)
    shaped = [chat[0], {**chat[1], "content": "Q: What is 2 + 2?"}]
    rendered = module.tokenizer.apply_chat_template(shaped, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>system setup\n" in rendered and "<|im_start|>user ada\nQ: What" in rendered
    assert dm.train_prompt_ids == [module.tokenizer(rendered, add_special_tokens=False)["input_ids"]]
    dm.build_train_batch()
    assert seen == [[chat, chat]]  # the messages as the row holds them, as TRL's conversational prompts


def test_a_source_mixing_chat_and_plain_prompts_gives_every_reward_call_the_conversational_form():
    """The form the reward functions get is the prompt source's, one for the run: a source with a chat row gives
    each step TRL's conversational form, a plain row as its one user message, whatever rows the step drew. Decided
    by the batch, a step that drew plain rows only gave text, so one function got two forms (len(c) meant two
    things)."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    seen = []

    def record(prompts, completions, **kwargs):
        seen.append((prompts, completions))
        return [0.0] * len(completions)

    dm = make_datamodule(make_module(), prompts=[{"prompt": chat}, "What is 3 + 3?"], val_size=0, prompts_per_step=1,
                         reward_funcs=[record], group_size=2, micro_group_size=2, max_new_tokens=2)
    batches = [dm.build_train_batch() for _ in range(2)]  # an epoch: each row drawn once, alone in its step
    assert sorted(batch.prompts[0] for batch in batches) == ["What is 2 + 2?", "What is 3 + 3?"]
    for batch, (prompts, completions) in zip(batches, seen):
        row = chat if batch.prompts == ["What is 2 + 2?"] else [{"role": "user", "content": "What is 3 + 3?"}]
        assert prompts == [row, row]
        assert completions == [[{"role": "assistant", "content": text}] for text in batch.completions[0]]


def test_split_holds_out_distinct_prompts_whole():
    """A prompt the source repeats is held out with all its rows (validated once) and never trained on; a source
    without repeats splits as a plain shuffle of its rows."""
    from lit_grpo.rollout.prompts import PromptExample, split_examples

    texts = [f"{a} + {b}" for a in range(6) for b in range(5)]  # 30 distinct prompts, each 1-4 times in the rows
    rows = [PromptExample(prompt=texts[(i * 7) % 30]) for i in range(30)] + [
        PromptExample(prompt=texts[i % 30]) for i in range(0, 60, 3)]
    for seed in range(5):
        train, val = split_examples(rows, 6, seed)
        held_out = [rows[i].prompt for i in val]
        assert len(held_out) == len(set(held_out)) == 6
        assert not set(held_out) & {rows[i].prompt for i in train}
        assert sorted(train + val) == [i for i in range(len(rows)) if rows[i].prompt not in held_out or i in val]
    assert len(split_examples(rows, 0.2, 0)[1]) == 6  # a fraction of the 30 distinct prompts, not of the 50 rows
    chat = [PromptExample(prompt="hi", messages=[{"role": "user", "content": "hi"}]), PromptExample(prompt="hi")]
    assert len(split_examples(chat, 1, 0)[0]) == 1  # the same text after other chat turns is another prompt
    with pytest.raises(ValueError, match=r"val_size=30 leaves no training prompt out of 30 distinct prompts; lower "
                                         r"it \(a count of at most 29; 0: no validation\) or add prompts"):
        split_examples(rows, 30)
    # a fraction that rounds to every prompt: the count is named as a count
    with pytest.raises(ValueError, match=r"val_size=0.99 leaves .* \(a count of at most 29, or a smaller fraction; "
                                         r"0: no validation\)"):
        split_examples(rows, 0.99)
    with pytest.raises(ValueError, match=r"val_size=1 leaves .* out of 1 distinct prompts; lower it \(0: no "
                                         r"validation\)"):
        split_examples(rows[:1], 1)
    unique = [PromptExample(prompt=str(i)) for i in range(40)]
    order = torch.randperm(40, generator=torch.Generator().manual_seed(3)).tolist()
    assert split_examples(unique, 4, 3) == (sorted(order[4:]), sorted(order[:4]))


def test_an_epoch_has_enough_steps_for_every_training_prompt():
    # steps per epoch round up: 10 training prompts at 4 a step take 3 steps (the last one partly a new epoch's)
    for prompts_per_step, steps in ((4, 3), (5, 2), (10, 1)):
        dm = RolloutDataModule(**datamodule_arguments({"prompts_per_step": prompts_per_step}))
        dm.setup("fit")  # no policy needed to split the prompts
        assert len(dm.train_indices) == 10  # PROMPTS' 12, 2 held out
        assert dm.num_train_steps_per_epoch() == steps, prompts_per_step


def test_token_logps_and_entropy_helpers():
    from lit_grpo.update.logprobs import token_entropy

    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(2, 3, 11, generator=g), torch.randint(0, 11, (2, 3), generator=g)
    full = torch.log_softmax(logits, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logps(logits, ids), full)
    half = token_logps(logits.bfloat16(), ids)  # the row-by-row path for half-precision logits
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, atol=6e-2, rtol=0)
    expected = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(token_entropy(logits), expected)


def test_the_logged_lr_is_the_one_the_step_used(batch):
    """train/lr is read before the scheduler steps: the first step of a 4-step warm-up logs lr / 4."""
    module = make_module(lr=1e-3, warmup_steps=4)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    logged = [module.grpo_step(batch, optimizer, scheduler)["train/lr"] for _ in range(2)]
    assert logged == pytest.approx([2.5e-4, 5e-4])


def test_a_second_iteration_clips_against_the_rollouts_log_probs_and_logs_the_mean_of_both(batch):
    """num_iterations 2: the second optimizer step's ratio is to the log-probs from before the first (its trust
    region: some tokens clip after a large first step), and train/* are the two steps' means (lr: lr / 2 and lr)."""
    module = make_module(num_iterations=2, lr=0.05, warmup_steps=2)
    config = module.configure_optimizers()
    metrics = module.grpo_step(batch, config["optimizer"], config["lr_scheduler"]["scheduler"])
    assert metrics["train/lr"] == pytest.approx((0.025 + 0.05) / 2)
    assert metrics["train/clip_ratio_low"] + metrics["train/clip_ratio_high"] > 0


@pytest.mark.parametrize("mask_truncated", [True, False])
def test_masked_truncated_completions_give_no_loss_or_gradient(batch, mask_truncated):
    every_row_cut = dataclasses.replace(batch, truncated=torch.ones_like(batch.truncated))
    module = make_module(mask_truncated_completions=mask_truncated)
    grads, metrics = grads_after_step(module, every_row_cut)
    moved = any(grad.abs().sum() > 0 for grad in grads.values())
    assert moved is not mask_truncated
    if mask_truncated:  # unmasked, the on-policy loss is a sum of zero-mean advantages: 0 up to rounding
        assert metrics["train/loss"] == 0


def test_the_rate_warms_up_then_holds_or_decays_to_zero_at_the_last_step():
    from lit_grpo.update.lr_schedule import lr_factor, lr_lambda

    steps = range(6)
    assert [lr_factor(s, 2, None, "constant") for s in steps] == [0.5, 1, 1, 1, 1, 1]
    assert [lr_factor(s, 0, None, "constant") for s in steps] == [1] * 6
    # the decay starts at the warm-up's last step (its peak) and would reach 0 at step 6
    assert [lr_factor(s, 2, 6, "linear") for s in steps] == pytest.approx([0.5, 1, 0.8, 0.6, 0.4, 0.2])
    assert [lr_factor(s, 0, 4, "linear") for s in range(4)] == pytest.approx([1, 0.75, 0.5, 0.25])
    assert [lr_factor(s, 2, 6, "cosine") for s in steps] == pytest.approx(
        [0.5, 1] + [0.5 * (1 + math.cos(math.pi * k / 5)) for k in range(1, 5)])
    assert lr_factor(9, 2, 6, "linear") == lr_factor(9, 2, 6, "cosine") == 0  # resumed past the end: no rate
    # a floor: transformers' cosine_with_min_lr (min_lr_rate 0.1), the same fall scaled into [0.1, 1]
    assert [lr_factor(s, 2, 6, "cosine", 0.1) for s in steps] == pytest.approx(
        [0.5, 1] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 5)) for k in range(1, 5)])
    assert [lr_factor(s, 0, 4, "linear", 0.2) for s in range(4)] == pytest.approx([1, 0.8, 0.6, 0.4])
    assert lr_factor(9, 2, 6, "cosine", 0.1) == pytest.approx(0.1)  # past the end: the floor
    assert lr_lambda("cosine", 2, 6, 0.1)(5) == pytest.approx(lr_factor(5, 2, 6, "cosine", 0.1))
    for bad in (-0.1, 1.5, math.nan, True, "0.1"):
        with pytest.raises(ValueError, match=rf"min_lr_ratio={bad!r} is not allowed; min_lr_ratio must be a finite "
                                             r"number >= 0 and <= 1"):
            GRPOModule(model="tiny-llama", lr_schedule="cosine", min_lr_ratio=bad)
    with pytest.warns(UserWarning, match=r"min_lr_ratio=0.1 is the floor of a decaying lr_schedule; with 'constant' "
                                         "it is ignored"):
        GRPOModule(model="tiny-llama", min_lr_ratio=0.1)
    with pytest.raises(ValueError, match=r"lr_schedule='cosine' decays the rate to 0 at trainer.max_steps, which "
                                         r"is not set \(-1\)"):
        lr_lambda("cosine", 0, -1)
    with pytest.raises(ValueError, match=r"warmup_steps=4 leaves no step of trainer.max_steps=4 for "
                                         r"lr_schedule='linear'"):
        lr_lambda("linear", 4, 4)
    with pytest.raises(ValueError, match=r"lr_schedule='Linear' is not known; use one of \['constant', 'linear', "):
        GRPOModule(model="tiny-llama", lr_schedule="Linear")


def test_a_warmup_the_run_never_leaves_is_warned_of_naming_both_counts():
    """A constant schedule takes any warm-up; one as long as the run's optimizer steps never reaches model.lr."""
    import lightning.pytorch as pl

    def configured(max_steps, **options):
        module = GRPOModule(model="tiny-llama", **options)
        module.policy = torch.nn.Linear(2, 2)  # what configure_optimizers steps: no model loaded
        module.trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False)
        module.configure_optimizers()

    with pytest.warns(UserWarning, match=r"model.warmup_steps=8 is not below trainer.max_steps=4: the whole run is "
                                         r"warm-up, its rate rising to 0.5 x model.lr at its last step"):
        configured(4, warmup_steps=8)
    # max_steps rounded up to whole training steps of 2 optimizer steps: the fit runs 4
    with pytest.warns(UserWarning, match=r"model.warmup_steps=4 is not below trainer.max_steps=3 \(4 optimizer "
                                         r"steps, rounded up to whole training steps\): the whole run is warm-up, "
                                         r"its rate rising to 1 x model.lr at its last step"):
        configured(3, warmup_steps=4, num_iterations=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*warmup_steps")
        configured(4, warmup_steps=3)
        configured(1, warmup_steps=1)  # one step of warm-up has the full rate
        configured(-1, warmup_steps=8)  # no max_steps: the run's length is not known here


def _fit_rates(max_steps, ckpt_path=None, save=None, fused=None, **module_options):
    """The rate of every optimizer step of a tiny fit (Python API, the settings given as their classes), and the
    betas of its last; ``fused``, a list: each step's ``fused`` setting and step count's device are added to it."""
    import lightning.pytorch as pl

    from lit_grpo.sampling import SamplingConfig
    from lit_grpo.update.loss_config import LossConfig

    rates, betas = [], []

    class Rates(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            rates.append(optimizer.param_groups[0]["lr"])
            betas[:] = optimizer.param_groups[0]["betas"]
            if fused is not None:
                group = optimizer.param_groups[0]
                steps = {optimizer.state[p]["step"].device.type for p in group["params"] if optimizer.state.get(p)}
                fused.append((group["fused"], steps))

    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[Rates()])
    module = GRPOModule(model="tiny-llama", loss=LossConfig(loss_type="grpo"), **module_options)
    sampling = SamplingConfig(group_size=2, micro_group_size=2, max_new_tokens=4)
    trainer.fit(module, RolloutDataModule(**datamodule_arguments({"val_size": 0, "sampling": sampling})),
                ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(save)
    return rates, tuple(betas)


def test_a_decaying_rate_spans_the_optimizer_steps_the_run_makes():
    """``max_steps`` counts optimizer steps: 2 training steps x 2 iterations decay over 4 rates; a count that is no
    multiple of the iterations is rounded up to the whole training steps Lightning runs."""
    rates, _ = _fit_rates(4, lr=1e-3, lr_schedule="linear", num_iterations=2)
    assert rates == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])
    assert _fit_rates(3, lr=1e-3, lr_schedule="linear", num_iterations=2)[0] == pytest.approx(rates)
    # with a floor the same fall is scaled into [min_lr_ratio, 1] of the rate
    floored, _ = _fit_rates(4, lr=1e-3, lr_schedule="linear", num_iterations=2, min_lr_ratio=0.2)
    assert floored == pytest.approx([1e-3, 8e-4, 6e-4, 4e-4])


def test_a_resumed_run_takes_its_own_rate_and_schedule_at_the_step_it_resumes(tmp_path):
    """The checkpoint (saved through the Python API, its settings as plain values that a weights-only load reads)
    restores the optimizer's param groups; the resumed run then trains at its own rate, on its own schedule."""
    checkpoint = str(tmp_path / "two.ckpt")
    rates, betas = _fit_rates(2, save=checkpoint, lr=1e-3, lr_schedule="linear")
    assert rates == pytest.approx([1e-3, 5e-4]) and betas == (0.9, 0.99)
    # to 4 steps at twice the rate: steps 2 and 3 of a 4-step linear decay, with other betas
    rates, betas = _fit_rates(4, ckpt_path=checkpoint, lr=2e-3, lr_schedule="linear", betas=(0.8, 0.9))
    assert rates == pytest.approx([1e-3, 5e-4]) and betas == (0.8, 0.9)
    assert _fit_rates(4, ckpt_path=checkpoint, lr=2e-3)[0] == pytest.approx([2e-3, 2e-3])  # constant from here


def test_a_resume_on_another_device_steps_with_this_runs_adamw_kernel(tmp_path, monkeypatch):
    """A checkpoint saved where AdamW ran foreach (a CPU) resumed where it runs fused (a GPU: ``fused_adamw``, made
    to say so here, on a CPU, which has a fused kernel too) steps fused, not with the saved group's setting; and
    back. The step counts go where each kernel keeps them."""
    import lit_grpo.update.module as module_file

    checkpoint = str(tmp_path / "foreach.ckpt")
    seen = []
    _fit_rates(1, save=checkpoint, fused=seen)
    assert seen == [(None, set())]  # the first step's state is made in it
    monkeypatch.setattr(module_file, "fused_adamw", lambda params, loss_scaled=False: True)
    seen.clear()
    _fit_rates(2, ckpt_path=checkpoint, save=str(tmp_path / "fused.ckpt"), fused=seen)
    assert seen == [(True, {"cpu"})]
    monkeypatch.setattr(module_file, "fused_adamw", lambda params, loss_scaled=False: False)
    seen.clear()
    _fit_rates(3, ckpt_path=str(tmp_path / "fused.ckpt"), fused=seen)
    assert seen == [(None, {"cpu"})]


#: The parameters of tiny-llama that transformers' Trainer (TRL's GRPOTrainer) leaves out of weight decay: its
#: RMSNorm weights; tiny-qwen2 adds its attention's biases.
LLAMA_NO_DECAY = {f"model.layers.{i}.{norm}.weight" for i in (0, 1)
                  for norm in ("input_layernorm", "post_attention_layernorm")} | {"model.norm.weight"}
QWEN2_NO_DECAY = LLAMA_NO_DECAY | {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in (0, 1) for p in "qkv"}


def _decay_by_name(module, optimizer) -> dict[str, float]:
    names = {id(p): name for name, p in module.policy.named_parameters()}
    return {names[id(p)]: group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}


@pytest.mark.parametrize("model, no_decay", [("tiny-llama", LLAMA_NO_DECAY), ("tiny-qwen2", QWEN2_NO_DECAY)])
def test_weight_decay_leaves_out_biases_and_norm_weights_as_transformers_trainer_does(model, no_decay):
    """Two param groups, decayed first, as the Trainer's: ``weight_decay`` on every other trainable weight."""
    module = make_module(model=model, weight_decay=0.1)
    optimizer = module.configure_optimizers()["optimizer"]
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    decay = _decay_by_name(module, optimizer)
    assert decay == {name: 0.0 if name in no_decay else 0.1 for name, _ in module.policy.named_parameters()}
    assert not optimizer.defaults["fused"]  # the kernel is chosen from every trainable weight


def test_weight_decay_under_lora_and_for_layernorm_modules():
    """A LoRA policy trains its adapters only, which have no bias: one group, decayed. A ``LayerNorm`` module's
    weights are left out whatever their name (GPT-2's ``ln_1``)."""
    from test_architectures import ARCHITECTURES, tiny_architecture

    from lit_grpo.update.module import weight_decay_groups

    lora = make_module(weight_decay=0.1, peft_config={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    decay = _decay_by_name(lora, lora.configure_optimizers()["optimizer"])
    assert len(decay) == 8 and all("lora_" in name for name in decay) and set(decay.values()) == {0.1}
    gpt2, _ = tiny_architecture(ARCHITECTURES["gpt2"][0], **ARCHITECTURES["gpt2"][1])
    names = {id(p): name for name, p in gpt2.named_parameters()}
    decayed, kept = ([names[id(p)] for p in group["params"]] for group in weight_decay_groups(gpt2, 0.1))
    assert "transformer.h.0.ln_1.weight" in kept and "transformer.ln_f.weight" in kept
    assert "transformer.h.0.attn.c_attn.bias" in kept and "transformer.h.0.attn.c_attn.weight" in decayed
    assert all("ln_" not in name and "bias" not in name for name in decayed)


def test_a_step_with_weight_decay_moves_biases_and_norm_weights_as_adamw_without_it(batch):
    """One step at weight_decay 0.1 changes the weights it decays and leaves every bias and norm weight where a step
    without decay puts it; without decay the optimizer is the one group of every trainable weight, in the policy's
    order, that it was before the groups (its steps bit for bit those)."""
    def stepped(**options):
        module = make_module(model="tiny-qwen2", lr=1e-2, **options)
        optimizer = module.configure_optimizers()["optimizer"]
        module.grpo_step(batch, optimizer)
        return optimizer, {name: p.detach().clone() for name, p in module.policy.named_parameters()}

    (_, decayed), (optimizer, plain) = stepped(weight_decay=0.1), stepped()
    for name, weight in plain.items():
        assert torch.equal(decayed[name], weight) is (name in QWEN2_NO_DECAY), name
    (only,) = optimizer.param_groups
    assert only["weight_decay"] == 0.0 and [p.shape for p in only["params"]] == [
        p.shape for p in make_module(model="tiny-qwen2").policy.parameters()]


def _fit_decays(max_steps, ckpt_path=None, save=None, **module_options):
    """A tiny fit's weight decay of each weight by name at its first optimizer step, and each weight's first AdamW
    moment there (a resumed run's: the checkpoint's)."""
    import lightning.pytorch as pl

    from lit_grpo.sampling import SamplingConfig

    seen = {}

    class Decays(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if not seen:
                seen["decay"] = _decay_by_name(pl_module, optimizer)
                names = {id(p): name for name, p in pl_module.policy.named_parameters()}
                seen["moments"] = {names[id(p)]: state["exp_avg"].clone() for p, state in optimizer.state.items()}

    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[Decays()])
    module = GRPOModule(model="tiny-qwen2", lr=1e-3, **module_options)
    sampling = SamplingConfig(group_size=2, micro_group_size=2, max_new_tokens=4)
    trainer.fit(module, RolloutDataModule(**datamodule_arguments({"val_size": 0, "sampling": sampling})),
                ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(save)
    return seen, module


def test_a_resumed_run_decays_by_its_own_setting_and_never_biases_or_norm_weights(tmp_path):
    checkpoint = str(tmp_path / "decayed.ckpt")
    first, _ = _fit_decays(1, save=checkpoint, weight_decay=0.1)
    assert first["decay"] == {name: 0.0 if name in QWEN2_NO_DECAY else 0.1 for name in first["decay"]}
    resumed, _ = _fit_decays(2, ckpt_path=checkpoint, weight_decay=0.2)
    assert resumed["decay"] == {name: 0.0 if name in QWEN2_NO_DECAY else 0.2 for name in first["decay"]}


@pytest.mark.parametrize("saved_decay, resumed_decay", [(0.0, 0.1), (0.1, 0.0)])
def test_a_checkpoint_of_other_param_groups_resumes_regrouped_each_weight_keeping_its_moments(
        tmp_path, saved_decay, resumed_decay):
    """A checkpoint of one group (weight_decay 0, or saved before the groups) resumed with weight_decay > 0, and
    one of the two groups resumed with 0: its optimizer state is regrouped as this run builds it, each weight's
    AdamW moments with it, and the schedule steps every group."""
    checkpoint = str(tmp_path / "saved.ckpt")
    _, saved = _fit_decays(1, save=checkpoint, weight_decay=saved_decay)
    names = {id(p): name for name, p in saved.policy.named_parameters()}
    moments = {names[id(p)]: state["exp_avg"] for p, state in saved.trainer.optimizers[0].state.items()}
    saved_groups = len(torch.load(checkpoint, weights_only=True)["optimizer_states"][0]["param_groups"])
    resumed, module = _fit_decays(2, ckpt_path=checkpoint, weight_decay=resumed_decay)
    assert saved_groups == (2 if saved_decay else 1)
    assert resumed["decay"] == {name: 0.0 if name in QWEN2_NO_DECAY else resumed_decay for name in moments}
    assert resumed["moments"].keys() == moments.keys()
    assert all(torch.equal(resumed["moments"][name], moment) for name, moment in moments.items())
    groups = len(module.optimizers().param_groups)
    assert groups == (2 if resumed_decay else 1) and len(module.lr_schedulers().lr_lambdas) == groups


def test_regrouped_gives_each_parameter_its_saved_number_in_its_new_group():
    from lit_grpo.update.module import regrouped

    a, b, c = (torch.zeros(1) for _ in range(3))
    state = {"state": {0: "a's", 1: "c's", 2: "b's"},
             "param_groups": [{"lr": 1.0, "weight_decay": 0.1, "params": [0, 1]}, {"lr": 1.0, "params": [2]}]}
    one = regrouped(state, [{"params": [a, c]}, {"params": [b]}], [{"params": [a, b, c]}])
    assert one == {"state": state["state"], "param_groups": [{"lr": 1.0, "weight_decay": 0.1, "params": [0, 2, 1]}]}
    assert regrouped(one, [{"params": [a, b, c]}], [{"params": [a, c]}, {"params": [b]}])["param_groups"] == [
        {"lr": 1.0, "weight_decay": 0.1, "params": [0, 1]}, {"lr": 1.0, "weight_decay": 0.1, "params": [2]}]


def test_regrouped_refuses_groups_that_are_not_the_saved_ones():
    """Saved groups of other sizes than the state's (another run's trainable weights) are named, not mapped."""
    from lit_grpo.update.module import regrouped

    a, b, c = (torch.zeros(1) for _ in range(3))
    state = {"state": {}, "param_groups": [{"lr": 1.0, "params": [0, 1]}, {"lr": 1.0, "params": [2]}]}
    with pytest.raises(ValueError, match=r"param groups of \[2, 1\] parameters .* groups of \[1, 2\]"):
        regrouped(state, [{"params": [a]}, {"params": [b, c]}], [{"params": [a, b, c]}])


def test_the_update_gives_freed_host_memory_back_before_each_optimizer_step(batch, monkeypatch):
    """On CPU the update's freed activations are released after the backward passes, before AdamW allocates."""
    module = make_module(num_iterations=2, train_micro_batch_size=3, lr=1e-3)
    optimizer = torch.optim.AdamW(module.policy.parameters(), lr=1e-3)
    calls = []

    def release():
        calls.append((len(optimizer.state), all(p.grad is not None for p in module.policy.parameters())))
        return True

    monkeypatch.setattr("lit_grpo.update.module.release_freed_host_memory", release)
    module.grpo_step(batch, optimizer)
    # once per optimizer step, each after every micro-batch's backward (the gradients exist) and before that step
    # (no optimizer state yet at the first)
    assert calls[0] == (0, True) and len(calls) == 2 and calls[1][1]


def test_loss_type_and_its_settings_are_checked_when_the_module_is_built():
    with pytest.raises(ValueError, match="loss_type='ppo' is not known"):
        GRPOModule(model="tiny-llama", loss={"loss_type": "ppo"})
    with pytest.raises(ValueError, match="epsilon_low=1.5 is not allowed; epsilon_low must be a finite number >= 0 "
                                         "and < 1"):
        GRPOModule(model="tiny-llama", loss={"epsilon_low": 1.5})
    assert GRPOModule(model="tiny-llama", loss={"loss_type": "grpo"}).loss_fn.name == "grpo"


def _fit_one_step(plugins, callbacks=(), **module_arguments):
    import lightning.pytorch as pl

    pl.seed_everything(0)
    module = GRPOModule(**{"model": "tiny-llama", "max_grad_norm": 1.0, "lr": 1e-3, **module_arguments})
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, plugins=plugins,
                         callbacks=list(callbacks))
    trainer.fit(module, RolloutDataModule(**datamodule_arguments({"val_size": 0})))
    return module, trainer


def test_under_a_loss_scaler_the_gradients_are_checked_and_clipped_unscaled():
    """16-mixed's GradScaler multiplies the loss by its scale in the backward and unscales the gradients inside
    ``optimizer.step()``: the norm, the finiteness check and clipping must see them unscaled (there: Lightning's
    ``on_before_optimizer_step``), and an overflow skips the step as the scaler does, and the learning-rate
    schedule's step with it, instead of stopping the run. (Lightning turns "16-mixed" into bf16 on a CPU; the
    plugin given here keeps a float16 scaler.)"""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def fp16(scale):
        return [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=scale))]

    full, _ = _fit_one_step([])
    scaled, _ = _fit_one_step(fp16(2.0**16))
    norms = [module.trainer.callback_metrics["train/grad_norm"].item() for module in (full, scaled)]
    assert norms[1] == pytest.approx(norms[0], rel=1e-2)  # the same step in float16 autocast, not 2**16 x larger
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        overflow, trainer = _fit_one_step(fp16(2.0**120))  # every scaled gradient overflows float16
    assert not math.isfinite(overflow.trainer.callback_metrics["train/grad_norm"].item())
    assert trainer.precision_plugin.scaler.get_scale() < 2.0**120  # the scaler saw the overflow and backed off
    # the schedule counts the steps taken: a skipped one leaves it where it was (and torch has nothing to warn of)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 0
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    initial = GRPOModule(model="tiny-llama")
    initial.configure_model()
    for p, q in zip(overflow.policy.parameters(), initial.policy.parameters(), strict=True):
        assert torch.equal(p, q)  # the step was skipped


def test_a_plain_optimizer_is_checked_and_clipped_with_a_trainer_attached():
    """grpo_step with a torch optimizer after a fit (a notebook): Lightning's hook does not run for it, so the norm
    is taken and the gradients clipped before its step, not skipped."""
    from lit_grpo.runtime.distributed import gradient_norm

    module, trainer = _fit_one_step([])
    batch = trainer.datamodule.build_train_batch()
    metrics = module.grpo_step(batch, torch.optim.SGD(module.policy.parameters(), lr=0.0))
    assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 1.0  # fresh, and above the clip
    assert gradient_norm(module.policy.parameters()) == pytest.approx(1.0, rel=1e-4)  # clipped to max_grad_norm


def test_no_gradient_is_held_through_the_next_rollout():
    """The gradients go right after the optimizer step: when the next step's rollout has been built (Lightning's
    on_train_batch_start runs after it), no parameter holds one."""
    import lightning.pytorch as pl

    held = []

    class GradientsAtStepStart(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            held.append(sum(p.grad is not None for p in pl_module.policy.parameters()))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            held.append(-sum(p.grad is not None for p in pl_module.policy.parameters()))  # they exist in the step

    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[GradientsAtStepStart()])
    trainer.fit(GRPOModule(model="tiny-llama"), RolloutDataModule(**datamodule_arguments({"val_size": 0})))
    assert held[0] == held[2] == 0 and held[1] < 0 and held[3] < 0, held


def test_the_gradient_norm_is_taken_once_and_clips_by_itself(monkeypatch):
    """One pass over the gradients for the norm: the clipping scales them by it instead of taking it again."""
    import lightning.pytorch as pl

    from lit_grpo.runtime.distributed import gradient_norm

    def refused(*args, **kwargs):
        raise AssertionError("a second gradient norm")

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", refused)
    monkeypatch.setattr(pl.LightningModule, "clip_gradients", refused)
    module, trainer = _fit_one_step([])
    assert trainer.global_step == 1 and math.isfinite(trainer.callback_metrics["train/grad_norm"].item())
    batch = trainer.datamodule.build_train_batch()
    metrics = module.grpo_step(batch, torch.optim.SGD(module.policy.parameters(), lr=0.0))
    assert metrics["train/grad_norm"] > 1.0
    assert gradient_norm(module.policy.parameters()) == pytest.approx(1.0, rel=1e-4)  # clipped to max_grad_norm


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_the_update_reads_from_the_device_a_few_times_a_step_however_many_micro_batches(batch, shared_prefix):
    """On a GPU every read of a tensor's value waits for the device: the update's reads are per step (the step's
    token count, its losses and metrics, the gradient norm), never per micro-batch."""
    from sync_helpers import HostReads

    reads = {}
    for size in (1, 4):  # 8 and 2 micro-batches
        module = make_module(train_micro_batch_size=size, shared_prefix=shared_prefix,
                             loss={"loss_type": "dapo"}, sampler_correction={"mode": "token_truncate"})
        fresh = batch.to("cpu")  # a copy: nothing read for the fixture's batch before counts here
        with HostReads() as counted:
            module.grpo_step(fresh, torch.optim.SGD(module.policy.parameters(), lr=0.0))
        reads[size] = counted.sites
    assert len(reads[1]) == len(reads[4]) <= 6, reads


def test_adamw_runs_fused_where_every_parameter_is_on_a_gpu():
    from types import SimpleNamespace

    from lit_grpo.update.module import fused_adamw

    def on(device_type, floating=True):
        return SimpleNamespace(device=torch.device(device_type), is_floating_point=lambda: floating)

    assert fused_adamw([on("cuda"), on("cuda")])
    assert not fused_adamw([on("cuda"), on("cpu")]) and not fused_adamw([on("cpu")]) and not fused_adamw([])
    assert not fused_adamw([on("cuda", floating=False)])
    assert not fused_adamw([on("cuda")], loss_scaled=True)  # 16-mixed: the norm and clipping need unscaled gradients
    optimizer = make_module().configure_optimizers()["optimizer"]
    assert not optimizer.defaults["fused"]  # on a CPU: torch's default implementation


def test_the_end_of_fit_frees_a_kept_slot_cache_and_its_graphs():
    """The policy may move after fit (``move_to_cpu_after_fit``), and a kept graph would read where its weights
    were: the datamodule's teardown frees every engine's cache."""
    import lightning.pytorch as pl

    class KeptDuringFit(pl.Callback):
        held = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.held.append(trainer.datamodule.builder.engine.slot_cache_bytes())

    module = GRPOModule(model="tiny-llama", lr=1e-3)
    data = RolloutDataModule(**datamodule_arguments({"val_size": 0, "keep_kv_cache": True}))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[KeptDuringFit()])
    trainer.fit(module, data)
    assert len(KeptDuringFit.held) == 2 and all(KeptDuringFit.held)  # kept through each update
    engine = data.builder.engine
    assert engine.rollout_index == 2 and engine.slot_cache_bytes() == 0 and engine._step is None


@pytest.mark.parametrize("move", [False, True])
def test_the_policy_and_its_optimizer_state_stay_on_their_device_after_fit_unless_asked(monkeypatch, move):
    """Lightning's strategy teardown moves the module and the optimizers' state to the CPU when fit ends (a host
    copy of weights and moments). On a CPU the move copies nothing, so what is checked is whether it is made."""
    import lightning.pytorch as pl
    import lightning.pytorch.strategies.strategy as strategy_module

    moved = {"module": 0, "optimizers": []}  # module moves; optimizers handed to each optimizer move
    module_apply, optimizers_to_device = torch.nn.Module._apply, strategy_module._optimizers_to_device

    def counted_apply(self, fn, *args, **kwargs):
        if isinstance(self, GRPOModule):
            moved["module"] += 1
        return module_apply(self, fn, *args, **kwargs)

    def counted_optimizers_to_device(optimizers, device):
        optimizers = list(optimizers)
        moved["optimizers"].append(len(optimizers))
        return optimizers_to_device(optimizers, device)

    class SeesOptimizers(pl.Callback):  # a callback checkpointing at the end of fit saves the optimizers' state
        def on_fit_end(self, trainer, pl_module):
            self.seen = len(trainer.optimizers)

    monkeypatch.setattr(strategy_module, "_optimizers_to_device", counted_optimizers_to_device)
    monkeypatch.setattr(torch.nn.Module, "_apply", counted_apply)
    sees = SeesOptimizers()
    module, trainer = _fit_one_step([], [sees], move_to_cpu_after_fit=move)
    assert trainer.global_step == 1 and sees.seen == 1
    assert "teardown" not in trainer.strategy.__dict__  # the wrapper served its one call
    moves_at_setup = 1  # the strategy's moves onto the device before training, then the teardown's to the CPU
    assert moved == ({"module": moves_at_setup + 1, "optimizers": [1, 1]} if move else
                     {"module": moves_at_setup, "optimizers": [1, 0]}), moved
    assert len(trainer.optimizers) == 1 and trainer.optimizers[0].state  # handed back, moments and all
    module.cpu()  # outside the teardown it moves as ever
    assert moved["module"] == moves_at_setup + 1 + move


@pytest.mark.parametrize("source, hint", [
    ("jsonl_path", "each row's 'answer' field; its rows' 'solution' is read as the answer with data.dataset="),
    ("dataset", "data.answer_column=None; its columns: ['prompt', 'solution']; for its 'solution' set "
                "data.answer_column: solution"),
])
def test_prompts_without_an_answer_name_a_solution_column_as_the_answer(tmp_path, source, hint):
    # TRL's accuracy_reward reads a 'solution' column; here the gold answer is 'answer' unless told
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i} + 1?", "solution": str(i + 1)}) + "\n" for i in range(3)))
    with pytest.raises(ValueError, match="score against a gold answer") as refused:
        RolloutDataModule(**{source: str(path)}, reward_funcs=["math"], val_size=0, prompts_per_step=1).setup()
    assert hint in str(refused.value)


def test_the_sharded_resume_check_keeps_no_module_alive_and_checks_only_its_own_fit(monkeypatch, tmp_path):
    """The strategy's load is wrapped at fit start to check a sharded checkpoint's param groups first; a fit that
    loads nothing leaves the wrapper on the strategy. It must not keep its module alive (a script fitting one module
    after another on a Trainer), nor, once another module is the strategy's, check that one's optimizer against the
    first module's settings."""
    import gc
    import weakref
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    import lit_grpo.update.module as module_file

    checked, loaded, compared = [], [], []
    monkeypatch.setattr(module_file, "check_sharded_param_groups",
                        lambda path, groups, weight_decay: checked.append((path, groups, weight_decay)))
    monkeypatch.setattr(module_file, "check_settings_before_load",
                        lambda path, module, trainer, **checks: compared.append((path, module.hparams.weight_decay)))

    class Strategy:  # the part of a sharded strategy (FSDP2's ModelParallelStrategy) the check uses
        restore_checkpoint_after_setup = True
        lightning_module = None

        def load_checkpoint(self, path):
            loaded.append(path)
            return {}

    def fit_start(module, strategy):
        module._trainer = SimpleNamespace(strategy=strategy, state=SimpleNamespace(fn=TrainerFn.FITTING))
        module.optimizers = lambda: SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{}, {}]))
        strategy.lightning_module = module
        module._check_sharded_resume()

    folder = str(tmp_path)
    strategy, module = Strategy(), make_module(weight_decay=0.1)
    fit_start(module, strategy)
    assert strategy.load_checkpoint(folder) == {} and checked == [(folder, 2, 0.1)] and loaded == [folder]
    assert compared == [(folder, 0.1)]  # its settings first
    assert "load_checkpoint" not in strategy.__dict__  # once: the class's own from then on
    # a fit that loads nothing, then the strategy's next module: the first is collected, the wrapper left behind
    fit_start(module, strategy)
    strategy.lightning_module, gone = SimpleNamespace(), weakref.ref(module)
    del module
    gc.collect()
    assert gone() is None, "the wrapper left on the strategy keeps its module alive"
    assert strategy.load_checkpoint(folder) == {} and checked == [(folder, 2, 0.1)] and loaded == [folder] * 2
    assert "load_checkpoint" not in strategy.__dict__
    # alive, but no longer the strategy's module: the load is the class's own, unchecked
    first = make_module(weight_decay=0.1)
    fit_start(first, strategy)
    strategy.lightning_module = make_module(weight_decay=0.0)
    assert strategy.load_checkpoint(folder) == {} and checked == [(folder, 2, 0.1)] and loaded == [folder] * 3
    assert compared == [(folder, 0.1)]


def test_the_load_wrapped_at_fit_start_compares_a_whole_files_settings_and_a_failed_load_leaves_no_mark(
        monkeypatch, tmp_path):
    """A whole file under FSDP2 (``save_distributed_checkpoint=False``) has its settings compared before the load
    too, but no sharded param groups; a load that fails after the comparison marked the file takes the mark off:
    no ``on_load_checkpoint`` follows, and a later fit of the same module loading that file is compared."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    import lit_grpo.update.module as module_file
    from lit_grpo.runtime.checkpoints import _CHECKED, mark_settings_checked

    checked, compared = [], []
    monkeypatch.setattr(module_file, "check_sharded_param_groups", lambda *args: checked.append(args))

    def compare(path, module, trainer, **checks):
        compared.append(path)
        mark_settings_checked(module, path, evaluate=False)

    monkeypatch.setattr(module_file, "check_settings_before_load", compare)

    class Strategy:  # FSDP2's ModelParallelStrategy as the wrapper sees it, its load failing (a shard unreadable)
        restore_checkpoint_after_setup = True

        def load_checkpoint(self, path):
            raise OSError(f"cannot read {path}")

    whole = str(tmp_path / "last.ckpt")
    strategy, module = Strategy(), make_module()
    module._trainer = SimpleNamespace(strategy=strategy, state=SimpleNamespace(fn=TrainerFn.FITTING))
    strategy.lightning_module = module
    module._check_sharded_resume()
    with pytest.raises(OSError, match="cannot read"):
        strategy.load_checkpoint(whole)
    assert compared == [whole] and checked == [] and not hasattr(module, _CHECKED)


@pytest.mark.parametrize("world, save_on_exception, warned", [(2, True, True), (1, True, False), (2, False, False)])
def test_a_checkpoint_saving_on_an_error_under_several_processes_is_warned_of(world, save_on_exception, warned):
    """Lightning's ModelCheckpoint(save_on_exception=True) saves in the failing rank's on_exception, whose collectives
    the other ranks do not pair: GRPOModule's fit start, which lit-grpo and a script's Trainer both pass, says so."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    module = make_module()
    checkpoint = ModelCheckpoint(save_on_exception=save_on_exception)
    module._trainer = SimpleNamespace(world_size=world, callbacks=[checkpoint], datamodule=None, max_steps=-1,
                                      val_check_interval=1.0, check_val_every_n_epoch=1,
                                      strategy=SimpleNamespace(restore_checkpoint_after_setup=False))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module.on_fit_start()
    finally:
        module._trainer = None
    said = [str(w.message) for w in caught if "save_on_exception" in str(w.message)]
    assert len(said) == warned
    if warned:
        assert said[0].startswith("ModelCheckpoint(save_on_exception=True) under 2 processes")
        assert "Set save_on_exception=False" in said[0]
