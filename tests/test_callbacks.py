"""The callbacks on a plain regression module and on hand-built lit_grpo rollout batches, read back from TensorBoard."""

from __future__ import annotations

import io
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lit_grpo.callbacks import (
    CompletionLogger,
    PeakMemoryMonitor,
    RewardForecast,
    RolloutProfiler,
    SlotTimelineLogger,
    render_slot_timeline,
    save_slot_timeline,
)
from lit_grpo import memory
from lit_grpo.callbacks.completion_logger import markdown_cell
from lit_grpo.callbacks.slot_timeline import IDLE_RGB, MARKER_RGB
from lit_grpo.sampling.stats import IDLE, RolloutStats

MiB = 1 << 20


# ----------------------------------------------------------------------------------------------------------------
# Fixtures: a plain regression, and a module trained on fake rollouts
# ----------------------------------------------------------------------------------------------------------------


class TinyRegression(pl.LightningModule):
    """Any LightningModule: tensors in, no rollout stats."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


@dataclass
class FakeRollout:
    """The lit_grpo batch contract: one whole rollout."""

    stats: RolloutStats
    prompts: list[str]
    completions: list[list[str]]
    rewards: torch.Tensor
    completion_lengths: torch.Tensor
    truncated: torch.Tensor


def continuous_timeline(lengths: list[int], num_slots: int) -> list[list[int]]:
    """timeline[t][s] of a continuous-batching schedule: a freed slot takes the next pending sample at once."""
    pending, occupant, left, timeline = list(range(len(lengths))), [IDLE] * num_slots, [0] * num_slots, []
    while pending or any(o != IDLE for o in occupant):
        for s in range(num_slots):
            if occupant[s] == IDLE and pending:
                occupant[s] = pending.pop(0)
                left[s] = lengths[occupant[s]]
        timeline.append(list(occupant))
        for s in range(num_slots):
            if occupant[s] != IDLE:
                left[s] -= 1
                if left[s] == 0:
                    occupant[s] = IDLE
    return timeline


def make_rollout(seed: int, prompts: int = 2, group_size: int = 4, num_slots: int = 3, max_new_tokens: int = 9,
                 with_predictor: bool = True) -> FakeRollout:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_new_tokens + 1, (prompts, group_size), generator=generator)
    flat = lengths.flatten().tolist()
    timeline = continuous_timeline(flat, num_slots)
    stats = RolloutStats(decode_steps=len(timeline), prefill_tokens=7 * prompts, peak_kv_bytes=1000 + seed,
                         wall_s=0.5, num_slots=num_slots, group_size=group_size, timeline=timeline,
                         length_pred_kendall_tau=0.5 if with_predictor else None,
                         length_pred_smape=0.25 if with_predictor else None)
    stats.finalize(flat)
    completions = [[f"answer {p}.{k} | *x* \n second line" for k in range(group_size)] for p in range(prompts)]
    return FakeRollout(
        stats=stats,
        prompts=[f"prompt number {p}" for p in range(prompts)],
        completions=completions,
        rewards=torch.rand(prompts, group_size, generator=generator),
        completion_lengths=lengths,
        truncated=lengths == max_new_tokens,
    )


class RolloutDataset(Dataset):
    """One rollout per item. ``rollout_bytes`` are touched while the item is built: the rollout phase's peak."""

    def __init__(self, rollouts: list[FakeRollout], rollout_bytes: int = 0, hold_s: float = 0.0) -> None:
        self.rollouts, self.rollout_bytes, self.hold_s = rollouts, rollout_bytes, hold_s

    def __len__(self) -> int:  # sized, so Lightning does not pre-fetch: fetch i happens right before step i
        return len(self.rollouts)

    def __getitem__(self, index: int) -> FakeRollout:
        touch_memory(self.rollout_bytes, self.hold_s)
        return self.rollouts[index]


def touch_memory(num_bytes: int, hold_s: float) -> None:
    """Make RSS rise by ``num_bytes`` for ``hold_s`` seconds, then give the memory back."""
    if num_bytes:
        block = torch.ones(num_bytes // 4)  # large enough for malloc to mmap it, so freeing lowers RSS
        time.sleep(hold_s)
        del block


class RolloutModule(pl.LightningModule):
    """Trains on FakeRollout batches, like GRPOModule will; ``update_bytes`` are touched inside training_step."""

    def __init__(self, rollouts: list[FakeRollout], update_bytes: int = 0, hold_s: float = 0.0) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.rollouts, self.update_bytes, self.hold_s = rollouts, update_bytes, hold_s
        self.rollout_bytes = 0

    def training_step(self, batch: FakeRollout, batch_idx: int):
        touch_memory(self.update_bytes, self.hold_s)
        reward = batch.rewards.float().mean()
        self.log("reward/mean", reward)
        return (self.weight * reward - 1.0) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        dataset = RolloutDataset(self.rollouts, self.rollout_bytes, self.hold_s)
        return DataLoader(dataset, batch_size=None, collate_fn=lambda rollout: rollout)


def fit(
    tmp_path: Path, module: pl.LightningModule, callbacks: list, max_steps: int, logger: object = None
) -> pl.Trainer:
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_steps=max_steps, max_epochs=100, callbacks=callbacks, accelerator="cpu",
        logger=logger if logger is not None else TensorBoardLogger(tmp_path, name="tb"), log_every_n_steps=1,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )
    trainer.fit(module)
    return trainer


def events(trainer: pl.Trainer) -> EventAccumulator:
    accumulator = EventAccumulator(trainer.logger.log_dir, size_guidance={"scalars": 0, "images": 0,
                                                                         "histograms": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def scalars(accumulator: EventAccumulator, tag: str) -> list[float]:
    return [event.value for event in accumulator.Scalars(tag)]


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
    assert scalars(accumulator, "rollout/peak_kv_bytes") == [1000.0, 1001.0, 1002.0]


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
    assert "rollout/peak_kv_bytes" in tags  # the engine's own figure needs no process measurement


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
                  "tokens_per_s", "wall_s", "peak_kv_bytes"):
        expected = [float(getattr(r.stats, field)) for r in rollouts]
        assert scalars(accumulator, f"rollout/{field}") == pytest.approx(expected, rel=1e-6), field
    # The predictor's figures exist only for rollouts that had a predictor: skipped, not logged as 0.
    assert [e.step for e in accumulator.Scalars("rollout/length_pred_kendall_tau")] == [0, 2]
    assert scalars(accumulator, "rollout/length_pred_smape") == [0.25, 0.25]

    last = rollouts[-1].stats
    bar = trainer.progress_bar_metrics
    assert bar["steps"] == last.decode_steps and bar["bound"] == last.lower_bound_steps
    assert bar["util"] == pytest.approx(last.slot_utilization)
    assert not {"steps", "bound", "util"} & set(accumulator.Tags()["scalars"])  # progress bar only


# ----------------------------------------------------------------------------------------------------------------
# SlotTimelineLogger and render_slot_timeline
# ----------------------------------------------------------------------------------------------------------------


def test_render_slot_timeline_layout_colours_and_markers():
    # Two slots, G = 2: slot 0 runs sample 0 then sample 1 (same group), slot 1 runs sample 2 then idles.
    timeline = [[0, 2], [0, 2], [1, IDLE], [1, IDLE]]
    image = render_slot_timeline(timeline, group_size=2, cell_width=5, row_height=10)
    assert image.shape == (2 * 10, 4 * 5, 3) and image.dtype == np.uint8

    def pixel(slot: int, step: int, x: int = 2) -> tuple[int, ...]:
        return tuple(image[slot * 10 + 4, step * 5 + x])

    assert pixel(0, 0) != pixel(1, 0)  # groups 0 and 1 differ in colour
    assert pixel(0, 0) != pixel(0, 2)  # samples 0 and 1 of one group differ in shade
    assert pixel(1, 2) == IDLE_RGB and pixel(1, 3) == IDLE_RGB
    # One-pixel markers where slot 0 changes samples and where slot 1 goes idle, nowhere else.
    assert pixel(0, 2, x=0) == MARKER_RGB and pixel(1, 2, x=0) == MARKER_RGB
    assert pixel(0, 2, x=1) != MARKER_RGB and pixel(0, 1, x=0) != MARKER_RGB
    assert tuple(image[9, 0]) == (255, 255, 255)  # the gap between slot rows


def test_render_slot_timeline_shrinks_long_rollouts_and_saves_png(tmp_path):
    timeline = continuous_timeline([300, 5000, 2500, 40, 800, 1200], num_slots=3)
    image = render_slot_timeline(timeline, group_size=3, max_width=1000, row_height=900, max_height=300)
    assert image.shape == (300, 1000, 3)
    path = save_slot_timeline(timeline, 3, tmp_path / "pictures" / "timeline.png", max_width=1000)
    assert Image.open(path).size == (1000, 3 * 12)
    with pytest.raises(ValueError):
        render_slot_timeline([], group_size=2)


def test_slot_timeline_logger_writes_decodable_images(tmp_path):
    rollouts = [make_rollout(seed) for seed in range(5)]
    logger = SlotTimelineLogger(every_n_rollouts=2, cell_width=3, row_height=8)
    trainer = fit(tmp_path, RolloutModule(rollouts), [logger], max_steps=5)
    images = events(trainer).Images("rollout/slot_timeline")

    assert [image.step for image in images] == [0, 2, 4]
    for image, rollout in zip(images, rollouts[::2]):
        decoded = Image.open(io.BytesIO(image.encoded_image_string))
        steps, slots = rollout.stats.decode_steps, rollout.stats.num_slots
        assert decoded.size == (steps * 3, slots * 8) == (image.width, image.height)
        expected = render_slot_timeline(rollout.stats.timeline, rollout.stats.group_size, cell_width=3,
                                        row_height=8)
        assert np.array_equal(np.asarray(decoded.convert("RGB")), expected)


def test_slot_timeline_logger_warns_once_without_tensorboard(tmp_path):
    with pytest.warns(UserWarning, match="no TensorBoardLogger") as caught:
        fit(tmp_path, RolloutModule([make_rollout(s) for s in range(3)]), [SlotTimelineLogger(every_n_rollouts=1)],
            max_steps=3, logger=CSVLogger(tmp_path))
    assert sum("SlotTimelineLogger" in str(w.message) for w in caught) == 1


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
