"""completion_logps: the chunked path (no [m, T, V] logits) equals the full-logits path in values and gradients."""

import re

import pytest
import torch
from precision_helpers import WeightCasts

from lit_grpo.update.logprobs import (completion_logits, completion_logps, head_reproduces_logits, token_entropy,
                                      token_logps)
from lit_grpo.runtime.models import load_model_and_tokenizer


def micro_batch(vocab: int, generator: torch.Generator) -> dict:
    """Two prompts (one left-padded) and right-padded completions of 5 and 3 tokens."""
    prompt = torch.randint(3, vocab, (2, 4), generator=generator)
    completion = torch.randint(3, vocab, (2, 5), generator=generator)
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    return {"input_ids": torch.cat([prompt, completion], dim=1), "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "completion_ids": completion,
            "completion_mask": completion_mask}


def full_path(model, micro, temperature):
    logits = completion_logits(model, micro, temperature)
    mask = micro["completion_mask"]
    return token_logps(logits, micro["completion_ids"]) * mask, token_entropy(logits) * mask


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_and_gradients_equal_the_full_logits(name, temperature):
    model, _ = load_model_and_tokenizer(name)
    model = model.double().train()
    micro = micro_batch(model.config.vocab_size, torch.Generator().manual_seed(0))
    assert head_reproduces_logits(model)
    weights = torch.randn(2, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def run(chunked: bool):
        model.zero_grad(set_to_none=True)
        if chunked:  # 3 tokens' logits per chunk: the 8 real tokens take 3 chunks
            logps, entropy = completion_logps(model, micro, temperature, chunk_bytes=3 * 4 * model.config.vocab_size)
        else:
            logps, entropy = full_path(model, micro, temperature)
        (logps * weights).sum().backward()
        return logps.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    chunked, full = run(True), run(False)
    mask = micro["completion_mask"].bool()
    torch.testing.assert_close(chunked[0], full[0])
    assert (chunked[0][~mask] == 0).all() and (chunked[0][mask] < 0).all()
    torch.testing.assert_close(chunked[1], full[1])
    assert not chunked[1].requires_grad
    assert chunked[2].keys() == full[2].keys() and len(full[2]) > 0
    for key in full[2]:
        torch.testing.assert_close(chunked[2][key], full[2][key], msg=key)


class ScaledLogits(torch.nn.Module):
    """A model whose logits are its output head's times 2 (as a logit scale or soft-capping would change them)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        out.logits = out.logits * 2
        return out


class FailingForward(ScaledLogits):
    def forward(self, **kwargs):
        raise RuntimeError("no hidden states here")


def test_a_head_that_cannot_be_checked_falls_back_to_the_full_logits_and_says_why():
    model, _ = load_model_and_tokenizer("tiny-llama")
    with pytest.warns(RuntimeWarning, match=r"the output head of FailingForward could not be checked against its "
                                            r"logits \(RuntimeError: no hidden states here\); the update computes"):
        assert not head_reproduces_logits(FailingForward(model))


def test_models_that_post_process_logits_fall_back_to_the_full_logits():
    model, _ = load_model_and_tokenizer("tiny-llama")
    scaled = ScaledLogits(model.double())
    assert head_reproduces_logits(model) and not head_reproduces_logits(scaled)
    micro = micro_batch(model.config.vocab_size, torch.Generator().manual_seed(2))
    with torch.no_grad():
        logps, entropy = completion_logps(scaled, micro, chunk_bytes=4)
        expected_logps, expected_entropy = full_path(scaled, micro, 1.0)
        unscaled, _ = full_path(model, micro, 1.0)
    torch.testing.assert_close(logps, expected_logps)
    torch.testing.assert_close(entropy, expected_entropy)
    assert not torch.allclose(logps, unscaled)  # the chunked path would have given these
    with pytest.raises(ValueError, match="chunk_bytes=0 must be >= 1"):
        completion_logps(model, micro, chunk_bytes=0)


def test_a_micro_batch_without_real_tokens_still_has_a_gradient_path():
    model, _ = load_model_and_tokenizer("tiny-llama")
    micro = micro_batch(model.config.vocab_size, torch.Generator().manual_seed(3))
    micro["completion_mask"] = torch.zeros_like(micro["completion_mask"])
    logps, entropy = completion_logps(model, micro)
    assert logps.requires_grad and (logps == 0).all() and (entropy == 0).all()
    logps.sum().backward()  # a zero loss, but backward works as for any other micro-batch


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tied", [False, True])
def test_under_autocast_the_head_is_cast_once_and_gives_the_per_chunk_casts_values_and_gradients(
        monkeypatch, name, temperature, tied):
    """bf16 autocast over float32 weights: the head's weight is cast once for the micro-batch's forward and backward
    (per chunk before, forward and recomputation), and the log-probs, entropies and every gradient are the per-chunk
    casts' to the bit (the same bfloat16 products, summed in autograd's order)."""
    import lit_grpo.update.logprobs as logprobs

    model, _ = load_model_and_tokenizer(name)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.train()
    micro = micro_batch(model.config.vocab_size, torch.Generator().manual_seed(0))
    weights = torch.randn(2, 5, generator=torch.Generator().manual_seed(1))
    head = model.get_output_embeddings()
    assert head_reproduces_logits(model)  # checked once per model, outside the counts
    chunk_bytes = 3 * 4 * model.config.vocab_size

    def run():
        model.zero_grad(set_to_none=True)
        with WeightCasts([head.weight]) as casts:
            # Lightning's bf16-mixed autocast, without a cast cache; 3 tokens per chunk: the 8 real tokens take 3
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                logps, entropy = completion_logps(model, micro, temperature, chunk_bytes=chunk_bytes)
            (logps * weights).sum().backward()
        return logps.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}, casts.count

    once = run()
    monkeypatch.setattr(logprobs, "head_cast_dtype", lambda *args: None)
    per_chunk = run()
    # the model's own head runs on one position (logits_to_keep=1); then the 3 chunks, each cast in its forward and
    # in its recomputation, or all of them once
    assert (once[3], per_chunk[3]) == (2, 1 + 2 * 3)
    assert torch.equal(once[0], per_chunk[0]) and torch.equal(once[1], per_chunk[1])
    assert once[2].keys() == per_chunk[2].keys()
    for key in per_chunk[2]:
        assert torch.equal(once[2][key], per_chunk[2][key]), key


def test_the_chunks_are_sized_for_the_micro_batchs_device(monkeypatch):
    """A chunk of the device's ``LOGITS_CHUNK_BYTES``: a GPU's larger (fewer, larger head matmuls), a CPU's as set."""
    from lit_grpo.update import logprobs

    assert logprobs.LOGITS_CHUNK_BYTES["cuda"] > logprobs.LOGITS_CHUNK_BYTES["cpu"]
    model, _ = load_model_and_tokenizer("tiny-llama")
    micro = micro_batch(model.config.vocab_size, torch.Generator().manual_seed(0))  # 8 real tokens
    chunks, chunk_logps = [], logprobs._chunk_logps
    monkeypatch.setattr(logprobs, "_chunk_logps", lambda *args: chunks.append(len(args[1])) or chunk_logps(*args))
    monkeypatch.setitem(logprobs.LOGITS_CHUNK_BYTES, "cpu", 3 * 4 * model.config.vocab_size)
    with torch.no_grad():
        completion_logps(model, micro)
    assert chunks == [3, 3, 2]


def written_out_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` each position's entropy as its formula, through autograd: ``-sum(p log p)``."""
    log_probs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunked", [True, False])
def test_with_entropy_grad_the_entropies_gradient_is_autograds_of_its_formula(name, temperature, chunked):
    """The entropy bonus's path: the chunked one (checkpointed chunks, ``_EntropyOfLogits``) and the full logits'
    give the entropies and every weight's gradient of ``sum(w1 logp + w2 H)`` that autograd of ``-sum(p log p)``
    over the whole logits gives, at the sampling temperature."""
    model, _ = load_model_and_tokenizer(name)
    model = model.double().train()
    micro = micro_batch(model.config.vocab_size, torch.Generator().manual_seed(0))
    w1, w2 = torch.randn(2, 2, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mask = micro["completion_mask"]

    def run(ours: bool):
        model.zero_grad(set_to_none=True)
        if ours:
            logps, entropy = completion_logps(model, micro, temperature, chunked=chunked, entropy_grad=True,
                                              chunk_bytes=3 * 4 * model.config.vocab_size)
        else:
            logits = completion_logits(model, micro, temperature)
            logps, entropy = token_logps(logits, micro["completion_ids"]) * mask, written_out_entropy(logits) * mask
        (logps * w1 + entropy * w2).sum().backward()
        return entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ours, want = run(True), run(False)
    torch.testing.assert_close(ours[0], want[0])
    assert ours[0].dtype == torch.float64 and (ours[0][~mask.bool()] == 0).all()
    assert ours[1].keys() == want[1].keys() and len(want[1]) > 0
    for key in want[1]:
        torch.testing.assert_close(ours[1][key], want[1][key], msg=key)
    # the entropy term moves the gradient: without it the weights' gradients differ
    model.zero_grad(set_to_none=True)
    logps, _ = completion_logps(model, micro, temperature, chunked=chunked)
    (logps * w1).sum().backward()
    assert any(not torch.allclose(p.grad, ours[1][n]) for n, p in model.named_parameters() if p.grad is not None)


def per_row_entropy_and_grad(logits: torch.Tensor, grad_entropy: torch.Tensor):
    """``[m, T]`` entropies and the ``[m, T, V]`` gradient of ``sum(grad_entropy * H)``, a ``[T, V]`` row at a time
    in float32 and cast back to the logits' dtype: ``_EntropyOfLogits``' arithmetic written out."""
    entropies, grads = [], []
    for row, weight in zip(logits, grad_entropy):
        log_probs = torch.log_softmax(row.float(), dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
        entropies.append(entropy)
        grads.append((log_probs.exp() * (log_probs + entropy[:, None]) * -weight[:, None]).to(logits.dtype))
    return torch.stack(entropies), torch.stack(grads)


def peak_bytes(fn) -> int:
    """The most bytes of host memory that ``fn()`` held at once beyond what it started with (the profiler's
    allocation records, in order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                     key=lambda e: e.start_ns())
    held = peak = 0
    for record in records:
        held += record.nbytes()
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_entropys_backward_holds_one_gradient_of_the_logits_size_and_its_values_are_the_per_row_formulas(
        dtype):
    """The full-logits path's entropy (``entropy_with_grad`` of ``[m, T, V]`` logits): entropies and gradient equal,
    to the bit, the per-row float32 formulas cast to the logits' dtype (also of a slice, as the model's logits
    are), and the backward holds one tensor of the logits' size (plus a row's float32 work), not every row's
    gradient until they are stacked into a second one."""
    from lit_grpo.update.logprobs import entropy_with_grad

    generator = torch.Generator().manual_seed(0)
    m, t, v = 16, 8, 2048
    logits = (torch.randn(m, t, v, generator=generator) * 3).to(dtype).requires_grad_(True)
    weights = torch.randn(m, t, generator=generator)
    entropy = entropy_with_grad(logits)
    want_entropy, want_grad = per_row_entropy_and_grad(logits.detach(), weights)
    assert entropy.dtype == torch.float32 and torch.equal(entropy.detach(), want_entropy)
    size = logits.numel() * logits.element_size()
    peak = peak_bytes(lambda: (entropy * weights).sum().backward())
    assert torch.equal(logits.grad, want_grad)
    assert peak < 1.6 * size, (peak / size, dtype)
    full = torch.cat([logits.detach(), logits.detach()[:, :1]], dim=1).requires_grad_(True)
    entropy = entropy_with_grad(full[:, :-1])  # not contiguous
    (entropy * weights).sum().backward()
    assert torch.equal(entropy.detach(), want_entropy) and torch.equal(full.grad[:, :-1], want_grad)
    # a 2-D [n, V] input (the chunked path's) is one row
    flat = logits.detach()[0].requires_grad_(True)
    entropy = entropy_with_grad(flat)
    (entropy * weights[0]).sum().backward()
    assert torch.equal(entropy.detach(), want_entropy[0]) and torch.equal(flat.grad, want_grad[0])


@pytest.mark.parametrize("chunked", [True, False])
def test_without_entropy_grad_the_entropy_carries_no_graph(chunked):
    """The default (no entropy bonus): the entropies are float32 values without a grad_fn on every path, so the
    backward neither keeps nor recomputes anything for them."""
    model, _ = load_model_and_tokenizer("tiny-llama")
    micro = micro_batch(model.config.vocab_size, torch.Generator().manual_seed(0))
    logps, entropy = completion_logps(model, micro, chunked=chunked, chunk_bytes=3 * 4 * model.config.vocab_size)
    assert logps.grad_fn is not None and entropy.grad_fn is None and not entropy.requires_grad
    assert entropy.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):  # the cast-once head
        _, entropy = completion_logps(model, micro, chunk_bytes=3 * 4 * model.config.vocab_size)
    assert entropy.grad_fn is None
    _, entropy = completion_logps(model, micro, chunked=chunked, entropy_grad=True)
    assert entropy.grad_fn is not None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_under_autocast_the_cast_once_head_gives_the_entropys_gradient_as_the_per_chunk_casts(
        monkeypatch, temperature):
    """bf16 autocast over float32 weights with ``entropy_grad``: the cast-once head's backward adds the entropies'
    gradient to each chunk's logits' and gives the per-chunk casts' (autograd's) entropies and gradients, up to
    the float32 sums' order (a bfloat16 rounding at most), and the log-probs to the bit."""
    import lit_grpo.update.logprobs as logprobs

    model, _ = load_model_and_tokenizer("tiny-llama")
    model.train()
    micro = micro_batch(model.config.vocab_size, torch.Generator().manual_seed(0))
    w1, w2 = torch.randn(2, 2, 5, generator=torch.Generator().manual_seed(1))

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            logps, entropy = completion_logps(model, micro, temperature, entropy_grad=True,
                                              chunk_bytes=3 * 4 * model.config.vocab_size)
        (logps * w1 + entropy * w2).sum().backward()
        return logps.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    once = run()
    monkeypatch.setattr(logprobs, "head_cast_dtype", lambda *args: None)
    per_chunk = run()
    w2 = torch.zeros_like(w2)
    without = run()  # no entropy term: the head's gradient moves by far more than the tolerance below
    assert torch.equal(once[0], per_chunk[0])
    torch.testing.assert_close(once[1], per_chunk[1], atol=1e-5, rtol=1e-5)
    for key in per_chunk[2]:
        scale = float(per_chunk[2][key].abs().max())
        torch.testing.assert_close(once[2][key], per_chunk[2][key], atol=1e-5 * scale, rtol=1e-3, msg=key)
    head = "lm_head.weight"
    assert float((without[2][head] - per_chunk[2][head]).abs().max()) > 1e-3 * float(per_chunk[2][head].abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_ids_of_another_shape_or_dtype_than_the_logits_rows_are_named(dtype):
    """``[m, 1]`` ids beside ``[m, T, V]`` logits broadcast against the logsumexp into ``[m, T]`` values of the
    wrong tokens without the check."""
    logits = torch.randn(2, 3, 7, dtype=dtype)
    for ids in (torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long),
                torch.zeros(6, dtype=torch.long)):
        shape = re.escape(str(tuple(ids.shape)))
        with pytest.raises(ValueError, match=rf"token_ids has shape {shape}, expected the logits' "
                                             r"rows \(2, 3\) \(logits \[m, T, V\] = \(2, 3, 7\)\)"):
            token_logps(logits, ids)
    with pytest.raises(ValueError, match=r"token_ids must be integer ids, got torch.float32"):
        token_logps(logits, torch.zeros(2, 3))


def test_a_hand_made_micro_batch_missing_a_key_or_of_mismatched_shapes_is_named():
    """A loop of one's own builds the micro-batch dict itself: a missing key was a KeyError, a mask of another shape
    or a completion longer than the input an IndexError from inside the gather."""
    model, _ = load_model_and_tokenizer("tiny-llama")
    ids = torch.randint(3, 300, (2, 7))
    ones = torch.ones(2, 7, dtype=torch.long)
    micro = dict(input_ids=ids, attention_mask=ones, position_ids=ones.cumsum(1) - 1, completion_ids=ids[:, 4:],
                 completion_mask=ones[:, 4:])
    for function in (completion_logps, completion_logits):
        with pytest.raises(ValueError, match=r"the micro-batch lacks \['position_ids'\]; it holds input_ids, "
                                             r"attention_mask, position_ids"):
            function(model, {k: v for k, v in micro.items() if k != "position_ids"})
        with pytest.raises(ValueError, match=r"completion_mask has shape \(2, 7\), expected completion_ids' \(2, 3\)"):
            function(model, {**micro, "completion_mask": ones})
        with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 6\), expected input_ids' \(2, 7\)"):
            function(model, {**micro, "attention_mask": ones[:, 1:]})
        longer = torch.randint(3, 300, (2, 7))
        with pytest.raises(ValueError, match=r"completion_ids \(2, 7\) must be the last T' < 7 columns of "
                                             r"input_ids \(2, 7\)"):
            function(model, {**micro, "completion_ids": longer, "completion_mask": ones})


def test_the_head_check_leaves_each_module_in_the_mode_it_found_it_in():
    """The check runs the model in eval mode once; a part its owner keeps in eval stays so after it, as after a
    rollout: ``model.train(was_training)`` would turn it on."""
    model, _ = load_model_and_tokenizer("tiny-llama")
    model.train()
    model.lm_head.eval()
    assert head_reproduces_logits(model)
    assert model.training and model.model.training and not model.lm_head.training
