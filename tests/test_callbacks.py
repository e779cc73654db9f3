"""The callbacks on a plain regression module and on hand-built lit_grpo rollout batches, read back from TensorBoard."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from callback_helpers import (HOLD_S, MiB, RolloutModule, TinyRegression, events, fit, make_rollout, scalars,
                              touch_memory, touch_memory_until_sampled)

from lit_grpo.runtime import memory
from lit_grpo.callbacks import (
    CompletionLogger,
    ExportModel,
    FitSummary,
    GRPOProgressBar,
    PeakMemoryMonitor,
    RewardForecast,
    RolloutProfiler,
    RunCheckpoint,
    SlotTimelineLogger,
)
from lit_grpo.callbacks.completion_logger import markdown_cell
from lit_grpo.scheduling.base import Decision


# ----------------------------------------------------------------------------------------------------------------
# Any LightningModule
# ----------------------------------------------------------------------------------------------------------------


def test_every_callback_runs_on_a_plain_module(tmp_path):
    monitor = PeakMemoryMonitor()
    callbacks = [monitor, RolloutProfiler(), SlotTimelineLogger(every_n_steps=1), CompletionLogger(),
                 RewardForecast(monitor="train/loss", min_points=5, check_every_n_steps=4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, TinyRegression(), callbacks, max_steps=12)
    accumulator = events(trainer)
    tags = set(accumulator.Tags()["scalars"])

    assert monitor.method in ("hwm+sampling", "sampling")
    peaks = scalars(accumulator, "memory/step_peak_bytes")
    assert len(peaks) == 12 and all(p > 10 * MiB for p in peaks)  # a Python process with torch holds far more
    assert not any(tag.startswith(("rollout/", "completions/")) for tag in tags)
    assert not {"memory/rollout_peak_bytes", "memory/update_peak_bytes"} & tags
    assert {"forecast/plateau_reward", "forecast/step_to_plateau", "forecast/remaining_gain"} <= tags
    assert accumulator.Tags()["images"] == []
    # Each rollout-only callback says once that there is nothing for it, instead of failing or logging zeros.
    for name in ("RolloutProfiler", "SlotTimelineLogger", "CompletionLogger"):
        said = [str(w.message) for w in caught if str(w.message).startswith(name)]
        assert len(said) == 1, name
        # and how a project of its own gets its rollouts to them: the engine's stats on the batch
        assert "batch.stats" in said[0] and "RolloutEngine.generate" in said[0], said[0]


class _ValidatedRegression(TinyRegression):
    """A plain module with a validation loop."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/accuracy", -torch.nn.functional.mse_loss(self.layer(x), y))

    def val_dataloader(self):
        return self.train_dataloader()


def test_reward_forecast_says_when_its_monitor_is_a_validations(tmp_path, recwarn):
    """A value logged in validation stays in callback_metrics between validations, so every training step would
    record its last value again (a flat curve with jumps): said once, naming the monitor, where a value logged at
    every training step is not."""
    forecasts = [RewardForecast(monitor="val/accuracy", min_points=5), RewardForecast(monitor="train/loss")]
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=6, accelerator="cpu", val_check_interval=2,
                         callbacks=forecasts, logger=False, enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=False)
    trainer.fit(_ValidatedRegression())
    said = [str(w.message) for w in recwarn if str(w.message).startswith("RewardForecast")]
    assert sum("monitor='val/accuracy' is logged in validation" in message for message in said) == 1, said
    assert not any("monitor='train/loss'" in message for message in said), said


class _LossLoggedInBoth(_ValidatedRegression):
    def validation_step(self, batch, batch_idx):
        self.log("train/loss", 123.0)  # the same key as training_step's, which overwrites it at every step


def test_reward_forecast_does_not_mistake_a_key_training_steps_log_too_for_a_validations(tmp_path, recwarn):
    forecast = RewardForecast(monitor="train/loss", min_points=5)
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=6, accelerator="cpu", val_check_interval=2,
                         callbacks=[forecast], logger=False, enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=False)
    trainer.fit(_LossLoggedInBoth())
    assert not [str(w.message) for w in recwarn if str(w.message).startswith("RewardForecast")]
    assert 123.0 not in forecast.rewards


def test_the_run_callbacks_work_on_a_plain_module_and_across_a_resume(tmp_path, capsys):
    """FitSummary, RunCheckpoint, GRPOProgressBar and RankFailureWatch on a plain module: a validation before the
    first step, last.ckpt kept, a bar over optimizer steps, a summary; a resume goes on from last.ckpt, the bar at
    its step, RewardForecast with its history."""
    from lit_grpo.callbacks import GRPOProgressBar, RankFailureWatch

    def run(max_steps: int, ckpt_path=None) -> tuple[pl.Trainer, FitSummary, RewardForecast]:
        summary, forecast = FitSummary(), RewardForecast(monitor="train/loss", min_points=5, check_every_n_steps=2)
        trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=max_steps, accelerator="cpu", log_every_n_steps=1,
                             callbacks=[summary, RunCheckpoint(every_n_train_steps=2), GRPOProgressBar(), forecast,
                                        RankFailureWatch()],
                             val_check_interval=2, enable_model_summary=False)
        trainer.fit(_ValidatedRegression(), ckpt_path=ckpt_path)
        return trainer, summary, forecast

    trainer, summary, forecast = run(4)
    last = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert trainer.global_step == 4 and last.is_file()
    assert [step for step, _ in summary.accuracy] == [0, 2, 4]  # before training, then every 2 steps
    assert summary.steps == 4 and forecast.steps == [0.0, 1.0, 2.0, 3.0]
    assert "lit_grpo: 4 steps in" in capsys.readouterr().out

    trainer, summary, forecast = run(6, ckpt_path=last)
    assert trainer.global_step == 6 and summary.steps == 6 and summary.resumed_at == 4  # the whole run's
    assert [step for step, _ in summary.accuracy] == [0, 2, 4, 6]
    assert forecast.steps == [float(step) for step in range(6)]  # the checkpoint's history, then its own points
    bar = trainer.progress_bar_callback.train_progress_bar
    assert (bar.initial, bar.n, bar.total) == (4, 6, 6)
    out = capsys.readouterr().out
    assert "lit_grpo: 6 steps in" in out and "resumed        at step 4, 2 steps in this fit" in out
    assert "GRPO steps" in out


# ----------------------------------------------------------------------------------------------------------------
# PeakMemoryMonitor
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cpu_method", ["auto", "sampling"])
def test_peak_memory_separates_rollout_and_update(tmp_path, cpu_method):
    rollouts = [make_rollout(seed) for seed in range(3)]
    module = RolloutModule(rollouts, update_bytes=48 * MiB, hold_s=HOLD_S)
    module.rollout_bytes = 112 * MiB
    monitor = PeakMemoryMonitor(cpu_method=cpu_method, sample_interval_s=0.002)
    trainer = fit(tmp_path, module, [monitor], max_steps=3)
    accumulator = events(trainer)

    assert monitor.method == ("hwm+sampling" if cpu_method == "auto" else "sampling")
    rollout = scalars(accumulator, "memory/rollout_peak_bytes")
    update = scalars(accumulator, "memory/update_peak_bytes")
    step = scalars(accumulator, "memory/step_peak_bytes")
    assert len(rollout) == len(update) == len(step) == 3
    for r, u, s in zip(rollout, update, step):
        # The 112 MiB rollout and the 48 MiB update each show up in their own phase only.
        assert 40 * MiB < r - u < 88 * MiB
        assert s == max(r, u)
    # What each phase added to what the process already held: about the memory it touched.
    rollout_added = scalars(accumulator, "memory/rollout_peak_delta_bytes")
    update_added = scalars(accumulator, "memory/update_peak_delta_bytes")
    assert len(rollout_added) == len(update_added) == len(scalars(accumulator, "memory/step_peak_delta_bytes")) == 3
    for r, u in zip(rollout_added, update_added):
        assert 96 * MiB < r < 128 * MiB and 32 * MiB < u < 64 * MiB
    assert monitor.max_logged["memory/rollout_peak_bytes"] == max(rollout)
    # The engine's KV figure is RolloutProfiler's alone: one writer per key.
    assert "rollout/peak_kv_bytes" not in accumulator.Tags()["scalars"]


def test_peak_memory_keeps_the_largest_peak_logged_not_the_last(tmp_path, monkeypatch):
    monitor = PeakMemoryMonitor(cpu_method="sampling")
    readings = iter([{"memory/rollout_peak_bytes": 300 * MiB}, {"memory/rollout_peak_bytes": 100 * MiB}])
    monkeypatch.setattr(monitor, "_step_peaks", lambda batch: next(readings))
    trainer = fit(tmp_path, RolloutModule([make_rollout(seed) for seed in range(2)]), [monitor], max_steps=2)
    assert scalars(events(trainer), "memory/rollout_peak_bytes") == [300 * MiB, 100 * MiB]
    assert monitor.max_logged == {"memory/rollout_peak_bytes": 300 * MiB}
    # a second fit with the same callback object reports its own peaks, not the first fit's
    readings = iter([{"memory/rollout_peak_bytes": 50 * MiB}])
    fit(tmp_path / "again", RolloutModule([make_rollout(0)]), [monitor], max_steps=1)
    assert monitor.max_logged == {"memory/rollout_peak_bytes": 50 * MiB}


class _SteppingWithMemory(torch.optim.SGD):
    """SGD whose step touches ``step_bytes`` (stands in for optimizer state allocated in the step)."""

    step_bytes = 0

    def step(self, closure=None):
        loss = super().step(closure)
        touch_memory(self.step_bytes, HOLD_S)
        return loss


@pytest.mark.parametrize("callback, kwargs, match", [
    # a string is truthy: each of these switches was on
    (RolloutProfiler, dict(progress_bar="false"), r"progress_bar='false' must be True or False"),
    (RewardForecast, dict(stop="false"), r"stop='false' must be True or False"),
    (FitSummary, dict(validate_before_training="no"), r"validate_before_training='no' must be True or False"),
    (RunCheckpoint, dict(save_on_validation="no"), r"save_on_validation='no' must be True or False"),
    (ExportModel, dict(adapter_only="no"), r"adapter_only='no' must be True or False"),
    # a NaN period never logged (step % nan is nan, truthy); a float was taken; a string failed a comparison
    (SlotTimelineLogger, dict(every_n_steps=float("nan")), r"every_n_steps=nan must be an integer >= 1"),
    (SlotTimelineLogger, dict(width="900"), r"width='900' must be an integer >= 800"),
    (SlotTimelineLogger, dict(row_height=2.5), r"row_height=2.5 must be an integer >= 2"),
    (CompletionLogger, dict(num_prompts=True), r"num_prompts=True must be an integer >= 1"),
    (CompletionLogger, dict(table_every_n_steps="5"), r"table_every_n_steps='5' must be an integer >= 1"),
    (FitSummary, dict(window=2.5), r"window=2.5 must be an integer >= 1"),
    (FitSummary, dict(accuracy_key=None), r"accuracy_key=None must be a non-empty string"),
    (RewardForecast, dict(monitor=""), r"monitor='' must be a non-empty string"),
    (RunCheckpoint, dict(train_time_interval=60), r"train_time_interval=60 must be a datetime.timedelta"),
    # a repr of an int of more than 4300 digits failed in place of the refusal
    (RunCheckpoint, dict(train_time_interval=10**5000), r"^train_time_interval=\(an int of 5001 digits\) must be a "
                                                        r"datetime.timedelta"),
    (RunCheckpoint, dict(dirpath=3), r"dirpath=3 must be a folder's path or None"),
    (ExportModel, dict(dirpath=""), r"dirpath='' must be a folder's path or None"),  # it was the current folder
    # Lightning's bar took these: a negative rate hid it, a string failed at the first step, "no" left it on screen
    (GRPOProgressBar, dict(refresh_rate=-1), r"refresh_rate=-1 must be an integer >= 0 \(steps between redraws; "
                                             r"0: no bar\)"),
    (GRPOProgressBar, dict(refresh_rate="10"), r"refresh_rate='10' must be an integer >= 0"),
    (GRPOProgressBar, dict(process_position=0.5), r"process_position=0.5 must be an integer >= 0"),
    (GRPOProgressBar, dict(leave="no"), r"leave='no' must be True or False"),
])
def test_bad_callback_settings_are_named(callback, kwargs, match):
    with pytest.raises(ValueError, match=match):
        callback(**kwargs)


@pytest.mark.parametrize("interval", [0, -1, float("inf"), float("nan")])
def test_peak_memory_refuses_a_sampling_interval_that_is_not_a_finite_positive_time(interval):
    # an infinite one crashed the sampling thread and the run still exited 0
    with pytest.raises(ValueError, match=rf"sample_interval_s={interval!r} is not allowed; .* finite number > 0"):
        PeakMemoryMonitor(sample_interval_s=interval)


def test_peak_memory_splits_the_optimizer_step_off_the_update(tmp_path):
    rollouts = [make_rollout(seed) for seed in range(2)]
    module = RolloutModule(rollouts, update_bytes=96 * MiB, hold_s=HOLD_S)
    _SteppingWithMemory.step_bytes = 32 * MiB
    module.configure_optimizers = lambda: _SteppingWithMemory(module.parameters(), lr=0.1)
    trainer = fit(tmp_path, module, [PeakMemoryMonitor()], max_steps=2)
    accumulator = events(trainer)
    update = scalars(accumulator, "memory/update_peak_bytes")
    optimizer = scalars(accumulator, "memory/optimizer_peak_bytes")
    step = scalars(accumulator, "memory/step_peak_bytes")
    added = scalars(accumulator, "memory/optimizer_peak_delta_bytes")
    assert len(update) == len(optimizer) == len(step) == len(added) == 2
    for u, o, s, a in zip(update, optimizer, step, added):
        # the 96 MiB forward/backward stays in the whole update's peak, not in the optimizer step's
        assert 40 * MiB < u - o < 88 * MiB and s >= u
        assert 16 * MiB < a < 48 * MiB  # what the step itself touched


def test_peak_memory_hwm_probe_and_reset():
    assert memory.hwm_reset_problem() is None  # Linux lets a process reset its own VmHWM
    tracker = memory.KernelHighWaterMark()
    tracker.reset()
    before = tracker.read()["peak_bytes"]
    touch_memory(64 * MiB, 0.0)
    raised = tracker.read()["peak_bytes"]
    tracker.reset()
    assert raised - before > 48 * MiB  # the short-lived block is caught after it was freed
    assert tracker.read()["peak_bytes"] < raised - 48 * MiB


FRAGMENTED_HEAP = """
import torch
from lit_grpo.runtime import memory
kept, freed = [], []
for index in range(4000):  # 64 KiB each, every 20th kept: 250 MiB allocated, 237.5 MiB of it freed below kept
    (kept if index % 20 == 19 else freed).append(torch.ones(16 * 1024))
del freed
before = memory.read_statm_rss()
released = memory.release_freed_host_memory()
print(released, before - memory.read_statm_rss(), all(bool((block == 1).all()) for block in kept))
"""


def test_release_freed_host_memory_returns_the_freed_heap_pages():
    """Blocks below glibc's mmap threshold live on the heap; freed below a live one, they stay resident until
    ``release_freed_host_memory``. (In a fresh process: the freed heap it leaves would serve other tests'
    allocations, which expect fresh mappings.)"""
    out = subprocess.run([sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True, text=True, check=True)
    released, dropped, intact = out.stdout.split()
    assert released == "True"  # glibc (Linux): malloc_trim exists
    assert int(dropped) > 150 * MiB
    assert intact == "True"  # live memory untouched


def test_peak_memory_warns_and_logs_nothing_when_unmeasurable(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "hwm_reset_problem", lambda: "cannot reset the mark (test)")
    monkeypatch.setattr(memory, "rss_reader", lambda: None)
    monitor = PeakMemoryMonitor()
    with pytest.warns(UserWarning, match="cannot read the process RSS") as caught:
        trainer = fit(tmp_path, RolloutModule([make_rollout(0), make_rollout(1)]), [monitor], max_steps=2)
    assert sum("PeakMemoryMonitor" in str(w.message) for w in caught) == 1
    tags = events(trainer).Tags()["scalars"]
    assert monitor.method is None
    assert not any(tag.startswith("memory/") for tag in tags)


def test_peak_memory_auto_leaves_the_kernels_mark_alone():
    """The default reads VmHWM and never resets it: what /usr/bin/time -v or ru_maxrss report of the process stays
    what it held (the issue: a reset mark made outside tools read 2.6 GB of a process that held 3.9 GB)."""
    touch_memory(64 * MiB, 0.0)  # the mark is now >= 64 MiB above what is held
    raised = memory.read_status_bytes("VmHWM")
    assert raised - memory.read_statm_rss() > 48 * MiB
    tracker, message = memory.make_peak_tracker(torch.device("cpu"), "auto", 0.002)
    try:
        assert tracker.name == "hwm+sampling" and message is None
        for _ in range(3):
            tracker.reset()
            touch_memory_until_sampled(16 * MiB, tracker._sampled)  # below the earlier peak: the thread sees it
            assert tracker.read()["peak_bytes"] - tracker.current() > 8 * MiB
    finally:
        tracker.close()
    assert memory.read_status_bytes("VmHWM") >= raised


SPIKE_ABOVE_THE_MARK = """
import mmap
from lit_grpo.runtime import memory
tracker, _ = memory.make_peak_tracker(__import__("torch").device("cpu"), "auto", 60.0)  # the thread never polls
size = memory.read_status_bytes("VmHWM") - memory.read_statm_rss() + (96 << 20)
tracker.reset()
held = tracker.current()
with mmap.mmap(-1, size) as block:  # a spike far shorter than the sampling interval, above every earlier peak
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
print(tracker.name, tracker.read()["peak_bytes"] - held >= size - (8 << 20))
tracker.close()
"""


def test_peak_memory_auto_catches_a_new_peak_shorter_than_its_sampling_interval():
    out = subprocess.run([sys.executable, "-c", SPIKE_ABOVE_THE_MARK], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["hwm+sampling", "True"]


def test_a_sample_read_before_a_reset_does_not_count_after_it():
    """The sampling thread reads RSS outside the lock: a reading it took before ``reset()`` (the rollout's KV still
    held) must not become the next phase's peak."""
    import threading

    rss = {"now": 100}
    inside, release = threading.Event(), threading.Event()

    def read():
        value = rss["now"]
        if threading.current_thread().name == "PeakMemoryMonitor-rss" and not release.is_set():
            inside.set()
            release.wait(5)
        return value

    tracker = memory.SampledRss(read, interval_s=0.001)
    try:
        assert inside.wait(5)  # the sampler has read 100 and waits
        rss["now"] = 10  # the memory is freed, the next phase starts
        tracker.reset()
        release.set()
        time.sleep(0.05)
        assert tracker.read()["peak_bytes"] == 10
    finally:
        release.set()
        tracker.close()


def test_peak_memory_falls_back_to_sampling_with_a_warning(monkeypatch):
    def no_status(field):
        raise OSError(f"{field} not found (test)")

    monkeypatch.setattr(memory, "read_status_bytes", no_status)
    tracker, message = memory.make_peak_tracker(torch.device("cpu"), "auto", 0.002)
    try:
        assert tracker.name == "sampling"
        assert "VmHWM not found (test)" in message and "sampling RSS every 2 ms" in message
        tracker.reset()
        touch_memory_until_sampled(64 * MiB, tracker)
        assert tracker.read()["peak_bytes"] - memory.read_statm_rss() > 48 * MiB
    finally:
        tracker.close()
    monkeypatch.setattr(memory, "hwm_reset_problem", lambda: "clear_refs is read-only here (test)")
    tracker, message = memory.make_peak_tracker(torch.device("cpu"), "hwm", 0.002)
    assert tracker is None and "not logged" in message


# ----------------------------------------------------------------------------------------------------------------
# RolloutProfiler
# ----------------------------------------------------------------------------------------------------------------


def test_rollout_profiler_logs_every_rollout_and_the_progress_bar(tmp_path):
    rollouts = [make_rollout(0), make_rollout(1, with_predictor=False), make_rollout(2)]
    trainer = fit(tmp_path, RolloutModule(rollouts), [RolloutProfiler(read_bytes_per_s=1e9)], max_steps=3)
    accumulator = events(trainer)

    for field in ("decode_steps", "lower_bound_steps", "slot_utilization", "prefill_tokens", "generated_tokens",
                  "tokens_per_s", "wall_s", "peak_kv_bytes", "capture_s"):
        expected = [float(getattr(r.stats, field)) for r in rollouts]
        assert scalars(accumulator, f"rollout/{field}") == pytest.approx(expected, rel=1e-6), field
    expected = [1000 * (0.5 - 0.05 * seed) / r.stats.decode_steps for seed, r in enumerate(rollouts)]
    assert scalars(accumulator, "rollout/ms_per_step") == pytest.approx(expected, rel=1e-6)
    expected = [1000 * 0.3 / r.stats.decode_steps for r in rollouts]
    assert scalars(accumulator, "rollout/decode_ms_per_step") == pytest.approx(expected, rel=1e-6)
    expected = [1000 * 0.01 * (seed + 1) / r.stats.prefill_tokens for seed, r in enumerate(rollouts)]
    assert scalars(accumulator, "rollout/prefill_ms_per_token") == pytest.approx(expected, rel=1e-6)
    # every step read 2 MB: at 1 GB/s its floor is 2 ms, and the ratio is ms_per_step over it
    assert scalars(accumulator, "rollout/floor_ms_per_step") == pytest.approx([2.0] * 3, rel=1e-9)
    ratios = [r.stats.ms_per_step / 2.0 for r in rollouts]
    assert scalars(accumulator, "rollout/roofline_ratio") == pytest.approx(ratios, rel=1e-6)
    # The predictor's figures exist only for rollouts that had a predictor: skipped, not logged as 0.
    assert [e.step for e in accumulator.Scalars("rollout/length_pred_kendall_tau")] == [0, 2]
    assert scalars(accumulator, "rollout/length_pred_smape") == [0.25, 0.25]

    last = rollouts[-1].stats
    bar = trainer.progress_bar_metrics
    assert bar["steps"] == last.decode_steps and bar["bound"] == last.lower_bound_steps
    assert bar["util"] == pytest.approx(last.slot_utilization)
    assert not {"steps", "bound", "util"} & set(accumulator.Tags()["scalars"])  # progress bar only


# ----------------------------------------------------------------------------------------------------------------
# CompletionLogger
# ----------------------------------------------------------------------------------------------------------------


class LengthLoggingModule(RolloutModule):
    """Logs completions/mean_length itself, as GRPOModule does (with a marker value to tell the writers apart)."""

    def training_step(self, batch, batch_idx):
        self.log("completions/mean_length", -1.0)
        return super().training_step(batch, batch_idx)


def test_completion_logger_leaves_keys_the_module_logs_itself(tmp_path):
    rollouts = [make_rollout(seed) for seed in range(3)]
    trainer = fit(tmp_path, LengthLoggingModule(rollouts), [CompletionLogger()], max_steps=3)
    accumulator = events(trainer)
    assert scalars(accumulator, "completions/mean_length") == [-1.0, -1.0, -1.0]  # one writer, one value per step
    assert scalars(accumulator, "completions/max_length") == [r.completion_lengths.max().item() for r in rollouts]


def test_completion_logger_scalars_histogram_and_table(tmp_path):
    rollouts = [make_rollout(seed) for seed in range(4)]
    trainer = fit(tmp_path, RolloutModule(rollouts), [CompletionLogger(table_every_n_steps=3, num_prompts=1,
                                                                       num_completions=2)], max_steps=4)
    accumulator = events(trainer)

    lengths = [r.completion_lengths.double() for r in rollouts]
    assert scalars(accumulator, "completions/mean_length") == pytest.approx([x.mean().item() for x in lengths])
    assert scalars(accumulator, "completions/min_length") == [x.min().item() for x in lengths]
    assert scalars(accumulator, "completions/max_length") == [x.max().item() for x in lengths]
    assert scalars(accumulator, "completions/clipped_ratio") == pytest.approx(
        [r.truncated.double().mean().item() for r in rollouts])

    histograms = accumulator.Histograms("completions/length")
    assert [h.step for h in histograms] == [0, 1, 2, 3]
    assert histograms[0].histogram_value.num == 8 and histograms[0].histogram_value.max == lengths[0].max()

    tables = accumulator.Tensors("completions/samples/text_summary")
    assert [t.step for t in tables] == [0, 3]
    text = tables[0].tensor_proto.string_val[0].decode()
    reward = rollouts[0].rewards[0, 1].item()
    assert "prompt number 0" in text and "prompt number 1" not in text
    assert f"| 1 | {reward:.3f} |" in text and "answer 0.1 \\| \\*x\\* <br> second line" in text
    assert "answer 0.2" not in text


@dataclass
class _StatsOnly:
    """A batch of a project of its own that hands the engine's RolloutStats to the callbacks, and no more."""

    stats: object


def test_completion_logger_names_what_a_batch_with_stats_alone_lacks(tmp_path):
    """RolloutProfiler and SlotTimelineLogger need only ``batch.stats``; CompletionLogger needs the completions too,
    and says which of them the batch lacks rather than failing on the first attribute it reads."""
    rollouts = [_StatsOnly(make_rollout(seed).stats) for seed in range(2)]
    with pytest.raises(TypeError, match=r"CompletionLogger: .* lacks prompts, completions, rewards, "
                                        r"completion_lengths, truncated: .*lit_grpo\.batch\.RolloutBatch"):
        fit(tmp_path, _StatsOnlyModule(rollouts), [CompletionLogger()], max_steps=2)
    trainer = fit(tmp_path, _StatsOnlyModule(rollouts), [RolloutProfiler(read_bytes_per_s=1e9)], max_steps=2)
    assert scalars(events(trainer), "rollout/decode_steps") == [r.stats.decode_steps for r in rollouts]


class _StatsOnlyModule(RolloutModule):
    def training_step(self, batch, batch_idx):
        return (self.weight - 1.0) ** 2


def test_markdown_cell_escapes_and_cuts():
    assert markdown_cell("a|b\nc", 100) == "a\\|b<br>c"
    assert markdown_cell("<script>", 100) == "\\<script\\>"
    assert markdown_cell("abcdef", 3) == "abc…"


# ----------------------------------------------------------------------------------------------------------------
# Several processes: the whole step's figures (two ranks stood in for in one process)
# ----------------------------------------------------------------------------------------------------------------


class _RecordingLogger:
    def __init__(self) -> None:
        self.logged: list[dict] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.logged.append(dict(metrics))


def _stand_in_trainer(all_gather, datamodule: object = None) -> SimpleNamespace:
    """What the callbacks read of a trainer of world size 2, with ``all_gather`` as the strategy's, whose datamodule
    declares its training batches rollouts (as RolloutDataModule does) unless ``datamodule`` is given."""
    strategy = SimpleNamespace(root_device=torch.device("cpu"), all_gather=all_gather)
    datamodule = SimpleNamespace(yields_rollouts=True) if datamodule is None else datamodule
    return SimpleNamespace(world_size=2, strategy=strategy, callbacks=[], datamodule=datamodule,
                           loggers=[_RecordingLogger()], log_every_n_steps=1, should_stop=False, callback_metrics={},
                           accumulate_grad_batches=1, is_last_batch=False, is_global_zero=False,
                           fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=0)))


def _as_rank_zero_of_two(hook) -> list[dict]:
    """Calls ``hook(rank, trainer)`` as rank 1, then as rank 0, whose gathers return rank 0's tensor stacked with
    what rank 1 gathered at the same point; returns what rank 0 logged."""
    from_rank_one: list[torch.Tensor] = []
    hook(1, _stand_in_trainer(lambda tensor: from_rank_one.append(tensor) or torch.stack([tensor, tensor])))
    zero = _stand_in_trainer(lambda tensor: torch.stack([tensor, from_rank_one.pop(0)]))
    hook(0, zero)
    assert not from_rank_one  # both ranks gathered as often
    return zero.loggers[0].logged


def test_rollout_profiler_logs_the_whole_step_over_ranks():
    rollouts = [make_rollout(0), make_rollout(1, with_predictor=False)]
    rollouts[1].stats.wall_s = 0.9
    rollouts[0].stats.decode_read_bytes *= 2  # rank 0's steps read 4 MB each
    profilers = [RolloutProfiler(progress_bar=False, read_bytes_per_s=1e9) for _ in rollouts]
    summaries, trainers = [FitSummary() for _ in rollouts], {}

    def hook(rank, trainer):
        trainers[rank] = trainer
        profilers[rank].on_train_batch_end(trainer, None, None, rollouts[rank], 0)
        summaries[rank].on_train_batch_end(trainer, None, None, rollouts[rank], 0)

    (logged,) = _as_rank_zero_of_two(hook)
    a, b = (r.stats for r in rollouts)
    # the fit summary's throughput is the logged one: the ranks generate at once
    trainers[0].callbacks = [profilers[0]]
    assert summaries[0]._floor_line(trainers[0]).endswith(f"; {logged['rollout/tokens_per_s']:.0f} tokens/s")
    # the largest floor, and the slowest rank's step over it
    assert logged["rollout/floor_ms_per_step"] == pytest.approx(4.0)
    assert logged["rollout/roofline_ratio"] == pytest.approx(max(a.ms_per_step, b.ms_per_step) / 4.0)
    assert logged["rollout/generated_tokens"] == a.generated_tokens + b.generated_tokens  # counts add up
    assert logged["rollout/prefill_tokens"] == a.prefill_tokens + b.prefill_tokens
    assert logged["rollout/decode_steps"] == max(a.decode_steps, b.decode_steps)  # the slowest rank's
    assert logged["rollout/wall_s"] == 0.9 and logged["rollout/capture_s"] == 0.05
    assert logged["rollout/ms_per_step"] == pytest.approx(max(a.ms_per_step, b.ms_per_step))
    # the step's throughput: every rank's tokens over the slowest rank's time, not the sum of the ranks' rates
    assert logged["rollout/tokens_per_s"] == pytest.approx((a.generated_tokens + b.generated_tokens) / 0.9)
    assert logged["rollout/tokens_per_s"] < a.tokens_per_s + b.tokens_per_s
    assert logged["rollout/peak_kv_bytes"] == 1001  # the largest process's
    assert logged["rollout/length_pred_kendall_tau"] == 0.5  # rank 1 had no predictor: rank 0's alone


def test_rollout_profiler_measures_no_bandwidth_without_rollouts(tmp_path, monkeypatch):
    """On a plain module the profiler does nothing (no probe of hundreds of MiB) and says so once; the summary
    has no floor to draw either."""
    from lit_grpo.sampling import roofline

    probes = []
    monkeypatch.setattr(roofline, "_BANDWIDTH", {})  # nothing measured yet in this process
    monkeypatch.setattr(roofline, "measure_read_bandwidth", lambda device: probes.append(device) or 1e9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, TinyRegression(), [PeakMemoryMonitor(), RolloutProfiler(), FitSummary()], max_steps=3)
    assert probes == []
    assert sum(str(w.message).startswith("RolloutProfiler") for w in caught) == 1


@pytest.mark.parametrize("profiler_first", [True, False])
def test_rollout_profiler_keeps_its_bandwidth_probe_out_of_the_memory_peaks(tmp_path, monkeypatch, profiler_first):
    """The probe runs at the first rollout, inside a step: its buffer (here 256 MiB) is no phase's peak, whichever
    callback comes first, and the peaks measured before it in the same window are kept."""
    from lit_grpo.sampling import roofline

    probes = []
    monkeypatch.setattr(roofline, "_BANDWIDTH", {})  # nothing measured yet in this process
    monkeypatch.setattr(roofline, "measure_read_bandwidth",
                        lambda device: probes.append(device) or touch_memory(256 * MiB, 0.05) or 1e9)
    monitor, profiler = PeakMemoryMonitor(), RolloutProfiler(progress_bar=False)
    module = RolloutModule([make_rollout(seed) for seed in range(3)], update_bytes=48 * MiB, hold_s=HOLD_S)
    trainer = fit(tmp_path, module, [profiler, monitor] if profiler_first else [monitor, profiler], max_steps=3)
    assert len(probes) == 1
    accumulator = events(trainer)
    for phase in ("rollout", "update", "step"):
        added = scalars(accumulator, f"memory/{phase}_peak_delta_bytes")
        assert len(added) == 3 and max(added) < 128 * MiB, (phase, added)
    assert min(scalars(accumulator, "memory/update_peak_delta_bytes")) > 40 * MiB  # the update's own, kept


def test_rollout_profiler_pauses_the_memory_peaks_only_for_a_probe_that_runs(tmp_path, monkeypatch):
    """The process measures its bandwidth once (lit_grpo.sampling.roofline keeps it): a later fit's profiler, or
    one after set_read_bandwidth, reads it there and leaves the memory peaks alone, where no probe runs."""
    from lit_grpo.sampling import roofline

    probes, pauses = [], []
    monkeypatch.setattr(roofline, "_BANDWIDTH", {})  # nothing measured yet in this process
    monkeypatch.setattr(roofline, "measure_read_bandwidth", lambda device: probes.append(device) or 1e9)
    paused = PeakMemoryMonitor.paused
    monkeypatch.setattr(PeakMemoryMonitor, "paused", lambda monitor: pauses.append(monitor) or paused(monitor))
    for run in ("first", "second"):
        fit(tmp_path / run, RolloutModule([make_rollout(0)]), [PeakMemoryMonitor(), RolloutProfiler()], max_steps=1)
    assert probes == ["cpu"] and len(pauses) == 1
    roofline.set_read_bandwidth("cpu", 2e9)
    trainer = fit(tmp_path / "given", RolloutModule([make_rollout(0)]), [PeakMemoryMonitor(), RolloutProfiler()],
                  max_steps=1)
    assert probes == ["cpu"] and len(pauses) == 1
    assert scalars(events(trainer), "rollout/floor_ms_per_step") == pytest.approx([1.0])  # 2 MB a step at 2 GB/s


def test_completion_logger_logs_the_whole_steps_lengths_over_ranks():
    rollouts = [make_rollout(0), make_rollout(1)]
    rollouts[1].completion_lengths = rollouts[1].completion_lengths + 20  # rank 1 wrote longer completions
    rollouts[1].truncated = torch.ones_like(rollouts[1].truncated)
    loggers = [CompletionLogger() for _ in rollouts]
    (logged,) = _as_rank_zero_of_two(
        lambda rank, trainer: loggers[rank].on_train_batch_end(trainer, None, None, rollouts[rank], 0))
    both = torch.cat([r.completion_lengths.flatten() for r in rollouts]).double()
    assert logged["completions/min_length"] == both.min() and logged["completions/max_length"] == both.max()
    assert logged["completions/mean_length"] == pytest.approx(float(both.mean()))  # equal shares: the mean of means
    clipped = torch.cat([r.truncated.flatten() for r in rollouts]).double().mean()
    assert logged["completions/clipped_ratio"] == pytest.approx(float(clipped))


@pytest.mark.parametrize("with_rollout", [0, 1])
def test_rollout_callbacks_gather_on_every_rank_where_only_one_has_a_rollout(with_rollout):
    """A module whose batches are not all rollouts: at a step where one rank's batch has none, that rank still joins
    each callback's gather (skipping it would leave the other waiting there), and rank 0 logs the rank's that has
    one."""
    rollout = make_rollout(0)
    callbacks = [[RolloutProfiler(progress_bar=False), CompletionLogger(), FitSummary()] for _ in range(2)]

    def hook(rank, trainer):
        batch = rollout if rank == with_rollout else (torch.zeros(8, 4), torch.zeros(8, 1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the plain batch's "left out" notes
            for callback in callbacks[rank]:
                callback.on_train_batch_end(trainer, None, None, batch, 0)

    logged = _as_rank_zero_of_two(hook)
    figures = {key: value for metrics in logged for key, value in metrics.items()}
    assert figures["rollout/generated_tokens"] == rollout.stats.generated_tokens  # the one rank's rollout
    assert figures["completions/max_length"] == rollout.completion_lengths.max()
    assert callbacks[0][2].rollout_totals.generated_tokens == rollout.stats.generated_tokens


@pytest.mark.parametrize("datamodule", [SimpleNamespace(), SimpleNamespace(yields_rollouts=False)])
def test_rollout_callbacks_gather_nothing_from_a_source_that_declares_no_rollouts(datamodule):
    """Under several processes, from a source that does not declare its training batches rollouts: a plain batch
    makes no collective, and a rollout batch is refused by each callback, naming the declaration, rather than
    reported from one rank alone."""
    def no_gather(tensor):
        raise AssertionError("a callback gathered on a plain module's batch")

    trainer = _stand_in_trainer(no_gather, datamodule)
    callbacks = [RolloutProfiler(progress_bar=False), CompletionLogger(), FitSummary()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plain batch's "left out" notes
        for callback in callbacks:
            callback.on_train_batch_end(trainer, None, None, (torch.zeros(8, 4), torch.zeros(8, 1)), 0)
    assert trainer.loggers[0].logged == [] and callbacks[2].rollouts == 0
    for callback in callbacks:
        with pytest.raises(RuntimeError, match=rf"^{type(callback).__name__}: .* under 2 processes.* does not "
                                               r"declare.*yields_rollouts = True"):
            callback.on_train_batch_end(trainer, None, None, make_rollout(0), 0)


def test_a_rollout_from_loaders_given_to_fit_is_refused_saying_where_the_declaration_goes():
    """Loaders passed to ``fit`` (or defined on the module) cannot declare anything: the refusal says to yield the
    rollouts from a data module that does."""
    trainer = _stand_in_trainer(None)
    trainer.datamodule = None
    with pytest.raises(RuntimeError, match=r"^RolloutProfiler: .* no datamodule \(loaders of its own\).* loaders "
                                           r"cannot declare it: yield the rollouts from a LightningDataModule with "
                                           r"the class attribute yields_rollouts = True"):
        RolloutProfiler(progress_bar=False).on_train_batch_end(trainer, None, None, make_rollout(0), 0)


@pytest.mark.parametrize("source", ["plain", "declared", "undeclared"])
def test_rollout_callbacks_under_two_gloo_ranks_gather_only_for_a_source_that_declares_rollouts(tmp_path, source):
    """2 ranks over gloo (tests/plain_ddp_callbacks.py, a Lightning project of its own): a plain module with
    FitSummary, RolloutProfiler and CompletionLogger makes no gather at any training batch; rollouts from a data
    module that declares them are gathered at every batch, one gather a callback, and logged as the whole step's on
    both ranks; the same rollouts from the module's own loader stop both ranks at the first batch, naming the
    declaration."""
    import json
    from pathlib import Path

    import forked_cli
    from tools.harness import free_port, repo_env

    script = str(Path(__file__).parent / "plain_ddp_callbacks.py")
    outputs = forked_cli.run_ranks([str(tmp_path), source], tmp_path, free_port(), 120, env=repo_env(),
                                   script=script)
    if source == "undeclared":
        for code, output, _ in outputs:
            assert code == 1, output[-4000:]
            assert "not declare that its training batches are rollouts" in output, output[-4000:]
        return
    for rank, (code, output, _) in enumerate(outputs):
        assert code == 0, f"rank {rank} ended with {code}:\n{output[-4000:]}"
        # lit_grpo's gathers go through Lightning's, which calls torch's deprecated autograd gather: a warning
        # about nothing in the project that runs them
        assert "all_gather is deprecated" not in output, output[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    per_batch = [[b - a for a, b in zip([0, *rank["gathers_by_batch"]], rank["gathers_by_batch"])]
                 for rank in ranks]
    assert len(per_batch[0]) == 4
    if source == "plain":
        assert per_batch == [[0] * 4, [0] * 4]
        assert ranks[0]["logged"] == ranks[1]["logged"] == []
        return
    assert per_batch == [[3] * 4, [3] * 4]  # FitSummary, RolloutProfiler and CompletionLogger: one gather each
    tokens = [a + b for a, b in zip(ranks[0]["generated_tokens"], ranks[1]["generated_tokens"])]
    lengths = [a + b for a, b in zip(ranks[0]["lengths"], ranks[1]["lengths"])]
    assert ranks[0]["generated_tokens"] != ranks[1]["generated_tokens"]  # each rank its own rollouts
    for rank in ranks:
        assert [step["rollout/generated_tokens"] for step in rank["logged"]] == tokens
        assert [step["completions/max_length"] for step in rank["logged"]] == [max(step) for step in lengths]
        assert rank["summary_generated_tokens"] == sum(tokens) and rank["summary_rollouts"] == 4


def test_the_rollout_data_module_declares_its_batches_rollouts():
    from lit_grpo.callbacks._rollout import declares_rollouts
    from lit_grpo.datamodules.rollout import RolloutDataModule

    assert declares_rollouts(SimpleNamespace(datamodule=RolloutDataModule(prompts=["a", "b"])))
    assert not declares_rollouts(SimpleNamespace(datamodule=None))


def _decisions(**counts: int) -> list[Decision]:
    """``count`` decisions of each ``action_reason`` (slot 0, sample (0, 0): only their names are counted)."""
    return [Decision(step, 0, (0, 0), *name.split("_", 1)) for name, count in counts.items() for step in range(count)]


def test_rollout_profiler_counts_the_decisions_and_preemption_over_ranks():
    """Each decision name's count adds up over ranks, and only the names some rank counted are logged;
    rollout/preempting is the share of ranks that preempted."""
    rollouts = [make_rollout(0), make_rollout(1)]
    preempted, first_come = (r.stats for r in rollouts)
    preempted.decisions = _decisions(start_least_attained=3, park_preemption=2, resume_least_attained=2,
                                     start_arrival=1)
    preempted.preempting = 1.0
    first_come.decisions, first_come.preempting = _decisions(start_arrival=4), 0.0
    profilers = [RolloutProfiler(progress_bar=False) for _ in rollouts]
    (logged,) = _as_rank_zero_of_two(
        lambda rank, trainer: profilers[rank].on_train_batch_end(trainer, None, None, rollouts[rank], 0))
    assert {key: value for key, value in logged.items() if key.startswith("rollout/decisions/")} == {
        "rollout/decisions/start_arrival": 5, "rollout/decisions/start_least_attained": 3,
        "rollout/decisions/resume_least_attained": 2, "rollout/decisions/park_preemption": 2}
    assert logged["rollout/preempting"] == 0.5
    assert logged["rollout/generated_tokens"] == preempted.generated_tokens + first_come.generated_tokens

    one = _stand_in_trainer(None)
    one.world_size = 1
    RolloutProfiler(progress_bar=False).on_train_batch_end(one, None, None, rollouts[1], 0)
    rollouts[1].stats.preempting = None  # another strategy: no figure
    rollouts[1].stats.decisions = []
    RolloutProfiler(progress_bar=False).on_train_batch_end(one, None, None, rollouts[1], 0)
    first, second = one.loggers[0].logged
    assert first["rollout/decisions/start_arrival"] == 4 and first["rollout/preempting"] == 0.0
    assert not {key for key in second if key.startswith("rollout/decisions/")} and "rollout/preempting" not in second

    summary = FitSummary()  # keeps the run's totals, not every decision of the run
    summary.on_train_batch_end(one, None, None, rollouts[0], 0)
    assert summary.rollout_totals.decisions == [] and summary.rollout_totals.generated_tokens > 0

    # a custom scheduler's own reason: counted as "other" with a warning, never an error (a rank that raised there
    # would leave the others waiting in the gather)
    rollouts[1].stats.decisions = _decisions(start_hunch=2, start_arrival=1)
    with pytest.warns(UserWarning, match="start_hunch.*rollout/decisions/other"):
        RolloutProfiler(progress_bar=False).on_train_batch_end(one, None, None, rollouts[1], 0)
    third = one.loggers[0].logged[-1]
    assert third["rollout/decisions/other"] == 2 and third["rollout/decisions/start_arrival"] == 1


class _FixedTracker:
    """A memory tracker that always reads ``peak`` bytes."""

    name = "fixed"

    def __init__(self, peak: int) -> None:
        self.peak = peak

    def read(self) -> dict[str, int]:
        return {"peak_bytes": self.peak}

    def current(self) -> int:
        return 0

    def reset(self) -> None:
        pass


@pytest.mark.parametrize("peer_peak", [300 * MiB, None])
def test_peak_memory_logs_the_largest_ranks_peaks(peer_peak):
    """The largest rank's peak; a rank that cannot measure (no tracker) still joins the gather, left out of it."""
    monitors = [PeakMemoryMonitor(), PeakMemoryMonitor()]
    monitors[0]._tracker = _FixedTracker(100 * MiB)
    monitors[1]._tracker = _FixedTracker(peer_peak) if peer_peak is not None else None
    rollout = make_rollout(0)

    def step(rank, trainer):
        monitors[rank].on_train_batch_start(trainer, None, rollout, 0)
        monitors[rank].on_train_batch_end(trainer, None, None, rollout, 0)

    (logged,) = _as_rank_zero_of_two(step)
    expected = peer_peak or 100 * MiB
    assert logged["memory/step_peak_bytes"] == logged["memory/rollout_peak_bytes"] == expected
    assert monitors[0].max_logged["memory/step_peak_bytes"] == expected


def test_fit_summary_counts_every_ranks_rollouts():
    """A step's rollout time is its slowest rank's; the decode and prefill figures are every rank's."""
    rollouts = [make_rollout(0), make_rollout(1)]
    rollouts[1].stats.wall_s = 0.9
    summaries = [FitSummary(), FitSummary()]
    _as_rank_zero_of_two(lambda rank, trainer: summaries[rank].on_train_batch_end(trainer, None, None,
                                                                                  rollouts[rank], 0))
    a, b = (r.stats for r in rollouts)
    totals = summaries[0].rollout_totals
    assert totals.generated_tokens == a.generated_tokens + b.generated_tokens
    assert summaries[0].rollouts == 1 and summaries[0].rollout_s == 0.9
    decode_steps = a.decode_steps + b.decode_steps
    assert totals.decode_ms_per_step == pytest.approx(1000 * (a.decode_s + b.decode_s) / decode_steps)


class _AccumulatingWithMemory(TinyRegression):
    """Touches memory in the first of every 3 micro-batches only: the step's peak is there, not in its last."""

    def training_step(self, batch, batch_idx):
        if batch_idx % 3 == 0:
            touch_memory(96 * MiB, HOLD_S)
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        from torch.utils.data import DataLoader, TensorDataset

        x = torch.randn(48, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)  # 6 batches: 2 steps


def test_peak_memory_under_gradient_accumulation_is_the_whole_steps(tmp_path):
    """Any LightningModule: with accumulate_grad_batches 3 a step is 3 micro-batches, logged once, its peak the
    largest of the three (here the first's)."""
    logged = []

    from lightning.pytorch.loggers import CSVLogger

    class Recording(CSVLogger):
        def log_metrics(self, metrics, step=None):
            logged.append((step, metrics))

    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=2, accumulate_grad_batches=3, accelerator="cpu",
                         callbacks=[PeakMemoryMonitor(cpu_method="sampling", sample_interval_s=0.002)],
                         logger=Recording(tmp_path), log_every_n_steps=1, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(_AccumulatingWithMemory())
    peaks = [(step, m["memory/step_peak_delta_bytes"]) for step, m in logged if "memory/step_peak_delta_bytes" in m]
    assert [step for step, _ in peaks] == [0, 1]
    assert all(delta > 64 * MiB for _, delta in peaks)


class _AccumulatingRollouts(RolloutModule):
    """Rollout batches under accumulate_grad_batches 2: the first micro-batch's update touches 96 MiB, the rollouts
    nothing."""

    def training_step(self, batch, batch_idx):
        if batch_idx % 2 == 0:
            touch_memory(96 * MiB, HOLD_S)
        return super().training_step(batch, batch_idx)


def test_peak_memory_under_gradient_accumulation_keeps_each_phase_apart(tmp_path):
    """A step of 2 micro-batches: the first update's memory is the update's and the step's peak, never counted in
    the rollout fetched after it (each micro-batch's rollout window starts at the previous one's end)."""
    from lightning.pytorch.loggers import CSVLogger

    logged = []

    class Recording(CSVLogger):
        def log_metrics(self, metrics, step=None):
            logged.append(metrics)

    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=2, accumulate_grad_batches=2, accelerator="cpu",
                         callbacks=[PeakMemoryMonitor(cpu_method="sampling", sample_interval_s=0.002)],
                         logger=Recording(tmp_path), log_every_n_steps=1, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(_AccumulatingRollouts([make_rollout(seed) for seed in range(4)]))
    steps = [metrics for metrics in logged if "memory/step_peak_delta_bytes" in metrics]
    assert len(steps) == 2
    for metrics in steps:
        assert metrics["memory/update_peak_delta_bytes"] > 64 * MiB
        assert metrics["memory/step_peak_delta_bytes"] > 64 * MiB
        assert metrics["memory/rollout_peak_delta_bytes"] < 32 * MiB


def _fit_accumulating_two(tmp_path, batches, quiet: bool = False):
    """A fit of ``batches`` under accumulate_grad_batches 2 with the three rollout callbacks logging every step;
    returns what the logger was given, ``{(key, step): value}``, and the run's TensorBoard events."""
    from lightning.pytorch.loggers import TensorBoardLogger

    logged: dict[tuple[str, int], float] = {}

    class Recording(TensorBoardLogger):
        def log_metrics(self, metrics, step=None):
            logged.update({(key, step): value for key, value in metrics.items()})
            super().log_metrics(metrics, step)

    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=2, accumulate_grad_batches=2, accelerator="cpu",
                         callbacks=[RolloutProfiler(read_bytes_per_s=1e9), CompletionLogger(table_every_n_steps=1),
                                    SlotTimelineLogger(every_n_steps=1)],
                         logger=Recording(tmp_path, name="tb"), log_every_n_steps=1, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=False)
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")  # each callback says once that a batch carries no rollout
        trainer.fit(RolloutModule(batches))
    return logged, events(trainer)


def _assert_step_timeline_and_table(accumulator, step: int, merged, first) -> None:
    """The step's slot timeline is ``merged``'s figure and its sample table ``first``'s (the step's first rollout)."""
    import io

    import numpy as np
    from PIL import Image

    from lit_grpo.callbacks.completion_logger import sample_table
    from lit_grpo.callbacks.slot_timeline import render_slot_timeline_figure

    image = accumulator.Images("rollout/slot_timeline")[step]
    decoded = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB"))
    expected = render_slot_timeline_figure(merged.timeline, merged.group_size, decisions=merged.decisions)
    assert image.step == step and np.array_equal(decoded, expected)
    text = accumulator.Tensors("completions/samples/text_summary")[step]
    assert text.step == step and text.tensor_proto.string_val[0].decode() == sample_table(first, 2, 4, 400)


def test_under_gradient_accumulation_a_step_logs_its_micro_batches_rollouts_merged(tmp_path):
    """Rollout batches under accumulate_grad_batches 2 (a module of its own; GRPOModule refuses accumulation): a
    step's figures are its two micro-batches' rollouts together (merge_stats), not each micro-batch's: the profile
    of the merged stats, the lengths of both batches' samples, the slot timeline of both rollouts one after the
    other, and the table of the step's first micro-batch."""
    from lit_grpo.callbacks.rollout_profiler import profile
    from lit_grpo.sampling.stats import merge_stats

    rollouts = [make_rollout(seed) for seed in range(4)]
    rollouts[1].stats.decisions = [Decision(1, 0, (0, 0), "park", "preemption")]
    logged, accumulator = _fit_accumulating_two(tmp_path, rollouts)
    for step, pair in enumerate((rollouts[:2], rollouts[2:])):
        merged = merge_stats([rollout.stats for rollout in pair])
        assert merged.decode_steps == sum(rollout.stats.decode_steps for rollout in pair)  # both, one after the other
        for key in ("rollout/decode_steps", "rollout/generated_tokens", "rollout/slot_utilization",
                    "rollout/wall_s", "rollout/tokens_per_s"):
            assert logged[key, step] == pytest.approx(profile(merged, 1e9)[key])
        lengths = torch.cat([rollout.completion_lengths.flatten() for rollout in pair]).float()
        assert logged["completions/mean_length", step] == pytest.approx(lengths.mean().item())
        assert logged["completions/max_length", step] == lengths.max().item()
        histogram = accumulator.Histograms("completions/length")[step]
        assert (histogram.step, histogram.histogram_value.num) == (step, lengths.numel())
        _assert_step_timeline_and_table(accumulator, step, merged, pair[0])


def test_under_gradient_accumulation_a_step_ends_at_its_optimizer_step_even_without_a_rollout_last(tmp_path):
    """A step whose last micro-batch carries no rollout still ends there: its figures are its own rollouts' (the
    first micro-batch's), and the next step's are the next step's alone, none of the earlier step carried over."""
    import dataclasses

    from lit_grpo.sampling.stats import merge_stats

    rollouts = [make_rollout(seed) for seed in range(4)]
    batches = [rollouts[0], dataclasses.replace(rollouts[1], stats=None), rollouts[2], rollouts[3]]
    logged, accumulator = _fit_accumulating_two(tmp_path, batches, quiet=True)
    for step, own in enumerate(([rollouts[0]], rollouts[2:])):
        merged = merge_stats([rollout.stats for rollout in own])
        assert logged["rollout/decode_steps", step] == merged.decode_steps
        lengths = torch.cat([rollout.completion_lengths.flatten() for rollout in own]).float()
        assert logged["completions/mean_length", step] == pytest.approx(lengths.mean().item())
        _assert_step_timeline_and_table(accumulator, step, merged, own[0])


def test_under_gradient_accumulation_the_predictors_figures_are_the_steps_micro_batches_mean(tmp_path):
    """The length predictor's figures of a step of 2 micro-batches are the mean over those that predicted, as over
    ranks: neither the first micro-batch's alone, nor a micro-batch without a predictor counted as 0."""
    from lightning.pytorch.loggers import TensorBoardLogger

    rollouts = [make_rollout(0), make_rollout(1), make_rollout(2, with_predictor=False), make_rollout(3)]
    rollouts[1].stats.length_pred_kendall_tau, rollouts[1].stats.length_pred_smape = 0.9, 0.05
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=2, accumulate_grad_batches=2, accelerator="cpu",
                         callbacks=[RolloutProfiler(progress_bar=False, read_bytes_per_s=1e9)],
                         logger=TensorBoardLogger(tmp_path, name="tb"), log_every_n_steps=1,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(RolloutModule(rollouts))
    accumulator = events(trainer)
    assert scalars(accumulator, "rollout/length_pred_kendall_tau") == pytest.approx([0.7, 0.5])
    assert scalars(accumulator, "rollout/length_pred_smape") == pytest.approx([0.15, 0.25])
