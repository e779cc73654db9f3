"""FitSummary (a validation before the first step, a summary at the end) and the GRPO progress bar."""

from __future__ import annotations

import dataclasses
import re
import time

import lightning.pytorch as pl
import pytest
import torch
from callback_helpers import RolloutModule, events, make_rollout, scalars
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from lit_grpo.callbacks import FitSummary, GRPOProgressBar, PeakMemoryMonitor, RolloutProfiler
from lit_grpo.runtime.memory import host_peak_bytes
from lit_grpo.runtime.sizes import disk_bytes, format_bytes


class ValidatedModule(RolloutModule):
    """A rollout module whose "accuracy" is its weight, so training visibly moves it."""

    def validation_step(self, batch, batch_idx):
        self.log("val/accuracy", self.weight.detach(), batch_size=1)

    def val_dataloader(self):
        return DataLoader([torch.zeros(1)] * 2, batch_size=1)


def _trainer(tmp_path, callbacks, max_steps=4, **kwargs) -> pl.Trainer:
    defaults = dict(default_root_dir=tmp_path, max_steps=max_steps, max_epochs=100, accelerator="cpu",
                    logger=TensorBoardLogger(tmp_path, name="tb"), log_every_n_steps=1, enable_model_summary=False,
                    enable_progress_bar=False, limit_val_batches=2, check_val_every_n_epoch=1,
                    num_sanity_val_steps=0)
    return pl.Trainer(callbacks=callbacks, **{**defaults, **kwargs})


def test_validation_before_training_and_a_summary_of_the_run(tmp_path, capsys):
    rollouts = [make_rollout(seed) for seed in range(4)]
    summary = FitSummary(window=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    profiler = RolloutProfiler(progress_bar=False, read_bytes_per_s=1e9)
    trainer = _trainer(tmp_path, [summary, PeakMemoryMonitor(), checkpoint, profiler])
    trainer.fit(ValidatedModule(rollouts))

    accuracy = events(trainer).Scalars("val/accuracy")
    assert accuracy[0].step == 0 and accuracy[0].value == 1.0  # the untouched weight, before any step
    assert len(accuracy) == 2 and accuracy[-1].value != 1.0
    assert summary.accuracy[0] == (0, 1.0) and summary.accuracy[-1][0] == 4

    out = capsys.readouterr().out
    again = summary.summary_lines(trainer)
    lines = out.strip().splitlines()[-len(again):]  # what fit printed
    # A later call reads the clock and the process's high-water mark again (reading the event file above may have
    # raised it): the elapsed time (0), the rollout's share of it (3) and the host peak (6) may differ from fit's.
    live = {0, 3, 6}
    assert [line for i, line in enumerate(lines) if i not in live] == [line for i, line in enumerate(again)
                                                                          if i not in live]
    assert lines[0].startswith("lit_grpo: 4 steps in") and "s per step" in lines[0]
    assert f"1.000 -> {accuracy[-1].value:.3f}   (before training -> after step 4)" in lines[1]
    rewards = scalars(events(trainer), "reward/mean")
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert f"reward/mean    {first:.3f} -> {last:.3f}   (mean of the first 2 steps -> the last 2)" in lines[2]
    decode_ms = 1000 * sum(r.stats.decode_s for r in rollouts) / sum(r.stats.decode_steps for r in rollouts)
    prefill_ms = 1000 * sum(r.stats.prefill_s for r in rollouts) / sum(r.stats.prefill_tokens for r in rollouts)
    assert re.fullmatch(rf"  rollout time   0\.50 s a step \(\d+% of it\): {decode_ms:.1f} ms a decode step alone, "
                        rf"{prefill_ms:.2f} ms a prompt token's prefill", lines[3]), lines[3]
    # each step read 2 MB, at the profiler's 1 GB/s: a 2 ms floor; the run's ms_per_step over it, and its tokens/s
    steps = sum(r.stats.decode_steps for r in rollouts)
    ms_per_step = 1000 * sum(r.stats.wall_s - r.stats.capture_s for r in rollouts) / steps
    tokens_per_s = sum(r.stats.generated_tokens for r in rollouts) / sum(r.stats.wall_s for r in rollouts)
    assert lines[4] == (f"  decode floor   2.00 ms a step (its bytes at 1.0 GB/s): {ms_per_step:.1f} ms a step is "
                        f"{ms_per_step / 2:.1f} x it; {tokens_per_s:.0f} tokens/s")
    kv = max(r.stats.peak_kv_bytes for r in rollouts)
    assert lines[5].startswith(f"  rollout peak   KV cache {kv} B; process ") and "during the rollout" in lines[5]
    host = re.fullmatch(r"  host peak      ([\d.]+) (MiB|GiB) resident \(the process's high-water mark\)", lines[6])
    assert host, lines[6]
    assert float(host[1]) * {"MiB": 2**20, "GiB": 2**30}[host[2]] == pytest.approx(host_peak_bytes(), rel=0.05)
    assert "tensorboard --logdir" in lines[7]
    # a script of its own resumes through trainer.fit (the CLI's --ckpt_path is no option of it)
    assert "last.ckpt (" in lines[8] and 'resume with trainer.fit(..., ckpt_path="' in lines[8], lines[8]


def test_a_short_runs_reward_ends_never_overlap_and_leave_out_what_is_not_a_number(tmp_path):
    rollouts = [make_rollout(seed) for seed in range(4)]
    rollouts[1] = dataclasses.replace(rollouts[1], rewards=torch.full_like(rollouts[1].rewards, float("nan")))
    summary = FitSummary(validate_before_training=False)  # a window of 5 steps at each end
    trainer = _trainer(tmp_path, [summary], max_steps=4, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(RolloutModule(rollouts))
    rewards = [float(rollouts[i].rewards.float().mean()) for i in (0, 2, 3)]
    assert summary.rewards == pytest.approx(rewards)
    # three rewards: one at each end, not three each
    assert f"  reward/mean    {rewards[0]:.3f} -> {rewards[-1]:.3f}   (first step -> last step)" in \
        summary.summary_lines(trainer)


def test_a_validation_after_the_first_step_is_said_to_follow_it(tmp_path):
    summary = FitSummary()
    trainer = _trainer(tmp_path, [summary], max_steps=1, enable_checkpointing=False)
    trainer.fit(ValidatedModule([make_rollout(0)]))
    assert [step for step, _ in summary.accuracy] == [0, 1]
    assert summary.summary_lines(trainer)[1].endswith("   (before training -> after step 1)")


class TwoOptimizerStepsModule(ValidatedModule):
    """Two optimizer steps per training batch, as GRPOModule makes with num_iterations=2."""

    def __init__(self, rollouts) -> None:
        super().__init__(rollouts)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        for _ in range(2):
            optimizer.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            optimizer.step()


def test_a_validation_is_placed_by_training_steps_not_optimizer_steps(tmp_path):
    summary = FitSummary()
    trainer = _trainer(tmp_path, [summary], max_steps=4, enable_checkpointing=False)
    trainer.fit(TwoOptimizerStepsModule([make_rollout(seed) for seed in range(2)]))
    assert trainer.global_step == 4 and summary.steps == 2
    assert [event.step for event in events(trainer).Scalars("val/accuracy")] == [0, 1]  # after step 2 at x = 1
    lines = summary.summary_lines(trainer)
    # the optimizer steps too: what max_steps and global_step count (verl's rollouts x mini-batches)
    assert lines[0].startswith("lit_grpo: 2 steps (4 optimizer steps) in")
    assert lines[1].endswith("   (before training -> after step 2)")


def test_a_resumed_run_does_not_validate_again_before_its_first_step(tmp_path):
    rollouts = [make_rollout(seed) for seed in range(4)]
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    _trainer(tmp_path, [checkpoint], max_steps=2).fit(ValidatedModule(rollouts))  # no summary state in it
    resumed = FitSummary()
    trainer = _trainer(tmp_path / "resumed", [resumed], max_steps=4, enable_checkpointing=False)
    trainer.fit(ValidatedModule(rollouts), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert [step for step, _ in resumed.accuracy] == [4]
    lines = resumed.summary_lines(trainer)
    assert lines[0].startswith("lit_grpo: 2 steps in")
    assert lines[1] == ("  resumed        at step 2, 2 steps in this fit; the checkpoint held no FitSummary state: "
                        "the lines cover this fit's steps alone")
    # its one validation stands alone, not as "x -> x (after step 4 -> after step 4)"
    assert lines[2] == f"  val/accuracy   {resumed.accuracy[0][1]:.3f}   (after step 4)"
    assert not any("nothing to do" in line for line in lines)
    finished = FitSummary()  # a resume of a run already at max_steps trains nothing, and says what to raise
    trainer = _trainer(tmp_path / "finished", [finished], max_steps=2, enable_checkpointing=False)
    trainer.fit(ValidatedModule(rollouts), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert finished.summary_lines(trainer)[1] == ("  nothing to do  the run is at trainer.max_steps=2 (step 2): "
                                                  "raise --trainer.max_steps to train on")


def test_the_progress_bar_counts_steps_to_max_steps_and_shows_the_reward(tmp_path, capsys):
    bar = GRPOProgressBar()
    trainer = _trainer(tmp_path, [bar, RolloutProfiler()], max_steps=3, enable_progress_bar=True,
                       enable_checkpointing=False, limit_val_batches=0)
    rollouts = [make_rollout(seed) for seed in range(5)]  # epochs of 5 batches: the bar counts 3 steps
    module = ValidatedModule(rollouts)
    trainer.fit(module)
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (3, 3)
    shown = bar.get_metrics(trainer, module)
    assert "v_num" not in shown and shown["reward"] == f"{float(trainer.callback_metrics['reward/mean']):.3f}"
    assert shown["steps"] == rollouts[2].stats.decode_steps and isinstance(shown["steps"], int)  # not "48.00"
    out = capsys.readouterr().out
    assert "GRPO steps" in out and "3/3" in out and "Epoch" not in out and "Training" not in out
    assert f"steps={rollouts[2].stats.decode_steps}," in out
    assert re.search(r"\d ?(step/s|s/step)", out)  # a rate in steps, not batches


def test_the_progress_bar_of_two_optimizer_steps_a_step_ends_at_the_step_past_an_odd_max_steps(tmp_path, capsys):
    """max_steps 3 at 2 optimizer steps a training step (GRPOModule's num_mini_batches 2) runs to global_step 4:
    the bar's total is 4, not a 3 it would pass ("4/?")."""
    class TwoStepsEach(TwoOptimizerStepsModule):
        optimizer_steps_per_training_step = 2

    bar = GRPOProgressBar()
    trainer = _trainer(tmp_path, [bar], max_steps=3, enable_progress_bar=True, enable_checkpointing=False,
                       limit_val_batches=0)
    trainer.fit(TwoStepsEach([make_rollout(seed) for seed in range(2)]))
    assert trainer.global_step == 4
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (4, 4)
    out = capsys.readouterr().out
    assert "0/4" in out and "4/4" in out and "/?" not in out.split("0/4", 1)[1], out


def test_a_resumed_runs_bar_starts_at_its_step(tmp_path):
    rollouts = [make_rollout(seed) for seed in range(4)]
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    _trainer(tmp_path, [checkpoint], max_steps=2, limit_val_batches=0).fit(ValidatedModule(rollouts))
    bar = GRPOProgressBar()
    trainer = _trainer(tmp_path / "resumed", [bar], max_steps=5, enable_progress_bar=True,
                       enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(ValidatedModule(rollouts), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    progress = bar.train_progress_bar
    assert (progress.initial, progress.n, progress.total) == (2, 5, 5)  # the rate counts the 3 steps it ran
    with pytest.raises(ValueError, match="window=0 must be an integer >= 1"):
        FitSummary(window=0)


def test_a_sharded_checkpoint_directory_is_sized_by_its_files(tmp_path):
    shards = tmp_path / "last.ckpt"
    (shards / "sub").mkdir(parents=True)
    (shards / "a.distcp").write_bytes(b"x" * 3000)
    (shards / "sub" / "b.distcp").write_bytes(b"x" * 1000)
    assert disk_bytes(shards) == 4000 and disk_bytes(shards / "a.distcp") == 3000


class SlowValidationModule(ValidatedModule):
    def validation_step(self, batch, batch_idx):
        time.sleep(0.4)
        super().validation_step(batch, batch_idx)


def test_a_summarised_key_never_logged_is_named_once(tmp_path, recwarn):
    summary = FitSummary(accuracy_key="val/acuracy", reward_key="reward/mean")  # misspelled
    trainer = _trainer(tmp_path, [summary], max_steps=2, enable_checkpointing=False)
    trainer.fit(ValidatedModule([make_rollout(seed) for seed in range(2)]))
    said = [str(w.message) for w in recwarn if "FitSummary" in str(w.message)]
    assert said == ["FitSummary: 'val/acuracy' was not logged, so the summary has no line for it; logged: "
                    "['val/accuracy']"]
    assert not any("acuracy" in line for line in summary.summary_lines(trainer))


def test_time_per_step_leaves_the_validations_out(tmp_path):
    summary = FitSummary()
    trainer = _trainer(tmp_path, [summary], max_steps=2, enable_checkpointing=False)
    trainer.fit(SlowValidationModule([make_rollout(seed) for seed in range(2)]))
    first = summary.summary_lines(trainer)[0]
    # The validation after the last step (2 x 0.4 s) is named apart; the one before training is not timed.
    match = re.fullmatch(r"lit_grpo: 2 steps in [\d.]+ s \((\d+) ms per step, plus ([\d.]+) s of validation\)",
                         first)
    assert match and int(match[1]) < 400 and 0.8 <= float(match[2]) < 1.6, first


def test_one_summary_serves_two_fits_and_counts_optimizer_steps_under_accumulation(tmp_path):
    """Each fit starts the summary afresh; with gradient accumulation a step is the batches of one optimizer step,
    and the reward forecast keeps one point per step too."""
    from callback_helpers import TinyRegression

    from lit_grpo.callbacks import RewardForecast

    summary = FitSummary(validate_before_training=False, reward_key="train/loss")
    forecast = RewardForecast(monitor="train/loss", min_points=100)
    for max_steps in (2, 3):
        trainer = _trainer(tmp_path, [summary, forecast], max_steps=max_steps, accumulate_grad_batches=2,
                           enable_checkpointing=False, limit_val_batches=0)
        trainer.fit(TinyRegression())
        assert summary.steps == len(summary.rewards) == max_steps
        assert summary.summary_lines(trainer)[0].startswith(f"lit_grpo: {max_steps} steps in ")
    assert forecast.steps == [0.0, 1.0, 2.0]  # the last fit's steps, one point each


def test_the_host_peak_is_read_before_the_decode_floor_measures_its_bandwidth(tmp_path, monkeypatch):
    from lit_grpo.callbacks import fit_summary

    readings = iter(range(1, 100))
    monkeypatch.setattr(fit_summary, "host_peak_bytes", lambda: next(readings) * 2**20)
    summary = FitSummary()
    trainer = _trainer(tmp_path, [summary], max_steps=2, enable_checkpointing=False)
    trainer.fit(RolloutModule([make_rollout(seed) for seed in range(2)]))
    floor, readings = summary._floor_line, iter([5, 50])
    monkeypatch.setattr(fit_summary, "host_peak_bytes", lambda: next(readings) * 2**20)
    monkeypatch.setattr(summary, "_floor_line", lambda trainer: (next(readings), floor(trainer))[1])  # its buffer
    lines = summary.summary_lines(trainer)
    assert any(line.startswith("  decode floor") for line in lines), lines
    assert "  host peak      5.0 MiB resident" in "\n".join(lines)  # the reading before the floor's, not after


def test_the_rollout_time_of_a_step_counts_every_micro_batchs_rollout(tmp_path):
    """Under gradient accumulation a step of 2 micro-batches ran 2 rollouts of 0.5 s: 1.00 s a step, and the tokens
    of all 4 rollouts count."""
    rollouts = [make_rollout(seed) for seed in range(4)]
    summary = FitSummary(validate_before_training=False)
    trainer = _trainer(tmp_path, [summary], max_steps=2, accumulate_grad_batches=2, limit_val_batches=0)
    trainer.fit(RolloutModule(rollouts))
    assert summary.steps == 2 and summary.rollouts == 4
    assert summary.rollout_totals.generated_tokens == sum(r.stats.generated_tokens for r in rollouts)
    assert "rollout time   1.00 s a step" in "\n".join(summary.summary_lines(trainer))


def test_a_resumed_summary_describes_the_whole_run(tmp_path):
    """Stopped after 2 of 4 steps and resumed, the summary's totals are those of 4 uninterrupted steps: its state
    travels in the checkpoint, as the rest of the run's does."""
    rollouts = [make_rollout(seed % 2) for seed in range(4)]  # the resumed epoch starts over: the same batches
    whole = FitSummary()
    _trainer(tmp_path / "whole", [whole], max_steps=4, enable_checkpointing=False).fit(ValidatedModule(rollouts))

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    first = ValidatedModule(rollouts)
    first.rollout_bytes = 64 * 2**20  # the first fit's rollouts held more memory than the resumed fit's
    monitor = PeakMemoryMonitor()
    _trainer(tmp_path, [FitSummary(), monitor, checkpoint], max_steps=2).fit(first)
    first_added = monitor.max_logged["memory/rollout_peak_delta_bytes"]
    assert first_added > 48 * 2**20
    resumed = FitSummary()
    trainer = _trainer(tmp_path / "resumed", [resumed, PeakMemoryMonitor()], max_steps=4, enable_checkpointing=False)
    trainer.fit(ValidatedModule(rollouts), ckpt_path=tmp_path / "ckpt" / "last.ckpt")

    assert (resumed.steps, resumed.rollouts, resumed.rollout_steps) == (whole.steps, whole.rollouts, 4)
    assert resumed.rewards == pytest.approx(whole.rewards)
    assert [step for step, _ in resumed.accuracy] == [step for step, _ in whole.accuracy] == [0, 4]
    assert [value for _, value in resumed.accuracy] == pytest.approx([value for _, value in whole.accuracy])
    assert resumed.rollout_totals.generated_tokens == whole.rollout_totals.generated_tokens
    assert resumed.rollout_s == pytest.approx(whole.rollout_s)
    lines = resumed.summary_lines(trainer)
    assert lines[0].startswith("lit_grpo: 4 steps in")
    assert lines[1] == "  resumed        at step 2, 2 steps in this fit; the lines cover all 4"
    assert lines[2].endswith("(before training -> after step 4)")
    assert "rollout time   0.50 s a step" in "\n".join(lines)
    peak = next(line for line in lines if line.startswith("  rollout peak"))
    assert peak.endswith(f"(+{format_bytes(first_added)} during the rollout)"), peak  # the first fit's, kept
    finished = FitSummary()  # a resume of the finished run trains nothing: the run's summary, and what to raise
    trainer = _trainer(tmp_path / "finished", [finished], max_steps=2, enable_checkpointing=False)
    trainer.fit(ValidatedModule(rollouts), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    lines = finished.summary_lines(trainer)
    assert lines[0].startswith("lit_grpo: 2 steps in "), lines[0]  # the run's steps, not this fit's none
    assert lines[1:3] == ["  resumed        at step 2, 0 steps in this fit; the lines cover all 2",
                          "  nothing to do  the run is at trainer.max_steps=2 (step 2): raise --trainer.max_steps to "
                          "train on"]


def test_a_resume_summarising_another_reward_key_keeps_the_runs_totals_but_not_that_curve():
    saved = FitSummary(reward_key="train/loss")
    saved.steps, saved.rewards, saved.accuracy = 3, [0.5, 0.25, 0.125], [(0, 0.5)]
    checkpoint = {"callbacks": {saved.state_key: saved.state_dict(), "Other": {"x": 1}}}
    resumed = FitSummary()
    assert resumed.state_key != saved.state_key  # two summaries of different keys may share a trainer
    resumed.on_load_checkpoint(None, None, checkpoint)
    assert (resumed.steps, resumed.rewards, resumed.accuracy, resumed.resumed_at) == (3, [], [(0, 0.5)], 3)


def _saved_summary_state() -> dict:
    saved = FitSummary()
    saved.steps, saved.rewards, saved.accuracy, saved.rollouts, saved.rollout_steps = 4, [0.5, 0.25], [(0, 0.5)], 4, 4
    saved.rollout_totals = dataclasses.replace(saved.rollout_totals, decode_steps=12, generated_tokens=40, wall_s=1.5)
    # a float, as the ranks' reduced peaks are logged
    saved._earlier_memory_peaks = {"process": {"memory/rollout_peak_bytes": float(2**20)}}
    return saved.state_dict()


def _summary_change(key, value, *inner):
    def change(state):
        target = state
        for step in inner:
            target = target[step]
        target[key] = value
    return change


@pytest.mark.parametrize("change, message", [
    (_summary_change("epochs", 1), r"^a FitSummary state has unknown keys \['epochs'\]; it holds steps, "),
    (lambda state: state.pop("rollouts"), r"^a FitSummary state lacks \['rollouts'\]; it holds steps, "),
    (_summary_change("steps", "4"), r"^summary state steps='4' must be an integer >= 0$"),  # was parsed as 4
    (_summary_change("rollout_s", -1.0), r"^summary state rollout_s=-1.0 is not allowed; summary state rollout_s must "
                                         r"be a finite number >= 0$"),
    (_summary_change("rewards", [0.5, float("nan")]), r"^summary state rewards\[1\]=nan is not allowed; summary state "
                                                      r"rewards\[1\] must be a finite number$"),  # never recorded
    (_summary_change("accuracy", [[0, 0.5, 1]]), r"^summary state accuracy\[0\]=\[0, 0.5, 1\] is not allowed; a "
                                                 r"validation's accuracy is \[step, value\], an integer >= 0 and a "
                                                 r"number$"),  # failed in the summary's last lines
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed in place of the refusal
    (_summary_change("accuracy", [[-10**5000, 0.5]]), r"^summary state accuracy\[0\]=a list holding an int of more "
                                                      r"than \d+ digits is not allowed; a validation's accuracy is "),
    (_summary_change("accuracy", 10**5000), r"^summary state accuracy=\(an int of 5001 digits\) must be a list of "
                                            r"\[step, value\] pairs$"),
    (_summary_change("rewards", 10**5000), r"^summary state rewards=\(an int of 5001 digits\) must be a list of "
                                           r"numbers$"),
    (_summary_change("wall_s", 10**5000, "rollout_totals"), r"^summary state rollout_totals.wall_s=\(an int of 5001 "
                                                            r"digits\) must be a number$"),
    (_summary_change("reward_key", ""), r"^summary state reward_key='' must be a non-empty string$"),
    (_summary_change("tokens", 3, "rollout_totals"), r"^a FitSummary state's rollout_totals has unknown keys "
                                                     r"\['tokens'\]; it holds decode_steps, "),  # was a TypeError
    (_summary_change("decode_steps", 1.5, "rollout_totals"), r"^summary state rollout_totals.decode_steps=1.5 must "
                                                             r"be an integer >= 0$"),
    (_summary_change("wall_s", "1.5", "rollout_totals"), r"^summary state rollout_totals.wall_s='1.5' must be a "
                                                         r"number$"),
    (_summary_change("gpu", {}, "memory_peaks"), r"^summary state memory_peaks has unknown keys \['gpu'\]; it holds "
                                                 r"device, process \(each may be absent\)$"),
    (_summary_change("memory/rollout_peak_bytes", "1 MiB", "memory_peaks", "process"),
     r"^summary state memory_peaks\['process'\]\['memory/rollout_peak_bytes'\]='1 MiB' is not allowed; "),
    (_summary_change("memory/rollout_peak_bytes", -1.0, "memory_peaks", "process"),
     r"^summary state memory_peaks\['process'\]\['memory/rollout_peak_bytes'\]=-1.0 is not allowed; "),
])
def test_a_bad_summary_state_is_refused_naming_the_bad_key_and_nothing_is_taken(change, message):
    """A corrupt or foreign checkpoint's summary state is refused naming what is wrong and what is allowed, before
    any of it is taken: counts were parsed, a rollout total of another version failed inside RolloutStats, and a bad
    curve or peak failed in the summary at the end of the fit."""
    state = _saved_summary_state()
    change(state)
    summary = FitSummary()
    before = summary.state_dict()
    with pytest.raises(ValueError, match=message):
        summary.load_state_dict(state)
    assert summary.state_dict() == before and summary.resumed_at is None
    summary.load_state_dict(_saved_summary_state())
    assert summary.state_dict() == _saved_summary_state()


def test_a_run_of_fast_steps_states_their_time_in_milliseconds(tmp_path, capsys):
    """A plain module's steps take milliseconds: "0.0 s per step" in "0 s" would say nothing."""
    from callback_helpers import TinyRegression

    trainer = _trainer(tmp_path, [FitSummary()], max_steps=4, limit_val_batches=0)
    trainer.fit(TinyRegression())
    first = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("lit_grpo: "))
    assert re.fullmatch(r"lit_grpo: 4 steps in \d+\.\d s \(\d+ ms per step\)", first), first


def test_the_way_back_is_said_as_the_run_was_started(tmp_path, capsys):
    """In a script of its own the summary and a stop name ``trainer.fit``'s ``ckpt_path`` with the checkpoint's
    path (a new run's default folder is another version, where "last" finds nothing); under ``lit-grpo`` (which
    sets ``resume_command``) its ``--ckpt_path last``."""
    from callback_helpers import TinyRegression

    from lit_grpo.callbacks import RunCheckpoint

    summary, checkpoint = FitSummary(), RunCheckpoint()
    trainer = _trainer(tmp_path, [summary, checkpoint], max_steps=2, limit_val_batches=0)
    trainer.fit(TinyRegression())
    path = checkpoint.last_model_path
    assert path.endswith("last.ckpt")
    checkpoint._announce(trainer, 15)
    out = capsys.readouterr().out
    assert f'resume with trainer.fit(..., ckpt_path="{path}")' in summary.summary_lines(trainer)[-1]
    assert f'  resume: trainer.fit(..., ckpt_path="{path}")' in out.splitlines()

    checkpoint.resume_command = "lit-grpo fit --config c.yaml --ckpt_path last"
    assert summary.summary_lines(trainer)[-1].endswith("resume with --ckpt_path last)")
    checkpoint._announce(trainer, 15)
    assert "  resume: lit-grpo fit --config c.yaml --ckpt_path last" in capsys.readouterr().out.splitlines()


class SpreadModule(ValidatedModule):
    """Logs ``reward/frac_zero_std`` as GRPOModule does: the share of the batch's groups whose rewards are equal."""

    def training_step(self, batch, batch_idx):
        equal = (batch.rewards == batch.rewards[:, :1]).all(dim=1)
        self.log("reward/frac_zero_std", equal.double().mean())
        return super().training_step(batch, batch_idx)


def _flat(rollout, groups: int | None = None):
    """``rollout`` with every one of its first ``groups`` groups' rewards equal (all of them by default)."""
    rewards = rollout.rewards.clone()
    rewards[:groups] = rewards[:groups, :1]
    return dataclasses.replace(rollout, rewards=rewards)


def _no_signal_line(lines: list[str]) -> str | None:
    return next((line for line in lines if line.startswith("  no signal")), None)


def test_a_run_whose_every_step_had_no_reward_spread_says_so_and_what_to_check(tmp_path):
    """Every group's rewards equal at every step (every advantage 0: the reward taught nothing) is said plainly,
    where the reward line alone would show a flat curve."""
    summary = FitSummary(validate_before_training=False)
    trainer = _trainer(tmp_path, [summary], max_steps=4, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(SpreadModule([_flat(make_rollout(seed)) for seed in range(4)]))
    line = _no_signal_line(summary.summary_lines(trainer))
    assert line is not None and line.startswith("  no signal      all 4 steps: no group's completions got different "
                                                "rewards (reward/frac_zero_std 1.0)"), line
    assert "check the reward functions against the completions" in line and "max_new_tokens" in line


def test_a_run_whose_most_steps_had_no_reward_spread_says_their_share_and_a_few_says_nothing(tmp_path):
    rollouts = [_flat(make_rollout(0)), _flat(make_rollout(1)), _flat(make_rollout(2), groups=1), make_rollout(3)]
    summary = FitSummary(validate_before_training=False)
    trainer = _trainer(tmp_path, [summary], max_steps=4, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(SpreadModule(rollouts))  # one group of two flat is no step without signal
    line = _no_signal_line(summary.summary_lines(trainer))
    assert line is not None and line.startswith("  no signal      2 of 4 steps (50%): no group's"), line
    assert summary.flat_steps == 2 and summary.spread_logged_steps == 4

    summary = FitSummary(validate_before_training=False)
    trainer = _trainer(tmp_path, [summary], max_steps=4, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(SpreadModule([_flat(make_rollout(0))] + [make_rollout(seed) for seed in range(1, 4)]))
    assert _no_signal_line(summary.summary_lines(trainer)) is None  # 1 of 4: the run learnt on the others
    # a module that logs no reward/frac_zero_std: no line, and no warning that it is missing
    summary = FitSummary(validate_before_training=False)
    trainer = _trainer(tmp_path, [summary], max_steps=2, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(RolloutModule([_flat(make_rollout(seed)) for seed in range(2)]))
    assert summary.spread_logged_steps == 0 and _no_signal_line(summary.summary_lines(trainer)) is None


def test_the_steps_without_reward_spread_survive_a_resume(tmp_path):
    rollouts = [_flat(make_rollout(seed % 2)) for seed in range(4)]
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    _trainer(tmp_path, [FitSummary(), checkpoint], max_steps=2, limit_val_batches=0).fit(SpreadModule(rollouts))
    resumed = FitSummary()
    trainer = _trainer(tmp_path / "resumed", [resumed], max_steps=4, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(SpreadModule(rollouts), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert (resumed.flat_steps, resumed.spread_logged_steps) == (4, 4)
    assert _no_signal_line(resumed.summary_lines(trainer)).startswith("  no signal      all 4 steps:")
    # a checkpoint saved before the summary kept these counts: they cover this fit's steps
    state = resumed.state_dict()
    del state["flat_steps"], state["spread_logged_steps"]
    older = FitSummary()
    older.load_state_dict(state)
    assert (older.flat_steps, older.spread_logged_steps) == (0, 0)


def test_a_step_of_several_micro_batches_has_no_signal_only_where_none_of_them_had(tmp_path):
    rollouts = [_flat(make_rollout(0)), make_rollout(1), _flat(make_rollout(2)), _flat(make_rollout(3))]
    summary = FitSummary(validate_before_training=False)
    trainer = _trainer(tmp_path, [summary], max_steps=2, accumulate_grad_batches=2, enable_checkpointing=False,
                       limit_val_batches=0)
    trainer.fit(SpreadModule(rollouts))
    assert (summary.flat_steps, summary.spread_logged_steps) == (1, 2)


class _ThreadReadings:
    """Fake ``thread_times``: every reading adds ``running_s`` and ``waiting_s`` to one thread's times."""

    def __init__(self, running_s: float, waiting_s: float) -> None:
        self.running_s, self.waiting_s, self.reads = running_s, waiting_s, 0

    def __call__(self):
        from lit_grpo.runtime.threads import ThreadTimes
        n = self.reads
        self.reads += 1
        return ThreadTimes(running_s={7: n * self.running_s}, waiting_s={7: n * self.waiting_s})


def _threads_line(lines: list[str]) -> str | None:
    return next((line for line in lines if line.startswith("  threads")), None)


@pytest.mark.parametrize("quota_cpus, busy", [(None, "keep the cores busy and"),
                                               (8.0, "keep the cores busy or share the CPU quota")])
def test_threads_that_waited_for_busy_cores_are_said_once_during_the_run_and_in_the_summary(tmp_path, monkeypatch,
                                                                                             recwarn, quota_cpus, busy):
    import lit_grpo.callbacks.fit_summary as fit_summary
    from lit_grpo.runtime.validation import CoreLimit
    monkeypatch.setattr(fit_summary, "thread_times", _ThreadReadings(running_s=1.0, waiting_s=2.0))
    # the threads fit the cores: other processes (or, where a CPU quota set the cores, what else uses its time)
    limits = []  # read once a fit, not at every step: the cgroups are files to walk
    monkeypatch.setattr(fit_summary, "core_limit", lambda: limits.append(1) or CoreLimit(8, quota_cpus))
    torch.set_num_threads(2)  # the conftest's fixture sets one again
    summary = FitSummary(validate_before_training=False)
    trainer = _trainer(tmp_path, [summary], max_steps=3, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(RolloutModule([make_rollout(seed) for seed in range(3)]))
    said = [str(w.message) for w in recwarn if "waited for a core" in str(w.message)]
    assert len(said) == 1 and "67% of their time with 2 torch threads" in said[0], said
    line = _threads_line(summary.summary_lines(trainer))
    assert line is not None and line.startswith("  threads        torch's threads waited for a core 67%"), line
    assert busy in line and line.endswith("try --torch_num_threads 1 (or OMP_NUM_THREADS=1)")
    assert len(limits) == 1


def test_a_ranks_threads_are_judged_by_its_share_of_the_nodes_cores(tmp_path, monkeypatch, recwarn):
    """2 ranks on a node of 8 cores, each of 4 threads (the CLI's default share) or 8: the 8 are told to take their
    share, not that other processes keep the cores busy."""
    import lit_grpo.callbacks.fit_summary as fit_summary
    from lit_grpo.runtime.validation import CoreLimit
    monkeypatch.setattr(fit_summary, "thread_times", _ThreadReadings(running_s=1.0, waiting_s=2.0))
    monkeypatch.setattr(fit_summary, "core_limit", lambda: CoreLimit(8))
    monkeypatch.setattr(pl.Trainer, "num_devices", property(lambda trainer: 2))  # rank 0 of 2 on this node
    for threads, advice in ((8, "try --torch_num_threads 4 (or OMP_NUM_THREADS=4)"),
                            (4, "other processes keep the cores busy")):
        torch.set_num_threads(threads)
        summary = FitSummary(validate_before_training=False)
        trainer = _trainer(tmp_path, [summary], max_steps=3, enable_checkpointing=False, limit_val_batches=0)
        trainer.fit(RolloutModule([make_rollout(seed) for seed in range(3)]))
        line = _threads_line(summary.summary_lines(trainer))
        assert line is not None and f"with {threads} torch threads" in line and advice in line, line
        assert "this process's share of the 8 cores among the 2 processes on this node" in line


def test_no_threads_line_on_one_thread_or_where_the_threads_hardly_waited(tmp_path, monkeypatch, recwarn):
    import lit_grpo.callbacks.fit_summary as fit_summary
    for threads, readings in ((1, _ThreadReadings(running_s=1.0, waiting_s=2.0)),
                              (2, _ThreadReadings(running_s=1.0, waiting_s=0.05))):
        monkeypatch.setattr(fit_summary, "thread_times", readings)
        torch.set_num_threads(threads)
        summary = FitSummary(validate_before_training=False)
        trainer = _trainer(tmp_path, [summary], max_steps=3, enable_checkpointing=False, limit_val_batches=0)
        trainer.fit(RolloutModule([make_rollout(seed) for seed in range(3)]))
        assert readings.reads > 1  # read, and judged
        assert _threads_line(summary.summary_lines(trainer)) is None
    assert not [w for w in recwarn if "waited for a core" in str(w.message)]
