"""The predictor study's instruments: token recordings, the teacher-forced features (equal to what the engine
hands a predictor live) and the study itself on a small recording."""

import gzip
import json

import pytest
import torch

from lit_grpo.sampling import RolloutEngine
from lit_grpo.scheduling import LeastAttainedScheduler
from lit_grpo.scheduling.length_aware import LengthAwareScheduler, OnlineLengthPredictor
from tools import length_signals, record_lengths, study_predictors
from tools.recording_features import recording_features
from tools.recordings import read_recording, write_recording


class SpyPredictor(OnlineLengthPredictor):
    """The token-conditioned predictor, keeping every feature the engine hands it."""

    def __init__(self):
        super().__init__()
        self.prompt_features, self.token_features = None, {}

    def predict(self, work, keys, token_features=None):
        self.prompt_features = work.prompt_features
        if token_features is not None:
            self.token_features.update({key: row.clone() for key, row in zip(keys, token_features)})
        return super().predict(work, keys, token_features)


@pytest.mark.parametrize("k", [1, 3])
def test_teacher_forced_features_equal_the_engines_live_features(tiny_llama, prompt_ids, k):
    model, tokenizer = tiny_llama
    spy = SpyPredictor()
    engine = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=3, strategy="infinite",
                           max_new_tokens=12, seed=5, predictor=spy, probe_tokens=k)
    result = engine.generate(prompt_ids[:2])
    features = recording_features(model, prompt_ids[:2], result.completion_ids, [k, 8])
    assert torch.allclose(features.prompt, spy.prompt_features.cpu(), atol=1e-4)
    probed = [(p, j) for p in range(2) for j in range(4) if len(result.completion_ids[p][j]) > k]
    assert probed and sorted(spy.token_features) == probed
    for p, j in probed:
        assert torch.allclose(features.token[k][p, j], spy.token_features[(p, j)], atol=1e-4), (p, j)
    ended = [(p, j) for p in range(2) for j in range(4) if len(result.completion_ids[p][j]) <= 8]
    assert all(features.token[8][p, j].abs().sum() == 0 for p, j in ended)  # no probe at 8: zeros
    with pytest.raises(ValueError, match=r"probe_tokens=\[0\] must be a non-empty list of integers >= 1"):
        recording_features(model, prompt_ids[:1], [[[1]]], [0])


def test_a_token_recording_round_trips_and_bad_files_are_named(tmp_path, monkeypatch):
    out = tmp_path / "rec.json.gz"
    record_lengths.main(["--model", "tiny", "--task", "synthetic", "--prompts", "2", "--group-size", "3",
                         "--max-new-tokens", "6", "--tokens", "--out", str(out)])
    record = read_recording(out)
    assert json.loads(gzip.decompress(out.read_bytes()))["lengths"] == record["lengths"]
    assert [[len(c) for c in group] for group in record["completion_ids"]] == record["lengths"]
    assert len(record["prompt_ids"]) == 2 and record["meta"]["max_new_tokens"] == 6
    assert record["meta"]["command"].startswith("python -m tools.record_lengths --model tiny")
    record["lengths"][0][0] += 1
    write_recording(tmp_path / "bad.json", record)
    with pytest.raises(ValueError, match="bad.json: 'completion_ids' and 'prompt_ids' do not match 'lengths'"):
        read_recording(tmp_path / "bad.json")
    write_recording(tmp_path / "ragged.json", {"lengths": [[1, 2], [3]]})
    with pytest.raises(ValueError, match=r"ragged.json: every prompt needs the same number of samples, got \[1, 2\]"):
        read_recording(tmp_path / "ragged.json")
    (tmp_path / "junk.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="junk.json.gz: cannot read it"):
        read_recording(tmp_path / "junk.json.gz")


def test_the_study_runs_every_predictor_cross_fitted_on_a_recording(tmp_path, tiny_llama, monkeypatch, capsys):
    model, tokenizer = tiny_llama
    prompts = [[5 + p, 40 + p, 7] for p in range(8)]
    lengths = [[2 + (p * 5 + k * 3) % 9 for k in range(4)] for p in range(8)]
    completions = [[[(p + k + i) % 200 + 3 for i in range(n)] for k, n in enumerate(row)]
                   for p, row in enumerate(lengths)]
    path = tmp_path / "rec.json.gz"
    write_recording(path, {"meta": {"model": "tiny-llama", "max_new_tokens": 10}, "lengths": lengths,
                           "truncated": [[False] * 4 for _ in lengths], "prompt_ids": prompts,
                           "completion_ids": completions})
    walked = []  # (scheduler, prompts) of every walk: warm-up and measured prompts per scheduler
    run = study_predictors.RecordingWalk.run
    monkeypatch.setattr(study_predictors.RecordingWalk, "run",
                        lambda self, scheduler, prompts, probe: walked.append((scheduler, list(prompts))) or
                        run(self, scheduler, prompts, probe))
    report = study_predictors.main(["--recording", str(path), "--predictors", "none,online",
                                    "--probe-tokens", "1,2", "--signal-tokens", "1,2", "--setups", "2,4,3",
                                    "--noisy", "0.5", "--features-cache", str(tmp_path / "f.pt"),
                                    "--json", str(tmp_path / "study.json")])
    rows = {(row["predictor"], row["probe_tokens"]): row for row in report["setups"][0]["rows"]}
    # cross-fitted: each scheduler warms up on one half and is measured on the other; both halves are measured
    by_scheduler = {}
    for scheduler, prompts in walked:
        by_scheduler.setdefault(id(scheduler), []).append(prompts)
    measured = []
    for warm, test in by_scheduler.values():
        assert not set(warm) & set(test) and sorted(warm + test) == list(range(8))
        measured.append(tuple(test))
    assert set(measured) == {(0, 1, 2, 3), (4, 5, 6, 7)} and len(by_scheduler) == 2 * len(rows)
    assert set(rows) == {("continuous", None), ("oracle", None), ("none", None), ("online", 1), ("online", 2),
                         ("noisy:0.5", None)}
    # "none" is the default scheduler: no predictor, so no prediction figures and no gate of predictions
    assert {type(scheduler) for scheduler, _ in walked if scheduler.__class__.__name__ != "Scheduler"} == {
        LeastAttainedScheduler, LengthAwareScheduler}
    assert rows[("none", None)]["kendall_tau"] is None and rows[("none", None)]["guided"] is None
    assert rows[("none", None)]["gain_z"] is None and 0 <= rows[("none", None)]["preempting"] <= 1
    assert -1 <= rows[("online", 2)]["kendall_tau"] <= 1 and 0 <= rows[("online", 2)]["guided"] <= 1
    continuous = rows[("continuous", None)]["decode_steps"]
    # every measured rollout of both folds: 8 prompts in rollouts of 2, so 4 rollouts, none run twice
    assert continuous == sum(study_predictors.simulate_rollout(study_predictors.Scheduler(), lengths[i:i + 2], 3,
                                                               10).decode_steps for i in range(0, 8, 2))
    assert rows[("oracle", None)]["decode_steps"] <= continuous and rows[("oracle", None)]["kendall_tau"] == 1.0
    for row in rows.values():
        assert row["ratio"] == row["decode_steps"] / continuous
    assert json.loads((tmp_path / "study.json").read_text())["setups"] == report["setups"]
    monkeypatch.setattr(study_predictors.harness, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    cached = study_predictors.main(["--recording", str(path), "--predictors", "online", "--probe-tokens", "2",
                                    "--signal-tokens", "1", "--setups", "2,4,3", "--noisy", "",
                                    "--features-cache", str(tmp_path / "f.pt")])
    assert cached["setups"][0]["rows"][2] == rows[("online", 2)]  # the cached features: no model is loaded
    gates = study_predictors.main(["--recording", str(path), "--predictors", "online", "--probe-tokens", "2",
                                   "--gain-z", "1,none", "--signal-tokens", "1", "--setups", "2,4,3", "--noisy", "",
                                   "--features-cache", str(tmp_path / "f.pt")])
    by_gate = {row["gain_z"]: row for row in gates["setups"][0]["rows"] if row["predictor"] == "online"}
    assert set(by_gate) == {1.0, None} and by_gate[1.0] == rows[("online", 2)]
    assert walked[-1][0].config.gain_z is None  # the last walk is the ungated scheduler's
    other = tmp_path / "other.json"
    write_recording(other, {**read_recording(path), "lengths": [row[::-1] for row in lengths],
                            "completion_ids": [group[::-1] for group in completions]})
    with pytest.raises(SystemExit, match=r"f.pt holds the features of .*rec.json.gz \(model tiny-llama\), not of "):
        study_predictors.main(["--recording", str(other), "--features-cache", str(tmp_path / "f.pt")])
    assert [row["t"] for row in report["signals"]["elapsed"]] == [0, 8, 32, 64, 128]
    assert 0 <= report["signals"]["group_share"] <= 1
    assert [row["k"] for row in report["signals"]["token"]] == [1, 2]
    assert all(row["tail_auc"] is None or 0 <= row["tail_auc"] <= 1 for row in report["signals"]["token"])
    assert set(report["signals"]["noisy_tail_auc"]) == {"0.5"}
    walked.clear()
    orders = study_predictors.main(["--recording", str(path), "--predictors", "online", "--probe-tokens", "2",
                                    "--orders", "3", "--signal-tokens", "1", "--setups", "2,4,3", "--noisy", "",
                                    "--features-cache", str(tmp_path / "f.pt")])
    for row in orders["setups"][0]["rows"]:  # the recording's order first, as a one-order study walks it
        assert len(row["order_steps"]) == 3 and row["decode_steps"] == sum(row["order_steps"])
        assert row["order_steps"][0] == rows[(row["predictor"], row["probe_tokens"])]["decode_steps"]
    # the halves of three orders, each walked warm and measured
    measured_sets = {tuple(prompts) for _, prompts in walked}
    assert len(measured_sets) > 2 and all(len(prompts) == 4 for prompts in measured_sets)
    assert orders["setups"][0]["rows"][0]["order_ratios"] == [1.0, 1.0, 1.0]
    with pytest.raises(SystemExit, match=r"setup B=2, G=5: the recording holds 8 prompts x 4 samples"):
        study_predictors.main(["--recording", str(path), "--setups", "2,5,3", "--probe-tokens", "2",
                               "--signal-tokens", "1", "--features-cache", str(tmp_path / "f.pt")])
    with pytest.raises(SystemExit):
        study_predictors.parse_args(["--recording", str(path), "--probe-tokens", "abc"])
    with pytest.raises(SystemExit):
        study_predictors.parse_args(["--recording", str(path), "--orders", "0"])
    assert "--orders 0: use an integer >= 1" in capsys.readouterr().err
    for bad in ("0", "-1", "inf", "abc"):
        with pytest.raises(SystemExit):
            study_predictors.parse_args(["--recording", str(path), "--gain-z", f"1,{bad}"])
        assert f"--gain-z: '{bad}' is neither a number > 0 nor 'none'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="holds lengths only"):
        write_recording(tmp_path / "lengths.json", {"lengths": lengths})
        study_predictors.main(["--recording", str(tmp_path / "lengths.json")])


def test_tail_auc_tells_the_long_samples_from_the_rest():
    lengths = [[4, 4, 5, 20], [4, 6, 5, 18]]  # median 5: long is > 7 tokens
    assert length_signals.long_threshold(lengths) == 7
    true = [n for row in lengths for n in row]
    assert length_signals.tail_auc([float(n) for n in true], true, 7) == 1.0
    assert length_signals.tail_auc([-float(n) for n in true], true, 7) == 0.0
    assert length_signals.tail_auc([1.0] * len(true), true, 7) == 0.5  # no ranking: chance
    assert length_signals.tail_auc([1.0, 2.0], [4, 5], 7) is None  # no long sample: nothing to tell apart
    assert length_signals.tail_auc([100.0, 200.0, 300.0], [100, 200, 300], 150) == 1.0  # lengths, not logits
    many = [[4] * 7 + [20]] * 40  # noisy:S tells 20 from 4 with P(log 5 + S (z1 - z2) > 0): 0.65 at S = 3
    assert length_signals.noisy_tail_auc(many, 0.01) == 1.0
    assert 0.55 < length_signals.noisy_tail_auc(many, 3.0) < 0.75
