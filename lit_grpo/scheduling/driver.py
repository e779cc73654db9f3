"""The one loop that drives a Scheduler through a rollout: the engine and the simulator both run it.

An executor carries out what the scheduler decides: the engine's ``RolloutLoop`` decodes with the model, the
simulator (``simulate.py``) counts the tokens of known lengths. Per decode step every running sample generates one
token. After the step, in slot order, a sample that ended (EOS or the length cap) finishes (``finish``); otherwise
one that reached ``probe_tokens`` is offered to ``probe`` (parked on True: its slot frees, its tokens are kept, it
resumes where it stopped), and one not parked there that reached one of ``preempt_points`` to ``preempt`` (the
same). Then, if a slot is free and a sample waits, ``admit()``, whose ``(slot, sample)``
assignments run from the next step. A sample that ends at its probe finishes without a probe.

The scheduler keeps the one record of the rollout's state (``Scheduler.running``, ``parked``, ``generated``); the
executor keeps what it computes with (tokens, KV) and reads the record, never a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from lit_grpo.scheduling.base import Assignment, Decision, RolloutWork, SampleKey, Scheduler

#: A free slot in a timeline row.
IDLE = -1

Row = tuple[int, SampleKey]  # (slot, the sample running there)


class Executor(Protocol):
    """What the driver needs of whatever runs the samples."""

    def over(self) -> bool:
        """Whether the rollout stops now (before the next admission and step)."""

    def start(self, assignments: list[Assignment]) -> None:
        """Run each ``(slot, sample)`` from the next step on: a sample new to this rollout, or a parked one."""

    def step(self, rows: list[Row], probing: list[int]) -> list[bool]:
        """One decode step of ``rows`` (slot order); whether each row's sample ended with its new token.
        ``probing``: the slots whose new token is their sample's probe (``feature`` is asked of them)."""

    def feature(self, slot: int, key: SampleKey) -> torch.Tensor:
        """``[H]``: the hidden state of the probe token the last step generated in ``slot``."""

    def finish(self, slot: int, key: SampleKey) -> None:
        """The sample in ``slot`` ended; its slot is free from the next step."""

    def park(self, slot: int, key: SampleKey) -> None:
        """The scheduler parked the sample in ``slot``: keep what it computed until it resumes."""

    def settle(self) -> None:
        """After a step's finishes and parks."""


@dataclass
class DriveResult:
    """What the driver counted: decode steps, the scheduler's metrics and decisions (``Decision.step`` = the first
    step that runs without the parked sample, or with the started one), and (when kept) the slot timeline
    (``timeline[t][s]`` = flat sample index ``p * G + k`` running in slot s at step t, or ``IDLE``)."""

    decode_steps: int
    metrics: dict[str, float]
    timeline: list[list[int]] = field(default_factory=list, repr=False)
    decisions: list[Decision] = field(default_factory=list, repr=False)


def drive_rollout(scheduler: Scheduler, work: RolloutWork, executor: Executor,
                  keep_timeline: bool = False) -> DriveResult:
    """Run one rollout: ``begin``, admissions and decode steps until ``executor.over()``, then ``end``."""
    scheduler.begin(work)
    probe, points, group_size = scheduler.probe_tokens, scheduler.preempt_points, work.group_size
    steps, timeline = 0, []
    while not executor.over():
        if len(scheduler.running) < work.num_slots and scheduler.waiting():
            # Once nothing waits, the tail runs without asking the scheduler.
            busy = {slot: key for key, slot in scheduler.running.items()}
            assignments = scheduler.admit()
            _check_admitted(scheduler, busy, assignments)
            executor.start(assignments)
        if not scheduler.running:
            raise RuntimeError(f"deadlock: {type(scheduler).__name__} admitted nothing while no sample runs and "
                               "samples wait")
        slots = scheduler.slots
        rows = [(slot, key) for slot, key in enumerate(slots) if key is not None]
        generated = scheduler.generated
        probing = [] if probe is None else [slot for slot, key in rows if generated[key] == probe - 1]
        ended = executor.step(rows, probing)
        steps += 1
        scheduler.step = steps
        if keep_timeline:
            timeline.append([IDLE if key is None else key[0] * group_size + key[1] for key in slots])
        for (slot, key), end in zip(rows, ended):
            generated[key] += 1
            if end:
                executor.finish(slot, key)
                scheduler.finish(key, generated[key])
            elif generated[key] == probe and scheduler.probe(key, generated[key], executor.feature(slot, key)):
                executor.park(slot, key)
            elif generated[key] in points and scheduler.preempt(key, generated[key]):
                executor.park(slot, key)
        executor.settle()
    return DriveResult(steps, scheduler.end(), timeline, scheduler.decisions)


def _check_admitted(scheduler: Scheduler, busy: dict[int, SampleKey], assignments: list[Assignment]) -> None:
    """Each assignment goes to a slot that was free and is what the scheduler's record holds."""
    name = type(scheduler).__name__
    for slot, key in assignments:
        if slot in busy:
            raise RuntimeError(f"{name} placed sample {key} in slot {slot}, which runs {busy[slot]}")
        if not 0 <= slot < scheduler.work.num_slots:
            raise RuntimeError(f"{name} placed sample {key} in slot {slot}; the slots are "
                               f"0..{scheduler.work.num_slots - 1}")
        if scheduler.running.get(key) != slot:
            raise RuntimeError(f"{name} admitted ({slot}, {key}) but its record holds {key} in slot "
                               f"{scheduler.running.get(key)}")
        busy[slot] = key
