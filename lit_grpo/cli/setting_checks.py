"""Checks of the parsed settings before anything is built, naming the setting and what it takes: groups given as
mappings, none of Lightning's settings that manual optimization cannot apply, a usable accelerator, process
counts Lightning takes, and stateful callbacks whose states do not collide.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from typing import Any

import torch
from lightning.pytorch import Callback
from jsonargparse import Namespace
from lightning.pytorch.utilities.model_helpers import is_overridden

from lit_grpo.runtime.validation import check_int_in_range, integer_within, shown_setting


#: The trainer precisions GRPOModule runs under, each with Lightning's short name after it.
PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16", "16-mixed", "16")


def check_groups_are_mappings(config: Namespace, defaults: Namespace) -> None:
    """Refuse a list given for a group of settings (a settings dataclass such as ``data.sampling``), which the
    parser would otherwise take positionally, field by field in declaration order."""
    for key, default in defaults.items(branches=True):
        if not isinstance(default, Namespace):
            continue
        with contextlib.suppress(KeyError, AttributeError):  # under a group given as a list itself
            value = config.get(key)
            if isinstance(value, (list, tuple)):
                names = list(vars(default))
                raise ValueError(f"{shown_setting(key, value)} must be a mapping of its settings by name "
                                 f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}), not a list")


def check_manual_optimization_settings(trainer: Any) -> None:
    """``GRPOModule`` steps its optimizer itself, so Lightning's clipping and accumulation cannot apply; name the
    module's own settings instead of Lightning's advice to switch to automatic optimization."""
    for name in ("gradient_clip_val", "gradient_clip_algorithm"):
        if trainer.get(name) is not None:
            raise ValueError(f"{shown_setting(f'trainer.{name}', trainer[name])} does not apply to GRPOModule (it "
                             "steps its optimizer itself): set model.max_grad_norm instead")
    if trainer.get("accumulate_grad_batches", 1) != 1:
        raise ValueError(f"{shown_setting('trainer.accumulate_grad_batches', trainer['accumulate_grad_batches'])} "
                         "does not apply to GRPOModule (a step's rows are already accumulated in micro-batches): set "
                         "model.train_micro_batch_size, the rows per backward pass, instead")
    precision = trainer.get("precision")
    if precision is not None and str(precision) not in PRECISIONS:
        # Lightning's "-true" plugins convert every batch, which a rollout batch (frozen dataclasses) cannot take
        raise ValueError(f"{shown_setting('trainer.precision', precision)} is not supported; use one of "
                         f"{list(PRECISIONS[::2])} "
                         "(for weights held in bf16: model.dtype: bfloat16 under 32-true or bf16-mixed)")


def check_accelerator(accelerator: Any) -> None:
    """Refuse a GPU ``trainer.accelerator`` on a machine without one torch can use, before a model is loaded for
    it: Lightning says only "No supported gpu backend found!", once the model is built."""
    if accelerator not in ("gpu", "cuda") or torch.cuda.is_available():
        return
    if accelerator == "gpu" and torch.backends.mps.is_available():  # Lightning's "gpu" is CUDA or Apple's MPS
        return
    raise ValueError(f"{shown_setting('trainer.accelerator', accelerator)}, but torch finds no GPU on this machine "
                     "(torch.cuda.is_available() is False): use 'cpu', or 'auto' for whatever is here")


def check_processes(trainer: Any) -> None:
    """Refuse a ``trainer.strategy`` name, ``trainer.devices`` or ``trainer.num_nodes`` Lightning would refuse,
    naming the setting and what it takes: Lightning's own messages name neither the setting's key nor, for
    devices, what is allowed (``Trainer(devices='0')`` is not a valid input). Classes and values Lightning takes
    are left to it. A count or index given as a numpy integer is put back in ``trainer`` as the plain int it
    holds, as every integer setting takes it (Lightning refuses numpy integers)."""
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = trainer.get("strategy")
    if isinstance(strategy, str) and strategy.lower() != "auto" and strategy.lower() not in StrategyRegistry:
        names = ["auto", *StrategyRegistry.available_strategies()]
        close = difflib.get_close_matches(strategy.lower(), names, n=1)
        plain = [name for name in names if "find_unused_parameters" not in name]  # not each ddp one's two variants
        meant = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{shown_setting('trainer.strategy', strategy)} is not known{meant}; use one of {plain} (the "
                         "ddp ones also as NAME_find_unused_parameters_true or _false), or a Strategy class "
                         "(class_path, init_args)")
    if trainer.get("num_nodes") is not None:
        trainer["num_nodes"] = check_int_in_range("trainer.num_nodes", trainer["num_nodes"], 1)
    devices = trainer.get("devices")
    if devices is None or (isinstance(devices, str) and devices == "auto"):
        return
    # a numpy integer (a count or an index computed with numpy) given on as the int it is, which Lightning takes
    if isinstance(devices, list) and None not in (indices := [integer_within(index, 0) for index in devices]):
        devices = trainer["devices"] = indices
    elif (number := integer_within(devices)) is not None:
        devices = trainer["devices"] = number
    count = _int_or_none(devices) if isinstance(devices, (int, str)) and not isinstance(devices, bool) else None
    written = isinstance(devices, str) and count is not None and devices.strip() == str(count)  # '0' read as 0
    shown = shown_setting("trainer.devices", count if written else devices)
    accelerator = trainer.get("accelerator")
    on_cpu = accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available()
                                      and not torch.backends.mps.is_available())
    if on_cpu:
        if count is None or count < 1:
            raise ValueError(f"{shown} is not allowed; on the CPU trainer.devices must be a number of processes >= 1, "
                             "or 'auto'")
        return
    listed = isinstance(devices, list) and devices and all(integer_within(index, 0) is not None for index in devices)
    if not (listed or (count is not None and (count >= 1 or count == -1)) or (
            count is None and isinstance(devices, str) and re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*,?", devices))):
        raise ValueError(f"{shown} is not allowed; trainer.devices must be a number of devices >= 1, -1 (all of "
                         "them), 'auto', or a list of device indices such as [0, 1]")


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def check_distinct_stateful_callbacks(callbacks: list[Callback]) -> None:
    """Raise when two callbacks with a checkpointed state share a ``state_key`` (the same type and settings): their
    states would overwrite each other in a checkpoint."""
    seen: dict[str, Callback] = {}
    for callback in callbacks:
        if not is_overridden("state_dict", instance=callback, parent=Callback):
            continue
        if callback.state_key in seen:
            name = type(callback).__name__
            raise ValueError(f"two {name} callbacks with the same settings ({callback.state_key}): their checkpointed "
                             f"states would collide. Give the second one different settings (any of those named) "
                             f"or remove it from trainer.callbacks.")
        seen[callback.state_key] = callback
