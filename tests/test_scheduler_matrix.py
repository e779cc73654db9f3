"""The scheduler matrix's tools: seeded length sets, the matrix run end to end, its target judgement, noisy:S."""

import json

import pytest

from tools import bench_rollout, bench_scheduler_matrix, make_length_sets
from tools.bench_scheduler_matrix import misses

CELL_FIELDS = {"set", "prompts", "group_size", "slots", "predictor", "refill", "decode_steps", "continuous_steps",
               "lower_bound_steps", "makespan_lower_bound", "best_plan_steps", "ratio_to_continuous",
               "ratio_to_bound", "ratio_to_best_plan"}


def test_length_sets_are_deterministic_valid_and_the_committed_files_current(tmp_path):
    planned = make_length_sets.planned_files(make_length_sets.FAMILIES, make_length_sets.SHAPES, 256, 0)
    assert planned == make_length_sets.planned_files(make_length_sets.FAMILIES, make_length_sets.SHAPES, 256, 0)
    assert planned != make_length_sets.planned_files(make_length_sets.FAMILIES, make_length_sets.SHAPES, 256, 1)
    assert make_length_sets.main(["--check"]) == 0  # tools/data/synthetic/ is what the script writes
    assert make_length_sets.main(["--out", str(tmp_path), "--families", "uniform", "--shapes", "2x4"]) == 0
    assert make_length_sets.main(["--out", str(tmp_path), "--check"]) == 1  # the other files are missing there
    for name, text in planned.items():
        content = json.loads(text)
        meta, lengths = content["meta"], content["lengths"]
        assert len(lengths) == meta["prompts"] + meta["warmup_prompts"] and {len(row) for row in lengths} == {
            meta["group_size"]}
        assert meta["warmup_prompts"] == make_length_sets.WARMUP_ROLLOUTS * meta["prompts"]
        assert all(1 <= n <= meta["max_new_tokens"] for row in lengths for n in row), name
        assert name == f"{meta['family']}_b{meta['prompts']}_g{meta['group_size']}.json"
    # prompts differ in difficulty: per-prompt means spread out
    lognormal = json.loads(planned["lognormal_b8_g16.json"])["lengths"]
    means = sorted(sum(row) / len(row) for row in lognormal)
    assert means[-1] > 1.5 * means[0]


def test_warm_up_rollouts_replay_other_prompts_than_the_measured_ones():
    """The measured instance is the same whatever the number of warm-ups (their prompts have their own random
    stream; the paper set at its own shape is the recorded prompt), and a replay never wraps a warm-up round onto
    the measured prompts: it refuses."""
    from tools.recordings import Replay

    recorded = json.loads(make_length_sets.PAPER_FILE.read_text())["lengths"]
    paper = make_length_sets.length_set("paper", 1, 32, make_length_sets.PAPER_CAP, 0)
    assert paper["lengths"][0] == recorded[0] and len(paper["lengths"]) == 1 + make_length_sets.WARMUP_ROLLOUTS
    content = make_length_sets.length_set("bimodal", 4, 16, 256, 0)
    replay = Replay(content, "lengths", B=4, G=16)
    rounds = [replay.rollout(i)[1]["lengths"] for i in range(1 + make_length_sets.WARMUP_ROLLOUTS)]
    assert rounds[0] == content["lengths"][:4] and all(warm != rounds[0] for warm in rounds[1:])
    with pytest.raises(ValueError, match=r"the recording holds 16 prompts: rollout 4 of B=4 needs 20 \(fewer "
                                         r"warm-up rollouts"):
        replay.rollout(1 + make_length_sets.WARMUP_ROLLOUTS)


def test_length_sets_name_bad_inputs():
    with pytest.raises(ValueError, match=r"unknown length family 'gamma'; allowed: lognormal, bimodal"):
        make_length_sets.length_set("gamma", 1, 4, 64, 0)
    with pytest.raises(ValueError, match=r"group_size=0 must be an integer >= 1"):
        make_length_sets.length_set("uniform", 1, 0, 64, 0)
    with pytest.raises(SystemExit, match=r"--shapes item '4x' must be BxG"):
        make_length_sets.main(["--shapes", "4x", "--check"])


def test_matrix_runs_a_sub_matrix_end_to_end(tmp_path, capsys):
    out, table = tmp_path / "matrix.json", tmp_path / "matrix.md"
    assert make_length_sets.main(["--families", "bimodal", "--shapes", "1x16", "--cap", "24", "--out",
                                  str(tmp_path)]) == 0
    report = bench_scheduler_matrix.main(["--sets", "bimodal", "--shapes", "1x16x4", "--lengths-dir", str(tmp_path),
                                          "--predictors", "none,oracle,online,noisy:0.5", "--warmup-rollouts", "1",
                                          "--json", str(out), "--markdown", str(table)])
    assert json.loads(out.read_text())["cells"] == report["cells"]
    cells = {cell["predictor"]: cell for cell in report["cells"]}
    assert set(cells) == {"none", "oracle", "online", "noisy:0.5"}
    for cell in cells.values():
        assert CELL_FIELDS <= set(cell)
        assert cell["decode_steps"] >= cell["lower_bound_steps"] > 0  # parking may beat the whole-sample bound
        assert cell["best_plan_steps"] >= cell["makespan_lower_bound"] >= cell["lower_bound_steps"]
        assert cell["ratio_to_continuous"] == cell["decode_steps"] / cell["continuous_steps"]
    text = table.read_text()
    assert "| bimodal | 1 | 16 | 4 |" in text and "S = 0.5" in text and text in capsys.readouterr().out
    assert "| default | length-aware oracle |" in text  # "none" is the default scheduler's column
    assert bench_scheduler_matrix.main(["--from-json", str(out), "--check"])["cells"] == report["cells"]


def _cell(predictor, steps, continuous=100, bound=80):
    return dict(set="s", prompts=1, group_size=4, slots=2, refill="lpt", predictor=predictor, decode_steps=steps,
                continuous_steps=continuous, makespan_lower_bound=bound, best_plan_steps=bound,
                ratio_to_continuous=steps / continuous,
                ratio_to_bound=steps / bound)


def test_check_names_every_missed_target(tmp_path):
    assert misses([_cell("none", 100), _cell("oracle", 81), _cell("online", 100), _cell("noisy:0.25", 90)]) == []
    found = misses([_cell("none", 103), _cell("oracle", 82), _cell("online", 101), _cell("noisy:0.25", 92),
                    _cell("noisy:1.0", 102)])
    assert [line.split(": ")[0] for line in found] == [
        "s B1 G4 g2 none,lpt", "s B1 G4 g2 oracle,lpt", "s B1 G4 g2 online,lpt", "s B1 G4 g2 noisy:0.25,lpt",
        "s B1 G4 g2 noisy:1.0,lpt"]
    assert "1.030 x continuous (infinite (the default scheduler)" in found[0]
    assert "1.025 x bound" in found[1] and "keeps 0.44 of the oracle's gain" in found[3]
    assert "1.010 x continuous (infinite/online" in found[2] and "1.020 x continuous" in found[4]
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"config": {"warmup_rollouts": 3, "seed": 0}, "cells": [_cell("online", 101)]}))
    with pytest.raises(SystemExit) as exit_info:
        bench_scheduler_matrix.main(["--from-json", str(saved), "--check"])
    assert exit_info.value.code == 1


def test_matrix_names_bad_arguments():
    with pytest.raises(SystemExit):
        bench_scheduler_matrix.parse_args(["--sets", "paper,gamma"])
    with pytest.raises(SystemExit):
        bench_scheduler_matrix.parse_args(["--shapes", "4x16"])


def test_bench_rollout_takes_noisy_predictors(tmp_path):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps({"lengths": [[9, 2, 5, 7, 30, 3], [3, 8, 1, 4, 2, 25]]}))
    report = bench_rollout.main(["--model", "tiny", "--lengths", str(lengths), "--micro-group-size", "2",
                                 "--max-new-tokens", "30", "--repeats", "1", "--task", "synthetic", "--threads", "1",
                                 "--strategies", "infinite", "--predictors", "none,oracle,noisy:0,noisy:0.25"])
    runs = {run["predictor"]: run for run in report["runs"]}
    assert set(runs) == {"none", "oracle", "noisy:0", "noisy:0.25"}
    assert runs["noisy:0"]["decode_steps"] == runs["oracle"]["decode_steps"]
    with pytest.raises(SystemExit):
        bench_rollout.parse_args(["--predictors", "noisy:-1"])
