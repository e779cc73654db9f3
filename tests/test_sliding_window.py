"""Sliding-window attention in the rollout engine (Gemma 3 text, Qwen2 and Mistral with a window): a sliding layer
holds a ring of its window's columns where the slot cache is wider (every column, masked to the window, where not),
so rollouts longer than the window equal ``model.generate`` (transformers' own sliding cache) and the update's
log-probs, in every schedule."""

from __future__ import annotations

import math
import re

import pytest
import torch
from transformers import (AutoConfig, AutoModelForCausalLM, DogeConfig, DynamicCache, Gemma2Config,
                          Gemma3TextConfig, Gemma4TextConfig, Llama4TextConfig, MinistralConfig, MistralConfig,
                          Qwen2Config, Qwen3NextConfig)

from lit_grpo.runtime.models import TINY_SLIDING_WINDOW, load_model_and_tokenizer, seeded_on, tiny_tokenizer
from lit_grpo.sampling import RolloutEngine
from lit_grpo.sampling.decode_attention import _is_decode_call
from lit_grpo.sampling.kv_cache import AttentionLayout, SlotCacheLayer, attention_layout
from lit_grpo.sampling.prefill import block_causal_mask
from precision_helpers import assert_greedy_margin
from prefill_helpers import assert_packed_prefixes_equal_alone
from scheduler_helpers import trust_predictions

WINDOW = TINY_SLIDING_WINDOW
# 7, 16 and 2 tokens: two prompts longer than the window, and completions of up to 16 tokens past it
PROMPTS = ["What is 2+3?", "Compute the sum of 7, 8 and 9. Think step by step.", "hi"]
MODELS = ["tiny-gemma3", "qwen2-sliding", "mistral-sliding"]


def sliding_model(name: str):
    """(model, tokenizer), float32: tiny-gemma3 (sliding, sliding, full), a Qwen2 whose second layer slides (mask
    dict keyed by layer type, as Gemma 3's) or a Mistral whose every layer slides (one mask for every layer)."""
    if name == "tiny-gemma3":
        return load_model_and_tokenizer(name)
    tokenizer = tiny_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW, tie_word_embeddings=False,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.bos_token_id)
    if name == "qwen2-sliding":
        config = Qwen2Config(**common, use_sliding_window=True, max_window_layers=1)
    elif name == "gemma2":  # soft-capped attention scores and logits; transformers runs it in eager attention
        config = Gemma2Config(**(common | dict(num_hidden_layers=3)), head_dim=16, query_pre_attn_scalar=16,
                              attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    else:
        config = MistralConfig(**common)
    with seeded_on(torch.device("cpu"), 1234):
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer


@pytest.fixture(scope="module", params=MODELS)
def sliding(request):
    return sliding_model(request.param)


@pytest.fixture(scope="module", params=MODELS)
def sliding64(request):
    """float64, as conftest's ``tiny``: schedules of different row counts then agree to far below float32."""
    model, tokenizer = sliding_model(request.param)
    return model.double(), tokenizer


def _ids(tokenizer):
    ids = [tokenizer(text)["input_ids"] for text in PROMPTS]
    assert max(len(p) for p in ids) > 2 * WINDOW  # the windows bite within the prompts
    return ids


def _greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy completion of ``prompt`` (its sliding caches), no step of which is a near tie."""
    expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=max_new_tokens, do_sample=False)[0, len(prompt):].tolist()
    assert_greedy_margin(model, prompt, expected)
    return expected


def _assert_greedy_is_generates(model, tokenizer, prompts: list[list[int]], max_new_tokens: int = 16) -> None:
    """The engine's greedy completion of each prompt (one slot a prompt) is transformers' own (``_greedy``)."""
    result = RolloutEngine(model, tokenizer, group_size=1, strategy="continuous", max_new_tokens=max_new_tokens,
                           temperature=0.0).generate(prompts)
    for p, prompt in enumerate(prompts):
        assert result.completion_ids[p] == [_greedy(model, prompt, max_new_tokens)]


def test_the_layout_reads_the_window_and_how_the_model_takes_its_masks():
    for name in ("tiny-llama", "tiny-qwen2"):  # tiny-qwen2's layer_types are all full attention
        assert attention_layout(load_model_and_tokenizer(name)[0].config) == AttentionLayout()
    gemma = sliding_model("tiny-gemma3")[0]
    assert type(gemma).__name__ == "Gemma3ForCausalLM"
    assert attention_layout(gemma.config) == AttentionLayout(sliding_window=WINDOW, keyed_masks=True)
    assert attention_layout(sliding_model("qwen2-sliding")[0].config) == AttentionLayout(WINDOW, keyed_masks=True)
    assert attention_layout(sliding_model("mistral-sliding")[0].config) == AttentionLayout(WINDOW, keyed_masks=False)
    full = torch.zeros(1)
    assert AttentionLayout().mask_argument(full, lambda: 1 / 0) is full  # a full-attention model: today's tensor
    # a sliding layer's decode call is the decode kernel's: its window is in the mask the step builds
    query, mask = torch.zeros(2, 4, 1, 8), torch.zeros(2, 1, 1, 5)
    assert _is_decode_call(query, mask, 0.0, {"sliding_window": WINDOW})


def _sdpa(config):
    config._attn_implementation = "sdpa"
    return config


@pytest.mark.parametrize("config, message", [
    (_sdpa(Gemma2Config(num_hidden_layers=2)), "sets attn_logit_softcapping=50.0, which SDPA attention does not "
                                               "compute; load it with attn_implementation='eager'"),
    (Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (Llama4TextConfig(num_hidden_layers=4), "has layer_types ['chunked_attention'] (chunked attention is not "
                                            "supported)"),
    (Qwen3NextConfig(num_hidden_layers=4), "this model uses DynamicLayer, LinearAttentionLayer (hybrid or linear "
                                           "caches are not supported)"),
    (DogeConfig(num_hidden_layers=2, keep_window_size=6), "masks its attention dynamically (keep_window_size=6)"),
    (Gemma4TextConfig(num_hidden_layers=3, head_dim=16, global_head_dim=16, hidden_size_per_layer_input=0,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_kv_shared_layers=1),
     "this model uses DummyLayer, DynamicLayer, DynamicSlidingWindowLayer (hybrid or linear caches, and layers that "
     "reuse another layer's keys and values (num_kv_shared_layers=1), are not supported)"),
    # layer_types that slide a layer where Qwen2 keeps no window (use_sliding_window=False sets it to None)
    (Qwen2Config(num_hidden_layers=2, use_sliding_window=False, layer_types=["sliding_attention", "full_attention"]),
     "this model (qwen2) has sliding_attention layers [0] (layer_types ['sliding_attention', 'full_attention']) "
     "whose sliding_window is None; an integer >= 1 is needed"),
    # a heterogeneous config's own window for one layer: transformers' cache keeps two windows
    (MinistralConfig(num_hidden_layers=2, head_dim=16, sliding_window=6, per_layer_config={0: {"sliding_window": 4}}),
     "has sliding-window layers of 2 windows [4, 6]; the rollout engine masks every sliding layer with one window"),
])
def test_what_the_engine_cannot_compute_exactly_is_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        attention_layout(config)


@pytest.mark.parametrize("name, implementation", [(name, "sdpa") for name in MODELS] + [("tiny-gemma3", "eager")])
def test_greedy_output_equals_model_generate_past_the_window(name, implementation):
    """generate keeps transformers' sliding cache (the last window of keys); the engine a ring of the window's
    columns. Equal tokens, 16 per completion from prompts of up to 16 tokens, window 6. eager: the packed prefill's
    block mask is windowed too (a dict keyed by layer type for Gemma 3)."""
    model, tokenizer = sliding_model(name)
    model.config._attn_implementation = implementation
    prompts = _ids(tokenizer)
    engine = RolloutEngine(model, tokenizer, group_size=2, micro_group_size=3, strategy="continuous",
                           max_new_tokens=16, temperature=0.0)
    result = engine.generate(prompts)
    for p, prompt in enumerate(prompts):
        expected = _greedy(model, prompt, 16)
        assert len(expected) == 16 and result.completion_ids[p] == [expected, expected]


def test_without_the_window_in_the_mask_the_engine_would_differ(monkeypatch):
    """The check above can fail: masking the sliding layers as full ones changes the completions."""
    import lit_grpo.sampling.kv_cache as kv_cache

    model, tokenizer = sliding_model("tiny-gemma3")
    prompts = _ids(tokenizer)
    settings = dict(group_size=1, strategy="continuous", max_new_tokens=16, temperature=0.0)
    windowed = RolloutEngine(model, tokenizer, **settings).generate(prompts)
    monkeypatch.setattr(kv_cache, "attention_layout", lambda config: AttentionLayout())
    unwindowed = RolloutEngine(model, tokenizer, **settings).generate(prompts)
    assert unwindowed.completion_ids != windowed.completion_ids


def test_every_strategy_returns_the_same_completions(sliding64):
    model, tokenizer = sliding64
    prompts = _ids(tokenizer)
    runs = {}
    for strategy in ("full", "micro", "continuous", "infinite"):
        for g in (1, 3):
            engine = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=g, strategy=strategy,
                                   max_new_tokens=14, temperature=1.0, seed=5)
            runs[(strategy, g)] = engine.generate(prompts)
    parking = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=2, strategy="infinite",
                            max_new_tokens=14, temperature=1.0, seed=5, predictor="online", probe_tokens=4)
    trust_predictions(parking.scheduler)
    runs["parking"] = parking.generate(prompts)
    assert parking.scheduler.last_info["parked_samples"] > 0  # parked tails, read from rows, written back
    reference = runs[("full", 1)]
    assert max(len(c) for c in sum(reference.completion_ids, [])) > WINDOW
    for key, result in runs.items():  # precision: as test_engine's test of every strategy (float64 model)
        assert result.completion_ids == reference.completion_ids, key
        for got, want in zip(sum(result.logprobs, []), sum(reference.logprobs, [])):
            assert got == pytest.approx(want, abs=2e-6), key


def test_carried_samples_prefilled_again_continue_as_one_rollout(sliding64):
    """A carried sample's fed positions are prefilled after its prompt's prefix (``_prefill_tail``): past the window
    too, the completions and log-probs of one uninterrupted rollout."""
    model, tokenizer = sliding64
    prompts = _ids(tokenizer)
    make = lambda: RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, strategy="continuous",  # noqa
                                 max_new_tokens=14, temperature=1.0, seed=7)
    whole = make().generate(prompts)
    engine = make()
    groups = engine.new_groups(prompts, tags=list(range(len(prompts))))
    completions, logprobs, calls = {}, {}, 0
    while groups:
        result = engine.generate_groups(groups, complete=1)
        calls += 1
        for tag, ids, lps in zip(result.tags, result.completion_ids, result.logprobs):
            completions[tag], logprobs[tag] = ids, lps
        groups = result.carried
    assert calls > 1
    assert [completions[p] for p in range(len(prompts))] == whole.completion_ids
    for p in range(len(prompts)):
        for got, want in zip(sum(logprobs[p], []), sum(whole.logprobs[p], [])):
            assert got == pytest.approx(want, abs=2e-6)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_packed_chunk_computes_each_prefix_as_it_would_alone_past_the_window(sliding64, implementation):
    """Packed: SDPA per prefix with the windowed mask for a sliding layer, or the windowed block mask; alone: the
    model's own masks. The prefill cache keeps every position of a sliding layer (not the last window)."""
    model, tokenizer = sliding64
    prefixes = [tokenizer(text)["input_ids"] for text in PROMPTS[:2] + ["Name a colour, then another one."]]
    model.config._attn_implementation = implementation
    try:
        assert_packed_prefixes_equal_alone(model, prefixes, torch.float64, 1e-6, longer_than=WINDOW)
    finally:
        model.config._attn_implementation = "sdpa"
    # transformers' own prefill cache keeps a sliding layer's last window only: PrefillCache must not
    kinds = {type(layer).__name__ for layer in DynamicCache(config=model.config).layers}
    assert "DynamicSlidingWindowLayer" in kinds


def test_a_windowed_block_mask_admits_the_last_window_of_each_prefix():
    allowed = (block_causal_mask([4, 2], torch.float32, torch.device("cpu"), sliding_window=2)[0, 0] == 0).int()
    assert allowed.tolist() == [[1, 0, 0, 0, 0, 0],
                                [1, 1, 0, 0, 0, 0],
                                [0, 1, 1, 0, 0, 0],
                                [0, 0, 1, 1, 0, 0],
                                [0, 0, 0, 0, 1, 0],
                                [0, 0, 0, 0, 1, 1]]


def test_the_engines_logprobs_equal_the_updates_for_gemma3():
    """The update runs the model's own forward (transformers builds the sliding masks, over left padding): its
    log-probs of the sampled completions equal the sampler's, float32 on a CPU, as for tiny-llama."""
    from lit_grpo.update.logprobs import completion_logps
    from lit_grpo.update.shared_prefix import unsupported_reason
    from test_module import make_datamodule, make_module

    module = make_module(model="tiny-gemma3")
    batch = make_datamodule(module, max_new_tokens=14).build_train_batch()
    micro = batch.micro_batch(torch.arange(batch.num_completions))
    mask = micro["completion_mask"].bool()
    assert micro["input_ids"].shape[1] > 2 * WINDOW and mask.sum(1).max() > WINDOW
    with torch.no_grad():
        trainer, _ = completion_logps(module.policy, micro, batch.temperature)
        full, _ = completion_logps(module.policy, micro, batch.temperature, chunked=False)
    torch.testing.assert_close(trainer[mask], micro["sampling_logprobs"][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(full[mask], micro["sampling_logprobs"][mask], atol=1e-5, rtol=0)
    # the shared-prefix forward cannot read a sliding cache as a prefix: "auto" runs the plain forward
    assert "DynamicSlidingWindowLayer" in unsupported_reason(module.policy)
    with torch.no_grad():
        auto, _ = completion_logps(module.policy, micro, batch.temperature, shared_prefix="auto")
    assert torch.equal(auto, trainer)


def test_gemma3_trains_a_few_steps():
    import lightning.pytorch as pl

    from datamodule_helpers import datamodule_arguments
    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.update.module import GRPOModule

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    module = GRPOModule(model="tiny-gemma3")
    trainer.fit(module, RolloutDataModule(**datamodule_arguments({"val_size": 0, "max_new_tokens": 10})))
    assert trainer.global_step == 2
    assert type(module.policy).__name__ == "Gemma3ForCausalLM"
    fresh = load_model_and_tokenizer("tiny-gemma3")[0]
    moved = [not torch.equal(p, q) for p, q in zip(module.policy.parameters(), fresh.parameters())]
    assert any(moved)  # the steps updated the policy


def test_a_compiled_step_masks_the_window_as_the_eager_one():
    """The CPU's compiled step traces the same code (the mask dict built from the lengths inside the step): the
    same greedy completions as the eager step and ``model.generate``, in one compilation. (The CUDA graph path
    captures this same step; it is not run here.)"""
    from torch._dynamo.utils import counters

    model, tokenizer = sliding_model("tiny-gemma3")
    prompts = _ids(tokenizer)
    settings = dict(group_size=2, micro_group_size=3, strategy="continuous", max_new_tokens=16, temperature=0.0)
    graphs_before = counters["stats"]["unique_graphs"]
    compiled = RolloutEngine(model, tokenizer, compile=True, **settings).generate(prompts)
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    eager = RolloutEngine(model, tokenizer, compile=False, **settings).generate(prompts)
    assert compiled.completion_ids == eager.completion_ids
    for p, prompt in enumerate(prompts):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
        assert compiled.completion_ids[p][0] == expected.tolist()


def test_a_multimodal_gemma3_samples_text_as_its_generate_does():
    """Gemma 3 4B and larger load as ``Gemma3ForConditionalGeneration`` (vision tower and all): text prompts go
    through its language model, whose masks it takes as Gemma3ForCausalLM does."""
    from transformers import Gemma3Config

    tokenizer = tiny_tokenizer()
    special = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    text = dict(vocab_size=len(tokenizer) + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                sliding_window=WINDOW, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                **special)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=len(tokenizer) + 1, boi_token_index=len(tokenizer) + 2,
                          eoi_token_index=len(tokenizer) + 3, **special)
    with seeded_on(torch.device("cpu"), 1234):
        model = AutoModelForCausalLM.from_config(config).eval()
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert attention_layout(model.config) == AttentionLayout(sliding_window=WINDOW, keyed_masks=True)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = tokenizer.eos_token_id
    prompts = _ids(tokenizer)
    _assert_greedy_is_generates(model, tokenizer, prompts)


def test_gemma2_in_eager_attention_samples_with_its_soft_capping():
    """Gemma 2 soft-caps its attention scores, which only eager attention computes (transformers loads it so; under
    SDPA ``attention_layout`` refuses it): the decode step and the prefill then run the model's own eager
    attention with the engine's masks. Greedy equals generate, and sampled log-probs a teacher-forced forward's."""
    model, tokenizer = sliding_model("gemma2")
    assert model.config._attn_implementation == "eager"
    assert attention_layout(model.config) == AttentionLayout(sliding_window=WINDOW, keyed_masks=True)
    prompts = _ids(tokenizer)
    _assert_greedy_is_generates(model, tokenizer, prompts)
    sampled = RolloutEngine(model, tokenizer, group_size=2, micro_group_size=3, strategy="continuous",
                            max_new_tokens=14, temperature=0.7, seed=3).generate(prompts)
    for p, prompt in enumerate(prompts):
        for completion, logprobs in zip(sampled.completion_ids[p], sampled.logprobs[p]):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
            expected = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, torch.tensor(completion)[:, None])
            torch.testing.assert_close(torch.tensor(logprobs), expected.squeeze(-1), atol=1e-5, rtol=0)


def test_a_gemma3_text_checkpoint_loads_as_gemma3_for_causal_lm_and_samples(tmp_path):
    """A saved Gemma 3 text checkpoint (as gemma-3-270m, gemma-3-1b-it: model_type gemma3_text) goes through
    ``load_model_and_tokenizer`` (AutoModelForCausalLM) to Gemma3ForCausalLM, and the engine takes it."""
    model, tokenizer = load_model_and_tokenizer("tiny-gemma3")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_model_and_tokenizer(str(tmp_path))
    assert type(loaded).__name__ == "Gemma3ForCausalLM" and loaded.config.model_type == "gemma3_text"
    assert attention_layout(loaded.config) == AttentionLayout(sliding_window=WINDOW, keyed_masks=True)
    prompts = _ids(tokenizer)
    settings = dict(group_size=1, strategy="continuous", max_new_tokens=12, temperature=0.0)
    assert (RolloutEngine(loaded, loaded_tokenizer, **settings).generate(prompts).completion_ids
            == RolloutEngine(model, tokenizer, **settings).generate(prompts).completion_ids)


def test_the_sdpa_gqa_decode_kernel_reads_the_window_from_the_mask_too():
    model, tokenizer = sliding_model("tiny-gemma3")
    prompts = _ids(tokenizer)
    settings = dict(group_size=2, micro_group_size=3, strategy="continuous", max_new_tokens=16, temperature=0.0)
    matmul = RolloutEngine(model, tokenizer, **settings).generate(prompts)
    gqa = RolloutEngine(model, tokenizer, decode_attention="sdpa_gqa", **settings).generate(prompts)
    assert gqa.completion_ids == matmul.completion_ids  # both equal generate (the greedy test above)


def test_prompts_prefilled_alone_take_the_models_own_sliding_masks(monkeypatch):
    """A chunk of one prompt (here every prompt: a budget of one token) runs the model's own masks over the full-width
    ``PrefillCache``: the same completions as packed chunks, and as generate."""
    from lit_grpo.sampling import rollout_loop

    model, tokenizer = sliding_model("tiny-gemma3")
    prompts = _ids(tokenizer)
    settings = dict(group_size=2, micro_group_size=3, strategy="continuous", max_new_tokens=16, temperature=1.0,
                    seed=11)
    packed = RolloutEngine(model, tokenizer, **settings).generate(prompts)
    monkeypatch.setattr(rollout_loop, "PREFILL_CHUNK_TOKENS", 1)
    alone = RolloutEngine(model, tokenizer, **settings).generate(prompts)
    assert alone.completion_ids == packed.completion_ids
    for got, want in zip(sum(sum(alone.logprobs, []), []), sum(sum(packed.logprobs, []), [])):
        assert got == pytest.approx(want, abs=1e-5)  # float32: packed and lone prefixes round apart
    bf16 = RolloutEngine(model.to(torch.bfloat16), tokenizer, **settings).generate(prompts)  # runs, finite
    assert all(math.isfinite(x) for x in sum(sum(bf16.logprobs, []), []))


@pytest.mark.parametrize("model_type, fields", [
    ("qwen2_moe", dict(use_sliding_window=True, max_window_layers=1, decoder_sparse_step=1, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)),
    ("phimoe", dict(num_local_experts=4, num_experts_per_tok=2)),
    # layer_types without use_sliding_window: the mask slides the first layer, its attention is told no window
    ("smollm3", dict(use_sliding_window=False, layer_types=["sliding_attention", "full_attention"], pad_token_id=None)),
])
def test_a_packed_chunk_takes_the_window_of_a_layer_whose_attention_is_not_told_it(model_type, fields):
    """Qwen2-MoE's and PhiMoE's attention layers do not pass ``sliding_window`` to the attention function, nor
    SmolLM3's without ``use_sliding_window`` (their window is only in the masks, which a packed SDPA chunk does not
    build): the packed prefill takes each layer's window from the config, as the cache's layers do, so a prefix
    longer than the window is computed as alone."""
    tokenizer = tiny_tokenizer()
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  sliding_window=WINDOW, tie_word_embeddings=False, **fields)
    with seeded_on(torch.device("cpu"), 1234):
        model = AutoModelForCausalLM.from_config(config).eval()  # float32: the experts' grouped matmul takes no float64
    assert attention_layout(model.config).sliding_window == WINDOW
    prefixes = [tokenizer(text)["input_ids"] for text in PROMPTS[:2]]
    assert_packed_prefixes_equal_alone(model, prefixes, torch.float32, 1e-5, longer_than=WINDOW)


def test_a_config_whose_layers_cache_other_widths_is_refused_when_the_cache_is_sized():
    """Gemma 4's full-attention layers have their own head_dim (a heterogeneous config, which will not give one
    global value): the slot cache, one width for every layer, refuses it naming each layer's widths (not transformers'
    advice to read the global value anyway)."""
    from lit_grpo.sampling.memory_budget import kv_geometry

    config = Gemma4TextConfig(num_hidden_layers=2, head_dim=16, sliding_window=WINDOW, hidden_size_per_layer_input=0,
                              layer_types=["sliding_attention", "full_attention"],
                              per_layer_config={1: {"head_dim": 32}})
    with pytest.raises(ValueError, match=r"model config Gemma4TextConfig \(gemma4_text\) gives its layers their own "
                                         r"key/value widths \(num_key_value_heads, head_dim by layer: "
                                         r"\[\(4, 16\), \(4, 32\)\]\); the rollout engine's slot cache holds "
                                         r"one num_key_value_heads x head_dim for every layer"):
        kv_geometry(config)


# ------------------------------------------------------------------------- the ring: a sliding layer's W columns
def _slot_cache(model, width: int, slots: int = 2):
    from lit_grpo.sampling.kv_cache import SlotKVCache

    return SlotKVCache(model.config, num_slots=slots, width=width, dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("name", MODELS)
def test_a_sliding_layer_holds_a_ring_of_window_columns_where_the_cache_is_wider(name):
    """tiny-gemma3 slides its first two layers of three, the Qwen2 its second of two, the Mistral both: those hold
    WINDOW columns per row once the width exceeds it (bytes counted as held), every column where it does not."""
    from lit_grpo.sampling.kv_cache import layer_windows
    from lit_grpo.sampling.memory_budget import kv_bytes_per_token, kv_slot_bytes

    model, _ = sliding_model(name)
    windows = layer_windows(model.config)
    per_layer = kv_bytes_per_token(model.config, torch.float32) // len(windows)
    for width in (40, WINDOW + 1):
        cache = _slot_cache(model, width)
        assert [layer.keys.shape[2] for layer in cache.layers] == [width if w is None else WINDOW for w in windows]
        assert cache.ring_width == WINDOW and cache.ring_columns is not None
        assert cache.nbytes() == 2 * per_layer * sum(width if w is None else WINDOW for w in windows)
        # the pricing is the allocation: a slot of a 1-token prompt and width new tokens is priced at width + 1
        assert kv_slot_bytes(model.config, torch.float32, 1, width - 1) == cache.nbytes() // 2
    for width in (WINDOW, 3):  # the window holds the row: every layer at the cache's width, no ring
        cache = _slot_cache(model, width)
        assert all(layer.keys.shape[2] == width and layer.ring is None for layer in cache.layers)
        assert cache.ring_width is None and cache.ring_columns is None
        assert cache.nbytes() == 2 * per_layer * len(windows) * width


def test_a_ring_row_writes_and_reads_the_last_window_of_a_span_across_the_wrap():
    model, _ = sliding_model("tiny-gemma3")
    cache = _slot_cache(model, 40)
    ring, full = cache.layers[0], cache.layers[2]
    _, kv_heads, _, head_dim = ring.keys.shape

    def kv(n):
        return [(torch.randn(1, kv_heads, n, head_dim), torch.randn(1, kv_heads, n, head_dim)) for _ in cache.layers]

    piece = kv(10)  # positions [3, 13): the ring keeps 7..12, at columns 7 % 6 = 1 on, wrapping after 11
    assert cache.write_row(1, 3, piece) == 10
    assert torch.equal(ring.keys[1, :, 1:6], piece[0][0][0, :, 4:9]) and torch.equal(ring.keys[1, :, 0],
                                                                                        piece[0][0][0, :, 9])
    assert torch.equal(full.keys[1, :, 3:13], piece[2][0][0])
    read = cache.read_row(1, 3, 13)
    assert [k.shape[2] for k, _ in read] == [WINDOW, WINDOW, 10]
    assert torch.equal(read[0][0], piece[0][0][:, :, -WINDOW:]) and torch.equal(read[2][1], piece[2][1])
    # a piece cut to the window (as the prefixes and tails are) writes the same row; positions then say the span
    cut = [(k[:, :, -WINDOW:], v[:, :, -WINDOW:]) if i < 2 else (k, v) for i, (k, v) in enumerate(piece)]
    cache.write_row(0, 3, cut, positions=10)
    assert torch.equal(cache.layers[1].values[0], cache.layers[1].values[1])
    with pytest.raises(ValueError, match=r"needs its span's length \(positions=\)"):
        cache.write_row(0, 3, cut)
    with pytest.raises(ValueError, match="layer 0's piece holds 5 positions of a span of 10; this slot cache's "
                                         "layer needs the span's last 6"):
        cache.write_row(0, 3, [(k[:, :, -5:], v[:, :, -5:]) for k, v in piece], positions=10)


def _masks_seen(monkeypatch) -> list:
    """The attention masks the decode steps give the model (``AttentionLayout.mask_argument``'s, which an SDPA
    model's packed prefill does not call)."""
    seen, mask_argument = [], AttentionLayout.mask_argument

    def spy(self, full, sliding):
        seen.append(mask_argument(self, full, sliding))
        return seen[-1]

    monkeypatch.setattr(AttentionLayout, "mask_argument", spy)
    return seen


def test_a_model_without_sliding_layers_allocates_every_layer_at_the_width_with_one_mask(monkeypatch):
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    cache = _slot_cache(model, 40)
    assert cache.ring_width is None and cache.ring_columns is None
    assert all(layer.keys.shape[2] == 40 and layer.ring is None for layer in cache.layers)
    seen = _masks_seen(monkeypatch)
    RolloutEngine(model, tokenizer, group_size=2, strategy="continuous", max_new_tokens=5,
                  temperature=0.0).generate([[5, 6, 7, 8]])
    # one tensor: 0 on the columns <= each row's length, the dtype's lowest past them
    assert seen and all(isinstance(mask, torch.Tensor) and mask.shape[1:3] == (1, 1) for mask in seen)
    assert (seen[-1][:, 0, 0] == 0).sum(1).tolist() == [8, 8]  # 3 prompt positions and 4 fed, plus the new one


def test_a_ring_layers_mask_admits_its_columns_up_to_the_length(monkeypatch):
    """Gemma 3's mask dict: the full layers' mask over the attended columns, the ring layers' its first WINDOW
    columns (all admitted once the row is longer: the ring holds the window alone)."""
    model, tokenizer = sliding_model("tiny-gemma3")
    seen = _masks_seen(monkeypatch)
    prompts = _ids(tokenizer)
    RolloutEngine(model, tokenizer, group_size=1, strategy="continuous", max_new_tokens=8,
                  temperature=0.0).generate(prompts[2:])  # "hi": its row grows past the window
    widths = [(mask["sliding_attention"].shape[-1], mask["full_attention"].shape[-1]) for mask in seen]
    assert all(ring == WINDOW < full for ring, full in widths)
    for mask in seen:
        assert torch.equal(mask["sliding_attention"], mask["full_attention"][..., :WINDOW])


def test_parked_samples_whose_tails_pass_the_window_resume_exactly(sliding64, monkeypatch):
    """Probed for 9 tokens (past the window of 6) and parked: a ring layer's tail is its last window, and the
    resumed samples complete as in an unparked rollout."""
    from lit_grpo.sampling.kv_cache import SlotKVCache

    model, tokenizer = sliding64
    prompts = _ids(tokenizer)
    settings = dict(group_size=4, max_new_tokens=14, temperature=1.0, seed=5)
    whole = RolloutEngine(model, tokenizer, micro_group_size=1, strategy="continuous", **settings).generate(prompts)
    tails, read = [], SlotKVCache.read_row

    def spy(self, slot, start, stop):
        kv = read(self, slot, start, stop)
        tails.append((stop - start, [k.shape[2] for k, _ in kv]))
        return kv

    monkeypatch.setattr(SlotKVCache, "read_row", spy)
    parking = RolloutEngine(model, tokenizer, micro_group_size=2, strategy="infinite", predictor="online",
                            probe_tokens=9, **settings)
    trust_predictions(parking.scheduler)
    parked = parking.generate(prompts)
    assert any(span > WINDOW and WINDOW in held for span, held in tails)  # a tail cut to the ring's window
    assert parked.completion_ids == whole.completion_ids
    for got, want in zip(sum(sum(parked.logprobs, []), []), sum(sum(whole.logprobs, []), [])):
        assert got == pytest.approx(want, abs=2e-6)


def test_prompts_longer_than_the_window_go_into_the_ring_and_complete_as_generate(monkeypatch):
    """16-token prompts (past 2 x WINDOW): their prefixes are cut to the window and written into the ring; greedy
    completions equal generate's."""
    from lit_grpo.sampling import rollout_loop

    model, tokenizer = sliding_model("tiny-gemma3")
    prompts = _ids(tokenizer)
    cut, split = [], rollout_loop.split_prefixes

    def spy(kv, chunk, windows=None):
        cut.append(windows)
        return split(kv, chunk, windows)

    monkeypatch.setattr(rollout_loop, "split_prefixes", spy)
    _assert_greedy_is_generates(model, tokenizer, prompts)
    assert cut and all(windows == [WINDOW, WINDOW, None] for windows in cut)


def test_auto_fits_more_slots_for_a_sliding_model_at_a_long_width_by_the_ring_rule():
    """A Gemma 3 1B-shaped config (26 layers, 22 sliding with window 512, one KV head of 256) at 4096 new tokens:
    a slot costs 4 full layers x 4352 positions + 22 ring layers x 512, a prefix 26 layers x 256 positions (shorter
    than the window): about 4x the slots of pricing every layer at every column."""
    from lit_grpo.sampling.kv_cache import layer_windows
    from lit_grpo.sampling.memory_budget import (auto_micro_group_size, kv_bytes_per_token, kv_prefill_bytes,
                                                 kv_slot_bytes)

    config = Gemma3TextConfig(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=256, sliding_window=512, vocab_size=262144)
    windows = layer_windows(config)
    assert windows.count(None) == 4 and windows.count(512) == 22
    per_layer = 2 * 256 * 2  # keys and values, one head of 256, bfloat16
    assert kv_bytes_per_token(config, "bfloat16") == 26 * per_layer
    budget, prompt, new, prompts = 8 * 2**30, 256, 4096, 8
    slot = per_layer * (4 * (prompt + new) + 22 * 512)
    assert kv_slot_bytes(config, "bfloat16", prompt, new) == slot
    held = prompts * 26 * per_layer * prompt + kv_prefill_bytes(config, "bfloat16", prompt, prompts, new)
    slots = auto_micro_group_size(config, "bfloat16", budget, prompt, new, group_size=64, num_prompts=prompts)
    assert slots == (budget - held) // slot == 290
    every_column = (budget - held) // (26 * per_layer * (prompt + new))
    assert slots > 3.9 * every_column
    # where the window holds the row, every layer is priced at every column
    assert kv_slot_bytes(config, "bfloat16", 100, 400) == 26 * per_layer * 500
    with pytest.raises(ValueError, match=rf"one slot's KV cache, {slot} bytes \({26 * per_layer} bytes/token x "
                                         rf"\({prompt} prompt \+ {new} new tokens, sliding layers holding at most "
                                         r"their window\)"):
        auto_micro_group_size(config, "bfloat16", held, prompt, new, group_size=64, num_prompts=prompts)


def test_the_decode_floor_counts_a_sliding_layers_window_of_each_row():
    """The roofline's bytes a step reads: a sliding layer's keys and values at most the window of a row, as its
    ring holds them; the engine sums them over its steps (a P-token prompt's row attends P + j positions at its
    j-th step)."""
    from lit_grpo.sampling.roofline import decode_reads

    model, tokenizer = sliding_model("tiny-gemma3")
    reads = decode_reads(model.config, torch.float32)
    assert reads.window == WINDOW and reads.windowed_per_position == reads.per_position * 2 // 3
    assert reads.rows_bytes([3, 10]) == reads.step_bytes(2, 13) - (10 - WINDOW) * reads.windowed_per_position
    assert decode_reads(load_model_and_tokenizer("tiny-llama")[0].config, torch.float32).window is None
    result = RolloutEngine(model, tokenizer, group_size=2, strategy="continuous", max_new_tokens=9,
                           temperature=1.0, seed=3).generate(_ids(tokenizer))
    attended = [len(prompt) + j for prompt, group in zip(result.prompt_ids, result.completion_ids)
                for ids in group for j in range(len(ids))]
    assert max(attended) > WINDOW
    expected = result.stats.decode_steps * reads.weights + reads.rows_bytes(attended) - reads.weights
    assert result.stats.decode_read_bytes == expected



def _window_80_gemma3():
    """A tiny Gemma 3 (sliding, sliding, full) with a window of 80: between the live-width buckets 64 and 128."""
    tokenizer = tiny_tokenizer()
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=80, layer_types=["sliding_attention", "sliding_attention",
                                                              "full_attention"],
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    with seeded_on(torch.device("cpu"), 1234):
        model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = tokenizer.eos_token_id
    return model, tokenizer


def _live_width(monkeypatch) -> None:
    """Each step attends the bucket of its longest live row, as on CUDA (built by hand on a CPU)."""
    import dataclasses

    from lit_grpo.sampling import engine as engine_module

    live = engine_module.RolloutEngine._step_settings
    monkeypatch.setattr(engine_module.RolloutEngine, "_step_settings",
                        lambda engine, *args: dataclasses.replace(live(engine, *args), live_width=True))


#: width 39 + 89 = 128: buckets 64 and 128, the window of 80 between them
BUCKETED_PROMPT = [5 + (7 * i) % 300 for i in range(40)]


def test_buckets_narrower_than_the_ring_attend_it_positionally_and_wider_ones_wrap_it(monkeypatch):
    """As on CUDA, each step attends the bucket of its longest live row (built by hand on a CPU): with a window of
    80, the 64-column bucket reads a ring layer's first 64 columns (no row has wrapped yet: column = position), the
    128-column one the whole ring of 80, wrapped. Greedy equals generate across both."""
    model, tokenizer = _window_80_gemma3()
    _live_width(monkeypatch)
    attended = []
    update = SlotCacheLayer.update

    def spy(self, *args, **kwargs):
        attended.append((self.ring, self.attended))
        return update(self, *args, **kwargs)

    monkeypatch.setattr(SlotCacheLayer, "update", spy)
    prompt = BUCKETED_PROMPT
    engine = RolloutEngine(model, tokenizer, group_size=1, strategy="continuous", max_new_tokens=89,
                           temperature=0.0)
    result = engine.generate([prompt])
    assert engine._step.buckets == (64, 128) and engine._cache.ring_width == 80
    assert {(80, 64), (80, 80), (None, 64), (None, 128)} <= set(attended)
    assert len(result.completion_ids[0][0]) > 60  # rows of over 99 positions: the ring wrapped
    assert result.completion_ids == [[_greedy(model, prompt, 89)]]


def test_a_compiled_ring_step_compiles_once_per_bucket_and_samples_as_the_eager_one(monkeypatch):
    """The compiled step (the code a CUDA graph captures) with the ring's write columns computed inside it and its
    mask sliced to the ring: one whole-step graph per bucket, no graph break, no recompilation in a second rollout,
    and the eager step's completions. Traced by dynamo's "eager" backend: tracing is what breaks or recompiles."""
    from torch._dynamo.utils import counters

    from lit_grpo.sampling import decode_step

    model, tokenizer = _window_80_gemma3()
    _live_width(monkeypatch)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: compile_(*args, **kwargs, backend="eager"))
    monkeypatch.setattr(decode_step, "compiler_problem", lambda device_type: None)  # "eager" needs no C++ compiler
    prompts = [BUCKETED_PROMPT, BUCKETED_PROMPT[:7]]
    settings = dict(group_size=2, micro_group_size=3, strategy="continuous", max_new_tokens=89, seed=5,
                    temperature=1.0)
    eager_engine = RolloutEngine(model, tokenizer, **settings)
    eagers = [eager_engine.generate(prompts) for _ in range(2)]  # each rollout its own random streams
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    engine = RolloutEngine(model, tokenizer, compile=True, keep_kv_cache=True, **settings)
    results = [engine.generate(prompts) for _ in range(2)]
    assert engine._cache.ring_width == 80 and engine._step.compiled_widths == {64, 128}
    assert max(len(ids) for result in results for ids in result.completion_ids[0]) > 80 - 39  # the ring wrapped
    assert sum(counters["graph_break"].values()) == breaks
    assert counters["stats"]["unique_graphs"] - graphs == 2
    for result, eager in zip(results, eagers):
        assert result.completion_ids == eager.completion_ids
        for expected, got in zip(sum(eager.logprobs, []), sum(result.logprobs, [])):
            assert got == pytest.approx(expected, abs=1e-4)


def test_the_priced_kv_bounds_the_peak_held_while_prompts_longer_than_the_window_are_prefilled():
    """A prefill chunk holds every layer at every position of its prompts until the split cuts a ring layer's prefix
    to its window: the budget prices that moment beside the slots and the (cut) prefixes, so a rollout's
    ``peak_kv_bytes`` stays within what ``micro_group_size: auto`` priced."""
    from lit_grpo.sampling.memory_budget import kv_held_bytes, kv_prefill_bytes, kv_slot_bytes

    model, tokenizer = sliding_model("tiny-gemma3")
    prompts = [[5 + (3 * i + p) % 200 for i in range(40)] for p in range(3)]  # 40 tokens each, past the window
    config, new_tokens, group_size, slots = model.config, 4, 2, 2
    priced = (kv_held_bytes(config, torch.float32, 40, group_size, len(prompts))
              + kv_prefill_bytes(config, torch.float32, 40, len(prompts), new_tokens)
              + slots * kv_slot_bytes(config, torch.float32, 40, new_tokens))
    result = RolloutEngine(model, tokenizer, group_size=group_size, micro_group_size=slots, strategy="continuous",
                           max_new_tokens=new_tokens, temperature=1.0, seed=3).generate(prompts)
    assert 0 < result.stats.peak_kv_bytes <= priced


def test_preempted_tails_past_the_window_stay_within_the_park_share_auto_prices(monkeypatch):
    """The default strategy's park budget counts a parked tail's KV (a ring layer's at most its window), and
    ``micro_group_size: auto`` prices the park share so: preempting on every point (a park budget of 2), tiny-gemma3
    parks tails longer than its window, and ``peak_kv_bytes`` stays within what auto priced for its two slots."""
    from lit_grpo.sampling.kv_cache import SlotKVCache
    from lit_grpo.sampling.memory_budget import auto_micro_group_size, kv_held_bytes, kv_prefill_bytes, kv_row_bytes, \
        kv_slot_bytes
    from lit_grpo.scheduling import LeastAttainedScheduler

    class Preempting(LeastAttainedScheduler):
        def judge(self, work):
            return True, "preempting: forced by the test"

    model, tokenizer = sliding_model("tiny-gemma3")
    prompts = _ids(tokenizer)
    config, longest, new_tokens, group_size, slots, park = model.config, max(map(len, prompts)), 20, 4, 2, 2.0
    priced = (kv_held_bytes(config, torch.float32, longest, group_size, len(prompts))
              + kv_prefill_bytes(config, torch.float32, longest, len(prompts), new_tokens)
              + slots * (kv_slot_bytes(config, torch.float32, longest, new_tokens)
                         + math.ceil(park * kv_row_bytes(config, torch.float32, new_tokens))))
    assert auto_micro_group_size(config, torch.float32, priced, longest, new_tokens, group_size, len(prompts),
                                 park_fraction=park) == slots
    tails, read = [], SlotKVCache.read_row

    def spy(self, slot, start, stop):
        tails.append(stop - start)
        return read(self, slot, start, stop)

    monkeypatch.setattr(SlotKVCache, "read_row", spy)
    scheduler = Preempting(preempt_tokens=2, park_budget=park, loss_share=None)
    result = RolloutEngine(model, tokenizer, group_size=group_size, micro_group_size=slots, strategy="infinite",
                           max_new_tokens=new_tokens, temperature=1.0, seed=3, scheduler=scheduler).generate(prompts)
    # the budget in full-layer tokens: 2 x 2 slots x (6 + 6 + 20) / 3, less than 2 x 2 x 20 tokens
    assert scheduler.park_tokens == pytest.approx(park * slots * (2 * WINDOW + new_tokens) / 3)
    assert max(tails) > WINDOW and result.stats.parked_samples > 0
    assert 0 < result.stats.peak_kv_bytes <= priced


@pytest.mark.parametrize("appended", [WINDOW - 1, WINDOW, WINDOW + 1, WINDOW + 3])
@pytest.mark.parametrize("name", MODELS)
def test_tokens_appended_past_the_window_at_once_continue_as_generate(name, appended):
    """A tool's result appended to a sample (``SampleProgress.resumed_at``), up to more tokens than the window at
    once, after a prompt longer than it: the carried sample's positions are prefilled after its cut prefix and cut
    to the ring, and its greedy continuation is transformers' own on the prompt and those tokens."""
    from lit_grpo.sampling.carry import GroupProgress, SampleProgress

    model, tokenizer = sliding_model(name)
    prompt = _ids(tokenizer)[1]  # 16 tokens
    engine = RolloutEngine(model, tokenizer, group_size=1, strategy="continuous", max_new_tokens=21,
                           temperature=0.0)
    tokens = _greedy(model, prompt, 4) + [11, 23, 35, 47, 59, 71, 83, 95, 107][:appended]
    group = GroupProgress(prompt, [SampleProgress(tokens, [0.0] * len(tokens), [0] * len(tokens),
                                                  resumed_at=len(tokens))], (0, 0))
    result = engine.generate_groups([group])
    assert result.completion_ids[0][0][:len(tokens)] == tokens
    assert result.completion_ids[0][0][len(tokens):] == _greedy(model, prompt + tokens, 21 - len(tokens))


@pytest.mark.parametrize("name", MODELS)
def test_rows_at_the_edges_of_the_window_complete_as_generate(name):
    """Prompts of 1, W - 1, W, W + 1 and W + 2 tokens (prefixes of 0, W - 2, W - 1, W positions, uncut, and W + 1
    cut to the ring's W), each row growing through W - 1, W and W + 1 positions: greedy equals generate."""
    model, tokenizer = sliding_model(name)
    prompts = [[5 + (11 * i + n) % 200 for i in range(n)] for n in (1, WINDOW - 1, WINDOW, WINDOW + 1, WINDOW + 2)]
    _assert_greedy_is_generates(model, tokenizer, prompts, max_new_tokens=WINDOW + 3)


def test_a_kept_cache_serves_rollouts_with_and_without_the_ring():
    """``keep_kv_cache``: a cache built with a ring (a rollout wider than the window) serves a later rollout the
    window holds whole (its rows never wrap), and one built without (narrower) is rebuilt with a ring for a wider
    rollout; greedy equals generate in every rollout."""
    model, tokenizer = sliding_model("tiny-gemma3")
    long, short = _ids(tokenizer)[1], [5, 6]  # widths 15 + 3 = 18 (ring) and 1 + 3 = 4 (within the window)
    for order in ([long, short, long], [short, long, short]):
        engine = RolloutEngine(model, tokenizer, group_size=1, strategy="continuous", max_new_tokens=3,
                               temperature=0.0, keep_kv_cache=True)
        rings = []
        for prompt in order:
            assert engine.generate([prompt]).completion_ids == [[_greedy(model, prompt, 3)]]
            rings.append(engine._cache.ring_width)
        assert rings == ([WINDOW] * 3 if order[0] is long else [None, WINDOW, WINDOW])


def test_a_ring_rows_tail_is_read_up_to_the_rows_length_only():
    """A ring layer holds a row's last window up to its length: a span that stops short of it is no longer held
    (its columns hold later positions), so the decode step refuses to read one rather than return other keys."""
    from lit_grpo.sampling.decode_step import DecodeStep, StepSettings

    model, _ = sliding_model("tiny-gemma3")
    cache = _slot_cache(model, 40)
    settings = StepSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, force_lengths=False, hidden_states=False,
                            cuda_graph=False)
    step = DecodeStep(model, cache, settings, eos_token_ids=[0])
    _, kv_heads, _, head_dim = cache.layers[2].keys.shape
    piece = [(torch.randn(1, kv_heads, 12, head_dim), torch.randn(1, kv_heads, 12, head_dim)) for _ in cache.layers]
    step.start_row(1, [piece], stream=(0, 0), sample=0, generated=0, next_input=5)
    assert [k.shape[2] for k, _ in step.read_row(1, 3, 12)] == [WINDOW, WINDOW, 9]
    with pytest.raises(ValueError, match=r"row 1 holds 12 positions: a span of it up to 10 .* up to its length"):
        step.read_row(1, 3, 10)


def test_the_hf_generate_benchmark_counts_a_sliding_layers_kv_at_its_window():
    """tools/bench_rollout's estimate of ``model.generate``'s KV: transformers' sliding cache keeps a sliding
    layer's last window of each row, so its rows are priced as the engine's (``kv_row_bytes``), not every layer at
    every position."""
    from types import SimpleNamespace

    from lit_grpo.sampling.memory_budget import kv_row_bytes
    from tools import bench_rollout

    model, tokenizer = sliding_model("tiny-gemma3")
    prompts = _ids(tokenizer)[:2]
    args = SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_new_tokens=8)
    record, completions = bench_rollout.run_hf_generate(model, tokenizer, prompts, 1, None, args,
                                                        {tokenizer.eos_token_id})
    steps = max(len(c) for c in completions)
    padded = max(map(len, prompts)) + steps - 1  # left-padded rows: the longest prompt and all but the last token
    assert record["peak_kv_bytes"] == 2 * kv_row_bytes(model.config, model.dtype, padded)


def test_the_roofline_tools_decode_cost_counts_a_sliding_layers_window():
    """tools/roofline's decode step: a sliding layer reads and attends at most its window of a row (as the engine's
    floor, ``DecodeReads.rows_bytes``); within the window, every layer every position."""
    from lit_grpo.sampling.roofline import decode_reads, model_shape
    from tools import roofline

    config = sliding_model("tiny-gemma3")[0].config
    reads, shape = decode_reads(config, "float32"), model_shape(config)
    for context, windowed in ((4, 4), (20, WINDOW)):
        cost = roofline.decode_step_cost(config, 3, context, "float32")
        assert cost.bytes == reads.step_bytes(3, 3 * context) - 3 * (context - windowed) * reads.windowed_per_position
        attended = shape.heads * shape.head_dim * (context + 2 * windowed)  # one full layer, two sliding
        assert cost.flops == 2 * 3 * shape.weights + 4 * 3 * attended
