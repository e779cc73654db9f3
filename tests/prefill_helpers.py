"""Checks that a packed prefill computes each prompt as that prompt's forward alone computes it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lit_grpo.runtime.models import cache_keyword
from lit_grpo.sampling.kv_cache import PrefillCache, cache_layers_kv
from lit_grpo.sampling.prefill import pack_chunk, packed_forward, split_prefixes


def assert_packed_logits_equal_alone(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                                     atol: float = 1e-5) -> None:
    """The logits of ``prompts`` packed in one forward equal each prompt's forward alone."""
    chunk = pack_chunk(prompts, torch.device("cpu"))
    with torch.no_grad(), packed_forward(model, chunk) as inputs:
        packed = model(input_ids=chunk.input_ids, **inputs).logits[0]
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([prompt])).logits[0] for prompt in prompts]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=atol)


def assert_packed_prefixes_equal_alone(model: torch.nn.Module, prefixes: Sequence[Sequence[int]], dtype: torch.dtype,
                                       tolerance: float, longer_than: int = 0) -> None:
    """Every layer's keys and values of ``prefixes`` packed in one prefill (``PrefillCache`` in ``dtype``, split)
    equal those of each prefix prefilled alone within ``tolerance``; each prefix's are all its positions, and more
    than ``longer_than`` (a window the check must see past)."""
    with torch.inference_mode():
        packed = pack_chunk(prefixes, torch.device("cpu"))
        cache = PrefillCache(model.config, dtype)
        with packed_forward(model, packed) as inputs:
            model(input_ids=packed.input_ids, **{cache_keyword(model): cache}, use_cache=True, **inputs)
        for prefix, kv in zip(prefixes, split_prefixes(cache_layers_kv(cache), packed)):
            alone = PrefillCache(model.config, dtype)
            model(input_ids=torch.tensor([prefix]), **{cache_keyword(model): alone}, use_cache=True)
            for (keys, values), (own_keys, own_values) in zip(kv, cache_layers_kv(alone)):
                assert keys.shape[2] == own_keys.shape[2] == len(prefix) > longer_than
                torch.testing.assert_close(keys, own_keys, rtol=tolerance, atol=tolerance)
                torch.testing.assert_close(values, own_values, rtol=tolerance, atol=tolerance)
