"""The decode step is capturable as a CUDA graph: checked on CPU by running it on the meta device.

A CUDA graph replays kernels only; a step that read a device value on the host (``.item()``, ``bool(tensor)``,
``.tolist()``, ``nonzero``, a data-dependent branch in the model's masking code) would either break the capture or
synchronise every step. Meta tensors have shapes but no data, and every such read raises on them, so a step that
runs on the meta device has none, for the whole forward (transformers' own code included) and the sampling.
"""

import pytest
import torch

from lit_grpo.models import load_model_and_tokenizer
from lit_grpo.sampling.decode_step import DecodeStep, StepSettings
from lit_grpo.sampling.kv_cache import SlotKVCache

META = torch.device("meta")
SETTINGS = [
    StepSettings(temperature=1.0, top_k=0, top_p=1.0, force_lengths=False, hidden_states=False, cuda_graph=False),
    StepSettings(temperature=0.7, top_k=5, top_p=0.9, force_lengths=True, hidden_states=True, cuda_graph=False),
    StepSettings(temperature=0.0, top_k=0, top_p=1.0, force_lengths=False, hidden_states=True, cuda_graph=False),
]


def test_the_meta_device_refuses_every_host_read():
    probe = torch.zeros(3, device=META)
    for read in (lambda: probe.sum().item(), lambda: bool(probe[0]), lambda: probe.tolist()):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()


@pytest.mark.parametrize("name, dtype", [("tiny-llama", "float32"), ("tiny-qwen2", "float32"),
                                         ("random:qwen3-0.6b", "bfloat16"), ("random:llama3.2-1b", "bfloat16")])
@pytest.mark.parametrize("settings", SETTINGS, ids=["sample", "top-k-p-forced-hidden", "greedy-hidden"])
def test_the_decode_step_never_reads_a_device_value_on_the_host(name, dtype, settings):
    model, tokenizer = load_model_and_tokenizer(name, dtype=dtype, device=META)
    cache = SlotKVCache(model.config, num_slots=3, width=16, dtype=model.dtype, device=META)
    step = DecodeStep(model.eval(), cache, settings, eos_token_ids=[tokenizer.eos_token_id])
    buffers = [step.input_ids, step.tokens, step.logprobs, cache.lengths, cache.layers[0].keys]
    with torch.inference_mode():
        step._run()
        step._run()
    # the step wrote its outputs in place: the same tensors a captured graph would read and write
    assert [t.shape for t in buffers] == [(3, 1), (3,), (3,), (3,), cache.layers[0].keys.shape]
    assert step.tokens is buffers[1] and cache.layers[0].keys is buffers[4]
    if settings.hidden_states:
        assert step.hidden.shape == (3, model.config.hidden_size) and step.hidden.device == META
