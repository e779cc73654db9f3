"""The repetition penalty (``SamplingConfig.repetition_penalty``): transformers' semantics over the prompt and the
completion so far, in every strategy's decode step, in the sampling log-probs, in token replays and in rows that
resume; 1.0 leaves the step as it was."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.sampling import RolloutEngine
from lit_grpo.sampling.decode_step import vocab_size
from lit_grpo.sampling.token_sampler import filter_logits, penalize_repetitions
from scheduler_helpers import trust_predictions

PROMPTS = ["What is 2+3?", "Compute the sum of 7, 8 and 9. Think step by step.", "hi", "Name a colour."]
PENALTY = 1.3


@pytest.fixture(scope="module")
def tiny64():
    """tiny-llama in float64 and the prompts' ids: what the schedules' row counts change in the logits vanishes in
    the sampler's float32 (see the ``tiny`` fixture in conftest.py)."""
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    return model.double().eval(), tokenizer, [tokenizer(text)["input_ids"] for text in PROMPTS]


def _engine(model, tokenizer, strategy="continuous", **options):
    settings = dict(group_size=3, micro_group_size=2, strategy=strategy, max_new_tokens=12, temperature=1.0,
                    top_k=20, seed=7, repetition_penalty=PENALTY) | options
    return RolloutEngine(model, tokenizer, **settings)


def _flat(nested):
    return torch.tensor([x for group in nested for row in group for x in row], dtype=torch.float64)


def _penalized_logprobs(model, prompt, completion, penalty, temperature, top_k):
    """``[L]`` log-probs of ``completion`` under transformers' repetition penalty over prompt + completion prefix,
    then the temperature and top-k, from one plain forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()                              # [L, V]
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    penalized = torch.cat([processor(ids[:, :len(prompt) + t], logits[t:t + 1].clone())
                           for t in range(len(completion))])
    logprobs = torch.log_softmax(filter_logits(penalized / temperature, top_k=top_k), -1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


# ------------------------------------------------------------------------------------------- the function
@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_penalize_repetitions_is_transformers_processor_bit_for_bit(penalty):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=generator) * 3                    # both signs
    logits[0, :5] = 0.0                                                      # and zeros
    ids = torch.randint(0, 50, (4, 30), generator=generator)                # repeats within a row
    seen = torch.zeros(4, 50, dtype=torch.bool).scatter_(1, ids, True)
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    got = penalize_repetitions(logits, seen, penalty)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert torch.equal(got[~seen], logits[~seen]) and not torch.equal(got, logits)
    # logits of another dtype are penalized in float32, as generate's float32 copy of them is
    assert torch.equal(penalize_repetitions(logits.double(), seen, penalty), expected)


# ------------------------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("strategy,slots", [("micro", 2), ("continuous", 2), ("infinite", 2), ("full", None)])
def test_greedy_completions_equal_transformers_generate_with_the_penalty(tiny, strategy, slots):
    """With fewer slots than samples, rows start mid-rollout beside running ones; each must still penalize its own
    prompt and tokens only. Float64 weights: the two implementations' logits differ by ~1e-16 before the float32
    cast both penalize, so no greedy step is a near tie between them."""
    model, tokenizer = tiny
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    engine = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=slots, strategy=strategy,
                           max_new_tokens=24, temperature=0.0, repetition_penalty=PENALTY)
    result = engine.generate(prompts)
    repeated = 0
    for p, prompt in enumerate(prompts):
        inputs = dict(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=24, do_sample=False)
        expected = model.generate(**inputs, repetition_penalty=PENALTY)[0, len(prompt):].tolist()
        plain = model.generate(**inputs)[0, len(prompt):].tolist()
        assert result.completion_ids[p] == [expected] * 3, p
        repeated += len(set(plain)) < len(plain) and plain != expected
    assert repeated >= 2  # without the penalty the greedy completions repeat tokens, and differ


def test_sampling_logprobs_are_those_of_the_penalized_distribution(tiny64):
    model, tokenizer, prompts = tiny64
    result = _engine(model, tokenizer, temperature=0.7, top_k=20).generate(prompts)
    gaps = []
    for p, prompt in enumerate(prompts):
        for completion, logprobs in zip(result.completion_ids[p], result.logprobs[p]):
            expected = _penalized_logprobs(model, prompt, completion, PENALTY, 0.7, 20)
            assert torch.isfinite(expected).all()  # no token top-k drops after the penalty was drawn
            assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-5)
            unpenalized = _penalized_logprobs(model, prompt, completion, 1.0, 0.7, 20)
            gaps.append(float((expected - unpenalized).abs().max()))
    assert max(gaps) > 1e-2  # the penalty changed what the sampler reports


def test_a_token_replay_under_the_penalty_reproduces_tokens_and_logprobs(tiny64):
    """The replayed rows draw other tokens (another seed) and ignore them: the ids a row has seen are the ones it
    emits, so each recorded token is scored against the recorded sequence."""
    model, tokenizer, prompts = tiny64
    recorded = _engine(model, tokenizer).generate(prompts)
    replay = _engine(model, tokenizer, seed=9).generate(prompts, tokens=recorded.completion_ids)
    assert replay.completion_ids == recorded.completion_ids and replay.truncated == recorded.truncated
    # exact: the same schedule, rows and tokens through the same kernels in one process
    assert torch.allclose(_flat(replay.logprobs), _flat(recorded.logprobs), atol=1e-9, rtol=0)
    free = _engine(model, tokenizer, seed=9).generate(prompts)
    assert free.completion_ids != recorded.completion_ids  # the replay's own draws were other tokens


def test_carried_and_parked_rows_still_penalize_the_tokens_they_generated_before(tiny64):
    """A carried sample (partial rollouts: its row prefilled again in a later call) and a parked one (its KV put
    aside and written back) start a row again: the row's seen ids must hold its tokens so far, not its prompt's
    alone, for the completions and log-probs of one uninterrupted rollout."""
    model, tokenizer, prompts = tiny64
    options = dict(strategy="continuous", max_new_tokens=16, repetition_penalty=3.0)
    # a token drawn early stops samples too, so they end at different steps and a rollout stops some midway
    early = _engine(model, tokenizer, **options).generate(prompts).completion_ids[0][0][2]
    options["eos_token_ids"] = [tokenizer.eos_token_id, early]
    whole = _engine(model, tokenizer, **options).generate(prompts)

    engine = _engine(model, tokenizer, **options)
    groups = engine.new_groups(prompts, tags=list(range(len(prompts))))
    completions, logprobs, resumed = {}, {}, 0
    while groups:
        result = engine.generate_groups(groups, complete=1)
        completions.update(zip(result.tags, result.completion_ids))
        logprobs.update(zip(result.tags, result.logprobs))
        resumed += sum(bool(s.tokens) and not s.done for g in result.carried for s in g.samples)
        groups = result.carried
    assert resumed > 0  # some samples stopped mid-completion and went on from their tokens
    assert [completions[p] for p in range(len(prompts))] == whole.completion_ids
    assert torch.allclose(_flat([logprobs[p] for p in range(len(prompts))]), _flat(whole.logprobs), atol=1e-6)

    parking = _engine(model, tokenizer, **(options | dict(strategy="infinite", probe_tokens=3, park_budget=None)))
    trust_predictions(parking.scheduler)
    parked = parking.generate(prompts)
    assert parking.scheduler.last_info["parked_samples"] > 0
    assert parked.completion_ids == whole.completion_ids
    assert torch.allclose(_flat(parked.logprobs), _flat(whole.logprobs), atol=1e-6)


# ------------------------------------------------------------------------------------------- off, and bad values
def test_a_penalty_of_one_keeps_no_seen_ids_and_a_penalty_changes_the_samples(tiny_llama):
    model, tokenizer = tiny_llama
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    default = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, max_new_tokens=10, seed=3)
    explicit = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, max_new_tokens=10, seed=3,
                             repetition_penalty=1.0)
    first, second = default.generate(prompts), explicit.generate(prompts)
    assert first.completion_ids == second.completion_ids and first.logprobs == second.logprobs
    assert default._step.seen is None and explicit._step.seen is None  # no state kept, nothing more per step
    penalized = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, max_new_tokens=10, seed=3,
                              repetition_penalty=1.2)
    assert penalized.generate(prompts).completion_ids != first.completion_ids
    assert penalized._step.seen.shape == (2, vocab_size(model)) and penalized._step.seen.dtype == torch.bool
