"""What the rollout loaders yield: ``RolloutRequest`` tokens, turned into rollouts right before each step.

The requests carry no data: ``RolloutDataModule`` builds the ``RolloutBatch`` in ``on_before_batch_transfer`` (see
its docstring for why), and the stream position lives in its ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, IterableDataset


@dataclass(frozen=True)
class RolloutRequest:
    """What the loaders yield: ``split`` ("train" or "val"), the request's ``step`` in its epoch and, for "val",
    the held-out prompt positions of the batch; turned into a ``RolloutBatch`` at transfer time."""

    split: str
    step: int
    indices: tuple[int, ...] | None = None


class RequestStream(IterableDataset):
    """Yields ``num_steps`` train requests, or one val request per chunk of positions."""

    def __init__(self, split: str, num_steps: int, chunks: Sequence[Sequence[int]] | None = None):
        self.split, self.num_steps, self.chunks = split, num_steps, chunks

    def __iter__(self) -> Iterator[RolloutRequest]:
        if self.chunks is not None:
            yield from (RolloutRequest(self.split, step, tuple(chunk)) for step, chunk in enumerate(self.chunks))
        else:
            yield from (RolloutRequest(self.split, step) for step in range(self.num_steps))

    def __len__(self) -> int:
        return len(self.chunks) if self.chunks is not None else self.num_steps


class ResumableRequestLoader(DataLoader):
    """Requests carry no data (the stream position is ``RolloutDataModule.state_dict``), so Lightning may treat
    the loader as resumable: a mid-epoch resume is exact without the "not resumable" warning."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        return None
