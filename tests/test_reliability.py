"""Reliability: bad inputs name the value, reward errors (raise | skip_group), no NaN losses on degenerate
rollouts, the KV memory budget (micro_group_size="auto"), and exact resume from a checkpoint (CPU, tiny model)."""

import copy
import math
import os
import warnings
from pathlib import Path

import forked_cli
import pytest
import torch

from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.update.module import GRPOModule
from lit_grpo.rollout.metrics import rollout_metrics
from lit_grpo.rollout.rewards import RewardFunctionError, WeightedReward, score_rewards
from lit_grpo.runtime.distributed import RolloutWeights
from lit_grpo.update.policy_losses import make_loss

from datamodule_helpers import PROMPTS, datamodule_arguments
from scheduler_helpers import trust_predictions

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def module():
    module = GRPOModule(model="tiny-llama", max_grad_norm=None)
    module.configure_model()
    return module


def make_datamodule(module, setup=True, **kwargs) -> RolloutDataModule:
    """A DataModule over PROMPTS; SamplingConfig's fields among ``kwargs`` go to ``sampling``."""
    dm = RolloutDataModule(**datamodule_arguments({"prompts_per_step": 3, "max_new_tokens": 6, **kwargs}))
    dm.attach(module.policy, module.tokenizer)
    if setup:
        dm.setup("fit")
    return dm


# ------------------------------------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("kwargs, match", [
    ({"group_size": 1}, r"group_size=1 must be an integer >= 2"),
    ({"group_size": 0}, r"group_size=0 must be an integer >= 2"),
    ({"micro_group_size": 0}, r"micro_group_size=0 must be an integer >= 1"),
    ({"micro_group_size": "big"}, r"micro_group_size='big' must be an integer >= 1, 'auto' or None"),
    ({"micro_group_size": "auto", "kv_budget_bytes": 0}, r"kv_budget_bytes=0 must be an integer >= 1"),
    ({"val_batch_size": 0}, r"val_batch_size=0 must be an integer >= 1"),
    ({"score_batch_size": 0}, r"score_batch_size=0 must be an integer >= 1"),
    ({"on_reward_error": "ignore"}, r"on_reward_error='ignore' is not known.*raise.*skip_group"),
    # the value's shape is refused when the module is built, before any prompt is loaded
    ({"val_size": -1}, r"val_size=-1 must be a count >= 0 or a fraction in \[0, 1\)"),
    ({"val_size": True}, r"val_size=True must be a count >= 0 or a fraction in \[0, 1\)"),
    ({"val_size": "10%"}, r"val_size='10%' must be a count >= 0 or a fraction in \[0, 1\)"),
    ({"val_size": 1.5}, r"val_size=1.5 as a fraction must be in \[0, 1\)"),
])
def test_bad_datamodule_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutDataModule(**datamodule_arguments(kwargs))


@pytest.mark.parametrize("kwargs, match", [
    ({"train_micro_batch_size": 0}, r"train_micro_batch_size=0 must be an integer >= 1"),
    ({"num_iterations": 0}, r"num_iterations=0 must be an integer >= 1"),
    ({"model": "./no/such/model"}, r"model path './no/such/model' does not exist"),
])
def test_bad_module_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOModule(**{"model": "tiny-llama", **kwargs})


def test_module_refuses_a_batch_with_one_completion_per_prompt(module, degenerate_batch):
    import dataclasses

    single = dataclasses.replace(degenerate_batch, rewards=degenerate_batch.rewards[:, :1])
    with pytest.raises(ValueError, match=r"group_size=1: GRPO training needs >= 2 completions per prompt"):
        module.grpo_step(single, torch.optim.SGD(module.policy.parameters(), lr=0.0))


def test_missing_model_path_in_the_loader_is_named(tmp_path):
    from lit_grpo.runtime.models import load_model_and_tokenizer

    with pytest.raises(ValueError, match="gone-model.*does not exist"):
        load_model_and_tokenizer(str(tmp_path / "gone-model"))


def test_tokenizer_without_eos_is_refused():
    from lit_grpo.runtime.models import prepare_tokenizer, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no EOS token"):
        prepare_tokenizer(tokenizer)


@pytest.mark.parametrize("values, match", [
    ([1.0], r"'bad' returned 1 values for 2 completions"),
    ([1.0, 2.0, 3.0], r"'bad' returned 3 values for 2 completions"),
    ([1.0, "x"], r"'bad' returned 'x' \(str\) at index 1 for prompt 'q2'"),
    ([float("nan"), 1.0], r"'bad' returned nan at index 0 for prompt 'q1'.*finite"),
    ([1.0, float("-inf")], r"'bad' returned -inf at index 1 for prompt 'q2'"),
    ([1e39, 1.0], r"'bad' returned 1e\+39 at index 0 for prompt 'q1'; values must be finite in float32"),
    (None, r"'bad' returned None, as a function without a return statement does"),
])
def test_bad_reward_values_are_named(values, match):
    def bad(prompts, completions, **kw):
        return values

    with pytest.raises(RewardFunctionError, match=match):  # the function's error, as one it raised would be
        score_rewards([WeightedReward(bad)], ["q1", "q2"], ["a", "b"])


def test_empty_or_missing_prompt_file_is_named(module, tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ValueError, match=r"missing.jsonl.*does not exist"):
        make_datamodule(module, prompts=None, jsonl_path=str(missing))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty.jsonl.*holds no prompts"):
        make_datamodule(module, prompts=None, jsonl_path=str(empty))


def test_unknown_config_key_gets_lightningcli_message(capsys, tmp_path):
    import yaml

    from lit_grpo.cli import build_cli

    with pytest.raises(SystemExit) as info:
        build_cli(["--config", TINY, "--data.no_such_key", "3"], run=False)
    assert info.value.code != 0
    assert "unrecognized arguments: --data.no_such_key 3" in capsys.readouterr().err
    config = yaml.safe_load(Path(TINY).read_text())
    config["model"]["lerning_rate"] = 0.1  # a typo in a YAML config
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as info:
        build_cli(["--config", str(bad)], run=False)
    assert info.value.code != 0
    err = capsys.readouterr().err
    assert "lerning_rate" in err, err[-2000:]


# ------------------------------------------------------------------------------------------------ reward errors
def _flaky_reward(prompts, completions, **columns):
    """Raises on the prompt about 3 + 3; rewards vary with the completion elsewhere."""
    if any("3 + 3" in p for p in prompts):
        raise KeyError("no checker for 3 + 3")
    return [len(c) / 10.0 + 0.01 * i for i, c in enumerate(completions)]


def test_reward_error_raise_names_function_and_prompt(module):
    dm = make_datamodule(module, prompts=PROMPTS[3:4] * 4, val_size=0, reward_funcs=[_flaky_reward])
    with pytest.raises(RewardFunctionError, match=r"'_flaky' raised KeyError.*no checker.*'What is 3 \+ 3\?'"):
        dm.build_train_batch()


def _length_reward_failing_at(call: int, message: str):
    """A reward of completion lengths that raises ``KeyError(message)`` on its ``call``-th call only."""
    calls = []

    def fails_once(prompts, completions, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise KeyError(message)
        return [float(len(c)) for c in completions]

    return fails_once


def test_a_failed_build_rolls_the_stream_back_and_the_retry_equals_a_first_build(module):
    """A step whose build fails (here a reward function, once) leaves the stream where it was: the retry draws
    the same prompts and completions as a DataModule that never failed."""
    failing = make_datamodule(module, reward_funcs=[_length_reward_failing_at(1, "not yet")])
    failing._require_builder()  # the builder exists; its engine is built by the first rollout
    before = failing.state_dict()
    with pytest.raises(RewardFunctionError):
        failing.build_train_batch()
    after = failing.state_dict()
    assert after["steps_built"] == before["steps_built"] == 0
    from tools.bench_faults import _tensor_differences

    assert _tensor_differences(before, after) == []
    retried = failing.build_train_batch()
    fresh = make_datamodule(module, reward_funcs=[lambda prompts, completions, **kw: [float(len(c)) for c in
                                                                                       completions]])
    first = fresh.build_train_batch()
    assert retried.indices == first.indices
    # exact: the same rollout (streams, shapes, kernels) run again in one process, and these rewards are lengths
    assert torch.equal(retried.completion_ids, first.completion_ids) and torch.equal(retried.rewards, first.rewards)


def test_a_failed_build_on_one_rank_of_two_raises_its_own_error_and_keeps_its_carried_groups(module, monkeypatch):
    """The roll-back puts this rank's engine state back as its own: read as a one-rank checkpoint under two ranks,
    its carried partial rollouts were refused, the refusal hid the reward's error and the groups were lost."""
    dm = make_datamodule(module, prompts_per_step=2, over_provision=2.0, group_size=4, micro_group_size=4,
                         strategy="continuous", max_new_tokens=12,
                         reward_funcs=[_length_reward_failing_at(2, "reward server down")])
    monkeypatch.setattr(dm, "_world", lambda: (2, 0))  # rank 0 of 2; the step's collective stood in for:
    monkeypatch.setattr(dm, "_finish_step", lambda batch: (0.5, None, 0))
    dm.build_train_batch()
    carried = dm.builder.state_dict()["carried"]
    assert carried, "the test needs groups carried into the next step"
    with pytest.raises(RewardFunctionError, match="reward server down"):
        dm.build_train_batch()
    assert dm.builder.state_dict()["carried"] == carried


def test_skip_group_trains_on_the_other_groups_only(module, recwarn):
    dm = make_datamodule(module, prompts=PROMPTS[2:7] + PROMPTS[3:4], val_size=1, prompts_per_step=5,
                         reward_funcs=[_flaky_reward],
                         on_reward_error="skip_group")
    batch = dm.build_train_batch()
    bad = [i for i, p in enumerate(batch.prompts) if "3 + 3" in p]
    assert bad, batch.prompts
    assert batch.skipped.tolist() == [i in bad for i in range(5)]
    assert batch.metrics["reward/skipped_groups"] == float(len(bad))
    assert rollout_metrics(batch)["reward/skipped_groups"] == float(len(bad))  # logged by training_step
    assert any("_flaky" in str(w.message) and "3 + 3" in str(w.message) for w in recwarn.list)
    assert torch.all(batch.advantages[bad] == 0) and torch.all(batch.rewards[bad] == 0)
    assert batch.advantages[[i for i in range(5) if i not in bad]].abs().sum() > 0
    assert torch.isnan(batch.reward_components["_flaky"][bad]).all()

    def grads(b):
        optimizer = torch.optim.SGD(module.policy.parameters(), lr=0.0)
        metrics = module.grpo_step(b, optimizer)
        return {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}, metrics

    reference, metrics = grads(batch)
    assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    # whatever the skipped group's rows hold, they carry no loss: perturb them and the gradient is unchanged
    poisoned = batch.to("cpu")
    poisoned.advantages = batch.advantages.clone()
    poisoned.advantages[bad] = 7.0
    poisoned.sampling_logprobs = batch.sampling_logprobs.clone()
    poisoned.sampling_logprobs[bad] = -3.0
    again, _ = grads(poisoned)
    for name, grad in reference.items():
        torch.testing.assert_close(again[name], grad, msg=name)
    mask = module._loss_mask(batch.micro_batch(torch.arange(batch.num_completions)))
    rows = batch.skipped.repeat_interleave(batch.group_size)
    assert mask[rows].sum() == 0 and mask[~rows].sum() > 0


def test_skip_group_stops_a_run_whose_reward_has_raised_on_every_group(module, recwarn):
    """skip_group skips bad rows; a function that has raised on every group so far is broken, and the run would
    train on nothing: the build stops. Once some group was scored, a step of bad rows only is skipped."""
    broken = make_datamodule(module, prompts=PROMPTS[3:4], val_size=0, prompts_per_step=1,
                             reward_funcs=[_flaky_reward], on_reward_error="skip_group")
    with pytest.raises(RuntimeError, match=r"a reward function has raised on every group of this run so far"):
        broken.build_train_batch()
    # under several ranks the run's count is every rank's: another rank scored a group, so this one skips
    another_rank_scored = make_datamodule(module, prompts=PROMPTS[3:4], val_size=0, prompts_per_step=1,
                                          reward_funcs=[_flaky_reward], on_reward_error="skip_group")
    builder = another_rank_scored._require_builder()

    def another_rank(tensor):  # its values in the step's gathers: no rollout abandoned ([1] flag), one group scored
        return torch.stack([tensor, torch.zeros_like(tensor) if tensor.dim() else torch.ones_like(tensor)])

    builder.world_size, builder.all_gather = 2, another_rank
    assert another_rank_scored.build_train_batch().skipped.tolist() == [True]
    calls = []

    def fails_after_the_first_call(prompts, completions, **columns):
        calls.append(1)
        if len(calls) > 1:
            raise KeyError("down")
        return [1.0] * len(completions)

    flaky = make_datamodule(module, prompts=PROMPTS[:2], val_size=0, prompts_per_step=1,
                            reward_funcs=[fails_after_the_first_call], on_reward_error="skip_group")
    assert flaky.build_train_batch().skipped.tolist() == [False]
    assert flaky.build_train_batch().skipped.tolist() == [True]  # skipped, not stopped
    resumed = make_datamodule(module, prompts=PROMPTS[:2], val_size=0, prompts_per_step=1,
                              reward_funcs=[fails_after_the_first_call], on_reward_error="skip_group")
    resumed.load_state_dict(flaky.state_dict())
    assert resumed.build_train_batch().skipped.tolist() == [True]  # the run had scored a group before its stop


def test_skip_group_in_validation_leaves_the_prompt_out(module):
    dm = make_datamodule(module, prompts=PROMPTS[:6], val_size=5, prompts_per_step=1, reward_funcs=[_flaky_reward],
                         on_reward_error="skip_group")
    with pytest.warns(UserWarning, match=r"3 \+ 3"):
        batch = dm.build_val_batch(range(len(dm.val_indices)))
    bad = [i for i, p in enumerate(batch.prompts) if "3 + 3" in p]
    assert len(bad) == 1 and batch.skipped.tolist() == [i in bad for i in range(len(batch.prompts))]
    expected = sum(float(batch.rewards[i].mean()) for i in range(5) if i not in bad) / 4
    module.held_out.reward.reset()
    module.log = lambda *args, **kwargs: None  # no trainer here
    try:
        module.validation_step(batch)
    finally:
        del module.log
    assert float(module.held_out.reward.compute()) == pytest.approx(expected)
    module.held_out.reward.reset()


def test_skip_group_on_the_whole_batch_still_raises():
    def always(prompts, completions, **columns):
        raise RuntimeError("service down")

    scores = score_rewards([WeightedReward(always)], ["a", "a", "b", "b"], ["1", "2", "3", "4"], group_size=2,
                           on_error="skip_group")
    assert scores.skipped_groups == [0, 1] and scores.total.tolist() == [0.0] * 4

    def batch_only(prompts, completions, **columns):
        if len(prompts) > 2:
            raise RuntimeError("batch too big")
        return [1.0] * len(prompts)

    with pytest.raises(RewardFunctionError, match="on the whole batch"):
        score_rewards([WeightedReward(batch_only)], ["a", "a", "b", "b"], ["1", "2", "3", "4"], group_size=2,
                      on_error="skip_group")


# ------------------------------------------------------------------------------------------------ no NaN losses
@pytest.fixture(scope="module")
def degenerate_batch(module):
    """Every completion truncated at the cap and every group's rewards identical."""
    def constant(prompts, completions, **columns):
        return [1.0] * len(prompts)

    dm = make_datamodule(module, max_new_tokens=3, reward_funcs=[constant])
    batch = dm.build_train_batch()
    batch.truncated = torch.ones_like(batch.truncated)
    assert torch.all(batch.advantages == 0)
    return batch


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("mask_truncated", [True, False])
def test_degenerate_rollouts_never_give_nan(module, degenerate_batch, loss_type, mask_truncated):
    module.loss_fn = make_loss(loss_type)
    module.hparams.mask_truncated_completions = mask_truncated
    try:
        before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
        metrics = module.grpo_step(degenerate_batch, torch.optim.SGD(module.policy.parameters(), lr=1e-2))
    finally:
        module.loss_fn, module.hparams.mask_truncated_completions = make_loss("dapo"), False
    for key, value in metrics.items():
        assert math.isfinite(value), (key, value)
    # exact in any summation order: every advantage is 0, so every term of the loss and its gradient is 0
    assert metrics["train/loss"] == 0.0
    for name, param in module.policy.named_parameters():  # zero advantages, zero gradient: SGD moves nothing
        assert torch.equal(param, before[name]), name


def test_nan_loss_stops_training_and_keeps_the_weights(module, degenerate_batch):
    bad = degenerate_batch.to("cpu")
    bad.advantages = torch.full_like(bad.advantages, float("nan"))
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    optimizer = torch.optim.AdamW(module.policy.parameters(), lr=1e-2)
    with pytest.raises(FloatingPointError, match="non-finite GRPO loss.*this optimizer step was not taken: "
                                                 "the weights are the last step's"):
        module.grpo_step(bad, optimizer)
    for name, param in module.policy.named_parameters():
        assert torch.equal(param, before[name]), name
    assert not optimizer.state


# ------------------------------------------------------------------------------------------------ memory budget
def test_kv_bytes_per_token_from_the_config(module):
    from lit_grpo.sampling.memory_budget import (auto_micro_group_size, kv_bytes_per_token, kv_held_bytes,
                                                 kv_prefill_bytes, kv_slot_bytes)

    config = module.policy.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    expected = 2 * config.num_hidden_layers * kv_heads * head_dim * 4
    assert kv_bytes_per_token(config, torch.float32) == expected
    assert kv_bytes_per_token(config, "bfloat16") == expected // 2
    slot = kv_slot_bytes(config, torch.float32, 10, 6)
    assert slot == expected * 16
    # besides the slots: 2 prompts' prefixes of 10 positions, and with unbudgeted parking 4 samples each x 3 tokens
    held = kv_held_bytes(config, torch.float32, 10, group_size=4, num_prompts=2)
    parked = kv_held_bytes(config, torch.float32, 10, group_size=4, num_prompts=2, parked_tokens=3)
    assert (held, parked) == (expected * 20, expected * 44)
    # for a moment, a prefill: one layer of the prompts' chunk (2 x 10 positions), or a carried sample's prompt and
    # tokens again (10 + 6) and one layer of its 6 tokens
    layer = expected // config.num_hidden_layers
    assert kv_prefill_bytes(config, torch.float32, 10, 2, 6) == layer * 20
    assert kv_prefill_bytes(config, torch.float32, 10, 2, 6, carried=True) == expected * 16 + layer * 6
    assert kv_prefill_bytes(config, torch.float32, 10, 500, 6) == layer * 1024  # one chunk's positions at most
    held += layer * 20
    assert auto_micro_group_size(config, torch.float32, held + 5 * slot + slot // 2, 10, 6, group_size=4,
                                 num_prompts=2) == 5
    assert auto_micro_group_size(config, torch.float32, held + 5 * slot, 10, 6, 4, 2, parked_tokens=3) == 3
    assert auto_micro_group_size(config, torch.float32, held + slot, 10, 6, 4, 2) == 1
    assert auto_micro_group_size(config, torch.float32, 10**12, 10, 6, 4, 2) == 8  # capped at B x G
    # a row's state besides its KV (a repetition penalty's seen ids) is part of each slot's price
    assert auto_micro_group_size(config, torch.float32, held + 5 * slot, 10, 6, 4, 2, row_state_bytes=1) == 4
    with pytest.raises(ValueError, match=rf"smaller than one slot's KV cache, {slot + 7} bytes .* \+ 7 bytes of its "
                                         rf"row's seen ids\), plus the {held} bytes"):
        auto_micro_group_size(config, torch.float32, held + slot, 10, 6, 4, 2, row_state_bytes=7)
    with pytest.raises(ValueError, match=rf"kv_budget_bytes={held + slot - 1} is smaller than one slot's KV cache, "
                                         rf"{slot} bytes .* plus the {held} bytes held besides the slots "
                                         rf"\(2 prompts' prefixes and a prefill's moment\); raise kv_budget_bytes "
                                         rf"to at least {held + slot}"):
        auto_micro_group_size(config, torch.float32, held + slot - 1, 10, 6, 4, 2)


def test_auto_micro_group_size_in_the_datamodule(module):
    from lit_grpo.sampling.memory_budget import kv_held_bytes, kv_prefill_bytes, kv_slot_bytes

    probe = make_datamodule(module)
    longest = max(len(ids) for ids in probe.train_prompt_ids)
    config = module.policy.config
    slot = kv_slot_bytes(config, torch.float32, longest, 6)
    sampling = probe.sampling
    parked = sampling.scheduler.parked_kv_bounds(sampling.max_new_tokens) if sampling.strategy == "infinite" else (0, 0)
    # "continuous" (or "infinite" with no preemption point below the 6-token cap): no sample parks, no KV aside
    assert sampling.max_new_tokens == 6 and parked == (0, 0)
    held = kv_held_bytes(config, torch.float32, longest, sampling.group_size, probe.training.prompts_per_step) + \
        kv_prefill_bytes(config, torch.float32, longest, probe.training.prompts_per_step, sampling.max_new_tokens)
    dm = make_datamodule(module, micro_group_size="auto", kv_budget_bytes=held + 3 * slot + 1)
    batch = dm.build_train_batch()
    assert dm.resolved_micro_group_size == 3 and dm.engine.micro_group_size == 3
    assert batch.metrics["rollout/slots"] == 3.0
    assert rollout_metrics(batch)["rollout/slots"] == 3.0  # logged by training_step
    assert batch.stats.peak_kv_bytes <= held + 3 * slot
    small = make_datamodule(module, micro_group_size="auto", kv_budget_bytes=slot // 2)
    with pytest.raises(ValueError, match=rf"kv_budget_bytes={slot // 2} is smaller.*{slot} bytes"):
        small.build_train_batch()


def test_auto_prices_a_slot_at_its_rows_aligned_width_where_the_engine_aligns_them(module):
    """On CUDA, or compiled, every row of the slot cache is rounded up to a multiple of WIDTH_ALIGNMENT: a short
    prompt and completion then take far more than prompt + new tokens, and the budget counts what is allocated."""
    from lit_grpo.sampling.engine import WIDTH_ALIGNMENT
    from lit_grpo.sampling.memory_budget import (kv_bytes_per_token, kv_held_bytes, kv_prefill_bytes, kv_slot_bytes,
                                                 slot_positions)

    assert (slot_positions(40, 40), slot_positions(40, 40, 64), slot_positions(1000, 3000, 64)) == (80, 128, 4032)
    assert slot_positions(30, 34, 64) == 64  # exactly aligned: the plain count, prompt + new tokens
    probe = make_datamodule(module)
    longest = max(len(ids) for ids in probe.train_prompt_ids)
    config = module.policy.config
    aligned = kv_slot_bytes(config, torch.float32, longest, 6, WIDTH_ALIGNMENT)
    assert aligned == kv_bytes_per_token(config, torch.float32) * WIDTH_ALIGNMENT > kv_slot_bytes(
        config, torch.float32, longest, 6)
    sampling = probe.sampling
    held = kv_held_bytes(config, torch.float32, longest, sampling.group_size, probe.training.prompts_per_step) + \
        kv_prefill_bytes(config, torch.float32, longest, probe.training.prompts_per_step, sampling.max_new_tokens)
    budget = held + 3 * aligned + 1  # three aligned slots and what is held besides them, not four
    slots = {compiled: make_datamodule(module, micro_group_size="auto", kv_budget_bytes=budget,
                                       compile=compiled).resolved_micro_group_size for compiled in (False, True)}
    assert slots[True] == 3 < slots[False]


def test_a_slot_prices_what_its_row_holds_and_a_long_prompt_its_whole_prefill(module):
    """A row is prompt - 1 + new tokens wide (the last token is never fed back): one position past an aligned width
    is priced at prompt + new tokens, not at the next multiple. A prompt longer than a prefill chunk is prefilled
    whole: its one layer counts all its positions."""
    from lit_grpo.sampling.memory_budget import kv_bytes_per_token, kv_prefill_bytes, slot_positions
    from lit_grpo.sampling.prefill import PREFILL_CHUNK_TOKENS

    assert slot_positions(31, 34, 64) == 65  # a row of 64 columns, aligned already
    config = module.policy.config
    layer = kv_bytes_per_token(config, torch.float32) // config.num_hidden_layers
    longest = PREFILL_CHUNK_TOKENS + 976
    assert kv_prefill_bytes(config, torch.float32, longest, 2, 6) == layer * longest


def test_a_slots_parked_share_is_priced_rounded_up(module):
    import math

    from lit_grpo.sampling.memory_budget import (auto_micro_group_size, kv_bytes_per_token, kv_held_bytes,
                                                 kv_prefill_bytes, kv_slot_bytes)

    config = module.policy.config
    share = kv_bytes_per_token(config, torch.float32) * 6 * 0.3  # 0.3 of a slot's 6 new tokens, parked
    assert share != int(share)  # the test needs a fraction of a byte to round
    slot = kv_slot_bytes(config, torch.float32, 10, 6) + math.ceil(share)
    held = kv_held_bytes(config, torch.float32, 10, 4, 2) + kv_prefill_bytes(config, torch.float32, 10, 2, 6)
    assert auto_micro_group_size(config, torch.float32, held + 3 * slot, 10, 6, 4, 2, park_fraction=0.3) == 3
    assert auto_micro_group_size(config, torch.float32, held + 3 * slot - 1, 10, 6, 4, 2, park_fraction=0.3) == 2


def test_a_kept_cache_fits_when_the_update_peak_and_it_leave_the_margin():
    from lit_grpo.sampling.memory_budget import kv_cache_fits_beside_update

    assert kv_cache_fits_beside_update(6_000, 3_000, 10_000, 1_000)
    assert not kv_cache_fits_beside_update(6_001, 3_000, 10_000, 1_000)
    with pytest.raises(ValueError, match=r"kept_bytes=-1 must be an integer >= 0"):
        kv_cache_fits_beside_update(0, -1, 10, 0)


def test_a_decode_steps_activations_are_priced_from_the_shapes():
    """Fake shapes: per slot, the logits' bytes, one layer's activations (its MLP, residual, query, key and value)
    and its attention over the width (float32 scores and probabilities, and probabilities in the dtype)."""
    from types import SimpleNamespace

    from lit_grpo.sampling.memory_budget import STEP_BYTES_PER_LOGIT, decode_step_bytes

    config = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             hidden_size=32, intermediate_size=64)
    layer = 2 * (3 * 64 + 4 * 32 + (4 + 2 * 2) * 8) + 4 * 16 * (8 + 2)
    assert decode_step_bytes(config, torch.bfloat16, 3, 16, 100) == 3 * (100 * STEP_BYTES_PER_LOGIT + layer)
    assert decode_step_bytes(config, torch.bfloat16, 6, 16, 100) == 2 * decode_step_bytes(config, "bfloat16", 3, 16,
                                                                                            100)
    wider = decode_step_bytes(config, torch.float32, 1, 32, 100) - decode_step_bytes(config, torch.float32, 1, 16, 100)
    assert wider == 4 * 16 * (8 + 4)
    del config.intermediate_size  # 4 x hidden where the config has none
    assert decode_step_bytes(config, torch.bfloat16, 3, 16, 100) == 3 * (100 * STEP_BYTES_PER_LOGIT + layer
                                                                         + 2 * 3 * (4 * 32 - 64))
    with pytest.raises(ValueError, match=r"slots=0 must be an integer >= 1"):
        decode_step_bytes(config, torch.float32, 0, 16, 100)


def test_weight_casts_take_a_pool_block_each_where_larger_than_every_cast_before():
    """A step's casts, each freed before the next: a later cast no larger takes a freed block, a larger one a block
    of its own (query 8, keys and values 4, output 8, the MLP's 24 each, a layer again, then the head's 594)."""
    from lit_grpo.sampling.memory_budget import cast_pool_bytes

    layer = [8, 4, 4, 8, 24, 24, 24]
    assert cast_pool_bytes(layer + layer + [594]) == 8 + 24 + 594
    assert cast_pool_bytes([]) == cast_pool_bytes([0, 0]) == 0
    assert cast_pool_bytes([594, *layer]) == 594
    with pytest.raises(ValueError, match=r"cast_sizes\[1\]=-4 must be an integer >= 0"):
        cast_pool_bytes([8, -4])


def test_the_weight_casts_of_a_step_are_the_linears_autocast_casts(tiny_llama):
    """Under autocast every linear weight not in its dtype, in the modules' order (one entry per linear, 0 for
    one already in it); nothing without autocast; a float32 head casts only a weight narrower than float32."""
    from lit_grpo.runtime.distributed import CastWeights
    from lit_grpo.runtime.head_precision import cast_lm_head_to_fp32
    from lit_grpo.sampling.decode_step import weight_cast_sizes

    model, _ = tiny_llama
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert weight_cast_sizes(model, "cpu") == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert weight_cast_sizes(model, "cpu") == [m.weight.numel() * 2 for m in linears]
        assert weight_cast_sizes(CastWeights(model, torch.bfloat16).module, "cpu") == [0] * len(linears)
    head = copy.deepcopy(model)
    cast_lm_head_to_fp32(head)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert weight_cast_sizes(head, "cpu")[-1] == 0
    head.get_output_embeddings().weight.data = head.get_output_embeddings().weight.data.bfloat16()
    assert weight_cast_sizes(head, "cpu") == [linears[-1].weight.numel() * 4]


def test_a_kept_graphs_pool_is_priced_at_the_cache_it_captured_or_the_widest(tiny_llama, prompt_ids):
    """No graph, no pool kept (an eager step's activations are freed after it); a captured one keeps the step's
    activations at the cache's slots and width, or at the widest cache's."""
    from lit_grpo.sampling import RolloutEngine
    from lit_grpo.sampling.decode_step import vocab_size
    from lit_grpo.sampling.engine import WIDTH_ALIGNMENT
    from lit_grpo.sampling.memory_budget import decode_step_bytes

    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, strategy="continuous",
                           max_new_tokens=4, seed=0)
    engine.generate(prompt_ids)
    assert engine._step is not None and not engine._step.graphs and engine.graph_pool_bytes() == 0
    engine._step.graphs[engine._cache.width] = object()  # what a capture on CUDA leaves
    cache, vocab = engine._cache, vocab_size(model)
    assert engine.graph_pool_bytes() == decode_step_bytes(model.config, torch.float32, 2, cache.width, vocab)
    widest = -(-(20 - 1 + 4) // WIDTH_ALIGNMENT) * WIDTH_ALIGNMENT
    assert engine.graph_pool_bytes(5, 20) == decode_step_bytes(model.config, torch.float32, 2, widest, vocab)
    engine.release()
    assert engine.graph_pool_bytes() == 0


def test_a_kv_budget_from_free_memory_is_what_is_left_after_the_reserve_and_the_margin():
    from lit_grpo.sampling.memory_budget import kv_budget_from_free_memory

    assert kv_budget_from_free_memory(10_000, 3_000, 1_000) == 6_000
    assert kv_budget_from_free_memory(10_000, 0, 0) == 10_000
    with pytest.raises(ValueError, match=r"free_bytes=10000 - reserved_bytes=9000 .* - margin_bytes=1000 = 0, but "
                                         r"micro_group_size: auto needs a budget >= 1 byte; set "
                                         r"sampling.kv_budget_bytes"):
        kv_budget_from_free_memory(10_000, 9_000, 1_000)
    for name, args in [("free_bytes", (-1, 0, 0)), ("reserved_bytes", (10, -5, 0)), ("margin_bytes", (10, 0, 2.5))]:
        with pytest.raises(ValueError, match=rf"{name}=(-1|-5|2.5) must be an integer >= 0"):
            kv_budget_from_free_memory(*args)


def test_auto_without_a_budget_on_a_cpu_says_what_to_set_when_the_policy_arrives(module):
    """The config is accepted (on CUDA the device's free memory is the budget); the policy's device is known at
    attach, before any validation or rollout runs: a ConfigError, which lit-grpo prints as one line. "full" gives
    every sample its row: nothing to size."""
    from lit_grpo.runtime.validation import ConfigError

    with pytest.raises(ConfigError, match=r"micro_group_size='auto' without kv_budget_bytes sizes the KV cache from "
                                         r"the GPU's free memory, but the policy is on 'cpu': set "
                                         r"sampling.kv_budget_bytes \(bytes, an integer >= 1\)"):
        make_datamodule(module, micro_group_size="auto")
    dm = make_datamodule(module, micro_group_size="auto", strategy="full")
    assert dm.build_train_batch().stats.peak_kv_bytes > 0 and dm.resolved_micro_group_size is None


def test_validation_alone_sizes_no_training_slots(module):
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    dm = RolloutDataModule(**datamodule_arguments({"prompts_per_step": 3, "micro_group_size": "auto"}))
    dm.trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.VALIDATING))
    dm.attach(module.policy, module.tokenizer)  # trainer.validate on a CPU: accepted
    dm.trainer.state.fn = TrainerFn.FITTING
    with pytest.raises(ValueError, match=r"micro_group_size='auto' without kv_budget_bytes"):
        dm.attach(module.policy, module.tokenizer)


def test_auto_micro_group_size_prices_the_cache_in_the_dtype_it_stores(module):
    """Under bf16 autocast with float32 weights the cache holds bf16 keys and values: ``auto`` fits the slots of a
    bf16 cache in the budget (pricing them in float32 would pick half as many)."""
    from lit_grpo.sampling.memory_budget import auto_micro_group_size, kv_held_bytes, kv_prefill_bytes, kv_slot_bytes

    probe = make_datamodule(module)
    longest = max(len(ids) for ids in probe.train_prompt_ids)
    config, sampling = module.policy.config, probe.sampling
    args = (longest, sampling.max_new_tokens, sampling.group_size, probe.training.prompts_per_step)
    budget = kv_held_bytes(config, torch.bfloat16, longest, sampling.group_size, probe.training.prompts_per_step) + \
        kv_prefill_bytes(config, torch.bfloat16, longest, probe.training.prompts_per_step, sampling.max_new_tokens) + \
        6 * kv_slot_bytes(config, torch.bfloat16, longest, sampling.max_new_tokens)
    assert auto_micro_group_size(config, torch.bfloat16, budget, *args) == 6
    assert auto_micro_group_size(config, torch.float32, budget, *args) < 6
    dm = RolloutDataModule(**datamodule_arguments({"prompts_per_step": 3, "max_new_tokens": 6,
                                                    "micro_group_size": "auto", "kv_budget_bytes": budget}))
    dm.attach(module.policy, module.tokenizer, precision_context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    dm.setup("fit")
    batch = dm.build_train_batch()
    assert dm.resolved_micro_group_size == 6 and batch.metrics["rollout/slots"] == 6.0
    assert batch.stats.peak_kv_bytes <= budget


@pytest.mark.parametrize("strategy,scheduler,bounds", [
    ("continuous", {}, (0, 0.0)),
    ("infinite", {}, (0, 0.5)),  # the default: preemption within half the slots' generation KV
    ("infinite", {"park_budget": None}, (8, 0.0)),  # unbudgeted: each sample up to its last point
    ("infinite", {"length_aware": {"predictor": "online"}}, (8, 0.5))])  # and the probes' first tokens
def test_a_rollout_under_an_auto_micro_group_size_keeps_its_kv_within_the_budget(strategy, scheduler, bounds):
    # long prompts and short completions: the prompts' prefixes outweigh the slots, which the budget must count
    from lit_grpo.runtime.models import load_model_and_tokenizer
    from lit_grpo.sampling import RolloutEngine, SamplingConfig
    from lit_grpo.sampling.memory_budget import (auto_micro_group_size, kv_bytes_per_token, kv_held_bytes,
                                                 kv_prefill_bytes, kv_slot_bytes)

    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    prompts = [[5 + i] * 60 for i in range(8)]
    sampling = SamplingConfig(group_size=4, strategy=strategy, max_new_tokens=16, scheduler=scheduler)
    # what parked samples may hold: a share of each slot within the park budget, else up to the last point each
    parked_tokens, park_share = sampling.scheduler.parked_kv_bounds(16) if strategy == "infinite" else (0, 0.0)
    assert (parked_tokens, park_share) == bounds
    slot = kv_slot_bytes(model.config, torch.float32, 60, 16) + math.ceil(
        kv_bytes_per_token(model.config, torch.float32) * 16 * park_share)
    budget = 6 * slot + kv_held_bytes(model.config, torch.float32, 60, 4, len(prompts), parked_tokens) + \
        kv_prefill_bytes(model.config, torch.float32, 60, len(prompts), 16)  # one layer of the prompts' chunk
    g = auto_micro_group_size(model.config, torch.float32, budget, 60, 16, 4, len(prompts), parked_tokens, park_share)
    assert g == 6
    engine = RolloutEngine(model, tokenizer, sampling.replace(micro_group_size=g))
    if "length_aware" in scheduler:
        trust_predictions(engine.scheduler)  # so that it parks samples after their probe, holding their KV
    # two rollouts: the default preempts (parks samples, holding their KV) once it has seen finished groups
    stats = [engine.generate(prompts).stats for _ in range(2)]
    assert stats[-1].parked_samples > 0 if strategy == "infinite" else stats[-1].parked_samples == 0
    assert stats[-1].parked_kv_bytes > 0 if strategy == "infinite" else stats[-1].parked_kv_bytes == 0
    for rollout in stats:
        assert 0 < rollout.peak_kv_bytes <= budget


# ------------------------------------------------------------------------------------------------ exact resume
def _fit(tmp_path, name, *extra):
    root = tmp_path / name
    argv = ["fit", "--config", TINY, "--trainer.default_root_dir", str(root), "--trainer.max_steps", "3",
            "--trainer.callbacks+=tools.step_recorder.StepRecorder", f"--trainer.callbacks.path={root / 'rec'}",
            *extra]
    proc = forked_cli.run(argv, tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return str(root / "rec"), proc


def test_exact_resume_mid_epoch(tmp_path):
    """Stop after step 1 (mid-epoch: tiny.yaml has 2 steps per epoch, infinite strategy whose gate learns from
    finished groups), resume with --ckpt_path: steps 2 and 3 (the second epoch's first) have the same prompts,
    completions, rewards, losses and weights."""
    from tools.step_recorder import read_records

    full, _ = _fit(tmp_path, "full", "--trainer.callbacks+=ModelCheckpoint",
                   f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=1",
                   "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}")
    ckpt = tmp_path / "ckpt" / "step=1.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    data_state = state["RolloutDataModule"]
    assert {"steps_built", "sampler", "engine", "rng"} <= set(data_state) and data_state["steps_built"] == 1
    assert data_state["engine"]["rollout_index"] == 1
    assert data_state["engine"]["scheduler"]["groups"]  # the default scheduler's gate state: step 1's finished groups
    resumed, proc = _fit(tmp_path, "resumed", "--ckpt_path", str(ckpt))
    assert "not resumable" not in proc.stderr
    a, b = read_records(full), read_records(resumed)
    assert [r["global_step"] for r in a] == [1, 2, 3] and [r["global_step"] for r in b] == [2, 3]
    for x, y in zip(a[1:], b):
        for key in ("indices", "completion_ids", "rewards", "advantages", "loss", "param_sum", "param_abs"):
            assert x[key] == y[key], (x["global_step"], key)


def test_exact_resume_with_carried_samples(tmp_path):
    """Partial rollouts: the groups carried past step 1 are in the checkpoint, and a resumed run continues them
    exactly as the uninterrupted one did."""
    from tools.step_recorder import read_records

    # Longer completions, so that some end early (EOS) and the rollout stops with samples part-way through.
    partial = ("--data.over_provision", "2.0", "--data.max_staleness", "1", "--data.sampling.micro_group_size", "6",
               "--data.sampling.max_new_tokens", "48")
    full, _ = _fit(tmp_path, "full", *partial, "--trainer.callbacks+=ModelCheckpoint",
                   f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=1",
                   "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}")
    ckpt = tmp_path / "ckpt" / "step=1.ckpt"
    carried = torch.load(ckpt, map_location="cpu", weights_only=True)["RolloutDataModule"]["engine"]["carried"]
    assert carried and any(not s["done"] and s["tokens"] for group in carried for s in group["samples"])
    resumed, _ = _fit(tmp_path, "resumed", *partial, "--ckpt_path", str(ckpt))
    a, b = read_records(full), read_records(resumed)
    assert [r["global_step"] for r in b] == [2, 3]
    for x, y in zip(a[1:], b):
        for key in ("indices", "completion_ids", "rewards", "advantages", "loss", "param_sum", "param_abs"):
            assert x[key] == y[key], (x["global_step"], key)


def test_starting_the_loaders_draws_nothing_from_the_global_random_state(module):
    """A resumed run starts its epoch's loader after the checkpoint's random states are back, where the uninterrupted
    run started it before they were saved: a seed drawn from the global state there shifted every later draw (the
    update's dropout: a resume with LoRA's dropout on went on with other weights)."""
    dm = make_datamodule(module, val_size=2)
    before = torch.get_rng_state()
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        assert next(iter(loader)) is not None
    assert torch.equal(torch.get_rng_state(), before)


def test_lightning_sizes_the_loaders_without_a_warning_of_them_and_the_users_own_warnings_stay(module):
    """What Lightning warned of in a plain fit, of the loaders alone: the train stream's length (an IterableDataset
    with one), and no validation loader with val_size 0 (on purpose: no held-out prompt). The same deprecation
    raised by the user's own code still shows."""
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.utilities.data import has_len_all_ranks

    strategy = SingleDeviceStrategy(torch.device("cpu"))
    dm = make_datamodule(module, val_size=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train, val = dm.train_dataloader(), dm.val_dataloader()
        assert has_len_all_ranks(train, strategy) and len(train) == dm.num_train_steps_per_epoch()
        assert len(val) == 0 and list(val) == [] and has_len_all_ranks(val, strategy)
        assert [str(w.message) for w in caught] == []
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning)
        # the user's own empty loader, sized by Lightning in the same module as lit_grpo's
        assert has_len_all_ranks([], strategy)
    assert [str(w.message) for w in caught] == ["`isinstance(treespec, LeafSpec)` is deprecated",
                                                "Total length of `list` across ranks is zero. "
                                                "Please make sure this was your intention."]


def test_lightnings_gather_for_lit_grpo_says_nothing_of_torchs_deprecated_gather_and_a_users_own_call_does():
    """Lightning's ``all_gather`` runs torch's deprecated autograd gather: in lit_grpo's gathers (the update's, the
    callbacks') that is not shown, as nothing a user can act on; a user's own call of it still warns."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available
    from torch.distributed.nn.functional import all_gather as users_own_gather

    from lit_grpo.runtime.distributed import strategy_all_gather

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        strategy = SimpleNamespace(root_device=torch.device("cpu"), all_gather=_all_gather_ddp_if_available)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert strategy_all_gather(strategy)(torch.tensor([1.0, 2.0])).tolist() == [[1.0, 2.0]]
            assert [str(w.message) for w in caught] == []
            with pytest.warns(FutureWarning, match="all_gather is deprecated"):
                users_own_gather(torch.tensor([1.0]))
    finally:
        dist.destroy_process_group()


def test_the_saved_random_states_hold_the_cuda_devices_where_cuda_is_in_use(monkeypatch):
    """A GPU update's dropout draws from the current CUDA device's generator: it is saved beside the CPU's and set back
    (CUDA faked here: a CPU has none; tests/test_cuda_update.py round-trips the real one)."""
    from lit_grpo.datamodules.random_state import get_rng_states, set_rng_states

    assert "cuda" not in get_rng_states()  # no CUDA in use: nothing of it saved
    device_state = [torch.arange(16, dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: device_state[0].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: device_state.__setitem__(0, state.clone()))
    saved = get_rng_states()
    device_state[0] = torch.zeros(16, dtype=torch.uint8)  # the generator moved on
    set_rng_states({**saved, "cuda": saved["cuda"].tolist()})  # as a checkpoint may hold it
    assert torch.equal(device_state[0], torch.arange(16, dtype=torch.uint8))


def test_the_same_hand_over_from_another_trainer_lends_its_precision_and_gather(module):
    """A second attach of the same policy (a bf16-mixed ``validate`` after a 32-bit fit) keeps the builder, with
    its engines and caches, and gives it the new trainer's precision context and gather."""
    dm = make_datamodule(module)
    dm.attach(module.policy, module.tokenizer)
    builder = dm._require_builder()
    bf16, gather = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)), (lambda tensor: tensor[None])
    dm.attach(module.policy, module.tokenizer, precision_context=bf16, all_gather=gather)
    assert dm._require_builder() is builder
    assert builder.precision_context is bf16 and builder.all_gather is gather


def test_the_datamodule_says_the_auto_budget_and_the_cache_keeping_once(module, monkeypatch):
    from lit_grpo.datamodules import rollout as datamodule_module
    from lit_grpo.rollout import slot_memory as slot_memory_module

    monkeypatch.setattr(slot_memory_module, "device_memory", lambda device: (10**10, 10**10))
    said = []
    monkeypatch.setattr(datamodule_module, "rank_zero_info", said.append)
    dm = make_datamodule(module, setup=False, micro_group_size="auto")
    dm.attach(module.policy, module.tokenizer, rollout_weights=RolloutWeights(module.policy),
              measured_update_peak=lambda: 10**9)  # an update's peak as if measured
    dm.setup("fit")
    for _ in range(3):
        dm.build_train_batch()
    slots = dm.resolved_micro_group_size
    assert said[0].startswith(f"lit_grpo: micro_group_size: auto -> {slots} slots under a KV budget of ")
    assert "free" in said[0]
    keeping = said[1:]  # from the second step on, each time the decision changes (a batch wider than any measured)
    assert keeping and all(line.startswith("lit_grpo: keep_kv_cache: auto -> the slot cache is ") for line in keeping)
    assert all(("kept through" in a) != ("kept through" in b) for a, b in zip(keeping, keeping[1:])), said
    assert any("kept through the update: the update's peak 953.7 MiB (rows up to " in line for line in keeping) or \
        "wider than any update measured" in keeping[0], said
