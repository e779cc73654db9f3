"""Reference-model sync (TR-DPO; TRL's ``sync_ref_model``): every ``every_n_steps`` optimizer steps the frozen
reference moves toward the policy, parameter by parameter,

    ref <- (1 - mixup_alpha) ref + mixup_alpha policy

so that the k3 KL penalty (``loss.beta > 0``) holds the policy near a recent mix of its own past weights rather than
the initial ones (``mixup_alpha: 1`` copies the policy)::

    model:
      loss: {beta: 0.04}
      reference_sync: {every_n_steps: 64, mixup_alpha: 0.6}   # null (the default): the reference stays as loaded

``GRPOModule`` mixes after each optimizer step whose count is a multiple of ``every_n_steps`` and, once a sync is
set, keeps the reference's weights in its checkpoints (they are no longer the initial weights it could reload).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lit_grpo.runtime.validation import check_field, check_int, check_real


@dataclass(frozen=True)
class ReferenceSync:
    """When and how far the reference moves toward the policy (YAML ``model.reference_sync``), checked when built.

    Args:
        every_n_steps: mix after every this many optimizer steps (``trainer.global_step``, which counts
            ``num_iterations x num_mini_batches`` per training step; TRL's ``ref_model_sync_steps``), an integer >= 1.
        mixup_alpha: the policy's share of the mix, in (0, 1] (TRL's ``ref_model_mixup_alpha``).
    """

    every_n_steps: int = 512
    mixup_alpha: float = 0.6

    def __post_init__(self) -> None:
        check_field(self, "every_n_steps", check_int, 1, prefix="reference_sync.")
        check_field(self, "mixup_alpha", check_real, low=0, high=1, low_open=True, prefix="reference_sync.")

    def due(self, optimizer_steps: int) -> bool:
        """Whether the optimizer step that brought the count to ``optimizer_steps`` is followed by a mix."""
        return optimizer_steps > 0 and optimizer_steps % self.every_n_steps == 0


@torch.no_grad()
def mix_parameters(target: torch.nn.Module, source: torch.nn.Module, alpha: float) -> None:
    """``target``'s parameters <- ``(1 - alpha) target + alpha source``, in place, matched by name: each product
    rounded in the parameters' dtype, then their sum (``alpha`` 1 copies ``source``; a fused multiply-add would
    differ by an ulp). One parameter's ``alpha source`` is allocated at a time.

    Plain tensors or FSDP2 shards (DTensors): the two models must be sharded alike, so each rank mixes its own
    shards without a collective. Names, shapes, dtypes and placements that differ raise a ValueError before any
    parameter changes."""
    for model in (target, source):
        _reshard(model)
    targets, sources = dict(target.named_parameters()), dict(source.named_parameters())
    if targets.keys() != sources.keys():
        missing, extra = sorted(targets.keys() - sources.keys()), sorted(sources.keys() - targets.keys())
        raise ValueError(f"the models' parameters differ: only the target has {missing[:3]}, only the source "
                         f"{extra[:3]}")
    for name, into in targets.items():
        source_param = sources[name]
        layout = (into.shape, into.dtype, getattr(into, "placements", None))
        source_layout = (source_param.shape, source_param.dtype, getattr(source_param, "placements", None))
        if layout != source_layout:
            raise ValueError(f"parameter {name}: the target's (shape, dtype, placements) {layout} differ from the "
                             f"source's {source_layout}")
    for name, into in targets.items():
        into.mul_(1.0 - alpha).add_(sources[name] * alpha)


def _reshard(model: torch.nn.Module) -> None:
    """Put every FSDP2 unit of ``model`` back on its shards. A unit left gathered (the root after a forward without
    a backward: FSDP2 keeps its weights for the backward) has its full weights registered in place of its shards,
    and a mix written into those would be lost when it reshards."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - old torch
        return
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
