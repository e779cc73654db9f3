"""The shared-prefix update (lit_grpo.update.shared_prefix): each prompt forwarded once per micro-batch gives the same
log-probs, entropies and gradients as one forward per completion, with chunked or full logits, micro-batches that
split or merge groups, gradient checkpointing and LoRA; models that cannot share fall back with a warning.

The tiny models run in float64, but their RMSNorm computes in float32, so gradients agree to float32 rounding.
"""

import collections
import contextlib
import math
import gc
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_grpo.batch import pad_left, pad_right
from lit_grpo.rollout.prompts import render_prompt
from lit_grpo.update.logprobs import completion_logps, head_reproduces_logits
from lit_grpo.runtime.models import enable_activation_checkpointing, load_model_and_tokenizer
from lit_grpo.update import shared_prefix as shared_prefix_module
from lit_grpo.update.module import GRPOModule
from lit_grpo.update.shared_prefix import prompt_groups, shared_prefix_outputs, unsupported_reason

from test_module import make_datamodule

GRAD_TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def grouped_micro_batch(vocab: int, generator: torch.Generator) -> dict:
    """Two prompts (the second left-padded) x 3 completions of 1 to 5 tokens, rows of the two groups interleaved."""
    prompts = torch.randint(3, vocab, (2, 6), generator=generator)
    prompt_mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    group = torch.tensor([0, 1, 0, 1, 1, 0])
    completions = torch.randint(3, vocab, (6, 5), generator=generator)
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0],
                                    [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    attention_mask = torch.cat([prompt_mask[group], completion_mask], dim=1)
    return {"input_ids": torch.cat([prompts[group], completions], dim=1), "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "completion_ids": completions,
            "completion_mask": completion_mask}


class TokenCounter:
    """Counts the calls of ``module`` and the token positions (``[batch, tokens, ...]`` inputs) that go through it."""

    def __init__(self, module):
        self.tokens = self.calls = 0
        module.register_forward_hook(self)

    def __call__(self, module, inputs, output):
        self.tokens += inputs[0].shape[0] * inputs[0].shape[1]
        self.calls += 1


def run(model, micro, shared: bool, **kwargs):
    model.zero_grad(set_to_none=True)
    logps, entropy = completion_logps(model, micro, shared_prefix=shared, **kwargs)
    weights = torch.randn(logps.shape, generator=torch.Generator().manual_seed(1), dtype=logps.dtype)
    (logps * weights).sum().backward()
    return logps.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(shared, unshared, **tolerance):
    torch.testing.assert_close(shared[0], unshared[0], **tolerance)
    torch.testing.assert_close(shared[1], unshared[1], **tolerance)
    assert shared[2].keys() == unshared[2].keys() and len(unshared[2]) > 0
    for name in unshared[2]:
        torch.testing.assert_close(shared[2][name], unshared[2][name], msg=name, **GRAD_TOLERANCE)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prefix_equals_one_forward_per_completion(name, chunked, checkpointing):
    model, _ = load_model_and_tokenizer(name)
    model = model.double().train()
    if checkpointing:
        enable_activation_checkpointing(model)
    micro = grouped_micro_batch(model.config.vocab_size, torch.Generator().manual_seed(0))
    first, group = prompt_groups(micro)
    assert len(first) == 2 and group.tolist() in ([0, 1, 0, 1, 1, 0], [1, 0, 1, 0, 0, 1])
    head_reproduces_logits(model)  # its 4-token check, once per model, before counting
    # the final norm sees each forward's positions once (checkpointed layers run again in the backward)
    counter, lookups = TokenCounter(model.model.norm), TokenCounter(model.get_input_embeddings())
    shared = run(model, micro, True, chunked=chunked, temperature=0.7)
    shared_tokens, counter.tokens = counter.tokens, 0
    assert lookups.calls == 1  # one embedding lookup for both passes: one dense embedding gradient, as unshared
    unshared = run(model, micro, False, chunked=chunked, temperature=0.7)
    assert_same(shared, unshared)
    mask = micro["completion_mask"].bool()
    assert (shared[0][~mask] == 0).all() and (shared[0][mask] < 0).all()
    # the prompts' 12 tokens went forward once, not 18 times; each completion's last token not at all
    assert shared_tokens == 2 * 6 + 6 * 4 and counter.tokens == 6 * (6 + 5)


def test_shared_prefix_logits_match_on_smollm2():
    """The real model in float32 and its chat template: two questions, three sampled-like completions each."""
    model, tokenizer = load_model_and_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")
    model.train()
    questions = ["What is 3 + 4?", "Compute 9 - 5 and answer with the number only."]
    prompts = [render_prompt(tokenizer, q, "Answer with only the final number.") for q in questions]
    completions = [tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
                   for text in ("7", "The answer is 7.", "3 + 4 = 7", "4", "9 - 5 = 4", "It is 4")]
    prompt_ids, prompt_mask = pad_left(prompts, tokenizer.pad_token_id)
    completion_ids, completion_mask = pad_right(completions, tokenizer.pad_token_id)
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    attention_mask = torch.cat([prompt_mask[group], completion_mask], dim=1)
    micro = {"input_ids": torch.cat([prompt_ids[group], completion_ids], dim=1), "attention_mask": attention_mask,
             "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "completion_ids": completion_ids,
             "completion_mask": completion_mask}
    shared, unshared = run(model, micro, True), run(model, micro, False)
    torch.testing.assert_close(shared[0], unshared[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared[1], unshared[1], rtol=1e-5, atol=1e-5)
    # gradients: each parameter's relative error (float32 through 30 layers; the unshared update itself moves
    # by ~3e-4 when its rows go one at a time instead)
    assert unshared[2].keys() == shared[2].keys()
    for name, expected in unshared[2].items():
        error = float((shared[2][name] - expected).norm() / expected.norm())
        assert error < 5e-5, (name, error)


class WeightCasts(TorchDispatchMode):
    """Counts the casts of each of ``model``'s parameters (``aten._to_copy`` of its storage) while active."""

    def __init__(self, model):
        super().__init__()
        self.names = {p.data_ptr(): n for n, p in model.named_parameters()}
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.names:
            self.counts[self.names[args[0].data_ptr()]] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_two_passes_share_one_cast_of_each_weight_under_autocast(checkpointing):
    """Lightning's bf16-mixed autocast keeps no cast cache: each pass would cast every weight again and the
    backward would hold both casts. The passes share one (where the layers are checkpointed nothing holds the
    casts, and the cache stays off), the cache is off and empty afterwards, and the values are the unshared ones."""
    model, _ = load_model_and_tokenizer("tiny-qwen2")
    model.train()
    if checkpointing:
        enable_activation_checkpointing(model)
    micro = grouped_micro_batch(model.config.vocab_size, torch.Generator().manual_seed(0))
    decoder = [name for name, _ in model.model.layers.named_parameters(prefix="model.layers") if "proj" in name]
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        with WeightCasts(model) as casts:
            states = shared_prefix_outputs(model, micro, hidden=True)
        assert not torch.is_autocast_cache_enabled()
        passes = 2 if checkpointing else 1
        assert {casts.counts[name] for name in decoder} == {passes}
        unshared = model(**{k: micro[k] for k in ("input_ids", "attention_mask", "position_ids")},
                         output_hidden_states=True).hidden_states[-1][:, -micro["completion_ids"].shape[1] - 1:-1]
        torch.testing.assert_close(states, unshared, rtol=0.02, atol=0.02)  # bfloat16: two ways to add up
        with torch.no_grad():  # a step between two forwards of one autocast: the next forward sees it
            for param in model.parameters():
                param.mul_(0.5)
        again = shared_prefix_outputs(model, micro, hidden=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        fresh = shared_prefix_outputs(model, micro, hidden=True)
        with torch.no_grad(), WeightCasts(model) as frozen:  # no backward holds the casts: no cache to hold them
            shared_prefix_outputs(model, micro, hidden=True)
    assert not torch.equal(again, states)
    torch.testing.assert_close(again, fresh, rtol=0, atol=0)
    assert {frozen.counts[name] for name in decoder} == {2}


def test_one_shared_cast_gives_the_gradients_of_one_cast_per_pass(monkeypatch):
    """One process backs up in two stages, each upcasting its own gradients: sharing the cast changes no bit."""
    model, _ = load_model_and_tokenizer("tiny-qwen2")
    model.train()
    micro = grouped_micro_batch(model.config.vocab_size, torch.Generator().manual_seed(0))

    def grads():
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            return run(model, micro, True)

    shared = grads()
    monkeypatch.setattr(shared_prefix_module, "casts_shared_by_passes", lambda model: contextlib.nullcontext())
    separate = grads()
    for got, expected in zip(shared[:2], separate[:2]):
        assert torch.equal(got, expected)
    assert shared[2].keys() == separate[2].keys() and len(shared[2]) > 0
    assert all(torch.equal(shared[2][name], separate[2][name]) for name in shared[2])


@pytest.fixture(scope="module")
def rollout():
    module = GRPOModule(model="tiny-llama", max_grad_norm=None)
    module.configure_model()
    batch = make_datamodule(module, reward_funcs=["char_fraction", "accuracy"]).build_train_batch()
    assert batch.group_size == 4 and batch.advantages.abs().sum() > 0
    return batch


def step_grads(rollout, **kwargs):
    torch.manual_seed(0)  # the same LoRA initialization on both sides
    module = GRPOModule(model="tiny-llama", dtype="float64", max_grad_norm=None, **kwargs)
    module.configure_model()
    optimizer = torch.optim.SGD(module.policy.parameters(), lr=0.0)
    metrics = module.grpo_step(rollout, optimizer)
    grads = {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}
    return grads, metrics, module


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


@pytest.mark.parametrize("micro_rows", [3, 8])  # 3 splits the groups of 4 over micro-batches; 8 holds two groups
@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("lora", [False, True])
def test_the_update_with_a_shared_prefix_equals_the_unshared_one(rollout, micro_rows, checkpointing, lora):
    settings = dict(train_micro_batch_size=micro_rows, gradient_checkpointing=checkpointing,
                    peft_config=LORA if lora else None, loss={"beta": 0.1 if lora else 0.0}, num_iterations=1)
    shared, shared_metrics, module = step_grads(rollout, shared_prefix=True, **settings)
    assert module.uses_shared_prefix is True
    unshared, metrics, _ = step_grads(rollout, shared_prefix=False, **settings)
    assert shared.keys() == unshared.keys() and len(unshared) > 0
    if lora:
        assert all("lora_" in name for name in shared)
    for name in unshared:
        torch.testing.assert_close(shared[name], unshared[name], msg=name, **GRAD_TOLERANCE)
    for key in ("train/loss", "train/entropy", "train/grad_norm", "train/clip_ratio_high"):
        assert shared_metrics[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-9), key
    assert metrics["train/grad_norm"] > 0


def live_tensors() -> int:
    gc.collect()
    return sum(isinstance(obj, torch.Tensor) for obj in gc.get_objects())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_process_backs_up_in_two_stages_and_a_process_group_in_one(monkeypatch, checkpointing):
    """Alone, a decoder weight's pass-2 gradient goes into ``.grad`` before pass 1's backward starts (two
    accumulations per backward, the top layer's first), so no layer's gradient waits for pass 1; in a process group
    (DDP, FSDP) each parameter's gradient arrives once. Both give the unshared gradients."""
    model, _ = load_model_and_tokenizer("tiny-llama", dtype="float64")
    if checkpointing:
        enable_activation_checkpointing(model)
    micro = grouped_micro_batch(model.config.vocab_size, torch.Generator().manual_seed(0))
    layers = model.model.layers
    order = []
    for index in (0, len(layers) - 1):
        layers[index].mlp.down_proj.weight.register_post_accumulate_grad_hook(lambda _, i=index: order.append(i))
    unshared = run(model, micro, False)
    assert order == [len(layers) - 1, 0]
    order.clear()
    live = live_tensors()
    assert_same(run(model, micro, True), unshared, rtol=1e-6, atol=1e-8)
    assert order == [len(layers) - 1, 0, len(layers) - 1, 0]  # pass 2 (top layer down), then pass 1
    # nothing of the two stages outlives the backward (the .grad existed already); at most: an earlier test's
    # objects may be collected meanwhile
    assert live_tensors() <= live
    order.clear()
    monkeypatch.setattr("lit_grpo.update.shared_prefix.is_multi_process", lambda: True)
    assert_same(run(model, micro, True), unshared, rtol=1e-6, atol=1e-8)
    assert order == [len(layers) - 1, 0]


class IgnoresThePast(torch.nn.Module):
    """A causal LM wrapper that drops ``past_key_values``: sharing would silently lose the prompt."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, past_key_values=None, **kwargs):
        return self.model(**kwargs)


def test_a_model_that_ignores_the_cache_is_refused_not_silently_wrong():
    model, _ = load_model_and_tokenizer("tiny-llama")
    micro = grouped_micro_batch(model.config.vocab_size, torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match="IgnoresThePast wrote no keys into the shared prefix cache"):
        shared_prefix_outputs(IgnoresThePast(model), micro, hidden=False)


def test_prompts_must_be_left_padded():
    model, _ = load_model_and_tokenizer("tiny-llama")
    micro = grouped_micro_batch(model.config.vocab_size, torch.Generator().manual_seed(3))
    micro["attention_mask"][:, 5] = 0  # the last prompt column is padding: right-padded prompts
    with pytest.raises(ValueError, match=r"left-padded prompts.*prompt_length=6 and last prompt column mask \[0, "):
        shared_prefix_outputs(model, micro, hidden=True)


def test_sliding_window_models_fall_back_with_a_warning(monkeypatch):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                         max_window_layers=0)
    sliding = AutoModelForCausalLM.from_config(config)
    assert "DynamicSlidingWindowLayer" in unsupported_reason(sliding)
    tiny, _ = load_model_and_tokenizer("tiny-llama")
    assert unsupported_reason(tiny) is None
    assert "takes no past_key_values" in unsupported_reason(
        type("NoPast", (torch.nn.Module,), {"config": tiny.config, "forward": lambda self, input_ids: None})())

    import lit_grpo.update.shared_prefix as shared_prefix

    monkeypatch.setattr(shared_prefix, "unsupported_reason", lambda model: "sliding-window layers (for the test)")
    module = GRPOModule(model="tiny-llama", shared_prefix=True)
    with pytest.warns(UserWarning, match=r"shared_prefix=True is not exact for LlamaForCausalLM: sliding-window "
                                         r"layers \(for the test\); the update runs one forward per completion"):
        module.configure_model()
    assert module.uses_shared_prefix is False
    for setting in (False, "auto"):  # asked for no sharing, or for sharing where it pays: nothing to warn about
        quiet = GRPOModule(model="tiny-llama", shared_prefix=setting)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            quiet.configure_model()
        assert quiet.uses_shared_prefix is False


def test_a_model_that_drops_the_cache_under_checkpointing_trains_unshared(rollout, monkeypatch):
    """GPT-2's forward hands its layers no cache while they checkpoint (the default): ``unsupported_reason`` says so
    (found by running it, not by its name), True warns and "auto" says nothing, and the update runs one forward per
    completion. Without checkpointing it shares."""
    from test_architectures import ARCHITECTURES, tiny_architecture

    model_type, fields = ARCHITECTURES["gpt2"]
    monkeypatch.setattr(GRPOModule, "_load_model", lambda self: tiny_architecture(model_type, **fields)[0])
    module = GRPOModule(model="tiny-llama", shared_prefix=True, max_grad_norm=None)
    with pytest.warns(UserWarning, match=r"shared_prefix=True is not exact for GPT2LMHeadModel: its forward hands its "
                                         r"layers no cache under gradient checkpointing "
                                         r"\(model.gradient_checkpointing: false keeps it\); the update runs one "
                                         r"forward per completion instead"):
        module.configure_model()
    assert module.uses_shared_prefix is False and module.policy.training  # the probe left it in train mode
    metrics = module.grpo_step(rollout, torch.optim.SGD(module.policy.parameters(), lr=0.0))
    assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    auto = GRPOModule(model="tiny-llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto.configure_model()
    assert auto.uses_shared_prefix is False
    unchecked = GRPOModule(model="tiny-llama", shared_prefix=True, gradient_checkpointing=False)
    unchecked.configure_model()
    assert unchecked.uses_shared_prefix is True and unsupported_reason(unchecked.policy) is None

    def failing(model):
        raise RuntimeError("no such input")

    monkeypatch.setattr(shared_prefix_module, "drops_cache_under_checkpointing", failing)
    assert unsupported_reason(module.policy) == ("a one-token forward into the prefix cache failed (RuntimeError: no "
                                                 "such input)")


def test_the_probe_finds_the_cache_kept_where_checkpointed_layers_drop_it_without_gradients(monkeypatch):
    """transformers versions whose checkpointed layers drop the cache in train mode with or without gradients (their
    rule: ``gradient_checkpointing and training``): the probe still finds that a model whose own forward passes the
    cache keeps it, as the shared forward lets its layers keep it (``caches_through_checkpoints``)."""
    import types

    from transformers import modeling_layers

    class GradientsOn(types.ModuleType):  # torch as that module sees it, saying gradients are on
        def __getattr__(self, name):
            return (lambda: True) if name == "is_grad_enabled" else getattr(torch, name)

    module = GRPOModule(model="tiny-llama", shared_prefix=False)
    module.configure_model()
    monkeypatch.setattr(modeling_layers, "torch", GradientsOn("torch"))
    assert shared_prefix_module.drops_cache_under_checkpointing(module.policy) is False


def test_auto_shares_where_the_spared_work_pays_for_the_second_pass(monkeypatch):
    """The rule against what tools.bench_update measured on a CPU (AMD EPYC, docs/training.md), shared / unshared
    time: tiny-llama (36,992 parameters a layer, 8 completion tokens) 1.57 x at 8 rows of one 64-token prompt and
    0.74 x at 192 tokens, 1.25 x at 4 rows of 128 and 0.92 x at 256; SmolLM2 (3,540,096 a layer), 8 rows of one
    prompt, 0.94 x at 16 tokens. On a GPU (provisional) the issue's H200 shape (8 rows of a 50-token prompt, Qwen3-1.7B)
    stays unshared and 2,048-token prompts share."""
    from lit_grpo.update import logprobs
    from lit_grpo.update.shared_prefix import layer_parameters, saved_positions, shared_prefix_pays

    tiny, _ = load_model_and_tokenizer("tiny-llama", dtype="float32")
    assert layer_parameters(tiny) == 36992
    assert saved_positions(8, 1, 16) == 112 and saved_positions(4, 4, 99) == 0
    measured = {(8, 1, 64, 36992): False, (8, 1, 192, 36992): True, (4, 1, 128, 36992): False,
                (4, 1, 256, 36992): True, (8, 1, 16, 3540096): True}  # (m, u, P', per layer): shared was faster
    for (rows, prompts, length, per_layer), faster in measured.items():
        assert shared_prefix_pays(saved_positions(rows, prompts, length), per_layer, "cpu") is faster
    qwen3_layer = 50_000_000
    assert not shared_prefix_pays(saved_positions(8, 1, 50), qwen3_layer, "cuda")
    assert shared_prefix_pays(saved_positions(8, 1, 2048), qwen3_layer, "cuda")
    with pytest.raises(ValueError, match=r"num_rows=2, num_prompts=3"):
        saved_positions(2, 3, 5)

    micro = grouped_micro_batch(tiny.config.vocab_size, torch.Generator().manual_seed(0))
    calls = []
    monkeypatch.setattr(logprobs, "shared_prefix_outputs",
                        lambda *args, **kwargs: calls.append(1) or shared_prefix_outputs(*args, **kwargs))
    for pays in (True, False):
        monkeypatch.setitem(logprobs.__dict__, "shared_prefix_pays", lambda *args, pays=pays: pays)
        completion_logps(tiny, micro, shared_prefix="auto")
    assert len(calls) == 1  # "auto" follows the rule
    completion_logps(tiny, micro, shared_prefix=True)
    assert len(calls) == 2  # True shares regardless


def test_auto_decides_each_micro_batch_once_and_alike_on_every_fsdp_rank(monkeypatch):
    """Each rank's prompts have their own length, so "auto" would decide apart; under FSDP2 a rank sharing runs its
    sharded layers twice, gathering their weights each time, and the others would wait on those gathers. The module
    decides each micro-batch once, and under FSDP2 takes the max over the ranks' decisions (one reduce a step)."""
    from types import SimpleNamespace

    from lit_grpo.update import logprobs
    from lit_grpo.update import module as module_module

    module = GRPOModule(model="tiny-llama", shared_prefix="auto", train_micro_batch_size=4)
    module.configure_model()
    batch = make_datamodule(module).build_train_batch()
    calls = []
    monkeypatch.setattr(logprobs, "shared_prefix_outputs",
                        lambda *args, **kwargs: calls.append(1) or shared_prefix_outputs(*args, **kwargs))
    chunks = module._micro_batches(batch)
    assert len(chunks) > 1 and not any(micro["shared_prefix"] for _, micro in chunks)  # short prompts: no pay
    module._logps(module.policy, chunks[0][1], batch.temperature)
    assert calls == []

    reduced = []

    def reduce(votes, reduce_op):  # another rank whose longer prompts pay for sharing
        reduced.append((votes.tolist(), reduce_op))
        return torch.maximum(votes, torch.ones_like(votes))

    module._trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(reduce=reduce))
    monkeypatch.setattr(module_module, "is_fsdp_sharded", lambda model: True)
    chunks = module._micro_batches(batch)
    assert reduced == [([0.0] * len(chunks), "max")]  # this rank's votes, once for the step
    assert all(micro["shared_prefix"] for _, micro in chunks)
    module._logps(module.policy, chunks[0][1], batch.temperature)
    assert calls == [1]


def test_without_the_batchs_groups_rows_share_a_prompt_only_with_equal_tokens_and_mask():
    # rows 0 and 2 are one prompt; row 1 has row 0's ids, but its first id is a real token, not padding
    micro = {"input_ids": torch.tensor([[0, 5, 6, 9], [0, 5, 6, 8], [0, 5, 6, 7]]),
             "attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]]),
             "completion_ids": torch.tensor([[9], [8], [7]])}
    first, group = prompt_groups(micro)
    assert group[0] == group[2] != group[1] and sorted(first.tolist()) == [0, 1]
