"""The callbacks on a plain regression module and on hand-built lit_grpo rollout batches, read back from TensorBoard."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from callback_helpers import MiB, RolloutModule, TinyRegression, events, fit, make_rollout, scalars, touch_memory

from lit_grpo.runtime import memory
from lit_grpo.callbacks import (
    CompletionLogger,
    PeakMemoryMonitor,
    RewardForecast,
    RolloutProfiler,
    SlotTimelineLogger,
)
from lit_grpo.callbacks.completion_logger import markdown_cell


# ----------------------------------------------------------------------------------------------------------------
# Any LightningModule
# ----------------------------------------------------------------------------------------------------------------


def test_every_callback_runs_on_a_plain_module(tmp_path):
    monitor = PeakMemoryMonitor()
    callbacks = [monitor, RolloutProfiler(), SlotTimelineLogger(every_n_rollouts=1), CompletionLogger(),
                 RewardForecast(monitor="train/loss", min_points=5, check_every_n_steps=4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, TinyRegression(), callbacks, max_steps=12)
    accumulator = events(trainer)
    tags = set(accumulator.Tags()["scalars"])

    assert monitor.method in ("hwm", "sampling")
    peaks = scalars(accumulator, "memory/step_peak_bytes")
    assert len(peaks) == 12 and all(p > 10 * MiB for p in peaks)  # a Python process with torch holds far more
    assert not any(tag.startswith(("rollout/", "completions/")) for tag in tags)
    assert not {"memory/rollout_peak_bytes", "memory/update_peak_bytes"} & tags
    assert {"forecast/plateau_reward", "forecast/step_to_plateau", "forecast/remaining_gain"} <= tags
    assert accumulator.Tags()["images"] == []
    # Each rollout-only callback says once that there is nothing for it, instead of failing or logging zeros.
    for name in ("RolloutProfiler", "SlotTimelineLogger", "CompletionLogger"):
        assert sum(str(w.message).startswith(name) for w in caught) == 1, name


# ----------------------------------------------------------------------------------------------------------------
# PeakMemoryMonitor
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cpu_method", ["auto", "sampling"])
def test_peak_memory_separates_rollout_and_update(tmp_path, cpu_method):
    rollouts = [make_rollout(seed) for seed in range(3)]
    module = RolloutModule(rollouts, update_bytes=48 * MiB, hold_s=0.03)
    module.rollout_bytes = 112 * MiB
    monitor = PeakMemoryMonitor(cpu_method=cpu_method, sample_interval_s=0.002)
    trainer = fit(tmp_path, module, [monitor], max_steps=3)
    accumulator = events(trainer)

    assert monitor.method == ("hwm" if cpu_method == "auto" else "sampling")
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


class _SteppingWithMemory(torch.optim.SGD):
    """SGD whose step touches ``step_bytes`` (stands in for optimizer state allocated in the step)."""

    step_bytes = 0

    def step(self, closure=None):
        loss = super().step(closure)
        touch_memory(self.step_bytes, 0.03)
        return loss


def test_peak_memory_splits_the_optimizer_step_off_the_update(tmp_path):
    rollouts = [make_rollout(seed) for seed in range(2)]
    module = RolloutModule(rollouts, update_bytes=96 * MiB, hold_s=0.03)
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


def test_peak_memory_falls_back_to_sampling_with_a_warning(monkeypatch):
    monkeypatch.setattr(memory, "hwm_reset_problem", lambda: "clear_refs is read-only here (test)")
    tracker, message = memory.make_peak_tracker(torch.device("cpu"), "auto", 0.002)
    try:
        assert tracker.name == "sampling"
        assert "clear_refs is read-only here (test)" in message and "sampling RSS every 2 ms" in message
        tracker.reset()
        touch_memory(64 * MiB, 0.05)
        assert tracker.read()["peak_bytes"] - memory.read_statm_rss() > 48 * MiB
    finally:
        tracker.close()
    tracker, message = memory.make_peak_tracker(torch.device("cpu"), "hwm", 0.002)
    assert tracker is None and "not logged" in message


# ----------------------------------------------------------------------------------------------------------------
# RolloutProfiler
# ----------------------------------------------------------------------------------------------------------------


def test_rollout_profiler_logs_every_rollout_and_the_progress_bar(tmp_path):
    rollouts = [make_rollout(0), make_rollout(1, with_predictor=False), make_rollout(2)]
    trainer = fit(tmp_path, RolloutModule(rollouts), [RolloutProfiler()], max_steps=3)
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


def test_markdown_cell_escapes_and_cuts():
    assert markdown_cell("a|b\nc", 100) == "a\\|b<br>c"
    assert markdown_cell("<script>", 100) == "\\<script\\>"
    assert markdown_cell("abcdef", 3) == "abc…"
