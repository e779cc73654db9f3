"""The eager CPU decode step's attention (two matmuls): SDPA's result up to rounding, each row alone, only inside a
decode step, and SDPA for every call it does not compute."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import lit_grpo.sampling.decode_attention as decode_attention_module
from lit_grpo.sampling import RolloutEngine
from lit_grpo.sampling.config import SamplingConfig
from lit_grpo.sampling.decode_attention import (DECODE_ATTENTION, SDPA_GQA_DECODE_ATTENTION, decode_attention,
                                                sdpa_gqa_decode_attention, step_attention)
from lit_grpo.sampling.decode_step import width_buckets


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


def _reference(query, key, value, lengths, scale):
    """float64 attention of each row's query heads over its columns ``[0, lengths[row]]``, each query head reading
    its key/value head (``h // group``) directly: ``[rows, 1, heads, dim]``."""
    rows, heads, _, dim = query.shape
    group = heads // key.shape[1]
    out = torch.zeros(rows, 1, heads, dim, dtype=torch.float64)
    for row in range(rows):
        live = int(lengths[row]) + 1
        for head in range(heads):
            k, v = key[row, head // group, :live].double(), value[row, head // group, :live].double()
            probs = torch.softmax(k @ query[row, head, 0].double() * scale, dim=0)
            out[row, 0, head] = probs @ v
    return out


#: The tolerance of each input dtype against the float64 reference: float32 rounding of the products and the
#: softmax; in bfloat16 the probabilities are rounded to bfloat16 before the second product, and the result too.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


@pytest.mark.parametrize("kernel", [decode_attention, sdpa_gqa_decode_attention], ids=["matmul", "sdpa_gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("width", width_buckets(1088))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA kernels need a CUDA device"))])
def test_both_kernels_equal_a_float64_reference_at_every_bucket(kernel, dtype, group, width, device):
    """Each bucket is a width a step attends: the cache's first ``width`` columns and a mask of that width. Row 0
    is idle (only column 0 admitted), row 1 fills the bucket; masked columns hold large stale values."""
    rows, kv_heads, dim = 5, 2, 16
    heads = kv_heads * group
    generator = torch.Generator().manual_seed(width + group)
    query = torch.randn(rows, heads, 1, dim, generator=generator).to(dtype)
    key, value = (100 * torch.randn(2, rows, kv_heads, width, dim, generator=generator)).to(dtype)
    lengths = torch.randint(0, width, (rows,), generator=generator)
    lengths[0], lengths[1] = 0, width - 1
    fresh = torch.randn(2, rows, kv_heads, width, dim, generator=generator).to(dtype)
    admitted = torch.arange(width)[None] <= lengths[:, None]                              # [rows, width]
    key = torch.where(admitted[:, None, :, None], fresh[0], key)  # stale values only where masked
    value = torch.where(admitted[:, None, :, None], fresh[1], value)
    mask = torch.zeros(rows, width, dtype=dtype).masked_fill(~admitted, torch.finfo(dtype).min)[:, None, None, :]
    out, weights = kernel(_Layer(heads, kv_heads), *(t.to(device) for t in (query, key, value, mask)),
                          scaling=dim ** -0.5)
    assert out.shape == (rows, 1, heads, dim) and out.dtype == dtype and weights is None
    expected = _reference(query, key, value, lengths, dim ** -0.5)
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA kernels need a CUDA device"))])
def test_peaked_half_precision_scores_stay_float32_where_the_device_can(device, monkeypatch):
    """Scores near +-30 rounded to bfloat16 move their probabilities by percents; written in float32 (CUDA's
    ``bmm`` with ``out_dtype``; on a CPU, which has none, emulated by a float32 product of the same bfloat16
    operands) the result is within bfloat16's rounding of a float64 reference of those operands."""
    rows, kv_heads, group, width, dim = 4, 2, 2, 40, 64
    generator = torch.Generator().manual_seed(3)
    query = (3.5 * torch.randn(rows, kv_heads * group, 1, dim, generator=generator)).bfloat16()
    key = (3.5 * torch.randn(rows, kv_heads, width, dim, generator=generator)).bfloat16()
    value = torch.randn(rows, kv_heads, width, dim, generator=generator).bfloat16()
    lengths = torch.full((rows,), width - 1)
    mask = torch.zeros(rows, 1, 1, width, dtype=torch.bfloat16)
    expected = _reference(query, key, value, lengths, dim ** -0.5)
    assert (query.double().view(rows, kv_heads, group, dim) @ key.double().transpose(-1, -2)).abs().max() * \
        dim ** -0.5 > 25  # peaked

    def error(float32_scores: bool, query: torch.Tensor) -> float:
        monkeypatch.setitem(decode_attention_module._FLOAT32_SCORES, key.to(device).device, float32_scores)
        with torch.autocast(device, dtype=torch.bfloat16):  # as under bf16-mixed
            out, _ = decode_attention(_Layer(kv_heads * group, kv_heads),
                                      *(t.to(device) for t in (query, key, value, mask)), scaling=dim ** -0.5)
        return float((out.cpu().double() - expected).abs().max())

    if device == "cpu":
        real_bmm = torch.bmm

        def bmm(a, b, out_dtype=None):  # as CUDA's bmm.dtype, which autocast passes through
            with torch.autocast("cpu", enabled=False):
                return real_bmm(a.float(), b.float())

        monkeypatch.setattr(torch, "bmm", bmm)
    else:
        assert decode_attention_module.float32_scores(torch.device(device))  # bare "cuda" probes cuda:N
        assert decode_attention_module._FLOAT32_SCORES[key.to(device).device]
    # a bfloat16 query, and a float32 one (under bf16-mixed the rotary embedding hands the query over in float32)
    for given in (query, query.float()):
        assert error(True, given) < 0.03 < error(False, given)


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
        with step_attention(model):
            assert model.config._attn_implementation == DECODE_ATTENTION
            raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"
    with step_attention(model, "sdpa_gqa"):
        assert model.config._attn_implementation == SDPA_GQA_DECODE_ATTENTION
    with pytest.raises(ValueError, match=r"kernel 'flash' is not known; use one of \['matmul', 'sdpa_gqa'\]"):
        with step_attention(model, "flash"):
            pass
    model.config._attn_implementation = "eager"
    try:
        with step_attention(model):
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


def test_the_engine_decodes_with_the_configured_kernel_and_names_a_bad_one(tiny_llama, prompt_ids, monkeypatch):
    model, tokenizer = tiny_llama
    with pytest.raises(ValueError, match=r"sampling.decode_attention='flash' is not known; use one of "
                                         r"\['matmul', 'sdpa_gqa'\]"):
        SamplingConfig(decode_attention="flash")
    calls = {DECODE_ATTENTION: 0, SDPA_GQA_DECODE_ATTENTION: 0}
    for name in calls:
        original = ALL_ATTENTION_FUNCTIONS[name]
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, name,
                            lambda *args, _name=name, _original=original, **kwargs:
                            calls.__setitem__(_name, calls[_name] + 1) or _original(*args, **kwargs))
    settings = dict(group_size=3, micro_group_size=2, strategy="continuous", max_new_tokens=8, temperature=0.0)
    results = {}
    for kernel in ("matmul", "sdpa_gqa"):
        engine = RolloutEngine(model, tokenizer, decode_attention=kernel, **settings)
        results[kernel] = engine.generate(prompt_ids)
        assert engine._step.settings.attention == kernel
    steps = results["matmul"].stats.decode_steps * model.config.num_hidden_layers
    assert calls == {DECODE_ATTENTION: steps, SDPA_GQA_DECODE_ATTENTION: steps}
    # float32, other kernels: the same greedy tokens while no step is a near tie (a random tiny model has none)
    assert results["sdpa_gqa"].completion_ids == results["matmul"].completion_ids
    for expected, got in zip(results["matmul"].logprobs, results["sdpa_gqa"].logprobs):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-5)


def test_the_float32_scores_probe_is_keyed_as_a_tensors_device_reads(monkeypatch):
    """``decode_attention`` looks the answer up by ``key.device`` (``cuda:0``), so a bare ``cuda`` asks for the
    current device's (stand-ins for the CUDA calls: the answer is there already, nothing is probed)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setitem(decode_attention_module._FLOAT32_SCORES, torch.device("cuda", 0), True)
    assert decode_attention_module.float32_scores(torch.device("cuda")) is True
    assert torch.device("cuda") not in decode_attention_module._FLOAT32_SCORES
