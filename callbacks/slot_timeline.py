"""A picture of which sample occupied which slot at each decode step: why a rollout took the steps it took."""

from __future__ import annotations

import colorsys
import math
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from PIL import Image, ImageDraw, ImageFont

from lit_grpo.runtime.validation import check_int
from lit_grpo.sampling.stats import RolloutStats, merge_stats
from lit_grpo.scheduling.base import DECISION_NAMES, Decision, decision_counts
from lit_grpo.scheduling.driver import IDLE

from ._rollout import CARRYING_ROLLOUTS, logger_step, rollout_stats, step_parts, tensorboard_experiments

#: Idle slot: a neutral grey no group colour comes close to (group colours are all saturated).
IDLE_RGB = (214, 214, 214)
#: Thin line where a sample finishes and its slot changes hands.
MARKER_RGB = (20, 20, 20)
#: A park: a short tick in the upper half of the slot's row, at the first step its sample no longer runs there
#: (fully saturated, darker than any group's colour).
PARK_RGB = (204, 0, 0)
#: A resumption: a short tick in the lower half of the row, at the first step the parked sample runs again.
RESUME_RGB = (0, 51, 204)
#: The one-pixel gap between slot rows.
BACKGROUND_RGB = (255, 255, 255)

_GOLDEN = 0.618033988749895
#: Axis labels and legend text.
TEXT_RGB = (40, 40, 40)
#: Prompt groups named in the figure's legend; more are summarised as "...".
LEGEND_GROUPS = 12


def group_colors(num_groups: int) -> np.ndarray:
    """[num_groups, 2, 3] uint8: two shades (even / odd sample k) of one distinct hue per prompt group.

    Hues step by the golden ratio so neighbouring groups, the ones that share slots, never look alike; the
    two shades let consecutive samples of one group be told apart even without the markers.
    """
    colors = np.empty((num_groups, 2, 3), dtype=np.uint8)
    for p in range(num_groups):
        hue = (p * _GOLDEN) % 1.0
        for shade, value in enumerate((0.93, 0.74)):
            colors[p, shade] = [round(255 * c) for c in colorsys.hsv_to_rgb(hue, 0.62, value)]
    return colors


def render_slot_timeline(
    timeline: Sequence[Sequence[int]] | np.ndarray,
    group_size: int,
    *,
    cell_width: int = 1,
    row_height: int = 12,
    max_width: int = 4096,
    max_height: int = 2048,
    markers: bool = True,
    decisions: Sequence[Decision] = (),
) -> np.ndarray:
    """Render a rollout's slot timeline as an RGB image.

    Args:
        timeline: ``timeline[t][s]``, the flat sample index ``p * group_size + k`` slot ``s`` ran at decode step
            ``t``, or ``IDLE`` (-1); shape [T, S] (``RolloutStats.timeline``).
        group_size: G, which maps a sample index to its prompt group ``p = index // G`` (its colour).
        cell_width: pixels per decode step.
        row_height: pixels per slot, a one-pixel separating gap included when it is 4 or more.
        max_width: a wider picture is shrunk to ``max_width`` evenly spaced steps of one pixel each (every
            finish marker kept).
        max_height: a taller picture gets thinner rows.
        markers: draw a dark line where a sample finishes (its slot goes idle or to the next sample).
        decisions: the scheduler's decisions (``RolloutStats.decisions``): a park is drawn as a ``PARK_RGB`` tick
            in the upper half of its slot's row, a resumption as a ``RESUME_RGB`` tick in the lower half, at the
            decision's step (kept when the picture is shrunk, as the finish markers are); starts are not drawn.

    Returns:
        [H, W, 3] uint8 with H = S * row_height and W = T * cell_width (before shrinking): row band ``s`` is slot
        ``s``, column ``t`` is decode step ``t``; colour = prompt group (two shades alternating with sample k),
        grey = idle.
    """
    grid = np.asarray(timeline, dtype=np.int64)
    if grid.ndim != 2 or grid.size == 0:
        raise ValueError(f"timeline must be a non-empty [steps, slots] grid, got shape {grid.shape}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    num_steps, num_slots = grid.shape

    if num_steps * cell_width > max_width:
        columns, cell_width = _sampled_steps(num_steps, max_width), 1
    else:
        columns = np.arange(num_steps)
    row_height = max(1, min(row_height, max_height // num_slots))
    gap = 1 if row_height >= 4 else 0

    cells = _cell_colors(grid[columns], group_size)  # [columns, slots, 3]
    width = len(columns) * cell_width
    image = np.empty((num_slots, row_height, width, 3), dtype=np.uint8)  # one band of rows per slot
    image[:] = BACKGROUND_RGB
    image[:, : row_height - gap] = np.repeat(cells.transpose(1, 0, 2), cell_width, axis=1)[:, None]
    if markers:
        column, slot = _finish_markers(grid, columns)
        image[slot, : row_height - gap, column * cell_width] = MARKER_RGB
    half = max(1, (row_height - gap) // 2)
    for action, rows, color in (("park", slice(0, half), PARK_RGB),
                                ("resume", slice(row_height - gap - half, row_height - gap), RESUME_RGB)):
        column, slot = _decision_marks(decisions, action, columns, num_slots)
        for offset in range(max(2, min(cell_width, 4))):  # 2 to 4 pixels wide, to be seen
            image[slot, rows, np.minimum(column * cell_width + offset, width - 1)] = color
    return image.reshape(num_slots * row_height, width, 3)


def save_slot_timeline(
    timeline: Sequence[Sequence[int]] | np.ndarray, group_size: int, path: str | Path, **render_kwargs: Any
) -> Path:
    """Render a slot timeline (see :func:`render_slot_timeline`) and write it as a PNG; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(render_slot_timeline(timeline, group_size, **render_kwargs)).save(path, format="PNG")
    return path


def render_slot_timeline_figure(
    timeline: Sequence[Sequence[int]] | np.ndarray,
    group_size: int,
    *,
    width: int = 1000,
    row_height: int | None = None,
    title: str | None = None,
    decisions: Sequence[Decision] | None = None,
) -> np.ndarray:
    """The slot timeline as a figure to read: the grid of :func:`render_slot_timeline` stretched to ``width``
    pixels, slots labelled on the left, decode steps on an axis below, and a legend of the prompt groups' colours,
    idle slots and sample ends; with ``decisions``, the parks and resumptions marked in the grid and a line under
    the legend that counts the decisions by reason ("why did this sample get this slot?").

    Args:
        timeline: as in :func:`render_slot_timeline`.
        group_size: as in :func:`render_slot_timeline`.
        width: of the whole figure, at least 800 pixels (the grid gets what the margins leave).
        row_height: pixels per slot (default: 24 for a few slots, down to 6 for many).
        title: the line above the grid (default: slots, steps, groups and samples).
        decisions: the scheduler's decisions (``RolloutStats.decisions``; None: none drawn or counted).

    Returns:
        [H, width, 3] uint8.
    """
    if width < 800:
        raise ValueError(f"width={width} is too narrow to label; use at least 800 pixels")
    grid = np.asarray(timeline, dtype=np.int64)
    if grid.ndim != 2 or grid.size == 0:
        raise ValueError(f"timeline must be a non-empty [steps, slots] grid, got shape {grid.shape}")
    num_steps, num_slots = grid.shape
    busy = grid[grid != IDLE]
    num_groups = int(busy.max()) // group_size + 1 if busy.size else 0
    row_height = row_height or max(6, min(24, 480 // num_slots))
    font = ImageFont.load_default(size=14)
    left, right, top = 64, 16, 34
    plot_width = width - left - right
    cell_width = max(1, plot_width // num_steps)
    decisions = decisions or ()
    grid_image = render_slot_timeline(grid, group_size, cell_width=cell_width, row_height=row_height,
                                      max_width=plot_width, max_height=num_slots * row_height, decisions=decisions)
    plot = Image.fromarray(grid_image).resize((plot_width, num_slots * row_height), Image.NEAREST)
    legend_rows = _legend_entries(num_groups, group_size, {d.action for d in decisions})
    count_lines = _wrap(_decision_summary(decisions), font, plot_width) if decisions else []
    height = top + plot.height + 48 + 22 * math.ceil(len(legend_rows) / 4) + 22 * len(count_lines)
    figure = Image.new("RGB", (width, height), BACKGROUND_RGB)
    figure.paste(plot, (left, top))
    draw = ImageDraw.Draw(figure)
    draw.text((left, 8), title or (f"slot timeline: {num_slots} slots, {num_steps} decode steps, "
                                   f"{num_groups} prompt groups x G = {group_size}"), fill=TEXT_RGB, font=font)
    label_every = max(1, math.ceil(16 / row_height))  # slot labels at least 16 pixels apart
    for slot in range(0, num_slots, label_every):
        y = top + slot * row_height + row_height // 2
        draw.text((left - 6, y), f"slot {slot}", fill=TEXT_RGB, font=font, anchor="rm")
    axis_y = top + plot.height + 2
    draw.line([(left, axis_y), (left + plot_width - 1, axis_y)], fill=TEXT_RGB)
    for step in _ticks(num_steps):
        x = left + round(step * plot_width / num_steps)
        draw.line([(x, axis_y), (x, axis_y + 4)], fill=TEXT_RGB)
        draw.text((x, axis_y + 6), str(step), fill=TEXT_RGB, font=font, anchor="mt")
    draw.text((left + plot_width, axis_y + 22), "decode step", fill=TEXT_RGB, font=font, anchor="rt")
    legend_y = axis_y + 44
    for index, (label, color) in enumerate(legend_rows):
        x, y = left + (index % 4) * (plot_width // 4), legend_y + 22 * (index // 4)
        draw.rectangle([x, y + 2, x + 14, y + 14], fill=color, outline=TEXT_RGB if color == MARKER_RGB else None)
        draw.text((x + 20, y), label, fill=TEXT_RGB, font=font)
    counts_y = legend_y + 22 * math.ceil(len(legend_rows) / 4)
    for index, line in enumerate(count_lines):
        draw.text((left, counts_y + 22 * index), line, fill=TEXT_RGB, font=font)
    return np.asarray(figure)


def _legend_entries(num_groups: int, group_size: int,
                    actions: Collection[str] = ()) -> list[tuple[str, tuple[int, ...]]]:
    """(label, colour) of the legend: the first groups, then idle, the sample-end marker, and the park and resume
    ticks when ``actions`` has them."""
    palette = group_colors(max(num_groups, 1))
    shown = min(num_groups, LEGEND_GROUPS)
    entries = [(f"prompt {p} (samples {p * group_size}-{(p + 1) * group_size - 1})", tuple(palette[p, 0]))
               for p in range(shown)]
    if num_groups > shown:
        entries.append((f"... {num_groups - shown} more groups", tuple(palette[shown, 0])))
    entries += [("idle slot", IDLE_RGB), ("slot changes hands", MARKER_RGB)]
    if "park" in actions:
        entries.append(("parked (tick above)", PARK_RGB))
    if "resume" in actions:
        entries.append(("resumed (tick below)", RESUME_RGB))
    return entries


def _decision_summary(decisions: Sequence[Decision]) -> list[str]:
    """``action (reason) count`` of every decision name that occurred, in ``DECISION_NAMES``' order (others
    after), each a piece of the legend's last line."""
    counts = decision_counts(decisions)
    order = [name for name in DECISION_NAMES if name in counts] + sorted(set(counts) - set(DECISION_NAMES))
    pieces = []
    for name in order:
        action, _, reason = name.partition("_")
        pieces.append(f"{action} ({reason}) {counts[name]}")
    return ["decisions:", *pieces]


def _wrap(pieces: list[str], font: ImageFont.ImageFont, width: int) -> list[str]:
    """``pieces`` joined by two spaces into lines of at most ``width`` pixels (a piece is never split)."""
    lines: list[str] = []
    for piece in pieces:
        if lines and font.getlength(lines[-1] + "  " + piece) <= width:
            lines[-1] += "  " + piece
        else:
            lines.append(piece)
    return lines


def _ticks(num_steps: int) -> list[int]:
    """Round step numbers for the axis: 1, 2 or 5 x 10^k apart, about 8 of them."""
    raw = max(1.0, num_steps / 8)
    base = 10 ** math.floor(math.log10(raw))
    spacing = next(base * m for m in (1, 2, 5, 10) if base * m >= raw)
    return list(range(0, num_steps + 1, int(spacing)))


def _sampled_steps(num_steps: int, num_columns: int) -> np.ndarray:
    """``num_columns`` evenly spaced decode steps (first and last included) that stand for all of them."""
    return np.linspace(0, num_steps - 1, max(num_columns, 1)).round().astype(np.int64)


def _cell_colors(grid: np.ndarray, group_size: int) -> np.ndarray:
    """[T, S] sample indices -> [T, S, 3] colours: the group's hue, the sample's shade, grey when idle."""
    busy = grid != IDLE
    samples = np.where(busy, grid, 0)
    palette = group_colors(int(samples.max()) // group_size + 1)
    cells = palette[samples // group_size, (samples % group_size) % 2]
    cells[~busy] = IDLE_RGB
    return cells


def _finish_markers(grid: np.ndarray, columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(column, slot) of the cell right after each sample's last step in its slot: where the slot changed hands.

    Ends are found on the full grid, then mapped to the sampled columns, so shrinking a long rollout never
    hides a finish.
    """
    previous, current = grid[:-1], grid[1:]
    step, slot = np.nonzero((previous != IDLE) & (current != previous))
    column = np.searchsorted(columns, step + 1)
    inside = column < len(columns)
    return column[inside], slot[inside]


def _decision_marks(decisions: Sequence[Decision], action: str, columns: np.ndarray,
                    num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(column, slot) of each ``action`` decision: the first sampled column at or after its step (so shrinking a
    long rollout never hides one); decisions outside the grid are left out."""
    marks = np.array([(d.step, d.slot) for d in decisions if d.action == action], dtype=np.int64).reshape(-1, 2)
    step, slot = marks[:, 0], marks[:, 1]
    inside = (step >= 0) & (step <= columns[-1]) & (slot >= 0) & (slot < num_slots)
    return np.searchsorted(columns, step[inside]), slot[inside]


class SlotTimelineLogger(Callback):
    r"""Logs an image of a training step's rollout slot timeline to TensorBoard every ``every_n_steps`` steps.

    **Logged keys** (TensorBoard images, at the step of the batch's scalars)

    - ``rollout/slot_timeline``: a figure ``width`` pixels wide (:func:`render_slot_timeline_figure`): rows = slots
      (labelled), columns = decode steps (an axis below); colour = prompt group ``p = index // G`` (two shades
      alternating with the sample k inside the group, named in a legend), grey = idle slot, a dark line = a
      sample finished and its slot changed hands; a red tick above = the scheduler parked the slot's sample there
      (e.g. a preemption), a blue tick below = a parked sample resumed there, and a line under the legend counts
      every start, park and resumption by reason (``rollout/decisions/*``). Long idle tails or a single slot
      running long after the others are what make a rollout slow.

    The first step's rollout is logged, then every ``every_n_steps``-th (the training loop's step, so a resumed
    run logs the ones an uninterrupted run would); under several processes, rank 0's; under gradient accumulation
    one image per optimizer step, after its last micro-batch, its micro-batches' rollouts one after another
    (``lit_grpo.sampling.stats.merge_stats``: steps and samples numbered on from the earlier ones). Needs a
    :class:`~lightning.pytorch.loggers.TensorBoardLogger` (warns once otherwise) and lit_grpo batches, whose
    ``stats`` is a RolloutStats with its timeline (``RolloutEngine.generate``'s ``result.stats``; warns once and logs
    nothing with any other LightningModule).

    Args:
        every_n_steps: log the rollout of one training step in this many.
        width: of the figure in pixels (>= 800).
        row_height: pixels per slot (None: chosen from the number of slots).
    """

    def __init__(self, every_n_steps: int = 10, width: int = 1000, row_height: int | None = None) -> None:
        every_n_steps = check_int("every_n_steps", every_n_steps, 1)
        width = check_int("width", width, 800)  # pixels: a readable figure
        if row_height is not None:
            row_height = check_int("row_height", row_height, 2)  # pixels (None: from the slots and the width)
        self.every_n_steps = every_n_steps
        self.render_kwargs = dict(width=width, row_height=row_height)
        self._warned: set[str] = set()
        self._step_stats: list[RolloutStats] = []  # the rollouts of the step's micro-batches so far

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_stats = []  # a fit that ended mid-step leaves none to the next

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = rollout_stats(batch)
        if stats is None:
            self._warn_once("no_rollout", "a training batch carries no RolloutStats (batch.stats): the batches "
                                          f"without one have no timeline ({CARRYING_ROLLOUTS}).")
        # counted by the loop's own step, which a resumed run restores: the same rollouts as an uninterrupted run
        if logger_step(trainer) % self.every_n_steps or not trainer.is_global_zero:
            return
        parts = step_parts(self._step_stats, stats, trainer, batch_idx)
        if not parts:  # the step goes on to the micro-batch whose optimizer step ends it, or had no rollout
            return
        stats = merge_stats(parts)
        if not stats.timeline:
            self._warn_once("empty", "a rollout came with an empty timeline (no decode steps); it is skipped.")
            return
        experiments = tensorboard_experiments(trainer)
        if not experiments:
            self._warn_once("no_tensorboard", "the trainer has no TensorBoardLogger; timeline images are not logged.")
            return
        image = render_slot_timeline_figure(stats.timeline, max(stats.group_size, 1), decisions=stats.decisions,
                                            **self.render_kwargs)
        for experiment in experiments:
            experiment.add_image("rollout/slot_timeline", image, logger_step(trainer), dataformats="HWC")

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            rank_zero_warn(f"SlotTimelineLogger: {message}")
