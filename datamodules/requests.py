"""What the rollout loaders yield: ``RolloutRequest`` tokens, turned into rollouts right before each step.

The requests carry no data: ``RolloutDataModule`` builds the ``RolloutBatch`` in ``on_before_batch_transfer`` (see
its docstring for why), and the stream position lives in its ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lit_grpo.runtime.validation import check_state_keys


@dataclass(frozen=True)
class RolloutRequest:
    """What the loaders yield: ``split`` ("train" or "val"), the request's ``step`` in its epoch and, for "val",
    the held-out prompt positions of the batch; turned into a ``RolloutBatch`` at transfer time."""

    split: str
    step: int
    indices: tuple[int, ...] | None = None


class RequestStream:
    """Yields ``num_steps`` train requests, or one val request per chunk of positions: what the loaders hand Lightning.

    A sized plain iterable rather than a ``DataLoader`` over an ``IterableDataset``: the length keeps Lightning from
    pre-fetching a rollout, and Lightning warns of any ``IterableDataset`` with a length (inexact under worker
    processes, which requests never need). Requests carry no data (the stream position is
    ``RolloutDataModule.state_dict``), so the stream is stateful for Lightning: a mid-epoch resume is exact without
    the "not resumable" warning. Iterating draws no random number, where a ``DataLoader``'s iterator draws a seed
    from the global random state: a resumed run starts its epoch's iterator after the checkpoint's random states are
    back, so a draw there would shift every later random number (dropout in the update, a reward's ``random``).
    """

    def __init__(self, split: str, num_steps: int, chunks: Sequence[Sequence[int]] | None = None):
        self.split, self.num_steps, self.chunks = split, num_steps, chunks

    def __iter__(self) -> Iterator[RolloutRequest]:
        if self.chunks is not None:
            yield from (RolloutRequest(self.split, step, tuple(chunk)) for step, chunk in enumerate(self.chunks))
        else:
            yield from (RolloutRequest(self.split, step) for step in range(self.num_steps))

    def __len__(self) -> int:
        return len(self.chunks) if self.chunks is not None else self.num_steps

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Nothing to take (the stream's position is the data module's); a state that holds something is another
        loader's, refused naming its keys."""
        check_state_keys("a RequestStream state", state_dict, ())
