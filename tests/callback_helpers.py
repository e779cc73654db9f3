"""What the callback tests share: a plain regression module, hand-built lit_grpo rollouts and a module trained on
them, a short fit, and reading its TensorBoard events back."""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lit_grpo.sampling.stats import IDLE, RolloutStats

MiB = 1 << 20
#: How long a test's memory stays held where a sampling thread must see it: longer than a thread on a loaded
#: machine goes unscheduled.
HOLD_S = 0.15


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
                         wall_s=0.5, capture_s=0.05 * seed, prefill_s=0.01 * (seed + 1), decode_s=0.3,
                         decode_read_bytes=2_000_000 * len(timeline),
                         num_slots=num_slots, group_size=group_size, timeline=timeline,
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
        # a mapping of its own, not malloc's: a free chunk left in the heap by earlier tests would serve a malloc
        # and stay resident after the free
        with mmap.mmap(-1, num_bytes) as block:
            for offset in range(0, num_bytes, mmap.PAGESIZE):
                block[offset] = 1
            time.sleep(hold_s)


def touch_memory_until_sampled(num_bytes: int, sampler, timeout_s: float = 10.0) -> None:
    """Make RSS rise by ``num_bytes`` until the ``SampledRss`` thread ``sampler`` has read at least three quarters of
    it (its own reading, not ``read()``'s, which takes the value right now too), at most ``timeout_s``, then give the
    memory back: a fixed hold can end before a thread on a loaded machine is scheduled."""
    base = sampler.current()
    with mmap.mmap(-1, num_bytes) as block:
        for offset in range(0, num_bytes, mmap.PAGESIZE):
            block[offset] = 1
        deadline = time.monotonic() + timeout_s
        while sampler._peak - base < num_bytes * 3 // 4 and time.monotonic() < deadline:
            time.sleep(0.002)


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
