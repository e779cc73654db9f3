"""The `lit-grpo` CLI: one fit step end to end in a (forked) process, --print_config, and the GPU recipe's
consistency."""

import glob
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Optional

import forked_cli
import numpy as np
import pytest
import torch
import yaml

from lit_grpo.cli import build_cli, main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
GPU = str(ROOT / "configs" / "qwen3_1.7b_gpu.yaml")


def _refused(capsys, argv: list[str]) -> str:
    """What ``lit-grpo`` printed when it ended ``argv`` on a bad setting (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_fit_two_steps_end_to_end(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = tmp_path / "run"
    argv = ["fit", "--config", TINY, "--trainer.default_root_dir", str(root), "--trainer.max_steps", "2",
            "--data.steps_per_epoch", "2"]
    proc = forked_cli.run(argv, tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    events = glob.glob(str(root / "lightning_logs" / "version_0" / "events.out.tfevents.*"))
    assert len(events) == 1, list(root.rglob("*"))
    accumulator = EventAccumulator(events[0])
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    expected = {"train/loss", "train/clip_ratio_low", "train/clip_ratio_high", "train/entropy", "train/grad_norm",
                "reward/mean", "reward/std", "reward/frac_zero_std", "reward/accuracy/mean", "reward/format/mean",
                "reward/overlong/mean", "reward/char_fraction/mean", "completions/mean_length",
                "completions/min_length", "completions/max_length", "completions/clipped_ratio",
                "val/accuracy", "val/reward",
                # the callbacks of configs/tiny.yaml, on a real GRPO run
                "rollout/decode_steps", "rollout/lower_bound_steps", "rollout/slot_utilization",
                "rollout/prefill_tokens", "rollout/generated_tokens", "rollout/tokens_per_s", "rollout/wall_s",
                "rollout/peak_kv_bytes", "rollout/preempting", "rollout/decisions/start_arrival",
                "rollout/ms_per_step", "rollout/floor_ms_per_step", "rollout/roofline_ratio", "memory/step_peak_bytes",
                "memory/rollout_peak_bytes", "memory/update_peak_bytes",
                # the sampler against the update (logged with the correction off, its default)
                "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"}
    assert expected <= tags, expected - tags
    scalar = lambda key: accumulator.Scalars(key)[0].value  # noqa: E731
    assert scalar("rollout/decode_steps") >= scalar("rollout/lower_bound_steps")
    assert accumulator.Scalars("memory/rollout_peak_bytes")[0].value > 0
    # the decode step against its floor: the bytes it read over this machine's measured bandwidth
    for step, floor in enumerate(accumulator.Scalars("rollout/floor_ms_per_step")):
        ms_per_step = accumulator.Scalars("rollout/ms_per_step")[step].value
        assert floor.value > 0
        assert accumulator.Scalars("rollout/roofline_ratio")[step].value == pytest.approx(ms_per_step / floor.value,
                                                                                          rel=1e-5)
    # tiny.yaml's "infinite" runs the default scheduler: no length predictor, so no prediction figures; its first
    # rollout has seen no finished group, so it runs first come, first served
    assert not {tag for tag in tags if tag.startswith("rollout/length_pred")}
    assert accumulator.Scalars("rollout/decisions/start_arrival")[0].value > 0
    assert accumulator.Scalars("rollout/preempting")[0].value == 0.0
    assert "rollout/slot_timeline" in accumulator.Tags()["images"]
    assert accumulator.Tags()["histograms"] == ["completions/length"]
    assert [e.step for e in accumulator.Scalars("train/loss")] == [0, 1]
    assert accumulator.Scalars("train/grad_norm")[0].value > 0  # a real update happened
    assert list((root / "lightning_logs" / "version_0" / "checkpoints").glob("*.ckpt"))

    # one writer per key: every key exactly once per step (Lightning's own "epoch" and "hp_metric" aside). The
    # validations land on the same steps: before training at step 0, after step 2 where step 2's scalars are.
    assert {"memory/rollout_peak_delta_bytes", "memory/update_peak_delta_bytes"} <= tags
    for tag in tags - {"epoch", "hp_metric"}:
        assert [e.step for e in accumulator.Scalars(tag)] == [0, 1], tag
    # the run says what it did, and nothing else
    checkpoints = list((root / "lightning_logs" / "version_0" / "checkpoints").glob("*.ckpt"))
    assert [c.name for c in checkpoints] == ["last.ckpt"]
    out = proc.stdout
    assert "lit_grpo: 2 steps in" in out and "s per step" in out
    assert "val/accuracy" in out and "(before training -> after step 2)" in out
    assert "reward/mean" in out and "(first step -> last step)" in out and "rollout peak   KV cache" in out
    assert re.search(r"  decode floor   \d+\.\d\d ms a step \(its bytes at [\d.]+ [GMT]B/s\): [\d.]+ ms a step is "
                     r"[\d.]+ x it; \d+ tokens/s", out), out
    assert "tensorboard --logdir" in out and "last.ckpt (" in out
    # no ExportModel callback: the summary ends with the command that exports the checkpoint
    assert ("export         lit-grpo export --ckpt_path run/lightning_logs/version_0/checkpoints/last.ckpt --out "
            "run/lightning_logs/version_0/model") in out  # relative to the working directory
    for noise in ("LeafSpec", "Tip:", "IterableDataset"):
        assert noise not in proc.stdout + proc.stderr, noise


def test_a_run_without_validation_says_nothing_of_an_empty_loader(tmp_path):
    """``data.val_size: 0`` (the TRL port's setting) is no validation, on purpose: Lightning's warning of a
    validation loader of length zero is not shown."""
    proc = forked_cli.run(["fit", "--config", TINY, "--trainer.default_root_dir", str(tmp_path / "run"),
                           "--trainer.max_steps", "1", "--data.val_size", "0", "--trainer.logger", "false"],
                          tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lit_grpo: 1 step" in proc.stdout, proc.stdout[-3000:]
    assert "across ranks is zero" not in proc.stdout + proc.stderr, proc.stderr[-3000:]


def test_a_reward_functions_error_ends_the_run_with_its_own_frames_and_the_function_named(tmp_path):
    proc = forked_cli.run(["fit", "--config", TINY, "--trainer.default_root_dir", str(tmp_path / "run"),
                           "--trainer.max_steps", "1", "--data.reward_funcs", "[fault_helpers:lookup_reward]"],
                          tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = proc.stderr[proc.stderr.index("Traceback (most recent call last):"):]
    # the function's own frame and its error, then the message naming it and the prompt; none of lit_grpo's or
    # Lightning's frames, and the retry of a single group is not chained to the whole batch's error
    assert re.search(r'fault_helpers\.py", line \d+, in lookup_reward\n.*answers\[prompt\]', report), report
    assert "lightning" not in report and "lit_grpo" not in report and "During handling" not in report, report
    # it fails on every group: skipping the failing ones is no remedy, and the message says so
    assert re.search(r"\nerror: reward function 'lookup' raised KeyError: .* on prompt 0 '.+', and on each of the "
                     r"batch's other \d+ groups", report), report
    assert "tip: data.on_reward_error: skip_group" not in report, report


def test_a_reward_functions_bad_result_ends_the_run_naming_it_without_a_traceback(tmp_path):
    """A result of the wrong length is the function's error, said as one it raised would be: no frames of
    lit_grpo's or Lightning's, which point at nothing its author can fix."""
    (tmp_path / "short_rewards.py").write_text("def one_value(completions, **kwargs):\n    return [1.0]\n")
    proc = forked_cli.run(["fit", "--config", TINY, "--trainer.default_root_dir", str(tmp_path / "run"),
                           "--trainer.max_steps", "1", "--data.reward_funcs", "[short_rewards:one_value]"],
                          tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.rstrip().endswith("error: reward function 'one_value' returned 1 values for 4 completions; "
                                         "it must return one float (or None) per completion"), proc.stderr[-3000:]


def test_a_reward_function_in_the_working_folder_is_found_as_by_python_m(tmp_path, monkeypatch, capsys):
    """``lit-grpo`` is a console script, whose sys.path lacks the working folder: ``my_rewards:fn`` beside the
    config is imported all the same (the run here then stops at a later setting, which names itself)."""
    (tmp_path / "folder_rewards.py").write_text("def length(prompts, completions, **kwargs):\n"
                                                "    return [float(len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and os.path.abspath(p) != str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["fit", "--config", TINY, "--trainer.logger", "false", "--data.reward_funcs", "[folder_rewards:length]",
              "--data.accuracy_reward", "math"])
    err = capsys.readouterr().err
    assert "error: data.accuracy_reward='math' is not one of the reward functions' names ['length']" in err, err


def test_a_reward_function_that_fails_only_on_the_whole_batch_is_not_told_to_skip_groups(capsys):
    """Each group alone scores fine: skip_group would end the run the same way (it already did, here)."""
    from lit_grpo.cli.run_errors import _exit_on_reward_error
    from lit_grpo.rollout.rewards import RewardFunctionError, build_reward_funcs, score_rewards

    def batch_only(prompts, completions, **columns):
        if len(prompts) > 2:
            raise RuntimeError("too many at once")
        return [1.0] * len(prompts)

    with pytest.raises(RewardFunctionError) as error:
        score_rewards(build_reward_funcs([batch_only]), ["a", "a", "b", "b"], ["x"] * 4, group_size=2,
                      on_error="skip_group")
    with pytest.raises(SystemExit) as exit_info:
        _exit_on_reward_error(error.value)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "error: reward function 'batch_only' raised RuntimeError: too many at once on the whole batch" in err
    assert "skip_group" not in err, err


@pytest.mark.parametrize("fails_on, prompts, tip", [("everything", ["bad", "bad", "b", "b"], False),
                                                     ("bad", ["bad", "bad", "b", "b"], True),
                                                     ("bad", ["bad", "bad"], True)])
def test_the_skip_group_tip_is_shown_only_where_some_group_scores(capsys, fails_on, prompts, tip):
    """A function's own signature refusing the call (a required column the data lacks) fails every group alike, as
    a bug of its body does: skip_group would skip them all. One failing on a row's content gets the tip, also in a
    batch of that one group: skip_group stops a run only where no group of the run has scored yet."""
    from lit_grpo.cli.run_errors import _exit_on_reward_error
    from lit_grpo.rollout.rewards import RewardFunctionError, build_reward_funcs, score_rewards

    def needs_answer(prompts, completions, answer, **columns):
        return [1.0] * len(prompts)

    def picky(prompts, completions, **columns):
        if "bad" in prompts:
            raise ValueError("a bad row")
        return [1.0] * len(prompts)

    with pytest.raises(RewardFunctionError) as error:
        score_rewards(build_reward_funcs([needs_answer if fails_on == "everything" else picky]),
                      prompts, ["x"] * len(prompts), group_size=2)
    with pytest.raises(SystemExit):
        _exit_on_reward_error(error.value)
    err = capsys.readouterr().err
    assert ("tip: data.on_reward_error: skip_group" in err) is tip, err


def test_print_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", TINY, "--print_config", "--data.sampling.repetition_penalty", "1.2"])
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["data"]["sampling"]["repetition_penalty"] == 1.2
    assert config["model"]["model"] == "tiny-llama"
    assert config["data"]["sampling"]["group_size"] == 4 and config["data"]["curriculum"] == "none"
    assert config["model"]["loss"]["loss_type"] == "dapo" and config["model"]["sampler_correction"]["mode"] == "auto"


def test_help_says_what_the_tool_is(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "GRPO training of language models" in out and "Infinite Sampling" in out
    assert "lit-grpo fit --config configs/demo.yaml" in out and "Lightning Trainer command line tool" not in out
    assert "last.ckpt" in out and "ends with a summary" in out
    assert "lit-grpo export --ckpt_path CKPT --out DIR" in out


def test_help_names_the_command_lit_grpo_also_run_as_a_module(capsys, monkeypatch):
    """``python -m lit_grpo.cli`` has ``__main__.py`` as its program name: the usage names the console script."""
    import lit_grpo.cli.__main__ as as_module

    monkeypatch.setattr(sys, "argv", [as_module.__file__])
    for argv, usage in ((["--help"], "usage: lit-grpo [-c CONFIG] {fit,validate}"),
                        (["fit", "--help"], "usage: lit-grpo [options] fit [-c CONFIG]")):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert out.startswith(usage) and "__main__" not in out


#: Run in a fresh interpreter: ``lit_grpo.cli.main`` from ``import lit_grpo.cli`` on, as the console script runs it,
#: noting what the garbage collector did meanwhile; one JSON line, printed by the first atexit handler registered
#: (so the last to run).
COLLECTOR_PROBE = r"""
import atexit, gc, json, sys
report = {"collections_while_importing": 0}
atexit.register(lambda: print(json.dumps({**report, "frozen_at_exit": gc.get_freeze_count() > frozen}), flush=True))
importing = False
def note(phase, info):
    command = sys.modules.get("lit_grpo.cli.command")
    if phase == "start" and importing and not hasattr(command, "main"):  # main: command.py's last definition
        report["collections_while_importing"] += 1
gc.callbacks.append(note)
import lit_grpo.cli
report["torch_before_main"] = "torch" in sys.modules
importing = True
try:
    lit_grpo.cli.main(["--help"])
except SystemExit:
    pass
frozen = gc.get_freeze_count()
report.update(enabled_after=gc.isenabled(), frozen_by_main=frozen > 0)
"""


def test_the_command_imports_its_packages_with_the_collector_paused_and_freezes_them(tmp_path):
    """torch, Lightning and transformers are imported by ``main``, not by ``import lit_grpo.cli``, with Python's
    cyclic garbage collector paused meanwhile (and on again after), then frozen, and at exit what is alive then is
    frozen before the interpreter's final collections: no collection walks them all again."""
    proc = subprocess.run([sys.executable, "-c", COLLECTOR_PROBE], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"collections_while_importing": 0, "torch_before_main": False, "enabled_after": True,
                      "frozen_by_main": True, "frozen_at_exit": True}, proc.stderr[-4000:]


def test_two_differently_configured_forecasts_work_and_identical_ones_are_named(tmp_path):
    base = ["--config", TINY, "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.callbacks+=lit_grpo.callbacks.RewardForecast"]
    cli = build_cli([*base, "--trainer.callbacks.monitor=val/reward"], run=False)
    forecasts = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == "RewardForecast"]
    assert len(forecasts) == 2 and forecasts[0].state_key != forecasts[1].state_key
    with pytest.raises(ValueError, match=r"two RewardForecast callbacks with the same settings \(RewardForecast\{"):
        build_cli(base, run=False)


def test_unknown_key_is_rejected(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", TINY, "--model.no_such_key", "1"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "no_such_key" in err and "did you mean" not in err


def test_a_misspelled_key_names_the_one_it_meant_without_the_usage_listing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", TINY, "--data.sampling.group_sise", "4"])
    err = capsys.readouterr().err
    assert "--data.sampling.group_sise 4 (did you mean 'data.sampling.group_size'?)" in err
    assert "usage:" not in err and "fit --help" in err
    config = yaml.safe_load(Path(TINY).read_text())
    config["trainer"]["max_step"] = config["trainer"].pop("max_steps")
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(tmp_path / "typo.yaml")])
    assert "option 'trainer.max_step' (did you mean 'trainer.max_steps'?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --print_config: the root parser reports it, relative to the group
        main(["fit", "--config", str(tmp_path / "typo.yaml"), "--print_config"])
    assert "option 'max_step' (did you mean 'trainer.max_steps'?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # several: each named
        main(["fit", "--config", TINY, "--data.sampling.group_sise", "4", "--model.lrr", "1", "--zzz", "1"])
    assert ("(did you mean 'data.sampling.group_size' for 'data.sampling.group_sise', 'model.lr' for 'model.lrr'?)"
            in capsys.readouterr().err)


@pytest.mark.parametrize("args, meant", [
    (["--model.beta", "0.04"], "model.loss.beta"),  # not taken for model.betas, its prefix
    (["--data.temperature", "0.7"], "data.sampling.temperature"),  # not data.val_temperature
    (["--data.max_new_tokens", "64"], "data.sampling.max_new_tokens"),
    (["--num_generations", "4"], "data.sampling.group_size"),  # TRL's names
    (["--model.learning_rate", "1e-5"], "model.lr"),
    (["--model.loss.epsilon", "0.2"], "model.loss.epsilon_low"),
    (["--model.loss.use_bias_correction_kl", "true"], "model.loss.kl_bias_correction"),
    (["--model.reward_weights", "[1.0]"], "data.reward_funcs"),
    (["--model.adam_beta2", "0.999"], "model.betas"),
    (["--model.lr_scheduler_type", "linear"], "model.lr_schedule"),
    (["--model.sync_ref_model", "true"], "model.reference_sync"),
    (["--model.vllm_importance_sampling_mode", "token_mask"], "model.sampler_correction.mode"),
    (["--model.vllm_importance_sampling_clip_max", "2.0"], "model.sampler_correction.clip_max"),
    (["--model.vllm_importance_sampling_correction", "false"], "model.sampler_correction.mode"),
    (["--model.ref_model_sync_steps", "64"], "model.reference_sync"),
    (["--bf16", "true"], "trainer.precision"),
    (["--output_dir", "out"], "trainer.default_root_dir"),
    (["--shuffle_dataset", "false"], "data.curriculum"),
    # TRL's ModelConfig and ScriptArguments names, which its own CLI reads from the same flat config
    (["--model_name_or_path", "tiny-qwen2"], "model.model"),
    (["--dataset_name", "train.jsonl"], "data.dataset"),
    (["--dataset_train_split", "train"], "data.split"),
    (["--resume_from_checkpoint", "true"], "ckpt_path"),
    (["--seed", "1"], "seed_everything"),  # TRL's seed is the global one, not the sampler's data.sampling.seed
    (["--random_state", "3407"], "seed_everything"),  # Unsloth's get_peft_model's seed, which its notebooks set
    (["--data.seed", "1"], "data.sampling.seed"),  # a nested key keeps its section's meaning
    # a mapping put in the wrong section: its own key, not the key inside it
    (["--chat_template_kwargs.enable_thinking", "false"], "data.chat_template_kwargs")])
def test_a_setting_under_another_section_or_trls_name_points_to_lit_grpos(capsys, args, meant):
    with pytest.raises(SystemExit):
        main(["fit", "--config", TINY, *args])
    assert f"unrecognized arguments: {' '.join(args)} (did you mean '{meant}'?)" in capsys.readouterr().err


@pytest.mark.parametrize("args, meant, note", [
    (["--model.warmup_ratio", "0.1"], "model.warmup_steps",
     "TRL's warmup_ratio is a share of the optimizer steps, model.warmup_steps a count of them"),
    (["--lora_r", "8"], "model.peft_config", "TRL's lora_r is r in model.peft_config"),
])
def test_a_trl_name_on_the_command_line_points_to_lit_grpos_and_says_how_it_differs(capsys, args, meant, note):
    with pytest.raises(SystemExit):
        main(["fit", "--config", TINY, *args])
    assert f"unrecognized arguments: {' '.join(args)} (did you mean '{meant}'? {note}" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--per_device_train_batch_size", "8"],
                                  ["--model.per_device_train_batch_size", "8"]])
def test_trls_per_device_train_batch_size_points_to_the_micro_batch_and_the_prompts_a_step_draws(capsys, args):
    # in TRL it also decides how many prompts a step draws: pointing to the micro-batch alone halves a port
    with pytest.raises(SystemExit):
        main(["fit", "--config", TINY, *args])
    err = capsys.readouterr().err
    assert "(did you mean 'model.train_micro_batch_size'?" in err, err
    # the prompts of a generation, a rollout here: steps_per_generation of its optimizer steps, not one's
    assert ("per_device_train_batch_size x steps_per_generation (gradient_accumulation_steps when unset) x "
            "processes / num_generations" in err and "data.prompts_per_step prompts x data.sampling.group_size" in err
            and "model.num_mini_batches" in err), err


@pytest.mark.parametrize("yaml_text, message", [
    ("use_vllm: true", "option 'use_vllm' (TRL's use_vllm has no counterpart: rollouts run on lit_grpo's own engine"),
    ("model:\n  vllm_gpu_memory_utilization: 0.3", "option 'model.vllm_gpu_memory_utilization' (TRL's "
                                                   "vllm_gpu_memory_utilization has no counterpart"),
    ("model:\n  gradient_accumulation_steps: 4",
     "(TRL's gradient_accumulation_steps has no counterpart: a mini-batch's micro-batches, "
     "model.train_micro_batch_size completions each, all accumulate into its optimizer step; "
     "model.num_mini_batches is steps_per_generation / gradient_accumulation_steps)"),
    ("generation_batch_size: 64", "(TRL's generation_batch_size has no counterpart: a rollout is "
                                  "data.prompts_per_step prompts x data.sampling.group_size completions on each "
                                  "process, cut into model.num_mini_batches optimizer steps)"),
    # TRL counts these in optimizer steps, Lightning's keys in training steps (rollouts)
    ("eval_steps: 8", "(did you mean 'trainer.val_check_interval'? TRL's eval_steps counts optimizer steps, "
                      "trainer.val_check_interval training steps: eval_steps / (model.num_mini_batches x "
                      "model.num_iterations), with trainer.check_val_every_n_epoch: null)"),
    ("logging_steps: 8", "(did you mean 'trainer.log_every_n_steps'? TRL's logging_steps counts optimizer steps, "
                         "trainer.log_every_n_steps training steps: logging_steps / (model.num_mini_batches x "
                         "model.num_iterations))"),
    ("save_steps: 100", "(TRL's save_steps is RunCheckpoint's every_n_train_steps here, in trainer.callbacks)"),
    ("report_to: tensorboard", "option 'report_to' (did you mean 'trainer.logger'? TRL's report_to names "
                               "integrations, trainer.logger takes Lightning loggers"),
    # Unsloth's GRPO notebooks set these: an 8-bit optimizer, a warm-up as a share of the steps, its model's length
    ("optim: adamw_8bit", "option 'optim' (TRL's optim has no counterpart: the optimizer is torch's AdamW (fused on "
                          "a GPU), from model.lr, model.betas and model.weight_decay; no 8-bit or paged one)"),
    ("warmup_ratio: 0.1", "(did you mean 'model.warmup_steps'? TRL's warmup_ratio is a share of the optimizer "
                          "steps, model.warmup_steps a count of them: warmup_ratio x trainer.max_steps)"),
    # TRL's LoRA fields are one peft LoraConfig here: each says its field's name in it
    ("lora_r: 16", "(did you mean 'model.peft_config'? TRL's lora_r is r in model.peft_config, peft's LoraConfig "
                   "fields: {r: 16, lora_alpha: 32, lora_dropout: 0.0, target_modules: [q_proj, v_proj]})"),
    ("lora_target_modules: [q_proj]", "(did you mean 'model.peft_config'? TRL's lora_target_modules is "
                                      "target_modules in model.peft_config, peft's LoraConfig fields: "),
    ("lora_target_parameters: [mlp.experts.down_proj]", "(did you mean 'model.peft_config'? TRL's "
                                                         "lora_target_parameters is target_parameters in "
                                                         "model.peft_config, peft's LoraConfig fields: "),
    ("use_peft: true", "(did you mean 'model.peft_config'? TRL's use_peft is a model.peft_config given, peft's "
                       "LoraConfig fields: "),
    ("max_seq_length: 1024", "option 'max_seq_length' (Unsloth's max_seq_length has no counterpart: no prompt is "
                             "cut or filtered; one whose tokens and data.sampling.max_new_tokens pass the model's "
                             "max_position_embeddings is refused before the first step, naming its row)"),
    # not taken for data.task_config, a key spelled alike that means something else
    ("dataset_config: main", "option 'dataset_config' (TRL's dataset_config has no counterpart: data.dataset reads"),
    ("model:\n  model_init_kwargs: {torch_dtype: bfloat16}", "option 'model.model_init_kwargs.torch_dtype' (did you "
                                                             "mean 'model.dtype'?)"),
    # a known section's unknown key is not taken for the section itself
    ("model:\n  no_such_key: 1", "option 'model.no_such_key'\n"),
])
def test_trls_settings_without_a_key_here_say_what_takes_their_place(capsys, tmp_path, yaml_text, message):
    config = tmp_path / "trl.yaml"
    config.write_text(yaml_text + "\n")
    assert message in _refused(capsys, ["fit", "--config", TINY, "--config", str(config)])


@pytest.mark.parametrize("yaml_text, meant", [
    # the parser stops at the first; a port of TRL's flat config would be fixed one key per run
    ("model_name_or_path: tiny-llama\nlearning_rate: 1.0e-5\nmodel:\n  loss: {epsilon: 0.2}\n"
     "report_to: tensorboard\ntrainer:\n  callbacks: [{class_path: lit_grpo.callbacks.RolloutProfiler, "
     "init_args: {}}]\n",
     ["'model_name_or_path' (did you mean 'model.model'?)", "'learning_rate' (did you mean 'model.lr'?)",
      "'model.loss.epsilon' (did you mean 'model.loss.epsilon_low'?)",
      "'report_to' (did you mean 'trainer.logger'? TRL's report_to names integrations"]),
    # verl's keys sit in sections lit_grpo has not (actor_rollout_ref.actor.optim): each is named with its hint
    ("actor_rollout_ref:\n  actor:\n    optim: {lr: 1.0e-6}\n    ppo_mini_batch_size: 2\n"
     "  rollout: {n: 4}\ncustom_reward_function: {path: my_reward.py, name: compute_score}\n"
     "trainer:\n  total_training_steps: 2\n",
     ["'actor_rollout_ref.actor.optim.lr' (did you mean 'model.lr'?",
      "'actor_rollout_ref.actor.ppo_mini_batch_size' (verl's ppo_mini_batch_size is model.num_mini_batches",
      "'actor_rollout_ref.rollout.n' (did you mean 'data.sampling.group_size'?",
      "'custom_reward_function.path' (verl's custom_reward_function is an entry of data.reward_funcs",
      "'custom_reward_function.name' (verl's custom_reward_function is an entry of data.reward_funcs",
      "'trainer.total_training_steps' (did you mean 'trainer.max_steps'?"]),
], ids=["trl_flat", "verl_nested"])
def test_a_config_with_several_unknown_keys_names_them_all(capsys, tmp_path, yaml_text, meant):
    config = tmp_path / "port.yaml"
    config.write_text(yaml_text)
    err = _refused(capsys, ["fit", "--config", TINY, "--config", str(config)])
    assert err.count(f"\n{config} also holds these unknown keys:\n  '") == 1, err
    for key in meant:  # each named once: the parser's first in its error line, the others one a line after it
        assert err.count(key) == 1, err
    assert "trainer.callbacks" not in err  # a class's own keys are its settings, not options


@pytest.mark.parametrize("path", sorted(Path(TINY).parent.glob("*.yaml")))
def test_the_configs_keys_are_all_known_to_the_account_of_unknown_ones(capsys, tmp_path, path):
    config = tmp_path / "one_unknown.yaml"
    config.write_text(path.read_text() + "\nno_such_key: 1\n")
    err = _refused(capsys, ["fit", "--config", str(config)])
    assert "option 'no_such_key'" in err and "also holds" not in err, err


@pytest.mark.parametrize("path", sorted(Path(TINY).parent.glob("*.yaml")))
def test_every_config_passes_the_parsers_type_and_choice_checks(capsys, path):
    """``--print_config`` parses a config whole (types, choices, class paths) without building anything; an unknown
    key, which the test above adds, would hide a bad value from it."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--print_config"])
    out, err = capsys.readouterr()
    assert exit_info.value.code in (0, None), err[-4000:]
    assert yaml.safe_load(out)["model"]["model"], out


@pytest.mark.parametrize("yaml_text, message", [
    ("model:\n  scale_rewards: true", "Got value: True (TRL's scale_rewards: true is 'group' here)\n"),
    ("model:\n  scale_rewards: false", "Got value: False (TRL's scale_rewards: false is 'none' here)\n"),
    ("model:\n  lr_schedule: cosine_with_min_lr", "(TRL's lr_scheduler_type cosine_with_min_lr is 'cosine' here, "
                                                   "down to model.min_lr_ratio)\n"),
    ("model:\n  scale_rewards: grp", "Got value: grp\n"),  # no TRL value: the choices alone
])
def test_trls_values_spelled_otherwise_here_say_what_they_are(capsys, tmp_path, yaml_text, message):
    config = tmp_path / "trl.yaml"
    config.write_text(yaml_text + "\n")
    err = _refused(capsys, ["fit", "--config", TINY, "--config", str(config)])
    assert message in err and "Expected a typing.Literal[" in err, err


@pytest.mark.parametrize("value, share", [("0.1", True), ("10.5", False), ("ten", False)])
def test_a_warmup_given_as_trls_share_of_the_steps_says_that_warmup_steps_counts_them(capsys, tmp_path, value,
                                                                                        share):
    """transformers 5's warmup_steps below 1 is a share of the steps; a fraction above 1, or no number, is refused
    without that word."""
    config = tmp_path / "trl.yaml"
    config.write_text(f"model:\n  warmup_steps: {value}\n")
    err = _refused(capsys, ["fit", "--config", TINY, "--config", str(config)])
    hint = (" (model.warmup_steps is a count of optimizer steps; TRL's warmup_ratio, a share of them, is "
            "warmup_ratio x trainer.max_steps)")
    assert f"Got value: {value}{hint if share else ''}\n" in err, err


@pytest.mark.parametrize("given", ["yaml", "option"])
def test_a_warmup_count_written_as_a_float_is_that_count(capsys, tmp_path, given):
    """transformers' TrainingArguments takes warmup_steps: 10.0 as 10 steps: so does model.warmup_steps, from a
    config file and from the command line, and the config it saves holds the integer."""
    config = tmp_path / "trl.yaml"
    config.write_text("model:\n  warmup_steps: 10.0\n")
    setting = ["--config", str(config)] if given == "yaml" else ["--model.warmup_steps", "10.0"]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", TINY, *setting, "--print_config"])
    assert exit_info.value.code in (0, None)
    saved = yaml.safe_load(capsys.readouterr().out)["model"]["warmup_steps"]
    assert saved == 10 and type(saved) is int, saved


def test_another_classs_setting_named_warmup_steps_keeps_its_value(capsys, tmp_path, monkeypatch):
    """Only model.warmup_steps is a count of TRL's: a callback's own warmup_steps, text here, is its value as given."""
    (tmp_path / "user_warmup_callback.py").write_text(textwrap.dedent("""\
        from lightning.pytorch import Callback

        class Warmup(Callback):
            def __init__(self, warmup_steps: str = "none"):
                self.warmup_steps = warmup_steps
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", TINY, "--trainer.callbacks+=user_warmup_callback.Warmup",
              "--trainer.callbacks.warmup_steps", "10.0", "--print_config"])
    assert exit_info.value.code in (0, None)
    [callback] = [c for c in yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]
                  if c["class_path"].endswith("Warmup")]
    assert callback["init_args"]["warmup_steps"] == "10.0", callback


@pytest.mark.parametrize("yaml_text, message", [
    # verl's names (its ppo_trainer.yaml's last key parts) point to lit_grpo's keys
    ("data:\n  train_batch_size: 16", "option 'data.train_batch_size' (did you mean 'data.prompts_per_step'? "),
    ("model:\n  loss:\n    clip_ratio_c: 3.0", "(did you mean 'model.loss.delta'?)"),
    ("model:\n  loss_agg_mode: token-mean", "(did you mean 'model.loss.loss_type'?)"),
    ("data:\n  max_response_length: 64", "(did you mean 'data.sampling.max_new_tokens'?)"),
    ("model:\n  ppo_epochs: 2", "(did you mean 'model.num_iterations'?)"),
    # where verl counts otherwise, how: rollouts against optimizer steps, every GPU's prompts against one rank's
    ("trainer:\n  total_training_steps: 100", "(did you mean 'trainer.max_steps'? verl's total_training_steps "
                                              "counts rollouts, trainer.max_steps optimizer steps: rollouts x "
                                              "model.num_iterations x model.num_mini_batches)"),
    ("model:\n  lr_warmup_steps: 10", "(did you mean 'model.warmup_steps'? verl's lr_warmup_steps counts rollouts, "
                                      "model.warmup_steps optimizer steps: rollouts x model.num_iterations x "
                                      "model.num_mini_batches)"),
    ("data:\n  train_batch_size: 16", "(did you mean 'data.prompts_per_step'? verl's train_batch_size counts the "
                                      "prompts of every GPU, data.prompts_per_step those of one rank: "
                                      "train_batch_size / ranks)"),
    ("trainer:\n  save_freq: 10", "(verl's save_freq is RunCheckpoint's every_n_train_steps here, in "
                                  "trainer.callbacks, counting optimizer steps: verl's rollouts x "
                                  "model.num_iterations x model.num_mini_batches)"),
    # or say what takes the place of one without a key here
    ("algorithm:\n  adv_estimator: grpo", "option 'algorithm.adv_estimator' (verl's adv_estimator has no counterpart: "
                                           "GRPO's group advantages are the only estimator)"),
    # verl's data.max_prompt_length, and TRL's in a flat config (its older GRPOConfig's, which Unsloth's notebooks
    # set): the note names both, right for either
    ("data:\n  max_prompt_length: 512", "(verl's and TRL's max_prompt_length (an older TRL GRPOConfig's, which "
                                        "Unsloth's notebooks set; TRL 1.16 has none) has no counterpart: no prompt "
                                        "is cut"),
    ("max_prompt_length: 256", "option 'max_prompt_length' (verl's and TRL's max_prompt_length (an older TRL "
                               "GRPOConfig's, which Unsloth's notebooks set; TRL 1.16 has none) has no counterpart"),
    ("model:\n  ppo_mini_batch_size: 256", "(verl's ppo_mini_batch_size is model.num_mini_batches here, counted "
                                           "otherwise: train_batch_size / ppo_mini_batch_size optimizer steps"),
    # a key inside verl's section (its file's path, its function's name): the section's note
    ("custom_reward_function:\n  path: my_reward.py", "option 'custom_reward_function.path' (verl's "
                                                       "custom_reward_function is an entry of data.reward_funcs here"),
    # a value of verl's for a setting lit_grpo spells otherwise
    ("model:\n  loss: {loss_type: seq-mean-token-mean}",
     "Got value: seq-mean-token-mean (verl's loss_agg_mode seq-mean-token-mean is 'grpo' here)\n"),
])
def test_verls_settings_point_to_lit_grpos_or_say_what_takes_their_place(capsys, tmp_path, yaml_text, message):
    config = tmp_path / "verl.yaml"
    config.write_text(yaml_text + "\n")
    err = _refused(capsys, ["fit", "--config", TINY, "--config", str(config)])
    assert message in err, err


def test_a_validation_interval_past_the_epoch_names_both_and_the_setting_that_counts_over_the_run(capsys):
    # verl's test_freq written as val_check_interval in a config that validates within each epoch (tiny.yaml's)
    err = _refused(capsys, ["fit", "--config", TINY, "--trainer.val_check_interval", "5"])
    assert ("trainer.val_check_interval=5 is more than an epoch's 2 training steps (data.steps_per_epoch) while "
            "trainer.check_val_every_n_epoch=1 counts it within each epoch: set trainer.check_val_every_n_epoch: "
            "null to validate every 5 training steps of the run, or val_check_interval <= 2") in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [["--optimizer", "SGD"], ["--lr_scheduler", "StepLR"]])
def test_lightnings_optimizer_options_are_not_offered(capsys, args):
    # GRPOModule builds its own optimizer from model.lr and friends: Lightning's would be parsed, then ignored
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", TINY, *args])
    assert exit_info.value.code != 0
    assert f"unrecognized arguments: {' '.join(args)}" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    # a class names its own field; the message names it by its full key
    (["--data.sampling.group_size", "0"], "error: data.sampling.group_size=0 must be an integer >= 1"),
    (["--data.val_size", "-1"], "error: data.val_size=-1 must be a count >= 0 or a fraction in [0, 1)"),
    (["--model.loss.epsilon_low", "-1"], "error: model.loss.epsilon_low=-1.0 is not allowed; epsilon_low must be a "
                                         "finite number >= 0 and < 1"),
    # a negative number in exponent notation is the value, not an option of its own
    (["--model.lr", "-1e-5"], "error: model.lr=-1e-05 is not allowed; lr must be a finite number > 0"),
    (["--model.loss.top_entropy_quantile", "1.5"], "error: model.loss.top_entropy_quantile=1.5 is not allowed; "
                                                   "top_entropy_quantile must be a finite number >= 0 and <= 1"),
    (["--model.betas", "[0.9, 1.5]"], "error: model.betas=[0.9, 1.5] must be two numbers in [0, 1)"),
    (["--trainer.gradient_clip_val", "1.0"], "error: trainer.gradient_clip_val=1.0 does not apply to GRPOModule"),
    (["--trainer.gradient_clip_algorithm", "value"], "error: trainer.gradient_clip_algorithm='value' does not apply "
                                                     "to GRPOModule"),
    (["--trainer.limit_train_batches", "0"], "error: trainer.limit_train_batches=0 trains no step"),
    (["--data.accuracy_reward", "mathh"], "error: data.accuracy_reward='mathh' is not one of the reward functions'"),
    (["--seed_everything", "-1"], "error: seed_everything=-1: -1 is not in bounds, numpy accepts from 0 to "),
    (["--data.sampling.seed", "-1"],
     "error: data.sampling.seed=-1 is not allowed; sampling.seed must be an integer >= 0"),
    (["--data.reward_funcs", "[{name: char_fraction, weight: 1e39}]"],
     "error: data.reward_funcs: reward weight=1e+39 for 'char_fraction' must be a finite number, "
     "|weight| <= 3.403e+38"),
    # a function of the user's is named as it is logged, not as its repr (<function ... at 0x...>)
    (["--data.reward_funcs", "[{name: 'fault_helpers:lookup_reward', weight: heavy}]"],
     "error: data.reward_funcs: reward weight='heavy' for 'lookup' must be a finite number"),
    (["--data.jsonl_path", "/", "--data.task", "null"], "error: data: prompt file '/' is a folder (jsonl_path)"),
    (["--model.dtype", "float13"], "error: model.dtype='float13' is not known; use one of ['bf16', 'bfloat16'"),
    # an optional group's own reason, not jsonargparse's account of each type of the Union
    (["--model.loss.beta", "0.1", "--model.reference_sync", "{every_n_steps: 0}"],
     "error: model.reference_sync.every_n_steps=0 must be an integer >= 1 (or model.reference_sync: null)\n"),
    # Lightning's own refusals and a YAML list where a mapping belongs are said alike
    (["--trainer.max_steps", "-5"], "error: MisconfigurationException: `max_steps` must be a non-negative integer"),
])
def test_a_bad_value_ends_the_command_with_its_message_not_a_traceback(capsys, args, message):
    err = _refused(capsys, ["fit", "--config", TINY, "--trainer.logger", "false", *args])
    assert err.startswith(message) and "Traceback" not in err and "lit-grpo fit --help" in err


def test_an_unknown_option_of_an_optional_group_is_named_alone(capsys):
    err = _refused(capsys, ["fit", "--config", TINY, "--model.loss.beta", "0.1", "--model.reference_sync",
                            "{every: 2}"])
    assert "error: model.reference_sync: Option 'every' is not accepted (or model.reference_sync: null)\n" in err, err
    assert "Union" not in err and "Given value" not in err


@pytest.mark.parametrize("args, message", [
    # an optional number keeps the value it was given
    (["--model.max_grad_norm", "abc"],
     "error: model.max_grad_norm: Expected a <class 'float'>. Got value: abc (or model.max_grad_norm: null)\n"),
    # a group given as a whole (not optional itself) is named with the optional setting in it that is bad
    (["--model.sampler_correction", "{clip_max: abc}"],
     "error: model.sampler_correction.clip_max: Expected a <class 'float'>. Got value: abc "
     "(or model.sampler_correction.clip_max: null)\n"),
    (["--data.sampling.scheduler", "{length_aware: {refill: bogus}}"],
     "error: data.sampling.scheduler.length_aware.refill: Expected a typing.Literal['lpt', 'sjf', 'fifo']. Got "
     "value: bogus (or data.sampling.scheduler.length_aware: null)\n"),
    # several types, each saying only what it expects: one line naming them all
    (["--data.sampling.micro_group_size", "all"],
     "error: data.sampling.micro_group_size: Expected a <class 'int'> or typing.Literal['auto']. Got value: all "
     "(or data.sampling.micro_group_size: null)\n"),
    # one item where a list belongs (TRL's reward_funcs=fn): how to write it as a list
    (["--data.reward_funcs", "my_rewards:fn"],
     "error: data.reward_funcs: Expected a <class 'list'>. Got value: my_rewards:fn; for one item, write "
     "[my_rewards:fn] (or data.reward_funcs: null)\n"),
    # an option a group's class does not take, with the one it most likely meant
    (["--data.sampling.scheduler.length_aware", "{predictr: oracle}"],
     "error: data.sampling.scheduler.length_aware: Option 'predictr' is not accepted (did you mean 'predictor'?) "
     "(or data.sampling.scheduler.length_aware: null)\n"),
])
def test_an_optional_settings_reason_names_its_whole_key_and_the_value(capsys, args, message):
    err = _refused(capsys, ["fit", "--config", TINY, *args])
    assert message in err, err


@pytest.mark.parametrize("callbacks, args, message", [
    ("- class_path: lit_grpo.callbacks.RewardForecast\n  init_args: {patiense: 3}", [],
     "error: trainer.callbacks: lit_grpo.callbacks.RewardForecast: Option 'patiense' is not accepted (did you mean "
     "'patience'?)\n"),
    ("- class_path: lit_grpo.callbacks.RewardForcast", [],
     "error: trainer.callbacks: lit_grpo.callbacks.RewardForcast: module 'lit_grpo.callbacks' has no attribute "
     "'RewardForcast' (did you mean 'lit_grpo.callbacks.RewardForecast'?)\n"),
    (None, ["--trainer.callbacks+=lit_grpo.callbacks.RewardForecast", "--trainer.callbacks.patiense=3"],
     "error: trainer.callbacks: lit_grpo.callbacks.RewardForecast: Option 'patiense' is not accepted (did you mean "
     "'patience'?)\n"),
    # one callback, not a list: its own reason, not the list's "Expected a <class 'list'>"
    (None, ["--trainer.callbacks", "{class_path: lit_grpo.callbacks.FitSummary, init_args: {windo: 2}}"],
     "error: trainer.callbacks: lit_grpo.callbacks.FitSummary: Option 'windo' is not accepted (did you mean "
     "'window'?)\n"),
    (None, ["--trainer.callbacks", "3"], "error: trainer.callbacks: Expected a dot import path string: 3\n"),
    # a short name (without its module) is matched against the callbacks a short name may give
    (None, ["--trainer.callbacks+=RewardForcast"],
     "error: trainer.callbacks: Expected a dot import path string: RewardForcast (did you mean 'RewardForecast'?)\n"),
    ("- class_path: RewardForcast", [],
     "error: trainer.callbacks: Expected a dot import path string: RewardForcast (did you mean 'RewardForecast'?)\n"),
    # an entry after one read well: named by its own value, not by the entry before it
    ("- class_path: FitSummary\n- class_path: RewardForcast", [],
     "error: trainer.callbacks: Expected a dot import path string: RewardForcast (did you mean 'RewardForecast'?)\n"),
    ("- class_path: FitSummary\n- class_path: lightning.pytorch.Trainer", [],
     "error: trainer.callbacks: Import path lightning.pytorch.Trainer does not correspond to a subclass of "
     "Callback\n"),
    # refused by the callback itself, when the list is built
    (None, ["--trainer.callbacks+=lit_grpo.callbacks.RewardForecast", "--trainer.callbacks.patience=-1"],
     "error: trainer.callbacks: lit_grpo.callbacks.RewardForecast.patience=-1 must be an integer >= 1\n"),
    # a value of the wrong type for a callback's setting: the setting named inside its class, the value, the type
    (None, ["--trainer.callbacks+=RewardForecast", "--trainer.callbacks.stop=maybe"],
     "error: trainer.callbacks: lit_grpo.callbacks.RewardForecast.stop: Expected a <class 'bool'>. Got value: "
     "maybe\n"),
    ("- class_path: FitSummary\n- class_path: RewardForecast\n  init_args: {criterion: aicc}", [],
     "error: trainer.callbacks: lit_grpo.callbacks.RewardForecast.criterion: Expected a typing.Literal['aic', "
     "'bic']. Got value: aicc\n"),
    (None, ["--trainer.callbacks+=RewardForecast", "--trainer.callbacks.reward_range=[0, a]"],
     "error: trainer.callbacks: lit_grpo.callbacks.RewardForecast.reward_range: Expected a <class 'float'>. Got "
     "value: a (or lit_grpo.callbacks.RewardForecast.reward_range: null)\n"),
])
def test_a_bad_callback_is_named_by_its_class_not_by_every_type_of_the_callbacks_union(capsys, tmp_path, callbacks,
                                                                                        args, message):
    if callbacks is not None:
        config = tmp_path / "callbacks.yaml"
        config.write_text("trainer:\n  callbacks:\n" + textwrap.indent(callbacks, "    ") + "\n")
        args = ["--config", str(config)]
    err = _refused(capsys, ["fit", "--config", TINY, "--trainer.logger", "false", *args])
    assert message in err, err
    assert "Union" not in err and "Subclass types" not in err and "Given value" not in err, err
    assert "Parser key" not in err, err


@pytest.mark.parametrize("args, message", [
    (["--trainer.logger", "TensorBoardLoger"],
     "error: trainer.logger: Expected a dot import path string: TensorBoardLoger (did you mean "
     "'TensorBoardLogger'?)\n"),
    (["--trainer.logger", "TensorBoardLogger", "--trainer.logger.save_dirr", "runs"],
     "error: trainer.logger: lightning.pytorch.loggers.TensorBoardLogger: Option 'save_dirr' is not accepted (did you "
     "mean 'save_dir'?)\n"),
    # a list of loggers: the reason of the entry at fault, not the lone class's refusal of a list
    (["--trainer.logger", "[{class_path: TensorBoardLogger}, {class_path: CSVLoger}]"],
     "error: trainer.logger: Expected a dot import path string: CSVLoger (did you mean 'CSVLogger'?)\n"),
])
def test_a_bad_logger_is_named_by_its_class_as_a_callback_is(capsys, args, message):
    err = _refused(capsys, ["fit", "--config", TINY, *args])
    assert message in err, err
    assert "Union" not in err and "Given value" not in err, err


def test_an_optional_setting_inside_an_optional_group_is_named_by_its_whole_key(capsys):
    """The group's inner parser leaves its message to the group's, which holds the setting's own Union: read
    there, once."""
    with pytest.raises(SystemExit):
        main(["fit", "--config", TINY, "--data.sampling.scheduler.length_aware.gain_z", "abc"])
    err = capsys.readouterr().err
    assert ("error: data.sampling.scheduler.length_aware.gain_z: Expected a <class 'float'>. Got value: abc (or "
            "data.sampling.scheduler.length_aware.gain_z: null)\n") in err, err
    assert "Union" not in err and "Given value" not in err


@pytest.mark.parametrize("yaml, message", [
    ("data:\n  sampling: [4, 2]", "error: data.sampling=[4, 2] must be a mapping of its settings by name (group_size, "
                                  "micro_group_size, kv_budget_bytes, strategy, ...), not a list"),
    ("data:\n  sampling:\n    scheduler: [4]", "error: data.sampling.scheduler=[4] must be a mapping of its "
                                               "settings by name (preempt_tokens, park_budget, loss_share, "
                                               "length_aware), not a list"),
    ("model:\n  loss: [grpo]", "error: model.loss=['grpo'] must be a mapping of its settings by name"),
])
def test_a_list_for_a_group_of_settings_is_refused_not_taken_positionally(capsys, tmp_path, yaml, message):
    config = tmp_path / "config.yaml"
    config.write_text(yaml + "\n")
    err = _refused(capsys, ["fit", "--config", TINY, "--config", str(config), "--trainer.logger", "false"])
    assert err.startswith(message) and "Traceback" not in err


@pytest.mark.parametrize("key, value, instead", [("gradient_clip_val", "1.0", "model.max_grad_norm"),
                                                 ("accumulate_grad_batches", "4", "model.train_micro_batch_size")])
def test_lightnings_clipping_and_accumulation_name_the_modules_settings(key, value, instead):
    with pytest.raises(ValueError, match=rf"trainer.{key}={value} does not apply to GRPOModule .*set {instead}"):
        build_cli(["--config", TINY, "--trainer.logger", "false", f"--trainer.{key}", value], run=False)


@pytest.mark.parametrize("key, value, allowed", [
    ("loss.loss_type", "gspo", "'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo', 'vespo'"),
    ("loss.importance_sampling_level", "seq", "'token', 'sequence'"),
    ("sampler_correction.mode", "tis",
     "'auto', 'none', 'token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask'"),
])
def test_loss_options_fail_at_parse_time_naming_the_value_and_the_choices(capsys, key, value, allowed):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", TINY, f"--model.{key}", value])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    # one line, as every other refusal: the key, what is allowed, the value
    assert f"error: model.{key}: Expected a typing.Literal[{allowed}]. Got value: {value}\n" in err, err


def test_a_fit_with_a_reference_model_leaves_no_module_in_eval_mode_for_lightning_to_warn_about(tmp_path, recwarn):
    """Lightning warns at the start of fit about every module in eval mode ("may lead to unexpected behavior"): the
    frozen reference (beta > 0) stays in train mode until each use puts it in eval mode."""
    cli = build_cli(["fit", "--config", TINY, "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", "1",
                     "--model.loss.beta", "0.04", "--trainer.logger", "false", "--torch_num_threads", "1"])
    assert cli.model.ref_model is not None and cli.trainer.global_step == 1
    assert not [w for w in recwarn if "eval mode" in str(w.message)], [str(w.message) for w in recwarn]
    with cli.model._reference() as ref:
        assert not any(module.training for module in ref.modules())


def test_loss_options_reach_the_module_from_the_command_line():
    cli = build_cli(["--config", TINY, "--model.loss.loss_type", "cispo", "--model.loss.epsilon_high", "5.0",
                     "--model.loss.importance_sampling_level", "sequence", "--model.loss.kl_bias_correction", "true",
                     "--model.sampler_correction.mode", "token_truncate", "--model.sampler_correction.clip_min",
                     "0.5", "--model.sampler_correction.clip_max", "2.0", "--trainer.logger", "false"], run=False)
    loss_fn, correction = cli.model.loss_fn, cli.model.sampler_correction
    config = loss_fn.config
    assert (loss_fn.name, config.epsilon_high, config.importance_sampling_level, config.kl_bias_correction) == (
        "cispo", 5.0, "sequence", True)
    assert (correction.mode, correction.clip_min, correction.clip_max) == ("token_truncate", 0.5, 2.0)
    cli = build_cli(["--config", TINY, "--model.loss.loss_type", "vespo", "--model.loss.vespo_k_pos", "1.5",
                     "--model.loss.vespo_lambda_neg", "0.5", "--trainer.logger", "false"], run=False)
    config = cli.model.loss_fn.config
    assert (cli.model.loss_fn.name, config.vespo_k_pos, config.vespo_lambda_pos, config.vespo_lambda_neg) == (
        "vespo", 1.5, 3.0, 0.5)


def test_top_entropy_quantile_reaches_the_loss_from_the_command_line_and_the_yaml(tmp_path):
    cli = build_cli(["--config", TINY, "--model.loss.top_entropy_quantile", "0.2", "--trainer.logger", "false"],
                    run=False)
    assert cli.model.loss_fn.config.top_entropy_quantile == 0.2
    config = tmp_path / "loss.yaml"
    config.write_text("model:\n  loss:\n    loss_type: grpo\n    top_entropy_quantile: 0.5\n")
    cli = build_cli(["--config", TINY, "--config", str(config), "--trainer.logger", "false"], run=False)
    assert (cli.model.loss_fn.name, cli.model.loss_fn.config.top_entropy_quantile) == ("grpo", 0.5)
    default = build_cli(["--config", TINY, "--trainer.logger", "false"], run=False).model.loss_fn.config
    assert default.top_entropy_quantile == 1.0


def test_the_entropy_bonus_reaches_the_module_from_the_yaml_and_bad_values_fail_naming_them(tmp_path):
    config = tmp_path / "entropy.yaml"
    config.write_text("model:\n  loss:\n    entropy_coef: 0.01\n    use_adaptive_entropy: true\n"
                      "    entropy_target: 1.5\n    entropy_coef_delta: 0.002\n")
    cli = build_cli(["--config", TINY, "--config", str(config), "--trainer.logger", "false"], run=False)
    control = cli.model.entropy_control
    assert (control.coef, control.adaptive, control.config.entropy_target, control.config.entropy_coef_delta) == (
        0.01, True, 1.5, 0.002)
    with pytest.raises(ValueError, match=r"entropy_coef_min=0.0 must be <= entropy_coef_max=-1.0"):
        build_cli(["--config", TINY, "--model.loss.use_adaptive_entropy", "true", "--model.loss.entropy_coef_max",
                   "-1", "--trainer.logger", "false"], run=False)


def test_gpu_recipe_parses_and_instantiates_with_a_tiny_model():
    cli = build_cli(["--config", GPU, "--model.model", "tiny-llama", "--trainer.accelerator", "cpu",
                     "--trainer.precision", "32-true", "--trainer.logger", "false",
                     "--data.sampling.kv_budget_bytes", str(10**9)], run=False)  # a CPU has no free memory to read
    hp = cli.model.hparams
    assert (cli.model.loss_fn.name, hp.gradient_checkpointing, hp.train_micro_batch_size) == ("dapo", True, 8)
    dm = cli.datamodule
    sampling = dm.sampling
    assert (sampling.group_size, sampling.micro_group_size, sampling.strategy, sampling.max_new_tokens) == (
        32, "auto", "infinite", 1024)
    assert [r.name for r in dm.reward_funcs] == ["accuracy", "format", "overlong"]
    with open(GPU) as handle:
        raw = yaml.safe_load(handle)
    assert raw["model"]["model"] == "Qwen/Qwen3-1.7B" and raw["trainer"]["precision"] == "bf16-mixed"
    assert raw["trainer"]["accelerator"] == "gpu" and "kv_budget_bytes" not in raw["data"]["sampling"]
    cli.model.configure_model()
    dm.size, dm.val_size = 64, 8  # keep the check quick: the recipe's 20000 prompts load the same way
    dm.attach(cli.model.policy, cli.model.tokenizer)
    dm.setup("fit")
    assert len(dm.train_prompt_ids) == 56


# Whether glibc maps a malloc'd block of its own (mallinfo2's count of mapped blocks rises while it is held): a
# 24 MiB block twice (glibc's own threshold rises to 24 MiB when the first is freed, so the second comes from the
# heap), then a 2 MiB block. Each of argv[1:] probes in a fork of the process as the import left it, as a fresh
# process of its own would (one import of torch for them all): "fix" fixes the threshold at 4 MiB first, as lit-grpo
# does, "own" leaves glibc's.
_MAPPED_PROBE = """
import ctypes, json, os, sys
from lit_grpo.runtime.memory import fix_mmap_threshold
libc = ctypes.CDLL(None)
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def mapped(nbytes):
    before = libc.mallinfo2().hblks
    block = libc.malloc(nbytes)
    out = libc.mallinfo2().hblks > before
    libc.free(block)
    return out
for mode in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        fixed = fix_mmap_threshold(4 << 20) if mode == "fix" else None
        print(json.dumps({"fixed": fixed, "mapped": [mapped(24 << 20), mapped(24 << 20), mapped(2 << 20)]}),
              flush=True)
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
"""


def _probe_mapped(*modes: str, **env: str) -> list[dict]:
    import ctypes
    import json

    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("glibc >= 2.33 only (mallinfo2)")
    out = subprocess.run([sys.executable, "-c", _MAPPED_PROBE, *modes], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | env)
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_a_fixed_mmap_threshold_keeps_large_blocks_mapped_and_small_ones_in_the_heap():
    own, fixed = _probe_mapped("own", "fix")
    assert own == {"fixed": None, "mapped": [True, False, False]}  # glibc's threshold rose
    assert fixed == {"fixed": True, "mapped": [True, True, False]}
    # the user's MALLOC_MMAP_THRESHOLD_ wins (glibc reads it as a process starts): lit-grpo leaves it as it is
    assert _probe_mapped("fix", MALLOC_MMAP_THRESHOLD_="131072") == [{"fixed": False, "mapped": [True, True, True]}]


def test_the_mmap_threshold_option_is_checked_and_can_be_turned_off(monkeypatch):
    from lit_grpo.cli import command

    calls = []
    monkeypatch.setattr(command, "fix_mmap_threshold", calls.append)
    build_cli(["--config", TINY, "--trainer.logger", "false"], run=False)
    build_cli(["--config", TINY, "--trainer.logger", "false", "--malloc_mmap_threshold", "null"], run=False)
    assert calls == [4 << 20]
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"malloc_mmap_threshold=0 must be between 1 and 33554432 bytes "
                                         r"\(glibc's largest\), or null for glibc's own threshold"):
        build_cli(["--config", TINY, "--malloc_mmap_threshold", "0"], run=False)


def test_thread_count_is_the_processes_share_of_the_cores_unless_the_config_or_the_environment_says(monkeypatch):
    import os

    import torch

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4}, raising=False)  # available_cores
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # recorded first, so the teardown takes back what the CLI sets
    monkeypatch.delenv("OMP_NUM_THREADS")
    quiet = ["--config", TINY, "--trainer.logger", "false"]
    build_cli(quiet, run=False)
    assert torch.get_num_threads() == 5 and "OMP_NUM_THREADS" not in os.environ
    # two ranks on this node: each its share, which the rank this process starts inherits
    build_cli([*quiet, "--trainer.strategy", "ddp", "--trainer.devices", "2"], run=False)
    assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    # so a launcher's OMP_NUM_THREADS (torch took it when it started) is kept, not replaced by all the cores
    build_cli(quiet, run=False)
    assert torch.get_num_threads() == 2
    build_cli([*quiet, "--torch_num_threads", "1"], run=False)
    assert torch.get_num_threads() == 1
    # the config's count goes to the ranks too (Lightning's launcher would set its own share where none is set)
    build_cli([*quiet, "--torch_num_threads", "3", "--trainer.strategy", "ddp", "--trainer.devices", "2"], run=False)
    assert torch.get_num_threads() == 3 and os.environ["OMP_NUM_THREADS"] == "3"
    for bad in (0, 21):  # thousands of threads crash OpenMP
        with pytest.raises(ValueError, match=rf"torch_num_threads={bad} must be in \[1, 20\] \(4 a core of the 5 "
                                             r"this process may run on\), or null for OMP_NUM_THREADS where set"):
            build_cli(["--config", TINY, "--torch_num_threads", str(bad)], run=False)


def test_a_cpu_quota_sets_the_default_thread_count(tmp_path, monkeypatch):
    """A 4-CPU container on a 64-core host: 4 threads, not 64 that the quota throttles."""
    import os

    import torch

    import lit_grpo.runtime.validation as validation

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    (tmp_path / "cpu.max").write_text("400000 100000\n")
    (tmp_path / "self_cgroup").write_text("0::/\n")
    monkeypatch.setattr(validation, "_CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(validation, "_PROC_SELF_CGROUP", str(tmp_path / "self_cgroup"))
    monkeypatch.setattr(validation, "_PROC_SELF_MOUNTINFO", str(tmp_path / "missing"))  # the cgroups under the root
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # recorded first, so the teardown takes back what the CLI sets
    monkeypatch.delenv("OMP_NUM_THREADS")
    build_cli(["--config", TINY, "--trainer.logger", "false"], run=False)
    assert torch.get_num_threads() == 4


@pytest.mark.parametrize("args, message", [
    (["--data.jsonl_path", "x.jsonl"], "error: data: give exactly one prompt source (task, jsonl_path, prompts or "
                                       "dataset); got ['task', 'jsonl_path']: unset the others, e.g. --data.task null"),
    (["--data.task", "null", "--data.task_config", "null", "--data.jsonl_path", "missing.jsonl"],
     "error: data: prompt file 'missing.jsonl' does not exist"),
    (["--data.val_size", "1000"], "error: data.val_size=1000 leaves no training prompt out of 40 distinct prompts"),
    # under the key the user set, not under data.tools (whose block it was checked in)
    (["--data.max_tool_calling_iterations", "-1"], "error: data.max_tool_calling_iterations=-1 must be an integer "
                                                   ">= 0 (tool rounds per completion) or None (null in YAML"),
    (["--data.over_provision", "1000"], "error: data.over_provision=1000.0 runs ceil(1000.0 x prompts_per_step=2) = "
                                        "2000 groups a rollout, x world_size=1 more than the 36 training prompts"),
    (["--data.sampling.micro_group_size", "auto", "--data.sampling.kv_budget_bytes", "1"],
     "error: data.sampling.kv_budget_bytes=1 is smaller than one slot's KV cache"),
    # judged against the policy when it is handed over, before any rollout
    (["--data.sampling.max_new_tokens", "100000"], "error: data.sampling.max_new_tokens=100000 leaves no room for a "
                                                   "prompt within the model's max_position_embeddings=2048"),
    (["--data.sampling.cuda_graph", "true"], "error: data.sampling.cuda_graph=True needs a CUDA model; this one is "
                                             "on cpu"),
    (["--trainer.precision", "bf16-true"], "error: trainer.precision='bf16-true' is not supported; use one of "
                                           "['32-true', 'bf16-mixed', '16-mixed']"),
    (["--data.task", "basic_arith"], "error: data.task='basic_arith' is not a reasoning-gym task; did you mean "
                                     "['basic_arithmetic']?"),
    (["--data.task_config", '{"max_digit": 3}'], "error: data: task_config ['max_digit'] is not an option of "
                                                 "reasoning-gym task 'basic_arithmetic'; its options: "
                                                 "['allow_negation', 'allow_parentheses', 'format_style', "
                                                 "'max_digits'"),
])
def test_a_setting_found_bad_while_setting_up_ends_the_run_as_a_parse_error_does(tmp_path, capsys, monkeypatch,
                                                                                   args, message):
    """Found when the data or the model are set up, not when the config is parsed: still one error line naming the
    setting, and exit 2, not a traceback."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_steps", "1",
                   "--trainer.logger", "false", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("where, settings, message, said", [
    ("data", ["val_size"], "val_size=-1 must be", "data.val_size=-1 must be"),
    ("data", ["sampling"], "sampling.seed=-1 is not allowed; sampling.seed must", "data.sampling.seed=-1 is not "
                                                                                  "allowed; sampling.seed must"),
    ("model.peft_config", [], "peft_config.r=0 must be", "model.peft_config.r=0 must be"),
    ("model.peft_config", [], "peft_config=[('r', 4)] must be", "model.peft_config=[('r', 4)] must be"),
    # no setting and its value first, a name not known under ``where``, a flag: under ``where: ``
    ("data", ["val_size"], "prompt file 'x' does not exist", "data: prompt file 'x' does not exist"),
    ("data.tools", [], "over_provision=2 turns on partial rollouts", "data.tools: over_provision=2 turns on partial "
                                                                     "rollouts"),
    ("--ckpt_path", ["step"], "step=3 is past", "--ckpt_path: step=3 is past"),
])
def test_a_setting_error_names_the_setting_and_its_value_as_the_command_line_writes_them(where, settings, message,
                                                                                         said):
    from lit_grpo.runtime.validation import ConfigError, config_errors

    with pytest.raises(ConfigError) as error, config_errors(where, settings):
        raise ValueError(message)
    assert str(error.value) == said


def test_validate_with_no_held_out_prompts_is_refused_naming_val_size(tmp_path, capsys, monkeypatch):
    """``data.val_size: 0`` (the TRL port's setting) leaves validate nothing to run: an error, not a silent exit 0."""
    monkeypatch.chdir(tmp_path)
    err = _refused(capsys, ["validate", "--config", TINY, "--trainer.logger", "false", "--data.val_size", "0"])
    assert ("error: data.val_size=0 holds out no prompts, so there is nothing to validate: set it to a count >= 1 or "
            "a fraction in (0, 1)") in err, err


def test_multi_objective_aggregation_reaches_the_rollouts_from_the_command_line_and_the_yaml(tmp_path, capsys):
    from lit_grpo.rollout.advantages import normalize_then_sum_advantages

    cli = build_cli(["fit", "--config", TINY, "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", "1",
                     "--trainer.limit_val_batches", "0", "--trainer.logger", "false", "--torch_num_threads", "1",
                     "--model.multi_objective_aggregation", "normalize_then_sum"])
    builder = cli.datamodule.builder
    assert cli.trainer.global_step == 1 and builder.advantage.multi_objective_aggregation == "normalize_then_sum"
    batch = cli.datamodule.build_train_batch()
    funcs = cli.datamodule.reward_funcs
    values = torch.stack([batch.reward_components[f.name] for f in funcs], dim=-1)
    torch.testing.assert_close(batch.advantages, normalize_then_sum_advantages(values, torch.tensor(
        [f.weight for f in funcs])))
    config = tmp_path / "gdpo.yaml"
    config.write_text("model:\n  multi_objective_aggregation: normalize_then_sum\n")
    cli = build_cli(["--config", TINY, "--config", str(config), "--trainer.logger", "false"], run=False)
    assert cli.model.hparams.multi_objective_aggregation == "normalize_then_sum"
    default = build_cli(["--config", TINY, "--trainer.logger", "false"], run=False)
    assert default.model.hparams.multi_objective_aggregation == "sum_then_normalize"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", TINY, "--model.multi_objective_aggregation", "gdpo"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "error: model.multi_objective_aggregation: Expected" in err and "Got value: gdpo" in err
    assert "'sum_then_normalize', 'normalize_then_sum'" in err


def test_a_single_callback_is_taken_as_the_trainers_list(tmp_path):
    """trainer.callbacks may be one callback, not a list (the Trainer's type says so): lit_grpo's defaults join it,
    and the one given stands for its own kind."""
    config = tmp_path / "one.yaml"
    config.write_text("trainer:\n  callbacks:\n    class_path: lit_grpo.callbacks.FitSummary\n"
                      "    init_args: {window: 3}\n")
    cli = build_cli(["--config", TINY, "--config", str(config), "--trainer.logger", "false",
                     "--trainer.default_root_dir", str(tmp_path)], run=False)
    names = [type(cb).__name__ for cb in cli.trainer.callbacks]
    assert [cb.window for cb in cli.trainer.callbacks if type(cb).__name__ == "FitSummary"] == [3]
    assert "RankFailureWatch" in names and "RunCheckpoint" in names


def test_a_constructors_warning_names_its_setting_and_points_where_the_config_sets_it(tmp_path):
    """A class warns at its constructor's caller (right in Python), which under the CLI is Lightning's code: the
    warning names the setting by its full key and points at the config file's line that sets it, or at the class
    that warned where the command line set it."""
    from lit_grpo.update import module

    config = tmp_path / "warn.yaml"
    config.write_text("model:\n  lr_schedule: constant\n  min_lr_ratio: 0.5\n")
    base = ["--config", TINY, "--trainer.logger", "false", "--data.sampling.strategy", "full"]
    with pytest.warns(UserWarning) as caught:
        build_cli([*base, "--config", str(config)], run=False)
    placed = {str(w.message).split("=")[0]: (w.filename, w.lineno) for w in caught}
    sampling_line = Path(TINY).read_text().splitlines().index(
        "  sampling: {group_size: 4, micro_group_size: 2, strategy: infinite, max_new_tokens: 16}") + 1
    assert placed["model.min_lr_ratio"] == (str(config), 3), placed
    assert placed["data.sampling.micro_group_size"] == (TINY, sampling_line), placed
    with pytest.warns(UserWarning) as caught:
        build_cli([*base, "--model.lr_schedule", "constant", "--model.min_lr_ratio", "0.5"], run=False)
    [warned] = [w for w in caught if str(w.message).startswith("model.min_lr_ratio=0.5 is the floor")]
    assert warned.filename == module.__file__
    assert not [w for w in caught if str(w.message).startswith(("model.", "data.")) and "lightning" in w.filename]


def test_a_callbacks_warning_about_its_own_setting_is_not_named_by_a_config_key_of_that_name(tmp_path, monkeypatch):
    """A callback's settings are no config keys (the callbacks are a list): its warning about its own ``lr`` is not
    model.lr's, nor does it point at the line of the config that sets model.lr."""
    (tmp_path / "user_warning_callback.py").write_text(textwrap.dedent("""\
        import warnings
        from lightning.pytorch import Callback

        class LoudCallback(Callback):
            def __init__(self, lr: float = 0.1):
                if lr > 1:
                    warnings.warn(f"lr={lr} is large", stacklevel=2)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning) as caught:
        build_cli(["--config", TINY, "--trainer.logger", "false",
                   "--trainer.callbacks+=user_warning_callback.LoudCallback", "--trainer.callbacks.lr=3"], run=False)
    [warned] = [w for w in caught if "is large" in str(w.message)]
    assert (str(warned.message), warned.filename) == ("lr=3.0 is large", str(tmp_path / "user_warning_callback.py"))


def test_a_constructors_warning_turned_into_an_error_is_raised_by_the_constructor(tmp_path):
    """Under an error filter (python -W error) the warning is raised where it is warned, as Python does: its
    traceback ends in the class that warned, and nothing after that class is built."""
    from lit_grpo.update import module

    config = tmp_path / "warn.yaml"
    config.write_text("model:\n  lr_schedule: constant\n  min_lr_ratio: 0.5\n")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*min_lr_ratio=0.5", category=UserWarning)
        with pytest.raises(UserWarning, match="min_lr_ratio=0.5") as raised:
            build_cli(["--config", TINY, "--trainer.logger", "false", "--config", str(config)], run=False)
    assert Path(raised.traceback[-1].path) == Path(module.__file__), raised.traceback[-1]


@pytest.mark.parametrize("logger", [[], ["--trainer.logger", "false"]])
def test_a_run_folder_that_cannot_be_made_ends_the_run_naming_it(tmp_path, capsys, logger):
    """The logger (TensorBoard's) or the saved config, whichever makes the run's folder first, fails on a path
    under a file: one error line naming the folder and the setting, not a traceback."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", TINY, "--trainer.max_steps", "1", "--trainer.default_root_dir",
                   str(blocker / "run"), "--torch_num_threads", "1", *logger])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (f"error: the run's folder {blocker / 'run'} cannot be created (Not a directory): set "
            "trainer.default_root_dir (or the logger's save_dir) to a folder that can be written\n") in err, err


def test_a_gpu_accelerator_without_a_gpu_is_refused_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert _refused(capsys, ["fit", "--config", GPU]).startswith(  # Qwen3-1.7B: never loaded here
        "error: trainer.accelerator='gpu', but torch finds no GPU on this machine (torch.cuda.is_available() is "
        "False): use 'cpu', or 'auto'")


@pytest.mark.parametrize("args, message", [
    (["--trainer.devices", "0"], "error: trainer.devices=0 is not allowed; on the CPU trainer.devices must be a number "
     "of processes >= 1, or 'auto'\n"),
    (["--trainer.accelerator", "cpu", "--trainer.devices", "[0, 1]"], "error: trainer.devices=[0, 1] is not allowed; "
     "on the CPU trainer.devices must be a number of processes >= 1, or 'auto'\n"),
    (["--trainer.strategy", "dpp"], "error: trainer.strategy='dpp' is not known (did you mean 'ddp'?); use one of "
     "['auto', 'ddp', 'ddp_spawn', "),
    (["--trainer.num_nodes", "0"], "error: trainer.num_nodes=0 is not allowed; trainer.num_nodes must be an integer "
     ">= 1\n"),
])
def test_a_bad_process_setting_is_named_with_what_it_takes(capsys, monkeypatch, args, message):
    """trainer.devices, strategy and num_nodes are refused as the other settings are (the key, the value, what is
    allowed), where Lightning said `Trainer(devices='0')` value is not a valid input, or listed strategy names
    without the setting's key."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert message in _refused(capsys, ["fit", "--config", TINY, "--trainer.logger", "false", *args])


@pytest.mark.parametrize("devices, allowed", [(0, False), ("0", False), (-2, False), ([], False), ("x", False),
                                              (2, True), (-1, True), ([0, 3], True), ("0,1", True), ("auto", True),
                                              ([True], False), ([-1], False)])
def test_gpu_devices_take_a_count_all_or_indices(devices, allowed):
    from lit_grpo.cli.setting_checks import check_processes

    trainer = {"accelerator": "gpu", "devices": devices}
    if allowed:
        check_processes(trainer)
        return
    with pytest.raises(ValueError, match=r"trainer.devices=.* is not allowed; trainer.devices must be a number of "
                                         r"devices >= 1, -1 \(all of them\), 'auto', or a list of device indices"):
        check_processes(trainer)


@pytest.mark.parametrize("accelerator", ["cpu", "gpu"])
def test_process_counts_take_numpy_integers_as_plain_ints(accelerator):
    # as every other integer setting: a count computed with numpy is the int it holds, given on to Lightning, which
    # refuses numpy integers itself
    from lit_grpo.cli.setting_checks import check_processes

    trainer = {"accelerator": accelerator, "num_nodes": np.int64(2), "devices": np.int64(2)}
    check_processes(trainer)
    assert (trainer["num_nodes"], trainer["devices"]) == (2, 2)
    assert (type(trainer["num_nodes"]), type(trainer["devices"])) == (int, int)
    if accelerator == "gpu":
        trainer["devices"] = [np.int64(0), np.int32(3)]
        check_processes(trainer)
        assert trainer["devices"] == [0, 3] and {type(index) for index in trainer["devices"]} == {int}
    for nodes in (np.int64(0), True, 2.0):
        with pytest.raises(ValueError, match=r"^trainer.num_nodes=.* is not allowed; trainer.num_nodes must be an "
                                             r"integer >= 1$"):
            check_processes({"num_nodes": nodes})


def test_the_trainer_setting_checks_show_the_value_bounded_and_a_huge_int_by_its_digits():
    """Shown as every check shows a value: a repr (or str) of an int of more than 4300 digits failed with Python's
    int-to-str ValueError in place of the refusal, a long value ran on."""
    from lit_grpo.cli.setting_checks import check_manual_optimization_settings, check_processes

    cases = [
        (lambda: check_processes({"accelerator": "cpu", "devices": -10**5000}),
         r"^trainer.devices=\(a negative int of 5001 digits\) is not allowed; on the CPU trainer.devices must be "),
        (lambda: check_processes({"accelerator": "gpu", "devices": [-10**5000]}),
         r"^trainer.devices=a list holding an int of more than \d+ digits is not allowed; trainer.devices must be a "),
        (lambda: check_processes({"accelerator": "cpu", "devices": "0"}),  # a count written as text, shown as one
         r"^trainer.devices=0 is not allowed; on the CPU trainer.devices must be a number of processes >= 1"),
        (lambda: check_processes({"strategy": "x" * 500}),
         rf"^trainer.strategy={re.escape(repr('x' * 500)[:100])} is not known; use one of "),
        (lambda: check_manual_optimization_settings({"gradient_clip_val": 10**5000}),
         r"^trainer.gradient_clip_val=\(an int of 5001 digits\) does not apply to GRPOModule"),
        (lambda: check_manual_optimization_settings({"accumulate_grad_batches": 10**5000}),
         r"^trainer.accumulate_grad_batches=\(an int of 5001 digits\) does not apply to GRPOModule"),
        (lambda: check_manual_optimization_settings({"precision": "x" * 500}),
         rf"^trainer.precision={re.escape(repr('x' * 500)[:100])} is not supported; use one of "),
    ]
    for check, message in cases:
        with pytest.raises(ValueError, match=message):
            check()


def test_a_missing_config_file_is_named_on_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = _refused(capsys, ["fit", "--config", "nope.yaml"])
    assert (f"error: --config nope.yaml: no such file ({tmp_path.resolve() / 'nope.yaml'}); --config takes a YAML file "
            "of settings\n") in err, err
    assert "Parser key" not in err
    (tmp_path / "run").mkdir()
    err = _refused(capsys, ["fit", "--config", str(tmp_path / "run")])
    assert (f"error: --config run: not a file ({tmp_path.resolve() / 'run'}); --config takes a YAML file of "
            "settings\n") in err, err


NON_FINITE_REFUSALS = [
    (["--model.lr", "inf"], "error: model.lr=inf is not allowed; lr must be a finite number > 0\n"),
    (["--model.lr=-inf"], "error: model.lr=-inf is not allowed; lr must be a finite number > 0\n"),
    # -inf after a space is a value, not an unknown option that leaves the setting without one
    (["--model.loss.beta", "-inf"], "error: model.loss.beta=-inf is not allowed; beta must be a finite number "
                                    ">= 0\n"),
    (["--data.sampling.temperature", "NaN"], "error: data.sampling.temperature=nan must be 0 (greedy) or a finite "
     "number >= 1e-05"),
    (["--model.max_grad_norm", "-Infinity"], "error: model.max_grad_norm=-inf is not allowed; max_grad_norm must be "
     "a finite number >= 0\n"),
]


@pytest.mark.parametrize("args, message", NON_FINITE_REFUSALS)
def test_python_spellings_of_infinity_and_nan_reach_the_settings_own_check(capsys, args, message):
    """inf, -inf and nan given to a float setting are read as the numbers they spell (as YAML's .inf is), so the
    setting's own check refuses them with its key and range: jsonargparse read them as text ('Expected a <class
    'float'>. Got value: inf'), and -inf as an option ('expected one argument')."""
    assert message in _refused(capsys, ["fit", "--config", TINY, "--trainer.logger", "false", *args])


def _as_yaml(args: list[str]) -> str:
    """``--a.b.c value`` (or ``--a.b.c=value``) as the YAML ``a: {b: {c: value}}``, the value as written."""
    key, value = args if len(args) == 2 else args[0].split("=", 1)
    *parents, leaf = key.removeprefix("--").split(".")
    return "".join(f"{'  ' * depth}{name}:\n" for depth, name in enumerate(parents)) + \
        f"{'  ' * len(parents)}{leaf}: {value}\n"


@pytest.mark.parametrize("args, message", NON_FINITE_REFUSALS)
def test_a_config_files_inf_and_nan_get_the_command_lines_refusal(capsys, tmp_path, args, message):
    """YAML 1.1 reads inf and nan as text (its float is .inf): a config file's float setting takes them as the
    numbers they spell, as the command line does, so the setting's own check speaks, not jsonargparse's 'Expected a
    <class 'float'>. Got value: inf'."""
    config = tmp_path / "non_finite.yaml"
    config.write_text(_as_yaml(args))
    err = _refused(capsys, ["fit", "--config", TINY, "--trainer.logger", "false", "--config", str(config)])
    assert message in err and "Expected a" not in err


def test_a_text_setting_keeps_inf_as_it_is_given(tmp_path):
    from lit_grpo.cli.parser import takes_float

    cli = build_cli(["--config", TINY, "--trainer.logger", "false", "--data.system_prompt", "inf"], run=False)
    assert cli.datamodule.hparams.system_prompt == "inf"
    config = tmp_path / "text.yaml"
    config.write_text("data:\n  system_prompt: nan\n")
    cli = build_cli(["--config", TINY, "--trainer.logger", "false", "--config", str(config)], run=False)
    assert cli.datamodule.hparams.system_prompt == "nan"
    assert takes_float(Optional[float]) and takes_float(int | float) and not takes_float(Optional[str])


def test_a_configured_save_last_or_a_warned_setting_too_long_to_print_is_named_as_refusals_name_it():
    """A value holding an int too long to print (Python's int-to-str limit): repr's and str()'s ValueError failed in
    place of the refusal of a ModelCheckpoint writing last.ckpt, and of a warning named by its setting's key."""
    from jsonargparse import Namespace
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_grpo.cli.command import GRPOCLI
    from lit_grpo.cli.setting_warnings import warned_setting

    with pytest.raises(ValueError, match=r"^ModelCheckpoint\(save_last=\(an int of 5001 digits\)\) would write "
                                         r"last.ckpt beside lit_grpo's RunCheckpoint"):
        GRPOCLI._instantiate_trainer(object.__new__(GRPOCLI), {"callbacks": [ModelCheckpoint(save_last=10**5000)]},
                                     [])
    config = Namespace(model=Namespace(lr=10**5000))
    assert warned_setting("lr=(an int of 5001 digits) is large", config) == "model.lr=(an int of 5001 digits) is large"
    assert warned_setting("lr=2 is large", config) == "lr=2 is large"  # another value: another class's lr
