"""What a resume compares of the module's settings: the fields of a group of them that no run with its values reads
(``unread_settings``), which ``lit_grpo.runtime.checkpoints.check_resumable`` skips, for ``lit-grpo fit --ckpt_path``
and for a script's ``trainer.fit(ckpt_path=...)`` alike (``GRPOModule.on_load_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_grpo.update.loss_config import LossConfig, unread_settings as loss_unread_settings


def unread_settings(name: str, group: Mapping[str, Any]) -> set[str]:
    """The fields of the module's group of settings ``name`` that a resumed run with the values ``group`` never
    reads (the loss's for another loss type or without the KL, the starting ``entropy_coef`` under the adaptive
    control, a sampler correction's bounds with mode none): a resume does not compare them (``check_resumable``'s
    ``unread``)."""
    if name == "loss":
        adaptive = group.get("use_adaptive_entropy", LossConfig.use_adaptive_entropy)
        unread = loss_unread_settings(group.get("loss_type", LossConfig.loss_type),
                                      group.get("beta", LossConfig.beta), adaptive)
        # the adaptive control's checkpointed state holds the coefficient a resume goes on from: the starting one
        # is read only at a run's start
        return unread | {"entropy_coef"} if adaptive else unread
    if name == "sampler_correction" and group.get("mode") == "none":
        return {"clip_min", "clip_max"}
    return set()
