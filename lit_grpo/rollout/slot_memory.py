"""``SlotMemory``: the device memory of the training engine's slot cache, decided in one place.

Two decisions, both made for ``RolloutBuilder``, which holds one ``SlotMemory`` and acts on its answers:

- ``micro_group_size: auto``: how many slots (g) fit a KV budget, the config's ``kv_budget_bytes`` or the device's
  free memory less what the run still allocates, read once and saved with the checkpoint (``SlotBudget``);
- ``keep_kv_cache: auto``: whether the slot cache and the rollout weights' copy stay through the coming update,
  from the widest update measured so far (``CacheKeeping``).

The engine owns the cache itself and the builder frees it; the figures are ``lit_grpo.sampling.memory_budget``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

from lit_grpo.runtime.distributed import RolloutWeights
from lit_grpo.runtime.memory import device_memory, trainable_bytes
from lit_grpo.runtime.sizes import format_bytes
from lit_grpo.runtime.validation import (
    ConfigError,
    check_bool,
    check_int,
    check_state_keys,
    check_text,
    config_errors,
    integer_within,
    shown_setting,
)
from lit_grpo.sampling import RolloutEngine, SamplingConfig
from lit_grpo.sampling.decode_step import row_state_bytes, vocab_size
from lit_grpo.sampling.engine import row_alignment
from lit_grpo.sampling.kv_cache import kv_cache_dtype
from lit_grpo.sampling.memory_budget import (DEVICE_MARGIN_FRACTION, auto_micro_group_size, decode_step_bytes,
                                             kv_budget_from_free_memory, kv_cache_fits_beside_update, row_width)


@dataclass(frozen=True)
class KVBudget:
    """The bytes ``micro_group_size: auto`` sizes the slots in, and where they came from (``source``: the config's
    value, or the device's free memory and what was set aside). ``device_total_bytes``: the memory of the device
    read (None for the config's value); ``restored``: read before the checkpoint this run resumed from."""

    kv_budget_bytes: int
    source: str
    device_total_bytes: int | None = None
    restored: bool = False


@dataclass(frozen=True)
class SlotBudget:
    """How ``micro_group_size: auto`` was resolved: ``slots`` (g) under ``budget``."""

    slots: int
    budget: KVBudget

    @property
    def kv_budget_bytes(self) -> int:
        return self.budget.kv_budget_bytes

    @property
    def source(self) -> str:
        return self.budget.source

    def describe(self) -> str:
        """One line for the log."""
        restored = "; read before the checkpoint was saved" if self.budget.restored else ""
        return (f"micro_group_size: auto -> {self.slots} slots under a KV budget of "
                f"{format_bytes(self.kv_budget_bytes)} ({self.source}{restored})")


@dataclass(frozen=True)
class CacheKeeping:
    """``keep_kv_cache: auto``'s decision at the end of a training rollout: ``kept`` through the coming update when
    this batch (``batch_width`` positions a row) is no wider than the widest update measured (``update_width``) and
    that update's peak with nothing kept (``update_peak_bytes``) plus the slot cache at its widest with its CUDA
    graphs' memory pool and the rollout weights' copy (``kept_bytes``) fit in ``total_bytes`` less ``margin_bytes``
    (``memory_budget.kv_cache_fits_beside_update``). A wider batch releases it, and its update is measured."""

    kept: bool
    batch_width: int
    update_width: int
    update_peak_bytes: int
    kept_bytes: int
    total_bytes: int
    margin_bytes: int

    def describe(self) -> str:
        """One line for the log."""
        if self.batch_width > self.update_width:
            return (f"keep_kv_cache: auto -> the slot cache is released: this batch's rows ({self.batch_width} "
                    f"positions) are wider than any update measured ({self.update_width}); this update is measured")
        verdict = "kept through the update" if self.kept else "released before the update"
        return (f"keep_kv_cache: auto -> the slot cache is {verdict}: the update's peak "
                f"{format_bytes(self.update_peak_bytes)} (rows up to {self.update_width} positions) + the slot cache "
                f"(with its graphs' pool) and rollout weights' copy {format_bytes(self.kept_bytes)} "
                f"{'<=' if self.kept else '>'} "
                f"{format_bytes(self.total_bytes)} on the device - {format_bytes(self.margin_bytes)} margin")


def check_slot_budget(sampling: SamplingConfig, device: torch.device) -> None:
    """Raise where ``micro_group_size: auto`` has no budget to size the slots from: no ``kv_budget_bytes`` and a
    policy off CUDA, whose free memory is not read ("full" ignores g: nothing to size)."""
    if (sampling.micro_group_size == "auto" and sampling.kv_budget_bytes is None and sampling.strategy != "full"
            and device_memory(device) is None):
        raise _no_slot_budget(device)


def check_max_prompt_length(sampling: SamplingConfig, max_prompt_length: int) -> None:
    """Raise unless ``max_prompt_length`` is an integer >= 1 where ``micro_group_size: auto`` sizes slots."""
    if sampling.micro_group_size == "auto" and sampling.strategy != "full" and (
            integer_within(max_prompt_length, 1) is None):
        raise ValueError(f"{shown_setting('max_prompt_length', max_prompt_length)}: micro_group_size 'auto' prices "
                         "the prompts' KV from the longest training prompt, so it needs that length (an integer >= 1)")


def _no_slot_budget(device: torch.device) -> ConfigError:
    return ConfigError(f"data.sampling.micro_group_size='auto' without kv_budget_bytes sizes the KV cache from the "
                       f"GPU's free memory, but the policy is on {device.type!r}: set sampling.kv_budget_bytes "
                       "(bytes, an integer >= 1) or an integer micro_group_size")


class SlotMemory:
    """Owns the training engine's slot-cache memory decisions: the resolved ``micro_group_size: auto``
    (``slot_budget``) with the KV budget a checkpoint saved, and ``keep_kv_cache: auto``'s measurements of past
    updates with its last decision (``cache_keeping``).

    Args:
        policy: the model being trained: its device, its config (the KV's shape) and its trainable parameters.
        sampling: the training rollouts' settings.
        weights: what the engines run on; its copy's bytes are set aside beside the cache.
        groups_per_rollout: the most groups a rollout runs at once.
        max_prompt_length: the longest training prompt (0: unknown, where g is an integer).
    """

    def __init__(self, policy: torch.nn.Module, sampling: SamplingConfig, weights: RolloutWeights, *,
                 groups_per_rollout: int, max_prompt_length: int):
        self.policy, self.sampling, self.weights = policy, sampling, weights
        self.groups_per_rollout, self.max_prompt_length = groups_per_rollout, max_prompt_length
        #: ``micro_group_size: auto`` resolved, once (a budget from free memory would differ at every reading).
        self.slot_budget: SlotBudget | None = None
        self._checkpoint_kv_budget: KVBudget | None = None  # the budget the checkpoint resumed from read
        #: ``keep_kv_cache: auto``'s last decision (on CUDA, once an update has been measured)
        self.cache_keeping: CacheKeeping | None = None
        #: the widest update measured: ``(row width, peak with nothing kept)``, and the last batch's, whose update
        #: runs next: ``(row width, bytes kept through it)``
        self._widest_update: tuple[int, int] | None = None
        self._pending_update: tuple[int, int] | None = None

    # ------------------------------------------------------------------------------------------ slots
    def micro_group_size(self, carried: bool, precision_context: Callable[[], Any]) -> int | None:
        """g of the training engine: ``sampling.micro_group_size``, with ``"auto"`` resolved once from the KV budget
        (``slot_budget`` says how). ``carried``: groups carried between steps may run (their KV is priced);
        ``precision_context``: the rollouts' (the cache stores its dtype)."""
        g = self.sampling.micro_group_size
        if g != "auto":
            return g
        if self.sampling.strategy == "full":  # every sample has its row
            return None
        if self.slot_budget is None:
            budget = self._kv_budget()
            config, prompts = self.sampling, self.groups_per_rollout
            parked = (config.scheduler.parked_kv_bounds(config.max_new_tokens) if config.strategy == "infinite"
                      else (0, 0))
            # priced in the dtype the cache stores: the autocast one under mixed precision
            with precision_context():
                dtype = kv_cache_dtype(self.weights.module)
            # "auto" compiles on CUDA only, where the rows are aligned anyway
            alignment = row_alignment(next(self.policy.parameters()).device, config.compile is True)
            step = 0
            if budget.device_total_bytes is not None:  # the device's memory holds the decode step's activations too
                width = row_width(self.max_prompt_length, config.max_new_tokens, alignment)
                step = decode_step_bytes(self.policy.config, dtype, 1, width, vocab_size(self.policy))
            # a budget too small for one slot: a setting, said as one
            with config_errors("data.sampling", [field.name for field in fields(SamplingConfig)]):
                slots = auto_micro_group_size(self.policy.config, dtype, budget.kv_budget_bytes,
                                              self.max_prompt_length, config.max_new_tokens, config.group_size,
                                              prompts, *parked, carried=carried, alignment=alignment,
                                              row_state_bytes=row_state_bytes(self.policy, config.repetition_penalty),
                                              step_bytes=step)
            self.slot_budget = SlotBudget(slots, budget)
        return self.slot_budget.slots

    def _kv_budget(self) -> KVBudget:
        """``sampling.kv_budget_bytes`` where set; else on CUDA the device's free memory less what the run will
        still allocate there beside the KV cache and ``DEVICE_MARGIN_FRACTION`` of its memory
        (``memory_budget.kv_budget_from_free_memory``); the slots sized in it are priced with their share of a
        decode step's activations (``memory_budget.decode_step_bytes``). A resumed run takes the budget its
        checkpoint read, on a device of the same memory: its free memory now holds the restored optimizer state,
        which a new reading would set aside a second time. The slots are sized again from it, for the config of
        the resumed run.

        g is resolved before the first rollout, so before any optimizer step: AdamW's two moments are estimated
        (2 x ``runtime.memory.trainable_bytes``), as are the rollout weights' copy (cast or gathered, allocated
        when a rollout starts) and the margin, which covers the allocator's fragmentation. The update's
        gradients (freed after every optimizer step) are set aside only under ``keep_kv_cache: true``, which holds
        the cache through every update; ``"auto"`` keeps it only where it fits beside a measured update
        (``CacheKeeping``), and the update's activations are the margin's, or the released cache's.
        """
        if self.sampling.kv_budget_bytes is not None:
            return KVBudget(self.sampling.kv_budget_bytes, "sampling.kv_budget_bytes")
        device = next(self.policy.parameters()).device
        memory = device_memory(device)
        if memory is None:
            raise _no_slot_budget(device)
        free, total = memory
        saved = self._checkpoint_kv_budget
        if saved is not None and saved.device_total_bytes == total:
            return replace(saved, restored=True)
        copy, trainable = self.weights.scope_bytes(), trainable_bytes(self.policy.parameters())
        state, named = (3 * trainable, "gradients and optimizer state") if self.sampling.keep_kv_cache is True else (
            2 * trainable, "optimizer state")
        margin = int(DEVICE_MARGIN_FRACTION * total)
        budget = kv_budget_from_free_memory(free, copy + state, margin)
        return KVBudget(budget, f"{device}: {format_bytes(free)} free - {format_bytes(copy)} rollout weights' copy - "
                                f"{format_bytes(state)} {named} - {format_bytes(margin)} margin", total)

    # ------------------------------------------------------------------------------------------ updates
    def measure_last_update(self, peak: int | None) -> None:
        """Fold the update of the last batch into ``_widest_update``: its row width and its ``peak`` (the
        allocator's since its last reset: under ``PeakMemoryMonitor`` this update's own, else the run's so far, the
        rollout's included, which errs toward releasing; None where none was read) less what was kept through it."""
        pending = self._pending_update
        self._pending_update = None
        if peak is None or pending is None:
            return
        width, kept = pending
        widest = self._widest_update or (0, 0)
        self._widest_update = max(widest[0], width), max(widest[1], peak - kept)

    def keep_through_update(self, engine: RolloutEngine, batch_width: int,
                            precision_context: Callable[[], Any]) -> bool:
        """Whether the training engine keeps its slot cache (and graphs) and the rollout weights their copy through
        the coming update, whose rows are ``batch_width`` positions: ``sampling.keep_kv_cache``, with ``"auto"``
        decided here (``CacheKeeping``, on CUDA)."""
        setting = self.sampling.keep_kv_cache
        if setting != "auto":
            return setting
        if self._widest_update is None:  # no update measured yet
            return False
        memory = device_memory(next(self.policy.parameters()).device)
        if memory is None:
            return False
        total = memory[1]
        cache = engine.slot_cache_bytes() + engine.graph_pool_bytes()
        if self.max_prompt_length:
            with precision_context():  # the cache's dtype: the autocast one under mixed precision
                widest = (self.groups_per_rollout, self.max_prompt_length)
                cache = max(cache, engine.widest_slot_cache_bytes(*widest) + engine.graph_pool_bytes(*widest))
        width, peak = self._widest_update
        kept_bytes, margin = cache + self.weights.scope_bytes(), int(DEVICE_MARGIN_FRACTION * total)
        kept = batch_width <= width and kv_cache_fits_beside_update(peak, kept_bytes, total, margin)
        self.cache_keeping = CacheKeeping(kept, batch_width, width, peak, kept_bytes, total, margin)
        return kept

    def expect_update(self, engine: RolloutEngine, batch_width: int, kept: bool) -> None:
        """The update of the batch just built, ``batch_width`` positions a row, runs next, beside the slot cache and
        the rollout weights' copy where ``kept``: the next ``measure_last_update`` reads its peak."""
        kept_bytes = engine.slot_cache_bytes() + engine.graph_pool_bytes() + self.weights.scope_bytes()
        self._pending_update = batch_width, (kept_bytes if kept else 0)

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The KV budget read from the device (``{"kv_budget": ...}``, plain values), or nothing: a budget from the
        config is read from the config again."""
        # before its first rollout sizes the slots, a resumed run saves again the budget it resumed from
        budget = self.slot_budget.budget if self.slot_budget is not None else self._checkpoint_kv_budget
        if budget is not None and budget.device_total_bytes is not None:
            return {"kv_budget": asdict(replace(budget, restored=False))}
        return {}

    def resume_kv_budget(self, budget: KVBudget | None) -> None:
        """Take the KV budget of a checkpoint's state (``checked_kv_budget``'s; None: it saved none) for
        ``_kv_budget``."""
        if budget is not None:
            self._checkpoint_kv_budget = budget


def checked_kv_budget(state: Any) -> KVBudget | None:
    """The KV budget a checkpoint's ``kv_budget`` holds (``SlotMemory.state_dict``'s; None: none saved), else a
    ValueError naming the bad key or value: taken as it was, a budget of no bytes, or a device's total that is no
    number, sized the slots from nonsense or was never matched."""
    if state is None:
        return None
    names = tuple(field.name for field in fields(KVBudget))
    check_state_keys("a KV budget state", state, names, ("device_total_bytes", "restored"))
    prefix = "builder state kv_budget."
    return KVBudget(check_int(prefix + "kv_budget_bytes", state["kv_budget_bytes"], 1),
                    check_text(prefix + "source", state["source"]),
                    check_int(prefix + "device_total_bytes", state.get("device_total_bytes"), 1,
                              none="the budget of sampling.kv_budget_bytes"),
                    check_bool(prefix + "restored", state.get("restored", False)))
