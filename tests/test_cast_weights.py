"""Rollout weights under mixed precision (``CastWeights``, lit_grpo/runtime/distributed.py): the linear weights cast
once per rollout, so no weight is cast inside a decode step, and the rollout samples what per-step casts would."""

import pytest
import torch
from precision_helpers import WeightCasts

from lit_grpo.runtime.distributed import CastWeights, cast_names
from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.sampling import RolloutEngine

SETTINGS = dict(group_size=4, micro_group_size=3, strategy="continuous", max_new_tokens=8, temperature=1.0,
                seed=3)


@pytest.fixture(params=["tiny-llama", "tiny-qwen2"])
def tied(request):
    """A float32 tiny model whose LM head shares the embedding's weight (Qwen2's has biases too)."""
    model, tokenizer = load_model_and_tokenizer(request.param)
    model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval(), tokenizer


def _generate(model, tokenizer, prompts):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return RolloutEngine(model, tokenizer, **SETTINGS).generate(prompts)


def test_only_what_autocast_casts_is_copied_and_a_tied_embedding_stays_float32(tied):
    model, _ = tied
    weights = CastWeights(model, torch.bfloat16)
    replica = weights.module
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(cast_names(model, torch.bfloat16)) == {f"{n}.{p}" for n in linear
                                                      for p, _ in model.get_submodule(n).named_parameters()}
    assert cast_names(model, torch.float32) == []
    with weights.active() as module:
        assert module is replica and not replica.training
        head = replica.lm_head.weight
        assert head.dtype == torch.bfloat16 and torch.equal(head, model.lm_head.weight.to(torch.bfloat16))
        assert replica.model.embed_tokens.weight is model.model.embed_tokens.weight  # float32, shared
        assert replica.model.norm.weight is model.model.norm.weight
        for name in cast_names(model, torch.bfloat16):
            assert torch.equal(replica.get_parameter(name), model.get_parameter(name).to(torch.bfloat16)), name
        assert all(p.requires_grad for p in model.parameters())  # the masters keep training


def test_the_cast_weights_follow_the_masters_and_are_freed_after_the_scope(tied):
    model, _ = tied
    weights = CastWeights(model, torch.bfloat16)
    name = cast_names(model, torch.bfloat16)[0]
    cast = weights.module.get_parameter(name)
    assert cast.shape == model.get_parameter(name).shape and cast.untyped_storage().size() == 0  # before any scope
    with weights.active(keep=True):
        address = cast.data_ptr()
    assert cast.untyped_storage().size() == cast.numel() * 2  # kept: the engines' graphs read it
    with torch.no_grad():
        model.get_parameter(name).add_(0.5)  # an optimizer step
    with weights.active():
        assert weights.module.get_parameter(name) is cast and cast.data_ptr() == address  # graphs stay valid
        assert torch.equal(cast, model.get_parameter(name).to(torch.bfloat16))
    assert cast.untyped_storage().size() == 0
    assert weights.cast_bytes() == sum(model.get_parameter(n).numel() for n in cast_names(model, torch.bfloat16)) * 2


def test_a_linear_used_twice_has_one_copy():
    model, _ = load_model_and_tokenizer("tiny-llama")
    model.model.layers[1].mlp.down_proj = model.model.layers[0].mlp.down_proj
    weights = CastWeights(model, torch.bfloat16)
    first, second = (weights.module.model.layers[i].mlp.down_proj.weight for i in (0, 1))
    assert first is second and first.dtype == torch.bfloat16


def test_dora_and_a_policy_already_in_the_autocast_dtype_keep_the_per_step_casts():
    """What GRPOModule.rollout_weights() checks before taking CastWeights: a weight to cast, none read outside
    F.linear (DoRA's weight norm reads its float32 base weight)."""
    from lit_grpo.runtime.distributed import reads_weights_outside_linear
    from lit_grpo.runtime.models import with_lora

    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    assert not reads_weights_outside_linear(with_lora(load_model_and_tokenizer("tiny-qwen2")[0], lora))
    assert reads_weights_outside_linear(with_lora(load_model_and_tokenizer("tiny-qwen2")[0],
                                                  {**lora, "use_dora": True}))
    assert cast_names(load_model_and_tokenizer("tiny-qwen2", "bfloat16")[0], torch.bfloat16) == []


def test_no_weight_is_cast_inside_a_rollout_and_the_samples_are_the_per_step_casts(tied, prompt_ids):
    """Under bf16 autocast with float32 master weights the policy's rollout casts its linear weights at every
    step; on CastWeights none is cast, and the completions and log-probs are exactly those of the per-step casts
    (the same bfloat16 weights)."""
    model, tokenizer = tied
    weights = CastWeights(model, torch.bfloat16)
    with WeightCasts(model.parameters()) as per_step:
        reference = _generate(model, tokenizer, prompt_ids)
    assert per_step.count >= reference.stats.decode_steps * len(cast_names(model, torch.bfloat16))
    with weights.active() as replica, WeightCasts([*model.parameters(), *replica.parameters()]) as cast_once:
        result = _generate(replica, tokenizer, prompt_ids)
    assert cast_once.count == 0
    assert result.completion_ids == reference.completion_ids and result.logprobs == reference.logprobs
    assert reference.stats.generated_tokens > len(prompt_ids) * SETTINGS["group_size"]


def test_a_lora_policy_samples_the_same_on_its_cast_weights(prompt_ids):
    """peft's adapters are linear layers too: base and adapter weights are cast, the samples stay exact."""
    from lit_grpo.runtime.models import with_lora

    model, tokenizer = load_model_and_tokenizer("tiny-qwen2")
    policy = with_lora(model, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}).eval()
    with torch.no_grad():  # adapters that change the output (peft starts lora_B at zero)
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    names = cast_names(policy, torch.bfloat16)
    assert any("lora_A" in n for n in names) and any("base_layer" in n for n in names)
    reference = _generate(policy, tokenizer, prompt_ids)
    weights = CastWeights(policy, torch.bfloat16)
    with weights.active() as replica:
        result = _generate(replica, tokenizer, prompt_ids)
    assert result.completion_ids == reference.completion_ids and result.logprobs == reference.logprobs


def test_what_fits_in_free_memory_counts_the_allocators_unused_blocks(monkeypatch):
    """The cast copy's and the gathered weights' fits read free memory as the KV budget does: a tensor takes the
    caching allocator's unused blocks first."""
    from lit_grpo.runtime.distributed import fits_free_memory

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 40 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * 2**30)
    cuda = torch.device("cuda")
    assert fits_free_memory(15 * 2**30, cuda, share=0.5)  # half of 10 free + 30 cached
    assert not fits_free_memory(21 * 2**30, cuda, share=0.5)
    assert fits_free_memory(10**15, torch.device("cpu"), share=0.5)
