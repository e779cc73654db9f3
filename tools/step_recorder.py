"""A callback that records what each training step saw and did, one JSON line per step, to compare runs.

Used by tools/bench_faults.py and by the resume and DDP tests through the CLI, e.g.
``--trainer.callbacks+=tools.step_recorder.StepRecorder --trainer.callbacks.path=OUT`` with the repository root
on PYTHONPATH. A step done twice (a resumed run redoing steps after a kill) is appended again: ``read_records``
keeps the last record of each step. Each line: global_step, rank, world_size, indices (the batch's prompt indices), completion_ids
(``[B][G][T]`` real tokens only), rewards, advantages, skipped, loss, grad_norm, param_sum (float64 sum of every
policy parameter after the step; under FSDP2 of this rank's shard, with sharded true) and param_abs (the same over
absolute values). ``save_batches``: global steps
(counted after the step) whose whole ``RolloutBatch`` is saved next to the records (``torch.save``).
"""

from __future__ import annotations

import json
import os

import torch
from lightning.pytorch import Callback


class StepRecorder(Callback):
    def __init__(self, path: str, save_batches: list[int] | None = None):
        self.path = path
        self.save_batches = list(save_batches or [])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        mask = batch.completion_mask.bool()
        ids = [[batch.completion_ids[p, k][mask[p, k]].tolist() for k in range(batch.group_size)]
               for p in range(batch.num_prompts)]
        with torch.no_grad():
            params = [p.detach() for p in pl_module.policy.parameters()]
            sharded = any(hasattr(p, "to_local") for p in params)  # FSDP2 DTensors: this rank's shard only
            params = [(p.to_local() if hasattr(p, "to_local") else p).double() for p in params]
            param_sum = float(sum(p.sum() for p in params))
            param_abs = float(sum(p.abs().sum() for p in params))
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        record = {
            "global_step": trainer.global_step, "rank": trainer.global_rank, "world_size": trainer.world_size,
            "indices": list(batch.indices), "completion_ids": ids, "rewards": batch.rewards.tolist(),
            "advantages": batch.advantages.tolist(),
            "skipped": batch.skipped.tolist() if batch.skipped is not None else None,
            "loss": float(loss) if loss is not None else None,
            "param_sum": param_sum, "param_abs": param_abs, "sharded": sharded,
            "micro_group_size": batch.metrics.get("rollout/micro_group_size"),
            "grad_norm": float(trainer.callback_metrics["train/grad_norm"]),
            "group_size": batch.group_size, "num_prompts": batch.num_prompts,
        }
        if trainer.global_step in self.save_batches:  # the whole RolloutBatch, for recomputing the update
            torch.save(batch.to("cpu"), f"{self.path}.rank{trainer.global_rank}.step{trainer.global_step}.pt")
        path = f"{self.path}.rank{trainer.global_rank}.jsonl"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


def read_records(path: str, rank: int = 0) -> list[dict]:
    """The records of ``rank``, one per step in step order (the last one where a step was recorded twice)."""
    with open(f"{path}.rank{rank}.jsonl") as handle:
        by_step = {record["global_step"]: record for record in map(json.loads, filter(str.strip, handle))}
    return [by_step[step] for step in sorted(by_step)]
