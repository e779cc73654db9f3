"""The rollout engine: schedule invariance, greedy parity, KV bounds, step arithmetic, bad inputs."""

import functools
import math
import re

import pytest
import torch

from lit_grpo.sampling import IDLE, STRATEGIES, RolloutEngine
from lit_grpo.sampling.decode_step import DecodeStep, vocab_size
from lit_grpo.sampling.prefill import prefill_chunks
from lit_grpo.sampling.token_sampler import filter_logits
from lit_grpo.scheduling.config import InfiniteSchedulerConfig, LengthAwareConfig
from precision_helpers import assert_greedy_margin
from scheduler_helpers import trust_predictions

G = 5


def _ids(tokenizer, texts):
    return [tokenizer(t)["input_ids"] for t in texts]


PROMPTS = ["What is 2+3?", "Compute the sum of 7, 8 and 9. Think step by step.", "hi"]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0),
                                                           (0.8, 20, 0.9, 0.05)])
def test_every_strategy_and_micro_group_size_returns_the_same_completions(tiny, temperature, top_k, top_p, min_p):
    model, tokenizer = tiny
    prompts = _ids(tokenizer, PROMPTS)
    runs = {}
    for strategy in ("full", "micro", "continuous", "infinite"):
        for g in (1, 3, G):
            engine = RolloutEngine(model, tokenizer, group_size=G, micro_group_size=g, strategy=strategy,
                                   max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p,
                                   min_p=min_p, seed=7)
            runs[(strategy, g)] = engine.generate(prompts)
    reference = runs[("full", 1)]
    # Precision: the strategies run from 1 to 15 rows, and float64 products over different row counts may round
    # differently in the last bits; the sampler then works in float32 (token_sampler), so a log-prob is the same
    # float32 number unless such a difference crosses a float32 rounding: one ulp, ~5e-7 at |log-prob| ~ 6, hence
    # 2e-6. A token could differ only if its uniform fell within that of a CDF boundary (~1e-7 odds per draw).
    for key, result in runs.items():
        assert result.completion_ids == reference.completion_ids, key
        for got, want in zip(sum(result.logprobs, []), sum(reference.logprobs, [])):
            assert got == pytest.approx(want, abs=2e-6), key
    if temperature > 0:  # samples of a group differ: each draws from its own stream
        assert len({tuple(c) for c in reference.completion_ids[0]}) > 1


def test_successive_rollouts_draw_fresh_samples_and_seeds_differ(tiny_llama, prompt_ids):
    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, group_size=3, max_new_tokens=8, seed=1)
    first, second = engine.generate(prompt_ids), engine.generate(prompt_ids)
    assert first.completion_ids != second.completion_ids
    other_seed = RolloutEngine(model, tokenizer, group_size=3, max_new_tokens=8, seed=2).generate(prompt_ids)
    assert other_seed.completion_ids != first.completion_ids
    state = engine.state_dict()
    resumed = RolloutEngine(model, tokenizer, group_size=3, max_new_tokens=8, seed=1)
    resumed.load_state_dict(state)
    assert resumed.generate(prompt_ids).completion_ids == engine.generate(prompt_ids).completion_ids


def test_streams_key_each_group_whatever_its_place_in_the_call(tiny_llama, prompt_ids):
    model, tokenizer = tiny_llama
    make = lambda: RolloutEngine(model, tokenizer, group_size=3, max_new_tokens=8, seed=1)  # noqa: E731
    both = make().generate(prompt_ids[:2], streams=[7, 4])
    alone = make().generate(prompt_ids[1:2], streams=[4])
    assert alone.completion_ids[0] == both.completion_ids[1]
    assert make().generate(prompt_ids[1:2]).completion_ids[0] != alone.completion_ids[0]  # default: stream 0
    for streams, message in [([4], r"must be \[B=2\] ints"), ([1, 1], "repeat a value"), ([-1, 2], r"\[0, 2\*\*32\)"),
                             ([0, 2**32], r"\[0, 2\*\*32\)"), ([True, 2], "ints")]:
        with pytest.raises(ValueError, match=message):
            make().generate(prompt_ids[:2], streams=streams)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_greedy_output_equals_model_generate(name):
    from lit_grpo.runtime.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(name)
    prompts = _ids(tokenizer, PROMPTS)
    engine = RolloutEngine(model, tokenizer, group_size=2, micro_group_size=3, strategy="continuous",
                           max_new_tokens=12, temperature=0.0)
    result = engine.generate(prompts)
    for p, prompt in enumerate(prompts):
        expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        # float32, other kernels than generate's: equal tokens because no step is a near tie
        assert_greedy_margin(model, prompt, expected)
        assert result.completion_ids[p] == [expected, expected]


@pytest.mark.parametrize("top_k,min_p", [(30, 0.0), (0, 0.5)])  # 0.5 drops about half the tokens here
def test_sampling_logprobs_match_a_teacher_forced_forward(tiny, top_k, min_p):
    model, tokenizer = tiny
    prompts = _ids(tokenizer, PROMPTS)
    temperature = 0.7
    engine = RolloutEngine(model, tokenizer, group_size=2, micro_group_size=2, strategy="continuous",
                           max_new_tokens=9, temperature=temperature, top_k=top_k, min_p=min_p, seed=3)
    result = engine.generate(prompts)
    for p, prompt in enumerate(prompts):
        for completion, logprobs in zip(result.completion_ids[p], result.logprobs[p]):
            ids = torch.tensor([prompt + completion])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:-1]
            expected = torch.log_softmax(filter_logits(logits.float() / temperature, top_k=top_k, min_p=min_p), -1)
            expected = expected.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
            assert torch.isfinite(expected).all()  # no token the filters drop was drawn
            assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-5)


def test_top_k_one_is_greedy(tiny_llama, prompt_ids):
    model, tokenizer = tiny_llama
    greedy = RolloutEngine(model, tokenizer, group_size=2, max_new_tokens=8, temperature=0.0).generate(prompt_ids)
    engine = RolloutEngine(model, tokenizer, group_size=2, max_new_tokens=8, temperature=1.0, top_k=1)
    top1 = engine.generate(prompt_ids)
    assert top1.completion_ids == greedy.completion_ids


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, top_p=0.79))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.01)).tolist() == [[True, False, False, False]]


def test_top_p_stops_at_the_token_whose_mass_reaches_it_exactly():
    # a nucleus whose mass equals top_p exactly is complete: the next token is dropped
    logits = torch.tensor([[1.0, 0.0, -1.0, -2.0]])
    probs = (logits - logits.logsumexp(-1, keepdim=True)).exp()
    reached = probs[0, 0] + probs[0, 1]  # float32, as the filter sums them
    assert torch.isfinite(filter_logits(logits, top_p=float(reached))).tolist() == [[True, True, False, False]]
    above = float(torch.nextafter(reached, torch.tensor(1.0)))
    assert torch.isfinite(filter_logits(logits, top_p=above)).tolist() == [[True, True, True, False]]


def test_top_p_keeps_every_token_tied_with_the_last_one_kept():
    """The nucleus does not depend on the order a sort gives equal logits (it differs between devices)."""
    assert torch.isfinite(filter_logits(torch.zeros(1, 4), top_p=0.5)).all()
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])  # masses 0.58, 0.21, 0.21, 0.08
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]):
        kept = torch.isfinite(filter_logits(logits[:, order], top_p=0.7))
        assert kept.tolist() == [[order[i] != 3 for i in range(4)]]
    # after top-k (which keeps its own ties: tokens 0, 1 and 2 here) the nucleus is taken over the tokens it keeps
    assert torch.isfinite(filter_logits(logits, top_k=2, top_p=0.5)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, top_k=2, top_p=0.8)).tolist() == [[True, True, True, False]]


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (5, 0.9), (50, 0.5), (200, 0.95)])
def test_top_p_over_the_top_k_equals_a_sort_of_the_whole_vocabulary(top_k, top_p):
    """With top-k on, the nucleus is found among its k tokens only; it is the one a sort of all V finds."""
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(top_k)) * 3
    expected = logits.clone()
    if top_k:
        expected[expected < torch.topk(expected, top_k).values[:, -1:]] = float("-inf")
    ordered, order = torch.sort(expected, descending=True)
    mass_before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)
    expected[torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)] = -math.inf
    assert torch.equal(torch.isfinite(filter_logits(logits, top_k=top_k, top_p=top_p)), torch.isfinite(expected))


def test_top_p_finds_its_nucleus_among_the_top_logits_on_a_cpu_as_a_sort_of_the_whole_row_does(monkeypatch):
    """Rows whose nucleus the top 256 hold, rows that need the top 4096 and rows that need every token (a flat
    row), alone and together: the same tokens kept, bit for bit, as a sort of all V; and no sort where the top
    logits held every row's nucleus."""
    from lit_grpo.sampling import token_sampler

    generator = torch.Generator().manual_seed(0)
    peaked = torch.randn(4, 10000, generator=generator) * 5         # a nucleus of tens of tokens
    wide = torch.randn(4, 10000, generator=generator) * 2.4         # of one or two thousand
    flat = torch.randn(4, 10000, generator=generator) * 0.05        # nearly all
    sorts = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sorts.append(1) or real_sort(*a, **k))
    for rows, top_p, sorted_ in [(peaked, 0.9, False), (wide, 0.9, False), (flat, 0.9, True),
                                 (torch.cat([peaked, wide]), 0.95, False), (torch.cat([peaked, flat]), 0.5, True)]:
        sorts.clear()
        got = filter_logits(rows, top_p=top_p)
        assert bool(sorts) == sorted_
        monkeypatch.setattr(token_sampler, "NUCLEUS_SEARCH", ())
        assert torch.equal(got, filter_logits(rows, top_p=top_p))
        monkeypatch.undo()
        monkeypatch.setattr(torch, "sort", lambda *a, **k: sorts.append(1) or real_sort(*a, **k))


def test_top_p_on_a_cpu_sorts_only_the_rows_its_search_does_not_hold_and_draws_what_a_whole_sort_draws(
        monkeypatch):
    """Rows of all three kinds, shuffled: a flat row is sorted alone (its top 256 cannot reach top_p within 4096
    tokens, so that search is skipped), a wide row is searched among its top 4096 alone, a peaked one among its top
    256; the tokens kept, drawn and their log-probs are a whole sort's, bit for bit."""
    from lit_grpo.sampling import token_sampler

    generator = torch.Generator().manual_seed(1)
    peaked = torch.randn(3, 10000, generator=generator) * 5
    wide = torch.randn(2, 10000, generator=generator) * 2.4
    flat = torch.randn(2, 10000, generator=generator) * 0.05
    rows = torch.cat([peaked, wide, flat])[torch.randperm(7, generator=generator)]
    uniforms = torch.rand(7, generator=generator, dtype=torch.float64)
    calls = []
    real_sort, real_topk = torch.sort, torch.topk
    monkeypatch.setattr(torch, "sort", lambda x, *a, **k: calls.append(("sort", x.shape[0])) or real_sort(x, *a, **k))
    monkeypatch.setattr(torch, "topk", lambda x, k, *a, **kw: calls.append((k, x.shape[0])) or real_topk(x, k, *a,
                                                                                                          **kw))
    got = filter_logits(rows, top_p=0.9)
    drawn = token_sampler.sample_tokens(rows, uniforms, 1.0, top_p=0.9)
    assert calls[:3] == [(256, 7), ("sort", 2), (4096, 2)]  # filter_logits's calls
    monkeypatch.setattr(token_sampler, "NUCLEUS_SEARCH", ())  # every row sorted whole
    assert torch.equal(got, filter_logits(rows, top_p=0.9))
    expected = token_sampler.sample_tokens(rows, uniforms, 1.0, top_p=0.9)
    assert torch.equal(drawn[0], expected[0]) and torch.equal(drawn[1], expected[1])


def test_top_p_after_top_k_counts_the_mass_of_the_tokens_tied_with_its_last():
    """Top-k keeps the tokens tied with its k-th (common in logits upcast from bfloat16): top-p's masses are shares
    of all it keeps, not of its k candidates alone, which would stop the nucleus short of top_p."""
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]])  # top-3 keeps all four: masses 0.68, 0.25, 0.034, 0.034
    assert torch.isfinite(filter_logits(logits, top_k=3, top_p=0.69)).tolist() == [[True, True, False, False]]
    logits = (torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 4).round() / 4  # many ties
    for top_k, top_p in [(5, 0.5), (20, 0.9), (50, 0.95)]:
        expected = logits.masked_fill(logits < torch.topk(logits, top_k).values[:, -1:], -math.inf)
        ordered = torch.sort(expected, descending=True).values
        before = torch.nn.functional.pad(ordered.softmax(-1).cumsum(-1)[:, :-1], (1, 0))
        floor = ordered.gather(-1, (before < top_p).sum(-1, keepdim=True) - 1)
        assert torch.equal(torch.isfinite(filter_logits(logits, top_k=top_k, top_p=top_p)), expected >= floor)


def test_min_p_keeps_the_tokens_near_the_most_likely_one():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]])) + 3.0  # any offset
    assert torch.isfinite(filter_logits(logits, min_p=0.2)).tolist() == [[True, True, True, False],
                                                                        [False, True, True, True]]
    assert torch.isfinite(filter_logits(logits, min_p=0.7)).tolist() == [[True, False, False, False],
                                                                        [False, False, False, True]]
    # a ratio of probabilities: the same after top-p has dropped the tail and the rest is renormalized
    assert torch.isfinite(filter_logits(logits, top_p=0.8, min_p=0.5)).tolist() == [[True, True, False, False],
                                                                                    [False, False, True, True]]
    assert torch.equal(filter_logits(logits, min_p=0.0), logits)


# ------------------------------------------------------------------------------ forced lengths: step arithmetic
LENGTHS = [[5, 1, 3], [2, 2, 7]]


def _forced(model, tokenizer, strategy, g, lengths=LENGTHS, max_new_tokens=10):
    engine = RolloutEngine(model, tokenizer, group_size=len(lengths[0]), micro_group_size=g, strategy=strategy,
                           max_new_tokens=max_new_tokens, temperature=1.0)
    prompts = _ids(tokenizer, PROMPTS[: len(lengths)])
    return engine.generate(prompts, lengths=lengths)


def test_forced_lengths_are_replayed_exactly(tiny_llama):
    result = _forced(*tiny_llama, "continuous", 2)
    assert [[len(c) for c in group] for group in result.completion_ids] == LENGTHS
    assert not any(sum(result.truncated, []))
    eos = tiny_llama[1].eos_token_id
    assert all(c[-1] == eos and eos not in c[:-1] for c in sum(result.completion_ids, []))


@pytest.mark.parametrize("strategy", ["full", "micro", "continuous", "infinite"])
def test_a_replayed_length_past_the_cap_is_cut_there_truncated(tiny_llama, strategy):
    """Recorded at a larger cap: the sample runs to this cap without EOS and is truncated, as a live run's would
    be; a recorded length at the cap ends with EOS there."""
    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, strategy=strategy, max_new_tokens=4)
    result = engine.generate([[5, 6, 7]], lengths=[[10, 4, 2]])
    eos = tokenizer.eos_token_id
    assert [len(c) for c in result.completion_ids[0]] == [4, 4, 2]
    assert result.truncated == [[True, False, False]]
    assert eos not in result.completion_ids[0][0] and result.completion_ids[0][1][-1] == eos


def test_continuous_refills_a_freed_slot_at_once_across_groups(tiny_llama):
    stats = _forced(*tiny_llama, "continuous", 2).stats
    # FIFO on 2 slots, jobs 5,1,3 | 2,2,7: slot 0 runs 5 then 2 (steps 0-4, 5-6); slot 1 runs 1, 3, 2, 7
    # (steps 0, 1-3, 4-5, 6-12): 13 steps.
    assert stats.decode_steps == 13
    assert stats.lower_bound_steps == max(math.ceil(20 / 2), 7) == 10
    assert stats.generated_tokens == 20
    assert stats.slot_utilization == pytest.approx(20 / (13 * 2))
    flat = lambda p, k: p * 3 + k
    assert [row[1] for row in stats.timeline] == [flat(0, 1)] + [flat(0, 2)] * 3 + [flat(1, 0)] * 2 + [flat(1, 2)] * 7
    assert [row[0] for row in stats.timeline] == [flat(0, 0)] * 5 + [flat(1, 1)] * 2 + [IDLE] * 6


def test_micro_rounds_wait_for_their_longest_member(tiny_llama):
    stats = _forced(*tiny_llama, "micro", 2).stats
    # rounds (5, 1), (3), (2, 2), (7): 5 + 3 + 2 + 7 steps; no round mixes prompts.
    assert stats.decode_steps == 17
    assert stats.slot_utilization == pytest.approx(20 / 34)
    assert all(cell == IDLE for cell in stats.timeline[1][1:])  # the finished row is not run


def test_micro_runs_at_most_a_groups_samples_at_once(tiny_llama):
    # micro's rounds hold one prompt's samples, so a g above G would only hold idle rows (and their KV memory)
    wide, exact = _forced(*tiny_llama, "micro", 8), _forced(*tiny_llama, "micro", 3)
    assert len(wide.stats.timeline[0]) == len(exact.stats.timeline[0]) == 3
    assert wide.stats.slot_utilization == exact.stats.slot_utilization and wide.completion_ids == exact.completion_ids
    assert len(_forced(*tiny_llama, "continuous", 8).stats.timeline[0]) == 6  # across groups: every sample


def test_infinite_parks_and_resumes_samples_without_changing_them(tiny_llama):
    model, tokenizer = tiny_llama
    prompts = _ids(tokenizer, PROMPTS)
    engine = RolloutEngine(model, tokenizer, group_size=6, micro_group_size=2, strategy="infinite",
                           max_new_tokens=20, seed=4, predictor="online", probe_tokens=4)
    trust_predictions(engine.scheduler)
    result = engine.generate(prompts)
    assert engine.scheduler.last_info["parked_samples"] > 0  # the probe really parked samples
    full = RolloutEngine(model, tokenizer, group_size=6, strategy="full", max_new_tokens=20, seed=4).generate(prompts)
    assert result.completion_ids == full.completion_ids
    # the length-aware method scored its predictions: real numbers in their ranges (a NaN would fail here)
    assert -1.0 <= result.stats.length_pred_kendall_tau <= 1.0
    assert 0.0 <= result.stats.length_pred_smape <= 2.0


def test_infinite_with_the_oracle_reaches_the_lower_bound(tiny_llama):
    lengths = [[30, 3, 17, 9, 25, 4, 11, 28], [6, 21, 2, 14, 30, 8, 19, 5]]
    continuous = _forced(*tiny_llama, "continuous", 4, lengths=lengths, max_new_tokens=30).stats
    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, group_size=8, micro_group_size=4, strategy="infinite",
                           max_new_tokens=30, predictor="oracle")
    result = engine.generate(_ids(tokenizer, PROMPTS[:2]), lengths=lengths)
    stats = result.stats
    assert [[len(c) for c in group] for group in result.completion_ids] == lengths
    assert stats.lower_bound_steps == max(math.ceil(sum(map(sum, lengths)) / 4), 30) == 58
    assert stats.decode_steps <= 1.02 * stats.lower_bound_steps < continuous.decode_steps
    assert stats.length_pred_kendall_tau == pytest.approx(1.0)


def test_the_default_infinite_scheduler_touches_no_length_predictor(tiny_llama, prompt_ids, monkeypatch):
    """The default of "infinite" is least attained service: no predictor is built, asked or taught, in the rollout
    that runs first come (nothing seen yet) nor in the one that preempts; every decision gives a default reason."""
    from lit_grpo.scheduling import LeastAttainedScheduler
    from lit_grpo.scheduling.length_aware.predictors import OnlineLengthPredictor, OracleLengthPredictor

    calls = []

    def spy(name, original):
        def called(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
        return called

    for cls, method in [(OnlineLengthPredictor, "__init__"), (OnlineLengthPredictor, "predict"),
                        (OnlineLengthPredictor, "observe"), (OracleLengthPredictor, "predict")]:
        monkeypatch.setattr(cls, method, spy(f"{cls.__name__}.{method}", getattr(cls, method)))
    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, strategy="infinite", group_size=8, micro_group_size=2,
                           max_new_tokens=48, seed=0)
    assert type(engine.scheduler) is LeastAttainedScheduler
    lengths = [[40, 1, 2, 1, 3, 1, 2, 1]] * len(prompt_ids)  # heavy-tailed: the second rollout preempts
    results = [engine.generate(prompt_ids, lengths=lengths) for _ in range(2)]
    assert calls == []
    assert [result.stats.preempting for result in results] == [0.0, 1.0]
    for result in results:
        assert [[len(c) for c in group] for group in result.completion_ids] == lengths
        decisions = result.stats.decisions
        assert decisions and {d.reason for d in decisions} <= {"arrival", "least_attained", "preemption"}
        assert sum(d.action == "start" for d in decisions) == 8 * len(prompt_ids)  # every sample started once
        assert result.stats.length_pred_kendall_tau is None and result.stats.length_pred_smape is None
    assert any(d.action == "park" and d.reason == "preemption" for d in results[1].stats.decisions)
    # the spies are live: the length-aware method on the same engine settings does call them
    RolloutEngine(model, tokenizer, strategy="infinite", group_size=8, micro_group_size=2, max_new_tokens=48,
                  predictor="online")
    assert calls == ["OnlineLengthPredictor.__init__"]


def test_full_runs_every_sample_at_once(tiny_llama):
    stats = _forced(*tiny_llama, "full", 1).stats
    assert stats.num_slots == 6 and stats.decode_steps == 7
    assert sum(cell != IDLE for row in stats.timeline for cell in row) == 20


def test_length_cap_marks_truncation(tiny_llama, prompt_ids):
    model, tokenizer = tiny_llama
    result = RolloutEngine(model, tokenizer, group_size=2, max_new_tokens=3, temperature=1.0,
                           eos_token_ids=[0]).generate(prompt_ids)  # id 0 is never sampled by this tiny model
    for group, flags in zip(result.completion_ids, result.truncated):
        for completion, truncated in zip(group, flags):
            assert len(completion) == 3 and truncated == (completion[-1] != 0)


# ------------------------------------------------------------------------------------------------- KV memory
def test_kv_bytes_are_bounded_by_the_slots_not_the_group(tiny_llama):
    model, tokenizer = tiny_llama
    prompts = _ids(tokenizer, PROMPTS)
    config = model.config
    bytes_per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    max_new, g = 12, 3
    prefixes = sum(len(p) - 1 for p in prompts) * bytes_per_position
    # the prompts prefill as one chunk, split into their prefixes a layer at a time: one layer of it held twice
    split = prefixes // config.num_hidden_layers
    slot_bound = g * (max(map(len, prompts)) - 1 + max_new) * bytes_per_position  # a row: the longest prefix + L
    peaks = {}
    for G_ in (3, 12, 24):
        for strategy in ("micro", "continuous"):
            engine = RolloutEngine(model, tokenizer, group_size=G_, micro_group_size=g, strategy=strategy,
                                   max_new_tokens=max_new)
            peaks[(strategy, G_)] = engine.generate(prompts).stats.peak_kv_bytes
            assert peaks[(strategy, G_)] == slot_bound + prefixes + split
    full = RolloutEngine(model, tokenizer, group_size=24, strategy="full", max_new_tokens=max_new)
    assert full.generate(prompts).stats.peak_kv_bytes > 4 * peaks[("continuous", 24)]
    assert peaks[("continuous", 24)] == peaks[("continuous", 12)]  # G does not move the peak


def test_bfloat16_and_qwen2_run(tiny_llama):
    from lit_grpo.runtime.models import load_model_and_tokenizer

    for name in ("tiny-llama", "tiny-qwen2"):
        model, tokenizer = load_model_and_tokenizer(name, dtype="bfloat16")
        result = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, max_new_tokens=6).generate(
            _ids(tokenizer, PROMPTS))
        assert result.stats.generated_tokens == sum(len(c) for g in result.completion_ids for c in g) > 0
        assert result.stats.peak_kv_bytes % 2 == 0


# ------------------------------------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("kwargs,match", [
    (dict(group_size=0), "group_size=0"),
    (dict(micro_group_size=0), "micro_group_size=0"),
    (dict(strategy="beam"), "strategy='beam'"),
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(temperature=float("inf")), r"temperature=inf must be 0 \(greedy\) or a finite number >= 1e-05"),
    (dict(temperature=1e-40), r"temperature=1e-40 must be 0 \(greedy\) or a finite number >= 1e-05 \(below it the "
                              r"logits divided by it overflow\)"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_k=-1), r"top_k=-1 must be an integer >= 0 \(0 disables it: vLLM's and verl's -1\)"),
    (dict(top_p=1.5), r"^sampling.top_p=1.5 is not allowed; sampling.top_p must be a finite number > 0 and <= 1$"),
    (dict(min_p=1.0), r"^sampling.min_p=1.0 is not allowed; sampling.min_p must be a finite number >= 0 and < 1 "
                      r"\(0 disables it\)$"),
    (dict(min_p=-0.1), "min_p=-0.1"),
    *[(dict(repetition_penalty=value), rf"^sampling.repetition_penalty={value!r} is not allowed; "
                                        r"sampling.repetition_penalty must be a finite number > 0 \(1.0 "
                                        r"disables it; above 1 penalizes the tokens already in the sequence\)$")
      for value in (0.0, -1.2, float("inf"), float("nan"), True, "1.2", None)],
    (dict(max_new_tokens=0), "max_new_tokens=0"),
])
def test_bad_engine_arguments_are_named(tiny_llama, kwargs, match):
    model, tokenizer = tiny_llama
    with pytest.raises(ValueError, match=match):
        RolloutEngine(model, tokenizer, **({"group_size": 2} | kwargs))


@pytest.mark.parametrize("options", [{"preempt_tokens": 16}, {"length_aware": {"predictor": "oracle"}},
                                     InfiniteSchedulerConfig(length_aware=LengthAwareConfig(predictor="oracle"))])
def test_scheduler_options_are_not_taken_for_a_scheduler(tiny_llama, options):
    # SamplingConfig's ``scheduler`` field shares its name with the engine's override: the clash is named
    with pytest.raises(TypeError, match=r"is the 'infinite' strategy's options: give them flat"):
        RolloutEngine(*tiny_llama, group_size=4, micro_group_size=2, scheduler=options)


def test_an_object_that_is_no_scheduler_is_named_when_the_engine_is_built(tiny_llama):
    with pytest.raises(TypeError, match=r"scheduler=object object has no begin, waiting, admit, waits, probe, "
                                        r"preempt, finish, end: give a lit_grpo.scheduling.Scheduler"):
        RolloutEngine(*tiny_llama, group_size=4, micro_group_size=2, scheduler=object())

    class WithoutWaiting:  # every other method the driver calls: it would fail in generate, at its first admission
        def __init__(self, inner):
            for name in ("begin", "admit", "waits", "probe", "preempt", "finish", "end"):
                setattr(self, name, getattr(inner, name))

    with pytest.raises(TypeError, match=r"scheduler=WithoutWaiting object has no waiting: give"):
        RolloutEngine(*tiny_llama, group_size=4, micro_group_size=2,
                      scheduler=WithoutWaiting(RolloutEngine(*tiny_llama, group_size=4).scheduler))

    class Wrapper:  # a proxy that forwards every attribute serves as its scheduler does
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

    inner = RolloutEngine(*tiny_llama, group_size=4, micro_group_size=2).scheduler
    engine = RolloutEngine(*tiny_llama, group_size=4, micro_group_size=2, max_new_tokens=4, scheduler=Wrapper(inner))
    assert len(engine.generate([[1, 2, 3]]).completion_ids[0]) == 4


def test_bad_prompts_are_named(tiny_llama):
    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, group_size=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="non-empty list"):
        engine.generate([])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[5, 6], []])
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[5, 10**6]])
    long_engine = RolloutEngine(model, tokenizer, group_size=2, max_new_tokens=2000)
    with pytest.raises(ValueError, match="max_position_embeddings=2048"):
        long_engine.generate([[5] * 100])
    with pytest.raises(ValueError, match=r"lengths must be \[B=1\]\[G=2\]"):
        engine.generate([[5, 6]], lengths=[[1, 2, 3]])


@pytest.mark.parametrize("prompts, match", [
    ([[5.7, 6.0]], r"prompt 0 has token ids that are not integers: \[5.7, 6.0\]"),  # was taken as [5, 6]
    ([["5", "6"]], r"prompt 0 has token ids that are not integers: \['5', '6'\]"),  # was parsed
    ([[True, 5]], r"prompt 0 has token ids that are not integers: \[True\]"),  # was token 1
    ([b"ab"], r"prompt 0 is b'ab'; each prompt is a string or a list of token ids"),  # was tokens 97, 98
    ([5, 6, 7], r"prompt 0 is 5; each prompt is .*for one prompt of token ids pass \[\[5, 6, 7\]\]"),
    ([[[5, 6]]], r"prompt 0 has token ids that are not integers: \[\[5, 6\]\]"),
    ([{"prompt": "hi"}], r"prompt 0 is \{'prompt': 'hi'\}; each prompt is a string or a list of token ids"),
    ([None], r"prompt 0 is None"),
])
def test_token_ids_that_are_not_integers_are_refused_not_converted(tiny_llama, prompts, match):
    engine = RolloutEngine(*tiny_llama, group_size=2, max_new_tokens=2)
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts)


def test_bad_replay_streams_stop_ids_and_state_are_named(tiny_llama):
    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, group_size=2, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"lengths must be \[B=1\]\[G=2\], got \[1, 2\]"):
        engine.generate([[5, 6]], lengths=[1, 2])  # one row, not [B][G]
    with pytest.raises(ValueError, match=r"streams=3 must be \[B=1\] ints"):
        engine.generate([[5, 6]], streams=3)
    with pytest.raises(ValueError, match=r"streams=tensor\(3\) must be \[B=1\] ints"):  # a 0-d tensor: no list
        engine.generate([[5, 6]], streams=torch.tensor(3))
    with pytest.raises(TypeError, match=r"each must be a GroupProgress .*generate\(prompts\) takes the prompts"):
        engine.generate_groups([[5, 6]])
    with pytest.raises(ValueError, match=r"finish=0 must be a list of indices"):
        engine.generate_groups(engine.new_groups([[5, 6]]), finish=0)
    vocab = vocab_size(model)
    for ids in ([-1], [vocab], [1.5], ["2"], [True], 2):  # -1 made the last token a stop token
        with pytest.raises(ValueError, match=rf"eos_token_ids=.* must be a list of token ids, ints in \[0, {vocab}\)"):
            RolloutEngine(model, tokenizer, group_size=2, eos_token_ids=ids)
    with pytest.raises(TypeError, match=r"model=None must be a transformers causal LM"):
        RolloutEngine(None, tokenizer, group_size=2)
    with pytest.raises(ValueError, match=r"is not an engine's state_dict: it needs 'rollout_index'"):
        engine.load_state_dict({})
    # the stream key holds 32 bits of the index: 2**32 would draw rollout 0's numbers again
    for index in (-1, 2**32, "3"):
        with pytest.raises(ValueError, match=rf"rollout_index={index!r} is not allowed"):
            engine.load_state_dict({"rollout_index": index})
    with pytest.raises(ValueError, match=r"^an engine state has unknown keys \['carried'\]; it holds rollout_index, "
                                         r"scheduler \(scheduler may be absent\)$"):  # a builder's: was dropped
        engine.load_state_dict({"rollout_index": 1, "carried": []})
    assert engine.rollout_index == 0
    # integer ids as tensors or arrays are still taken
    lengths = torch.tensor([[1, 2]])
    result = engine.generate([torch.tensor([5, 6])], lengths=lengths, streams=torch.tensor([3]))
    assert [len(c) for c in result.completion_ids[0]] == [1, 2]
    assert RolloutEngine(model, tokenizer, group_size=2, eos_token_ids=(3, 3, 0)).eos_token_ids == [0, 3]


def test_bad_engine_arguments_show_the_value_bounded_and_a_huge_int_by_its_digits(tiny_llama):
    """Each refusal shows the bad value as the shared checks do: a repr of an int of more than 4300 digits failed
    with Python's int-to-str ValueError in place of the refusal, a long value ran on."""
    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, group_size=2, max_new_tokens=2)
    huge, holding = 10**5000, r"a list holding an int of more than \d+ digits"
    cases = [
        (lambda: RolloutEngine(huge, tokenizer, group_size=2), TypeError,
         r"^model=\(an int of 5001 digits\) must be a transformers causal LM"),
        (lambda: RolloutEngine(model, huge, group_size=2), TypeError,
         r"^tokenizer=\(an int of 5001 digits\) must be a transformers tokenizer or None"),
        (lambda: RolloutEngine(model, tokenizer, group_size=2, scheduler={"preempt_tokens": huge}), TypeError,
         r"^scheduler=a dict holding an int of more than \d+ digits is the 'infinite' strategy's options"),
        (lambda: RolloutEngine(model, tokenizer, group_size=2, eos_token_ids=[huge]), ValueError,
         rf"^eos_token_ids={holding} must be a list of token ids"),
        (lambda: engine.load_state_dict(huge), ValueError,
         r"^state=\(an int of 5001 digits\) is not an engine's state_dict: it needs 'rollout_index'$"),
        (lambda: engine.new_groups([[5, 6]], tags=huge), ValueError,
         r"^tags is an int of 5001 digits for 1 prompts: give a list of one per prompt$"),
        (lambda: engine.generate_groups(huge), TypeError, r"^groups=\(an int of 5001 digits\) must be a list of "
                                                          r"GroupProgress"),
        (lambda: engine.generate_groups(engine.new_groups([[5, 6]]), complete=huge), ValueError,
         r"^complete=\(an int of 5001 digits\) must be an integer between 1 and the number of groups \(1\)$"),
        (lambda: engine.generate_groups(engine.new_groups([[5, 6]]), finish=huge), ValueError,
         r"^finish=\(an int of 5001 digits\) must be a list of indices of the groups"),
        (lambda: engine.generate_groups(engine.new_groups([[5, 6]]), finish=[huge]), ValueError,
         rf"^finish={holding} must be indices of the groups"),
        (lambda: engine.generate(huge), ValueError, r"^prompts must be a non-empty list of strings or token-id lists, "
                                                    r"got an int of 5001 digits$"),
        (lambda: engine.generate([huge]), ValueError, r"^prompt 0 is an int of 5001 digits; each prompt is a string or "
                                                      r"a list of token ids; for one prompt of token ids pass "
                                                      r"\[\[an int of 5001 digits\]\]$"),
        (lambda: engine.generate([[5, huge]]), ValueError, rf"^prompt 0 has token ids outside \[0, \d+\): {holding}$"),
        (lambda: engine.generate([[5, 6]], lengths=huge), ValueError,
         r"^lengths must be \[B=1\]\[G=2\], got an int of 5001 digits$"),
        (lambda: engine.generate([[5, 6]], lengths=[[1, -huge]]), ValueError,
         r"^forced lengths must be >= 1, got a negative int of 5001 digits$"),
        (lambda: engine.generate([[5, 6]], lengths=[["x" * 500, 1]]), ValueError,
         rf"^forced lengths must be integers, got {re.escape(repr(['x' * 500])[:100])}$"),
        (lambda: engine.generate([[5, 6]], streams=huge), ValueError,
         r"^streams=\(an int of 5001 digits\) must be \[B=1\] ints in \[0, 2\*\*32\)$"),
        (lambda: engine.generate([[5, 6]], streams=[huge]), ValueError, rf"^streams={holding} must be \[B=1\] ints"),
        (lambda: engine.generate([[5, 6]], tokens=[[[5], [huge]]]), ValueError,
         r"^tokens\[0\]\[1\]\[0\] = an int of 5001 digits \(prompt 0, sample 1\); token ids are ints in \[0, "),
    ]
    for make, error, message in cases:
        with pytest.raises(error, match=message):
            make()


def test_every_strategy_is_documented_runs_on_its_slots_and_an_unknown_one_is_named(tiny_llama, prompt_ids):
    import re

    from lit_grpo.sampling import engine as engine_module
    from lit_grpo.sampling.config import SamplingConfig

    documented = re.findall(r'^"(\w+)" ', engine_module.__doc__, flags=re.MULTILINE)  # the docstring's table
    assert tuple(documented) == STRATEGIES
    model, tokenizer = tiny_llama
    lengths = [[4, 1]] * len(prompt_ids)
    for strategy in STRATEGIES:
        engine = RolloutEngine(model, tokenizer, group_size=2, micro_group_size=1, strategy=strategy,
                               max_new_tokens=4)
        stats = engine.generate(prompt_ids, lengths=lengths).stats
        wide = strategy == "full"  # every sample at once; the others run one at a time on g = 1
        assert stats.num_slots == (2 * len(prompt_ids) if wide else 1)
        assert stats.decode_steps == (4 if wide else 5 * len(prompt_ids))
    with pytest.raises(ValueError, match=re.escape(f"sampling.strategy='beam' is not known; use one of "
                                                   f"{list(STRATEGIES)}")):
        SamplingConfig(strategy="beam")


# ------------------------------------------------------------------------------- static slot cache, decode step
@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 (the default model) in float32, loaded once for the tests of this module that run it."""
    from lit_grpo.runtime.models import DEFAULT_MODEL, load_model_and_tokenizer

    return load_model_and_tokenizer(DEFAULT_MODEL, dtype="float32")


def _chat_prompts(tokenizer, questions):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"] for q in questions]


@pytest.mark.xdist_group("smollm2")
def test_schedules_are_bit_identical_on_smollm2_in_float32(smollm2):
    """Every decode step has the same shapes, so a row's arithmetic does not depend on what runs beside it: the
    g-slot strategies return bit-identical completions and log-probs on a real model in float32. A determinism
    claim, not a numerical one: every strategy runs the same kernels (packed oneDNN linears and the decode
    attention compute each row alone, tests/test_cpu_linear.py and tests/test_decode_attention.py) on the same
    shapes and the same prefill chunks (tests/test_prefill.py) in one process, so it holds on any CPU."""
    model, tokenizer = smollm2
    prompts = _chat_prompts(tokenizer, ["What is 12 + 7?", "Name three colours."])
    results, engines = {}, {}
    for strategy in ("micro", "continuous", "infinite"):
        # a cap of 3 keeps the decode steps (most of the time, a whole forward of the real model each) few, and a
        # parked sample still decodes 2 tokens after its probe; G = 4 > g = 3: micro's rounds leave slots idle
        options = {"probe_tokens": 1} if strategy == "infinite" else {}
        engines[strategy] = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=3, strategy=strategy,
                                          max_new_tokens=3, temperature=1.0, seed=5, **options)
        if strategy == "infinite":
            trust_predictions(engines[strategy].scheduler)
        results[strategy] = engines[strategy].generate(prompts)
    assert engines["infinite"].scheduler.last_info["parked_samples"] > 0  # parked and resumed samples are identical too
    assert results["micro"].stats.timeline != results["continuous"].stats.timeline  # really different schedules
    for strategy in ("continuous", "infinite"):
        assert results[strategy].completion_ids == results["micro"].completion_ids, strategy
        assert results[strategy].logprobs == results["micro"].logprobs, strategy
    assert len({tuple(c) for c in results["micro"].completion_ids[0]}) > 1  # temperature 1: samples differ


def test_the_slot_cache_is_allocated_once_and_reused_while_it_fits(tiny_llama, prompt_ids):
    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, group_size=6, micro_group_size=2, strategy="continuous",
                           max_new_tokens=8, seed=1)
    engine.generate(prompt_ids)
    cache = engine._cache
    pointers = [layer.keys.data_ptr() for layer in cache.layers]
    # A rollout runs many refills and removals; none of them reallocates the rows.
    result = engine.generate(prompt_ids[:2])
    assert engine._cache is cache and [layer.keys.data_ptr() for layer in cache.layers] == pointers
    assert result.stats.decode_steps > 8  # refills happened
    assert result.stats.peak_kv_bytes >= cache.nbytes()
    longer = [prompt_ids[0] * 3]  # wider than the cache: a new one
    engine.generate(longer)
    assert engine._cache is not cache and engine._cache.width == len(longer[0]) - 1 + 8
    engine.release()
    assert engine._cache is None and engine._step is None


@pytest.mark.xdist_group("smollm2")
def test_a_rollout_is_the_same_in_a_fresh_slot_cache_and_in_one_an_earlier_rollout_widened(smollm2):
    """A step attends its rollout's own width, so a rollout's completions and log-probs do not depend on how wide
    earlier rollouts left the cache (a resumed run starts with a fresh one). The cap puts the rollout's width one
    column into a new block of 16, which its prompt's rows reach: attending the whole cache rounded them
    differently there."""
    model, tokenizer = smollm2
    prompts = _chat_prompts(tokenizer, ["Compute 3 * 4 - 2, explain."])
    cached = len(prompts[0]) - 1
    cap = 8 + (1 - cached - 8) % 16  # cached + cap = 1 (mod 16); 8 with this question: a short rollout
    settings = dict(group_size=3, micro_group_size=3, strategy="continuous", max_new_tokens=cap, temperature=1.0,
                    seed=3)
    widened, fresh = RolloutEngine(model, tokenizer, **settings), RolloutEngine(model, tokenizer, **settings)
    widened.generate([prompts[0] * 2])
    fresh.rollout_index = widened.rollout_index
    results = [engine.generate(prompts) for engine in (widened, fresh)]
    assert widened._cache.width > fresh._cache.width == widened._cache.attended == cached + cap
    assert max(map(len, results[1].completion_ids[0])) == cap  # its rows reached the width's end
    assert results[0].completion_ids == results[1].completion_ids
    assert results[0].logprobs == results[1].logprobs


def test_an_eager_step_attends_its_rollouts_own_width_in_a_wider_cache(tiny_llama, prompt_ids, monkeypatch):
    from lit_grpo.sampling.kv_cache import SlotCacheLayer

    model, tokenizer = tiny_llama
    attended, update = [], SlotCacheLayer.update

    def spy(self, *args, **kwargs):
        keys, values = update(self, *args, **kwargs)
        attended.append((keys.shape[2], values.shape[2]))
        return keys, values

    monkeypatch.setattr(SlotCacheLayer, "update", spy)
    engine = RolloutEngine(model, tokenizer, group_size=2, micro_group_size=2, strategy="continuous",
                           max_new_tokens=6, seed=0)
    engine.generate([prompt_ids[1] * 3])
    wide = engine._cache.width
    assert set(attended) == {(wide, wide)}
    attended.clear()
    engine.generate([prompt_ids[2]])
    assert engine._cache.width == wide and set(attended) == {(len(prompt_ids[2]) - 1 + 6,) * 2}
    with pytest.raises(ValueError, match=rf"attended columns must be in \[1, {wide}\] .* got {wide + 1}"):
        engine._cache.attend(wide + 1)


def test_infinite_parks_nothing_when_every_sample_has_a_slot(tiny_llama, prompt_ids):
    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=12, strategy="infinite",
                           max_new_tokens=12, seed=2, probe_tokens=3)
    trust_predictions(engine.scheduler)  # trusted probes, and still nothing to gain from parking
    result = engine.generate(prompt_ids)
    assert engine.scheduler.last_info["parked_samples"] == 0
    engine = RolloutEngine(model, tokenizer, group_size=4, strategy="full", max_new_tokens=12, seed=2)
    full = engine.generate(prompt_ids)
    assert result.stats.decode_steps == full.stats.decode_steps


def test_sampling_config_errors_name_the_option(tiny_llama):
    from lit_grpo.sampling import SamplingConfig

    model, tokenizer = tiny_llama
    with pytest.raises(ValueError, match=r"only apply to strategy='infinite', not 'continuous'"):
        RolloutEngine(model, tokenizer, strategy="continuous", predictor="oracle")
    with pytest.raises(TypeError, match=r"unknown sampling options \['beam_width'\]"):
        RolloutEngine(model, tokenizer, beam_width=4)
    with pytest.raises(ValueError, match=r"scheduler.preempt_tokens=-2 must be an integer >= 0 or None"):
        SamplingConfig(scheduler={"preempt_tokens": -2})
    with pytest.raises(ValueError, match=r"scheduler.length_aware.probe_tokens=-2 must be an integer >= 0 or None"):
        SamplingConfig(scheduler={"length_aware": {"probe_tokens": -2}})
    with pytest.raises(ValueError, match=r"unknown scheduler options \['refil'\]"):
        SamplingConfig(scheduler={"refil": "sjf"})
    # the length-aware method's options live under scheduler.length_aware, not beside the default's
    with pytest.raises(ValueError, match=r"unknown scheduler options \['refill'\]; allowed: .*'length_aware'"):
        SamplingConfig(scheduler={"refill": "sjf"})
    with pytest.raises(ValueError, match=r"unknown scheduler.length_aware options \['refil'\]"):
        SamplingConfig(scheduler={"length_aware": {"refil": "sjf"}})
    with pytest.raises(ValueError, match=r"scheduler.length_aware.predictor: .*'history'"):  # removed in 0.2
        SamplingConfig(scheduler={"length_aware": {"predictor": "history"}})
    with pytest.raises(ValueError, match=r"micro_group_size='auto' must be resolved"):
        RolloutEngine(model, tokenizer, micro_group_size="auto", kv_budget_bytes=10**6)
    for name, value in [("cuda_graph", "no"), ("cuda_graph", 1), ("keep_kv_cache", "yes"), ("compile", 1)]:
        with pytest.raises(ValueError, match=rf"sampling.{name}={value!r} must be true(,| or) false"):
            SamplingConfig(**{name: value})  # a truthy string must not turn a flag on
    with pytest.raises(ValueError, match=r"cuda_graph=True needs a CUDA model"):
        RolloutEngine(model, tokenizer, group_size=2, max_new_tokens=2, cuda_graph=True).generate([[5, 6]])
    config = SamplingConfig(group_size=3, strategy="infinite", scheduler={"length_aware": {"predictor": "online"}})
    engine = RolloutEngine(model, tokenizer, config)
    assert engine.config is config and engine.scheduler.predictor.__class__.__name__ == "OnlineLengthPredictor"


@pytest.mark.parametrize("name, value, message", [
    ("micro_group_size", "x" * 500, rf"^sampling.micro_group_size={re.escape(repr('x' * 500)[:100])} must be an "
                                    r"integer >= 1, 'auto' or None$"),
    ("cuda_graph", 10**5000, r"^sampling.cuda_graph=\(an int of 5001 digits\) must be true, false or null"),
    ("keep_kv_cache", 10**5000, r"^sampling.keep_kv_cache=\(an int of 5001 digits\) must be true, false or 'auto'$"),
    ("compile", 10**5000, r"^sampling.compile=\(an int of 5001 digits\) must be true, false or 'auto'$"),
    ("stop_strings", [10**5000], r"^sampling.stop_strings=a list holding an int of more than \d+ digits must be a "
                                 r"list of non-empty strings$"),
    ("scheduler", 10**5000, r"^sampling.scheduler=\(an int of 5001 digits\) must be an InfiniteSchedulerConfig"),
    ("temperature", -10**5000, r"^sampling.temperature=\(a negative int of 5001 digits\) must be 0 \(greedy\) or a "
                               r"finite number >= "),
], ids=["micro_group_size", "cuda_graph", "keep_kv_cache", "compile", "stop_strings", "scheduler", "temperature"])
def test_a_bad_sampling_setting_is_shown_bounded_and_a_huge_int_by_its_digits(name, value, message):
    """Shown as every check shows a value: a repr of an int of more than 4300 digits failed with Python's int-to-str
    ValueError in place of the refusal, a long value ran on."""
    from lit_grpo.sampling import SamplingConfig

    with pytest.raises(ValueError, match=message):
        SamplingConfig(**{name: value})


def test_under_autocast_the_cache_holds_the_autocast_dtype(tiny_llama, prompt_ids):
    """bf16-mixed training keeps float32 weights; attention then runs in bfloat16, and the cache stores that."""
    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, strategy="continuous",
                           max_new_tokens=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = engine.generate(prompt_ids)
    assert model.dtype == torch.float32 and engine._cache.layers[0].keys.dtype == torch.bfloat16
    assert result.stats.generated_tokens == sum(len(c) for group in result.completion_ids for c in group) > 0


def test_attention_without_a_4d_mask_is_refused():
    from lit_grpo.runtime.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-qwen2")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"attention implementation is 'flex_attention'.*\['sdpa', 'eager'\]"):
        RolloutEngine(model, tokenizer, group_size=2)


def test_forced_lengths_keep_every_shape():
    from lit_grpo.sampling.token_sampler import force_lengths

    logits = torch.zeros(3, 5)
    is_eos = torch.tensor([False, False, True, False, False])
    out = force_lengths(logits, token_index=torch.tensor([0, 3, 1]), forced_length=torch.tensor([4, 4, 0]),
                        is_eos=is_eos)
    assert out.shape == (3, 5)
    assert out[0, 2] == float("-inf") and torch.isfinite(out[0, [0, 1, 3, 4]]).all()  # before: no EOS
    assert out[1, 2] == 0 and torch.isinf(out[1, [0, 1, 3, 4]]).all()  # at the length: only EOS
    assert torch.equal(out[2], logits[2])  # forced_length 0: untouched (copied, no arithmetic: exact)


class _CountingScheduler:
    """Wraps a scheduler and counts ``admit`` calls; everything else passes through."""

    def __init__(self, inner):
        self.inner, self.admits = inner, 0

    def admit(self):
        self.admits += 1
        return self.inner.admit()

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("strategy", ["continuous", "infinite"])
def test_the_scheduler_is_asked_only_while_a_sample_waits(tiny_llama, prompt_ids, strategy):
    """With a slot for every sample, the only admission is the first one: the tail of a rollout (rows ending one by
    one, nothing left to start) costs the scheduler nothing between decode steps."""
    from lit_grpo.sampling.engine import _default_scheduler
    from lit_grpo.sampling.config import SamplingConfig

    model, tokenizer = tiny_llama
    config = SamplingConfig(group_size=4, micro_group_size=4 * len(prompt_ids), strategy=strategy,
                            max_new_tokens=10, seed=2)
    scheduler = _CountingScheduler(_default_scheduler(config))
    engine = RolloutEngine(model, tokenizer, config, scheduler=scheduler)
    lengths = [[10, 2, 6, 4]] * len(prompt_ids)  # rows end at different steps and free their slots
    result = engine.generate(prompt_ids, lengths=lengths)
    assert scheduler.admits == 1 and result.stats.decode_steps == 10
    # with fewer slots than samples the scheduler is asked again, and the completions do not change
    narrow_config = config.replace(micro_group_size=3)
    narrow_scheduler = _CountingScheduler(_default_scheduler(narrow_config))
    narrow = RolloutEngine(model, tokenizer, narrow_config, scheduler=narrow_scheduler)
    assert narrow.generate(prompt_ids, lengths=lengths).completion_ids == result.completion_ids
    assert narrow_scheduler.admits > 1


def test_merged_rounds_add_their_capture_time_and_step_time_leaves_it_out():
    from lit_grpo.sampling.stats import RolloutStats, merge_stats

    rounds = [RolloutStats(decode_steps=10, wall_s=1.0, capture_s=0.4, num_slots=2, group_size=2,
                           timeline=[[0, 1]] * 10),
              RolloutStats(decode_steps=30, wall_s=0.6, capture_s=0.0, num_slots=2, group_size=2,
                           timeline=[[0, -1]] * 30)]
    assert rounds[0].ms_per_step == pytest.approx(60.0) and RolloutStats().ms_per_step == 0.0
    merged = merge_stats(rounds)
    assert merged.capture_s == pytest.approx(0.4) and merged.wall_s == pytest.approx(1.6)
    assert merged.ms_per_step == pytest.approx(1000 * 1.2 / 40)


@pytest.mark.parametrize("strategy", ["micro", "continuous", "infinite"])
@pytest.mark.parametrize("chunk_tokens", [1024, 12])
def test_prefill_time_is_counted_once_per_prefill_forward(tiny_llama, prompt_ids, strategy, chunk_tokens,
                                                          monkeypatch):
    """A clock that ticks 1 s per reading: each timed interval (a prefill forward or a decode step) lasts 1 s."""
    import itertools
    from types import SimpleNamespace

    from lit_grpo.sampling import rollout_loop

    model, tokenizer = tiny_llama
    prompts = [ids + [5] for ids in prompt_ids]  # every prompt has a prefix to prefill
    monkeypatch.setattr(rollout_loop, "PREFILL_CHUNK_TOKENS", chunk_tokens)
    forwards = len(prefill_chunks([len(p) - 1 for p in prompts], chunk_tokens))
    assert forwards == (1 if chunk_tokens == 1024 else len(prompts))  # all prompts in one forward, or each alone
    engine = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, strategy=strategy,
                           max_new_tokens=6, temperature=1.0)
    real = engine.generate(prompts).stats
    assert 0 < real.prefill_s < real.forward_s <= real.wall_s
    assert real.decode_s > 0 and real.prefill_s + real.decode_s == pytest.approx(real.forward_s)  # a CPU's clock
    monkeypatch.setattr(rollout_loop, "time", SimpleNamespace(perf_counter=itertools.count().__next__))
    stats = engine.generate(prompts).stats
    assert stats.prefill_s == forwards  # each chunk prefilled once, whatever the strategy's rounds
    assert stats.forward_s == forwards + stats.decode_steps  # decode steps are not prefill
    assert stats.decode_s == stats.decode_steps
    assert stats.prefill_tokens == sum(len(p) - 1 for p in prompts)  # real tokens, not the padding


def test_merged_rounds_add_their_prefill_and_decode_time():
    from lit_grpo.sampling.stats import RolloutStats, merge_stats

    merged = merge_stats([RolloutStats(prefill_s=0.25, decode_s=0.5, forward_s=1.0),
                          RolloutStats(prefill_s=0.5, decode_s=1.25, forward_s=2.0)])
    assert merged.prefill_s == pytest.approx(0.75) and merged.scalars()["prefill_s"] == pytest.approx(0.75)
    assert merged.decode_s == pytest.approx(1.75) and merged.scalars()["decode_s"] == pytest.approx(1.75)
    merged.decode_steps, merged.prefill_tokens = 7, 3
    assert merged.decode_ms_per_step == pytest.approx(250.0) and merged.prefill_ms_per_token == pytest.approx(250.0)
    assert RolloutStats().decode_ms_per_step is None and RolloutStats().prefill_ms_per_token is None  # nothing run


def test_merged_rounds_of_different_slot_counts_keep_their_utilization():
    """A dynamic-sampling round with fewer prompts has fewer slots: each round's busy share counts at its own width."""
    from lit_grpo.sampling.stats import RolloutStats, merge_stats

    wide = RolloutStats(num_slots=8, decode_steps=10, generated_tokens=80)
    narrow = RolloutStats(num_slots=2, decode_steps=10, generated_tokens=20)
    for rounds in ([wide, narrow], [narrow, wide]):
        merged = merge_stats(rounds)
        assert merged.slot_utilization == 1.0 and merged.num_slots == 8
        assert merged.slot_steps == 100  # the weight of its utilization over ranks, and in a later merge
    from lit_grpo.callbacks.rollout_profiler import profile

    assert profile(merged)["weight/slot_steps"] == 100
    half = RolloutStats(num_slots=8, decode_steps=10, generated_tokens=40)
    assert merge_stats([merged, half]).slot_utilization == pytest.approx(140 / 180)  # FitSummary's running total


@pytest.mark.parametrize("strategy, advice", [("continuous", "lower micro_group_size \\(now 2 slots\\)"),
                                              ("full", "use 'continuous' or 'infinite'")])
def test_a_slot_cache_that_does_not_fit_says_how_large_it_is_and_what_to_change(tiny_llama, prompt_ids, monkeypatch,
                                                                                strategy, advice):
    from lit_grpo.sampling import kv_cache

    model, tokenizer = tiny_llama

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(kv_cache.SlotKVCache, "__init__", out_of_memory)
    engine = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, strategy=strategy, max_new_tokens=7)
    with pytest.raises(torch.cuda.OutOfMemoryError, match=f"slot cache: \\d+ rows x \\d+ positions .*GiB in float32.*"
                                                          f"{advice}.*max_new_tokens \\(now 7\\)"):
        engine.generate(prompt_ids)


class _RecordingScheduler(_CountingScheduler):
    """Also records every (slot, sample) assignment, in order."""

    def __init__(self, inner):
        super().__init__(inner)
        self.assignments = []

    def admit(self):
        made = super().admit()
        self.assignments.extend(made)
        return made


def test_samples_run_in_the_slots_the_scheduler_assigned(tiny_llama, prompt_ids):
    """One record of which sample is in which slot: after parking and planned refills, each slot runs exactly the
    samples the scheduler placed in it, in that order."""
    from lit_grpo.sampling.config import SamplingConfig
    from lit_grpo.sampling.engine import _default_scheduler

    model, tokenizer = tiny_llama
    G = 6
    config = SamplingConfig(group_size=G, micro_group_size=3, strategy="infinite", max_new_tokens=16, seed=3,
                            scheduler={"park_budget": None, "length_aware": {"predictor": "online", "probe_tokens": 3}})
    scheduler = _RecordingScheduler(_default_scheduler(config))
    trust_predictions(scheduler.inner)
    engine = RolloutEngine(model, tokenizer, config, scheduler=scheduler)
    result = engine.generate(prompt_ids, lengths=[[16, 2, 9, 5, 12, 7]] * len(prompt_ids))
    assert scheduler.inner.last_info["parked_samples"] > 0  # samples left their slots at probes and came back elsewhere
    for slot in range(3):
        ran = [row[slot] for row in result.stats.timeline if row[slot] != IDLE]
        runs = [flat for i, flat in enumerate(ran) if i == 0 or ran[i - 1] != flat]
        assert runs == [p * G + k for s, (p, k) in scheduler.assignments if s == slot]


# ------------------------------------------------------------------------------ the two-level inverse-CDF draw
def test_inverse_cdf_draws_the_token_a_whole_vocabulary_scan_draws():
    """Exact: the probabilities are multiples of 2^-8 below 1, so every float32 block sum (at most 1000 x 255 / 256)
    fits float32's 24-bit significand and is exact in any summation order (AVX2, AVX-512 or scalar), and both draws
    see the same CDF. With arbitrary probabilities a block sum rounds (~1e-7 of its mass), and a target that close
    to a token's boundary may fall on either side of it depending on the CPU's reduction order."""
    from lit_grpo.sampling.token_sampler import inverse_cdf

    generator = torch.Generator().manual_seed(0)
    # V not a multiple of the block: a padded last block
    probs = (torch.rand(64, 1000, generator=generator) ** 4 * 256).floor() / 256
    probs[:, torch.randperm(1000, generator=generator)[:300]] = 0.0  # filtered tokens
    uniforms = torch.rand(64, generator=generator, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    cdf = probs.double().cumsum(-1)
    expected = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    for block in (1, 7, 128, 4096):
        tokens = inverse_cdf(probs, uniforms, block=block)
        assert torch.equal(tokens, expected), block
        assert (probs.gather(-1, tokens[:, None]) > 0).all()


def test_inverse_cdf_never_draws_a_zero_probability_token_at_the_edges():
    from lit_grpo.sampling.token_sampler import inverse_cdf

    probs = torch.zeros(3, 300)
    probs[:, 5] = 1e-30   # a tiny first token, then nothing until the last live one
    probs[:, 260] = 1.0
    uniforms = torch.tensor([1e-40, 0.5, 1 - 1e-16], dtype=torch.float64)
    assert inverse_cdf(probs, uniforms).tolist() == [5, 260, 260]


def test_inverse_cdf_keeps_a_row_of_nan_probabilities_inside_the_vocabulary():
    from lit_grpo.sampling.token_sampler import inverse_cdf

    probs = torch.full((2, 300), float("nan"))
    probs[1] = 0.0
    probs[1, 42] = 1.0  # a row of numbers beside it draws as ever
    tokens = inverse_cdf(probs, torch.tensor([0.999, 0.5], dtype=torch.float64))
    assert 0 <= tokens[0] < 300 and tokens[1] == 42


def test_the_finite_logits_check_reads_live_rows_only_and_lets_minus_infinity_pass():
    """-inf is a legitimate log-prob (a replayed token the filters exclude); an idle row computes on stale input."""
    from lit_grpo.sampling.decode_step import check_finite_logits

    check_finite_logits([math.nan, -math.inf, -0.5], [1, 2])
    with pytest.raises(FloatingPointError, match=r"in 1 decoding rows \(slots \[0\]\)"):
        check_finite_logits([math.nan, -math.inf, -0.5], [0, 1, 2])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_policy_whose_logits_are_nan_stops_the_rollout_naming_why(temperature):
    """Diverged weights (an absurd learning rate) make every logit NaN: the rollout ends with a named error, not an
    index error inside the sampler (or a device-side assert on CUDA)."""
    from lit_grpo.runtime.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    engine = RolloutEngine(model.eval(), tokenizer, group_size=2, micro_group_size=2, strategy="continuous",
                           max_new_tokens=4, temperature=temperature)
    with pytest.raises(FloatingPointError, match=r"next-token logits are NaN or inf in 2 decoding rows .*lower "
                                                 r"model.lr"):
        engine.generate(["1+1="])


# ------------------------------------------------------------------------------ the compiled decode step
def test_a_compiled_step_is_schedule_invariant_samples_as_the_eager_one_and_compiles_once(tiny_llama):
    """One compilation serves every strategy and later rollouts of other prompts; the compiled rollouts equal each
    other and the eager step's. Compiled greedy decoding against ``model.generate`` is tests/test_sliding_window.py's
    (the same fixed-width CPU step): a second compilation here would take as long as all of this test."""
    from torch._dynamo.utils import counters

    model, tokenizer = tiny_llama
    prompts = _ids(tokenizer, PROMPTS)
    graphs_before = counters["stats"]["unique_graphs"]
    runs = {}
    settings = dict(group_size=G, micro_group_size=3, max_new_tokens=10, seed=7)
    # Equal completions across strategies: a determinism claim (the same compiled code on the same shapes, each
    # row computed alone, in one process), so it holds on any CPU.
    for strategy in ("micro", "continuous", "infinite"):
        # the default "infinite" scheduler reads no hidden states: the same step settings, so the same compiled code
        engine = RolloutEngine(model, tokenizer, strategy=strategy, compile=True, **settings)
        result = engine.generate(prompts)
        runs[strategy] = result
        assert result.stats.capture_s > 0 or strategy != "micro"  # the first build pays the compilation
    for strategy in ("continuous", "infinite"):
        assert runs[strategy].completion_ids == runs["micro"].completion_ids
        assert runs[strategy].logprobs == runs["micro"].logprobs
    # The eager step on torch's linears (a compiled step keeps oneDNN's off): fused float32 kernels round differently
    # (~1e-7), which changes a sampled token only where its uniform is that close to a CDF boundary.
    eager = RolloutEngine(model, tokenizer, strategy="micro", cpu_linear="torch", **settings).generate(prompts)
    assert eager.completion_ids == runs["micro"].completion_ids
    for expected, got in zip(sum(eager.logprobs, []), sum(runs["micro"].logprobs, [])):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-4)
    after_first = counters["stats"]["unique_graphs"]
    assert after_first - graphs_before == 1  # one shape, one settings: one compilation for all three engines
    # Training-like: new prompts of other lengths (same width bucket), the cache freed after every rollout.
    engine = RolloutEngine(model, tokenizer, strategy="continuous", compile=True, **settings)
    for texts in (PROMPTS[:2], PROMPTS[1:], ["Another prompt of another length?"]):
        engine.generate(_ids(tokenizer, texts))
        engine.release()
    assert counters["stats"]["unique_graphs"] == after_first


def test_a_compiled_step_on_a_cpu_attends_by_decode_attention(tiny_llama):
    from lit_grpo.sampling.decode_attention import DECODE_ATTENTION

    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, group_size=3, max_new_tokens=4, seed=3, compile=True)
    seen = set()  # not a list: the compiled code guards on a list's length, so every step would compile again
    original = DecodeStep._run

    def run(step, *args, **kwargs):  # what the compiler traces (and eager runs)
        seen.add(step.model.config._attn_implementation)
        return original(step, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeStep, "_run", run)
        engine.generate(_ids(tokenizer, PROMPTS[:1]))
    assert engine._step._compiled_run is not None and seen == {DECODE_ATTENTION}
    assert model.config._attn_implementation == "sdpa"  # restored after each step


def test_a_compiled_slot_cache_write_writes_the_layer_in_place(tiny_llama):
    """Compiled, each row's new key lands at its own column with no copy of the layer: a write into a graph input
    that Inductor does not do in place costs a buffer of the layer's size, the write, and a copy back, every step."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from lit_grpo.sampling.kv_cache import SlotKVCache

    model, _ = tiny_llama
    cache = SlotKVCache(model.config, num_slots=3, width=64, dtype=torch.float32, device=torch.device("cpu"))
    layer = cache.layers[0]
    slots, kv_heads, _, head_dim = layer.keys.shape
    cache.lengths.copy_(torch.tensor([5, 0, 63]))
    keys, values = torch.randn(slots, kv_heads, 1, head_dim), torch.randn(slots, kv_heads, 1, head_dim)

    def write(keys, values):
        layer.update(keys, values)

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False):  # a cache hit would generate (and show) no code
        _, code = run_and_get_code(torch.compile(write, dynamic=False), keys, values)
    code = "".join(code)
    assert "def call(" in code and f"empty_strided_cpu({tuple(layer.keys.shape)}" not in code
    rows, columns = torch.arange(slots), cache.lengths
    # a write copies values (no arithmetic): exact
    assert torch.equal(layer.keys[rows, :, columns], keys[:, :, 0])
    assert torch.equal(layer.values[rows, :, columns], values[:, :, 0])
    assert layer.keys.count_nonzero() == keys.count_nonzero()  # nothing written elsewhere


def test_a_slot_cache_row_takes_a_kv_up_to_its_full_width(tiny_llama):
    # write_row fills columns [start, start + n) up to the width itself, and refuses one column more
    from lit_grpo.sampling.kv_cache import SlotKVCache

    model, _ = tiny_llama
    cache = SlotKVCache(model.config, num_slots=2, width=8, dtype=torch.float32, device=torch.device("cpu"))
    _, kv_heads, _, head_dim = cache.layers[0].keys.shape

    def kv(n):
        return [(torch.randn(1, kv_heads, n, head_dim), torch.randn(1, kv_heads, n, head_dim)) for _ in cache.layers]

    full = kv(8)
    assert cache.write_row(1, 0, full) == 8
    assert all(torch.equal(k, fk) and torch.equal(v, fv) for (k, v), (fk, fv) in zip(cache.read_row(1, 0, 8), full))
    tail = kv(5)
    assert cache.write_row(0, 3, tail) == 5  # ends at the last column
    assert torch.equal(cache.read_row(0, 3, 8)[0][0], tail[0][0])
    with pytest.raises(ValueError, match="9 positions do not fit the slot cache's width 8"):
        cache.write_row(0, 4, tail)
    with pytest.raises(ValueError, match="9 positions do not fit"):
        cache.write_row(1, 0, kv(9))


def test_a_slot_cache_is_reused_only_for_as_many_slots(tiny_llama):
    from lit_grpo.sampling.kv_cache import SlotKVCache

    model, _ = tiny_llama
    cpu = torch.device("cpu")
    cache = SlotKVCache(model.config, num_slots=3, width=8, dtype=torch.float32, device=cpu)
    assert cache.fits(3, 8, torch.float32, cpu) and cache.fits(3, 5, torch.float32, cpu)  # narrower rows fit
    assert not cache.fits(2, 8, torch.float32, cpu) and not cache.fits(4, 8, torch.float32, cpu)
    assert not cache.fits(3, 9, torch.float32, cpu) and not cache.fits(3, 8, torch.bfloat16, cpu)


def test_the_prefix_and_tail_store_counts_the_bytes_it_holds():
    from lit_grpo.sampling.kv_cache import PrefixTailStore, kv_bytes

    def kv(positions):  # two layers of one row, 2 kv heads of 4 dims
        return [(torch.zeros(1, 2, positions, 4), torch.zeros(1, 2, positions, 4)) for _ in range(2)]

    store = PrefixTailStore()
    store.put_prefix(0, kv(5))
    store.put_prefix(1, None)  # a one-token prompt: no prefix, prefilled all the same
    store.put_tail((0, 0), kv(3))
    store.put_tail((0, 1), kv(2))
    assert store.parked_bytes == kv_bytes(kv(5)) and store.nbytes() == kv_bytes(kv(10))
    assert store.take_tail((0, 0)) is not None and store.take_tail((0, 0)) is None
    assert store.parked_bytes == kv_bytes(kv(2)) and store.nbytes() == kv_bytes(kv(7))
    store.drop_prefix(0)
    assert store.prompts() == [1] and store.nbytes() == kv_bytes(kv(2))


def test_compile_setting_resolves_per_device_and_warns_once_without_a_compiler(tiny_llama, monkeypatch):
    from lit_grpo.sampling import SamplingConfig, decode_step

    with pytest.raises(ValueError, match=r"sampling.compile='yes' must be true, false or 'auto'"):
        SamplingConfig(compile="yes")
    cpu = torch.device("cpu")
    assert decode_step.resolve_compile("auto", cpu, sharded=False) is False  # auto compiles on CUDA only
    assert decode_step.resolve_compile(False, cpu, sharded=False) is False
    monkeypatch.setattr(decode_step.shutil, "which", lambda name: None)  # no C++ compiler on PATH
    monkeypatch.setattr(decode_step, "_warned_compilers", set())
    # a fresh cache for this test (restored afterwards), so the patched PATH lookup is what it asks
    monkeypatch.setattr(decode_step, "compiler_problem", functools.cache(decode_step.compiler_problem.__wrapped__))
    model, tokenizer = tiny_llama
    prompts = _ids(tokenizer, PROMPTS[:2])
    eager = RolloutEngine(model, tokenizer, group_size=3, max_new_tokens=6, seed=3).generate(prompts)
    with pytest.warns(RuntimeWarning, match=r"no C\+\+ compiler .* runs eagerly"):
        engine = RolloutEngine(model, tokenizer, group_size=3, max_new_tokens=6, seed=3, compile=True)
        result = engine.generate(prompts)
    assert engine._step.settings.compile is False and result.completion_ids == eager.completion_ids
    import warnings as warnings_module

    with warnings_module.catch_warnings():
        warnings_module.simplefilter("error")  # the second engine does not warn again
        RolloutEngine(model, tokenizer, group_size=3, max_new_tokens=6, seed=3, compile=True).generate(prompts)


def test_merged_rounds_of_different_slot_counts_keep_one_timeline_grid_that_renders():
    """A dynamic-sampling round with fewer prompts than slots runs narrower: its rows are padded with idle slots, so
    the step's timeline stays a [steps, slots] grid (SlotTimelineLogger draws it)."""
    from lit_grpo.callbacks.slot_timeline import render_slot_timeline_figure
    from lit_grpo.sampling.stats import RolloutStats, merge_stats

    wide = RolloutStats(num_slots=4, group_size=2, decode_steps=2, timeline=[[0, 1, 2, 3], [0, 1, 2, -1]])
    narrow = RolloutStats(num_slots=2, group_size=2, decode_steps=3, timeline=[[0, 1]] * 3)
    merged = merge_stats([wide, narrow])
    assert merged.timeline == [[0, 1, 2, 3], [0, 1, 2, -1], [4, 5, -1, -1], [4, 5, -1, -1], [4, 5, -1, -1]]
    image = render_slot_timeline_figure(merged.timeline, merged.group_size)
    assert image.ndim == 3 and image.shape[2] == 3


def test_on_a_cpu_each_forward_times_its_own_phase(tiny_llama, prompt_ids, monkeypatch):
    """Every timed forward adds its host time to forward_s and, on a CPU (no events), to its own phase's field:
    with a clock that advances 1 s a reading, each decode step adds 1 s to decode_s, each prefill 1 s to prefill_s."""
    from types import SimpleNamespace

    from lit_grpo.sampling import rollout_loop

    readings = iter(range(10**6))
    monkeypatch.setattr(rollout_loop, "time", SimpleNamespace(perf_counter=lambda: float(next(readings))))
    model, tokenizer = tiny_llama
    stats = RolloutEngine(model, tokenizer, group_size=2, max_new_tokens=4, seed=0).generate(prompt_ids).stats
    assert stats.decode_s == stats.decode_steps > 0
    assert stats.prefill_s >= 1 and stats.forward_s == stats.prefill_s + stats.decode_s


def test_a_model_left_in_train_mode_samples_as_in_eval_mode_and_is_left_as_it_was(prompt_ids):
    """A loop of one's own trains the policy (``.train()``) between rollouts: with dropout on, the samples and their
    log-probs would come from a noised model, silently. The engine samples in eval mode and leaves every module's
    mode as it found it (a frozen part kept in eval stays so)."""
    from lit_grpo import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.9
    settings = dict(group_size=4, micro_group_size=2, max_new_tokens=6, seed=3)
    evaluated = RolloutEngine(model.eval(), tokenizer, **settings).generate(prompt_ids)
    model.train()
    model.lm_head.eval()
    trained = RolloutEngine(model, tokenizer, **settings).generate(prompt_ids)
    assert trained.completion_ids == evaluated.completion_ids
    assert trained.logprobs == evaluated.logprobs
    assert model.training and model.model.training and not model.lm_head.training
