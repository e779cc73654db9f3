"""tools.compare_trl without TRL: the specs both sides get, the run order, the summary and table, the memory
watched from outside a child, the lit_grpo config read back through the CLI, and TRL's environment made from a
venv with a stand-in TRL from a local folder."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import site
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from tools import compare_trl, process_memory
from tools.compare_trl_spec import SHAPES, build_spec, cells, demo_settings, lit_config, trl_config

MB = 1 << 20


@pytest.fixture(scope="module")
def demo():
    return demo_settings()


def test_the_demo_shape_is_the_demo(demo):
    spec = build_spec(demo, cells("demo", demo)[0], steps=8)
    assert (spec["prompts_per_step"], spec["group_size"], spec["max_new_tokens"]) == (4, 8, 24)
    assert spec["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and spec["dtype"] == "float32"
    assert spec["loss"] == {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.28, "beta": 0.0,
                            "importance_sampling_level": "token"}
    assert (spec["lr"], spec["lr_warmup_steps"], spec["train_micro_batch_size"], spec["steps"]) == (1e-5, 2, 16, 9)
    assert spec["data"]["system_prompt"] == demo["data"]["system_prompt"]
    assert [(c["prompts_per_step"], c["group_size"], c["max_new_tokens"]) for c in cells("gsweep", demo)] == [
        (1, 8, 32), (1, 32, 32), (1, 64, 32), (1, 128, 32)]


def test_the_g_sweep_varies_g_alone(demo):
    # the demo's 16-row micro-batch and 16 slots would shrink to 8 at G 8 only; the sweep holds 8 at every G
    specs = [build_spec(demo, cell) for cell in cells("gsweep", demo)]
    assert [(s["group_size"], s["train_micro_batch_size"], s["lit"]["micro_group_size"]) for s in specs] == [
        (8, 8, 8), (32, 8, 8), (64, 8, 8), (128, 8, 8)]
    assert all("rows" not in s and not s["gradient_checkpointing"] for s in specs)
    # the long cells hold their rows and checkpoint both systems' updates, whatever the demo does
    long = [build_spec(demo, cell, device="cuda") for cell in cells("gpu_long", demo)]
    assert [(s["group_size"], s["max_new_tokens"], s["train_micro_batch_size"]) for s in long] == [
        (256, 4096, 8), (32, 4096, 8), (64, 4096, 8), (128, 4096, 8)]
    assert all(s["gradient_checkpointing"] and trl_config(s, "out")["gradient_checkpointing"] for s in long)
    assert all(lit_config(s, "records.jsonl")["model"]["gradient_checkpointing"] for s in long)
    assert [trl_config(s, "out")["gradient_accumulation_steps"] for s in specs] == [1, 4, 8, 16]
    with pytest.raises(ValueError, match=r"rows 12: .* positive divisor of B x G = 32"):
        build_spec(demo, {"prompts_per_step": 1, "group_size": 32, "max_new_tokens": 8, "rows": 12})


def test_lit_slots_all_or_auto_change_the_slots_and_nothing_else(demo):
    fixed, every, auto = ([build_spec(demo, cell, lit_slots=slots) for cell in cells("gpu_gsweep", demo)]
                          for slots in ("fixed", "all", "auto"))
    assert [s["lit"]["micro_group_size"] for s in every] == [8, 32, 64]
    for a, b, c in zip(fixed, every, auto):
        assert {**a, "lit": None} == {**b, "lit": None} == {**c, "lit": None}
        assert trl_config(a, "out") == trl_config(b, "out") == trl_config(c, "out")
        assert lit_config(b, "r")["data"]["sampling"]["micro_group_size"] == b["group_size"]
        assert lit_config(c, "r")["data"]["sampling"]["micro_group_size"] == "auto"
    with pytest.raises(ValueError, match=r"lit_slots 'some': use one of \('fixed', 'all', 'auto'\) or a count"):
        build_spec(demo, cells("demo", demo)[0], lit_slots="some")
    # a count: the same slots at every G (capped at the samples), nothing else changed
    counted = [build_spec(demo, cell, lit_slots=32) for cell in cells("gpu_gsweep", demo)]
    assert [s["lit"]["micro_group_size"] for s in counted] == [8, 32, 32]
    assert all({**a, "lit": None} == {**b, "lit": None} for a, b in zip(fixed, counted))
    for bad in (0, True):
        with pytest.raises(ValueError, match=f"lit_slots {bad!r}: use one of"):
            build_spec(demo, cells("demo", demo)[0], lit_slots=bad)
    assert compare_trl._lit_slots("32") == 32 and compare_trl._lit_slots("auto") == "auto"
    with pytest.raises(argparse.ArgumentTypeError, match="'0': use one of fixed, all, auto or a count"):
        compare_trl._lit_slots("0")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_both_sides_get_the_same_settings(demo, shape):
    for cell in cells(shape, demo):
        spec = build_spec(demo, cell, seed=3, steps=2, threads=2)
        lit, trl = lit_config(spec, "steps.jsonl"), trl_config(spec, "out")
        model, data, sampling = lit["model"], lit["data"], lit["data"]["sampling"]
        rows = spec["prompts_per_step"] * spec["group_size"]
        pairs = [  # (lit_grpo's value, TRL's value)
            (lit["trainer"]["max_steps"], trl["max_steps"]),
            (lit["seed_everything"], trl["seed"]), (sampling["seed"], trl["seed"]),
            (sampling["group_size"], trl["num_generations"]),
            (sampling["max_new_tokens"], trl["max_completion_length"]),
            (sampling["temperature"], trl["temperature"]), (sampling["top_p"], trl["top_p"]),
            (sampling["top_k"], trl["top_k"]),
            (model["loss"]["loss_type"], trl["loss_type"]), (model["loss"]["epsilon_low"], trl["epsilon"]),
            (model["loss"]["epsilon_high"], trl["epsilon_high"]), (model["loss"]["beta"], trl["beta"]),
            (model["loss"]["importance_sampling_level"], trl["importance_sampling_level"]),
            (model["scale_rewards"], trl["scale_rewards"]), (model["num_iterations"], trl["num_iterations"]),
            (model["multi_objective_aggregation"], trl["multi_objective_aggregation"]),
            (model["mask_truncated_completions"], trl["mask_truncated_completions"]),
            (model["lr"], trl["learning_rate"]), (tuple(model["betas"]), (trl["adam_beta1"], trl["adam_beta2"])),
            (model["weight_decay"], trl["weight_decay"]), (model["max_grad_norm"], trl["max_grad_norm"]),
            (model["gradient_checkpointing"], trl["gradient_checkpointing"]),
            (lit["trainer"]["precision"] == "bf16-mixed", trl["bf16"]),
            (model["train_micro_batch_size"], trl["per_device_train_batch_size"]),
        ]
        for ours, theirs in pairs:
            assert ours == theirs
        # one optimizer step per GRPO step: TRL's accumulation covers the B x G rows exactly
        assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == rows
        assert data["prompts_per_step"] == spec["prompts_per_step"] and not data["dynamic_sampling"]
        assert trl["shuffle_dataset"] is False and trl["use_cpu"] is True and trl["report_to"] == "none"
        assert len(trl["reward_weights"]) == len(data["reward_funcs"])
        assert lit["torch_num_threads"] == 2 and sampling["micro_group_size"] <= rows


def test_a_decaying_schedule_and_min_p_reach_both_sides(demo):
    """A config's lr_schedule and min_p are compared, not dropped: TRL samples with the same min_p and steps its
    learning rate by lit_grpo's own schedule."""
    from lit_grpo.update.lr_schedule import lr_factor
    from tools.compare_trl_runs import lit_optimizer

    settings = {**demo, "model": {**demo["model"], "lr_schedule": "cosine", "warmup_steps": 2},
                "data": {**demo["data"], "sampling": {**demo["data"]["sampling"], "min_p": 0.1}}}
    spec = build_spec(settings, {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8}, seed=0, steps=6,
                      threads=1)
    lit, trl = lit_config(spec, "steps.jsonl"), trl_config(spec, "out")
    assert lit["model"]["lr_schedule"] == "cosine" and lit["data"]["sampling"]["min_p"] == trl["min_p"] == 0.1
    optimizer, scheduler = lit_optimizer(torch.nn.Linear(2, 2), spec)
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    total = lit["trainer"]["max_steps"]  # where lit_grpo's run decays to 0
    assert rates == [spec["lr"] * lr_factor(k, 2, total, "cosine") for k in range(6)] and rates[-1] < rates[1]
    assert trl_config(build_spec(demo, {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8}, seed=0,
                                 steps=1, threads=1), "out")["min_p"] is None  # off, as TRL says it


def test_trl_steps_a_gpu_policy_with_the_fused_adamw_lit_grpo_steps_it_with(demo):
    """On a GPU lit_grpo's AdamW runs fused (one kernel for every weight): TRL's side, handed lit_grpo's optimizer,
    runs the same one, or the comparison would time TRL's optimizer step by another kernel. The GPU's weights are
    faked (their device alone is read: nothing runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lit_grpo.update.module import GRPOModule
    from tools.compare_trl_runs import lit_optimizer
    from tools.compare_trl_spec import trl_other_settings

    spec = build_spec(demo, {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8}, device="cuda",
                      precision="bf16-mixed", seed=0, steps=2, threads=1)
    with FakeTensorMode():
        weight = torch.nn.Parameter(torch.zeros(4, 4, device="cuda"))
    module = GRPOModule(model="tiny-llama")
    module.policy = torch.nn.ParameterList([weight])  # what configure_optimizers steps: the policy's weights
    optimizer, _ = lit_optimizer(torch.nn.ParameterList([weight]), spec)
    assert optimizer.defaults["fused"] is True is module.configure_optimizers()["optimizer"].defaults["fused"]
    assert "fused" in trl_other_settings(spec)["optimizers"]
    cpu, _ = lit_optimizer(torch.nn.Linear(2, 2), build_spec(demo, {"prompts_per_step": 2, "group_size": 4,
                                                                    "max_new_tokens": 8}, seed=0, steps=2, threads=1))
    assert not cpu.defaults["fused"]  # on a CPU torch's default, as lit_grpo's


def test_the_lit_grpo_config_sets_what_the_spec_says(demo, tmp_path):
    from lit_grpo.cli import build_cli

    spec = build_spec(demo, {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12}, model="tiny-llama",
                      seed=5, steps=3, threads=1)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(lit_config(spec, tmp_path / "steps.jsonl")))
    threads = torch.get_num_threads()
    try:
        cli = build_cli(["--config", str(path)], run=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    hp = model.hparams
    assert hp.model == "tiny-llama" and hp.dtype == "float32" and hp.lr == spec["lr"]
    assert tuple(hp.betas) == tuple(spec["betas"]) and hp.warmup_steps == spec["lr_warmup_steps"]
    assert (hp.train_micro_batch_size, hp.max_grad_norm, hp.gradient_checkpointing) == (
        spec["train_micro_batch_size"], spec["max_grad_norm"], spec["gradient_checkpointing"])
    config = model.loss_fn.config
    assert (model.loss_fn.name, config.epsilon_low, config.epsilon_high, config.beta) == ("dapo", 0.2, 0.28, 0.0)
    sampling = data.sampling
    assert (sampling.group_size, sampling.max_new_tokens, sampling.temperature, sampling.seed) == (4, 12, 1.0, 5)
    assert data.training.prompts_per_step == 2 and data.system_prompt == demo["data"]["system_prompt"]
    assert trainer.max_steps == 4 and trainer.limit_val_batches == 0 and trainer.logger is None
    recorders = [cb for cb in trainer.callbacks if type(cb).__name__ == "StepRecorder"]
    assert len(recorders) == 1 and recorders[0].out == str(tmp_path / "steps.jsonl")
    assert not [cb for cb in trainer.callbacks if type(cb).__name__ == "PeakMemoryMonitor"]


def test_the_lit_grpo_run_records_its_engine_against_its_floor_each_step(demo, tmp_path):
    """A step record holds the engine's slots and its decode step against the floor (the bytes it read at the
    bandwidth measured before the first step), so a run stopped at its deadline keeps them."""
    from lit_grpo.cli import build_cli

    spec = build_spec(demo, {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8}, model="tiny-llama",
                      steps=1, threads=1, lit_slots=3)
    path, records = tmp_path / "spec" / "config.yaml", tmp_path / "steps.jsonl"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(lit_config(spec, records)))
    threads = torch.get_num_threads()
    try:
        cli = build_cli(["--config", str(path), "--trainer.default_root_dir", str(tmp_path)], run=False)
        cli.trainer.fit(cli.model, cli.datamodule)
    finally:
        torch.set_num_threads(threads)
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    start, steps = lines[0], [line for line in lines if line["event"] == "step"]
    assert start["read_bytes_per_s"] > 0 and len(steps) == 2
    # each step's rollout written before its update, with what it measured
    assert [(line["event"], line.get("step")) for line in lines[1:5]] == [("rollout", 1), ("step", 1),
                                                                           ("rollout", 2), ("step", 2)]
    assert lines[3]["ms_per_step"] == steps[1]["ms_per_step"] and lines[3]["rollout_s"] == steps[1]["rollout_s"]
    for step in steps:
        assert step["slots"] == 3 and step["decode_steps"] > 0 and step["peak_kv_bytes"] > 0
        assert step["floor_ms_per_step"] > 0
        assert step["roofline_ratio"] == pytest.approx(step["ms_per_step"] / step["floor_ms_per_step"])
    figures = compare_trl.run_figures(steps, untimed=1)
    assert figures["slots"] == 3 and figures["ms_per_step"] == steps[1]["ms_per_step"]


def test_trl_gets_lit_grpos_prompts_in_its_order(demo):
    from tools.compare_trl_runs import lit_prompt_rows

    spec = build_spec(demo, {"prompts_per_step": 3, "group_size": 2, "max_new_tokens": 8}, seed=1, steps=1)
    rows = lit_prompt_rows(spec)
    assert len(rows) == 2 * 3 and len({row["index"] for row in rows[:3]}) == 3
    assert rows == lit_prompt_rows(spec)  # seeded: the same every time
    assert rows[0]["prompt"][0] == {"role": "system", "content": demo["data"]["system_prompt"]}
    assert rows[0]["prompt"][-1]["role"] == "user" and rows[0]["answer"] is not None
    # a template with braces of its own (\boxed{}) is filled as lit_grpo fills it: only {prompt} is replaced
    spec["data"]["prompt_template"] = "Put the answer in \\boxed{}: {prompt}"
    boxed = lit_prompt_rows(spec)
    assert boxed[0]["prompt"][-1]["content"] == "Put the answer in \\boxed{}: " + rows[0]["prompt"][-1]["content"]


def test_lit_grpos_rewards_take_trls_call_and_keywords(tmp_path):
    """The comparison hands TRL lit_grpo's reward functions wrapped into TRL's signature: TRL's own keywords
    (trainer_state, log_metric) reach them, and a TRL-shaped function among them is called its way."""
    from tools.compare_trl_runs import StepLog, trl_reward_funcs

    logged = []

    def solution_reward(completions, answer, trainer_state, log_metric, **kwargs):
        log_metric("seen_step", trainer_state.global_step)
        return [float(c == a) for c, a in zip(completions, answer)]

    spec = {"max_new_tokens": 4, "data": {"reward_funcs": [solution_reward]}}
    (wrapped,) = trl_reward_funcs(spec, {0}, StepLog(tmp_path / "log.jsonl", cuda=False))
    state = type("TrainerState", (), {"global_step": 3})()
    scores = wrapped(prompts=[[{"role": "user", "content": "1 + 1?"}]] * 2,
                     completions=[[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "3"}]],
                     completion_ids=[[5, 0], [6, 0]], answer=["2", "2"], entry_json=["{}", "{}"], index=[0, 0],
                     trainer_state=state, log_metric=lambda name, value: logged.append((name, value)),
                     log_extra=lambda column, values: None)
    assert scores == [1.0, 0.0] and logged == [("seen_step", 3)]


def test_abba_order():
    runs = compare_trl.plan(compare_trl.parse_order("lit,trl,trl,lit"), [0, 7], 2)
    assert [(r["cell"], r["seed"], r["system"], r["repeat"]) for r in runs[:8]] == [
        (0, 0, "lit", 0), (0, 0, "trl", 0), (0, 0, "trl", 1), (0, 0, "lit", 1),
        (0, 7, "lit", 0), (0, 7, "trl", 0), (0, 7, "trl", 1), (0, 7, "lit", 1)]
    assert len(runs) == 16 and runs[8]["cell"] == 1
    with pytest.raises(Exception, match="comma list of lit and trl"):
        compare_trl.parse_order("lit,vllm")


def test_group_sizes_pick_the_shapes_cells_in_its_order(capsys):
    base = ["--trl-python", sys.executable, "--shape", "gpu_long"]
    picked = compare_trl.specs(compare_trl.parse_args([*base, "--group-sizes", "64,256"]))
    assert [(s["group_size"], s["max_new_tokens"]) for s in picked] == [(256, 4096), (64, 4096)]
    assert len(compare_trl.specs(compare_trl.parse_args(base))) == 4
    with pytest.raises(SystemExit):
        compare_trl.parse_args([*base, "--group-sizes", "32,512"])
    assert "--group-sizes 512: --shape gpu_long has G 256, 32, 64, 128" in capsys.readouterr().err


def test_gpu_long_times_its_one_step_without_a_warm_up_and_the_others_after_one(demo):
    base = ["--trl-python", sys.executable]
    assert compare_trl.parse_args([*base, "--shape", "gpu_long"]).untimed_steps == 0
    assert compare_trl.parse_args([*base, "--shape", "gpu_gsweep"]).untimed_steps == 1
    args = compare_trl.parse_args([*base, "--shape", "gpu_long", "--untimed-steps", "2", "--group-sizes", "32"])
    (spec,) = compare_trl.specs(args)
    assert (spec["untimed_steps"], spec["steps"], trl_config(spec, "out")["max_steps"]) == (2, 3, 3)
    with pytest.raises(SystemExit):
        compare_trl.parse_args([*base, "--untimed-steps", "-1"])
    with pytest.raises(ValueError, match="untimed_steps -1: use an integer >= 0"):
        build_spec(demo, cells("gpu_long", demo)[0], untimed_steps=-1)


def test_out_dir_names_the_files_after_what_picks_the_runs(tmp_path):
    """The shape, the slots, the group sizes and a lone system name a call's files (its runs' archive too), so that
    calls of other cells into one folder keep each other's; the live log is one, its runs archived as they end."""
    base = ["--trl-python", sys.executable, "--out-dir", str(tmp_path)]
    for flags, name in (([], "demo"), (["--shape", "gpu_long", "--lit-slots", "auto"], "gpu_long_slots-auto"),
                        (["--shape=gpu_gsweep", "--shape", "gpu_long", "--lit-slots", "32"], "gpu_long_slots-32"),
                        (["--lit-slots", "fixed"], "demo"),
                        (["--shape", "gpu_gsweep", "--group-sizes", "64,32", "--order", "lit"],
                         "gpu_gsweep_g32-64_lit"),
                        (["--shape", "gpu_gsweep", "--group-sizes", "32,64", "--order", "trl,trl"],
                         "gpu_gsweep_g32-64_trl"),
                        (["--shape", "gsweep", "--group-sizes", "8", "--lit-slots", "all", "--order", "trl,lit"],
                         "gsweep_slots-all_g8")):
        args = compare_trl.parse_args([*base, *flags])
        assert (args.json, args.markdown, args.archive) == (tmp_path / f"{name}.json", tmp_path / f"{name}.md",
                                                            tmp_path / f"{name}.runs.tgz")
        assert args.live_log == tmp_path / "live.log"
    args = compare_trl.parse_args([*base, "--json", str(tmp_path / "mine.json")])  # a given path wins
    assert (args.json, args.markdown) == (tmp_path / "mine.json", tmp_path / "demo.md")
    assert compare_trl.parse_args(base[:2]).json is None


def _steps(step_s, rollout_s, reward, peak, count=3, prompts=(1, 2)):
    steps = []
    for i in range(count):
        steps.append({"event": "step", "step": i + 1, "start": 10.0 * i, "end": 10.0 * i + step_s,
                      "step_s": step_s + i * 0.1, "rollout_s": rollout_s, "generate_s": rollout_s - 0.1,
                      "update_s": step_s + i * 0.1 - rollout_s, "reward_mean": reward, "prompts": list(prompts)})
    samples = [(s["start"] + 0.5, peak if s["step"] > 1 else peak * 2) for s in steps]  # the warm-up is larger
    return steps, samples


def _record(system, seed, steps, samples, status="ok", returncode=0, cell=0):
    seen = process_memory.Watched(returncode=returncode, timed_out=status == "timeout", samples=samples,
                                  maxrss_bytes=max(rss for _, rss in samples))
    output = {"oom": "RuntimeError: DefaultCPUAllocator: can't allocate memory", "timeout": "", "ok": "",
              "failed": "ValueError: a run's own error"}[status]
    spec = {"prompts_per_step": 4, "group_size": 8, "max_new_tokens": 24, "untimed_steps": 1}
    run = {"cell": cell, "seed": seed, "system": system, "repeat": 0}
    records = [{"event": "start", "torch": "2", "threads": 2}, *steps]
    return compare_trl.run_record(run, spec, seen, records, output, ["cmd"], "dir")


def test_summary_and_table_from_synthetic_runs():
    runs = []
    for seed, (lit_reward, trl_reward) in enumerate([(0.5, 0.45), (0.6, 0.5)]):
        runs.append(_record("lit", seed, *_steps(2.0, 1.0, lit_reward, 100 * MB)))
        runs.append(_record("trl", seed, *_steps(4.0, 1.5, trl_reward, 200 * MB)))
    steps, samples = _steps(9.0, 8.0, 0.1, 900 * MB, count=2)
    runs.append(_record("trl", 0, steps, samples, status="timeout", returncode=-9, cell=1))
    steps, samples = _steps(3.0, 1.0, 0.2, 300 * MB, count=3)
    runs.append(_record("lit", 0, steps, samples, cell=1))
    steps, samples = _steps(9.0, 8.0, 0.1, 900 * MB, count=1)
    runs.append(_record("trl", 0, steps, samples, status="oom", returncode=1, cell=1))

    assert [r["status"] for r in runs[4:]] == ["timeout", "ok", "oom"]
    assert runs[0]["rss_peak_bytes"] == 100 * MB  # the warm-up step's larger peak is left out
    assert runs[0]["step_s"] == pytest.approx(2.15) and runs[0]["timed_steps"] == 2
    summary = compare_trl.summarize(runs)
    first, second = summary
    lit, trl = first["systems"]["lit"], first["systems"]["trl"]
    assert lit["step_s"] == pytest.approx(2.15) and trl["step_s"] == pytest.approx(4.15)
    assert first["ratio_lit_over_trl"]["step_s"] == pytest.approx(2.15 / 4.15)
    assert first["ratio_lit_over_trl"]["rss_peak_bytes"] == pytest.approx(0.5)
    assert first["same_prompts"] is True
    reward = first["reward"]
    assert reward["lit"]["mean"] == pytest.approx(0.55) and reward["lit"]["spread"] == pytest.approx(0.1)
    assert reward["trl"]["mean"] == pytest.approx(0.475) and reward["within_spread"] is True
    assert second["systems"]["trl"]["statuses"] == {"timeout": 1, "oom": 1}
    assert second["systems"]["trl"]["steps_per_run"] == [2, 1] and second["reward"]["within_spread"] is None

    report = {"config": {"steps_total": 3, "steps": 2, "device": "cpu", "model": "m", "precision": "32-true",
                         "threads": 2, "order": ["lit", "trl"], "seeds": [0, 1], "interval_s": 0.05},
              "trl_settings": {"version": "1.16.0", "GRPOConfig": {"4x8x24": {"num_generations": 8, "beta": 0.0},
                                                                    "4x32x64": {"num_generations": 32, "beta": 0.0}},
                               "other": {"optimizers": "AdamW"}},
              "runs": runs, "summary": summary}
    table = compare_trl.markdown(report)
    assert "| 4x8x24 | lit_grpo | 2.15 | 1.00 | 0.90 | 1.15 | 0.10 |" in table
    assert "| 4x8x24 | lit_grpo / TRL | 0.52 x |" in table
    assert "timeout x1, oom x1 (1-2 of 3 steps done)" in table
    assert "within the spread" in table and "GRPOConfig: num_generations=8, beta=0.0" in table
    assert "  - 4x32x64: num_generations=32" in table and "TRL optimizers: AdamW" in table


def test_a_comparison_stopped_midway_keeps_the_runs_it_finished(tmp_path, monkeypatch, capsys):
    finished = _record("lit", 0, *_steps(2.0, 1.0, 0.5, 100 * MB))
    finished["cuda_peak_bytes"] = 3 << 30
    outcomes = iter([finished, KeyboardInterrupt()])  # the second run is stopped (a command's time limit)

    def run_one(*args):
        outcome = next(outcomes)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(compare_trl, "check_trl_python", lambda python: ("2", "5", "1.16.0"))
    monkeypatch.setattr(compare_trl, "run_one", run_one)
    out = tmp_path / "report.json"
    with pytest.raises(KeyboardInterrupt):
        compare_trl.main(["--trl-python", "python3", "--shape", "demo", "--steps", "2", "--json", str(out),
                          "--work-dir", str(tmp_path / "runs")])
    report = json.loads(out.read_text())
    assert [(r["system"], r["status"]) for r in report["runs"]] == [("lit", "ok")]
    assert report["summary"][0]["systems"]["lit"]["step_s"] == pytest.approx(2.15)
    assert "CUDA peak 3.00 GiB, peak RSS 0.10 GiB" in capsys.readouterr().err


def _one_untimed_lit_run(spec, seen, records):
    """A lit_grpo run of one step and no warm-up on CUDA, its summary and its table."""
    run = compare_trl.run_record({"cell": 0, "seed": 0, "system": "lit", "repeat": 0}, {**spec, "untimed_steps": 0},
                                 seen, [{"event": "start"}, *records], "", ["cmd"], "dir")
    summary = compare_trl.summarize([run], untimed=0)
    report = {"config": {"steps_total": 1, "steps": 1, "untimed_steps": 0, "device": "cuda", "model": "m",
                         "precision": "bf16-mixed", "threads": 4, "order": ["lit"], "seeds": [0], "interval_s": 0.05},
              "trl_settings": {"version": None, "GRPOConfig": {compare_trl.cell_label(spec): {"num_generations": 8}},
                               "other": {}},
              "runs": [run], "summary": summary}
    return run, summary, compare_trl.markdown(report)


def test_without_a_warm_up_the_first_step_is_timed_and_the_table_says_so():
    steps, samples = _steps(2.0, 1.0, 0.5, 100 * MB, count=1)
    for step in steps:
        step.update(slots=32, ms_per_step=4.0, floor_ms_per_step=1.6, roofline_ratio=2.5, tokens_per_s=8000.0)
    spec = {"prompts_per_step": 4, "group_size": 8, "max_new_tokens": 24}
    seen = process_memory.Watched(returncode=0, timed_out=False, samples=samples, maxrss_bytes=200 * MB)
    run, summary, table = _one_untimed_lit_run(spec, seen, steps)
    assert run["timed_steps"] == 1 and run["step_s"] == pytest.approx(2.0) and run["slots"] == 32
    assert summary[0]["systems"]["lit"]["roofline_ratio"] == pytest.approx(2.5)
    assert "1 timed steps no warm-up" in table
    assert ("lit_grpo's engine: 32 slots, a decode step 4.00 ms against a floor of 1.60 ms (2.5 x), 8000 tokens/s"
            in table)
    assert "lit_grpo's engine: 32 slots" in compare_trl.run_line(run)


def test_a_run_stopped_in_its_update_keeps_what_its_rollout_measured():
    rollout = {"event": "rollout", "step": 1, "rollout_s": 150.0, "generate_s": 149.0, "slots": 32,
               "ms_per_step": 4.5, "floor_ms_per_step": 2.0, "roofline_ratio": 2.25, "tokens_per_s": 7000.0,
               "cuda_peak_bytes": 40 << 30}
    seen = process_memory.Watched(returncode=-9, timed_out=True, samples=[(1.0, MB)], maxrss_bytes=MB)
    spec = {"prompts_per_step": 1, "group_size": 256, "max_new_tokens": 4096}
    run, _, table = _one_untimed_lit_run(spec, seen, [rollout])
    assert run["status"] == "timeout" and run["steps"] == [] and run["unfinished_rollout"] == rollout
    note = ("step 1 stopped in its update, after a rollout of 150.00 s (CUDA peak so far 40.00 GiB): lit_grpo's "
            "engine: 32 slots, a decode step 4.50 ms against a floor of 2.00 ms (2.2 x), 7000 tokens/s")
    assert note in compare_trl.run_line(run)
    assert f"- 1x256x4096: {note}" in table


def test_a_failed_run_makes_the_exit_status_1_and_a_timeout_or_oom_does_not():
    steps, samples = _steps(2.0, 1.0, 0.5, MB)
    outcomes = {status: _record("lit", 0, steps, samples, status=status, returncode=returncode)
                for status, returncode in (("ok", 0), ("timeout", -9), ("oom", 1), ("failed", 1))}
    assert outcomes["failed"]["status"] == "failed"
    assert compare_trl.exit_status([outcomes["ok"], outcomes["timeout"], outcomes["oom"]]) == 0
    assert compare_trl.exit_status([outcomes["ok"], outcomes["failed"], outcomes["timeout"]]) == 1


def test_a_comparison_with_a_failed_run_writes_its_records_then_exits_1(tmp_path, monkeypatch, capsys):
    steps, samples = _steps(2.0, 1.0, 0.5, MB)
    outcomes = iter([_record("lit", 0, steps, samples, status="failed", returncode=1),
                     _record("lit", 0, steps, samples)])
    monkeypatch.setattr(compare_trl, "run_one", lambda *args: next(outcomes))
    with pytest.raises(SystemExit) as exit:
        compare_trl.main(["--order", "lit,lit", "--steps", "2", "--out-dir", str(tmp_path / "out"),
                          "--work-dir", str(tmp_path / "runs")])
    assert exit.value.code == 1
    report = json.loads((tmp_path / "out" / "demo_lit.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["failed", "ok"]  # every run ran, and was written first
    assert "failed x1" in (tmp_path / "out" / "demo_lit.md").read_text()
    assert "compare_trl: 1 of 2 runs failed" in capsys.readouterr().err


def test_a_comparison_of_lit_grpo_alone_does_not_look_for_trl(tmp_path, monkeypatch, capsys):
    def no_trl(python):
        raise AssertionError("TRL's environment was checked for a run without TRL")

    monkeypatch.setattr(compare_trl, "check_trl_python", no_trl)
    monkeypatch.setattr(compare_trl, "run_one", lambda *args: _record("lit", 0, *_steps(2.0, 1.0, 0.5, MB)))
    report = compare_trl.main(["--order", "lit", "--steps", "2", "--json", str(tmp_path / "report.json"),
                               "--work-dir", str(tmp_path / "runs")])
    assert [r["system"] for r in report["runs"]] == ["lit"] and report["trl_settings"]["version"] is None
    with pytest.raises(SystemExit):  # where TRL runs, its interpreter is needed
        compare_trl.parse_args(["--order", "lit,trl"])
    assert "give --trl-python (an interpreter with TRL) or --make-trl-env DIR" in capsys.readouterr().err


def test_different_prompts_are_named():
    runs = [_record("lit", 0, *_steps(2.0, 1.0, 0.5, MB)), _record("trl", 0, *_steps(2.0, 1.0, 0.5, MB,
                                                                                      prompts=(3, 4)))]
    assert compare_trl.summarize(runs)[0]["same_prompts"] is False


HOLD_200_MB = "import time; block = b'x' * (200 << 20); time.sleep(0.6); del block; time.sleep(0.3)"


def test_the_memory_of_a_child_read_from_outside():
    start = time.time()
    process = subprocess.Popen([sys.executable, "-c", HOLD_200_MB])
    seen = process_memory.watch(process, timeout_s=30, interval_s=0.02)
    assert seen.returncode == 0 and not seen.timed_out and process.returncode == 0
    assert seen.peak_rss_bytes >= 200 * MB and seen.maxrss_bytes >= 200 * MB
    assert seen.samples[-1][1] < 100 * MB  # the block was freed before the end
    assert process_memory.window_peak(seen.samples, start, time.time()) == seen.peak_rss_bytes
    assert process_memory.window_peak(seen.samples, 0.0, 1.0) is None


def test_a_child_past_its_deadline_is_killed_and_named():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    seen = process_memory.watch(process, timeout_s=0.3, interval_s=0.02)
    assert seen.timed_out and seen.returncode == -9
    assert compare_trl.run_status(seen, "") == "timeout"
    killed = process_memory.Watched(returncode=-9)
    assert compare_trl.run_status(killed, "") == "oom"  # SIGKILL not sent by us: the kernel's OOM killer
    assert compare_trl.run_status(process_memory.Watched(returncode=1), "torch.OutOfMemoryError: CUDA") == "oom"
    assert compare_trl.run_status(process_memory.Watched(returncode=1), "ValueError") == "failed"


# A stand-in for the runs' commands: each records one step and says so; run 00 then ends, run 01 trains on until it
# is killed (the command's time limit falls inside it).
_STAND_IN_RUN = """
import json, os, sys, time
run_dir = sys.argv[1]
with open(os.path.join(run_dir, "steps.jsonl"), "w") as f:
    f.write(json.dumps({"event": "step", "step": 1, "start": 0.0, "end": 1.0, "step_s": 1.0, "rollout_s": 0.5}) + "\\n")
with open(os.path.join(run_dir, "pid"), "w") as f:
    f.write(str(os.getpid()))
print("step 1 done", flush=True)
if os.path.basename(run_dir).startswith("01"):
    time.sleep(300)
"""
_STAND_IN_COMPARISON = """
import sys
from tools import compare_trl

compare_trl.run_command = lambda system, spec, run_dir, trl_python: [sys.executable, sys.argv[1], str(run_dir)]
compare_trl.main(sys.argv[2:])
"""


def test_a_sigterm_keeps_the_finished_runs_and_what_the_stopped_one_left(tmp_path):
    """A command's time limit (SIGTERM) in the second run: the first run's records were already in the output
    folder, and the second run is killed, recorded as stopped with the step it finished, and its log archived."""
    import signal
    import tarfile

    run, script, out, work = tmp_path / "run.py", tmp_path / "compare.py", tmp_path / "out", tmp_path / "runs"
    run.write_text(_STAND_IN_RUN)
    script.write_text(_STAND_IN_COMPARISON)
    process = subprocess.Popen([sys.executable, str(script), str(run), "--order", "lit,lit", "--steps", "1",
                                "--untimed-steps", "0", "--work-dir", str(work), "--out-dir", str(out)],
                               cwd=compare_trl.harness.ROOT, env=compare_trl.harness.repo_env(), stderr=subprocess.PIPE,
                               text=True)
    second = work / "demo_4x8x24" / "seed0" / "01_lit"
    deadline = time.monotonic() + 120
    while not ((second / "pid").exists() and "step 1 done" in (out / "live.log").read_text()):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1]
        time.sleep(0.05)
    with tarfile.open(out / "demo_lit.runs.tgz") as tar:  # the first run's records, before the second ended
        assert "runs/demo_4x8x24/seed0/00_lit/output.log" in tar.getnames()
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err
    report = json.loads((out / "demo_lit.json").read_text())
    assert [(r["status"], len(r["steps"])) for r in report["runs"]] == [("ok", 1), ("stopped", 1)]
    assert "stopped x1 (1-1 of 1 steps done)" in (out / "demo_lit.md").read_text()
    with tarfile.open(out / "demo_lit.runs.tgz") as tar:
        log = tar.extractfile("runs/demo_4x8x24/seed0/01_lit/output.log").read().decode()
    assert "step 1 done" in log and not list(out.glob("*.partial"))
    with pytest.raises(ProcessLookupError):  # the stopped run's child was killed and reaped
        os.kill(int((second / "pid").read_text()), 0)


def test_a_sigkill_leaves_what_the_run_in_flight_printed_in_the_output_folder(tmp_path):
    """A kill without SIGTERM first (a machine's hard limit) can trap nothing: the run in flight writes its output
    into OUT_DIR/live.log as it goes (a machine hands back a few files of OUT_DIR, none deep in it), so that file
    holds what it printed; the finished run's log is in NAME.runs.tgz."""
    import signal
    import tarfile

    run, script, out = tmp_path / "run.py", tmp_path / "compare.py", tmp_path / "out"
    run.write_text(_STAND_IN_RUN)
    script.write_text(_STAND_IN_COMPARISON)
    process = subprocess.Popen([sys.executable, str(script), str(run), "--order", "lit,lit", "--steps", "1",
                                "--untimed-steps", "0", "--work-dir", str(tmp_path / "runs"), "--out-dir", str(out)],
                               cwd=compare_trl.harness.ROOT, env=compare_trl.harness.repo_env(),
                               stderr=subprocess.DEVNULL, start_new_session=True)
    second = tmp_path / "runs" / "demo_4x8x24" / "seed0" / "01_lit"
    deadline = time.monotonic() + 120
    try:
        while not (second / "pid").exists():
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        while "step 1 done" not in (out / "live.log").read_text():  # printed after the pid is written
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the comparison and its run, as a machine's limit ends both
        process.wait(timeout=60)
    assert (out / "live.log").read_text() == "step 1 done\n"
    with tarfile.open(out / "demo_lit.runs.tgz") as tar:  # the first run's own output.log, from the live log
        assert tar.extractfile("runs/demo_4x8x24/seed0/00_lit/output.log").read() == b"step 1 done\n"
    assert sorted(path.name for path in out.iterdir()) == ["demo_lit.json", "demo_lit.md", "demo_lit.runs.tgz",
                                                           "live.log"]


def test_records_cut_short_by_a_kill_are_read(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text('{"event": "start"}\n{"event": "step", "step": 1}\n{"event": "st')
    assert compare_trl.read_records(path) == [{"event": "start"}, {"event": "step", "step": 1}]
    assert compare_trl.read_records(tmp_path / "none.jsonl") == []


def test_an_environment_with_this_torch_and_transformers_is_accepted_whatever_its_torch_says(tmp_path, monkeypatch):
    """Both sides' versions are their distributions' (a CUDA torch's module says 2.11.0+cu130, its wheel 2.11.0):
    this interpreter, given a stand-in ``trl``, passes; one whose torch differs is refused, naming both."""
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text("__version__ = '1.16.0'\n")
    (tmp_path / "trl-1.16.0.dist-info").mkdir()
    (tmp_path / "trl-1.16.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: trl\nVersion: 1.16.0\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    versions = compare_trl.check_trl_python(sys.executable)
    assert versions[2] == "1.16.0" and versions[0] == compare_trl.importlib.metadata.version("torch")
    # the imports passed above; the refusal compares the same versions, read without importing torch again
    monkeypatch.setattr(compare_trl, "_VERSIONS", _METADATA_VERSIONS)
    monkeypatch.setattr(compare_trl.importlib.metadata, "version", lambda name: "0.0-other")
    with pytest.raises(SystemExit, match=r"has torch .*; this environment has 0.0-other, 0.0-other"):
        compare_trl.check_trl_python(sys.executable)


# ------------------------------------------------------------------------------------------------ TRL's environment
def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A pure-Python wheel of ``name`` (its module sets ``__version__``) requiring ``requires``, into ``folder``."""
    stem = f"{name.replace('-', '_')}-{version}"
    files = {f"{name.replace('-', '_')}/__init__.py": f"__version__ = {version!r}\n",
             f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                           + "".join(f"Requires-Dist: {text}\n" for text in requires),
             f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    files[f"{stem}.dist-info/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{stem}.dist-info/RECORD"])
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _users_venv(venv: Path) -> Path:
    """A venv seeing this environment's packages through a ``.pth`` line, as a user's would, with a package of its
    own (``only-in-users-venv``) that the base interpreter lacks; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    ours = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    adds = "; ".join(f"site.addsitedir({path!r})" for path in sys.path if path in ours)
    packages = _site_packages(venv)
    (packages / "this_environment.pth").write_text(f"import site; {adds}\n")
    (packages / "only_in_users_venv").mkdir()
    (packages / "only_in_users_venv" / "__init__.py").write_text("")
    (packages / "only_in_users_venv-1.0.dist-info").mkdir()
    (packages / "only_in_users_venv-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: only-in-users-venv\nVersion: 1.0\n")
    return venv / "bin" / "python"


# where each distribution comes from under an interpreter, and lit_grpo's module (importlib.metadata only: fast)
_WHERE = """
import importlib.metadata as md, importlib.util, json, sys
print(json.dumps({"lit_grpo": importlib.util.find_spec("lit_grpo").origin,
                  **{name: [md.version(name), str(md.distribution(name).locate_file(""))] for name in sys.argv[1:]}}))
"""


def _where(python: Path, *names: str) -> dict:
    """``_WHERE`` under ``python``, run outside the checkout: lit_grpo is found through the environment alone."""
    return json.loads(subprocess.run([str(python), "-c", _WHERE, *names], cwd=python.parent, check=True,
                                     capture_output=True, text=True).stdout)


def _assert_this_environments_stack(where: dict) -> None:
    """torch and transformers in ``where`` are this environment's distributions, lit_grpo is this checkout's."""
    for name in compare_trl.STACK:
        dist = importlib.metadata.distribution(name)
        assert where[name] == [dist.version, str(dist.locate_file(""))]
    assert where["lit_grpo"] == importlib.util.find_spec("lit_grpo").origin


# check_trl_python's check from the distributions' metadata, without importing torch (seconds on 2 cores)
_METADATA_VERSIONS = "import json, importlib.metadata as m; " \
                     "print(json.dumps([m.version(n) for n in ('torch', 'transformers', 'trl')]))"


def test_trl_environment_made_from_a_venv_reuses_its_torch_and_transformers(tmp_path, monkeypatch):
    """--make-trl-env run by a venv's python: TRL's venv sees that venv's packages (not the base interpreter's),
    its torch, transformers and editable lit_grpo are this environment's, only the missing requirement of a
    stand-in trl is installed (from a local folder), and a requirement needing another torch is refused."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "trl", compare_trl.TRL_VERSION, ("torch>=2", "transformers>=4.56.2", "packaging",
                                                    "only-in-users-venv", "missing-here>=1", "never ; extra == 'x'",
                                                    "never ; python_version < '3'"))
    _wheel(wheels, "missing-here", "1.0")
    _wheel(wheels, "needs-newer-torch", "1.0", ("torch>=99",))
    _wheel(wheels, "torch", "99.0")
    # pip from the local folder alone, without this machine's configuration, and without its scan of every
    # installed package for conflicts after an install (seconds; pip reads a "no-" option's variable inverted)
    for name, value in (("PIP_CONFIG_FILE", os.devnull), ("PIP_NO_INDEX", "1"), ("PIP_FIND_LINKS", str(wheels)),
                        ("PIP_NO_WARN_CONFLICTS", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(compare_trl, "_VERSIONS", _METADATA_VERSIONS)
    python = _users_venv(tmp_path / "users-venv")
    before = sorted(p.name for p in _site_packages(tmp_path / "users-venv").iterdir())

    trl_python = compare_trl.make_trl_env(tmp_path / "trl-venv", python)

    assert trl_python == tmp_path / "trl-venv" / "bin" / "python"
    where = _where(trl_python, *compare_trl.STACK, "trl", "only-in-users-venv", "missing-here")
    _assert_this_environments_stack(where)
    trl_site = _site_packages(tmp_path / "trl-venv")
    assert where["trl"] == [compare_trl.TRL_VERSION, str(trl_site)] and where["missing-here"] == ["1.0", str(trl_site)]
    assert where["only-in-users-venv"] == ["1.0", str(_site_packages(tmp_path / "users-venv"))]
    assert sorted(p.name for p in _site_packages(tmp_path / "users-venv").iterdir()) == before

    # pinned: a requirement that needs another torch is refused, naming it, and the venv's torch stays ours
    pinned = (tmp_path / "trl-venv" / compare_trl.CONSTRAINTS).read_text().splitlines()
    assert f"packaging=={importlib.metadata.version('packaging')}" in pinned  # every package, not torch's alone
    with pytest.raises(SystemExit, match=r"requirements \['needs-newer-torch'\] with this environment's packages "
                                         r"pinned \(torch 2"):
        compare_trl.install_requirements(trl_python, tmp_path / "trl-venv" / compare_trl.CONSTRAINTS,
                                         ["needs-newer-torch"],
                                         {name: importlib.metadata.version(name) for name in compare_trl.STACK})
    assert not list(trl_site.glob("torch*")) and not list(trl_site.glob("transformers*"))


def test_trl_environment_refuses_what_would_change_torch_or_transformers(tmp_path):
    versions = {"torch": "2.13.0+cpu", "transformers": "5.24.0"}
    compare_trl.refuse_stack_changes(["accelerate>=1.10.1", "pandas"], versions)
    with pytest.raises(SystemExit, match=r"requires 'Transformers>=99'; this environment has transformers 5.24.0"):
        compare_trl.refuse_stack_changes(["pandas", "Transformers>=99"], versions)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("")
    with pytest.raises(SystemExit, match=r"taken: it exists and is not a TRL environment made by --make-trl-env"):
        compare_trl.make_trl_env(tmp_path / "taken")


def test_trl_environment_over_this_interpreter_sees_its_packages(tmp_path):
    """The venv over this interpreter's environment, whatever it is (a venv or the base interpreter's), without
    TRL: torch, transformers and lit_grpo are this environment's."""
    env = compare_trl.running_environment(sys.executable)
    python = compare_trl.make_venv(tmp_path / "venv", sys.executable, env)
    _assert_this_environments_stack(_where(python, *compare_trl.STACK))
    assert env["versions"] == {name: importlib.metadata.version(name) for name in compare_trl.STACK}
