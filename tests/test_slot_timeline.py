"""The slot-timeline picture: the raw grid renderer, the labelled figure, and the callback that logs it."""

from __future__ import annotations

import io

import numpy as np
import pytest
from callback_helpers import FakeRollout, RolloutModule, continuous_timeline, events, fit, make_rollout
from lightning.pytorch.loggers import CSVLogger
from PIL import Image

from lit_grpo.callbacks import SlotTimelineLogger, render_slot_timeline, render_slot_timeline_figure, save_slot_timeline
from lit_grpo.callbacks.slot_timeline import IDLE_RGB, MARKER_RGB, PARK_RGB, RESUME_RGB, TEXT_RGB, group_colors
from lit_grpo.sampling.stats import IDLE
from lit_grpo.scheduling.base import Decision


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


class MovableRollout(FakeRollout):
    """A rollout that moves itself to a device, as RolloutBatch does (``to``): Lightning then leaves it whole
    instead of rebuilding its dataclasses field by field, which the frozen Decisions in its stats do not allow."""

    def to(self, device, **kwargs):
        return self


def test_slot_timeline_logger_writes_readable_figures(tmp_path):
    rollouts = [MovableRollout(**vars(make_rollout(seed))) for seed in range(5)]
    rollouts[2].stats.decisions = [Decision(0, 0, (0, 0), "start", "arrival"), Decision(2, 1, (0, 1), "park",
                                                                                         "preemption")]
    logger = SlotTimelineLogger(every_n_steps=2, width=900)
    trainer = fit(tmp_path, RolloutModule(rollouts), [logger], max_steps=5)
    images = events(trainer).Images("rollout/slot_timeline")

    assert [image.step for image in images] == [0, 2, 4]
    for image, rollout in zip(images, rollouts[::2]):
        decoded = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB"))
        assert decoded.shape[1] == image.width == 900
        expected = render_slot_timeline_figure(rollout.stats.timeline, rollout.stats.group_size, width=900,
                                               decisions=rollout.stats.decisions)
        assert np.array_equal(decoded, expected)
    with pytest.raises(ValueError, match="width=400 must be an integer >= 800"):
        SlotTimelineLogger(width=400)


def test_a_resumed_run_logs_the_timelines_an_uninterrupted_one_would(tmp_path):
    """Counted by the training loop's step (restored on resume), not by a counter of the callback's own: a fresh
    callback that first sees step 3 logs steps 4 and 6 of every 2, as the uninterrupted run did."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import TensorBoardLogger

    loop = SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=0))
    trainer = SimpleNamespace(is_global_zero=True, fit_loop=loop, loggers=[TensorBoardLogger(tmp_path, name="tb")],
                              accumulate_grad_batches=1)
    logger = SlotTimelineLogger(every_n_steps=2)
    for step in (3, 4, 5, 6):
        loop.epoch_loop._batches_that_stepped = step
        logger.on_train_batch_end(trainer, None, None, make_rollout(step), 0)
    trainer.loggers[0].experiment.flush()
    accumulator = events(SimpleNamespace(logger=trainer.loggers[0]))
    assert [image.step for image in accumulator.Images("rollout/slot_timeline")] == [4, 6]


def test_the_figure_labels_slots_and_steps_and_has_a_legend():
    """At least 800 pixels wide whatever the rollout's length; every group's colour, idle and the end marker
    appear both in the grid and in the legend below it."""
    timeline = continuous_timeline([30, 50, 25, 4, 80, 12, 44, 60, 70, 10, 20, 33], num_slots=4)  # 3 groups of 4
    figure = render_slot_timeline_figure(timeline, group_size=4)
    grid_only = render_slot_timeline(timeline, group_size=4)
    assert figure.shape[1] == 1000 and figure.shape[1] >= 800 > grid_only.shape[1]
    assert figure.shape[0] > grid_only.shape[0]  # title, axis and legend around the grid
    colors = {tuple(c) for c in figure.reshape(-1, 3)}
    palette = group_colors(3)
    assert len({tuple(palette[group, shade]) for group in range(3) for shade in range(2)}) == 6  # all distinct
    for group in range(3):
        assert tuple(palette[group, 0]) in colors and tuple(palette[group, 1]) in colors
    assert IDLE_RGB in colors and MARKER_RGB in colors
    text = (figure == 40).all(axis=-1)  # TEXT_RGB: labels, ticks and legend text
    plot_left = 64
    assert text[:, :plot_left].any()  # slot labels left of the grid
    assert text[-60:].any()  # axis numbers and legend under it
    short = render_slot_timeline_figure([[0, IDLE]], group_size=2, width=800)
    assert short.shape[1] == 800
    with pytest.raises(ValueError, match="width=500 is too narrow"):
        render_slot_timeline_figure(timeline, 4, width=500)


# Slot 0 runs sample 0 (steps 0-2), which is preempted at step 3 for sample 2; sample 0 resumes in slot 1 at step 5.
PREEMPTED = [[0, 1], [0, 1], [0, 1], [2, 1], [2, 1], [2, 0], [2, 0], [IDLE, 0]]
PREEMPTIONS = [Decision(0, 0, (0, 0), "start", "arrival"), Decision(0, 1, (0, 1), "start", "arrival"),
               Decision(3, 0, (0, 0), "park", "preemption"), Decision(3, 0, (1, 0), "start", "least_attained"),
               Decision(5, 1, (0, 0), "resume", "least_attained")]


def test_parks_and_resumptions_are_marked_where_they_happen():
    """A park is a tick in the upper half of its slot's row at its step, a resumption one in the lower half; starts
    and the finish markers stay as they were, and a shrunk picture keeps every tick."""
    image = render_slot_timeline(PREEMPTED, group_size=2, cell_width=6, row_height=12, decisions=PREEMPTIONS)

    def pixel(slot: int, y: int, step: int, x: int = 1) -> tuple[int, ...]:
        return tuple(image[slot * 12 + y, step * 6 + x])

    assert pixel(0, 1, 3) == PARK_RGB and pixel(0, 9, 3) != PARK_RGB  # upper half only
    assert pixel(1, 9, 5) == RESUME_RGB and pixel(1, 1, 5) != RESUME_RGB  # lower half only
    assert pixel(1, 1, 3) != PARK_RGB and pixel(0, 9, 5) != RESUME_RGB  # in its own slot only
    assert pixel(0, 9, 3, x=0) == MARKER_RGB  # the slot still changes hands there
    assert pixel(0, 4, 0) not in (PARK_RGB, RESUME_RGB)  # starts are not drawn
    plain = render_slot_timeline(PREEMPTED, group_size=2, cell_width=6, row_height=12)
    assert np.array_equal(plain, render_slot_timeline(PREEMPTED, 2, cell_width=6, row_height=12, decisions=[]))
    assert PARK_RGB not in {tuple(c) for c in plain.reshape(-1, 3)}

    long = np.repeat(np.asarray(PREEMPTED), 500, axis=0)  # 4000 steps shrunk to 800 columns
    decisions = [Decision(d.step * 500, d.slot, d.key, d.action, d.reason) for d in PREEMPTIONS]
    shrunk = render_slot_timeline(long, 2, max_width=800, decisions=decisions)
    assert shrunk.shape[1] == 800
    colors = {tuple(c) for c in shrunk.reshape(-1, 3)}
    assert PARK_RGB in colors and RESUME_RGB in colors


def test_the_figure_marks_decisions_and_counts_them_by_reason():
    figure = render_slot_timeline_figure(PREEMPTED, group_size=2, decisions=PREEMPTIONS)
    plain = render_slot_timeline_figure(PREEMPTED, group_size=2)
    assert np.array_equal(plain, render_slot_timeline_figure(PREEMPTED, group_size=2, decisions=None))
    left, top, plot_width, row_height = 64, 34, 1000 - 64 - 16, 24
    column = plot_width // len(PREEMPTED)  # pixels per step

    def pixel(fig: np.ndarray, slot: int, y: int, step: int) -> tuple[int, ...]:
        return tuple(fig[top + slot * row_height + y, left + step * column + 1])

    assert pixel(figure, 0, 3, 3) == PARK_RGB and pixel(plain, 0, 3, 3) != PARK_RGB
    assert pixel(figure, 1, row_height - 4, 5) == RESUME_RGB
    # Two more legend entries (the park and resume ticks, as swatches) and the line of counts under them.
    colors = {tuple(c) for c in figure[top + 2 * row_height + 10:].reshape(-1, 3)}
    assert PARK_RGB in colors and RESUME_RGB in colors
    assert figure.shape[0] == plain.shape[0] + 2 * 22  # a legend row for the two swatches, one line of counts
    text = (figure == TEXT_RGB).all(axis=-1)
    assert text[-22:].any()  # the counts are written

    only_starts = render_slot_timeline_figure(PREEMPTED, 2, decisions=PREEMPTIONS[:2])
    assert PARK_RGB not in {tuple(c) for c in only_starts.reshape(-1, 3)}
    assert only_starts.shape[0] == plain.shape[0] + 22  # no swatches, the counts line alone


def test_slot_timeline_logger_warns_once_without_tensorboard(tmp_path):
    with pytest.warns(UserWarning, match="no TensorBoardLogger") as caught:
        fit(tmp_path, RolloutModule([make_rollout(s) for s in range(3)]), [SlotTimelineLogger(every_n_steps=1)],
            max_steps=3, logger=CSVLogger(tmp_path))
    assert sum("SlotTimelineLogger" in str(w.message) for w in caught) == 1
