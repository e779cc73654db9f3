"""Decoder architectures the rollout engine and the update run exactly: tiny random models of each family that
transformers ships, float32 on the CPU (the repo's byte-level tokenizer, 2 layers of width 64, GQA where the family
has it, options that change the forward set off their defaults), each checked as tests/test_engine.py checks
tiny-llama: the engine's greedy completions are ``model.generate``'s, its sampled log-probs the update's
``completion_logps``, the shared-prefix update's log-probs and gradients the unshared one's, and oneDNN's packed
linears (the CPU's default) sample what torch's ``F.linear`` samples. docs/training.md lists the families and
the refusals.
"""

import re
import warnings

import pytest
import torch
from transformers import AutoConfig

from lit_grpo.batch import pad_left, pad_right
from lit_grpo.runtime.models import (TINY_SLIDING_WINDOW, _seeded_model, _special_token_ids, disable_dropout,
                                     prepare_tokenizer, tiny_tokenizer)
from lit_grpo.sampling import RolloutEngine
from lit_grpo.sampling.prefill import pack_chunk, packed_forward
from lit_grpo.update.logprobs import completion_logps, head_reproduces_logits, logits_multiplier
from precision_helpers import assert_greedy_margin
from prefill_helpers import assert_packed_logits_equal_alone

from conftest import PROMPT_TEXTS

#: What every tiny model shares; an architecture's own fields below override it (None: left out, its default).
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
               logits_scaling=8.0)

WINDOW = TINY_SLIDING_WINDOW
SLIDING_FULL = ["sliding_attention", "full_attention"]

#: name: (model_type, its fields). Each field set tests what its family adds to Llama's forward.
ARCHITECTURES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "mistral": ("mistral", dict(sliding_window=None)),
    "mixtral": ("mixtral", dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("qwen2", dict(use_sliding_window=False)),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, decoder_sparse_step=1, **MOE)),
    "qwen2_moe": ("qwen2_moe", dict(decoder_sparse_step=1, shared_expert_intermediate_size=64, **MOE)),
    "phi3": ("phi3", dict(sliding_window=None)),  # fused qkv_proj and gate_up_proj
    "phi4-mini": ("phi3", dict(sliding_window=None, partial_rotary_factor=0.75, tie_word_embeddings=True)),
    "phi": ("phi", {}),  # partial rotary, LayerNorm, a biased head
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2)),  # its second layer without rotary (NoPE)
    "olmo": ("olmo", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", GRANITE),
    "granitemoe": ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2, **GRANITE)),
    "gemma": ("gemma", dict(head_dim=16)),  # embeddings scaled by sqrt(hidden)
    "glm": ("glm", {}),
    "glm4": ("glm4", {}),
    "cohere": ("cohere", dict(logit_scale=0.0625, use_qk_norm=True)),
    "stablelm": ("stablelm", dict(partial_rotary_factor=0.25, qk_layernorm=True)),
    "starcoder2": ("starcoder2", dict(sliding_window=None)),
    "nemotron": ("nemotron", {}),
    "gpt_neox": ("gpt_neox", dict(num_key_value_heads=None)),
    "gpt2": ("gpt2", dict(num_key_value_heads=None)),
    "helium": ("helium", dict(head_dim=16)),
    "ernie4_5": ("ernie4_5", {}),
    "arcee": ("arcee", {}),
    "seed_oss": ("seed_oss", {}),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", dict(head_dim=16)),
    "exaone4": ("exaone4", dict(sliding_window=None, sliding_window_pattern=None,
                                layer_types=["full_attention"] * 2)),
    "bitnet": ("bitnet", {}),
    # Sliding-window attention, window 6: the prompts' 7 and 16 tokens and the completions pass it. SLIDING_FULL:
    # the first layer slides, the second attends in full (those with layer_types); the others slide in every layer.
    "mistral-sliding": ("mistral", dict(sliding_window=WINDOW)),
    "mixtral-sliding": ("mixtral", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen2_moe-sliding": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                            decoder_sparse_step=1, shared_expert_intermediate_size=64, **MOE)),
    "qwen3-sliding": ("qwen3", dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3_moe-sliding": ("qwen3_moe", dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                                            decoder_sparse_step=1, **MOE)),
    "phi3-sliding": ("phi3", dict(sliding_window=WINDOW)),
    "starcoder2-sliding": ("starcoder2", dict(sliding_window=WINDOW)),
    "smollm3-sliding": ("smollm3", dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=SLIDING_FULL)),
    "ministral": ("ministral", dict(head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_FULL)),
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_FULL,
                              attn_implementation="eager")),  # soft-capped attention scores and logits
    "gemma3_text": ("gemma3_text", dict(head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_FULL)),
    "gemma4_text": ("gemma4_text", dict(head_dim=16, global_head_dim=16, sliding_window=WINDOW,
                                        layer_types=SLIDING_FULL, hidden_size_per_layer_input=8,
                                        num_kv_shared_layers=0)),  # per-layer inputs; one head_dim, no shared KV
    "vaultgemma": ("vaultgemma", dict(head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_FULL)),
    "olmo3": ("olmo3", dict(sliding_window=WINDOW, layer_types=SLIDING_FULL)),
    "gpt_oss": ("gpt_oss", dict(head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_FULL, num_local_experts=4,
                                num_experts_per_tok=2)),  # attention sinks, in eager attention
    "cohere2": ("cohere2", dict(sliding_window=WINDOW, layer_types=SLIDING_FULL, logit_scale=0.0625)),
    "cohere2_moe": ("cohere2_moe", dict(sliding_window=WINDOW, layer_types=SLIDING_FULL, logit_scale=0.0625, **MOE)),
    "exaone4-sliding": ("exaone4", dict(sliding_window=WINDOW, sliding_window_pattern=None, layer_types=SLIDING_FULL)),
    "exaone_moe": ("exaone_moe", dict(sliding_window=WINDOW, layer_types=SLIDING_FULL, **MOE)),
    "granite_swa": ("granite_swa", dict(sliding_window=WINDOW, layer_types=SLIDING_FULL, **GRANITE)),
    "granitemoe_swa": ("granitemoe_swa", dict(sliding_window=WINDOW, layer_types=SLIDING_FULL, num_local_experts=4,
                                              num_experts_per_tok=2, **GRANITE)),
    "afmoe": ("afmoe", dict(sliding_window=WINDOW, layer_types=SLIDING_FULL, **MOE)),
    "cwm": ("cwm", dict(sliding_window=WINDOW, layer_types=SLIDING_FULL)),
    "flint": ("flint", dict(sliding_window=WINDOW, layer_types=SLIDING_FULL)),
    "lfm3": ("lfm3", dict(sliding_window=WINDOW, layer_types=SLIDING_FULL)),
    "mellum": ("mellum", dict(head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_FULL, **MOE)),
    "lara_mini": ("lara_mini", dict(head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_FULL,
                                    shared_expert_intermediate_size=64, **MOE)),
    "laguna": ("laguna", dict(head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_FULL,
                              shared_expert_intermediate_size=64, **MOE)),
    "dots1": ("dots1", dict(sliding_window=WINDOW, layer_types=SLIDING_FULL, n_routed_experts=4, n_shared_experts=1,
                            num_experts_per_tok=2, moe_intermediate_size=32)),
    "kolibri1": ("kolibri1", dict(head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_FULL, num_local_experts=4,
                                  shared_expert_intermediate_size=64, **MOE)),
}


def tiny_architecture(model_type: str, **fields):
    """(float32 model, tokenizer): a seeded tiny model of ``model_type`` over the repo's test tokenizer."""
    tokenizer = prepare_tokenizer(tiny_tokenizer())
    merged = {key: value for key, value in {**COMMON, **fields}.items() if value is not None or key not in COMMON}
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **merged, **_special_token_ids(tokenizer))
    return _seeded_model(config, torch.float32, torch.device("cpu"), tokenizer), tokenizer


def micro_batch(prompts, completions, pad):
    """The update's micro-batch of a rollout: each group's prompt (left-padded) beside each of its completions."""
    rows = [(prompt, completion) for prompt, group in zip(prompts, completions) for completion in group]
    prompt_ids, prompt_mask = pad_left([prompt for prompt, _ in rows], pad)
    completion_ids, completion_mask = pad_right([completion for _, completion in rows], pad)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    return {"input_ids": torch.cat([prompt_ids, completion_ids], dim=1), "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "completion_ids": completion_ids,
            "completion_mask": completion_mask}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_the_engine_and_the_update_run_the_architecture_exactly(name):
    model_type, fields = ARCHITECTURES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a family's notes on a random config (rope fields, optional kernels)
        model, tokenizer = tiny_architecture(model_type, **fields)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPT_TEXTS]
    # greedy: the packed prefill of three prompts and a decode step of three slots give generate's tokens
    greedy = RolloutEngine(model, tokenizer, group_size=2, micro_group_size=3, strategy="continuous",
                           max_new_tokens=8, temperature=0.0).generate(prompts)
    for prompt, completions in zip(prompts, greedy.completion_ids):
        expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
        assert_greedy_margin(model, prompt, expected)  # no near tie that other kernels could break
        assert completions == [expected, expected]
    # sampled: oneDNN's packed linears (the CPU's default) and torch's draw the same tokens
    sampled = {}
    for kernel in ("packed", "torch"):
        engine = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, strategy="continuous",
                               max_new_tokens=8, temperature=0.7, seed=3, cpu_linear=kernel)
        sampled[kernel] = engine.generate(prompts)
    result = sampled["packed"]
    assert result.completion_ids == sampled["torch"].completion_ids
    micro = micro_batch(prompts, result.completion_ids, tokenizer.eos_token_id)
    sampler = pad_right([logps for group in result.logprobs for logps in group], 0.0, dtype=torch.float32)[0]
    mask = micro["completion_mask"].bool()
    # Precision: float32 forwards of other shapes and kernels (a slot cache's decode step, a packed prefill, a
    # whole-sequence forward) round each log-prob differently, by a few float32 ulps of |log-prob| ~ 6.
    with torch.no_grad():
        for shared_prefix in (False, True):
            update, _ = completion_logps(model, micro, 0.7, shared_prefix=shared_prefix)
            torch.testing.assert_close(update[mask], sampler[mask], rtol=0, atol=1e-5)
    # the update's gradients (train mode, dropout off) with the shared prefix are the unshared forward's
    disable_dropout(model.train())
    gradients = {}
    for shared_prefix in (False, True):
        model.zero_grad(set_to_none=True)
        update, _ = completion_logps(model, micro, 0.7, shared_prefix=shared_prefix)
        (update * torch.linspace(-1, 1, update.numel()).view(update.shape)).sum().backward()
        gradients[shared_prefix] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert gradients[True].keys() == gradients[False].keys() and gradients[False]
    for parameter, unshared in gradients[False].items():  # float32 rounding of sums in another order
        torch.testing.assert_close(gradients[True][parameter], unshared, rtol=0,
                                   atol=1e-5 * float(unshared.abs().max()), msg=parameter)
    # the update ran its chunked head: Granite's and Cohere's logit scales are folded into its temperature; a
    # soft-capped head (Gemma 2's, VaultGemma's) the whole logits
    assert head_reproduces_logits(model) == (getattr(model.config, "final_logit_softcapping", None) is None)


def test_a_layer_that_drops_its_keyword_arguments_keeps_the_packed_prompts_apart():
    """StableLM's decoder layers do not pass their keyword arguments on to their attention: the packed prefill's
    lengths reach it beside the forward, so each prompt's keys are those it has alone."""
    model, tokenizer = tiny_architecture("stablelm")
    prompts = [tokenizer(text)["input_ids"] for text in PROMPT_TEXTS[:2]]
    assert_packed_logits_equal_alone(model, prompts)


def test_a_packed_prefill_whose_layers_never_call_the_packed_attention_is_refused():
    model, _ = tiny_architecture("llama")
    chunk = pack_chunk([[5, 6, 7], [8, 9]], torch.device("cpu"))
    with pytest.raises(ValueError, match=r"a packed prefill of LlamaForCausalLM \(llama\) called the registered "
                                         r"attention function 0 times for its 2 attention layers"):
        with packed_forward(model, chunk):
            pass  # a forward whose attention picks its own kernel calls none
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("model_type", ["falcon", "bloom"])
def test_an_attention_outside_transformers_interface_is_refused_when_the_engine_is_built(model_type):
    """Falcon's attention compares the implementation's name with "sdpa" rather than looking it up (the engine's
    decode and prefill attention would never run); BLOOM's builds its ALiBi biases from a 2-D mask, where the slot
    cache passes a 4-D one."""
    model, tokenizer = tiny_architecture(model_type, num_key_value_heads=None)
    name = type(model).__name__
    with pytest.raises(ValueError, match=rf"cannot run this model exactly: {name} \({model_type}\) does not look "
                                         r"its attention up in transformers' attention interface"):
        RolloutEngine(model, tokenizer, group_size=2)


@pytest.mark.parametrize("model_type, rates", [
    ("seed_oss", dict(attention_dropout=0.1, residual_dropout=0.1)),
    ("starcoder2", dict(attention_dropout=0.1, residual_dropout=0.1, embedding_dropout=0.1, sliding_window=None)),
])
def test_disable_dropout_zeroes_the_rates_a_forward_applies_by_functional_dropout(model_type, rates):
    """Seed-OSS and StarCoder2 keep their residual (and embedding) dropout as float attributes that their forward
    hands to ``F.dropout``, as transformers' attention does its ``attention_dropout``: a model in train mode then
    computes one input twice alike only once they are 0."""
    model, _ = tiny_architecture(model_type, **rates)
    ids = torch.arange(3, 19).unsqueeze(0)
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, model(ids).logits)
        disable_dropout(model)
        assert torch.equal(model(ids).logits, model(ids).logits)
    assert model.config.residual_dropout == 0.1  # the config keeps its value: an export writes the model loaded


@pytest.mark.parametrize("model_type, fields, multiplier", [
    ("granite", dict(logits_scaling=8.0), 1 / 8), ("cohere", dict(logit_scale=0.0625), 0.0625), ("llama", {}, 1.0)])
def test_the_chunked_head_takes_the_logit_scale_the_model_applies(model_type, fields, multiplier):
    """Granite divides its head's output by ``logits_scaling``, Cohere multiplies it by ``logit_scale``: the chunks
    do the same (``logits_multiplier``), so the update keeps its bounded logits for them, with the log-probs and
    entropies of the whole logits; a config field that does not say what the forward does leaves the whole logits."""
    model, _ = tiny_architecture(model_type, **fields)
    assert logits_multiplier(model) == multiplier and head_reproduces_logits(model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    micro = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1),
             "completion_ids": ids[:, 4:], "completion_mask": mask[:, 4:]}
    with torch.no_grad():
        for temperature in (0.0, 0.7):
            chunked = completion_logps(model, micro, temperature, chunk_bytes=4)
            whole = completion_logps(model, micro, temperature, chunked=False)
            for got, want in zip(chunked, whole):  # float32 products of other shapes: a few ulps of |value| ~ 6
                torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    if model_type == "llama":  # a field Llama's forward does not read: checked, and left to the whole logits
        stray = tiny_architecture(model_type)[0]
        stray.config.logits_scaling = 8.0
        assert logits_multiplier(stray) == 1 / 8 and not head_reproduces_logits(stray)


def test_a_soft_capped_head_gets_the_whole_logits():
    """Gemma 2's logits are ``cap * tanh(head / cap)``: at a random model's small logits the cap moves them by less
    than the head check's tolerance, yet the log-probs by 1e-5 and more; the update takes the whole logits for it."""
    model, _ = tiny_architecture("gemma2", head_dim=16, attn_implementation="eager", final_logit_softcapping=30.0)
    assert not head_reproduces_logits(model)
    ids = torch.arange(3, 21).view(2, 9)
    mask = torch.ones_like(ids)
    micro = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1),
             "completion_ids": ids[:, 4:], "completion_mask": mask[:, 4:]}
    with torch.no_grad():
        got, _ = completion_logps(model, micro, 0.7)
        want = torch.log_softmax(model(ids).logits[:, 3:-1].float() / 0.7, dim=-1)
    torch.testing.assert_close(got, want.gather(-1, ids[:, 4:, None])[..., 0], rtol=0, atol=2e-6)


def test_attention_sinks_switched_to_sdpa_are_refused_rather_than_dropped():
    """gpt-oss's attention hands its sinks to the attention function (``s_aux``), which transformers' SDPA ignores:
    transformers loads the family in eager attention; a config switched to SDPA afterwards is refused when the
    engine's attention gets the sinks, by the decode step and the packed prefill alike."""
    model, tokenizer = tiny_architecture("gpt_oss", **ARCHITECTURES["gpt_oss"][1])
    assert model.config._attn_implementation == "eager"
    model.config._attn_implementation = "sdpa"
    prompts = [tokenizer(text)["input_ids"] for text in PROMPT_TEXTS]
    for micro_group_size in (1, 3):  # a prompt prefilled alone, then decoded; three packed
        engine = RolloutEngine(model, tokenizer, group_size=1, micro_group_size=micro_group_size, max_new_tokens=4)
        with pytest.raises(ValueError, match=r"GptOssAttention passes attention sinks \(s_aux\), which SDPA does "
                                             r"not compute; load the model with attn_implementation='eager'"):
            engine.generate(prompts[:micro_group_size])


def test_layers_that_cache_other_widths_than_the_config_gives_are_refused():
    """MiMo-V2-Flash's sliding layers cache twice the config's key/value heads, and its values are v_head_dim wide:
    the slot cache, sized by ``num_key_value_heads x head_dim``, refuses the prefix KV naming the layer's widths."""
    model, tokenizer = tiny_architecture("mimo_v2_flash", head_dim=16, v_head_dim=8, sliding_window=WINDOW,
                                         layer_types=SLIDING_FULL, **MOE)
    engine = RolloutEngine(model, tokenizer, group_size=1, max_new_tokens=4)
    with pytest.raises(ValueError, match=re.escape(
            "layer 0 of this model (mimo_v2_flash) caches keys of 4 heads x 16 and values of 4 heads x 8, where "
            "the slot cache, sized by the config's num_key_value_heads x head_dim, holds 2 x 16")):
        engine.generate([tokenizer(PROMPT_TEXTS[0])["input_ids"]])
