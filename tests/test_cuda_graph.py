"""The decode step captured as a CUDA graph returns exactly what the eager step returns (needs a CUDA device).

The same static-shape step runs eagerly on CPU in every other engine test; this file checks only what a CPU
cannot: that capture and replay are correct and that the step needs one host synchronisation.
"""

import pytest
import torch

from lit_grpo.models import load_model_and_tokenizer
from lit_grpo.sampling import RolloutEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.mark.parametrize("strategy", ["continuous", "infinite"])
def test_graph_replay_equals_the_eager_step(strategy):
    model, tokenizer = load_model_and_tokenizer("tiny-qwen2", dtype="float32", device="cuda")
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2+3?", "Compute 7 + 8 + 9.", "hi")]
    results = {}
    for graph in (False, True):
        engine = RolloutEngine(model, tokenizer, group_size=5, micro_group_size=3, strategy=strategy,
                               max_new_tokens=12, temperature=1.0, seed=3, cuda_graph=graph)
        results[graph] = [engine.generate(prompts) for _ in range(2)]  # the second rollout replays the same graph
        assert (engine._step.graph is not None) == graph
    for eager, replayed in zip(results[False], results[True]):
        assert replayed.completion_ids == eager.completion_ids
        assert replayed.logprobs == eager.logprobs
    assert results[True][0].stats.capture_s > 0 and results[True][1].stats.capture_s == 0


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
