"""The decode step captured as CUDA graphs (one per attended width) returns exactly what the eager step returns
(needs a CUDA device).

The same static-shape step runs eagerly on CPU in every other engine test; this file checks only what a CPU
cannot: that capture and replay are correct and that the step needs one host synchronisation.
"""

import gc
import warnings

import pytest
import torch

from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.sampling import RolloutEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

#: float32 log-probs of a graph against the eager step: the same operations on the same inputs, but the capture runs
#: on another stream with a cuBLAS workspace of its own (torch keys workspaces by stream, and newer builds give each
#: capture its own), and cuBLAS picks a product's algorithm by the workspace it is handed, so a product may be summed
#: in another order: the log-probs agree to float32 rounding, not bit for bit. The sampled tokens are the same unless
#: a draw falls within that rounding of a boundary (none in these few hundred draws).
GRAPH_AGAINST_EAGER = dict(rtol=0, atol=1e-5)


def assert_same_samples(replayed, eager) -> None:
    """The same completions, and log-probs equal to float32 rounding (``GRAPH_AGAINST_EAGER``)."""
    assert replayed.completion_ids == eager.completion_ids
    for got, expected in zip(replayed.logprobs, eager.logprobs):
        for got_row, expected_row in zip(got, expected):
            torch.testing.assert_close(torch.tensor(got_row), torch.tensor(expected_row), **GRAPH_AGAINST_EAGER)


def _generated(model, prompt: list[int], max_new_tokens: int, eos_token_ids, pad_token_id: int) -> list[int]:
    """``model.generate``'s greedy completion of ``prompt`` on CUDA, up to its first EOS (generate pads after it;
    the engine stops there)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_token_ids, pad_token_id=pad_token_id)
    expected = out[0, len(prompt):].tolist()
    if any(t in eos_token_ids for t in expected):
        expected = expected[: next(i for i, t in enumerate(expected) if t in eos_token_ids) + 1]
    return expected


@pytest.mark.parametrize("penalty", [1.0, 1.3])  # 1.3: the rows' seen ids, written between replays, read in them
@pytest.mark.parametrize("strategy", ["continuous", "infinite"])
def test_graph_replay_equals_the_eager_step(strategy, penalty):
    model, tokenizer = load_model_and_tokenizer("tiny-qwen2", dtype="float32", device="cuda")
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2+3?", "Compute 7 + 8 + 9.", "hi")]
    results = {}
    for graph in (False, True):
        engine = RolloutEngine(model, tokenizer, group_size=5, micro_group_size=3, strategy=strategy,
                               max_new_tokens=12, temperature=1.0, seed=3, cuda_graph=graph,
                               repetition_penalty=penalty)
        results[graph] = [engine.generate(prompts) for _ in range(2)]  # the second rollout replays the same graph
        assert (engine._step.graph is not None) == graph
    for eager, replayed in zip(results[False], results[True]):
        assert_same_samples(replayed, eager)
    assert results[True][0].stats.capture_s > 0 and results[True][1].stats.capture_s == 0


def test_graphs_of_several_buckets_replay_what_the_eager_live_width_step_computes():
    """Rows crossing bucket edges: one graph per bucket reached, captured mid-rollout in one pool, replaying what the
    eager step computes (both attend the bucket of the longest live row; to float32 rounding, see
    ``GRAPH_AGAINST_EAGER``)."""
    model, tokenizer = load_model_and_tokenizer("tiny-qwen2", dtype="float32", device="cuda")
    prompts, lengths = [list(range(5, 45)), list(range(50, 60))], [[150, 30, 45, 10], [5, 20, 100, 1]]
    settings = dict(group_size=4, micro_group_size=2, strategy="continuous", max_new_tokens=150, seed=2)
    results = {}
    for graph in (False, True):
        engine = RolloutEngine(model, tokenizer, cuda_graph=graph, **settings)
        results[graph] = [engine.generate(prompts, lengths=lengths) for _ in range(2)]
    step = engine._step
    assert step.settings.live_width and step.buckets == (64, 128, 192)  # 39 + 150 rounded up to 192
    assert sorted(step.graphs) == [64, 128, 192]
    for eager, replayed in zip(results[False], results[True]):
        assert_same_samples(replayed, eager)
    assert results[True][1].stats.capture_s == 0  # every bucket's graph kept and replayed


def test_one_synchronisation_per_decode_step(monkeypatch):
    model, tokenizer = load_model_and_tokenizer("tiny-llama", dtype="bfloat16", device="cuda")
    engine = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=2, strategy="continuous",
                           max_new_tokens=8, cuda_graph=True)
    prompts = [tokenizer("What is 2+3?")["input_ids"]]
    engine.generate(prompts)  # capture outside the count
    syncs = []
    stream_type = type(torch.cuda.current_stream())
    original = stream_type.synchronize
    monkeypatch.setattr(stream_type, "synchronize", lambda self: (syncs.append(1), original(self))[1])
    result = engine.generate(prompts)
    assert len(syncs) == result.stats.decode_steps


def test_starting_rows_under_a_repetition_penalty_and_a_token_replay_waits_on_no_copy():
    """A row's seen ids and replayed tokens go to the device without a wait (a pageable source is staged at once):
    a blocking copy at each refill stalled the host once per started row."""
    import inspect

    from lit_grpo.sampling.decode_step import DecodeStep

    lines = set()
    for method in (DecodeStep._write_seen, DecodeStep._write_forced_tokens):
        source, first = inspect.getsourcelines(method)
        lines |= set(range(first, first + len(source)))
    model, tokenizer = load_model_and_tokenizer("tiny-llama", dtype="bfloat16", device="cuda")
    engine = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=2, strategy="continuous",
                           max_new_tokens=8, cuda_graph=True, repetition_penalty=1.2)
    prompts = [tokenizer("What is 2+3?")["input_ids"]]
    recorded = engine.generate(prompts).completion_ids
    engine.generate(prompts, tokens=recorded)  # both steps captured outside the count
    waits = {}
    for name, run in (("penalty", lambda: engine.generate(prompts)),
                      ("replay", lambda: engine.generate(prompts, tokens=recorded))):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        waits[name] = [w.lineno for w in caught if "synchroniz" in str(w.message)
                       and w.filename.endswith("decode_step.py") and w.lineno in lines]
    assert waits == {"penalty": [], "replay": []}, waits


def test_schedules_return_bit_identical_completions_in_bfloat16():
    """Schedule invariance on the device it is for: the same g and seed give the same bits whatever
    the schedule, with graphs replayed and every row's arithmetic independent of its neighbours. Bit-identical in
    bfloat16 is a determinism claim, not a numerical one: the same captured kernels on the same shapes. Every row
    here fits the first bucket (64 columns), so every step attends the same width; across buckets a row's
    attention may round differently from one schedule to another."""
    model, tokenizer = load_model_and_tokenizer("tiny-qwen2", dtype="bfloat16", device="cuda")
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2+3?", "Compute 7 + 8 + 9.", "hi")]
    results = {}
    for strategy in ("micro", "continuous", "infinite"):
        engine = RolloutEngine(model, tokenizer, group_size=6, micro_group_size=4, strategy=strategy,
                               max_new_tokens=24, temperature=1.0, seed=5)
        results[strategy] = engine.generate(prompts)
        assert engine._step.graph is not None
    for strategy in ("continuous", "infinite"):
        assert results[strategy].completion_ids == results["micro"].completion_ids, strategy
        assert results[strategy].logprobs == results["micro"].logprobs, strategy


def test_greedy_replayed_graph_equals_model_generate():
    model, tokenizer = load_model_and_tokenizer("tiny-llama", dtype="float32", device="cuda")
    prompt = tokenizer("Compute 7 + 8 + 9.")["input_ids"]
    engine = RolloutEngine(model, tokenizer, group_size=1, strategy="continuous", max_new_tokens=12,
                           temperature=0.0, cuda_graph=True)
    completion = engine.generate([prompt]).completion_ids[0][0]
    assert engine._step.graph is not None
    # float32, other kernels than generate's: equal tokens while no step is a near tie (tests/precision_helpers.py
    # checks such margins on the CPU tests)
    assert completion == _generated(model, prompt, 12, engine.eos_token_ids, tokenizer.pad_token_id)


def test_a_model_that_cannot_be_captured_falls_back_to_the_eager_step():
    """A forward that reads a device value on the host (here a hook calling .item()) breaks a real capture: the
    engine says why, runs the same step eagerly, and returns what the eager step returns."""
    model, tokenizer = load_model_and_tokenizer("tiny-llama", dtype="float32", device="cuda")
    prompts = [tokenizer("What is 2+3?")["input_ids"]]
    settings = dict(group_size=3, micro_group_size=2, strategy="continuous", max_new_tokens=8, seed=1)
    eager = RolloutEngine(model, tokenizer, cuda_graph=False, **settings).generate(prompts)

    def read_on_the_host(module, args, kwargs):
        kwargs["input_ids"].sum().item()  # a sync: fine eagerly, refused inside a capture

    handle = model.model.register_forward_pre_hook(read_on_the_host, with_kwargs=True)
    try:
        engine, stream = RolloutEngine(model, tokenizer, **settings), torch.cuda.current_stream()
        with pytest.warns(RuntimeWarning, match="CUDA graph failed"):
            result = engine.generate(prompts)
        assert torch.cuda.current_stream() == stream  # not left on the failed capture's stream
        assert engine._step.graph is None and engine.graph_failure
        assert "previous error" not in engine.graph_failure  # the op that broke the capture, not its aftermath
        # exact: the same eager step on the same shapes and inputs (a determinism claim)
        assert result.completion_ids == eager.completion_ids and result.logprobs == eager.logprobs
        assert engine.generate(prompts).stats.decode_steps > 0  # later rollouts run eagerly, without a warning
    finally:
        handle.remove()


def test_a_failed_capture_leaves_nothing_of_its_memory_pool_behind():
    """The graphs of a step share one pool, held by each capture from its start; a capture that fails never ends,
    so the step drops its hold: once the engine is gone, ``empty_cache`` returns all of the pool's memory. The first
    failed engine makes what a process keeps for good (the side stream's cuBLAS workspace)."""
    model, tokenizer = load_model_and_tokenizer("tiny-llama", dtype="float32", device="cuda")
    prompts = [tokenizer("What is 2+3?")["input_ids"]]
    settings = dict(group_size=3, micro_group_size=2, strategy="continuous", max_new_tokens=8, seed=1)

    def read_on_the_host(module, args, kwargs):
        kwargs["input_ids"].sum().item()

    def fail_a_capture_and_let_go() -> int:
        engine = RolloutEngine(model, tokenizer, **settings)
        with pytest.warns(RuntimeWarning, match="CUDA graph failed"):
            engine.generate(prompts)
        del engine
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    handle = model.model.register_forward_pre_hook(read_on_the_host, with_kwargs=True)
    try:
        reserved = fail_a_capture_and_let_go()
        assert fail_a_capture_and_let_go() <= reserved
    finally:
        handle.remove()


def test_prefills_and_decode_steps_are_timed_on_the_device():
    """On CUDA both times come from events (the host's clock would count the prefills' kernels inside the step that
    waits for them); each is positive and the two fit in the rollout."""
    model, tokenizer = load_model_and_tokenizer("tiny-llama", dtype="bfloat16", device="cuda")
    engine = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=2, strategy="continuous",
                           max_new_tokens=8, cuda_graph=True)
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2+3?", "Compute 7 + 8 + 9.")]
    engine.generate(prompts)  # capture outside the timing
    stats = engine.generate(prompts).stats
    assert stats.prefill_s > 0 and stats.decode_s > 0
    assert stats.prefill_s + stats.decode_s <= stats.wall_s


def test_the_compiled_step_captured_samples_what_the_eager_step_samples_and_compiles_once():
    """``compile: true`` on CUDA (what the graph captures is the compiled step): greedy completions equal the
    uncompiled graph's, log-probs within float32 fusion noise, and a later engine of the same shape reuses the
    process's compilation instead of compiling again."""
    from torch._dynamo.utils import counters

    model, tokenizer = load_model_and_tokenizer("tiny-qwen2", dtype="float32", device="cuda")
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2+3?", "Compute 7 + 8 + 9.")]
    settings = dict(group_size=4, micro_group_size=2, strategy="infinite", max_new_tokens=12, temperature=0.0)
    results = {}
    for compiled in (False, True):
        engine = RolloutEngine(model, tokenizer, compile=compiled, **settings)
        results[compiled] = [engine.generate(prompts) for _ in range(2)]
        assert engine._step.graph is not None
    graphs = counters["stats"]["unique_graphs"]
    again = RolloutEngine(model, tokenizer, compile=True, **settings).generate(prompts)
    assert counters["stats"]["unique_graphs"] == graphs > 0
    expected = results[False][0]
    for result in results[False][1:] + results[True] + [again]:
        assert result.completion_ids == expected.completion_ids
        for expected_row, row in zip(expected.logprobs, result.logprobs):
            assert torch.allclose(torch.tensor(row), torch.tensor(expected_row), atol=1e-4)


def test_a_graph_replayed_on_kept_cast_weights_samples_what_per_step_casts_sample():
    """bf16 autocast over float32 weights, as a bf16-mixed fit rolls out: a captured graph replayed on the same
    CastWeights (kept between scopes, an optimizer step in between) samples what the policy's per-step casts sample,
    and follows the new weights. The reference is captured too: a bfloat16 product summed in another order (a
    capture's own cuBLAS workspace, see ``GRAPH_AGAINST_EAGER``) moves a logit by a bfloat16 step, enough to change
    a sample, so both sides' products are chosen alike and the comparison is exact: it is about the weights."""
    from lit_grpo.runtime.distributed import CastWeights

    model, tokenizer = load_model_and_tokenizer("tiny-qwen2", dtype="float32", device="cuda")
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2+3?", "Compute 7 + 8 + 9.", "hi")]
    weights = CastWeights(model.eval(), torch.bfloat16)
    settings = dict(group_size=5, micro_group_size=3, strategy="continuous", max_new_tokens=12, seed=3)
    engine = RolloutEngine(weights.module, tokenizer, cuda_graph=True, **settings)
    # the policy's per-step casts, captured (each replay casts the weights anew); its rollouts drawn as the engine's are
    per_step = RolloutEngine(model, tokenizer, cuda_graph=True, **settings)
    for step in range(2):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            reference = per_step.generate(prompts)
            with weights.active(keep=True):
                replayed = engine.generate(prompts)
        assert replayed.completion_ids == reference.completion_ids and replayed.logprobs == reference.logprobs
        with torch.no_grad():
            model.lm_head.weight.add_(0.05 * torch.randn_like(model.lm_head.weight))  # an optimizer step
    assert engine._step.graph is not None and per_step._step.graph is not None


def test_a_compiled_step_under_a_caching_autocast_is_compiled_before_its_capture():
    """Under a plain ``torch.autocast`` (its weight-cast cache on; Lightning's is off) the warm-ups run under the
    capture's autocast, whose cache flag the compiled step guards on: it compiles there, not again inside the
    capture, where compiling fails the capture."""
    model, tokenizer = load_model_and_tokenizer("tiny-qwen2", dtype="float32", device="cuda")
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2+3?", "Compute 7 + 8 + 9.")]
    engine = RolloutEngine(model, tokenizer, compile=True, group_size=4, micro_group_size=2, strategy="continuous",
                           max_new_tokens=12, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns
        with torch.autocast("cuda", dtype=torch.bfloat16):
            engine.generate(prompts)
    assert engine._step.graph is not None and not engine.graph_failure


@pytest.mark.parametrize("compile", [False, True])
def test_a_sliding_window_model_replays_its_windowed_masks(compile):
    """tiny-gemma3 (window 6): the captured step (compiled or not) builds the sliding layers' mask from the rows'
    lengths on every replay, with live-width buckets: greedy equals generate (transformers' sliding cache), and
    sampling equals the eager step, past the window."""
    model, tokenizer = load_model_and_tokenizer("tiny-gemma3", dtype="float32", device="cuda")
    prompts = [tokenizer(text)["input_ids"] for text in ["Compute 7 + 8 + 9, step by step.", "What is 2+3?"]]
    greedy = RolloutEngine(model, tokenizer, group_size=1, strategy="continuous", max_new_tokens=16,
                           temperature=0.0, cuda_graph=True, compile=compile)
    result = greedy.generate(prompts)
    assert greedy._step.graph is not None
    for p, prompt in enumerate(prompts):
        assert result.completion_ids[p][0] == _generated(model, prompt, 16, greedy.eos_token_ids,
                                                         tokenizer.pad_token_id)
    settings = dict(group_size=3, micro_group_size=2, strategy="continuous", max_new_tokens=16, seed=2)
    replayed = RolloutEngine(model, tokenizer, cuda_graph=True, compile=compile, **settings).generate(prompts)
    eager = RolloutEngine(model, tokenizer, cuda_graph=False, compile=False, **settings).generate(prompts)
    assert_same_samples(replayed, eager)
