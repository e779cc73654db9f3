"""``RolloutBuilder``: prompts in, one scored ``RolloutBatch`` out (rollout, rewards, dynamic sampling, advantages).

The data flow of a training step, prompt -> builder -> batch -> module::

    RolloutDataModule   draws prompts (sampler / curriculum), owns the loaders and the stream position
      -> RolloutBuilder.build_train(draw)
           engine.generate_groups(groups)       the current policy, eval mode, no grad (lit_grpo.sampling);
                                                with over_provision > 1 it stops once B groups are complete and
                                                carries the others to the next step (partial rollouts)
           score_rewards(...)                   weighted reward functions (lit_grpo.rollout.rewards)
           [dynamic sampling: drop groups whose rewards are all equal, draw more, up to max_rollouts_per_step]
           group_advantages(rewards, scale)     (lit_grpo.rollout.advantages; "batch" spans every rank)
      -> RolloutBatch                           (lit_grpo.batch)
      -> GRPOModule.training_step               the update

Everything the builder needs comes in as an argument, once: the policy and tokenizer (from the module that owns
them), the sampling config, the reward functions, the advantage scaling and the world (size, and how to gather
across ranks). It knows nothing about Lightning.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from lit_grpo.rollout.advantages import group_advantages, zero_std_groups
from lit_grpo.batch import RolloutBatch, accuracy_sums, pad_left, pad_right
from lit_grpo.rollout.prompts import PromptExample
from lit_grpo.rollout.rewards import WeightedReward, correctness_reward, score_rewards
from lit_grpo.runtime.distributed import RolloutWeights
from lit_grpo.runtime.memory import device_memory, trainable_bytes
from lit_grpo.runtime.sizes import format_bytes
from lit_grpo.runtime.validation import ConfigError, check_int, config_errors
from lit_grpo.sampling import GroupProgress, RolloutEngine, SampleProgress, SamplingConfig
from lit_grpo.sampling.carry import plan_partial_rollout
from lit_grpo.sampling.engine import row_alignment
from lit_grpo.sampling.kv_cache import kv_cache_dtype
from lit_grpo.sampling.memory_budget import (DEVICE_MARGIN_FRACTION, auto_micro_group_size, kv_budget_from_free_memory,
                                             kv_cache_fits_beside_update)
from lit_grpo.sampling.random_streams import rank_seed
from lit_grpo.sampling.stats import merge_stats


#: Added to ``sampling.seed`` for sampled validation, so that its draws never repeat a training rollout's.
VAL_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Prompt:
    """One prompt as the builder sees it: its index among the dataset's examples, the source example and its token
    ids."""

    index: int
    example: PromptExample
    ids: list[int]


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


def check_slot_budget(sampling: SamplingConfig, device: torch.device) -> None:
    """Raise where ``micro_group_size: auto`` has no budget to size the slots from: no ``kv_budget_bytes`` and a
    policy off CUDA, whose free memory is not read ("full" ignores g: nothing to size)."""
    if (sampling.micro_group_size == "auto" and sampling.kv_budget_bytes is None and sampling.strategy != "full"
            and device_memory(device) is None):
        raise _no_slot_budget(device)


def _no_slot_budget(device: torch.device) -> ConfigError:
    return ConfigError(f"data.sampling.micro_group_size='auto' without kv_budget_bytes sizes the KV cache from the "
                       f"GPU's free memory, but the policy is on {device.type!r}: set sampling.kv_budget_bytes "
                       "(bytes, an integer >= 1) or an integer micro_group_size")


@dataclass(frozen=True)
class CacheKeeping:
    """``keep_kv_cache: auto``'s decision at the end of a training rollout: ``kept`` through the coming update when
    this batch (``batch_width`` positions a row) is no wider than the widest update measured (``update_width``) and
    that update's peak with nothing kept (``update_peak_bytes``) plus the slot cache at its widest and the rollout
    weights' copy (``kept_bytes``) fit in ``total_bytes`` less ``margin_bytes``
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
                f"and rollout weights' copy {format_bytes(self.kept_bytes)} {'<=' if self.kept else '>'} "
                f"{format_bytes(self.total_bytes)} on the device - {format_bytes(self.margin_bytes)} margin")


@dataclass(frozen=True)
class _Carry:
    """What the builder attaches to a group it may carry: its prompt, and the steps it has been carried so far."""

    prompt: Prompt
    steps: int = 0


@dataclass
class _Round:
    """One rollout's (engine call's) groups, scored: ``[b]`` prompts x G completions."""

    prompts: list[Prompt]
    completion_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    truncated: list[list[bool]]
    texts: list[list[str]]
    rewards: torch.Tensor                 # [b, G]
    components: dict[str, torch.Tensor]   # name -> [b, G]
    skipped: torch.Tensor                 # [b] bool
    stats: Any
    offpolicy_tokens: list[int]           # [b] each group's completion tokens drawn in an earlier rollout


class RolloutBuilder:
    """Turns prompts into ``RolloutBatch`` es with the current policy.

    Args:
        policy: the model being trained (``tokenizer``: its tokenizer).
        sampling: the training rollouts' settings; ``micro_group_size="auto"`` is resolved against
            ``max_prompt_length`` on first use.
        reward_funcs: weighted reward functions (``lit_grpo.rollout.rewards.build_reward_funcs``).
        scale_rewards: advantage scaling, "group" | "batch" | "none" (part of the module's objective).
        accuracy_reward: the reward whose values are correctness (``RolloutBatch.accuracy``; ``correctness_reward``).
        on_reward_error: "raise" | "skip_group" (see RolloutDataModule).
        dynamic_sampling: drop all-equal groups and sample more, at most ``max_rollouts_per_step`` rollouts
            (engine calls) per step; dropped groups fill the batch if still short (zero advantages).
        val_batch_size: greedy validation rollouts (one completion per prompt), ``val_max_new_tokens`` long.
        val_num_samples: k > 1 also draws k completions per held-out prompt at ``val_temperature``
            (``RolloutBatch.sampled_accuracy``, for mean@k and pass@k). Their random streams use their own seed
            (``sampling.seed + VAL_SEED_OFFSET``), keyed by the prompt's index in the dataset, and restart at every
            validation, so a prompt's k draws depend on the seed and that index only (not on the batch or the rank
            it falls in): the same policy gets the same draws in any run, a resumed one included, and the
            training engine's state is never touched.
        world_size: ranks; ``all_gather(tensor) -> [world_size, *tensor.shape]`` is needed when it is > 1 and
            ``scale_rewards="batch"``.
        rank: this process's rank among them. The training engine's streams are keyed by the rollout and the
            group's place in it, the same on every rank, so each rank gets its own seed
            (``random_streams.rank_seed``): otherwise group p of every rank would draw the same numbers.
        all_gather: a gather across ranks, lent by the trainer (``use_world``; see ``world_size``).
        precision_context: a context manager factory the rollouts run in (the trainer's autocast), or None.
        measured_update_peak: the device's peak in the last update, read from its owner (``use_world``).
        prompts_per_step: B, groups per training batch.
        max_prompt_length: the longest training prompt, for ``micro_group_size="auto"``.
        over_provision: partial rollouts (1.0: off): each step's first rollout runs up to ``ceil(over_provision x B)``
            groups, carried ones first, stops once B are complete and carries every unfinished group (its samples'
            tokens so far, continued next step under the new weights). Nothing is dropped.
        max_staleness: steps a group may be carried; one carried that long must complete in the next rollout
            (the stalest B at most, as only B groups fit a batch).
        rollout_weights: what the engines run on (default: ``policy`` itself); under FSDP2 the policy's gathered
            copy or its shards in lockstep (lit_grpo.runtime.distributed). A training step's rollouts (all of
            them, dynamic sampling's too) run in one ``active()`` scope, a validation batch's in one, and what
            gathers across ranks (the batch reward scale) runs after it: every rank enters and leaves the scope
            together whatever its rollouts' lengths.
    """

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, sampling: SamplingConfig,
                 reward_funcs: Sequence[WeightedReward], *, scale_rewards: str = "group",
                 accuracy_reward: str | None = None, on_reward_error: str = "raise", dynamic_sampling: bool = False,
                 max_rollouts_per_step: int = 4, val_batch_size: int = 32, val_max_new_tokens: int | None = None,
                 val_num_samples: int = 1, val_temperature: float = 1.0,
                 world_size: int = 1, rank: int = 0, all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 precision_context: Callable[[], Any] | None = None, prompts_per_step: int = 1,
                 max_prompt_length: int = 0, over_provision: float = 1.0, max_staleness: int = 2,
                 rollout_weights: RolloutWeights | None = None,
                 measured_update_peak: Callable[[], int | None] | None = None):
        if world_size > 1 and scale_rewards == "batch" and all_gather is None:
            raise ValueError(f"scale_rewards='batch' over world_size={world_size} ranks needs all_gather")
        check_partial_rollouts(over_provision, max_staleness)
        if sampling.micro_group_size == "auto" and sampling.strategy != "full" and (
                isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int) or max_prompt_length < 1):
            raise ValueError(f"max_prompt_length={max_prompt_length!r}: micro_group_size 'auto' prices the prompts' "
                             "KV from the longest training prompt, so it needs that length (an integer >= 1)")
        self.policy, self.tokenizer, self.sampling, self.reward_funcs = policy, tokenizer, sampling, list(reward_funcs)
        self.scale_rewards, self.on_reward_error = scale_rewards, on_reward_error
        self.accuracy_reward = correctness_reward(self.reward_funcs, accuracy_reward)
        self.dynamic_sampling, self.max_rollouts_per_step = dynamic_sampling, max_rollouts_per_step
        self.val_batch_size, self.val_max_new_tokens = val_batch_size, val_max_new_tokens or sampling.max_new_tokens
        self.val_num_samples, self.val_temperature = val_num_samples, val_temperature
        self.world_size, self.rank = world_size, check_int("rank", rank, 0)
        self.use_world(all_gather, precision_context, measured_update_peak)
        self.prompts_per_step, self.max_prompt_length = prompts_per_step, max_prompt_length
        self.over_provision, self.max_staleness = over_provision, max_staleness
        #: the most groups a rollout runs at once: a step's first one, with partial rollouts, runs carried and
        #: fresh groups up to ``ceil(over_provision x B)``
        self.groups_per_rollout = math.ceil(over_provision * prompts_per_step)
        self.weights = rollout_weights or RolloutWeights(policy)
        self._in_scope = False  # inside rollout_scope(): a nested one reuses it
        #: ``micro_group_size: auto`` resolved, once (a budget from free memory would differ at every reading).
        self.slot_budget: SlotBudget | None = None
        self._checkpoint_kv_budget: KVBudget | None = None  # the budget the checkpoint resumed from read
        #: ``keep_kv_cache: auto``'s last decision (on CUDA, once an update has been measured)
        self.cache_keeping: CacheKeeping | None = None
        #: the widest update measured: ``(row width, peak with nothing kept)``, and the last batch's, whose update
        #: runs next: ``(row width, bytes kept through it)``
        self._widest_update: tuple[int, int] | None = None
        self._pending_update: tuple[int, int] | None = None
        self.carried: list[GroupProgress] = []  # unfinished groups of the last step, continued by the next
        #: training groups no reward function raised on, over every rank, until the first (checkpointed)
        self._groups_scored = 0
        self._engine: RolloutEngine | None = None
        self._val_engine: RolloutEngine | None = None
        self._val_sampled_engine: RolloutEngine | None = None
        self._pending_engine_state: dict | None = None

    def use_world(self, all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  precision_context: Callable[[], Any] | None = None,
                  measured_update_peak: Callable[[], int | None] | None = None) -> None:
        """What the trainer running the rollouts lends them (another trainer of the same world may take over): a
        gather across ranks, its precision context, and the device's peak in its last update (None before one has
        run, or off CUDA)."""
        self.all_gather = all_gather
        self.precision_context = precision_context or contextlib.nullcontext
        self.measured_update_peak = measured_update_peak or (lambda: None)

    @property
    def partial_rollouts(self) -> bool:
        """Whether a step's first rollout is a partial one (``_partial_rollout``): ``over_provision > 1``, or groups
        carried in from a checkpoint wait to run first."""
        return self.over_provision > 1 or bool(self.carried)

    # ------------------------------------------------------------------------------------------ engines
    @property
    def resolved_micro_group_size(self) -> int | None:
        """g of the training engine: ``sampling.micro_group_size``, with ``"auto"`` resolved once from the KV budget
        (``slot_budget`` says how)."""
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
            with self.precision_context():
                dtype = kv_cache_dtype(self.weights.module)
            # "auto" compiles on CUDA only, where the rows are aligned anyway
            alignment = row_alignment(next(self.policy.parameters()).device, config.compile is True)
            with config_errors("data.sampling"):  # a budget too small for one slot: a setting, said as one
                slots = auto_micro_group_size(self.policy.config, dtype, budget.kv_budget_bytes,
                                              self.max_prompt_length, config.max_new_tokens, config.group_size,
                                              prompts, *parked, carried=self.partial_rollouts, alignment=alignment)
            self.slot_budget = SlotBudget(slots, budget)
        return self.slot_budget.slots

    def _kv_budget(self) -> KVBudget:
        """``sampling.kv_budget_bytes`` where set; else on CUDA the device's free memory less what the run will
        still allocate there beside the KV cache and ``DEVICE_MARGIN_FRACTION`` of its memory
        (``memory_budget.kv_budget_from_free_memory``). A resumed run takes the budget its checkpoint read, on a
        device of the same memory: its free memory now holds the restored optimizer state, which a new reading
        would set aside a second time. The slots are sized again from it, for the config of the resumed run.

        g is resolved before the first rollout, so before any optimizer step: AdamW's two moments are estimated
        (2 x ``runtime.memory.trainable_bytes``), as are the rollout weights' copy (cast or gathered, allocated
        when a rollout starts) and the margin, which covers a decode step's activations and logits. The update's
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

    def _measure_last_update(self) -> None:
        """Fold the update of the last batch into ``_widest_update``: its row width and its peak (the allocator's
        since its last reset: under ``PeakMemoryMonitor`` this update's own, else the run's so far, the rollout's
        included, which errs toward releasing) less what was kept through it."""
        peak, pending = self.measured_update_peak(), self._pending_update
        self._pending_update = None
        if peak is None or pending is None:
            return
        width, kept = pending
        widest = self._widest_update or (0, 0)
        self._widest_update = max(widest[0], width), max(widest[1], peak - kept)

    def _keep_through_update(self, engine: RolloutEngine, batch_width: int) -> bool:
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
        cache = engine.slot_cache_bytes()
        if self.max_prompt_length:
            with self.precision_context():  # the cache's dtype: the autocast one under mixed precision
                cache = max(cache, engine.widest_slot_cache_bytes(self.groups_per_rollout, self.max_prompt_length))
        width, peak = self._widest_update
        kept_bytes, margin = cache + self.weights.scope_bytes(), int(DEVICE_MARGIN_FRACTION * total)
        kept = batch_width <= width and kv_cache_fits_beside_update(peak, kept_bytes, total, margin)
        self.cache_keeping = CacheKeeping(kept, batch_width, width, peak, kept_bytes, total, margin)
        return kept

    @property
    def engine(self) -> RolloutEngine:
        """The training rollout engine (built on first use)."""
        if self._engine is None:
            self._engine = self._new_engine(self.sampling.replace(micro_group_size=self.resolved_micro_group_size,
                                                                  seed=rank_seed(self.sampling.seed, self.rank)))
            if self._pending_engine_state is not None:
                self._engine.load_state_dict(self._pending_engine_state)
                self._pending_engine_state = None
        return self._engine

    @property
    def val_engine(self) -> RolloutEngine:
        """Greedy, one completion per prompt, ``val_batch_size`` prompts at a time."""
        if self._val_engine is None:
            config = SamplingConfig(group_size=1, micro_group_size=self.val_batch_size, strategy="continuous",
                                    max_new_tokens=self.val_max_new_tokens, temperature=0.0,
                                    seed=self.sampling.seed, **self._step_options())
            self._val_engine = self._new_engine(config)
        return self._val_engine

    @property
    def val_sampled_engine(self) -> RolloutEngine:
        """``val_num_samples`` completions per held-out prompt at ``val_temperature`` (the training top_p /
        top_k / min_p), on ``val_batch_size`` continuous slots, with the validation seed."""
        if self._val_sampled_engine is None:
            config = SamplingConfig(group_size=self.val_num_samples, micro_group_size=self.val_batch_size,
                                    strategy="continuous", max_new_tokens=self.val_max_new_tokens,
                                    temperature=self.val_temperature, top_p=self.sampling.top_p,
                                    top_k=self.sampling.top_k, min_p=self.sampling.min_p,
                                    seed=self.sampling.seed + VAL_SEED_OFFSET,
                                    **self._step_options())
            self._val_sampled_engine = self._new_engine(config)
        return self._val_sampled_engine

    def _step_options(self) -> dict[str, Any]:
        """How the training engine runs its decode step (graphs, compiler, kernels): validation's engines run theirs
        the same way, whatever they sample."""
        return {key: getattr(self.sampling, key) for key in ("cuda_graph", "compile", "cpu_linear", "decode_attention")}

    def _new_engine(self, config: SamplingConfig) -> RolloutEngine:
        return RolloutEngine(self.weights.module, self.tokenizer, config)

    def state_dict(self) -> dict:
        """The training engine's state (rollout counter, the scheduler's state) and the carried groups, for exact
        resume (plain Python values: a checkpoint loads them without unpickling classes)."""
        state = self._engine.state_dict() if self._engine is not None else dict(self._pending_engine_state or {})
        state["carried"] = [_carried_state(group) for group in self.carried]
        state["groups_scored"] = self._groups_scored
        # before its first rollout sizes the slots, a resumed run saves again the budget it resumed from
        budget = self.slot_budget.budget if self.slot_budget is not None else self._checkpoint_kv_budget
        if budget is not None and budget.device_total_bytes is not None:
            state["kv_budget"] = asdict(replace(budget, restored=False))
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.carried = [_carried_group(entry) for entry in state.pop("carried", [])]
        self._groups_scored = int(state.pop("groups_scored", 1))  # a checkpoint without it: a run that trained
        budget = state.pop("kv_budget", None)
        if budget is not None:  # used where g is resolved from the device (_kv_budget)
            self._checkpoint_kv_budget = KVBudget(**budget)
        if not state:  # a state from before the engine was built: the next rollout builds it afresh
            self._engine, self._pending_engine_state = None, None
        elif self._engine is not None:
            self._engine.load_state_dict(state)
        else:
            self._pending_engine_state = state

    @contextlib.contextmanager
    def rollout_scope(self, keep: bool | None = None) -> Iterator[None]:
        """The rollout weights' scope (``rollout_weights``: under FSDP2 a gather, or lockstep, at its edges), once
        per training step's rollouts and per validation batch; a nested call reuses the outer one. ``keep``: the
        weights stay after it; by default where an engine holds its slot cache, whose graphs read them."""
        if self._in_scope:
            yield
            return
        if keep is None:
            keep = self.sampling.keep_kv_cache is True or self._training_cache_held()
        self._in_scope = True
        try:
            with self.weights.active(keep=keep):
                yield
        finally:
            self._in_scope = False

    def _training_cache_held(self) -> bool:
        return self._engine is not None and self._engine.slot_cache_bytes() > 0

    @contextlib.contextmanager
    def generation_mode(self) -> Iterator[torch.nn.Module]:
        """The module to generate with, inside ``rollout_scope()``, with no grad, in eval mode (restored
        afterwards) and the precision context. Reward functions run outside it."""
        with self.rollout_scope():
            was_training = self.policy.training
            self.policy.eval()
            try:
                with torch.no_grad(), self.precision_context():
                    yield self.weights.module
            finally:
                self.policy.train(was_training)

    def release(self) -> None:
        """Free every engine's slot cache and graphs, and the rollout weights' copy (the end of fit: the policy may
        move, and a kept graph would read where its weights were)."""
        for engine in (self._engine, self._val_engine, self._val_sampled_engine):
            if engine is not None:
                engine.release()
        self.weights.release()

    # ------------------------------------------------------------------------------------------ batches
    def build_train(self, draw: Callable[[int], list[Prompt]]) -> RolloutBatch:
        """One training step's batch of ``prompts_per_step`` groups; ``draw(count)`` gives the next prompts."""
        engine, num_prompts = self.engine, self.prompts_per_step
        self._measure_last_update()
        partial = self.partial_rollouts
        with self.rollout_scope(keep=self.sampling.keep_kv_cache is not False):  # "auto" decides below
            rounds = [self._partial_rollout(engine, draw) if partial else self._rollout(engine, draw(num_prompts))]
            keep = self._kept_groups(rounds)
            while self.dynamic_sampling and len(keep) < num_prompts and len(rounds) < self.max_rollouts_per_step:
                rounds.append(self._rollout(engine, draw(num_prompts - len(keep))))
                keep = self._kept_groups(rounds)
        chosen = keep[:num_prompts]
        if len(chosen) < num_prompts:  # fill with dropped groups (zero advantage) to keep B fixed
            dropped = [key for key in _all_groups(rounds) if key not in set(chosen)]
            chosen = chosen + dropped[: num_prompts - len(chosen)]
        batch = self._assemble(rounds, chosen, engine, train=True)
        width = batch.prompt_ids.shape[1] + batch.completion_ids.shape[1]
        kept = self._keep_through_update(engine, width)
        if not kept:  # the update needs that memory more
            engine.release()
            self.weights.release()  # no graph reads them any more
        self._pending_update = width, (engine.slot_cache_bytes() + self.weights.scope_bytes() if kept else 0)
        batch.metrics["rollout/rollouts_per_step"] = float(len(rounds))
        batch.offpolicy_tokens = sum(rounds[r].offpolicy_tokens[p] for r, p in chosen)  # the groups trained on
        if partial:
            batch.metrics["rollout/carried_samples"] = float(sum(not s.done for g in self.carried for s in g.samples))
            tokens = max(int(batch.completion_mask.sum()), 1)
            batch.metrics["rollout/offpolicy_tokens_frac"] = batch.offpolicy_tokens / tokens
        batch.metrics["reward/skipped_groups"] = float(sum(int(r.skipped.sum()) for r in rounds))
        self._check_some_group_scored(rounds)
        scored = [(r.components.get(self.accuracy_reward), r.rewards, ~r.skipped) for r in rounds]  # every group
        batch.generated_accuracy = sum(accuracy_sums(None if accuracy is None else accuracy[kept], rewards[kept])
                                       for accuracy, rewards, kept in scored)
        if engine.micro_group_size is not None:
            batch.metrics["rollout/slots"] = float(engine.micro_group_size)
        return batch

    def build_val(self, prompts: list[Prompt]) -> RolloutBatch | None:
        """Greedy completions (one per prompt) of held-out prompts, scored; with ``val_num_samples`` k > 1 also
        the correctness of k sampled completions each (``sampled_accuracy``, ``[b, k]``). No prompts: None, after
        the rollout scope's collectives (a rank short of held-out prompts still answers the others)."""
        engine = self.val_engine
        if self.sampling.keep_kv_cache is not True and self._training_cache_held():
            self._engine.release()  # its memory was priced against the update, not against validation
        with self.rollout_scope():
            if not prompts:
                return None
            part = self._rollout(engine, prompts)
            if self.sampling.keep_kv_cache is not True:  # validation's engines are kept only when asked
                engine.release()
            sampled = None
            if self.val_num_samples > 1:
                sampled_engine = self.val_sampled_engine
                sampled_engine.rollout_index = 0  # every validation draws from the same streams (docstring)
                sampled = self._rollout(sampled_engine, prompts, streams=[p.index for p in prompts])
                if self.sampling.keep_kv_cache is not True:
                    sampled_engine.release()
        batch = self._assemble([part], [(0, p) for p in range(len(prompts))], engine, train=False)
        if sampled is not None:
            batch.sampled_accuracy = sampled.components.get(self.accuracy_reward)
        return batch

    # ------------------------------------------------------------------------------------------ steps
    def _partial_rollout(self, engine: RolloutEngine, draw: Callable[[int], list[Prompt]]) -> _Round:
        """The carried groups first, then fresh ones up to ``ceil(over_provision x B)``; stops once B groups are
        complete and carries the others, one step staler."""
        B, carried = self.prompts_per_step, self.carried
        wanted, finish = plan_partial_rollout([g.tag.steps for g in carried], B, self.over_provision,
                                              self.max_staleness)
        fresh = draw(wanted) if wanted else []
        with self.generation_mode():
            groups = carried + engine.new_groups([p.ids for p in fresh], tags=[_Carry(p) for p in fresh])
            result = engine.generate_groups(groups, complete=B, finish=finish)
        self.carried = [replace(g, tag=replace(g.tag, steps=g.tag.steps + 1)) for g in result.carried]
        return self._score(engine, [tag.prompt for tag in result.tags], result)

    def _rollout(self, engine: RolloutEngine, prompts: list[Prompt], streams: list[int] | None = None) -> _Round:
        """Generate G completions per prompt (``streams``: their random streams' keys, ``RolloutEngine.generate``)
        and score them."""
        with self.generation_mode():
            result = engine.generate([p.ids for p in prompts], streams=streams)
        return self._score(engine, prompts, result)

    def _score(self, engine: RolloutEngine, prompts: list[Prompt], result) -> _Round:
        G = engine.group_size
        examples = [p.example for p in prompts]
        texts = [[self.tokenizer.decode(ids, skip_special_tokens=True) for ids in group]
                 for group in result.completion_ids]
        repeat = lambda per_prompt: [v for v in per_prompt for _ in range(G)]  # noqa: E731
        columns = {
            "answer": repeat([e.answer for e in examples]),
            "entry": repeat([e.entry for e in examples]),
            "completion_ids": [ids for group in result.completion_ids for ids in group],
            "completion_length": [len(ids) for group in result.completion_ids for ids in group],
            "truncated": [t for group in result.truncated for t in group],
            "max_new_tokens": [engine.max_new_tokens] * (len(examples) * G),
        }
        for key in sorted({k for e in examples for k in e.entry} - set(columns) - {"prompt", "question"}):
            columns[key] = repeat([e.entry.get(key) for e in examples])
        scores = score_rewards(self.reward_funcs, repeat([e.prompt for e in examples]),
                               [t for group in texts for t in group], columns, group_size=G,
                               on_error=self.on_reward_error)
        skipped = torch.zeros(len(examples), dtype=torch.bool)
        skipped[scores.skipped_groups] = True
        current = engine.rollout_index - 1  # the rollout just run
        offpolicy = [sum(v < current for sample in group for v in sample) for group in result.versions]
        return _Round(prompts=prompts, completion_ids=result.completion_ids, logprobs=result.logprobs,
                      truncated=result.truncated, texts=texts, rewards=scores.total.view(len(examples), G),
                      components={k: v.view(len(examples), G) for k, v in scores.components.items()},
                      skipped=skipped, stats=result.stats, offpolicy_tokens=offpolicy)

    def _check_some_group_scored(self, rounds: list[_Round]) -> None:
        """``on_reward_error: skip_group`` skips the groups a reward function raised on. Where it has raised on
        every group of the run so far, on every rank, the function is broken, not the rows: stop rather than train
        on nothing. Until a group is scored the ranks add up their counts (a collective each step), so all decide
        alike; the count is checkpointed, so a resumed run goes on skipping."""
        if self._groups_scored:
            return
        scored = torch.tensor(float(sum(int((~r.skipped).sum()) for r in rounds)))
        # "raise" skips no group, so every rank has scored some: only skip_group needs the ranks' sum
        if self.on_reward_error == "skip_group" and self.world_size > 1 and self.all_gather is not None:
            scored = self.all_gather(scored).sum()
        self._groups_scored = int(scored)
        if not self._groups_scored:
            raise RuntimeError("data.on_reward_error=skip_group: a reward function has raised on every group of "
                               "this run so far, so nothing would be trained (its errors are in the warnings "
                               "above): fix it, or set data.on_reward_error: raise to stop at its first error with "
                               "a traceback")

    def _kept_groups(self, rounds: list[_Round]) -> list[tuple[int, int]]:
        if not self.dynamic_sampling:
            return _all_groups(rounds)
        return [(r, p) for r, part in enumerate(rounds) for p in range(len(part.prompts))
                if not bool(zero_std_groups(part.rewards)[p]) and not bool(part.skipped[p])]

    def _assemble(self, rounds: list[_Round], chosen: list[tuple[int, int]], engine: RolloutEngine,
                  train: bool) -> RolloutBatch:
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        pick = lambda name: [getattr(rounds[r], name)[p] for r, p in chosen]  # noqa: E731
        B, G = len(chosen), engine.group_size
        rewards = torch.stack(pick("rewards"))
        components = {name: torch.stack([rounds[r].components[name][p] for r, p in chosen])
                      for name in rounds[0].components}
        flat_ids = [ids for group in pick("completion_ids") for ids in group]
        ids_tensor, mask = pad_right(flat_ids, pad, max((len(ids) for ids in flat_ids), default=1))
        logprobs, _ = pad_right([lp for group in pick("logprobs") for lp in group], 0.0, ids_tensor.shape[1],
                                dtype=torch.float32)
        prompts = pick("prompts")
        prompt_ids, prompt_mask = pad_left([p.ids for p in prompts], pad)
        all_rewards = torch.cat([part.rewards for part in rounds])
        skipped = torch.stack(pick("skipped"))
        return RolloutBatch(
            stats=merge_stats([part.stats for part in rounds]),
            prompts=[p.example.prompt for p in prompts],
            completions=pick("texts"),
            rewards=rewards,
            completion_lengths=mask.sum(dim=1).view(B, G),
            truncated=torch.tensor(pick("truncated"), dtype=torch.bool).view(B, G),
            advantages=self._advantages(rewards, skipped) if train else torch.zeros_like(rewards),
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=ids_tensor.view(B, G, -1),
            completion_mask=mask.view(B, G, -1),
            sampling_logprobs=logprobs.view(B, G, -1),
            reward_components=components,
            accuracy=components.get(self.accuracy_reward),
            columns={"answer": [p.example.answer for p in prompts], "entry": [p.example.entry for p in prompts]},
            indices=[p.index for p in prompts],
            max_new_tokens=engine.max_new_tokens,
            temperature=engine.temperature,
            pad_token_id=pad,
            num_groups_generated=all_rewards.shape[0],
            num_groups_zero_std=int(zero_std_groups(all_rewards).sum()) if G > 1 else all_rewards.shape[0],
            split="train" if train else "val",
            skipped=skipped,
        )

    def _advantages(self, rewards: torch.Tensor, skipped: torch.Tensor) -> torch.Tensor:
        """``[B, G]`` advantages; skipped groups get 0 and are left out of the batch statistics.

        ``scale_rewards="batch"`` over several ranks: the standard deviation spans every rank's kept rewards,
        gathered with ``all_gather`` (every rank has the same ``[B, G]`` shape), so all ranks scale alike.
        """
        advantages = torch.zeros_like(rewards, dtype=torch.float32)
        batch_rewards = None
        if self.scale_rewards == "batch" and self.world_size > 1:
            gathered = self.all_gather(rewards.float())                    # [W, B, G]
            kept = self.all_gather(skipped.logical_not())                  # [W, B]
            batch_rewards = gathered.reshape(-1, rewards.shape[1])[kept.reshape(-1).bool()].cpu()
        keep = ~skipped
        if bool(keep.any()):
            advantages[keep] = group_advantages(rewards[keep], self.scale_rewards, batch_rewards=batch_rewards)
        return advantages


def check_partial_rollouts(over_provision: float, max_staleness: int) -> None:
    """Raise naming the value unless ``over_provision >= 1`` (a number) and ``max_staleness >= 1`` (an int)."""
    if isinstance(over_provision, bool) or not isinstance(over_provision, (int, float)) or \
            not 1 <= over_provision < math.inf:
        raise ValueError(f"over_provision={over_provision!r} must be a finite number >= 1.0 (1.0: no partial "
                         "rollouts)")
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 1:
        raise ValueError(f"max_staleness={max_staleness!r} must be an integer >= 1 (steps a group may be carried)")


def _carried_state(group: GroupProgress) -> dict:
    prompt = group.tag.prompt
    return {"prompt": {"index": prompt.index, "ids": list(prompt.ids), "prompt": prompt.example.prompt,
                       "answer": prompt.example.answer, "entry": prompt.example.entry},
            "steps": group.tag.steps, "stream": list(group.stream), "forced_lengths": group.forced_lengths,
            "samples": [{"tokens": s.tokens, "logprobs": s.logprobs, "versions": s.versions, "done": s.done}
                        for s in group.samples]}


def _carried_group(state: dict) -> GroupProgress:
    p = state["prompt"]
    prompt = Prompt(p["index"], PromptExample(p["prompt"], p["answer"], p["entry"]), list(p["ids"]))
    samples = [SampleProgress(list(s["tokens"]), list(s["logprobs"]), list(s["versions"]), bool(s["done"]))
               for s in state["samples"]]
    return GroupProgress(prompt.ids, samples, tuple(state["stream"]), state["forced_lengths"],
                         _Carry(prompt, int(state["steps"])))


def _all_groups(rounds: list[_Round]) -> list[tuple[int, int]]:
    return [(r, p) for r, part in enumerate(rounds) for p in range(len(part.prompts))]

