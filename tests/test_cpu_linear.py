"""The rollout's linears on oneDNN (sampling.cpu_linear): same products up to rounding, restored after, chosen
where they apply and refused by name where they do not."""

from __future__ import annotations

import warnings

import pytest
import torch

from lit_grpo.sampling import RolloutEngine, SamplingConfig
from lit_grpo.sampling import cpu_linear
from lit_grpo.sampling.cpu_linear import onednn_linears, resolve_cpu_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def _linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@needs_onednn
def test_a_model_computes_the_same_logits_on_onednn_and_is_restored_after(tiny_llama):
    model, _ = tiny_llama
    ids = torch.randint(0, model.config.vocab_size, (3, 7))
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
        with onednn_linears(model):
            assert all("forward" in m.__dict__ for m in _linears(model))
            routed = model(input_ids=ids).logits
    torch.testing.assert_close(routed, reference, rtol=1e-4, atol=1e-4)
    assert all("forward" not in m.__dict__ for m in _linears(model))


@needs_onednn
def test_the_modules_are_restored_when_the_block_raises(tiny_llama):
    model, _ = tiny_llama
    with pytest.raises(RuntimeError, match="inside"):
        with onednn_linears(model):
            raise RuntimeError("inside")
    assert all("forward" not in m.__dict__ for m in _linears(model))


@needs_onednn
def test_each_row_is_computed_alone_so_schedules_stay_bit_identical():
    """A row's result does not depend on the other rows or its position: what same-g schedule invariance needs."""
    linear = torch.nn.Linear(64, 96)
    x = torch.randn(16, 1, 64)
    permutation = torch.randperm(16)
    with torch.inference_mode(), onednn_linears(linear):
        full = linear(x)
        assert torch.equal(linear(x[permutation]), full[permutation])
        assert torch.equal(linear(x[:5]), full[:5])


@needs_onednn
def test_a_rollout_runs_its_linears_on_onednn_only_when_chosen(tiny_llama, monkeypatch):
    model, tokenizer = tiny_llama
    calls = []
    original = cpu_linear._onednn_linear
    monkeypatch.setattr(cpu_linear, "_onednn_linear", lambda module, x: calls.append(x.shape) or original(module, x))
    outputs = {}
    for setting in ("torch", "onednn", "auto"):
        calls.clear()
        engine = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=2, strategy="continuous",
                               max_new_tokens=6, temperature=0.0, cpu_linear=setting)
        result = engine.generate([[5, 6, 7, 8]])
        outputs[setting] = result
        assert bool(calls) == (setting != "torch"), setting
        assert all("forward" not in m.__dict__ for m in _linears(model))  # the update gets torch's kernels back
    for setting in ("onednn", "auto"):
        for ours, theirs in zip(outputs[setting].logprobs, outputs["torch"].logprobs):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-4)


def test_auto_takes_onednn_only_for_a_float32_cpu_policy_and_an_uncompiled_step(tiny_llama):
    model, _ = tiny_llama
    assert resolve_cpu_linear("torch", model, compiled=False) is False
    assert resolve_cpu_linear("auto", model, compiled=False) is torch.backends.mkldnn.is_available()
    assert resolve_cpu_linear("auto", model, compiled=True) is False
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_cpu_linear("auto", half, compiled=False) is False  # auto stays quiet


def test_onednn_asked_for_where_it_cannot_run_warns_once_naming_why(tiny_llama):
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)
    cpu_linear._warned.clear()
    with pytest.warns(RuntimeWarning, match="cpu_linear='onednn', but the policy's weights are bfloat16, not float32"):
        assert resolve_cpu_linear("onednn", half, compiled=False) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_cpu_linear("onednn", half, compiled=False) is False  # once


def test_an_unknown_cpu_linear_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"sampling.cpu_linear='mkl' is not known; use one of \['auto', 'onednn', "
                                         r"'torch'\]"):
        SamplingConfig(cpu_linear="mkl")
