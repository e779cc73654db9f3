"""A picture of which sample occupied which slot at each decode step: why a rollout took the steps it took."""

from __future__ import annotations

import colorsys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from PIL import Image

from lit_grpo.sampling.stats import IDLE

from ._rollout import logger_step, rollout_stats, tensorboard_experiments

#: Idle slot: a neutral grey no group colour comes close to (group colours are all saturated).
IDLE_RGB = (214, 214, 214)
#: Thin line where a sample finishes and its slot changes hands.
MARKER_RGB = (20, 20, 20)
#: The one-pixel gap between slot rows.
BACKGROUND_RGB = (255, 255, 255)

_GOLDEN = 0.618033988749895


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
) -> np.ndarray:
    """Render a rollout's slot timeline as an RGB image.

    Args:
        timeline: ``timeline[t][s]``, the flat sample index ``p * group_size + k`` slot ``s`` ran at decode step
            ``t``, or ``IDLE`` (-1); shape [T, S] (``RolloutStats.timeline``).
        group_size: G, which maps a sample index to its prompt group ``p = index // G`` (its colour).
        cell_width: pixels per decode step.
        row_height: pixels per slot, a one-pixel separating gap included when it is 4 or more.
        max_width / max_height: larger pictures are shrunk: ``max_width`` evenly spaced steps of one pixel
            each (every finish marker kept), rows made thinner.
        markers: draw a dark line where a sample finishes (its slot goes idle or to the next sample).

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
    return image.reshape(num_slots * row_height, width, 3)


def save_slot_timeline(
    timeline: Sequence[Sequence[int]] | np.ndarray, group_size: int, path: str | Path, **render_kwargs: Any
) -> Path:
    """Render a slot timeline (see :func:`render_slot_timeline`) and write it as a PNG; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(render_slot_timeline(timeline, group_size, **render_kwargs)).save(path, format="PNG")
    return path


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


class SlotTimelineLogger(Callback):
    r"""Logs an image of the rollout's slot timeline to TensorBoard every ``every_n_rollouts`` rollouts.

    **Logged keys** (TensorBoard images, at the step of the batch's scalars)

    - ``rollout/slot_timeline``: rows = slots, columns = decode steps; colour = prompt group ``p = index // G``
      (two shades alternating with the sample k inside the group), grey = idle slot, a dark line = a sample
      finished and its slot changed hands. Long idle tails or a single slot running long after the others are
      what make a round slow. See :func:`render_slot_timeline`.

    The first rollout is logged, then every ``every_n_rollouts``-th. Needs a
    :class:`~lightning.pytorch.loggers.TensorBoardLogger` (warns once otherwise) and lit_grpo batches (warns once
    and logs nothing with any other LightningModule).

    Args:
        every_n_rollouts: log one rollout in this many.
        cell_width, row_height, max_width, max_height: passed to :func:`render_slot_timeline`.
    """

    def __init__(
        self,
        every_n_rollouts: int = 10,
        cell_width: int = 1,
        row_height: int = 12,
        max_width: int = 4096,
        max_height: int = 2048,
    ) -> None:
        if every_n_rollouts < 1:
            raise ValueError(f"every_n_rollouts must be >= 1, got {every_n_rollouts}")
        self.every_n_rollouts = every_n_rollouts
        self.render_kwargs = dict(cell_width=cell_width, row_height=row_height, max_width=max_width,
                                  max_height=max_height)
        self._rollouts_seen = 0
        self._warned: set[str] = set()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = rollout_stats(batch)
        if stats is None:
            self._warn_once("no_rollout", "the training batches carry no RolloutStats (batch.stats); no timeline.")
            return
        index = self._rollouts_seen
        self._rollouts_seen += 1
        if index % self.every_n_rollouts or not trainer.is_global_zero:
            return
        if not stats.timeline:
            self._warn_once("empty", "a rollout came with an empty timeline (no decode steps); it is skipped.")
            return
        experiments = tensorboard_experiments(trainer)
        if not experiments:
            self._warn_once("no_tensorboard", "the trainer has no TensorBoardLogger; timeline images are not logged.")
            return
        image = render_slot_timeline(stats.timeline, max(stats.group_size, 1), **self.render_kwargs)
        for experiment in experiments:
            experiment.add_image("rollout/slot_timeline", image, logger_step(trainer), dataformats="HWC")

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            rank_zero_warn(f"SlotTimelineLogger: {message}")
