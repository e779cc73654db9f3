"""Test callbacks (not a test module) for the stop and checkpoint tests, loaded by the CLI from ``tests/``."""

from __future__ import annotations

import os
import signal
import time

import torch
from lightning.pytorch import Callback

from lit_grpo.runtime.stop_signal import COPY_WINDOW_S


class SignalAt(Callback):
    """Sends ``signal_name`` (TERM or INT) to this process ``times`` times when step ``step`` is in ``phase``:
    "rollout" (while its prompts are drawn, inside the rollout), "update" (at the start of its update) or
    "validation" (in the first batch of the validation after it; step 0: the one before training) or
    "validation_rollout" (as that batch's rollout starts)."""

    def __init__(self, signal_name: str, step: int, phase: str, times: int = 1, rank: int | None = None):
        self.signum, self.step, self.phase, self.times = getattr(signal, f"SIG{signal_name}"), step, phase, times
        self.rank = rank  # None: every rank's process; else that rank's alone
        self._global_rank = 0

    def setup(self, trainer, pl_module, stage) -> None:
        self._global_rank = trainer.global_rank

    def _send(self) -> None:
        if self.rank is not None and self.rank != self._global_rank:
            return
        for i in range(self.times):
            if i:  # a user asking again, not a launcher's copy of the first (``COPY_WINDOW_S``)
                time.sleep(COPY_WINDOW_S + 0.1)
            os.kill(os.getpid(), self.signum)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.phase == "rollout":
            # the datamodule's public prompt sampler: the rollout draws its prompts from it
            sampler = trainer.datamodule.sampler
            draw = sampler.draw

            def draw_and_signal(count, avoid=()):
                if trainer.global_step + 1 == self.step:
                    self._send()
                return draw(count, avoid)

            sampler.draw = draw_and_signal

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.phase == "validation_rollout" and trainer.global_step == self.step:
            # the builder's validation rollout (its builder is made at the first rollout): the signal comes as
            # the first batch's rollout starts
            from lit_grpo.rollout.builder import RolloutBuilder

            build_val = RolloutBuilder.build_val

            def signal_and_build(builder, prompts):
                RolloutBuilder.build_val = build_val
                self._send()
                batch = build_val(builder, prompts)
                print(f"validation rollout after step {trainer.global_step} finished", flush=True)
                return batch

            RolloutBuilder.build_val = signal_and_build

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.phase == "validation" and trainer.global_step == self.step and batch_idx == 0:
            self._send()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.phase == "update" and trainer.global_step + 1 == self.step:
            self._send()


class ValidationBatches(Callback):
    """Prints a line at the end of every validation batch (a cut validation's output shows where it stopped)."""

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        print(f"validation batch {batch_idx} after step {trainer.global_step} ended", flush=True)


class LastCheckpointProbe(Callback):
    """Records, at the start of every update, the step held by ``last.ckpt`` (None while there is none)."""

    def __init__(self):
        self.seen: dict[int, int | None] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        path = trainer.checkpoint_callback.last_model_path
        step = None
        if path and os.path.exists(path):
            step = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"]
        self.seen[trainer.global_step + 1] = step


class SlowRollout(Callback):
    """Makes step ``step``'s training rollout long on ``slow_ranks`` (a ``sleep``-second pause before each forward of
    the policy in it), and on ``signal_ranks`` sends SIGTERM to this process after ``after`` of its forwards, or,
    where it slows none, as it joins the ranks' meeting after its rollout (past its rollout). A rank that both
    slows and signals pauses only from its signal's forward on: the pauses are there to make a rollout the signal
    failed to abandon outlast the test, and any before the signal would only delay it. A pause is taken in naps of
    ``NAP_S``, between which a stop from another rank interrupts it (``_thread.interrupt_main`` wakes no sleep), as
    it would a rollout's compute. Each rank writes the training positions its sampler drew in that step, as example
    indices, to ``folder/drawn.rankR`` and, where its rollout finished (not abandoned), touches
    ``folder/past.rankR`` as it joins that meeting."""

    NAP_S = 0.05

    def __init__(self, folder: str, step: int, sleep: float, after: int = 5, slow_ranks: tuple = (0, 1),
                 signal_ranks: tuple = (0, 1)):
        self.folder, self.step, self.sleep, self.after = folder, step, sleep, after
        self.slow_ranks, self.signal_ranks = tuple(slow_ranks), tuple(signal_ranks)
        self._forwards = 0

    def _in_step(self, trainer) -> bool:
        return trainer.global_step + 1 == self.step and trainer.training

    def on_train_start(self, trainer, pl_module) -> None:
        rank, folder = trainer.global_rank, self.folder
        datamodule = trainer.datamodule
        draw = datamodule.sampler.draw

        def draw_and_note(count, avoid=()):
            drawn = draw(count, avoid)
            if self._in_step(trainer):
                with open(os.path.join(folder, f"drawn.rank{rank}"), "a") as handle:
                    handle.write("".join(f"{datamodule.train_indices[p]}\n" for p in drawn))
            return drawn

        datamodule.sampler.draw = draw_and_note
        if rank in self.slow_ranks:
            pl_module.policy.register_forward_pre_hook(lambda module, args: self._slow(trainer))
        from lit_grpo.rollout.builder import RolloutBuilder

        any_rank = RolloutBuilder._any_rank

        def note_and_meet(builder, flag):
            if self._in_step(trainer) and not flag:  # its rollout finished, not abandoned
                open(os.path.join(folder, f"past.rank{rank}"), "w").close()
                if rank in self.signal_ranks and rank not in self.slow_ranks:
                    os.kill(os.getpid(), signal.SIGTERM)
            return any_rank(builder, flag)

        RolloutBuilder._any_rank = note_and_meet

    def _slow(self, trainer) -> None:
        if not self._in_step(trainer) or torch.is_grad_enabled():  # the rollout's forwards only, not the update's
            return
        self._forwards += 1
        signals = trainer.global_rank in self.signal_ranks
        if self._forwards == self.after and signals:
            print(f"rank {trainer.global_rank}: SIGTERM after {self._forwards} rollout forwards", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        if signals and self._forwards < self.after:
            return
        end = time.monotonic() + self.sleep
        while time.monotonic() < end:
            time.sleep(min(self.NAP_S, max(end - time.monotonic(), 0.0)))


def write_checkpoint_twice(path: str, first_written) -> None:
    """A process's two atomic saves to ``path`` (started from tests/forked_cli.py's fork server, warm already): a
    small one, then ``first_written`` set, then one of 800 MB for the test to kill in the middle of."""
    from lit_grpo.runtime.checkpoints import atomic_torch_save

    atomic_torch_save({"version": 1, "weights": torch.ones(1000)}, path)
    first_written.set()
    atomic_torch_save({"version": 2, "weights": torch.ones(200_000_000)}, path)
