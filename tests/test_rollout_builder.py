"""RolloutBuilder on its own (no Lightning), and the typed sampling / scheduler options in configs."""

import functools

import pytest
import torch

from lit_grpo.cli import build_cli
from lit_grpo.rollout.prompts import PromptExample
from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.runtime.distributed import CastWeights
from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.rollout.rewards import build_reward_funcs
from lit_grpo.rollout.builder import Prompt, RolloutBuilder
from lit_grpo.rollout.config import AdvantageConfig, ScoringConfig, TrainingConfig, ValidationConfig
from lit_grpo.sampling import SamplingConfig
from lit_grpo.sampling.decode_step import vocab_size
from lit_grpo.scheduling import LeastAttainedScheduler
from lit_grpo.scheduling.config import InfiniteSchedulerConfig, LengthAwareConfig
from lit_grpo.scheduling.length_aware import LengthAwareScheduler, OnlineLengthPredictor

TINY = "configs/tiny.yaml"


@pytest.fixture(scope="module")
def policy():
    return load_model_and_tokenizer("tiny-llama")


def _prompts(tokenizer, count, start=0):
    return [Prompt(index=start + i, example=PromptExample(f"What is {i} + {i}?", str(2 * i)),
                   ids=tokenizer(f"What is {i} + {i}?")["input_ids"]) for i in range(count)]


def test_builder_turns_prompts_into_a_scored_batch_without_lightning(policy):
    model, tokenizer = policy
    pool = _prompts(tokenizer, 10)
    drawn = []

    def draw(count):
        drawn.append(count)
        return [pool.pop(0) for _ in range(count)]

    sampling = SamplingConfig(group_size=4, micro_group_size=3, strategy="continuous", max_new_tokens=6, seed=1)
    model.train()
    builder = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["char_fraction", "accuracy"]),
                             advantage=AdvantageConfig(scale_rewards="group"),
                             training=TrainingConfig(prompts_per_step=2))
    batch = builder.build_train(draw)
    assert drawn == [2] and batch.rewards.shape == (2, 4) and batch.indices == [0, 1]
    assert torch.equal(batch.accuracy, batch.reward_components["accuracy"])
    centred = batch.advantages.sum(dim=1)
    assert torch.allclose(centred, torch.zeros_like(centred), atol=1e-5)  # group-normalised advantages
    assert builder.engine._cache is None  # keep_kv_cache=False: the update gets the KV memory back
    assert model.training  # generation mode restored the policy's mode
    val = builder.build_val(_prompts(tokenizer, 3, start=20))
    assert val.group_size == 1 and val.split == "val" and not val.advantages.any()


def test_a_rollout_leaves_each_module_of_the_policy_in_the_mode_it_found_it_in(policy):
    """A part its owner keeps in eval (a frozen tower, a head) stays in eval after the builder's rollout, as after
    the engine's (``runtime.models.eval_mode``): ``policy.train(was_training)`` would turn it on again."""
    model, tokenizer = policy
    sampling = SamplingConfig(group_size=2, micro_group_size=2, max_new_tokens=3, seed=0)
    builder = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["accuracy"]),
                             training=TrainingConfig(prompts_per_step=1))
    model.train()
    model.lm_head.eval()
    try:
        builder.build_train(lambda count: _prompts(tokenizer, count))
        assert model.training and model.model.training and not model.lm_head.training
    finally:
        model.train()


def test_validation_engines_run_their_step_as_the_training_engine_does(policy):
    model, tokenizer = policy
    options = dict(cuda_graph=False, compile=True, cpu_linear="torch", decode_attention="sdpa_gqa")
    sampling = SamplingConfig(group_size=4, micro_group_size=2, max_new_tokens=6, repetition_penalty=1.2, **options)
    builder = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["accuracy"]),
                             training=TrainingConfig(prompts_per_step=1),
                             validation=ValidationConfig(val_num_samples=3, val_temperature=0.7))
    for engine in (builder.engine, builder.val_engine, builder.val_sampled_engine):
        assert {key: getattr(engine.config, key) for key in options} == options
    assert (builder.val_engine.config.temperature, builder.val_sampled_engine.config.temperature) == (0.0, 0.7)
    # sampled validation draws as training does; greedy validation is the policy's own argmax
    assert (builder.val_engine.config.repetition_penalty, builder.val_sampled_engine.config.repetition_penalty) == (
        1.0, 1.2)


def test_sampled_validation_takes_its_own_seed_whatever_the_training_seed(policy):
    """A training seed near the top of the range (valid for training) made sampled validation's seed, offset from it,
    fall out of the range: its engine failed to build at the first validation."""
    from lit_grpo.rollout.builder import VAL_SEED_OFFSET
    from lit_grpo.runtime.validation import SEED_MAX

    model, tokenizer = policy
    for seed in (1, SEED_MAX):
        sampling = SamplingConfig(group_size=2, micro_group_size=2, max_new_tokens=4, seed=seed)
        builder = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["accuracy"]),
                                 validation=ValidationConfig(val_num_samples=2))
        assert builder.engine.seed == seed
        assert builder.val_sampled_engine.seed == (seed + VAL_SEED_OFFSET) % (SEED_MAX + 1) != seed


@pytest.mark.parametrize("world, match", [
    (dict(world_size=0), r"world_size=0 must be an integer >= 1"),
    (dict(world_size=1.5), r"world_size=1.5 must be an integer >= 1"),
    (dict(world_size="2"), r"world_size='2' must be an integer >= 1"),  # it failed a comparison with a TypeError
    (dict(world_size=2, rank=2), r"rank=2 is not allowed; rank must be an integer >= 0 and <= 1"),
    (dict(rank=-1), r"rank=-1 is not allowed; rank must be an integer >= 0 and <= 0"),
])
def test_a_builder_refuses_a_world_it_cannot_be_a_rank_of(policy, world, match):
    model, tokenizer = policy
    sampling = SamplingConfig(group_size=2, micro_group_size=2, max_new_tokens=4)
    with pytest.raises(ValueError, match=match):
        RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["accuracy"]), all_gather=lambda x: x, **world)


@pytest.mark.parametrize("over_provision", [1.0, 2.0])
def test_a_chat_prompt_given_to_a_text_form_builder_is_refused_before_it_is_generated(policy, over_provision):
    """A builder made directly with conversational=False (its default) that is handed a chat prompt is told so when
    it gets the prompt, naming the fix, before any completion is generated for it (training, partial rollouts and
    validation alike), not once the rollout is done and its reward functions are called."""
    model, tokenizer = policy
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2 + 2?"}]
    chat = [Prompt(0, PromptExample("What is 2 + 2?", "4", {"prompt": messages}, messages),
                   tokenizer("What is 2 + 2?")["input_ids"])]
    sampling = SamplingConfig(group_size=2, micro_group_size=2, max_new_tokens=4, seed=0)
    builder = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["accuracy"]),
                             training=TrainingConfig(prompts_per_step=1, over_provision=over_provision))

    def generate(*args, **kwargs):
        raise AssertionError("a completion was generated for the chat prompt")

    for name in ("new_groups", "generate", "generate_groups"):
        for engine in (builder.engine, builder.val_engine):
            setattr(engine, name, generate)
    match = (r"conversational=False, but prompt 'What is 2 \+ 2\?' is chat messages: the reward functions' form is "
             r"the whole prompt set's: pass conversational=is_conversational\(examples\) over all its rows")
    with pytest.raises(ValueError, match=match):
        builder.build_train(lambda count: chat * count)
    with pytest.raises(ValueError, match=match):
        builder.build_val(chat)


def test_builder_resumes_the_engine_state_it_is_given(policy):
    model, tokenizer = policy
    sampling = SamplingConfig(group_size=2, micro_group_size=2, strategy="infinite", max_new_tokens=5)
    make = lambda: RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["char_fraction"]),  # noqa: E731
                                  training=TrainingConfig(prompts_per_step=1))
    first = make()
    first.build_train(lambda n: _prompts(tokenizer, n))
    second = make()
    second.load_state_dict(first.state_dict())  # before its engine exists
    assert second.engine.rollout_index == 1
    again = second.build_train(lambda n: _prompts(tokenizer, n))
    assert again.completions == first.build_train(lambda n: _prompts(tokenizer, n)).completions


def test_each_rank_draws_from_its_own_random_streams(policy):
    """The training streams are keyed by rollout and position, the same on every rank: each rank's seed differs, so
    group p of two ranks never shares its random numbers (here the same prompt on both: different samples)."""
    from lit_grpo.sampling.random_streams import rank_seed

    model, tokenizer = policy
    sampling = SamplingConfig(group_size=4, micro_group_size=4, strategy="continuous", max_new_tokens=6, seed=3)
    make = lambda rank: RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["char_fraction"]),  # noqa: E731
                                       training=TrainingConfig(prompts_per_step=2), world_size=2, rank=rank)
    ranks = [make(rank) for rank in (0, 1)]
    assert ranks[0].engine.seed == 3 and ranks[1].engine.seed == rank_seed(3, 1) != 3  # rank 0: the seed itself
    assert len({rank_seed(3, rank) for rank in range(64)}) == 64
    batches = [builder.build_train(lambda n: _prompts(tokenizer, n)) for builder in ranks]
    assert batches[0].completions != batches[1].completions
    with pytest.raises(ValueError, match=r"rank=-1 is not allowed; rank must be an integer >= 0 and <= 1"):
        make(-1)


def test_batch_scaling_across_ranks_needs_a_gather(policy):
    model, tokenizer = policy
    with pytest.raises(ValueError, match=r"scale_rewards='batch' over world_size=2 ranks needs all_gather"):
        RolloutBuilder(model, tokenizer, SamplingConfig(), [], advantage=AdvantageConfig(scale_rewards="batch"),
                       world_size=2)


@pytest.mark.parametrize("args, message, key", [
    (["--data.sampling.strategy", "beam"],
     "Expected a typing.Literal['full', 'micro', 'continuous', 'infinite']", "data.sampling.strategy"),
    # a setting of a nested optional config, named by its whole key
    (["--data.sampling.scheduler.length_aware.refill", "bogus"], "Expected a typing.Literal['lpt', 'sjf', 'fifo']",
     "error: data.sampling.scheduler.length_aware.refill: Expected"),
    (["--data.curriculum", "hard"], "Expected a typing.Literal['none', 'angle']", "data.curriculum"),
])
def test_a_wrong_option_fails_when_the_config_is_parsed(capsys, args, message, key):
    with pytest.raises(SystemExit):
        build_cli(["--config", TINY, *args], run=False)
    err = capsys.readouterr().err
    assert message in err and key in err


def test_scheduler_options_are_typed_in_the_config():
    default = build_cli(["--config", TINY, "--data.sampling.scheduler.preempt_tokens", "16",
                         "--trainer.logger", "false"], run=False).datamodule.sampling.scheduler
    assert isinstance(default, InfiniteSchedulerConfig) and (default.preempt_tokens, default.length_aware) == (16, None)
    built = default.build()  # the default scheduler: no predictor
    assert type(built) is LeastAttainedScheduler and built.preempt_tokens == 16
    cli = build_cli(["--config", TINY, "--data.sampling.scheduler.length_aware.predictor", "online",
                     "--data.sampling.scheduler.length_aware.probe_tokens", "4",
                     "--data.sampling.scheduler.length_aware.gain_z", "null", "--trainer.logger", "false"], run=False)
    scheduler = cli.datamodule.sampling.scheduler
    length_aware = scheduler.length_aware
    assert (length_aware.predictor, length_aware.probe_tokens, length_aware.refill, length_aware.gain_z) == (
        "online", 4, "lpt", None)
    built = scheduler.build()  # reaches the scheduler
    assert type(built) is LengthAwareScheduler and built.config.gain_z is None and built.probe_tokens == 4
    assert isinstance(built.predictor, OnlineLengthPredictor)
    with pytest.raises(ValueError, match=r"scheduler.length_aware.gain_z=0 is not allowed; .* must be a finite "
                                         r"number > 0, or None"):
        LengthAwareConfig(gain_z=0)
    with pytest.raises(ValueError, match=r"scheduler.park_budget=-1.0 is not allowed; .* must be a finite number > 0, "
                                         r"or None"):
        build_cli(["--config", TINY, "--data.sampling.scheduler.park_budget", "-1.0", "--trainer.logger", "false"],
                  run=False)


def test_a_training_step_under_bf16_mixed_precision(tmp_path):
    """The rollout runs inside the trainer's autocast (float32 weights, bfloat16 compute) on the linear weights cast
    once per rollout (kept with the slot cache here, until fit ends): the slot cache takes the autocast dtype, and
    the update follows."""
    import lightning.pytorch as pl

    class AfterTheUpdate(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            head = pl_module.rollout_weights().module.lm_head.weight
            self.seen = (trainer.datamodule.engine._cache.layers[0].keys.dtype, head.dtype,
                         head.untyped_storage().size() == head.numel() * 2)

    cli = build_cli(["--config", TINY, "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "1",
                     "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
                     "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(tmp_path),
                     "--data.sampling.keep_kv_cache", "true"], run=False)
    seen = AfterTheUpdate()
    cli.trainer.callbacks.append(seen)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 1
    assert cli.model.policy.dtype == torch.float32
    assert seen.seen == (torch.bfloat16, torch.bfloat16, True)  # the cache and the cast head, kept
    weights = cli.model.rollout_weights()
    assert isinstance(weights, CastWeights) and cli.datamodule.engine.model is weights.module
    assert weights.module.lm_head.weight.untyped_storage().size() == 0  # freed when fit ended


@pytest.mark.parametrize("args, key", [
    (["--data.group_size", "4"], "group_size"),
    (["--data", "{max_new_tokens: 8, temperature: 0.5}"], "max_new_tokens"),
])
def test_a_sampling_key_outside_data_sampling_fails_naming_it(capsys, args, key):
    with pytest.raises(SystemExit):
        build_cli(["--config", TINY, *args, "--trainer.logger", "false"], run=False)
    assert key in capsys.readouterr().err


def test_sampling_settings_in_python_go_in_one_config():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'group_size'"):
        RolloutDataModule(prompts=["a"], group_size=4)
    data = RolloutDataModule(prompts=["a"], sampling={"group_size": 4, "scheduler": {"preempt_tokens": 4}})
    assert (data.sampling.group_size, data.sampling.scheduler.preempt_tokens) == (4, 4)
    assert data.sampling.scheduler.length_aware is None
    with pytest.raises(ValueError, match=r"sampling.group_size=1 must be an integer >= 2"):
        RolloutDataModule(prompts=["a"], sampling=SamplingConfig(group_size=1))


@pytest.mark.parametrize("greedy", [{"temperature": 0.0}, {"top_k": 1}])
def test_greedy_training_rollouts_are_refused(greedy):
    """G identical completions give every advantage 0: a run that could never learn stops before it starts."""
    setting = "temperature=0" if "temperature" in greedy else "top_k=1"
    with pytest.raises(ValueError, match=rf"sampling.{setting} makes training rollouts greedy: the group_size=4 "
                                         "completions"):
        RolloutDataModule(prompts=["a"], sampling={"group_size": 4, **greedy})
    RolloutDataModule(prompts=["a"], sampling={"group_size": 4, "temperature": 0.7, "top_k": 2})


def test_a_wrong_loss_type_fails_when_the_config_is_parsed(capsys):
    with pytest.raises(SystemExit):
        build_cli(["--config", TINY, "--model.loss.loss_type", "ppo"], run=False)
    err = capsys.readouterr().err
    assert "model.loss.loss_type" in err and "'grpo', 'bnpo', 'dr_grpo', 'dapo'" in err


@pytest.mark.parametrize("cast", [False, True])
def test_auto_slots_come_from_the_devices_free_memory(policy, monkeypatch, cast):
    """Without kv_budget_bytes the builder reads the device's free memory (once), sets aside the rollout weights'
    copy, AdamW's moments and a margin, and sizes g to what is left (gradients are freed before every rollout), each
    slot priced with its share of a decode step's activations."""
    from lit_grpo.rollout import slot_memory as slot_memory_module
    from lit_grpo.runtime.memory import trainable_bytes
    from lit_grpo.sampling.memory_budget import (DEVICE_MARGIN_FRACTION, auto_micro_group_size, decode_step_bytes,
                                                 kv_held_bytes, kv_prefill_bytes, kv_slot_bytes)

    model, tokenizer = policy
    prompts = _prompts(tokenizer, 2)
    longest = max(len(p.ids) for p in prompts)
    sampling = SamplingConfig(group_size=4, micro_group_size="auto", strategy="continuous", max_new_tokens=6)
    weights = CastWeights(model, torch.bfloat16) if cast else None
    config = model.config
    dtype = torch.bfloat16 if cast else torch.float32
    # a slot holds its KV and its share of a decode step's activations (the memory a captured graph keeps)
    slot = kv_slot_bytes(config, dtype, longest, 6) + decode_step_bytes(config, dtype, 1, longest - 1 + 6,
                                                                        vocab_size(model))
    held = kv_held_bytes(config, dtype, longest, 4, 2) + kv_prefill_bytes(config, dtype, longest, 2, 6)
    total = 10**9
    copy = weights.cast_bytes() if cast else 0
    reserved = copy + 2 * trainable_bytes(model.parameters())
    assert trainable_bytes(model.parameters()) == sum(p.numel() * p.element_size() for p in model.parameters())
    free = reserved + int(DEVICE_MARGIN_FRACTION * total) + held + 3 * slot + slot // 2
    readings = []

    def device_memory(device):
        readings.append(device)
        return free, total

    monkeypatch.setattr(slot_memory_module, "device_memory", device_memory)
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if cast else None
    builder = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["char_fraction"]),
                             training=TrainingConfig(prompts_per_step=2),
                             max_prompt_length=longest, rollout_weights=weights, precision_context=context)
    batch = builder.build_train(lambda count: prompts[:count])
    assert builder.engine.micro_group_size == 3 and batch.metrics["rollout/slots"] == 3.0
    assert builder.resolved_micro_group_size == 3 and len(readings) == 1  # resolved once, not at every reading
    budget = builder.slot_memory.slot_budget
    assert budget.kv_budget_bytes == held + 3 * slot + slot // 2
    assert budget.describe().startswith("micro_group_size: auto -> 3 slots under a KV budget of ")
    assert "free" in budget.source and "margin" in budget.source and "optimizer state" in budget.source
    assert batch.stats.peak_kv_bytes <= budget.kv_budget_bytes
    if cast:
        assert copy > 0
    # A resumed run takes the budget its checkpoint read: AdamW's restored moments, on the device by then, are
    # not set aside twice. Its g is sized again, for the resumed config; a device of other memory is read again.
    monkeypatch.setattr(slot_memory_module, "device_memory", lambda device: (free - 2 * trainable_bytes(
        model.parameters()), total))

    def resumed(state, **changes):
        run = RolloutBuilder(model, tokenizer, sampling.replace(**changes), [],
                             training=TrainingConfig(prompts_per_step=2),
                             max_prompt_length=longest, rollout_weights=weights, precision_context=context)
        run.load_state_dict(state)
        return run

    again = resumed(builder.state_dict())
    assert again.resolved_micro_group_size == 3
    restored = again.slot_memory.slot_budget
    assert restored.kv_budget_bytes == budget.kv_budget_bytes
    assert restored.describe() == budget.describe().replace(")", "; read before the checkpoint was saved)")
    third = resumed(again.state_dict())  # resumed twice: the same budget, said the same way
    assert resumed(builder.state_dict()).state_dict()["kv_budget"] == builder.state_dict()["kv_budget"]  # unsized
    assert third.resolved_micro_group_size == 3 and third.slot_memory.slot_budget.describe() == restored.describe()
    longer = resumed(builder.state_dict(), max_new_tokens=12)  # longer rows: fewer of them in the same bytes
    same_bytes = resumed({}, max_new_tokens=12, kv_budget_bytes=budget.kv_budget_bytes)
    # the device's bytes hold the step's activations too; a configured budget is the cache's alone
    step = decode_step_bytes(config, dtype, 1, longest - 1 + 12, vocab_size(model))
    sized = functools.partial(auto_micro_group_size, config, dtype, budget.kv_budget_bytes, longest, 12, 4, 2)
    assert longer.resolved_micro_group_size == sized(step_bytes=step) <= 3 < same_bytes.resolved_micro_group_size
    assert same_bytes.resolved_micro_group_size == sized()
    assert longer.slot_memory.slot_budget.kv_budget_bytes == budget.kv_budget_bytes
    monkeypatch.setattr(slot_memory_module, "device_memory", lambda device: (free, 2 * total))
    with pytest.raises(ValueError, match="no device memory left for the KV cache"):  # read again: a larger margin
        resumed(builder.state_dict()).resolved_micro_group_size
    # keep_kv_cache: true holds the cache through every update: the gradients are set aside too
    gradients = trainable_bytes(model.parameters())
    monkeypatch.setattr(slot_memory_module, "device_memory", lambda device: (free + gradients, total))
    held_through = RolloutBuilder(model, tokenizer, sampling.replace(keep_kv_cache=True), [],
                                  training=TrainingConfig(prompts_per_step=2),
                                  max_prompt_length=longest, rollout_weights=weights, precision_context=context)
    assert held_through.resolved_micro_group_size == 3
    held_budget = held_through.slot_memory.slot_budget
    assert held_budget.kv_budget_bytes == budget.kv_budget_bytes  # their bytes more free, as many slots
    assert "gradients and optimizer state" in held_budget.source


def _partial_builder(policy, seed=0):
    """A builder whose first step carried two groups into the next (over_provision 2: their tokens drawn or not)."""
    model, tokenizer = policy
    sampling = SamplingConfig(group_size=2, micro_group_size=2, strategy="infinite", max_new_tokens=5, seed=seed)
    builder = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["char_fraction"]),
                             training=TrainingConfig(prompts_per_step=2, over_provision=2.0))
    builder.build_train(lambda count: _prompts(tokenizer, count))
    assert builder.carried and builder.engine.rollout_index == 1
    return builder


def _with_tokens(state):
    """``state`` whose first carried group's first sample has drawn 2 tokens."""
    state["carried"][0]["samples"][0].update(tokens=[5, 6], logprobs=[-0.5, -1.0], versions=[0, 0])
    return state


def _in_carried(*path_and_value):
    *path, key, value = path_and_value

    def change(state):
        entry = _with_tokens(state)["carried"][0]
        for step in path:
            entry = entry[step]
        entry[key] = value
    return change


_BUILDER_KEYS = "rollout_index, scheduler, carried, groups_scored, kv_budget"


@pytest.mark.parametrize("change, message", [
    (lambda state: state.__setitem__("carried_by_rank", [[]]),
     r"^a rollout builder state has unknown keys \['carried_by_rank'\]; it holds " + _BUILDER_KEYS
     + r" \(each may be absent\)$"),
    (lambda state: state.__setitem__("groups_scored", "2"),
     r"^builder state groups_scored='2' must be an integer >= 0"),  # was parsed as 2
    (lambda state: _with_tokens(state).__setitem__("rollout_index", -1), r"^rollout_index=-1 is not allowed"),
    (lambda state: _with_tokens(state).update(rollout_index=5, scheduler={"groups": [[]]}),
     r"^scheduler state groups\[0\]=\[\] is not allowed"),  # the engine's scheduler checks its own, the index kept
    (lambda state: state.__setitem__("carried", {"0": []}), r"^builder state carried=\{'0': \[\]\} must be a list of "
                                                            r"carried groups$"),
    (_in_carried("forced", None), r"^builder state carried\[0\] has unknown keys \['forced'\]; it holds prompt, steps, "
                                  r"stream, forced_lengths, samples$"),
    (_in_carried("prompt", "ids", [292, -1]), r"^builder state carried\[0\].prompt.ids=\[292, -1\] is not allowed; "
                                              r"it must be a non-empty list of token ids \(integers >= 0\)$"),
    (_in_carried("stream", [0]), r"^builder state carried\[0\].stream=\[0\] is not allowed; it must be \(rollout "
                                 r"index, prompt index\), two integers >= 0$"),
    (_in_carried("samples", [{"tokens": [], "logprobs": [], "versions": [], "done": False}]),
     r"^builder state carried\[0\].samples holds 1 samples; a group of this run holds group_size=2$"),
    (_in_carried("samples", 0, "logprobs", [-0.5]), r"^builder state carried\[0\].samples\[0\] holds 2 tokens, 1 "
                                                    r"logprobs and 2 versions; a sample holds one of each per token$"),
    (_in_carried("samples", 0, "logprobs", [-0.5, "x"]), r"^builder state carried\[0\].samples\[0\].logprobs=\[-0.5, "
                                                         r"'x'\] is not allowed; it must be a list of numbers \(the "
                                                         r"sampler's log-probabilities\)$"),
    (_in_carried("samples", 1, "done", "false"), r"^builder state carried\[0\].samples\[1\].done='false' must be True "
                                                 r"or False$"),
    (_in_carried("forced_lengths", [3]), r"^builder state carried\[0\].forced_lengths=\[3\] is not allowed; it must "
                                         r"be None or 2 lengths, one per sample \(integers >= 0\)$"),
    (_in_carried("steps", -1), r"^builder state carried\[0\].steps=-1 must be an integer >= 0$"),
    # the prompt's own fields: taken unchecked, a bad one failed at the first reward call or prompt-set comparison
    (_in_carried("prompt", "prompt", 5), r"^builder state carried\[0\].prompt.prompt=5 must be a non-empty string$"),
    (_in_carried("prompt", "entry", ["x"]), r"^builder state carried\[0\].prompt.entry=\['x'\] is not allowed; it "
                                            r"must be the prompt's source row: a mapping of its fields by name "
                                            r"\(string keys\)$"),
    (_in_carried("prompt", "entry", {0: "x"}), r"^builder state carried\[0\].prompt.entry=\{0: 'x'\} is not "
                                               r"allowed; it must be the prompt's source row"),
    (_in_carried("prompt", "messages", [{"role": "user"}]),
     r"^builder state carried\[0\].prompt.messages: message 0 must be \{'role': str, 'content': str\}"),
    (_in_carried("prompt", "messages", "hello"),
     r"^builder state carried\[0\].prompt.messages='hello' is not allowed; it must be None \(a single user "
     r"message\) or a non-empty list of chat messages"),
    (_in_carried("prompt", "answer", 10**5000), r"^builder state carried\[0\].prompt: the answer is an int of 5001 "
                                                r"digits, more than Python turns into text"),
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed
    (lambda state: state.__setitem__("carried", 10**5000), r"^builder state carried=\(an int of 5001 digits\) must be "
                                                           r"a list of carried groups$"),
    (_in_carried("stream", [10**5000] * 3), r"^builder state carried\[0\].stream=a list holding an int of more than "
                                            r"\d+ digits is not allowed; it must be \(rollout index, prompt index\)"),
    (_in_carried("prompt", "ids", [-10**5000]), r"^builder state carried\[0\].prompt.ids=a list holding an int of "
                                                r"more than \d+ digits is not allowed; it must be a non-empty list"),
    (_in_carried("samples", 10**5000), r"^builder state carried\[0\].samples=\(an int of 5001 digits\) must be a "
                                       r"list of the group's samples$"),
    (_in_carried("forced_lengths", [10**5000]),
     r"^builder state carried\[0\].forced_lengths=a list holding an int of more than \d+ digits is not allowed; it "
     r"must be None or 2 lengths"),
    (_in_carried("samples", 0, "logprobs", [-0.5, 10**5000]),
     r"^builder state carried\[0\].samples\[0\].logprobs=a list holding an int of more than \d+ digits is not "
     r"allowed; it must be a list of numbers \(the sampler's log-probabilities\)$"),
    (lambda state: state.__setitem__("kv_budget", {"kv_budget_bytes": -5, "source": "cuda:0", "device_total_bytes": 8,
                                                   "restored": False}),
     r"^builder state kv_budget.kv_budget_bytes=-5 must be an integer >= 1$"),
    (lambda state: state.__setitem__("kv_budget", {"kv_budget_bytes": 5, "source": "cuda:0", "total": 8}),
     r"^a KV budget state has unknown keys \['total'\]; it holds kv_budget_bytes, source, device_total_bytes, "
     r"restored \(device_total_bytes and restored may be absent\)$"),
])
def test_a_bad_builder_state_is_refused_naming_the_bad_key_and_nothing_is_taken(policy, change, message):
    """A corrupt or foreign checkpoint's builder state (its carried groups, the engine's state, the KV budget) is
    refused naming what is wrong and what is allowed, before any of it is taken: the carried groups were taken before
    the engine's state failed, a carried sample of fewer log-probs than tokens failed in a later batch, and a KV
    budget of a negative size sized the slots."""
    state = _partial_builder(policy).state_dict()
    change(state)
    builder = _partial_builder(policy, seed=1)
    before = builder.state_dict()
    with pytest.raises(ValueError, match=message):
        builder.load_state_dict(state)
    assert builder.state_dict() == before and builder.slot_memory._checkpoint_kv_budget is None


def test_a_bad_engine_state_is_refused_when_it_is_loaded_not_when_the_engine_is_built(policy):
    """A builder takes the engine's state before its engine is built: the keys, the rollout index and the
    scheduler's state (on a scratch scheduler of the strategy) are checked then, not at the first rollout."""
    model, tokenizer = policy
    state = _with_tokens(_partial_builder(policy).state_dict())
    fresh = RolloutBuilder(model, tokenizer, SamplingConfig(group_size=2, micro_group_size=2, strategy="infinite",
                                                            max_new_tokens=5),
                           build_reward_funcs(["char_fraction"]), training=TrainingConfig(prompts_per_step=2))
    with pytest.raises(ValueError, match=r"^rollout_index=None is not allowed"):
        fresh.load_state_dict({**state, "rollout_index": None})
    assert fresh._pending_engine_state is None and fresh.carried == []
    with pytest.raises(ValueError, match=r"^scheduler state groups\[0\]=\[\] is not allowed; a finished group is a "
                                         r"non-empty list"):
        fresh.load_state_dict({**state, "scheduler": {"groups": [[]]}})
    assert fresh._pending_engine_state is None and fresh.carried == []
    fresh.load_state_dict(state)
    assert fresh.engine.rollout_index == 1 and fresh.carried[0].samples[0].tokens == [5, 6]
    assert fresh.state_dict() == state


def _prompts_of_length(tokenizer, count, words):
    return [Prompt(index=i, example=PromptExample(f"What is {i} + {i}?", str(2 * i)),
                   ids=tokenizer(f"{'Think. ' * words}What is {i} + {i}?")["input_ids"]) for i in range(count)]


@pytest.mark.parametrize("cast", [False, True])
def test_auto_keeps_the_cache_through_updates_no_wider_than_one_measured_where_it_fits(policy, monkeypatch, cast):
    """keep_kv_cache: auto releases until an update has been measured. Then, at the end of each rollout, it keeps
    the slot cache (priced at its widest: the longest prompt's width) and the rollout weights' copy its graphs read
    through the coming update where that batch is no wider than the widest update measured and the kept bytes fit
    beside that update's peak; a wider batch releases them, and its update is measured."""
    from lit_grpo.rollout import slot_memory as slot_memory_module
    from lit_grpo.sampling.engine import WIDTH_ALIGNMENT
    from lit_grpo.sampling.memory_budget import DEVICE_MARGIN_FRACTION, kv_bytes_per_token

    model, tokenizer = policy
    # prompts far enough apart in length that a batch's width (prompt + at most 6 new tokens) orders as they do
    short, medium, long = (_prompts_of_length(tokenizer, 2, words) for words in (0, 4, 8))
    longest = max(len(p.ids) for p in long)
    assert max(len(p.ids) for p in short) + 6 < min(len(p.ids) for p in medium)
    assert max(len(p.ids) for p in medium) + 6 < min(len(p.ids) for p in long)
    total = 10**9
    margin = int(DEVICE_MARGIN_FRACTION * total)
    monkeypatch.setattr(slot_memory_module, "device_memory", lambda device: (total, total))
    sampling = SamplingConfig(group_size=4, micro_group_size=3, strategy="continuous", max_new_tokens=6)
    assert sampling.keep_kv_cache == "auto"
    dtype = torch.bfloat16 if cast else torch.float32
    widest = -(-(longest - 1 + 6) // WIDTH_ALIGNMENT) * WIDTH_ALIGNMENT
    slot_cache = 3 * widest * kv_bytes_per_token(model.config, dtype)
    for fits in (True, False):
        weights = CastWeights(model, torch.bfloat16) if cast else None
        context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if cast else None
        measured = {"peak": None}
        builder = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["char_fraction"]),
                                 training=TrainingConfig(prompts_per_step=2),
                                 rollout_weights=weights, precision_context=context, max_prompt_length=longest,
                                 measured_update_peak=lambda: measured["peak"])
        kept_bytes = slot_cache + (weights.cast_bytes() if cast else 0)

        def copies_held():  # the cast weights' storage (a policy without them: nothing to hold, None)
            return None if not cast else all(c.untyped_storage().size() > 0 for _, c in weights._casts.values())

        builder.build_train(lambda count: medium[:count])
        assert builder.slot_memory.cache_keeping is None and builder.engine._cache is None  # no update measured yet
        assert not copies_held()
        measured["peak"] = total - margin - kept_bytes + (0 if fits else 1)
        builder.build_train(lambda count: short[:count])  # narrower than the update measured
        decided = builder.slot_memory.cache_keeping
        assert (decided.kept, decided.kept_bytes, decided.margin_bytes) == (fits, kept_bytes, margin)
        assert decided.describe().startswith(f"keep_kv_cache: auto -> the slot cache is "
                                             f"{'kept through' if fits else 'released before'} the update")
        cache = builder.engine._cache
        assert (cache is not None) is fits and copies_held() in (None, fits)
        builder.build_train(lambda count: short[:count])
        kept_again = builder.slot_memory.cache_keeping.kept
        assert kept_again is fits and (cache is not None and builder.engine._cache is cache) is fits
        builder.build_train(lambda count: long[:count])  # wider than any update measured: released, then measured
        assert not builder.slot_memory.cache_keeping.kept and builder.engine._cache is None and not copies_held()
        assert "wider than any update measured" in builder.slot_memory.cache_keeping.describe()


def test_auto_keeps_the_cache_beside_an_update_measured_with_it_kept_up_to_its_width(monkeypatch):
    """An update measured while the cache was kept peaked with the cache in it: its own peak is that less the kept
    bytes. A batch exactly as wide as the widest update measured keeps the cache where it fits; a wider one not."""
    import contextlib
    from types import SimpleNamespace

    from lit_grpo.rollout import slot_memory as slot_memory_module
    from lit_grpo.rollout.slot_memory import SlotMemory

    monkeypatch.setattr(slot_memory_module, "device_memory", lambda device: (1000, 1000))  # a margin of 100
    policy = torch.nn.Linear(2, 2)
    sampling = SamplingConfig(group_size=4, micro_group_size=2, strategy="continuous", max_new_tokens=6)
    memory = SlotMemory(policy, sampling, SimpleNamespace(scope_bytes=lambda: 0, module=policy),
                        groups_per_rollout=2, max_prompt_length=0)
    # its graphs' memory pool is kept with the cache: 50 bytes beside its 200
    engine = SimpleNamespace(slot_cache_bytes=lambda: 200, graph_pool_bytes=lambda *widest: 50)
    memory.expect_update(engine, 10, kept=True)
    memory.measure_last_update(900)  # the update of rows 10 wide, beside the kept 250 bytes
    assert memory.keep_through_update(engine, 10, contextlib.nullcontext) is True  # 650 + 250 <= 1000 - 100
    kept = memory.cache_keeping
    assert (kept.update_peak_bytes, kept.kept_bytes, kept.update_width, kept.margin_bytes) == (650, 250, 10, 100)
    assert memory.keep_through_update(engine, 11, contextlib.nullcontext) is False
    memory.expect_update(engine, 10, kept=False)
    memory.measure_last_update(651)  # an update of 651 bytes with nothing kept: 651 + 250 > 900
    assert memory.keep_through_update(engine, 10, contextlib.nullcontext) is False


def test_auto_slots_under_infinite_price_what_preemption_may_park(policy, monkeypatch):
    from lit_grpo.rollout import slot_memory as slot_memory_module

    model, tokenizer = policy
    priced = []
    monkeypatch.setattr(slot_memory_module, "auto_micro_group_size",
                        lambda *args, carried, alignment, row_state_bytes, step_bytes: priced.append(args[7:]) or 2)
    for strategy, scheduler in [("infinite", {}), ("infinite", {"park_budget": None}), ("continuous", {})]:
        sampling = SamplingConfig(group_size=4, micro_group_size="auto", strategy=strategy, max_new_tokens=64,
                                  kv_budget_bytes=10**7, scheduler=scheduler)
        builder = RolloutBuilder(model, tokenizer, sampling, [], training=TrainingConfig(prompts_per_step=2),
                                 max_prompt_length=8)
        assert builder.resolved_micro_group_size == 2
    # within the park budget: half of each slot's generation KV; without one, each sample up to its last point
    assert priced == [(0, 0.5), (56, 0.0), (0, 0)]


def test_auto_slots_price_the_ids_a_repetition_penalty_keeps_per_row(policy, monkeypatch):
    from lit_grpo.rollout import slot_memory as slot_memory_module

    model, tokenizer = policy
    priced = []
    monkeypatch.setattr(slot_memory_module, "auto_micro_group_size",
                        lambda *args, carried, alignment, row_state_bytes, step_bytes: priced.append(
                            (row_state_bytes, step_bytes)) or 2)
    for penalty in (1.0, 1.2):
        sampling = SamplingConfig(group_size=4, micro_group_size="auto", strategy="continuous", max_new_tokens=64,
                                  kv_budget_bytes=10**7, repetition_penalty=penalty)
        assert RolloutBuilder(model, tokenizer, sampling, [], training=TrainingConfig(prompts_per_step=2),
                              max_prompt_length=8).resolved_micro_group_size == 2
    # one bool per vocabulary entry a row; no decode step's activations in a configured budget (the cache's alone)
    assert priced == [(0, 0), (vocab_size(model), 0)]


def test_auto_keeps_nothing_off_cuda(policy):
    model, tokenizer = policy
    sampling = SamplingConfig(group_size=2, micro_group_size=2, strategy="continuous", max_new_tokens=4)
    builder = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["char_fraction"]),
                             training=TrainingConfig(prompts_per_step=1),
                             measured_update_peak=lambda: 1)
    for _ in range(2):
        builder.build_train(lambda count: _prompts(tokenizer, count))
        assert builder.slot_memory.cache_keeping is None and builder.engine._cache is None


def test_auto_slots_name_a_device_too_full_for_one_slot(policy, monkeypatch):
    from lit_grpo.rollout import slot_memory as slot_memory_module

    model, tokenizer = policy
    monkeypatch.setattr(slot_memory_module, "device_memory", lambda device: (10**6, 10**9))  # the margin alone is 10**8
    sampling = SamplingConfig(group_size=4, micro_group_size="auto", strategy="continuous", max_new_tokens=6)
    builder = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["char_fraction"]),
                             training=TrainingConfig(prompts_per_step=2),
                             max_prompt_length=8)
    with pytest.raises(ValueError, match=r"no device memory left for the KV cache: free_bytes=1000000 - "
                                         r"reserved_bytes=\d+ .* - margin_bytes=100000000 = -\d+"):
        builder.resolved_micro_group_size


def test_auto_slots_need_the_longest_prompt_and_price_carried_groups_wherever_some_are(policy, monkeypatch):
    from lit_grpo.rollout import slot_memory as slot_memory_module

    model, tokenizer = policy
    sampling = SamplingConfig(group_size=4, micro_group_size="auto", strategy="continuous", max_new_tokens=6,
                              kv_budget_bytes=10**7)
    with pytest.raises(ValueError, match=r"max_prompt_length=0: micro_group_size 'auto' prices the prompts' KV "
                                         r"from the longest training prompt"):
        RolloutBuilder(model, tokenizer, sampling, [], training=TrainingConfig(prompts_per_step=2))
    # a repr of an int of more than 4300 digits failed in place of the refusal
    with pytest.raises(ValueError, match=r"^max_prompt_length=\(a negative int of 5001 digits\): micro_group_size "):
        slot_memory_module.check_max_prompt_length(sampling, -10**5000)
    priced = []
    monkeypatch.setattr(slot_memory_module, "auto_micro_group_size",
                        lambda *args, carried, alignment, row_state_bytes, step_bytes: priced.append(carried) or 2)
    partial = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["char_fraction"]),
                             training=TrainingConfig(prompts_per_step=2, over_provision=2.0),
                             max_prompt_length=8)
    partial.build_train(lambda count: _prompts(tokenizer, count))
    assert partial.carried, "the test needs groups carried into the next step"
    # resumed without partial rollouts, the carried groups still run first: their KV is priced
    resumed = RolloutBuilder(model, tokenizer, sampling, [], training=TrainingConfig(prompts_per_step=2),
                             max_prompt_length=8)
    resumed.load_state_dict(partial.state_dict())
    assert resumed.resolved_micro_group_size == 2 and priced == [True, True]


def test_the_curriculums_accuracy_counts_every_generated_group_dynamic_sampling_dropped_or_not(policy):
    """Dynamic sampling drops all-correct and all-wrong groups, so the kept groups' accuracy leans towards one
    half: the curriculum is fed every generated group's (the skipped ones left out)."""
    from lit_grpo.rollout.rewards import WeightedReward

    model, tokenizer = policy

    def correct(prompts, completions, **columns):  # prompt 0 always right, prompt 1 always wrong, prompt 2 mixed
        first = {"What is 0 + 0?": 1.0, "What is 1 + 1?": 0.0}
        return [first.get(p, float(k % 2)) for k, p in enumerate(prompts)]

    sampling = SamplingConfig(group_size=4, micro_group_size=4, strategy="continuous", max_new_tokens=4)
    builder = RolloutBuilder(model, tokenizer, sampling, [WeightedReward(correct)],
                             training=TrainingConfig(prompts_per_step=1, dynamic_sampling=True),
                             scoring=ScoringConfig(accuracy_reward="correct"))
    pool = iter(_prompts(tokenizer, 3))
    batch = builder.build_train(lambda count: [next(pool) for _ in range(count)])
    assert batch.indices == [2] and batch.metrics["rollout/rollouts_per_step"] == 3.0
    assert batch.accuracy.mean() == 0.5  # the kept group's
    correct_sum, judged, _, _ = batch.accuracy_sums().tolist()
    assert (correct_sum, judged) == (4 + 0 + 2, 12)  # all three groups'


def test_no_generated_group_gives_the_curriculum_zero_sums_as_a_tensor(policy):
    """Every generated group's ``accuracy_sums`` add up from a ``[4]`` float64 tensor of zeros, so no group at all
    gives one too (what ``RolloutBatch.accuracy_sums`` returns), not a plain number."""
    from lit_grpo.batch import accuracy_sums

    model, tokenizer = policy
    sampling = SamplingConfig(group_size=2, max_new_tokens=4)
    builder = RolloutBuilder(model, tokenizer, sampling, build_reward_funcs(["accuracy"]))
    total = builder._generated_accuracy([])
    assert isinstance(total, torch.Tensor) and total.dtype == torch.float64
    assert torch.equal(total, accuracy_sums(None, torch.zeros(0)))


def test_the_curriculums_mean_reward_leaves_out_the_completions_no_reward_function_scored(policy):
    """Without a correctness reward the curriculum is fed the mean reward; a completion every function said None
    to has a logged total of 0.0 that it never earned, and counting it would pull the feedback down."""
    from lit_grpo.batch import accuracy_sums, scored_rewards
    from lit_grpo.rollout.rewards import WeightedReward

    model, tokenizer = policy

    def half(prompts, completions, **columns):  # even completions score 1, odd ones have no opinion
        return [1.0 if k % 2 == 0 else None for k in range(len(prompts))]

    sampling = SamplingConfig(group_size=4, micro_group_size=4, strategy="continuous", max_new_tokens=4)
    builder = RolloutBuilder(model, tokenizer, sampling, [WeightedReward(half)],
                             training=TrainingConfig(prompts_per_step=2))
    assert builder.scoring.accuracy_reward is None
    with pytest.warns(UserWarning, match="every reward function returned None for 4 of 8 completions"):
        batch = builder.build_train(lambda count: _prompts(tokenizer, count))
    assert batch.rewards.tolist() == [[1.0, 0.0, 1.0, 0.0]] * 2  # the logged totals
    assert batch.accuracy_sums().tolist() == [0.0, 0.0, 4.0, 4.0]
    batch.generated_accuracy = None  # the batch's own groups: the same from its reward components
    assert batch.accuracy_sums().tolist() == [0.0, 0.0, 4.0, 4.0]
    scored = scored_rewards(batch.rewards, batch.reward_components)
    assert scored.isnan().tolist() == [[False, True, False, True]] * 2
    assert accuracy_sums(None, torch.tensor([0.5, float("nan")])).tolist() == [0.0, 0.0, 0.5, 1.0]


def _stacked(batch, names):
    return torch.stack([batch.reward_components[name] for name in names], dim=-1)


def test_normalize_then_sum_advantages_span_the_kept_groups_of_every_rank(policy):
    """The builder's batch advantages under normalize_then_sum: a skipped group gets 0 and its values (here not
    NaN, so that leaving them out shows) stay out of the batch's mean and std, on this rank and the other."""
    from lit_grpo.rollout.advantages import normalize_then_sum, normalize_then_sum_advantages
    from lit_grpo.rollout.rewards import WeightedReward

    model, tokenizer = policy
    funcs = [WeightedReward(lambda prompts, completions, **_: [0.0] * len(prompts), w, name)
             for name, w in (("a", 1.0), ("b", -0.5))]
    weights = torch.tensor([1.0, -0.5])
    g = torch.Generator().manual_seed(3)
    values = torch.randint(0, 5, (3, 4, 2), generator=g).float()
    values[2] = 50.0 * torch.rand(4, 2, generator=g)                   # the skipped group
    other = torch.randint(0, 5, (3, 4, 2), generator=g).float()
    components = {"a": values[..., 0], "b": values[..., 1]}
    skipped, other_skipped = torch.tensor([False, False, True]), torch.tensor([True, False, False])
    other_sums = normalize_then_sum(other, weights).masked_fill(other_skipped[:, None], float("nan"))
    sampling = SamplingConfig(group_size=4)

    one = RolloutBuilder(model, tokenizer, sampling, funcs,
                         advantage=AdvantageConfig(multi_objective_aggregation="normalize_then_sum"))
    advantages = one._advantages(values.sum(dim=2), components, skipped)
    assert torch.equal(advantages[2], torch.zeros(4))
    torch.testing.assert_close(advantages[:2], normalize_then_sum_advantages(values[:2], weights))
    assert not torch.allclose(advantages[:2], normalize_then_sum_advantages(values, weights)[:2], atol=1e-3)

    gathered = []

    def all_gather(tensor):  # this rank's [B, G] first, then the other rank's
        gathered.append(tensor)
        return torch.stack([tensor, other_sums])

    two = RolloutBuilder(model, tokenizer, sampling, funcs,
                         advantage=AdvantageConfig(multi_objective_aggregation="normalize_then_sum",
                                                   scale_rewards="group"),
                         world_size=2, all_gather=all_gather)
    advantages = two._advantages(values.sum(dim=2), components, skipped)
    assert len(gathered) == 1 and gathered[0][2].isnan().all()   # the skipped group is gathered as NaN
    kept = torch.cat([normalize_then_sum(values[:2], weights), other_sums[1:]])
    torch.testing.assert_close(advantages[:2], normalize_then_sum_advantages(values[:2], weights, batch_sums=kept))
    assert torch.equal(advantages[2], torch.zeros(4))
    assert not torch.allclose(advantages[:2], normalize_then_sum_advantages(values[:2], weights), atol=1e-3)

    with pytest.raises(ValueError, match=r"multi_objective_aggregation='normalize_then_sum' over world_size=2 "
                                         r"ranks needs all_gather"):
        RolloutBuilder(model, tokenizer, sampling, funcs,
                       advantage=AdvantageConfig(multi_objective_aggregation="normalize_then_sum"),
                       world_size=2)
    with pytest.raises(ValueError, match=r"multi_objective_aggregation='gdpo' is not known; use one of "
                                         r"\['sum_then_normalize', 'normalize_then_sum'\]"):
        RolloutBuilder(model, tokenizer, sampling, funcs, advantage=AdvantageConfig(multi_objective_aggregation="gdpo"))


def test_normalize_then_sum_trains_on_the_groups_no_reward_function_raised_on(policy, recwarn):
    """A whole step under normalize_then_sum with on_reward_error: skip_group: the skipped group gets 0, the
    others the advantages of the kept groups' rewards alone."""
    from lit_grpo.rollout.advantages import normalize_then_sum_advantages
    from lit_grpo.rollout.rewards import WeightedReward

    model, tokenizer = policy

    def picky(prompts, completions, **columns):
        if any("1 + 1" in p for p in prompts):
            raise RuntimeError("no sums of ones")
        return [float(len(c) % 3) for c in completions]

    def spread(prompts, completions, **columns):
        return [float(k % 4) if k % 3 else None for k in range(len(prompts))]

    names = ["picky", "spread"]
    sampling = SamplingConfig(group_size=4, micro_group_size=4, strategy="continuous", max_new_tokens=4)
    builder = RolloutBuilder(model, tokenizer, sampling, [WeightedReward(picky, 2.0), WeightedReward(spread, 0.5)],
                             training=TrainingConfig(prompts_per_step=3),
                             scoring=ScoringConfig(on_reward_error="skip_group"),
                             advantage=AdvantageConfig(multi_objective_aggregation="normalize_then_sum"))
    batch = builder.build_train(lambda count: _prompts(tokenizer, count))
    assert batch.skipped.tolist() == [False, True, False]
    assert torch.equal(batch.advantages[1], torch.zeros(4)) and batch.advantages.abs().sum() > 0
    values, weights = _stacked(batch, names), torch.tensor([2.0, 0.5])
    torch.testing.assert_close(batch.advantages[[0, 2]], normalize_then_sum_advantages(values[[0, 2]], weights))


def test_dynamic_sampling_under_normalize_then_sum_drops_groups_whose_every_function_is_constant(policy):
    """Prompt 1's functions are each constant over the completions they score, but score different ones, so its
    totals vary; prompt 0's totals are all 2 while its functions vary. Under normalize_then_sum the first has no
    signal and the second has; summed, the other way round."""
    from lit_grpo.rollout.rewards import WeightedReward

    model, tokenizer = policy

    def first(prompts, completions, **columns):
        return [(2.0 * (k % 2 == 0)) if "0 + 0" in p else 1.0 if k % 4 < 2 else None
                for k, p in enumerate(prompts)]

    def second(prompts, completions, **columns):
        return [float(k % 2 == 1) if "0 + 0" in p else 3.0 if k % 4 >= 2 else None
                for k, p in enumerate(prompts)]

    sampling = SamplingConfig(group_size=4, micro_group_size=4, strategy="continuous", max_new_tokens=4)
    funcs = [WeightedReward(first, 1.0), WeightedReward(second, 2.0)]
    batches = {}
    for aggregation in ("normalize_then_sum", "sum_then_normalize"):
        builder = RolloutBuilder(model, tokenizer, sampling, funcs,
                                 training=TrainingConfig(prompts_per_step=1, dynamic_sampling=True),
                                 advantage=AdvantageConfig(multi_objective_aggregation=aggregation))
        pool = iter([_prompts(tokenizer, 2)[1], _prompts(tokenizer, 2)[0]])
        batches[aggregation] = builder.build_train(lambda count: [next(pool) for _ in range(count)])
    gdpo, summed = batches["normalize_then_sum"], batches["sum_then_normalize"]
    assert (gdpo.indices, gdpo.num_groups_generated, gdpo.num_groups_zero_std) == ([0], 2, 1)
    assert torch.equal(gdpo.rewards, torch.full((1, 4), 2.0)) and gdpo.advantages.std() > 0.5
    assert (summed.indices, summed.num_groups_generated, summed.num_groups_zero_std) == ([1], 1, 0)


def test_completions_no_function_scored_are_left_out_of_their_groups_advantages(policy):
    """Under sum_then_normalize a completion every function returned None for is logged as 0.0 but is no 0.0 its
    group earned: it gets advantage 0, the others are normalized among themselves, and a group whose scored
    completions are all equal has no signal for dynamic sampling (its totals vary only by the unscored 0.0)."""
    from lit_grpo.rollout.rewards import WeightedReward

    model, tokenizer = policy

    def sparse(prompts, completions, **columns):  # prompt 0: 1, 1, None, 1; prompt 1: 2, None, 5, 3
        table = {"0 + 0": [1.0, 1.0, None, 1.0], "1 + 1": [2.0, None, 5.0, 3.0]}
        return [next(v for key, v in table.items() if key in p)[k % 4] for k, p in enumerate(prompts)]

    sampling = SamplingConfig(group_size=4, micro_group_size=4, strategy="continuous", max_new_tokens=4)
    for dynamic in (False, True):
        builder = RolloutBuilder(model, tokenizer, sampling, [WeightedReward(sparse, 1.0)],
                                 training=TrainingConfig(prompts_per_step=2, dynamic_sampling=dynamic,
                                                         max_rollouts_per_step=1))
        with pytest.warns(UserWarning, match="None for 2 of 8 completions; they are left out"):
            batch = builder.build_train(lambda count: _prompts(tokenizer, count))
        if dynamic:
            assert batch.num_groups_zero_std == 1 and batch.indices[0] == 1  # the group with signal comes first
            continue
        assert batch.rewards[:, [2, 1]].diag().eq(0).all()  # logged as 0.0
        assert batch.advantages[0].eq(0).all() and batch.advantages[1, 1] == 0
        scored = torch.tensor([2.0, 5.0, 3.0])
        torch.testing.assert_close(batch.advantages[1, [0, 2, 3]], (scored - scored.mean()) / (scored.std() + 1e-4))


def test_a_short_batch_is_filled_with_the_dropped_groups_spread_among_the_kept_ones():
    """Dynamic sampling's batch: the kept groups (at most B) in their order, the dropped ones in generation order up
    to B, none twice, spread evenly, so no mini-batch of consecutive groups is made of fillers where it need not be."""
    from lit_grpo.rollout.builder import _fill_groups

    generated = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert _fill_groups([(0, 1), (1, 1)], generated, 4) == [(0, 1), (0, 0), (1, 1), (0, 2)]
    assert _fill_groups([(0, 2), (0, 0), (1, 0)], generated, 2) == [(0, 2), (0, 0)]
    assert _fill_groups([], generated, 5) == generated
    assert _fill_groups([(1, 1)], generated, 3) == [(0, 0), (1, 1), (0, 1)]
    # 2 kept of 8: any 2 mini-batches of 4 groups hold a kept group each, any 4 of 2 at most one filler pair
    kept, many = [(1, 0), (1, 1)], [(0, p) for p in range(8)] + [(1, 0), (1, 1)]
    filled = _fill_groups(kept, many, 8)
    assert sorted(filled) == sorted(kept + many[:6]) and all(set(filled[i:i + 4]) & set(kept) for i in (0, 4))


def test_the_batch_scale_over_ranks_leaves_out_every_ranks_unscored_completions(policy):
    """scale_rewards=batch over two ranks: the std spans both ranks' scored completions; an unscored one (every
    function None) is gathered as NaN and left out, and gets 0."""
    import math

    from lit_grpo.rollout.rewards import WeightedReward

    model, tokenizer = policy
    funcs = [WeightedReward(lambda prompts, completions, **_: [0.0] * len(prompts), 1.0, "a")]
    values = torch.tensor([[1.0, math.nan, 3.0, 0.0], [2.0, 2.0, 5.0, 1.0]])
    other = torch.tensor([[4.0, 0.0, 0.0, 1.0], [math.nan, 1.0, 2.0, 3.0]])

    def all_gather(tensor):
        return torch.stack([tensor, other if tensor.dtype == torch.float32 else torch.ones(2, dtype=torch.bool)])

    builder = RolloutBuilder(model, tokenizer, SamplingConfig(group_size=4), funcs,
                             advantage=AdvantageConfig(scale_rewards="batch"),
                             world_size=2, all_gather=all_gather)
    advantages = builder._advantages(values.nan_to_num(0.0), {"a": values}, torch.zeros(2, dtype=torch.bool))
    pool = torch.cat([values, other]).flatten()
    std = pool[~pool.isnan()].std()
    expected = (values - values.nanmean(dim=1, keepdim=True)) / (std + 1e-4)
    torch.testing.assert_close(advantages, expected.nan_to_num(0.0))


def test_a_reward_function_changing_its_arguments_changes_nothing_of_the_run():
    """Each completion's columns are copies of its own, as TRL's rows: a reward function that edits its entry, a row
    field or its completion's token ids leaves the prompt set, the rollout's tokens and the other completions' as
    they were."""
    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.runtime.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    seen = []

    def vandal(prompts, completions, entry, tags, completion_ids, **columns):
        seen.append(([dict(e) for e in entry], [list(t) for t in tags]))
        for e, t, ids in zip(entry, tags, completion_ids):
            e["answer"] = "changed"
            t.append("changed")
            ids.append(-1)
        return [0.0] * len(completions)

    rows = [{"prompt": f"{i} + 1?", "answer": str(i + 1), "tags": ["a"]} for i in range(4)]
    dm = RolloutDataModule(prompts=rows, val_size=0, prompts_per_step=2, reward_funcs=[vandal],
                           sampling={"group_size": 2, "micro_group_size": 2, "max_new_tokens": 3})
    dm.attach(model, tokenizer)
    dm.setup("fit")
    batch = dm.build_train_batch()
    assert all(e["answer"] != "changed" for e, _ in zip(*seen[0]))  # each completion saw the row as it is
    assert all(t == ["a"] for t in seen[0][1])
    assert all(example.entry["tags"] == ["a"] and example.entry["answer"] != "changed" for example in dm.examples)
    assert int(batch.completion_ids.min()) >= 0  # no -1 reached the tokens trained on


def test_a_row_field_deepcopy_refuses_reaches_each_completion_as_it_is():
    """Each completion's columns are copied as each reward function's are (``rewards._fresh``): plain data rebuilt,
    and a value ``copy.deepcopy`` refuses (a lock, a client handle in a row built in Python) passed as it is, where
    ``copy.deepcopy`` of the whole row ended the step on it."""
    import threading

    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.runtime.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    client = threading.Lock()
    seen = []

    def judge(prompts, completions, entry, handle, **columns):
        seen.append((entry, handle))
        return [0.0] * len(completions)

    rows = [{"prompt": f"{i} + 1?", "answer": str(i + 1), "handle": client, "tags": ["a"]} for i in range(4)]
    dm = RolloutDataModule(prompts=rows, val_size=0, prompts_per_step=2, reward_funcs=[judge],
                           sampling={"group_size": 2, "micro_group_size": 2, "max_new_tokens": 3})
    dm.attach(model, tokenizer)
    dm.setup("fit")
    dm.build_train_batch()
    entries, handles = seen[0]
    assert len(handles) == 4 and all(handle is client for handle in handles)
    assert all(entry["handle"] is client for entry in entries)
    assert len({id(entry) for entry in entries}) == 4 and len({id(entry["tags"]) for entry in entries}) == 4


def test_the_data_module_hands_its_settings_groups_to_the_builder_as_they_are(policy):
    """The data module's flat settings become the groups once; its builder reads those very groups (no copy that
    could drift), the module's objective handed over by ``attach``, and the accuracy reward resolved once."""
    model, tokenizer = policy
    rows = [{"prompt": f"{i} + 1?", "answer": str(i + 1)} for i in range(6)]
    dm = RolloutDataModule(prompts=rows, val_size=2, prompts_per_step=2, reward_funcs=["char_fraction", "math"],
                           over_provision=1.5, val_num_samples=2, on_reward_error="skip_group",
                           sampling={"group_size": 2, "max_new_tokens": 3})
    assert dm.training == TrainingConfig(prompts_per_step=2, over_provision=1.5)
    assert dm.validation == ValidationConfig(val_num_samples=2)
    assert dm.scoring == ScoringConfig(accuracy_reward="math", on_reward_error="skip_group")
    dm.attach(model, tokenizer, scale_rewards="none")
    dm.setup("fit")
    builder = dm._require_builder()
    assert builder.training is dm.training and builder.validation is dm.validation
    assert builder.scoring == dm.scoring and builder.advantage == AdvantageConfig(scale_rewards="none")
    assert builder.slot_memory.groups_per_rollout == dm.training.groups_per_rollout == 3


@pytest.mark.parametrize("make, match", [
    (lambda: TrainingConfig(prompts_per_step=0), r"prompts_per_step=0 must be an integer >= 1"),
    (lambda: TrainingConfig(dynamic_sampling="false"), r"dynamic_sampling='false' must be True or False"),
    (lambda: TrainingConfig(max_rollouts_per_step=0), r"max_rollouts_per_step=0 must be an integer >= 1"),
    (lambda: ValidationConfig(val_max_new_tokens=0),
     r"val_max_new_tokens=0 must be an integer >= 1 or None \(null in YAML: the sampling cap\)$"),
    (lambda: ValidationConfig(val_temperature=0.0), r"val_temperature=0.0 is not allowed"),
    (lambda: AdvantageConfig(scale_rewards="rank"), r"scale_rewards='rank' is not known"),
    (lambda: ScoringConfig(on_reward_error="ignore"), r"on_reward_error='ignore' is not known"),
])
def test_each_settings_group_refuses_a_bad_value_by_its_setting_name(make, match):
    """A builder made without the data module gets the same checks, named as the user's keys."""
    with pytest.raises(ValueError, match=match):
        make()
