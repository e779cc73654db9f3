"""A callback that records what each training step saw and did, one JSON line per step, to compare runs.

Used by tools/bench_faults.py and by the resume and DDP tests through the CLI, e.g.
``--trainer.callbacks+=tools.step_recorder.StepRecorder --trainer.callbacks.path=OUT`` with the repository root on
PYTHONPATH. A step done twice (a resumed run redoing steps after a kill) is appended again: ``read_records`` keeps the
last record of each step. Each line: global_step, rank, world_size, indices (the batch's prompt indices), completion_ids
(``[B][G][T]`` real tokens only), rewards, advantages, skipped, loss, grad_norm, param_sum (float64 sum of every policy
parameter after the step; under FSDP2 of this rank's shard, with sharded true) and param_abs (the same over absolute
values), threads (``torch.get_num_threads()`` during the step). ``save_batches``: global steps (counted after the step)
whose whole ``RolloutBatch`` is saved next to the records (``torch.save``).
``record_state``: each line also holds ``data_state``, the state that decides what data comes next
(``data_steering_state``: the prompt sampler / curriculum and the reward forecasts), to compare it across ranks.
Each line also holds ``logged`` (``trainer.callback_metrics`` after the step: what the module logged, reduced over
ranks) and ``rollout`` (this rank's ``RolloutStats.scalars()``). ``count_grad_syncs`` (ddp only): a DDP comm hook
counts the gradient buckets all-reduced, and each line holds ``grad_syncs``, one list per optimizer step of the
step, the index of every bucket reduced before it (one all-reduce round: each bucket once).
Validations go to ``PATH.rankR.val.jsonl``: one line per validation batch (global_step, indices, rewards per
prompt, skipped; none for a rank's empty chunk) and one per validation with the logged ``val/*``
(``read_validations``).
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from lightning.pytorch import Callback
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel


class StepRecorder(Callback):
    def __init__(self, path: str, save_batches: list[int] | None = None, record_state: bool = False,
                 count_grad_syncs: bool = False):
        self.path = path
        self.save_batches = list(save_batches or [])
        self.record_state = record_state
        self.count_grad_syncs = count_grad_syncs
        self._buckets: list[int] = []  # bucket indices all-reduced since the last optimizer step
        self._grad_syncs: list[list[int]] = []  # per optimizer step of this training step

    def on_train_start(self, trainer, pl_module) -> None:
        if not self.count_grad_syncs:
            return
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(f"count_grad_syncs needs the ddp strategy; the strategy's model is a "
                             f"{type(model).__name__}")
        model.register_comm_hook(self._buckets, _counting_allreduce)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._buckets.clear()
        self._grad_syncs = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._grad_syncs.append(list(self._buckets))
        self._buckets.clear()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if batch is None:  # a rank's empty chunk
            return
        self._append_val({"global_step": trainer.global_step, "indices": list(batch.indices),
                          "rewards": batch.rewards.double().mean(dim=1).tolist(),
                          "skipped": batch.skipped.tolist() if batch.skipped is not None else None}, trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            self._append_val({"global_step": trainer.global_step, "logged": logged}, trainer)

    def _append_val(self, record: dict, trainer) -> None:
        path = f"{self.path}.rank{trainer.global_rank}.val.jsonl"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

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
            "micro_group_size": batch.metrics.get("rollout/slots"),
            "grad_norm": float(trainer.callback_metrics["train/grad_norm"]),
            "group_size": batch.group_size, "num_prompts": batch.num_prompts,
            "threads": torch.get_num_threads(),
            "logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "rollout": batch.stats.scalars(),
        }
        if self.count_grad_syncs:
            record["grad_syncs"] = self._grad_syncs
        if self.record_state:  # what decides the next data: the prompt sampler / curriculum, the reward forecasts
            record["data_state"] = data_steering_state(trainer)
        if trainer.global_step in self.save_batches:  # the whole RolloutBatch, for recomputing the update
            torch.save(batch.to("cpu"), f"{self.path}.rank{trainer.global_rank}.step{trainer.global_step}.pt")
        path = f"{self.path}.rank{trainer.global_rank}.jsonl"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


def data_steering_state(trainer) -> dict:
    """The state that decides what data comes next, JSON-ready: ``sampler`` (the datamodule's prompt sampler's
    ``state_dict()``, its random generator as a SHA-256 of its bytes), ``sampler_metrics`` (e.g. ``curriculum/mu``)
    and ``forecasts`` (each ``RewardForecast``'s ``state_dict()``, by state key)."""
    from lit_grpo.callbacks import RewardForecast

    sampler = getattr(trainer.datamodule, "sampler", None)
    return {"sampler": None if sampler is None else _plain(sampler.state_dict()),
            "sampler_metrics": None if sampler is None else _plain(sampler.metrics()),
            "forecasts": {cb.state_key: _plain(cb.state_dict()) for cb in trainer.callbacks
                          if isinstance(cb, RewardForecast)}}


def _plain(value):
    """Tensors as lists (a uint8 one, a generator's state, as the SHA-256 of its bytes), NaN as the string "nan"."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.uint8:
            return hashlib.sha256(value.cpu().numpy().tobytes()).hexdigest()
        return _plain(value.tolist())
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def _counting_allreduce(buckets: list[int], bucket):
    """DDP's default all-reduce of a gradient bucket, noting the bucket's index in ``buckets``."""
    buckets.append(bucket.index())
    return allreduce_hook(None, bucket)


def read_validations(path: str, rank: int = 0) -> list[dict]:
    """The validations ``rank`` recorded, in order: each ``{"global_step", "batches": [...], "logged": {...}}``."""
    validations, batches = [], []
    with open(f"{path}.rank{rank}.val.jsonl") as handle:
        for record in map(json.loads, filter(str.strip, handle)):
            if "logged" in record:
                validations.append({**record, "batches": batches})
                batches = []
            else:
                batches.append(record)
    return validations


def read_records(path: str, rank: int = 0) -> list[dict]:
    """The records of ``rank``, one per step in step order (the last one where a step was recorded twice)."""
    with open(f"{path}.rank{rank}.jsonl") as handle:
        by_step = {record["global_step"]: record for record in map(json.loads, filter(str.strip, handle))}
    return [by_step[step] for step in sorted(by_step)]
