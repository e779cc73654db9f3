"""Prompt prefills run in chunks: which prompts share a forward, and that sharing one changes nothing they compute
beyond rounding, and nothing at all between strategies."""

import re

import pytest
import torch
from transformers import DynamicCache

from lit_grpo.runtime.models import cache_keyword
from lit_grpo.sampling import RolloutEngine, rollout_loop
from lit_grpo.sampling.kv_cache import cache_layers_kv
from lit_grpo.sampling.prefill import (block_causal_mask, pack_chunk, packed_attention, packed_forward,
                                      prefill_chunks, split_prefixes)
from prefill_helpers import assert_packed_logits_equal_alone
from scheduler_helpers import trust_predictions


@pytest.mark.parametrize("lengths, max_tokens, chunks", [
    ([60, 0, 39, 36, 700, 44], 200, [[0, 2, 3], [4], [5]]),  # 135 + 700 > 200; 700 runs alone; 0: no prefix
    ([5, 5, 5, 5], 20, [[0, 1, 2, 3]]),  # exactly at the budget
    ([5, 5, 5, 5], 19, [[0, 1, 2], [3]]),
    ([3, 9, 7, 1], 18, [[0, 1], [2, 3]]),  # consecutive runs only: 2 would fit beside 0 but not after 1
    ([0, 0], 8, []),
    ([4], 1, [[0]]),  # a prefix over the budget still runs, alone
])
def test_chunks_are_runs_of_consecutive_prompts_within_the_padded_budget(lengths, max_tokens, chunks):
    assert prefill_chunks(lengths, max_tokens) == chunks


@pytest.mark.parametrize("lengths, max_tokens, message", [
    ([3], 0, "max_tokens=0 must be an integer >= 1"),
    ([3, -1], 8, "prefix_lengths[1]=-1 must be an integer >= 0"),
    ([2.5], 8, "prefix_lengths[0]=2.5 must be an integer >= 0"),
])
def test_a_bad_budget_or_length_is_refused_by_name(lengths, max_tokens, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        prefill_chunks(lengths, max_tokens)


def test_a_packed_chunk_lays_the_prefixes_end_to_end_each_from_position_0():
    packed = pack_chunk([[4, 5, 6], [7], [8, 9]], torch.device("cpu"))
    assert packed.input_ids.tolist() == [[4, 5, 6, 7, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert packed.lengths == [3, 1, 2] and packed.offsets == [0, 3, 4]
    mask = block_causal_mask(packed.lengths, torch.bfloat16, torch.device("cpu"))
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bfloat16
    assert mask.min() == torch.finfo(torch.bfloat16).min
    assert (mask[0, 0] == 0).int().tolist() == [[1, 0, 0, 0, 0, 0],
                                                [1, 1, 0, 0, 0, 0],
                                                [1, 1, 1, 0, 0, 0],
                                                [0, 0, 0, 1, 0, 0],
                                                [0, 0, 0, 0, 1, 0],
                                                [0, 0, 0, 0, 1, 1]]
    for bad in ([], [[4], []]):
        with pytest.raises(ValueError, match="a prefill chunk needs one or more non-empty prefixes; got lengths"):
            pack_chunk(bad, torch.device("cpu"))


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_chunk_computes_each_prompts_prefix_as_it_would_alone(tiny, implementation):
    """SDPA: each prefix's attention on its own; eager: the block-diagonal mask. Either way a member's KV is its
    own, and the model's attention is restored after. Precision: SDPA runs float64 end to end, so packed and alone
    agree to 1e-12; transformers' eager attention takes its softmax in float32 whatever the model's dtype, and how
    the packed and the lone rows vectorize (AVX2 or AVX-512) changes that float32 rounding (~1e-7 relative), which
    the next layer's keys and values carry: 1e-6 there."""
    model, tokenizer = tiny
    tolerance = 1e-12 if implementation == "sdpa" else 1e-6
    prefixes = [tokenizer(text)["input_ids"] for text in ["What is 2+3?", "Compute 7 * 8.", "hi"]]
    model.config._attn_implementation = implementation
    try:
        with torch.inference_mode():
            packed = pack_chunk(prefixes, torch.device("cpu"))
            cache = DynamicCache(config=model.config)
            with packed_forward(model, packed) as inputs:
                assert set(inputs) == {"position_ids"} if implementation == "sdpa" else {"position_ids",
                                                                                       "attention_mask"}
                model(input_ids=packed.input_ids, **{cache_keyword(model): cache}, use_cache=True, **inputs)
            assert model.config._attn_implementation == implementation
            together = split_prefixes(cache_layers_kv(cache), packed)
            for prefix, kv in zip(prefixes, together):
                alone = DynamicCache(config=model.config)
                model(input_ids=torch.tensor([prefix]), **{cache_keyword(model): alone}, use_cache=True)
                for (keys, values), (own_keys, own_values) in zip(kv, cache_layers_kv(alone)):
                    assert keys.shape == own_keys.shape == (1, own_keys.shape[1], len(prefix), own_keys.shape[3])
                    torch.testing.assert_close(keys, own_keys, rtol=tolerance, atol=tolerance)
                    torch.testing.assert_close(values, own_values, rtol=tolerance, atol=tolerance)
                    assert keys.untyped_storage().nbytes() == keys.nbytes  # a copy: the chunk's cache can be freed
    finally:
        model.config._attn_implementation = "sdpa"


def test_without_a_chunk_the_packed_attention_is_sdpa(tiny_llama):
    """Any call of the registered attention outside a packed forward's block is SDPA's, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attention = tiny_llama[0].model.layers[0].self_attn
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 5, 8, generator=generator)  # 4 query heads over 2 key/value heads
    key, value = (torch.randn(2, 2, 5, 8, generator=generator) for _ in range(2))
    ours, _ = packed_attention(attention, query, key, value, None)
    sdpa, _ = sdpa_attention_forward(attention, query, key, value, None)
    assert torch.equal(ours, sdpa)  # exact: SDPA's own call on the same inputs


@pytest.mark.parametrize("chunk_tokens", [18, 1024])
def test_every_strategy_prefills_the_same_chunks_so_schedules_stay_bit_identical(tiny_llama, chunk_tokens,
                                                                                  monkeypatch):
    """float32: a prompt's KV depends in its rounding on its chunk, so a strategy
    that chunked by what it runs first (continuous, lazily) or all at once (infinite, for the prompt features)
    would differ in the log-probs. Bit-identical is a determinism claim: the same chunks, shapes and row-alone
    kernels in one process, so it holds on any CPU."""
    model, tokenizer = tiny_llama
    monkeypatch.setattr(rollout_loop, "PREFILL_CHUNK_TOKENS", chunk_tokens)
    prompts = [tokenizer(text)["input_ids"] for text in
               ["What is 2+3?", "Sum 7, 8 and 9.", "hi", "x", "Compute 6 * 7, step by step.", "abc"]]
    chunks = prefill_chunks([len(p) - 1 for p in prompts], chunk_tokens)
    assert chunks == ([[0, 1, 2], [4, 5]] if chunk_tokens == 18 else [[0, 1, 2, 4, 5]])
    results = {}
    for strategy in ("micro", "continuous", "infinite"):
        options = {"probe_tokens": 3, "predictor": "online"} if strategy == "infinite" else {}
        engine = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, strategy=strategy,
                               max_new_tokens=8, temperature=1.0, seed=3, **options)
        if strategy == "infinite":
            assert engine.scheduler.needs_prompt_features  # every prompt prefilled before the first step
            trust_predictions(engine.scheduler)
        results[strategy] = engine.generate(prompts)
    for strategy in ("continuous", "infinite"):
        assert results[strategy].completion_ids == results["micro"].completion_ids, strategy
        assert results[strategy].logprobs == results["micro"].logprobs, strategy


def test_a_lazy_strategy_holds_the_prefixes_of_one_chunk_ahead_at_most(tiny_llama, monkeypatch):
    """continuous runs the groups in order: a chunk's prefixes are kept only while their samples wait, and a chunk
    is prefilled once, when its first prompt starts."""
    model, tokenizer = tiny_llama
    monkeypatch.setattr(rollout_loop, "PREFILL_CHUNK_TOKENS", 24)
    prompts = [[7 + i] * 6 for i in range(6)]  # prefixes of 5: chunks of 4 prompts (20 <= 24 tokens)
    chunks = prefill_chunks([5] * 6, 24)
    assert chunks == [[0, 1, 2, 3], [4, 5]]
    held, forwards = [], []
    original_prefill = rollout_loop.RolloutLoop._prefill

    def prefill(loop, needed):
        forwards.append(sorted(needed))
        original_prefill(loop, needed)
        held.append(sorted(loop.store.prompts()))

    monkeypatch.setattr(rollout_loop.RolloutLoop, "_prefill", prefill)
    engine = RolloutEngine(model, tokenizer, group_size=2, micro_group_size=2, strategy="continuous",
                           max_new_tokens=3, temperature=1.0, seed=1)
    engine.generate(prompts)
    assert forwards == [[0], [4]]  # one prefill per chunk, when its first prompt starts
    assert held[0] == [0, 1, 2, 3] and set(held[1]) <= {3, 4, 5} and {4, 5} <= set(held[1])


def test_a_layer_that_calls_the_attention_function_twice_is_packed_not_refused():
    """DiffLlama's layers call the attention function twice each (its differential attention): every layer went
    through the packed attention, so the chunk runs, each prompt's logits those it has alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("diffllama", vocab_size=64, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    assert_packed_logits_equal_alone(model, prompts)
