"""A stopped run loses at most one step: ``last.ckpt`` kept current by ``RunCheckpoint``, written atomically, a saved
stop on SIGTERM and Ctrl-C with a non-zero exit, ``--ckpt_path last``, and clear errors for bad checkpoints."""

import csv
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import time
import warnings
from datetime import timedelta
from pathlib import Path

import forked_cli
import lightning.pytorch as pl
import pytest
import stop_helpers
import torch

from lit_grpo.callbacks import RunCheckpoint
from lit_grpo.runtime.checkpoints import (AtomicCheckpointIO, atomic_torch_save, check_resumable, check_writable,
                                  checkpoint_identity, find_last_checkpoint, partial_path, read_checkpoint_header,
                                  remove_stale_partials, run_checkpoint_folders)
from lit_grpo.cli import build_cli
from lit_grpo.cli.resume import resume_command
from tools.step_recorder import read_records

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
STEPS = 5
KEYS = ("indices", "completion_ids", "rewards", "advantages", "loss", "param_sum", "param_abs")


def _fit_args(root: Path, *extra: str, steps: int = STEPS) -> list[str]:
    return ["fit", "--config", TINY, "--trainer.default_root_dir", str(root), "--trainer.max_steps", str(steps),
            "--torch_num_threads", "1", *extra]


def _run(tmp_path: Path, name: str, *extra: str, attempt: int = 0) -> subprocess.CompletedProcess:
    """``lit-grpo fit`` of tiny.yaml in a (forked) process, recording every step to ``tmp_path/name/rec``."""
    root = tmp_path / name
    argv = _fit_args(root, "--trainer.callbacks+=tools.step_recorder.StepRecorder",
                     f"--trainer.callbacks.path={root / 'rec'}", *extra)
    return forked_cli.run(argv, tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})


def _last_step(root: Path) -> int:
    path = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of STEPS steps: its folder (records, last.ckpt)."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = _run(tmp, "run")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return tmp / "run"


def _assert_same_steps(reference: Path, resumed: Path) -> None:
    a, b = read_records(str(reference / "rec")), read_records(str(resumed / "rec"))
    assert [r["global_step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        for key in KEYS:
            assert x[key] == y[key], (x["global_step"], key)


# ------------------------------------------------------------------------------------------------ stop signals
@pytest.mark.xdist_group("reference")
@pytest.mark.parametrize("signal_name, phase, saved, code", [
    ("TERM", "update", 3, 143),   # the update finishes: step 3 is saved
    ("INT", "rollout", 2, 130),   # the rollout is abandoned and rolled back: step 2 is saved, step 3 redone
])
def test_a_stop_signal_saves_the_last_completed_step_and_the_resume_is_exact(
        tmp_path, reference, signal_name, phase, saved, code):
    stopped = _run(tmp_path, "run", "--trainer.callbacks+=stop_helpers.SignalAt",
                   f"--trainer.callbacks.signal_name={signal_name}", "--trainer.callbacks.step=3",
                   f"--trainer.callbacks.phase={phase}")
    assert stopped.returncode == code, stopped.stdout[-2000:] + stopped.stderr[-4000:]
    assert f"stopped by SIG{signal_name} after step {saved}; saved to" in stopped.stdout
    assert "resume: lit-grpo fit --config" in stopped.stdout and stopped.stdout.rstrip().endswith("--ckpt_path last")
    assert "Traceback" not in stopped.stderr
    root = tmp_path / "run"
    assert _last_step(root) == saved
    assert [r["global_step"] for r in read_records(str(root / "rec"))] == list(range(1, saved + 1))

    resumed = _run(tmp_path, "run", "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    assert "--ckpt_path last: resuming from" in resumed.stdout + resumed.stderr
    assert sorted(p.name for p in (root / "lightning_logs").iterdir()) == ["version_0"]  # continued in place
    _assert_same_steps(reference, root)
    assert _last_step(root) == STEPS


def test_a_stop_during_the_validation_before_training_stops_the_run_as_a_stop(tmp_path):
    """That validation runs before training starts, where Lightning's own handler would end the run with 0."""
    stopped = _run(tmp_path, "run", "--trainer.callbacks+=stop_helpers.SignalAt",
                   "--trainer.callbacks.signal_name=TERM", "--trainer.callbacks.step=0",
                   "--trainer.callbacks.phase=validation")
    assert stopped.returncode == 143, stopped.stdout[-2000:] + stopped.stderr[-4000:]
    assert "stopped by SIGTERM during the validation before the first step" in stopped.stdout
    assert "nothing to save" in stopped.stdout and "resume:" not in stopped.stdout
    assert "Traceback" not in stopped.stderr


# two validation batches of two prompts: the signal comes in the first, the second must not run
CUT = ("--trainer.limit_val_batches", "2", "--data.val_batch_size", "2",
       "--trainer.callbacks+=stop_helpers.ValidationBatches")


@pytest.mark.parametrize("step", [0, 2])
def test_a_stop_during_a_validation_rollout_abandons_it(tmp_path, step):
    stopped = _run(tmp_path, "run", "--trainer.callbacks+=stop_helpers.SignalAt",
                   "--trainer.callbacks.signal_name=TERM", f"--trainer.callbacks.step={step}",
                   "--trainer.callbacks.phase=validation_rollout")
    assert stopped.returncode == 143, stopped.stdout[-2000:] + stopped.stderr[-4000:]
    assert "validation rollout" not in stopped.stdout and "Traceback" not in stopped.stderr
    assert f"stopped by SIGTERM during the validation {'after step 2' if step else 'before the first step'}, cut" \
        in stopped.stdout, stopped.stdout[-2000:]
    assert ("resume: lit-grpo fit" in stopped.stdout) == (step > 0)


@pytest.mark.xdist_group("reference")
@pytest.mark.parametrize("step", [0, 2])
def test_a_stop_during_a_validation_cuts_it_and_the_resume_is_exact(tmp_path, reference, step):
    """A validation changes nothing of the training state: a stop ends it within its current rollout, saves the
    last completed step (none before the first) and the resume trains the same steps."""
    stopped = _run(tmp_path, "run", *CUT, "--trainer.callbacks+=stop_helpers.SignalAt",
                   "--trainer.callbacks.signal_name=INT", f"--trainer.callbacks.step={step}",
                   "--trainer.callbacks.phase=validation")
    assert stopped.returncode == 130, stopped.stdout[-2000:] + stopped.stderr[-4000:]
    assert f"validation batch 0 after step {step} ended" in stopped.stdout
    assert f"validation batch 1 after step {step} ended" not in stopped.stdout, stopped.stdout[-2000:]
    assert "Traceback" not in stopped.stderr
    where = "before the first step" if step == 0 else f"after step {step}"
    assert f"stopped by SIGINT during the validation {where}, cut short" in stopped.stdout, stopped.stdout[-2000:]
    root = tmp_path / "run"
    if step == 0:
        assert "nothing to save" in stopped.stdout and "resume:" not in stopped.stdout
        return
    assert _last_step(root) == step and "resume: lit-grpo fit --config" in stopped.stdout
    resumed = _run(tmp_path, "run", *CUT, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    _assert_same_steps(reference, root)


def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path):
    stopped = _run(tmp_path, "run", "--trainer.callbacks+=stop_helpers.SignalAt",
                   "--trainer.callbacks.signal_name=INT", "--trainer.callbacks.step=3",
                   "--trainer.callbacks.phase=update", "--trainer.callbacks.times=2")
    assert stopped.returncode not in (0, 130), stopped.stdout[-2000:]
    assert "stopped by" not in stopped.stdout
    # tiny.yaml validates every 2 steps, so step 2 was saved; the interrupted step 3 was not
    assert _last_step(tmp_path / "run") == 2
    assert [r["global_step"] for r in read_records(str(tmp_path / "run" / "rec"))] == [1, 2]


def test_resume_command_replaces_the_checkpoint_argument():
    assert resume_command(["fit", "--config", "c.yaml", "--ckpt_path", "x.ckpt", "--trainer.max_steps", "9"]) == (
        "lit-grpo fit --config c.yaml --trainer.max_steps 9 --ckpt_path last")
    assert resume_command(["fit", "--ckpt_path=x.ckpt", "--config", "my run.yaml"]) == (
        "lit-grpo fit --config 'my run.yaml' --ckpt_path last")


# ------------------------------------------------------------------------------------------------ when it saves
def test_last_checkpoint_is_current_after_each_validation(tmp_path):
    """tiny.yaml validates every 2 steps: from step 3 on, last.ckpt holds step 2 (not only once fit ends)."""
    cli = build_cli(_fit_args(tmp_path, "--trainer.callbacks+=stop_helpers.LastCheckpointProbe"))
    probe = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "LastCheckpointProbe")
    checkpoint = cli.trainer.checkpoint_callback
    assert isinstance(checkpoint, RunCheckpoint)  # the CLI's default
    assert probe.seen == {1: None, 2: None, 3: 2, 4: 2, 5: 4}
    assert _last_step(tmp_path) == STEPS and checkpoint.saves == 3  # after steps 2 and 4, and at the end
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)


@pytest.mark.parametrize("settings, saves", [
    ({"every_n_train_steps": 2, "train_time_interval": "null", "save_on_validation": False}, 3),  # 2, 4, end
    ({"train_time_interval": "0:00:00", "save_on_validation": False}, 5),  # every step
    ({"train_time_interval": "1:00:00", "save_on_validation": False}, 1),  # the end only
])
def test_save_intervals_in_steps_and_time(tmp_path, settings, saves):
    args = ["--trainer.callbacks+=lit_grpo.callbacks.RunCheckpoint"] + [
        f"--trainer.callbacks.{key}={value}" for key, value in settings.items()]
    cli = build_cli(_fit_args(tmp_path, *args))
    checkpoint = cli.trainer.checkpoint_callback
    assert checkpoint.saves == saves
    assert _last_step(tmp_path) == STEPS


def test_step_interval_saves_after_each_step_that_passes_a_multiple_of_it():
    """A GRPO step makes num_iterations optimizer steps (here 4): a save every 10 falls after steps 12, 20, 32, 40."""
    from types import SimpleNamespace

    callback = RunCheckpoint(every_n_train_steps=10)
    saved = []
    callback._save_last = lambda trainer: saved.append(trainer.global_step)
    callback._stop_agreed = lambda trainer: False
    for batch in range(1, 11):
        trainer = SimpleNamespace(global_step=4 * batch, world_size=1, accumulate_grad_batches=1)
        callback.on_train_batch_end(trainer, None, None, None, batch)
    assert saved == [12, 20, 32, 40]
    # under gradient accumulation (3 batches a step), a stop waits for the batch that ends the optimizer step
    callback, saved, stopped = RunCheckpoint(), [], []
    callback._save_last = lambda trainer: saved.append(trainer.global_step)
    callback._stop_agreed = lambda trainer: True
    callback._stop = lambda trainer: stopped.append(trainer.global_step)
    for batch in range(3):
        trainer = SimpleNamespace(global_step=(batch + 1) // 3, world_size=1, accumulate_grad_batches=3,
                                  is_last_batch=False)
        callback.on_train_batch_end(trainer, None, None, None, batch)
    assert saved == stopped == [1]


def test_bad_run_checkpoint_settings_are_named():
    with pytest.raises(ValueError, match=r"every_n_train_steps=0 must be an integer >= 1"):
        RunCheckpoint(every_n_train_steps=0)
    with pytest.raises(ValueError, match=r"train_time_interval=.* must not be negative"):
        RunCheckpoint(train_time_interval=timedelta(minutes=-1))


# ------------------------------------------------------------------------------------------------ atomic writes
def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_whole(tmp_path):
    folder = tmp_path / "checkpoints"
    last = folder / "last.ckpt"
    context = forked_cli.forkserver()
    first_written = context.Event()
    proc = context.Process(target=stop_helpers.write_checkpoint_twice, args=(str(last), first_written))
    proc.start()
    assert first_written.wait(60), "the first write never ended"
    partial = partial_path(last, pid=proc.pid)
    deadline = time.monotonic() + 60
    while not (partial.exists() and partial.stat().st_size > 1 << 20):
        assert time.monotonic() < deadline and proc.is_alive(), "the second write never started"
        time.sleep(0.001)
    proc.kill()
    proc.join()
    assert partial.exists()  # the kill struck inside the second write
    assert torch.load(last, weights_only=True)["version"] == 1  # the previous checkpoint, whole
    assert find_last_checkpoint([folder]) == last  # the partial file is never a candidate
    assert remove_stale_partials(folder) == [partial] and not partial.exists()


def test_only_the_partial_writes_of_ended_processes_are_removed(tmp_path):
    gone = subprocess.Popen(["true"])  # a process that has ended: its partial write is no one's
    gone.wait()
    stale = partial_path(tmp_path / "last.ckpt", pid=gone.pid)
    stale.write_bytes(b"cut")
    mine = partial_path(tmp_path / "last.ckpt")  # this process's, being written
    mine.write_bytes(b"being written")
    assert remove_stale_partials(tmp_path) == [stale]
    assert mine.exists() and not stale.exists()


def test_lightning_checkpoints_go_through_the_atomic_write(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.ones(2)}}, tmp_path / "last.ckpt")
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_find_last_checkpoint_takes_the_newest_of_any_run(tmp_path):
    older, newer = tmp_path / "version_0" / "checkpoints", tmp_path / "version_1" / "checkpoints"
    atomic_torch_save({"v": 0}, older / "last.ckpt")
    atomic_torch_save({"v": 1}, newer / "last.ckpt")
    os.utime(older / "last.ckpt", (time.time() + 5, time.time() + 5))
    (newer / ".last.ckpt.999999.partial").write_bytes(b"cut")
    assert find_last_checkpoint([older, newer, tmp_path / "missing"]) == older / "last.ckpt"
    assert find_last_checkpoint([tmp_path / "missing"]) is None


# ------------------------------------------------------------------------------------------------ bad inputs
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    build_cli(_fit_args(root, steps=1))
    return root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"


def _run_copied_from(tiny_checkpoint: Path, root: Path) -> None:
    """The 1-step run of ``tiny_checkpoint`` copied into ``root``, as ``build_cli(_fit_args(root, steps=1))`` would
    have left it there, for tests whose later command refuses its checkpoint or only validates it (its
    RunCheckpoint state names the first run's folder, which a resume's restore would compare)."""
    shutil.copytree(tiny_checkpoint.parents[3], root, dirs_exist_ok=True)


def _hparams(path: Path) -> tuple[dict, dict]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return dict(checkpoint["hyper_parameters"]), dict(checkpoint["datamodule_hyper_parameters"])


def test_a_checkpoint_of_another_prompt_set_ends_the_resume_as_a_bad_setting_does(tmp_path, tiny_checkpoint, capsys):
    # another val_size holds out other prompts: the sampler's state counts another training set
    with pytest.raises(SystemExit) as exit_info:
        build_cli(_fit_args(tmp_path, "--ckpt_path", str(tiny_checkpoint), "--data.val_size", "8", steps=2))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: --ckpt_path: state num_prompts=" in err and "Traceback" not in err


def test_a_checkpoint_of_as_many_other_training_prompts_is_refused_and_an_unhashed_one_resumes(
        tmp_path, tiny_checkpoint, capsys):
    """The sampler's state holds a hash of the training prompts it drew from: a set of the same size but other
    prompts (another data_seed, task_config or source) is refused, as its positions would point at other prompts,
    held-out ones among them; a checkpoint saved before the hash resumes as before."""
    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=False)
    sampler = checkpoint["RolloutDataModule"]["sampler"]
    assert len(sampler["train_prompts"]) == 16
    sampler["train_prompts"] = "0" * 16
    other = tmp_path / "other.ckpt"
    torch.save(checkpoint, other)
    with pytest.raises(SystemExit) as exit_info:
        build_cli(_fit_args(tmp_path / "other", "--ckpt_path", str(other), steps=2))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: --ckpt_path: the checkpoint drew from another set of training prompts than this run's" in err
    del sampler["train_prompts"]
    unhashed = tmp_path / "unhashed.ckpt"
    torch.save(checkpoint, unhashed)
    build_cli(_fit_args(tmp_path / "unhashed", "--ckpt_path", str(unhashed), steps=2))
    assert _last_step(tmp_path / "unhashed") == 2


def test_the_prompt_sets_hash_follows_its_prompts_and_their_order():
    from lit_grpo.rollout.prompts import PromptExample, prompt_set_fingerprint

    examples = [PromptExample("1 + 1", "2"), PromptExample("2 + 2", "4", messages=[{"role": "user", "content": "x"}])]
    same = [PromptExample("1 + 1", "2", entry={"other": "data"}),
            PromptExample("2 + 2", "4", messages=[{"role": "user", "content": "x"}])]
    assert prompt_set_fingerprint(examples) == prompt_set_fingerprint(same)  # the source row plays no part
    assert prompt_set_fingerprint(examples) != prompt_set_fingerprint(examples[::-1])
    assert prompt_set_fingerprint(examples) != prompt_set_fingerprint([examples[0], PromptExample("2 + 2", "5")])


def test_the_prompt_sets_hash_is_taken_once_not_in_every_steps_state(monkeypatch):
    """Each training step snapshots the data side's state (a failed build rolls back to it): hashing every training
    prompt there would cost every step time in proportion to the data set."""
    import lit_grpo.datamodules.rollout as rollout_module
    from datamodule_helpers import datamodule_arguments
    from lit_grpo.datamodules.rollout import TRAIN_PROMPTS_KEY, RolloutDataModule
    from lit_grpo.runtime.models import load_model_and_tokenizer

    hashed = []
    real = rollout_module.prompt_set_fingerprint
    monkeypatch.setattr(rollout_module, "prompt_set_fingerprint", lambda examples: hashed.append(1) or real(examples))
    data = RolloutDataModule(**datamodule_arguments({"max_new_tokens": 4, "group_size": 2}))
    data.attach(*load_model_and_tokenizer("tiny-llama"))
    data.setup("fit")
    for _ in range(3):
        data.build_train_batch()
    state = data.state_dict()
    assert state["sampler"][TRAIN_PROMPTS_KEY] == real([data.examples[i] for i in data.train_indices])
    data.load_state_dict(state)
    assert len(hashed) == 1


def test_a_checkpoint_hashed_before_chat_messages_kept_their_other_keys_resumes_and_says_so():
    """The prompt set's hash takes a chat turn's keys beyond role and content, which were dropped before (and
    hashed without): a checkpoint of then, of the same prompts in the same order, resumes with a warning that they
    now render with those keys, not refused as another prompt set; one of other prompts still is."""
    from dataclasses import replace

    from datamodule_helpers import datamodule_arguments
    from lit_grpo.datamodules.rollout import TRAIN_PROMPTS_KEY, RolloutDataModule
    from lit_grpo.rollout.prompts import prompt_set_fingerprint
    from lit_grpo.runtime.models import load_model_and_tokenizer
    from lit_grpo.runtime.validation import ConfigError

    chat = [{"prompt": [{"role": "system", "content": "Be brief.", "name": "setup"},
                        {"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)} for i in range(12)]
    data = RolloutDataModule(**datamodule_arguments({"prompts": chat, "max_new_tokens": 4, "group_size": 2}))
    data.attach(*load_model_and_tokenizer("tiny-llama"))
    data.setup("fit")
    state = data.state_dict()
    # the hash as it was taken when a turn was its role and content alone
    before = [replace(data.examples[i], messages=[{"role": m["role"], "content": m["content"]}
                                                  for m in data.examples[i].messages]) for i in data.train_indices]
    state["sampler"][TRAIN_PROMPTS_KEY] = prompt_set_fingerprint(before)
    assert state["sampler"][TRAIN_PROMPTS_KEY] != data.state_dict()["sampler"][TRAIN_PROMPTS_KEY]
    with pytest.warns(UserWarning, match=r"the checkpoint's training prompts are this run's but for their chat "
                                         r"messages' keys beyond role and content \(\['name'\]\), which its run "
                                         r"dropped: it resumes, and these prompts now render with them$"):
        data.load_state_dict(state)
    state["sampler"][TRAIN_PROMPTS_KEY] = prompt_set_fingerprint(before[::-1])
    with pytest.raises(ConfigError, match=r"^--ckpt_path: the checkpoint drew from another set of training prompts"):
        data.load_state_dict(state)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process
def test_a_sharded_checkpoint_of_one_param_group_is_refused_where_this_run_builds_two(tmp_path):
    """An FSDP2 checkpoint of one group (weight_decay 0, or saved before the groups) cannot be regrouped before its
    load: a run whose optimizer has two is refused naming both counts; one of one group loads it."""
    import torch.distributed.checkpoint as dcp

    from lit_grpo.runtime.checkpoints import SHARDED_HEADER, check_sharded_param_groups

    folder = tmp_path / "last.ckpt"
    dcp.save({"optimizer_0": {"state": {"w": {"exp_avg": torch.zeros(2)}},
                              "param_groups": [{"lr": 1e-6, "weight_decay": 0.1, "params": ["w"]}]}},
             checkpoint_id=folder)
    torch.save({"loops": {}, "hyper_parameters": {}}, folder / SHARDED_HEADER)
    with pytest.raises(ValueError, match=r"has 1 param group\(s\), this run's 2 \(model.weight_decay 0.1;.*"
                                         r"one group: model.weight_decay 0 or a model.peft_config;"):
        check_sharded_param_groups(folder, 2, 0.1)
    check_sharded_param_groups(folder, 1, 0.1)  # a LoRA adapter's one group at weight_decay 0.1


def test_bad_checkpoint_files_are_named(tmp_path, tiny_checkpoint):
    module, data = _hparams(tiny_checkpoint)
    check_resumable(tiny_checkpoint, module, data)  # the good one passes
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*nowhere.ckpt does not exist"):
        check_resumable(tmp_path / "nowhere.ckpt", module, data)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.ckpt is empty \(0 bytes\)"):
        check_resumable(empty, module, data)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(tiny_checkpoint.read_bytes()[: tiny_checkpoint.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cut.ckpt is cut short or is not a torch checkpoint .*interrupted"):
        check_resumable(cut, module, data)
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"notes.ckpt is cut short or is not a torch checkpoint"):
        check_resumable(text, module, data)
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"model": torch.ones(2)}, foreign)
    with pytest.raises(ValueError, match=r"foreign.ckpt is not a lit_grpo training checkpoint: it has no "
                                         r"state_dict, loops, optimizer_states, hyper_parameters"):
        check_resumable(foreign, module, data)
    assert read_checkpoint_header(tiny_checkpoint)["global_step"] == 1


def test_a_checkpoint_with_other_settings_names_them(tiny_checkpoint):
    module, data = _hparams(tiny_checkpoint)
    module.update(loss={**module["loss"], "loss_type": "grpo"}, model="tiny-qwen2")
    data["sampling"] = {**data["sampling"], "group_size": 8}
    with pytest.raises(ValueError) as error:
        check_resumable(tiny_checkpoint, module, data)
    message = str(error.value)
    assert "model.model: 'tiny-llama' in the checkpoint, 'tiny-qwen2' now" in message
    assert "model.loss.loss_type: 'dapo' in the checkpoint, 'grpo' now" in message
    assert "data.sampling.group_size: 4 in the checkpoint, 8 now" in message
    assert "epsilon" not in message  # only what differs
    # evaluating it needs only weights that fit: the objective may differ, the model may not
    module_now, data_now = _hparams(tiny_checkpoint)
    module_now.update(loss={**module_now["loss"], "loss_type": "grpo"})
    check_resumable(tiny_checkpoint, module_now, {**data_now, "sampling": data["sampling"]}, evaluate=True)
    with pytest.raises(ValueError, match=r"holds the weights of another model than this run's:\n  model.model: "
                                         r"'tiny-llama' in the checkpoint, 'tiny-qwen2' now"):
        check_resumable(tiny_checkpoint, module, data, evaluate=True)


@pytest.mark.parametrize("group, name, value, shown", [
    (None, "disable_dropout", True, "model.disable_dropout: False in the checkpoint, True now"),
    (None, "cast_lm_head_to_fp32", True, "model.cast_lm_head_to_fp32: False in the checkpoint, True now"),
    ("loss", "top_entropy_quantile", 0.2, "model.loss.top_entropy_quantile: 1.0 in the checkpoint, 0.2 now"),
])
def test_a_resume_refuses_another_dropout_head_precision_or_entropy_mask_and_reads_an_older_checkpoint_as_off(
        tmp_path, tiny_checkpoint, group, name, value, shown):
    module, data = _hparams(tiny_checkpoint)
    changed = {**module, group: {**module[group], name: value}} if group else {**module, name: value}
    with pytest.raises(ValueError, match=re.escape(shown)):
        check_resumable(tiny_checkpoint, changed, data)
    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    saved = checkpoint["hyper_parameters"][group] if group else checkpoint["hyper_parameters"]
    default = saved.pop(name)  # as if saved before the setting existed
    older = tmp_path / "older.ckpt"
    torch.save(checkpoint, older)
    defaults = {"model": {group: {name: default}} if group else {name: default}}
    check_resumable(older, module, data, defaults=defaults)
    with pytest.raises(ValueError, match=re.escape(shown)):
        check_resumable(older, changed, data, defaults=defaults)


class _RunsCode:
    """What unpickling it does: makes the folder ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_a_checkpoint_is_read_for_its_settings_as_lightnings_resume_reads_it(tmp_path):
    """``lit-grpo fit --ckpt_path`` reads the file's settings before Lightning loads it: with torch.load's default
    ``weights_only``, as Lightning's resume does, so a file that runs code as it is unpickled is refused naming it,
    its code never run; it was read with weights_only=False, running code that the load would then refuse."""
    path = tmp_path / "code.ckpt"
    torch.save({"state_dict": {}, "loops": {}, "optimizer_states": [], "hyper_parameters": {"model": "tiny-llama"},
                "extra": _RunsCode(tmp_path / "ran")}, path)
    with pytest.raises(ValueError, match=rf"^checkpoint {re.escape(str(path))} cannot be read: UnpicklingError"):
        check_resumable(path, {"model": "tiny-llama"}, None)
    assert not (tmp_path / "ran").exists()


def test_a_resume_names_a_setting_or_key_too_long_to_print_as_refusals_do(tmp_path):
    """A value or a key that holds an int too long to print (Python's int-to-str limit) is named in a resume's
    differences as refusals name it: repr's and str()'s ValueError failed in place of the refusal (a run's
    data.sampling.group_size, a hand-edited checkpoint's key), and a key that is no text failed to join the names."""
    from lit_grpo.runtime.checkpoints import check_checkpoint_settings

    path = tmp_path / "edited.ckpt"
    saved = {"model": "tiny-llama", "dtype": None, 1: "a", 10**5000: "b"}  # no disable_dropout: an older release's
    checkpoint = {"state_dict": {}, "loops": {}, "optimizer_states": [], "hyper_parameters": saved,
                  "datamodule_hyper_parameters": {"sampling": {"group_size": 4}}}
    torch.save(checkpoint, path)
    module = {"model": "tiny-llama", "dtype": None, "disable_dropout": True}
    # the file is read as Lightning's resume reads it (torch.load's default weights_only), which refuses such an int
    with pytest.raises(ValueError, match=rf"^checkpoint {re.escape(str(path))} cannot be read: UnpicklingError"):
        check_resumable(path, module, {"sampling": {"group_size": 10**5000}})
    with pytest.raises(ValueError) as refused:  # read by other means (weights_only=False), it is compared
        check_checkpoint_settings(checkpoint, path, module, {"sampling": {"group_size": 10**5000}})
    message = str(refused.value)
    assert "\n  model.disable_dropout: None in the checkpoint, True now\n" in message
    assert ("(the checkpoint also holds model.1, model.(an int of 5001 digits), which this release does not have: "
            in message)
    assert "\n  data.sampling.group_size: 4 in the checkpoint, an int of 5001 digits now\n" in message


def test_a_resume_with_other_reward_functions_warns_once_naming_each_change(tmp_path, tiny_checkpoint):
    """A resume may change the reward functions (on purpose): it is not refused, but its reward curve, forecast and
    early stop then mix two objectives, so it warns once, naming each reward added, removed or changed (weight, kwargs,
    log_name), the checkpoint's against this run's, both as a run saves them. The same rewards spelt otherwise (a
    name alone, its defaults written out, the function itself, a marker for one no name imports) warn nothing."""
    from lit_grpo.rollout.reward_functions import accuracy_reward
    from lit_grpo.rollout.rewards import WeightedReward, reward_changes

    marker = "<not importable (a lambda): script:<lambda>>"
    saved = ["accuracy", {"name": "format", "weight": 0.1},
             {"name": "overlong", "weight": 1.0, "kwargs": {"buffer": 8}},
             {"name": marker, "weight": 0.5, "log_name": "ones"}, {"name": "math", "log_name": "m"}]
    path = tmp_path / "rewards.ckpt"
    torch.save({"state_dict": {}, "loops": {}, "optimizer_states": [], "hyper_parameters": {"model": "tiny-llama"},
                "datamodule_hyper_parameters": {"sampling": {"group_size": 4}, "reward_funcs": saved}}, path)
    module = {"model": "tiny-llama"}
    same = [WeightedReward(accuracy_reward), {"name": "format", "weight": 0.1, "kwargs": None, "log_name": ""},
            {"name": "overlong", "kwargs": {"buffer": 8}}, {"name": marker, "weight": 0.5, "log_name": "ones"},
            {"name": "math", "weight": 1, "log_name": "m"}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_resumable(path, module, {"sampling": {"group_size": 4}, "reward_funcs": same},
                        reward_changes=reward_changes)
    other = [{"name": "accuracy", "log_name": "accuracy"},
             {"name": "overlong", "weight": 1.0, "kwargs": {"buffer": 16}},
             {"name": marker, "weight": 0.5, "log_name": "ones"}, {"name": "math", "log_name": "maths"},
             "char_fraction"]
    with pytest.warns(UserWarning) as caught:
        check_resumable(path, module, {"sampling": {"group_size": 4}, "reward_funcs": other},
                        reward_changes=reward_changes)
    [message] = [str(warning.message) for warning in caught]
    assert message.startswith(f"checkpoint {path} was trained with other reward functions than this run's:")
    assert ("\n  reward 'format': removed (weight 0.1 in the checkpoint)"
            "\n  reward 'overlong': kwargs {'buffer': 8} in the checkpoint, {'buffer': 16} now"
            "\n  reward 'math': log_name 'm' in the checkpoint, 'maths' now"
            "\n  reward 'char_fraction': added (weight 1.0 now)\n") in message
    assert "'accuracy'" not in message and marker not in message
    # a run that only evaluates the checkpoint trains no further: nothing to warn of
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_resumable(path, module, {"reward_funcs": other}, evaluate=True, reward_changes=reward_changes)

    # the CLI: a resume of tiny.yaml's run with another weight names that reward, and that reward alone
    checkpoint_rewards = _hparams(tiny_checkpoint)[1]["reward_funcs"]
    assert checkpoint_rewards[1] == {"name": "format", "weight": 0.1}
    changed = [checkpoint_rewards[0], {"name": "format", "weight": 0.3}, *checkpoint_rewards[2:]]
    with pytest.warns(UserWarning, match="other reward functions") as caught:
        build_cli(_fit_args(tmp_path / "resumed", "--ckpt_path", str(tiny_checkpoint),
                            "--data.reward_funcs", json.dumps(changed), steps=2))
    [message] = [str(warning.message) for warning in caught if "reward functions" in str(warning.message)]
    assert "\n  reward 'format': weight 0.1 in the checkpoint, 0.3 now\n" in message
    assert message.count("\n  reward ") == 1
    assert _last_step(tmp_path / "resumed") == 2


def test_a_resume_with_other_reward_functions_on_two_nodes_is_warned_of_by_rank_0_alone(tmp_path):
    """``--ckpt_path PATH`` on 2 nodes x 1 process under Lightning's own launcher (each node's process given its
    ``NODE_RANK``): the checkpoint is compared as the command line is read, before any Trainer set this process's
    rank, and rank 1 took itself for rank 0, so every node warned of the other rewards; rank 0 alone does."""
    from tools.harness import free_port, repo_env

    layout = ["--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.accelerator", "cpu",
              "--trainer.limit_val_batches", "0"]
    first = forked_cli.run_ranks([*_fit_args(Path("run"), *layout, steps=1)], tmp_path, free_port(), 120,
                                 env=repo_env())
    assert [code for code, _, _ in first] == [0, 0], "\n\n".join(output[-3000:] for _, output, _ in first)
    (checkpoint,) = (tmp_path / "run").rglob("last.ckpt")
    changed = _hparams(checkpoint)[1]["reward_funcs"][:-1]  # one removed
    argv = _fit_args(Path("run"), *layout, "--data.reward_funcs", json.dumps(changed), "--ckpt_path",
                     str(checkpoint), steps=2)
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), 120, env=repo_env())
    shown = "\n\n".join(output[-3000:] for _, output, _ in outputs)
    assert [code for code, _, _ in outputs] == [0, 0], shown
    warned = [output.count("reward 'char_fraction': removed") for _, output, _ in outputs]
    assert warned == [1, 0], shown


def _with_tuples(value):
    """``value`` with each list in it a tuple: a Python run's settings as releases saved them before they saved plain
    YAML (AdamW's betas, stop strings, LoRA's layer pairs)."""
    if isinstance(value, dict):
        return {key: _with_tuples(item) for key, item in value.items()}
    if isinstance(value, list):
        return tuple(_with_tuples(item) for item in value)
    return value


def test_a_checkpoint_saved_with_tuples_resumes_where_the_run_has_lists(tmp_path, tiny_checkpoint, capsys):
    """A checkpoint's hyperparameters hold lists, or tuples where an earlier release saved a Python run's: a resume
    compares a tuple and the list of its values as one setting, at any depth (LoRA's layer_replication: a list of
    pairs), either way round, and still names a value that differs."""
    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    assert checkpoint["hyper_parameters"]["betas"] == [0.9, 0.99]  # the tiny run's, saved as plain YAML
    for section in ("hyper_parameters", "datamodule_hyper_parameters"):
        checkpoint[section] = _with_tuples(checkpoint[section])
    older = tmp_path / "older.ckpt"
    torch.save(checkpoint, older)
    build_cli(_fit_args(tmp_path / "resumed", "--ckpt_path", str(older), steps=2))
    assert "in the checkpoint" not in capsys.readouterr().err and _last_step(tmp_path / "resumed") == 2
    module, data = _hparams(tiny_checkpoint)
    pairs = {"r": 4, "layer_replication": [[0, 1], [1, 2]]}
    checkpoint["hyper_parameters"]["peft_config"] = _with_tuples(pairs)
    torch.save(checkpoint, older)
    check_resumable(older, {**module, "peft_config": pairs}, data)
    torch.save({**checkpoint, "hyper_parameters": {**checkpoint["hyper_parameters"], "peft_config": pairs}}, older)
    check_resumable(older, {**module, "peft_config": _with_tuples(pairs)}, data)
    with pytest.raises(ValueError, match=re.escape("model.peft_config.layer_replication: [[0, 1], [1, 2]] in the "
                                                   "checkpoint, ((0, 1), (1, 3)) now")):
        check_resumable(older, {**module, "peft_config": {"r": 4, "layer_replication": ((0, 1), (1, 3))}}, data)


def test_a_fit_writes_its_hyperparameters_as_plain_yaml(tiny_checkpoint):
    """The run's hparams.yaml (the TensorBoard logger's) and its checkpoint's hyperparameters are what
    yaml.safe_load reads back: no ``!!python/tuple`` or other Python tag."""
    import yaml

    logged = yaml.safe_load((tiny_checkpoint.parents[1] / "hparams.yaml").read_text())
    assert logged["model"] == "tiny-llama" and logged["sampling"]["group_size"] == 4
    module, data = _hparams(tiny_checkpoint)
    for saved in (module, data):
        assert yaml.safe_load(yaml.safe_dump(saved)) == saved
    assert {**module, **data} == {key: value for key, value in logged.items() if key != "_class_path"}


def _python_fit(root: Path, jsonl: Path, reward_funcs: list, steps: int, ckpt_path: str | None = None):
    """A fit from Python, no CLI: a TensorBoard logger (hparams.yaml) and Lightning's checkpoint of each epoch."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from datamodule_helpers import datamodule_arguments
    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.update.module import GRPOModule

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=TensorBoardLogger(root, name="logs"),
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    module = GRPOModule(model="tiny-llama")
    arguments = datamodule_arguments({"val_size": 0, "group_size": 2, "micro_group_size": 2, "max_new_tokens": 4,
                                      "reward_funcs": reward_funcs})
    datamodule = RolloutDataModule(**{**arguments, "prompts": None, "jsonl_path": jsonl})
    trainer.fit(module, datamodule, ckpt_path=ckpt_path)
    return trainer, module, datamodule


def test_a_python_fit_saves_its_reward_functions_and_paths_as_plain_values_and_resumes(tmp_path, monkeypatch):
    """Reward functions and a Path given from Python are saved as text that yaml.safe_load and
    torch.load(weights_only=True) read (Lightning's resume loads so): an importable function by the name a config
    gives it, a lambda or local function by a marker that says it cannot be imported, a Path as its text. A resume
    given the same functions compares them as the saved names; another function is another setting."""
    import yaml

    from datamodule_helpers import PROMPTS
    from lit_grpo.rollout.reward_functions import char_fraction_reward, format_reward
    from lit_grpo.runtime import checkpoints

    def zero(prompts, completions, **columns):
        return [0.0] * len(completions)

    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    lam = lambda prompts, completions, **columns: [1.0] * len(completions)  # noqa: E731
    rewards = [char_fraction_reward, {"name": zero, "weight": 0.5, "log_name": "zeros"}, lam]
    _, module, datamodule = _python_fit(tmp_path / "first", jsonl, rewards, steps=1)
    here = f"{__name__}:test_a_python_fit_saves_its_reward_functions_and_paths_as_plain_values_and_resumes"
    saved_rewards = ["lit_grpo.rollout.reward_functions:char_fraction_reward",
                     {"name": f"<not importable (a local function): {here}.<locals>.zero>", "weight": 0.5,
                      "log_name": "zeros"},
                     f"<not importable (a lambda): {here}.<locals>.<lambda>>"]
    logged = yaml.safe_load((tmp_path / "first" / "logs" / "version_0" / "hparams.yaml").read_text())
    assert logged["reward_funcs"] == saved_rewards and logged["jsonl_path"] == str(jsonl)
    [ckpt] = (tmp_path / "first" / "logs" / "version_0" / "checkpoints").glob("*.ckpt")
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["datamodule_hyper_parameters"]
    assert saved["reward_funcs"] == saved_rewards and saved["jsonl_path"] == str(jsonl)
    # the run kept the objects it was given
    assert datamodule.jsonl_path is jsonl
    assert [reward.fn for reward in datamodule.reward_funcs] == [char_fraction_reward, zero, lam]

    trainer, _, _ = _python_fit(tmp_path / "resumed", jsonl, rewards, steps=2, ckpt_path=str(ckpt))
    assert trainer.global_step == 2
    # where the comparison covers the rewards, the same functions given again are the saved names; another is not
    monkeypatch.setitem(checkpoints.RESUME_SETTINGS, "datamodule_hyper_parameters", ("reward_funcs", "jsonl_path"))
    check_resumable(ckpt, module.hparams, {**datamodule.hparams, "reward_funcs": rewards, "jsonl_path": jsonl})
    with pytest.raises(ValueError, match=re.escape("data.reward_funcs: ['lit_grpo.rollout.reward_functions:"
                                                   "char_fraction_reward', ")):
        check_resumable(ckpt, module.hparams, {**datamodule.hparams, "reward_funcs": [format_reward, *rewards[1:]]})


def test_a_resume_compares_no_setting_that_neither_run_reads(tmp_path, tiny_checkpoint, capsys):
    """A loss setting another loss type never reads (warned as ignored when the run started), or a sampler
    correction's bounds with mode none, may differ: dropping it on resume changes nothing. One that either run
    reads is still compared."""
    from lit_grpo.update.resume_settings import unread_settings

    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    hparams = checkpoint["hyper_parameters"]
    assert hparams["loss"]["loss_type"] == "dapo" and hparams["loss"]["beta"] == 0
    hparams["loss"].update(vespo_k_pos=3.0, sapo_temperature_neg=2.0, kl_bias_correction=True)
    hparams["sampler_correction"].update(mode="none", clip_max=5.0)
    ignored = tmp_path / "ignored.ckpt"
    torch.save(checkpoint, ignored)
    module, data = _hparams(tiny_checkpoint)
    module["sampler_correction"] = {**module["sampler_correction"], "mode": "none"}
    check_resumable(ignored, module, data, unread=unread_settings)
    with pytest.raises(ValueError, match=re.escape("model.loss.vespo_k_pos: 3.0 in the checkpoint, 2.0 now")):
        check_resumable(ignored, {**module, "loss": {**module["loss"], "loss_type": "vespo"}}, data,
                        unread=unread_settings)
    with pytest.raises(ValueError, match=re.escape("model.loss.kl_bias_correction: True in the checkpoint")):
        check_resumable(ignored, {**module, "loss": {**module["loss"], "beta": 0.1}}, data, unread=unread_settings)
    # the command line compares so too
    build_cli(_fit_args(tmp_path / "resumed", "--ckpt_path", str(ignored), "--model.sampler_correction.mode", "none",
                        steps=2))
    assert "in the checkpoint" not in capsys.readouterr().err


def test_a_resume_compares_the_entropy_bonus_and_its_control_only_where_a_run_reads_them(tmp_path, tiny_checkpoint):
    """entropy_coef is compared (an older checkpoint without it ran as 0) but where both runs have the adaptive
    control, whose saved state replaces it; the control's settings only where either run has it on: without it
    neither reads them."""
    from lit_grpo.update.resume_settings import unread_settings

    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    loss = checkpoint["hyper_parameters"]["loss"]
    assert loss["entropy_coef"] == 0.0 and loss["use_adaptive_entropy"] is False
    loss.update(entropy_target=3.0, entropy_coef_delta=0.01)  # set, and warned about as ignored, without the control
    saved = tmp_path / "entropy.ckpt"
    torch.save(checkpoint, saved)
    module, data = _hparams(tiny_checkpoint)
    check_resumable(saved, module, data, unread=unread_settings)
    with pytest.raises(ValueError, match=re.escape("model.loss.entropy_target: 3.0 in the checkpoint, 0.2 now")):
        check_resumable(saved, {**module, "loss": {**module["loss"], "use_adaptive_entropy": True}}, data,
                        unread=unread_settings)
    with pytest.raises(ValueError, match=re.escape("model.loss.entropy_coef: 0.0 in the checkpoint, 0.1 now")):
        check_resumable(saved, {**module, "loss": {**module["loss"], "entropy_coef": 0.1}}, data,
                        unread=unread_settings)
    # under the adaptive control in both runs the checkpoint's state replaces the starting coefficient
    adaptive = {**loss, "use_adaptive_entropy": True}
    checkpoint["hyper_parameters"]["loss"] = adaptive
    torch.save(checkpoint, tmp_path / "adaptive.ckpt")
    check_resumable(tmp_path / "adaptive.ckpt", {**module, "loss": {**adaptive, "entropy_coef": 0.1}}, data,
                    unread=unread_settings)
    checkpoint["hyper_parameters"]["loss"] = loss
    for name in ("entropy_coef", "use_adaptive_entropy", "entropy_target", "entropy_coef_delta"):
        loss.pop(name)  # as if saved before the bonus existed: it ran as off
    older = tmp_path / "older.ckpt"
    torch.save(checkpoint, older)
    defaults = {"model": {"loss": {"entropy_coef": 0.0, "use_adaptive_entropy": False, "entropy_target": 0.2,
                                   "entropy_coef_delta": 0.005}}}
    check_resumable(older, module, data, defaults=defaults, unread=unread_settings)
    with pytest.raises(ValueError, match=re.escape("model.loss.use_adaptive_entropy: False in the checkpoint")):
        check_resumable(older, {**module, "loss": {**module["loss"], "use_adaptive_entropy": True}}, data,
                        defaults=defaults, unread=unread_settings)


def test_a_setting_an_older_checkpoint_lacks_reads_as_its_default(tmp_path, tiny_checkpoint, capsys):
    """A release that adds a setting still resumes the checkpoints of the releases before it: the setting they
    lack ran as its default, and only a run that sets it otherwise is refused."""
    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    default_epsilon = checkpoint["hyper_parameters"]["loss"].pop("epsilon_low")  # as if saved before both existed
    del checkpoint["hyper_parameters"]["mask_truncated_completions"]
    del checkpoint["hyper_parameters"]["multi_objective_aggregation"]
    older = tmp_path / "older.ckpt"
    torch.save(checkpoint, older)
    module, data = _hparams(tiny_checkpoint)
    with pytest.raises(ValueError) as error:  # with no defaults to read them as, they are named
        check_resumable(older, module, data)
    assert "model.loss.epsilon_low: None in the checkpoint" in str(error.value)
    assert "model.mask_truncated_completions: None in the checkpoint, False now" in str(error.value)
    assert "model.multi_objective_aggregation: None in the checkpoint, 'sum_then_normalize' now" in str(error.value)
    defaults = {"model": {"loss": {"epsilon_low": default_epsilon}, "mask_truncated_completions": False,
                          "multi_objective_aggregation": "sum_then_normalize"}}
    check_resumable(older, module, data, defaults=defaults)
    with pytest.raises(ValueError, match=r"\n  model.multi_objective_aggregation: 'sum_then_normalize' in the "
                                         r"checkpoint, 'normalize_then_sum' now\nUse"):
        check_resumable(older, {**module, "multi_objective_aggregation": "normalize_then_sum"}, data,
                        defaults=defaults)
    with pytest.raises(ValueError, match=r"\n  model.loss.epsilon_low: 0.2 in the checkpoint, 0.3 now\nUse"):
        check_resumable(older, {**module, "loss": {**module["loss"], "epsilon_low": 0.3}}, data, defaults=defaults)

    # the command line reads its defaults from its own parser
    with pytest.raises(SystemExit) as exit_info:
        build_cli(_fit_args(tmp_path / "other", "--ckpt_path", str(older), "--model.loss.epsilon_low", "0.3", steps=2))
    assert exit_info.value.code == 2
    assert "model.loss.epsilon_low: 0.2 in the checkpoint, 0.3 now" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        build_cli(_fit_args(tmp_path / "gdpo", "--ckpt_path", str(older), "--model.multi_objective_aggregation",
                            "normalize_then_sum", steps=2))
    assert exit_info.value.code == 2
    assert ("model.multi_objective_aggregation: 'sum_then_normalize' in the checkpoint, 'normalize_then_sum' now"
            in capsys.readouterr().err)
    build_cli(_fit_args(tmp_path / "same", "--ckpt_path", str(older), steps=2))
    resumed = tmp_path / "same" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert read_checkpoint_header(resumed)["global_step"] == 2


def test_a_checkpoint_holding_settings_under_other_names_lacks_none_of_them(tmp_path, tiny_checkpoint):
    """A checkpoint that lacks a setting but holds ones this release does not have (saved before a rename: the loss
    settings were flat before model.loss) ran as those, not as the defaults: it is refused, naming them."""
    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    hparams = checkpoint["hyper_parameters"]
    hparams.update(hparams.pop("loss"), beta=0.04, importance_sampling_mode="none")
    del hparams["sampler_correction"]
    flat = tmp_path / "flat.ckpt"
    torch.save(checkpoint, flat)
    module, data = _hparams(tiny_checkpoint)
    defaults = {"model": {"loss": module["loss"], "sampler_correction": module["sampler_correction"]}}
    with pytest.raises(ValueError) as error:
        check_resumable(flat, module, data, defaults=defaults)
    assert "model.loss.beta: None in the checkpoint, 0.0 now" in str(error.value)
    assert "holds model.loss_type, model.epsilon_low" in str(error.value)
    assert "model.beta" in str(error.value) and "model.importance_sampling_mode" in str(error.value)


def test_a_sharded_checkpoint_folder_is_checked_by_its_header(tmp_path, tiny_checkpoint):
    """An FSDP2 run's checkpoint is a folder: the shards and ``meta.pt``, the rest of the checkpoint as Lightning's
    ModelParallelStrategy writes it. Its settings are compared as a file's are; a folder without it is named."""
    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"checkpoint folder .*last.ckpt has no meta.pt: it is not a sharded"):
        check_resumable(folder, *_hparams(tiny_checkpoint))
    del checkpoint["state_dict"], checkpoint["optimizer_states"]
    torch.save(checkpoint, folder / "meta.pt")
    module, data = _hparams(tiny_checkpoint)
    check_resumable(folder, module, data)
    check_resumable(folder, module, data, evaluate=True)
    with pytest.raises(ValueError, match=r"model.model: 'tiny-llama' in the checkpoint, 'tiny-qwen2' now"):
        check_resumable(folder, {**module, "model": "tiny-qwen2"}, data)


def test_a_sharded_checkpoints_header_must_hold_the_loops_to_resume(tmp_path, tiny_checkpoint):
    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    del checkpoint["state_dict"], checkpoint["optimizer_states"], checkpoint["loops"]
    torch.save(checkpoint, folder / "meta.pt")
    with pytest.raises(ValueError, match=r"last.ckpt is not a lit_grpo training checkpoint: it has no loops \("):
        check_resumable(folder, *_hparams(tiny_checkpoint))
    check_resumable(folder, *_hparams(tiny_checkpoint), evaluate=True)  # evaluating it needs no loop state


def test_a_setting_saved_as_a_list_is_the_same_as_that_tuple(tmp_path, tiny_checkpoint):
    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["peft_config"] = {"r": 8, "target_modules": ["q_proj", "v_proj"],
                                                     "layers": {"ids": [0, 1]}}
    saved = tmp_path / "lists.ckpt"
    torch.save(checkpoint, saved)
    module, data = _hparams(saved)
    as_tuples = {"r": 8, "target_modules": ("q_proj", "v_proj"), "layers": {"ids": (0, 1)}}  # nested too
    check_resumable(saved, {**module, "peft_config": as_tuples}, data)
    with pytest.raises(ValueError, match=r"model.peft_config.target_modules: \['q_proj', 'v_proj'\] in the "
                                         r"checkpoint, \('q_proj',\) now"):
        check_resumable(saved, {**module, "peft_config": {**as_tuples, "target_modules": ("q_proj",)}}, data)


def test_a_dtype_is_the_same_setting_under_either_of_its_names(tmp_path, tiny_checkpoint):
    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["dtype"] = "bfloat16"
    saved = tmp_path / "bf16.ckpt"
    torch.save(checkpoint, saved)
    module, data = _hparams(saved)
    check_resumable(saved, {**module, "dtype": "bf16"}, data)
    with pytest.raises(ValueError, match=r"model.dtype: 'bfloat16' in the checkpoint, 'float32' now"):
        check_resumable(saved, {**module, "dtype": "float32"}, data)


def test_a_null_dtype_is_the_dtype_its_model_loads_in(tmp_path, tiny_checkpoint):
    """``model.dtype: null`` keeps the model's own dtype: tiny-llama's float32, so null against float32 (either
    way round) is one setting, and against bfloat16 the difference names what null loaded as. A model directory
    saved in bfloat16 loads in bfloat16: there null is bfloat16, not float32."""
    module, data = _hparams(tiny_checkpoint)
    assert module["dtype"] is None and module["model"] == "tiny-llama"
    check_resumable(tiny_checkpoint, {**module, "dtype": "float32"}, data)
    with pytest.raises(ValueError, match=re.escape(
            "model.dtype: None (its model's own dtype, float32) in the checkpoint, 'bfloat16' now")):
        check_resumable(tiny_checkpoint, {**module, "dtype": "bfloat16"}, data)
    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["dtype"] = "fp32"
    torch.save(checkpoint, tmp_path / "fp32.ckpt")
    check_resumable(tmp_path / "fp32.ckpt", {**module, "dtype": None}, data)

    from lit_grpo.runtime.models import load_model_and_tokenizer, loaded_dtype

    model, tokenizer = load_model_and_tokenizer("tiny-llama", "bfloat16")
    model.save_pretrained(tmp_path / "bf16-model")
    tokenizer.save_pretrained(tmp_path / "bf16-model")
    assert loaded_dtype(str(tmp_path / "bf16-model")) == torch.bfloat16
    assert loaded_dtype("tiny-llama") == torch.float32 and loaded_dtype("owner/not-cached-here") is None
    checkpoint["hyper_parameters"].update(model=str(tmp_path / "bf16-model"), dtype=None)
    torch.save(checkpoint, tmp_path / "bf16.ckpt")
    module["model"] = str(tmp_path / "bf16-model")
    check_resumable(tmp_path / "bf16.ckpt", {**module, "dtype": "bf16"}, data)
    checkpoint["hyper_parameters"]["dtype"] = "float32"
    torch.save(checkpoint, tmp_path / "bf16-model-in-fp32.ckpt")
    with pytest.raises(ValueError, match=re.escape(
            "model.dtype: 'float32' in the checkpoint, None (its model's own dtype, bfloat16) now")):
        check_resumable(tmp_path / "bf16-model-in-fp32.ckpt", {**module, "dtype": None}, data)


@pytest.mark.parametrize("subcommand", ["validate", "fit"])
def test_a_checkpoint_of_other_weight_shapes_is_named_with_the_first_differing_weight(
        tmp_path, tiny_checkpoint, capsys, subcommand):
    """A checkpoint whose settings match but whose weights have other shapes (a model folder changed since it was
    saved, an edited file) ends ``validate`` and a resume on one error line naming the file, the first differing
    weight and both shapes, not on load_state_dict's traceback."""
    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    names = [name for name in checkpoint["state_dict"] if name.endswith("mlp.up_proj.weight")]
    for name in names:
        rows, columns = checkpoint["state_dict"][name].shape
        checkpoint["state_dict"][name] = torch.zeros(2 * rows, columns)
    other = tmp_path / "other-shapes.ckpt"
    torch.save(checkpoint, other)
    args = _fit_args(tmp_path / "run", "--ckpt_path", str(other), "--trainer.limit_val_batches", "1", steps=2)
    err = _refused(capsys, [subcommand, *args[1:]])
    assert (f"error: --ckpt_path: checkpoint {other} holds weights of other shapes than this run's model: "
            f"{names[0]} is [{2 * rows}, {columns}] there, [{rows}, {columns}] in the model "
            f"({len(names) - 1} more weights differ too)") in err
    assert "Traceback" not in err and len(names) > 1


def test_the_cli_resumes_a_null_dtype_run_with_float32(tmp_path, tiny_checkpoint):
    """A run saved with ``model.dtype: null`` (tiny.yaml's) resumed with ``--model.dtype float32``: one setting."""
    build_cli(_fit_args(tmp_path, "--ckpt_path", str(tiny_checkpoint), "--model.dtype", "float32", steps=2))
    assert _last_step(tmp_path) == 2


def _refused(capsys, args: list[str]) -> str:
    """What the CLI printed when it ended a run on a bad setting: an ``error:`` line and exit 2, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        build_cli(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_the_cli_refuses_a_bad_checkpoint_before_loading_it(tmp_path, tiny_checkpoint, capsys):
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(tiny_checkpoint.read_bytes()[:1000])
    err = _refused(capsys, _fit_args(tmp_path / "run", "--ckpt_path", str(cut)))
    assert "error: --ckpt_path: checkpoint " in err and "cut.ckpt is cut short" in err
    err = _refused(capsys, _fit_args(tmp_path / "run", "--ckpt_path", str(tiny_checkpoint),
                                     "--data.sampling.group_size", "6"))
    assert "data.sampling.group_size: 4 in the checkpoint, 6 now" in err
    assert "does not exist" in _refused(capsys, _fit_args(tmp_path / "run", "--ckpt_path", str(tmp_path / "no.ckpt")))
    # validate only evaluates the weights: another G is fine there
    validate = ["validate", *_fit_args(tmp_path / "val", "--ckpt_path", str(tiny_checkpoint),
                                       "--data.sampling.group_size", "6", "--trainer.limit_val_batches", "1")[1:]]
    build_cli(validate)
    # and on other held-out prompts: it takes none of the fit's prompt stream (whose sampler drew from the rest)
    cli = build_cli([*validate, "--data.val_size", "8"])
    assert len(cli.datamodule.val_indices) == 8


def test_last_with_no_checkpoint_starts_a_new_run_and_then_resumes_it(tmp_path, caplog):
    cli = build_cli(_fit_args(tmp_path, "--ckpt_path", "last", steps=1))
    assert cli.trainer.global_step == 1 and _last_step(tmp_path) == 1
    assert f"--ckpt_path last: no last.ckpt under {tmp_path / 'lightning_logs'} yet; starting a new run" in caplog.text
    cli = build_cli(_fit_args(tmp_path, "--ckpt_path", "last", steps=2))
    assert "--ckpt_path last: resuming from" in caplog.text and _last_step(tmp_path) == 2
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0"]


@pytest.mark.parametrize("logger", [["--trainer.logger", "TensorBoardLogger", "--trainer.logger.version", "myrun"],
                                    ["--trainer.logger", "CSVLogger"]])
def test_last_finds_a_named_version_and_other_loggers_runs(tmp_path, caplog, logger):
    """TensorBoard's run folder is continued; CSV's logger starts a new one (continued, its writer would delete the
    metrics of the steps before the stop), and the next resume still finds the newest last.ckpt."""
    save_dir = ["--trainer.logger.save_dir", str(tmp_path)]
    build_cli(_fit_args(tmp_path, *logger, *save_dir, steps=1))
    cli = build_cli(_fit_args(tmp_path, *logger, *save_dir, "--ckpt_path", "last", steps=2))
    assert "--ckpt_path last: resuming from" in caplog.text and cli.trainer.global_step == 2
    runs = sorted((tmp_path / "lightning_logs").iterdir())
    if "CSVLogger" in logger:
        assert [run.name for run in runs] == ["version_0", "version_1"]
        with open(runs[0] / "metrics.csv", newline="") as file:
            assert {row["step"] for row in csv.DictReader(file) if row.get("train/loss")} == {"0"}
        cli = build_cli(_fit_args(tmp_path, *logger, *save_dir, "--ckpt_path", "last", steps=3))
        assert cli.trainer.global_step == 3
    else:
        assert len(runs) == 1  # one run folder, continued


def test_a_history_checkpoint_keeps_last_ckpt_with_run_checkpoint_and_a_second_writer_is_refused(tmp_path, capsys):
    history = ["--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={tmp_path / 'history'}",
               "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1"]
    cli = build_cli(_fit_args(tmp_path, *history, steps=1))
    assert sum(isinstance(cb, RunCheckpoint) for cb in cli.trainer.callbacks) == 1 and _last_step(tmp_path) == 1
    err = _refused(capsys, _fit_args(tmp_path / "two", *history, "--trainer.callbacks.save_last=true", steps=1))
    assert "ModelCheckpoint(save_last=True) would write last.ckpt beside lit_grpo's RunCheckpoint" in err


def test_an_incompatible_last_checkpoint_is_refused_without_a_traceback(tmp_path, tiny_checkpoint, capsys):
    _run_copied_from(tiny_checkpoint, tmp_path)
    err = _refused(capsys, _fit_args(tmp_path, "--ckpt_path", "last", "--data.sampling.group_size", "6", steps=2))
    assert "error: --ckpt_path last: " in err and "data.sampling.group_size: 4 in the checkpoint, 6 now" in err


def test_validate_last_validates_the_newest_checkpoint_and_refuses_when_there_is_none(tmp_path, tiny_checkpoint,
                                                                                     caplog, capsys):
    validate = ["validate", *_fit_args(tmp_path, "--ckpt_path", "last", "--trainer.limit_val_batches", "1")[1:]]
    assert "--ckpt_path last: no last.ckpt under " in _refused(capsys, validate)
    _run_copied_from(tiny_checkpoint, tmp_path)
    build_cli(validate)
    checkpoint = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"--ckpt_path last: validating {checkpoint}" in caplog.text


@pytest.mark.parametrize("subcommand, given", [("fit", "path"), ("fit", "last"), ("validate", "path"),
                                               ("validate", "last")])
def test_the_cli_compares_a_checkpoints_settings_once(tmp_path, tiny_checkpoint, monkeypatch, subcommand, given):
    """``lit-grpo`` compares the checkpoint it is given, or ``--ckpt_path last`` finds, before anything loads it, and
    tells the module, whose own check as Lightning loads it (a script's) is then not run a second time."""
    from lit_grpo.runtime import checkpoints

    compared = []
    original = checkpoints.check_checkpoint_settings

    def counted(checkpoint, path, *args, **kwargs):
        compared.append(Path(path).resolve())
        return original(checkpoint, path, *args, **kwargs)

    monkeypatch.setattr(checkpoints, "check_checkpoint_settings", counted)
    _run_copied_from(tiny_checkpoint, tmp_path)
    checkpoint = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    args = _fit_args(tmp_path, "--ckpt_path", "last" if given == "last" else str(checkpoint), steps=2)
    build_cli([subcommand, *args[1:], "--trainer.limit_val_batches", "1"] if subcommand == "validate" else args)
    assert compared == [checkpoint.resolve()]


def _killed_swap(folder: Path) -> tuple[Path, Path]:
    """A folder holding an older ``last-v1.ckpt`` and a sharded save of ``last.ckpt`` killed between its renames
    (the old one set aside, the new one staged, by a process that has ended): ``(last.ckpt, its staged copy)``."""
    from lit_grpo.runtime.checkpoints import staging_path

    older = folder / "last-v1.ckpt"
    older.write_bytes(b"x")
    os.utime(older, (1, 1))
    last = folder / "last.ckpt"
    gone = subprocess.Popen(["true"])
    gone.wait()
    _folder(folder / f".last.ckpt.{gone.pid}.replaced", "old")
    _folder(staging_path(last, gone.pid), "new")
    return last, staging_path(last, gone.pid)


def test_last_finds_a_killed_swaps_checkpoint_before_rank_0_finishes_it(tmp_path):
    """A sharded save killed between its renames: the checkpoint it completes is the newest one, found as
    ``last.ckpt`` whether or not rank 0 has finished the swap yet (a rank that looks while it renames finds the
    same)."""
    from lit_grpo.runtime.checkpoints import finish_interrupted_swaps, interrupted_swaps

    last, staged = _killed_swap(tmp_path)
    assert interrupted_swaps(tmp_path) == [(last, staged)]
    assert find_last_checkpoint([tmp_path]) == last
    assert finish_interrupted_swaps(tmp_path, clean=False) == [last] and (last / "shard").read_text() == "new"
    assert find_last_checkpoint([tmp_path]) == last and interrupted_swaps(tmp_path) == []


def test_last_finds_a_killed_swaps_checkpoint_that_rank_0_finishes_while_it_looks(tmp_path, monkeypatch):
    """Rank 0 finishes the swap between this rank's two listings (its interrupted swaps and the folder's names):
    the checkpoint is in one or the other, never in neither, so the older one is not taken for the newest."""
    from lit_grpo.runtime import checkpoints

    last, _ = _killed_swap(tmp_path)
    listed = checkpoints.interrupted_swaps

    def listed_then_finished(folder):
        swaps = listed(folder)
        for target, staged in swaps:  # rank 0 finishes them, just after this rank listed them
            os.replace(staged, target)
        return swaps

    monkeypatch.setattr(checkpoints, "interrupted_swaps", listed_then_finished)
    assert find_last_checkpoint([tmp_path]) == last


def test_ranks_that_find_different_checkpoints_are_named_on_every_rank():
    from lit_grpo.cli.checkpoint_agreement import CheckpointsDiffer, check_same_checkpoint
    from lit_grpo.runtime.distributed import RaisedOnEveryRank

    from lit_grpo.runtime.checkpoints import CheckpointIdentity

    ours = CheckpointIdentity("version_0/checkpoints/last.ckpt", 2, "0123456789abcdef")
    check_same_checkpoint([("/a/last.ckpt", ours)] * 3)
    check_same_checkpoint([("/a/last.ckpt", ours), ("/mnt/a/last.ckpt", ours)])  # one file, mounted elsewhere
    check_same_checkpoint([None, None])
    older = CheckpointIdentity("version_0/checkpoints/last.ckpt", 1, "fedcba9876543210")
    with pytest.raises(CheckpointsDiffer) as raised:
        check_same_checkpoint([("/a/last.ckpt", ours), ("/a/last.ckpt", ours), ("/b/last.ckpt", older), None])
    assert str(raised.value).startswith(
        "--ckpt_path last: the ranks found different checkpoints: rank 0: /a/last.ckpt (version_0/checkpoints/"
        "last.ckpt, step 2, content 0123456789abcdef); rank 2: /b/last.ckpt (version_0/checkpoints/last.ckpt, step 1, "
        "content fedcba9876543210); rank 3: no last.ckpt (a new run).")
    assert isinstance(raised.value, RaisedOnEveryRank)
    with pytest.raises(CheckpointsDiffer, match="rank 1: /a/last.ckpt"):  # the same step, other content
        check_same_checkpoint([("/a/last.ckpt", ours), ("/a/last.ckpt", dataclasses.replace(ours, fingerprint="0"))])


def test_a_checkpoints_identity_is_its_place_under_the_root_its_step_and_content_not_its_path(tmp_path):
    root, mount = tmp_path / "root", tmp_path / "elsewhere"
    path = root / "version_0" / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save({"global_step": 3, "state_dict": {"w": torch.zeros(2)}}, path)
    shutil.copytree(root, mount)
    identity = checkpoint_identity(path, root)
    assert identity.name == "version_0/checkpoints/last.ckpt" and identity.global_step == 3
    assert checkpoint_identity(mount / "version_0" / "checkpoints" / "last.ckpt", mount) == identity
    torch.save({"global_step": 3, "state_dict": {"w": torch.ones(2)}}, path)  # other weights, the same step
    assert checkpoint_identity(path, root).fingerprint != identity.fingerprint
    assert checkpoint_identity(path).name == "last.ckpt"


@pytest.mark.parametrize("findings", [[None, None], ["/a/last.ckpt", "/a/last.ckpt"]])
def test_validate_with_no_rank_finding_a_checkpoint_ends_every_rank_once_they_can_talk(monkeypatch, findings):
    """``validate --ckpt_path last`` under several processes: where no rank found a checkpoint every rank ends at
    setup on the same error (NoCheckpointFound); where every rank found rank 0's, validation goes on; ``fit``
    (no ``missing``) starts a new run where none was found."""
    import torch.distributed

    from lit_grpo.cli import checkpoint_agreement
    from lit_grpo.runtime.distributed import RaisedOnEveryRank

    monkeypatch.setattr(checkpoint_agreement, "is_multi_process", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    gathered = [(None if path is None else (path, checkpoint_identity(path)), None) for path in findings]
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda out, _: out.__setitem__(slice(None), gathered))
    missing = "--ckpt_path last: no last.ckpt under /runs to validate; give a checkpoint path"
    checkpoint_agreement.SameCheckpointOnEveryRank(None, None).setup(None, None, "fit")
    if findings[0] is not None:
        checkpoint_agreement.SameCheckpointOnEveryRank(Path(findings[0]), missing).setup(None, None, "validate")
        return
    with pytest.raises(checkpoint_agreement.NoCheckpointFound, match=re.escape(missing)) as raised:
        checkpoint_agreement.SameCheckpointOnEveryRank(None, missing).setup(None, None, "validate")
    assert isinstance(raised.value, RaisedOnEveryRank)


def test_validate_last_on_two_ranks_with_no_checkpoint_ends_before_any_prompt_is_built(tmp_path):
    """``validate --ckpt_path last`` on 2 ranks where no rank finds a checkpoint ends every rank on that error before
    the data module sets up (Lightning sets it up before any callback): its prompt file, missing here, is never
    read."""
    from tools.harness import free_port, repo_env

    argv = ["validate", *_fit_args(Path("run"), "--ckpt_path", "last", "--data.task", "null", "--data.jsonl_path",
                                   "missing.jsonl", "--trainer.num_nodes", "2", "--trainer.devices", "1",
                                   "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu")[1:]]
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), 180, env=repo_env())
    shown = "\n\n".join(output[-3000:] for _, output, _ in outputs)
    assert [code for code, _, _ in outputs] == [2, 2], shown
    missing = "--ckpt_path last: no last.ckpt under run/lightning_logs to validate"
    assert all(missing in output for _, output, _ in outputs), shown
    assert "prompt file" not in shown, shown


def test_a_ckpt_path_refused_on_several_nodes_ends_every_rank_before_any_prompt_is_built(tmp_path):
    """``--ckpt_path PATH`` on 2 nodes x 1 process, a file no node has: every rank ends on the refusals before the
    data module sets up, as for ``--ckpt_path last``: its prompt file, missing here, is never read."""
    from tools.harness import free_port, repo_env

    argv = _fit_args(Path("run"), "--ckpt_path", "nowhere.ckpt", "--data.task", "null", "--data.jsonl_path",
                     "missing.jsonl", "--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.strategy", "ddp",
                     "--trainer.accelerator", "cpu")
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), 180, env=repo_env())
    shown = "\n\n".join(output[-3000:] for _, output, _ in outputs)
    assert [code for code, _, _ in outputs] == [2, 2], shown
    assert all("CheckpointRefused: rank 0, 1: --ckpt_path: checkpoint nowhere.ckpt does not exist" in output
               for _, output, _ in outputs), shown
    assert "prompt file" not in shown, shown


def test_two_ranks_resume_from_rank_0s_last_checkpoint_or_end_when_they_see_different_ones(tmp_path):
    """``--ckpt_path last`` on 2 nodes x 1 process: each rank looks for the newest last.ckpt itself, before the ranks
    can talk. Where only rank 0 sees one (nodes without a shared file system: each rank in a folder of its own, the
    run's root relative), both end on one error naming what each found, before anything is restored; where both
    see rank 0's, both resume it."""
    from tools.harness import free_port, repo_env

    folders = (tmp_path / "node0", tmp_path / "node1")
    for folder in folders:
        folder.mkdir()
    build_cli(_fit_args(folders[0] / "run", steps=1))
    found = folders[0] / "run" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert found.is_file()
    argv = [*_fit_args(Path("run"), "--ckpt_path", "last", "--trainer.limit_val_batches", "0", steps=2),
            "--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.strategy", "ddp",
            "--trainer.accelerator", "cpu"]
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), 180, env=repo_env(), rank_folders=folders)
    shown = "\n\n".join(output[-3000:] for _, output, _ in outputs)
    assert [code for code, _, _ in outputs] == [2, 2], shown
    for _, output, _ in outputs:
        assert re.search(r"--ckpt_path last: the ranks found different checkpoints: rank 0: run/lightning_logs/"
                         r"version_0/checkpoints/last.ckpt \(version_0/checkpoints/last.ckpt, step 1, content \w+\); "
                         r"rank 1: no last.ckpt \(a new run\)", output), shown
    assert "Restoring states" not in shown and "Traceback" not in shown
    # validate needs a checkpoint: a rank that found none ended before the ranks could talk, and rank 0 waited
    validate = ["validate", *argv[1:argv.index("--trainer.max_steps")], *argv[argv.index("--ckpt_path"):]]
    outputs = forked_cli.run_ranks(validate, tmp_path, free_port(), 180, env=repo_env(), rank_folders=folders)
    shown = "\n\n".join(output[-3000:] for _, output, _ in outputs)
    assert [code for code, _, _ in outputs] == [2, 2], shown
    assert all("the ranks found different checkpoints" in output for _, output, _ in outputs), shown
    outputs = forked_cli.run_ranks(argv, folders[0], free_port(), 180, env=repo_env())
    assert [code for code, _, _ in outputs] == [0, 0], "\n\n".join(output[-3000:] for _, output, _ in outputs)
    assert _last_step(folders[0] / "run") == 2


def test_a_checkpoint_refused_on_one_rank_is_named_by_every_rank():
    from lit_grpo.cli.checkpoint_agreement import CheckpointRefused, check_no_checkpoint_refused
    from lit_grpo.runtime.distributed import RaisedOnEveryRank

    check_no_checkpoint_refused([None, None])
    with pytest.raises(CheckpointRefused) as raised:
        check_no_checkpoint_refused(["bad a", None, "bad b", "bad a"])
    assert str(raised.value) == "rank 0, 3: bad a; rank 2: bad b"
    assert isinstance(raised.value, RaisedOnEveryRank)


def test_a_checkpoint_one_node_refuses_ends_every_rank_once_they_can_talk(tmp_path, tiny_checkpoint):
    """On 2 nodes x 1 process, rank 1's node holds a cut-short copy of rank 0's last.ckpt (``--ckpt_path last``), or
    lacks the file ``--ckpt_path PATH`` names: rank 1 refuses it before the ranks can talk, and both end on its
    refusal, at setup, instead of rank 1 ending alone and rank 0 waiting for it to connect."""
    from tools.harness import free_port, repo_env

    folders = (tmp_path / "node0", tmp_path / "node1")
    _run_copied_from(tiny_checkpoint, folders[0] / "run")
    found = Path("run") / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    (folders[1] / found).parent.mkdir(parents=True)
    (folders[1] / found).write_bytes((folders[0] / found).read_bytes()[:1000])
    two = ["--trainer.limit_val_batches", "0", "--trainer.num_nodes", "2", "--trainer.devices", "1",
           "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]
    for given, refusal in (("last", f"rank 1: --ckpt_path last: checkpoint {found} is cut short"),
                           (str(found), f"rank 1: --ckpt_path: checkpoint {found} does not exist")):
        if given != "last":
            (folders[1] / found).unlink()
        argv = [*_fit_args(Path("run"), "--ckpt_path", given, *two, steps=2)]
        outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), 60, env=repo_env(), rank_folders=folders)
        shown = "\n\n".join(output[-3000:] for _, output, _ in outputs)
        assert [code for code, _, _ in outputs] == [2, 2], shown
        for rank, (_, output, _) in enumerate(outputs):
            assert f"error: {refusal}" in output, shown
            assert f"lit_grpo: rank {rank} of 2 failed: CheckpointRefused: {refusal}" in output, shown
        assert "Restoring states" not in shown and "Traceback" not in shown


def test_a_ckpt_path_file_that_one_rank_of_one_node_refuses_or_sees_otherwise_ends_every_rank(tmp_path,
                                                                                             tiny_checkpoint):
    """``--ckpt_path c.ckpt`` under torchrun on one node of 2 processes, rank 1 seeing another file there (each rank
    in a folder of its own): a cut-short copy, which rank 1 refuses, or one of other content, which it would load
    and train on as one run with rank 0's other weights. Both end on one error once they can talk, naming it."""
    from tools.harness import free_port, repo_env

    folders = (tmp_path / "node0", tmp_path / "node1")
    for folder in folders:
        folder.mkdir()
    saved = tiny_checkpoint  # only read: copied, or changed and saved elsewhere
    shutil.copy(saved, folders[0] / "c.ckpt")
    other = torch.load(saved, map_location="cpu", weights_only=False)
    weights = other["state_dict"]
    name = next(iter(weights))
    weights[name] = weights[name] + 1
    argv = [*_fit_args(Path("run"), "--ckpt_path", "c.ckpt", "--trainer.limit_val_batches", "0", steps=2),
            "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]
    for seen, error in (("cut", "CheckpointRefused: rank 1: --ckpt_path: checkpoint c.ckpt is cut short"),
                        ("other", "CheckpointsDiffer: --ckpt_path: the ranks found different checkpoints: rank 0: "
                                  "c.ckpt (c.ckpt, step 1, content ")):
        if seen == "cut":
            (folders[1] / "c.ckpt").write_bytes((folders[0] / "c.ckpt").read_bytes()[:1000])
        else:
            torch.save(other, folders[1] / "c.ckpt")
        outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), 60, env=repo_env(), rank_folders=folders,
                                       torchrun_nodes=1)
        shown = "\n\n".join(output[-3000:] for _, output, _ in outputs)
        assert [code for code, _, _ in outputs] == [2, 2], shown
        for rank, (_, output, _) in enumerate(outputs):
            assert f"lit_grpo: rank {rank} of 2 failed: {error}" in output, shown
        assert "Restoring states" not in shown and "Traceback" not in shown


def test_validate_last_with_no_checkpoint_on_any_rank_ends_every_rank_naming_it(tmp_path):
    """``validate --ckpt_path last`` on 2 nodes x 1 process where no rank finds a last.ckpt: both end on the same
    error (NoCheckpointFound) once they can talk, exit status 2, in seconds."""
    from tools.harness import free_port, repo_env

    argv = ["validate", "--config", TINY, "--trainer.default_root_dir", "run", "--ckpt_path", "last",
            "--torch_num_threads", "1", "--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.strategy",
            "ddp", "--trainer.accelerator", "cpu"]
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), 60, env=repo_env())
    shown = "\n\n".join(output[-3000:] for _, output, _ in outputs)
    assert [code for code, _, _ in outputs] == [2, 2], shown
    missing = "--ckpt_path last: no last.ckpt under run/lightning_logs to validate; give a checkpoint path"
    for rank, (_, output, _) in enumerate(outputs):
        assert f"error: {missing}" in output, shown
        assert f"lit_grpo: rank {rank} of 2 failed: NoCheckpointFound: {missing}; every rank stops" in output, shown
    assert "Traceback" not in shown


def test_two_ranks_resume_one_checkpoint_their_nodes_see_at_different_paths(tmp_path):
    """Nodes that mount one file system at different places find one last.ckpt at different absolute paths (here a
    checkpoint folder given relative to each node's working folder, which the checkpoint callback makes absolute,
    each node's holding the same file): both ranks resume it, as one run."""
    from tools.harness import free_port, repo_env

    folders = (tmp_path / "node0", tmp_path / "node1")
    checkpoint = ["--trainer.callbacks+=lit_grpo.callbacks.RunCheckpoint"]
    build_cli(_fit_args(folders[0] / "run", *checkpoint, f"--trainer.callbacks.dirpath={folders[0] / 'ckpt'}",
                        steps=1))
    shutil.copytree(folders[0] / "ckpt", folders[1] / "ckpt")  # the file's time kept, as one file system shows it
    argv = [*_fit_args(Path("run"), "--ckpt_path", "last", "--trainer.limit_val_batches", "0", *checkpoint,
                       "--trainer.callbacks.dirpath=ckpt", steps=2),
            "--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.strategy", "ddp",
            "--trainer.accelerator", "cpu"]
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), 120, env=repo_env(), rank_folders=folders)
    shown = "\n\n".join(output[-3000:] for _, output, _ in outputs)
    assert [code for code, _, _ in outputs] == [0, 0], shown
    assert "Restoring states" in outputs[0][1], shown
    assert torch.load(folders[0] / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False,
                      mmap=True)["global_step"] == 2


def test_last_finds_a_loggers_checkpoint_from_a_run_resumed_without_that_logger(tmp_path):
    # started with TensorBoard (ROOT/lightning_logs/version_0/checkpoints), resumed with trainer.logger false: the
    # trainer's root is searched, and it found nothing, so the run started over
    logged = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    logged.mkdir(parents=True)
    (logged / "last.ckpt").write_bytes(b"x")
    assert logged in run_checkpoint_folders(tmp_path)
    assert find_last_checkpoint(run_checkpoint_folders(tmp_path)) == logged / "last.ckpt"


def test_an_unwritable_checkpoint_folder_fails_before_the_first_step(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = _fit_args(tmp_path / "run", "--trainer.callbacks+=lit_grpo.callbacks.RunCheckpoint",
                     f"--trainer.callbacks.dirpath={blocker / 'checkpoints'}",
                     "--trainer.callbacks+=stop_helpers.LastCheckpointProbe")
    with pytest.raises(SystemExit) as exit_info:  # said as a bad setting is: one line, exit 2
        build_cli(args)
    assert exit_info.value.code == 2
    assert re.search(r"checkpoint folder .*a_file/checkpoints cannot be written", capsys.readouterr().err)
    with pytest.raises(OSError, match=r"GiB free, and one checkpoint of this run needs about"):
        check_writable(tmp_path, needed_bytes=1 << 60)


# ------------------------------------------------------------------------------------------------ the stop request
@pytest.fixture
def stop_clock(monkeypatch):
    """The stop handler's clock, moved by hand: ``stop_clock[0] += s``."""
    from lit_grpo.runtime import stop_signal

    now = [1000.0]
    monkeypatch.setattr(stop_signal, "_now", lambda: now[0])
    return now


def test_stop_signal_interrupts_only_abandonable_code_and_a_second_signal_interrupts_anything(stop_clock):
    from lit_grpo.runtime.stop_signal import COPY_WINDOW_S, STOP_SIGNAL, StopRequested

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a shell's background job
    STOP_SIGNAL.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # outside abandonable code: only recorded
        stop_clock[0] += COPY_WINDOW_S  # the next signal is the user's second, no copy of this one
        assert STOP_SIGNAL.signum == signal.SIGTERM
        with pytest.raises(StopRequested) as stop:  # a pending stop interrupts abandonable code on entry
            with STOP_SIGNAL.abandonable():
                pytest.fail("entered")
        assert stop.value.code == 143 and stop.value.signal_name == "SIGTERM"
        with STOP_SIGNAL.abandonable(enabled=False):  # several processes: never abandoned
            pass
        with pytest.raises(KeyboardInterrupt):  # the second signal: at once, anywhere
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        STOP_SIGNAL.restore()
    assert STOP_SIGNAL.signum is None and signal.getsignal(signal.SIGINT) is before  # restored as it was

    STOP_SIGNAL.install()
    try:
        with pytest.raises(StopRequested) as stop:  # inside abandonable code: interrupted where it is
            with STOP_SIGNAL.abandonable():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
                pytest.fail("not interrupted")
        assert stop.value.code == 130
    finally:
        STOP_SIGNAL.restore()


@pytest.mark.parametrize("closing", [False, True], ids=["as_the_scope_opens", "as_the_scope_closes"])
def test_a_signal_between_the_abandonable_flag_and_its_scope_leaves_no_scope_open(closing):
    """The interpreter runs a signal handler between any two bytecodes, so a stop may come right after
    ``abandonable`` has set its flag and before its ``try``, or in its ``finally`` before the flag is reset: the raise
    skips that reset. The next fit's first signal, during an update, must still be recorded only, not raised there
    (a stop raised mid-update would be saved as a completed step by a run of one process)."""
    from lit_grpo.runtime.stop_signal import StopRequested, StopSignal

    class SignalAtTheFlag(StopSignal):
        """Its SIGTERM handler runs where the abandonable flag is set: after it is set on opening, or before it is
        reset on closing (once, from ``armed`` on)."""

        armed = False

        @property
        def _abandonable(self) -> bool:
            return self.__dict__.get("flag", False)

        @_abandonable.setter
        def _abandonable(self, value: bool) -> None:
            due, self.armed = self.armed and value is not closing, self.armed and value is closing
            if due and closing:
                self._handle(signal.SIGTERM, None)
            self.__dict__["flag"] = value
            if due and not closing:
                self._handle(signal.SIGTERM, None)

    stop = SignalAtTheFlag()
    stop.armed = True
    with pytest.raises(StopRequested):
        with stop.abandonable():
            pass
    stop.restore()  # the fit ends; the next one starts with no stop
    stop._handle(signal.SIGTERM, None)  # its first signal, outside any abandonable code
    assert stop.signum == signal.SIGTERM


def test_code_abandonable_together_is_abandoned_by_every_rank_once_any_rank_abandons_it():
    """Each rank's flag goes to the one meeting at the end (``any_rank``), finished or abandoned; where any rank
    abandoned, every rank raises an agreed stop, the finished ones too; a stop that comes after the code finished
    is only recorded."""
    from lit_grpo.runtime.stop_signal import STOP_SIGNAL, StopRequested

    def meeting(others: bool, sent: list):
        return lambda abandoned: sent.append(abandoned) or abandoned or others

    STOP_SIGNAL.install()
    try:
        sent = []
        with STOP_SIGNAL.abandonable_together(meeting(False, sent)):  # no rank abandons: nothing raised
            finished = True
        os.kill(os.getpid(), signal.SIGTERM)  # after the code: recorded only
        assert finished and sent == [False] and STOP_SIGNAL.signum == signal.SIGTERM
    finally:
        STOP_SIGNAL.restore()

    STOP_SIGNAL.install()
    try:
        sent = []
        with pytest.raises(StopRequested) as stop:  # this rank finished, another abandoned: dropped here too
            with STOP_SIGNAL.abandonable_together(meeting(True, sent)):
                pass
        assert sent == [False] and stop.value.agreed and stop.value.code == 143  # SIGTERM: this rank got none
        sent = []
        with pytest.raises(StopRequested) as stop:  # abandoned here, where it was, and met the others
            with STOP_SIGNAL.abandonable_together(meeting(False, sent)):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
                pytest.fail("not interrupted")
        assert sent == [True] and stop.value.agreed and stop.value.code == 130
    finally:
        STOP_SIGNAL.restore()


def test_a_signal_soon_after_the_first_is_a_copy_of_it_and_one_later_a_second_request(stop_clock):
    """torchrun forwards to its workers the Ctrl-C (or SIGTERM) that the terminal (or scheduler) sent them too: a
    signal within ``COPY_WINDOW_S`` of the first is the same request, recorded once, not the "stop at once, unsaved"
    of a second one, in abandonable code or not; one after the window is a second request."""
    from lit_grpo.runtime.stop_signal import COPY_WINDOW_S, STOP_SIGNAL, StopRequested

    STOP_SIGNAL.install()
    try:
        with pytest.raises(StopRequested) as stop:
            with STOP_SIGNAL.abandonable():
                os.kill(os.getpid(), signal.SIGINT)  # the terminal's
                pytest.fail("not interrupted")
        assert stop.value.signal_name == "SIGINT"
        stop_clock[0] += COPY_WINDOW_S * 0.9
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's copy: recorded already, nothing more
        os.kill(os.getpid(), signal.SIGTERM)  # a copy of another kind (a scheduler's SIGTERM forwarded) likewise
        assert STOP_SIGNAL.signum == signal.SIGINT
        stop_clock[0] += COPY_WINDOW_S * 0.2
        with pytest.raises(KeyboardInterrupt):  # the user's second, after the window: at once
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        STOP_SIGNAL.restore()


def test_a_stop_from_another_rank_is_no_signal_of_this_one_and_interrupts_abandonable_code(stop_clock):
    """A peer stop (another rank's signal, read from the run's store by the failure watch's thread) is recorded as
    this process's stop request, interrupts abandonable code on the main thread where it is, and is no signal of
    this process: its own first signal after it is a first (recorded), only a second one stops at once. Nothing is
    recorded while no handler is installed, nor twice."""
    import threading

    from lit_grpo.runtime.stop_signal import STOP_SIGNAL, StopRequested

    STOP_SIGNAL.record_peer_stop(1, signal.SIGTERM)  # no run listens for stops
    assert STOP_SIGNAL.signum is None
    STOP_SIGNAL.install()
    try:
        with pytest.raises(StopRequested) as stop:  # in abandonable code on the main thread: interrupted there
            with STOP_SIGNAL.abandonable():
                threading.Timer(0.1, STOP_SIGNAL.record_peer_stop, (1, signal.SIGTERM)).start()
                waited = time.monotonic() + 5
                while time.monotonic() < waited:  # in naps: the interrupt (``_thread.interrupt_main``) wakes no sleep
                    time.sleep(0.01)
                pytest.fail("not interrupted")
        assert stop.value.code == 143 and (STOP_SIGNAL.signum, STOP_SIGNAL.peer) == (signal.SIGTERM, 1)
        STOP_SIGNAL.record_peer_stop(2, signal.SIGINT)  # a stop is recorded already: nothing
        assert (STOP_SIGNAL.signum, STOP_SIGNAL.peer) == (signal.SIGTERM, 1)
        os.kill(os.getpid(), signal.SIGINT)  # this process's first signal: recorded, not a second one
        stop_clock[0] += 60
        with pytest.raises(KeyboardInterrupt):  # its second: at once
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        STOP_SIGNAL.restore()
    assert (STOP_SIGNAL.signum, STOP_SIGNAL.peer) == (None, None)

    STOP_SIGNAL.install()
    try:  # outside abandonable code: recorded only, and abandonable code entered later raises on entry
        STOP_SIGNAL.record_peer_stop(1, signal.SIGINT)
        time.sleep(0.1)  # an interrupt would be handled here
        with pytest.raises(StopRequested) as stop:
            with STOP_SIGNAL.abandonable():
                pytest.fail("entered")
        assert stop.value.code == 130
    finally:
        STOP_SIGNAL.restore()


def test_a_stop_signal_on_one_rank_is_relayed_to_the_others_through_the_run_store():
    """``StopSignal.relay`` (one poll of the failure watch): a rank says its own signal in the store, once, the
    first rank to say one being the run's; another rank reads it and records a peer stop; a process listens only
    while its handlers are installed, and a later run of it has a key of its own."""
    from lit_grpo.runtime.stop_signal import STOP_SIGNAL

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=5))
    STOP_SIGNAL.relay(store, 0)  # not installed: no exchange
    STOP_SIGNAL.install()
    try:
        STOP_SIGNAL.relay(store, 0)  # no stop anywhere
        assert STOP_SIGNAL.signum is None
        os.kill(os.getpid(), signal.SIGTERM)
        STOP_SIGNAL.relay(store, 0)  # said in the store, as rank 0's
        STOP_SIGNAL.relay(store, 0)
        assert (STOP_SIGNAL.signum, STOP_SIGNAL.peer) == (signal.SIGTERM, None)
        key = STOP_SIGNAL._store_key()
        assert store.get(key) == b"0 15"
    finally:
        STOP_SIGNAL.restore()

    STOP_SIGNAL.install()  # the next run: a key of its own, said by rank 1 (Ctrl-C) and then by rank 2 too
    try:
        assert STOP_SIGNAL._store_key() != key
        STOP_SIGNAL.relay(store, 0)
        assert STOP_SIGNAL.signum is None
        store.compare_set(STOP_SIGNAL._store_key(), "", "1 2")
        store.compare_set(STOP_SIGNAL._store_key(), "", "2 15")
        STOP_SIGNAL.relay(store, 0)
        assert (STOP_SIGNAL.signum, STOP_SIGNAL.peer) == (signal.SIGINT, 1)
    finally:
        STOP_SIGNAL.restore()


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_stop_raised_on_one_rank_saves_only_in_a_run_of_one_process(monkeypatch, world_size):
    """A ``StopRequested`` the ranks did not agree on (``_stop``'s callers save before raising it) reaches
    ``on_exception`` on this rank alone: one process saves its rolled-back step; under several the save's collectives
    would pair with whatever the other ranks run, so it saves nothing. An agreed one (a training rollout abandoned
    together) every rank raised at one point: saved."""
    from types import SimpleNamespace

    from lit_grpo.runtime.stop_signal import StopRequested

    saved = []
    checkpoint = RunCheckpoint()
    monkeypatch.setattr(checkpoint, "_save_last", lambda trainer: saved.append(trainer.global_step))
    trainer = SimpleNamespace(world_size=world_size, global_step=3, is_global_zero=False, validating=False)
    checkpoint.on_exception(trainer, None, StopRequested(signal.SIGTERM))
    assert saved == ([3] if world_size == 1 else [])
    saved.clear()
    checkpoint.on_exception(trainer, None, StopRequested(signal.SIGTERM, agreed=True))  # every rank raised it
    assert saved == [3]


#: A rollout of step 2 is at least 4 x 16 / 2 decode steps (G 4 on 2 slots, no sample ending before the cap on the
#: random model being rare), each slowed by 10 s from the signal's 5th forward on: unabandoned, at least 280 s on
#: each rank, above the launch's time limit of 200 s, so a run that waited for it would be cut off there. A short
#: cap keeps the unslowed rollouts (step 1, the resume's step 2, the validations) cheap.
ROLLOUT_CAP = ("--data.sampling.max_new_tokens", "16")
SLOW_FORWARD_S = 10


@pytest.mark.parametrize("case", ["both_ranks_mid_rollout", "rank_0_past_its_rollout_signalled_alone"])
def test_a_stop_during_a_training_rollout_of_two_ranks_abandons_it_and_the_resume_draws_its_prompts_again(
        tmp_path, case):
    """SIGTERM during step 2 of a 2-process fit whose rollout on a slowed rank would outlast the test's limit:
    every rank abandons its rollout at once, the ranks meet after it, and step 1 is saved; the resume trains step 2
    on the prompts the abandoned step drew. ``both_ranks_mid_rollout``: both ranks slowed and signalled mid-rollout.
    ``rank_0_past_its_rollout_signalled_alone``: rank 0's rollout is not slowed, and SIGTERM comes to rank 0 alone
    (``docker stop``'s case) as it waits for rank 1 after its finished rollout (recorded only there): rank 1 learns
    of it through the run's store and abandons its rollout, and rank 0 still drops its finished step."""
    from tools.harness import free_port, repo_env

    root = tmp_path / "run"
    slow = ["--trainer.callbacks+=stop_helpers.SlowRollout", f"--trainer.callbacks.folder={tmp_path}",
            "--trainer.callbacks.step=2", f"--trainer.callbacks.sleep={SLOW_FORWARD_S}"]
    race = case == "rank_0_past_its_rollout_signalled_alone"
    if race:
        slow += ["--trainer.callbacks.slow_ranks=[1]", "--trainer.callbacks.signal_ranks=[0]"]
    argv = [*_fit_args(root, *ROLLOUT_CAP, "--trainer.num_nodes", "2", "--trainer.devices", "1",
                       "--trainer.strategy", "ddp", "--trainer.callbacks+=tools.step_recorder.StepRecorder",
                       f"--trainer.callbacks.path={root / 'rec'}", steps=2)]
    outputs = forked_cli.run_ranks([*argv, *slow], tmp_path, free_port(), 200, env=repo_env())
    for rank, (code, output, _) in enumerate(outputs):
        assert code == 143, f"rank {rank} ended with {code}:\n{output[-4000:]}"
    assert "stopped by SIGTERM after step 1; saved to" in outputs[0][1]
    assert all("Traceback" not in output for _, output, _ in outputs)
    if race:
        assert "a stop from rank 0 (SIGTERM came to it)" in outputs[1][1]
        assert "SIGTERM received" not in outputs[1][1] and "SIGTERM received" in outputs[0][1]
    assert (tmp_path / "past.rank0").exists() == race and not (tmp_path / "past.rank1").exists()
    assert _last_step(root) == 1
    drawn = [sorted(map(int, (tmp_path / f"drawn.rank{rank}").read_text().split())) for rank in (0, 1)]
    assert drawn[0] == drawn[1] and len(drawn[0]) == 4  # one global draw: 2 prompts for each rank

    resumed = forked_cli.run_ranks([*argv, "--ckpt_path", "last"], tmp_path, free_port(), 300, env=repo_env())
    for rank, (code, output, _) in enumerate(resumed):
        assert code == 0, f"rank {rank} ended with {code}:\n{output[-4000:]}"
    steps = [read_records(str(root / "rec"), rank) for rank in (0, 1)]
    assert [[r["global_step"] for r in records] for records in steps] == [[1, 2], [1, 2]]
    assert sorted(steps[0][1]["indices"] + steps[1][1]["indices"]) == drawn[0]


def _folder(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "shard").write_text(content)
    return path


def test_a_sharded_checkpoint_is_swapped_in_whole_and_a_killed_swap_is_finished(tmp_path):
    """A sharded checkpoint (FSDP2) is a folder: written beside its place, then swapped in by two renames. Whatever
    moment a kill hits, the next run finds last.ckpt whole, old or new."""
    from lit_grpo.runtime.checkpoints import finish_interrupted_swaps, staging_path, swap_in_staged

    last = _folder(tmp_path / "last.ckpt", "old")
    me = os.getpid()
    _folder(staging_path(last, me), "new")
    swap_in_staged(last, me)
    assert (last / "shard").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]

    gone = subprocess.Popen(["true"])  # a process that has ended: its leftovers are no one's
    gone.wait()
    # killed between the renames: no last.ckpt, the old one set aside, the new one complete
    last.rename(tmp_path / f".last.ckpt.{gone.pid}.replaced")
    _folder(staging_path(last, gone.pid), "newer")
    assert finish_interrupted_swaps(tmp_path) and (last / "shard").read_text() == "newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    # killed while writing: the staged folder is incomplete and last.ckpt untouched
    _folder(staging_path(last, gone.pid), "half")
    finish_interrupted_swaps(tmp_path)
    assert (last / "shard").read_text() == "newer" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    # the old one aside and the new one staged under a pid that runs again (a restarted container's): finished
    last.rename(tmp_path / f".last.ckpt.{me}.replaced")
    _folder(staging_path(last, me), "newest")
    assert finish_interrupted_swaps(tmp_path, clean=False) == [last]  # the --ckpt_path last lookup: no deleting
    assert (last / "shard").read_text() == "newest" and (tmp_path / f".last.ckpt.{me}.replaced").is_dir()
    finish_interrupted_swaps(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    # another live process's save in progress is left alone
    live = subprocess.Popen(["sleep", "30"])
    try:
        _folder(staging_path(last, live.pid), "writing")
        assert finish_interrupted_swaps(tmp_path) == [] and staging_path(last, live.pid).is_dir()
    finally:
        live.kill()
        live.wait()


def test_a_staged_folder_beside_a_whole_checkpoint_is_never_swapped_in(tmp_path):
    """A kill after a swap's second rename leaves last.ckpt whole and the old one aside; a later save of that pid,
    killed while writing, leaves its staged folder half written: last.ckpt stays, the leftovers go."""
    from lit_grpo.runtime.checkpoints import finish_interrupted_swaps, staging_path

    gone = subprocess.Popen(["true"])
    gone.wait()
    last = _folder(tmp_path / "last.ckpt", "new")
    _folder(tmp_path / f".last.ckpt.{gone.pid}.replaced", "old")
    _folder(staging_path(last, gone.pid), "half")
    finish_interrupted_swaps(tmp_path)
    assert (last / "shard").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_run_checkpoint_writes_a_sharded_checkpoint_beside_its_place_then_swaps_it_in(tmp_path):
    """Under ModelParallelStrategy the ranks write into the staging folder (here one process stands in), and
    last.ckpt changes from the old folder to the new one only once they are done."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import ModelParallelStrategy

    from lit_grpo.callbacks import RunCheckpoint
    from lit_grpo.runtime.checkpoints import staging_path

    last = _folder(tmp_path / "last.ckpt", "old")
    written = []

    def save_checkpoint(path, weights_only=False):
        written.append(path)
        assert (last / "shard").read_text() == "old"  # untouched while the shards are written
        _folder(Path(path), "new")

    trainer = SimpleNamespace(strategy=ModelParallelStrategy(), is_global_zero=True, loggers=[], global_step=3,
                              save_checkpoint=save_checkpoint)
    callback = RunCheckpoint(dirpath=tmp_path)
    callback._save_checkpoint(trainer, str(last))
    assert written == [str(staging_path(last, os.getpid()))]
    assert (last / "shard").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert callback._last_checkpoint_saved == str(last)


class _CountsValidations(pl.Callback):
    """State that a validation changes, as EarlyStopping's or a summary's."""

    def __init__(self) -> None:
        self.validations = 0

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.validations += 1

    def state_dict(self) -> dict:
        return {"validations": self.validations}


def test_a_step_save_that_a_validation_follows_holds_what_the_validation_changed(tmp_path):
    """Saves every 2 steps and validations every 2 steps: the step's save waits for its validation, once."""
    from callback_helpers import TinyRegression

    class Validated(TinyRegression):
        def validation_step(self, batch, batch_idx):
            self.log("val/loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

        def val_dataloader(self):
            return self.train_dataloader()

    checkpoint = RunCheckpoint(dirpath=tmp_path, every_n_train_steps=2)
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=4, accelerator="cpu", val_check_interval=2,
                         num_sanity_val_steps=0, callbacks=[_CountsValidations(), checkpoint], logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Validated())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 4
    assert saved["callbacks"]["_CountsValidations"] == {"validations": 2}  # the validation after step 4 included
    assert checkpoint.saves == 2  # after each validation; step 4's not again before it


def test_a_step_save_is_kept_where_the_validation_after_it_has_no_batches(tmp_path):
    """No held-out prompts (an empty val dataloader): Lightning skips that validation before any of its hooks, so
    the save of the step it would follow (the epoch's last, every 4 steps here) is made at the step's end."""
    from callback_helpers import TinyRegression

    class NothingToValidate(TinyRegression):
        def validation_step(self, batch, batch_idx):
            raise AssertionError("no batch to validate")

        def val_dataloader(self):
            return []

    saved: list[int] = []

    class SavedSteps(pl.Callback):  # runs before RunCheckpoint's hooks (Lightning puts checkpoints last)
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            last = tmp_path / "last.ckpt"
            saved.append(torch.load(last, weights_only=False)["global_step"] if last.exists() else 0)

    checkpoint = RunCheckpoint(dirpath=tmp_path, every_n_train_steps=2)
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=8, accelerator="cpu", num_sanity_val_steps=0,
                         callbacks=[SavedSteps(), checkpoint], logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(NothingToValidate())
    assert saved == [0, 0, 2, 2, 4, 4, 6, 6]  # step 4, the first epoch's last, saved before step 5 starts
    assert checkpoint.saves == 4


def test_last_refusing_another_experiments_run_says_how_to_name_the_one_meant(tmp_path, tiny_checkpoint, capsys):
    # two experiments under one root: the newest last.ckpt is the other one's, which a TRL user (one output_dir
    # per experiment) would not expect
    _run_copied_from(tiny_checkpoint, tmp_path)
    build_cli(_fit_args(tmp_path, "--model.loss.loss_type", "grpo", steps=1))
    err = _refused(capsys, _fit_args(tmp_path, "--ckpt_path", "last", steps=2))
    assert "model.loss.loss_type: 'grpo' in the checkpoint, 'dapo' now" in err
    assert (f"--ckpt_path last takes the newest run under {tmp_path / 'lightning_logs'}, whatever its config: name "
            "the run you meant with --ckpt_path PATH, or give each experiment its own trainer.default_root_dir") in err
    newest = tmp_path / "lightning_logs" / "version_2" / "checkpoints" / "last.ckpt"  # a broken file: no such hint
    newest.parent.mkdir(parents=True)
    newest.write_bytes((tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").read_bytes()[:1000])
    err = _refused(capsys, _fit_args(tmp_path, "--ckpt_path", "last", steps=2))
    assert "is cut short" in err and "takes the newest run" not in err


def test_a_checkpoint_from_another_folder_restores_nothing_into_run_checkpoint_and_warns_nothing(tmp_path):
    # lit-grpo validate (a new version folder) or a resume by path into a new run: Lightning's warning that the
    # top-k state of the other folder is not reloaded was printed on each, about state this callback does not keep
    here, there = RunCheckpoint(dirpath=str(tmp_path / "here")), RunCheckpoint(dirpath=str(tmp_path / "there"))
    there.last_model_path = str(tmp_path / "there" / "last.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        here.load_state_dict(there.state_dict())
    assert here.last_model_path == ""  # the other folder's last.ckpt is not this run's
    again = RunCheckpoint(dirpath=str(tmp_path / "there"))
    again.load_state_dict(there.state_dict())  # its own folder: restored as Lightning does
    assert again.last_model_path == there.last_model_path


def test_last_refused_by_the_data_module_for_another_prompt_set_says_how_to_name_the_run_meant(tmp_path,
                                                                                               tiny_checkpoint, capsys):
    # the settings compared before loading agree; the prompt set (another val_size) is refused as the stream loads
    _run_copied_from(tiny_checkpoint, tmp_path)
    err = _refused(capsys, _fit_args(tmp_path, "--ckpt_path", "last", "--data.val_size", "8", steps=2))
    assert "error: --ckpt_path: state num_prompts=" in err and "Traceback" not in err
    assert (f"--ckpt_path last takes the newest run under {tmp_path / 'lightning_logs'}, whatever its config: name "
            "the run you meant with --ckpt_path PATH, or give each experiment its own trainer.default_root_dir") in err
    named = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"  # a path the user chose: no hint
    err = _refused(capsys, _fit_args(tmp_path, "--ckpt_path", str(named), "--data.val_size", "8", steps=2))
    assert "state num_prompts=" in err and "takes the newest run" not in err


def test_a_stop_on_one_of_two_ranks_during_a_validation_stops_both_after_its_batch(tmp_path):
    """2 nodes x 1 process, SIGTERM to rank 0 alone in the first of its two validation batches after step 2: the
    ranks agree at the batch's end, and both stop there, step 2 saved, the second batch not run."""
    from tools.harness import free_port, repo_env

    argv = [*_fit_args(Path("run"), "--trainer.limit_val_batches", "2", "--data.val_batch_size", "1",
                       "--trainer.callbacks+=stop_helpers.ValidationBatches",
                       "--trainer.callbacks+=stop_helpers.SignalAt", "--trainer.callbacks.signal_name=TERM",
                       "--trainer.callbacks.step=2", "--trainer.callbacks.phase=validation",
                       "--trainer.callbacks.rank=0"),
            "--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.strategy", "ddp",
            "--trainer.accelerator", "cpu"]
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), 240, env=repo_env())
    shown = "\n\n".join(output[-3000:] for _, output, _ in outputs)
    assert [code for code, _, _ in outputs] == [143, 143], shown
    assert all("validation batch 0 after step 2 ended" in output for _, output, _ in outputs), shown
    assert "validation batch 1 after step 2 ended" not in shown and "Traceback" not in shown
    assert "stopped by SIGTERM during the validation after step 2, cut short" in outputs[0][1], shown
    assert _last_step(tmp_path / "run") == 2


def test_a_checkpoint_whose_peft_config_is_empty_resumes_with_null(tmp_path, tiny_checkpoint, capsys):
    """An empty peft_config, which older releases took, trained all weights as null does: its checkpoint resumes
    with null. A run's own {} is refused as GRPOModule refuses it without a checkpoint, not as another setting."""
    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["peft_config"] = {}
    saved = tmp_path / "empty_lora.ckpt"
    torch.save(checkpoint, saved)
    module, data = _hparams(saved)
    check_resumable(saved, {**module, "peft_config": None}, data)
    check_resumable(saved, {**module, "peft_config": None}, data, evaluate=True)
    with pytest.raises(ValueError, match=r"model.peft_config: None in the checkpoint, \{'r': 4\} now"):
        check_resumable(saved, {**module, "peft_config": {"r": 4}}, data)
    checkpoint["hyper_parameters"]["peft_config"] = {"r": 4}
    lora = tmp_path / "lora.ckpt"
    torch.save(checkpoint, lora)
    for ckpt in (saved, tiny_checkpoint, lora):  # {} saved, null saved, a LoRA saved (not said to be None now)
        err = _refused(capsys, _fit_args(tmp_path / "run", "--ckpt_path", str(ckpt), "--model.peft_config", "{}"))
        assert "error: model.peft_config={} gives no LoRA setting" in err and "in the checkpoint" not in err, err
