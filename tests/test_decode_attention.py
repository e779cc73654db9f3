"""The eager CPU decode step's attention (two matmuls): SDPA's result up to rounding, each row alone, only inside a
decode step, and SDPA for every call it does not compute."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import lit_grpo.sampling.decode_attention as decode_attention_module
from lit_grpo.sampling import RolloutEngine
from lit_grpo.sampling.decode_attention import DECODE_ATTENTION, cpu_decode_attention, decode_attention


class _Layer(torch.nn.Module):
    """What transformers' attention functions read from their module."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = heads // kv_heads, True


def _decode_inputs(rows=6, heads=6, kv_heads=2, width=11, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, heads, 1, dim, generator=generator)
    key, value = torch.randn(2, rows, kv_heads, width, dim, generator=generator)
    lengths = torch.randint(0, width, (rows,), generator=generator)
    admitted = torch.arange(width)[None] <= lengths[:, None]
    mask = torch.zeros(rows, width).masked_fill(~admitted, torch.finfo(torch.float32).min)[:, None, None, :]
    return _Layer(heads, kv_heads), query, key, value, mask


@pytest.mark.parametrize("kv_heads", [1, 2, 6])
def test_a_decode_call_computes_what_sdpa_computes(kv_heads):
    layer, query, key, value, mask = _decode_inputs(kv_heads=kv_heads)
    ours, _ = decode_attention(layer, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (6, 1, 6, 8)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_each_row_is_computed_alone_so_schedules_stay_bit_identical():
    """Bit-identical on any CPU: each row's two products are batch entries of one shape, computed by the same
    kernel whatever the other rows hold (a determinism claim, not a numerical one)."""
    layer, query, key, value, mask = _decode_inputs(rows=9)
    full, _ = decode_attention(layer, query, key, value, mask)
    order = torch.randperm(9)
    permuted, _ = decode_attention(layer, query[order], key[order], value[order], mask[order])
    assert torch.equal(permuted, full[order])
    assert torch.equal(decode_attention(layer, query[:4], key[:4], value[:4], mask[:4])[0], full[:4])


def test_calls_it_does_not_compute_go_to_sdpa_unchanged(monkeypatch):
    layer, query, key, value, mask = _decode_inputs()
    prompt = torch.randn(2, 6, 5, 8)  # a prefill: several queries, no mask (causal)
    keys = torch.randn(2, 2, 5, 8)
    # exact: these calls are SDPA's own, on the same inputs in the same process
    assert torch.equal(decode_attention(layer, prompt, keys, keys, None)[0],
                       sdpa_attention_forward(layer, prompt, keys, keys, None)[0])
    assert torch.equal(decode_attention(layer, query, key, value, None)[0],
                       sdpa_attention_forward(layer, query, key, value, None)[0])
    passed = []
    monkeypatch.setattr(decode_attention_module, "sdpa_attention_forward",
                        lambda *args, **kwargs: passed.append(kwargs) or (args[1], None))
    decode_attention(layer, query, key, value, mask, softcap=30.0)  # SDPA decides what a softcap means
    assert len(passed) == 1 and passed[0]["softcap"] == 30.0


def test_the_switch_holds_for_the_block_only_and_leaves_other_implementations_alone(tiny_llama):
    model, _ = tiny_llama
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"):
        with cpu_decode_attention(model):
            assert model.config._attn_implementation == DECODE_ATTENTION
            raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"
    with cpu_decode_attention(model, enabled=False):
        assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    try:
        with cpu_decode_attention(model):
            assert model.config._attn_implementation == "eager"  # chosen on purpose: kept
    finally:
        model.config._attn_implementation = "sdpa"


def test_a_cpu_rollout_decodes_with_it_and_prefills_with_sdpa(tiny_llama, monkeypatch):
    model, tokenizer = tiny_llama
    queries = []
    original = ALL_ATTENTION_FUNCTIONS[DECODE_ATTENTION]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, DECODE_ATTENTION,
                        lambda module, query, *args, **kwargs: queries.append(query.shape[2])
                        or original(module, query, *args, **kwargs))
    engine = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=2, strategy="continuous",
                           max_new_tokens=6, temperature=0.0)
    result = engine.generate([[5, 6, 7, 8]])
    layers = model.config.num_hidden_layers
    assert queries and set(queries) == {1}  # decode steps only: the prefill ran on SDPA
    assert len(queries) == layers * result.stats.decode_steps
    assert model.config._attn_implementation == "sdpa"
