"""Token replay: ``RolloutEngine.generate(tokens=...)`` emits recorded completions, with the sampler's log-probs, on
every schedule (parking and carried groups included), and ``tools.bench_rollout --tokens`` runs it."""

import pytest
import torch

from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.sampling import RolloutEngine
from lit_grpo.sampling.rollout_loop import RolloutLoop
from lit_grpo.sampling.token_sampler import replay_tokens, sample_tokens
from scheduler_helpers import trust_predictions

PROMPTS = ["What is 2+3?", "Compute the sum of 7, 8 and 9. Think step by step.", "hi"]
G, CAP = 4, 8


@pytest.fixture(scope="module")
def tiny64():
    """tiny-llama in float64 and the prompts' ids. Float64 makes what the schedules' different row counts change in
    the logits (~1e-16 relative) vanish in the sampler's float32 (see the ``tiny`` fixture in conftest.py)."""
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    return model.double().eval(), tokenizer, [tokenizer(text)["input_ids"] for text in PROMPTS]


@pytest.fixture(scope="module")
def eos_ids(tiny64):
    """The tokenizer's EOS and a token the free run below draws early, so some recorded samples end on a stop
    token and others at the cap (this random model almost never draws its EOS)."""
    model, tokenizer, prompts = tiny64
    first = _engine(model, tokenizer).generate(prompts).completion_ids
    return [tokenizer.eos_token_id, first[0][0][2]]


@pytest.fixture(scope="module")
def recorded(tiny64, eos_ids):
    """A free rollout (seed 1, temperature 1.0) to replay."""
    model, tokenizer, prompts = tiny64
    result = _engine(model, tokenizer, eos_token_ids=eos_ids).generate(prompts)
    assert any(not t for t in sum(result.truncated, [])) and any(sum(result.truncated, []))
    return result


def _engine(model, tokenizer, strategy="continuous", **options):
    settings = dict(group_size=G, micro_group_size=3, strategy=strategy, max_new_tokens=CAP, temperature=1.0,
                    seed=1) | options
    return RolloutEngine(model, tokenizer, **settings)


def _flat(nested):
    return torch.tensor([x for group in nested for row in group for x in row], dtype=torch.float64)


def _reference_logprobs(model, prompts, completions, temperature):
    """``[B][G][L]`` log-probs of the completions under log_softmax(logits / T) of a plain forward."""
    out = []
    for prompt, group in zip(prompts, completions):
        out.append([])
        for completion in group:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
            logprobs = torch.log_softmax(logits.float() / temperature, -1)
            out[-1].append(logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist())
    return out


# ------------------------------------------------------------------------------------------- what is emitted
def test_a_replay_emits_the_recorded_tokens_with_the_samplers_logprobs(tiny64, eos_ids, recorded):
    model, tokenizer, prompts = tiny64
    same = _engine(model, tokenizer, seed=9, eos_token_ids=eos_ids).generate(prompts, tokens=recorded.completion_ids)
    assert same.completion_ids == recorded.completion_ids and same.truncated == recorded.truncated
    # exact: the replay runs the recorded rollout's schedule, rows and tokens through the same kernels in one process
    # (a determinism claim), and the sampler's log-probs are the same float32 numbers
    assert same.stats.timeline == recorded.stats.timeline
    assert torch.allclose(_flat(same.logprobs), _flat(recorded.logprobs), atol=1e-9, rtol=0)

    hot = _engine(model, tokenizer, seed=5, temperature=1.7, eos_token_ids=eos_ids)
    replay = hot.generate(prompts, tokens=recorded.completion_ids)
    assert replay.completion_ids == recorded.completion_ids and replay.truncated == recorded.truncated
    expected = _reference_logprobs(model, prompts, recorded.completion_ids, 1.7)
    assert torch.allclose(_flat(replay.logprobs), _flat(expected), atol=1e-5, rtol=0)
    assert not torch.allclose(_flat(replay.logprobs), _flat(recorded.logprobs), atol=1e-3, rtol=0)


def test_replay_tokens_samples_free_rows_and_scores_forced_ones():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    uniforms = torch.tensor([0.3, 0.6, 0.9], dtype=torch.float64)
    # row 0 replays its most likely token, row 1 its least likely (outside the top 5), row 2 draws
    forced, replaying = torch.stack([logits[0].argmax(), logits[1].argmin(), torch.tensor(0)]), torch.tensor(
        [True, True, False])
    tokens, logprobs = replay_tokens(logits, uniforms, forced, replaying, temperature=0.5, top_k=5)
    drawn, drawn_logprobs = sample_tokens(logits, uniforms, temperature=0.5, top_k=5)
    # exact: the free row's draw is sample_tokens' own arithmetic on the same logits
    assert tokens[:2].tolist() == forced[:2].tolist() and tokens[2] == drawn[2] and logprobs[2] == drawn_logprobs[2]
    top5 = torch.topk(logits[0] / 0.5, 5).values
    assert logprobs[0].item() == pytest.approx(torch.log_softmax(top5, -1)[0].item(), abs=1e-6)
    assert logprobs[1].item() == float("-inf")  # impossible under the filtered distribution


def test_a_truncated_recording_ends_at_its_last_token_and_a_long_one_at_the_cap(tiny64):
    model, tokenizer, prompts = tiny64
    eos = tokenizer.eos_token_id
    tokens = [[[5] * CAP, [6, 7, 8], [9, eos], [10] * (CAP + 3)]]
    result = _engine(model, tokenizer).generate(prompts[:1], tokens=tokens)
    assert result.completion_ids == [[[5] * CAP, [6, 7, 8], [9, eos], [10] * CAP]]
    assert result.truncated == [[True, True, False, True]]
    assert result.stats.generated_tokens == CAP + 3 + 2 + CAP


def test_the_replay_step_reads_nothing_on_the_host_and_keeps_its_shapes():
    """On the meta device every host read raises (see test_decode_step.py): the replay keeps the step capturable."""
    from lit_grpo.sampling.decode_step import DecodeStep, StepSettings
    from lit_grpo.sampling.kv_cache import SlotKVCache

    meta = torch.device("meta")
    model, tokenizer = load_model_and_tokenizer("tiny-llama", device=meta)
    cache = SlotKVCache(model.config, num_slots=3, width=16, dtype=model.dtype, device=meta)
    settings = StepSettings(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, force_lengths=False,
                            hidden_states=True, cuda_graph=False, force_tokens=True)
    step = DecodeStep(model.eval(), cache, settings, eos_token_ids=[tokenizer.eos_token_id])
    buffers = [step.forced_tokens, step.tokens, step.logprobs]
    with torch.inference_mode():
        step._run()
        step._run()
    assert [t.shape for t in buffers] == [(3, 16), (3,), (3,)] and step.forced_tokens is buffers[0]
    with pytest.raises(ValueError, match="force_lengths and force_tokens are exclusive"):
        StepSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, force_lengths=True, hidden_states=False,
                     cuda_graph=False, force_tokens=True)


# ------------------------------------------------------------------------------------------- schedules
@pytest.mark.parametrize("strategy,options", [("continuous", {}), ("infinite", {}),  # the default scheduler
                                              ("infinite", {"predictor": "oracle"})])  # the length-aware method
def test_decode_steps_equal_those_of_a_length_replay(tiny64, eos_ids, recorded, strategy, options):
    model, tokenizer, prompts = tiny64
    lengths = [[len(c) for c in group] for group in recorded.completion_ids]
    by_length = _engine(model, tokenizer, strategy, eos_token_ids=eos_ids, **options).generate(prompts, lengths)
    by_token = _engine(model, tokenizer, strategy, eos_token_ids=eos_ids, **options).generate(
        prompts, tokens=recorded.completion_ids)
    assert by_token.completion_ids == recorded.completion_ids
    assert by_token.stats.decode_steps == by_length.stats.decode_steps
    assert by_token.stats.timeline == by_length.stats.timeline
    if options:  # the oracle read the replay's lengths
        assert by_token.stats.length_pred_kendall_tau == pytest.approx(1.0)
    elif strategy == "infinite":  # the default scheduler predicts nothing
        assert by_token.stats.length_pred_kendall_tau is None and by_token.stats.preempting is not None


def _probe_features(monkeypatch):
    """Record every probe feature the loop hands the scheduler, by sample."""
    seen = {}
    original = RolloutLoop.feature

    def feature(self, slot, key):
        seen[key] = original(self, slot, key).clone()
        return seen[key]

    monkeypatch.setattr(RolloutLoop, "feature", feature)
    return seen


def test_an_online_predictor_probes_the_replay_as_the_live_run_and_parks_it(tiny64, monkeypatch):
    model, tokenizer, prompts = tiny64
    options = dict(max_new_tokens=16, predictor="online", probe_tokens=3, park_budget=None)
    live_engine = _engine(model, tokenizer, "infinite", micro_group_size=2, **options)
    trust_predictions(live_engine.scheduler)
    live_features = _probe_features(monkeypatch)
    live = live_engine.generate(prompts)
    assert live_engine.scheduler.last_info["parked_samples"] > 0

    engine = _engine(model, tokenizer, "infinite", micro_group_size=2, seed=3, temperature=0.6, **options)
    trust_predictions(engine.scheduler)
    replay_features = _probe_features(monkeypatch)
    replay = engine.generate(prompts, tokens=live.completion_ids)
    assert engine.scheduler.last_info["parked_samples"] > 0  # parked at probes, resumed at the right token
    assert replay.completion_ids == live.completion_ids and replay.truncated == live.truncated
    assert replay_features.keys() == live_features.keys() and live_features
    # exact (the features are float32 copies of the hidden states): the replay runs the live run's schedule, so
    # every row sees the same inputs beside the same rows through the same kernels in one process
    assert replay.stats.timeline == live.stats.timeline
    for key, feature in live_features.items():
        assert torch.allclose(replay_features[key], feature, atol=1e-9), key


def test_carried_groups_resume_their_recorded_tokens(tiny64, recorded, eos_ids):
    model, tokenizer, prompts = tiny64
    engine = _engine(model, tokenizer, eos_token_ids=eos_ids, temperature=0.8)
    groups = engine.new_groups(prompts, tags=list(range(len(prompts))), tokens=recorded.completion_ids)
    completions, calls, cut = {}, 0, 0
    while groups:
        result = engine.generate_groups(groups, complete=1)
        calls += 1
        completions.update(zip(result.tags, result.completion_ids))
        assert all(g.forced_tokens is not None for g in result.carried)
        cut += sum(bool(s.tokens) and not s.done for g in result.carried for s in g.samples)
        groups = result.carried
    assert calls > 1 and cut > 0  # some samples stopped mid-recording and went on from there
    assert [completions[p] for p in range(len(prompts))] == recorded.completion_ids


# ------------------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("tokens, match", [
    ([[[5]] * G], r"tokens must be \[B=2\]\[G=4\] lists of token ids, got \[4\]"),
    ([[[5]] * 3, [[5]] * G], r"got \[3, 4\]"),
    ([[[5], [], [5], [5]], [[5]] * G], r"tokens\[0\]\[1\] is \[\]; every replayed sample needs a non-empty"),
    ([[[5]] * G, [[5], [5], [5, 370, 6], [5]]], r"tokens\[1\]\[2\]\[1\] = 370 \(prompt 1, sample 2\); token ids "
                                                r"are ints in \[0, 370\)"),
    ([[[5]] * G, [[5], [-1], [5], [5]]], r"tokens\[1\]\[1\]\[0\] = -1"),
    ([[[5]] * G, [[5], [5], [5], [5, 2.0]]], r"tokens\[1\]\[3\]\[1\] = 2.0"),
    ([[[5, 2, 6]] + [[5]] * 3, [[5]] * G], r"tokens\[0\]\[0\]\[1\] = 2 is a stop token \[2\] before the end"),
])
def test_bad_tokens_are_named(tiny64, tokens, match):
    model, tokenizer, prompts = tiny64
    with pytest.raises(ValueError, match=match):
        _engine(model, tokenizer).generate(prompts[:2], tokens=tokens)


def test_lengths_and_tokens_together_are_refused(tiny64):
    model, tokenizer, prompts = tiny64
    with pytest.raises(ValueError, match="give lengths= or tokens=, not both"):
        _engine(model, tokenizer).generate(prompts[:1], [[1] * G], tokens=[[[5]] * G])


def test_a_rollout_mixing_replayed_and_free_groups_is_refused(tiny64):
    model, tokenizer, prompts = tiny64
    engine = _engine(model, tokenizer)
    groups = engine.new_groups(prompts[:1], tokens=[[[5]] * G]) + engine.new_groups(prompts[1:2])
    with pytest.raises(ValueError, match=r"forced tokens must be given for every group .* groups \[1\] of 2"):
        engine.generate_groups(groups)


# ------------------------------------------------------------------------------------------- the benchmark
def _recording(path, with_tokens=True):
    """2 prompts x 4 samples, cap 8: some end on EOS, some at the cap, some short and truncated."""
    from tools.recordings import write_recording

    _, tokenizer = load_model_and_tokenizer("tiny-llama")
    eos = tokenizer.eos_token_id
    completions = [[[40, 41, eos], [42] * 8, [43, 44, 45, 46, 47, eos], [48]],
                   [[50] * 7 + [eos], [51, eos], [52, 53], [54, 55, 56, 57, 58, 59, 60, 61]]]
    record = {"meta": {"max_new_tokens": 8}, "lengths": [[len(c) for c in g] for g in completions],
              "truncated": [[c[-1] != eos for c in g] for g in completions]}
    if with_tokens:
        record |= {"prompt_ids": [tokenizer(PROMPTS[0])["input_ids"], tokenizer(PROMPTS[1])["input_ids"]],
                   "completion_ids": completions}
    write_recording(path, record)
    return sum(map(len, sum(completions, [])))


def test_bench_rollout_replays_a_token_recording(tmp_path):
    from tools import bench_rollout

    tokens = tmp_path / "tokens.json.gz"
    total = _recording(tokens)
    common = ["--model", "tiny", "--micro-group-size", "2", "--repeats", "1", "--threads", "1",
              "--strategies", "continuous,infinite", "--predictors", "oracle"]
    report = bench_rollout.main([*common, "--tokens", str(tokens)])
    config = report["config"]
    assert (config["replay"], config["prompts"], config["group_size"], config["max_new_tokens"]) == ("tokens", 2, 4, 8)
    assert len(report["runs"]) == 2
    for run in report["runs"]:
        assert run["generated_tokens"] == total
    # a token recording is a length source too
    lengths = bench_rollout.main([*common, "--lengths", str(tokens), "--strategies", "continuous"])
    assert lengths["config"]["replay"] == "lengths" and lengths["runs"][0]["generated_tokens"] == total

    only_lengths = tmp_path / "lengths.json"
    _recording(only_lengths, with_tokens=False)
    with pytest.raises(SystemExit, match="has no 'completion_ids'"):
        bench_rollout.main([*common, "--tokens", str(only_lengths)])
    with pytest.raises(SystemExit, match=r"--max-new-tokens 9 is above the --tokens recording's cap "
                                         r"max_new_tokens=8"):
        bench_rollout.main([*common, "--tokens", str(tokens), "--max-new-tokens", "9"])
    with pytest.raises(SystemExit, match="hf_generate"):
        bench_rollout.main([*common, "--tokens", str(tokens), "--strategies", "continuous,hf_generate"])
    with pytest.raises(SystemExit):
        bench_rollout.parse_args(["--tokens", str(tokens), "--lengths", str(tokens)])


def test_warmup_rollouts_never_run_the_measured_samples(tmp_path, monkeypatch):
    from tools import bench_rollout
    from tools.recordings import read_recording

    seen = []
    generate = RolloutEngine.generate

    def spy(self, prompts, *args, **kwargs):
        seen.append(([list(p) for p in prompts], kwargs.get("tokens")))
        return generate(self, prompts, *args, **kwargs)

    monkeypatch.setattr(RolloutEngine, "generate", spy)
    tokens = tmp_path / "tokens.json.gz"
    _recording(tokens)
    record = read_recording(tokens)
    common = ["--model", "tiny", "--micro-group-size", "2", "--repeats", "1", "--threads", "1",
              "--strategies", "infinite", "--predictors", "oracle", "--prompts", "1"]
    bench_rollout.main([*common, "--tokens", str(tokens), "--warmup-rollouts", "1"])
    warmup, measured = seen[0], seen[-1]  # warm-ups run as the engines are built; seen[1]: the untimed set-up
    assert measured == ([record["prompt_ids"][0]], [record["completion_ids"][0]])
    assert warmup == ([record["prompt_ids"][1]], [record["completion_ids"][1]])  # the recording's next prompt
    with pytest.raises(SystemExit, match=r"--tokens: the recording holds 2 prompts: rollout 2 of B=1 needs 3"):
        bench_rollout.main([*common, "--tokens", str(tokens), "--warmup-rollouts", "2"])
    seen.clear()
    bench_rollout.main([*common[:-4], "--prompts", "2", "--group-size", "2", "--max-new-tokens", "4",
                        "--task", "synthetic", "--warmup-rollouts", "1"])
    warmup, measured = seen[0][0], seen[-1][0]
    assert len(warmup) == len(measured) == 2 and not set(map(tuple, warmup)) & set(map(tuple, measured))
