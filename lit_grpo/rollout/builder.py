"""``RolloutBuilder``: prompts in, one scored ``RolloutBatch`` out (rollout, rewards, dynamic sampling, advantages).

The data flow of a training step, prompt -> builder -> batch -> module::

    RolloutDataModule   draws prompts (sampler / curriculum), owns the loaders and the stream position
      -> RolloutBuilder.build_train(draw)
           engine.generate_groups(groups)       the current policy, eval mode, no grad (lit_grpo.sampling);
                                                with over_provision > 1 it stops once B groups are complete and
                                                carries the others to the next step (partial rollouts)
           score_rewards(...)                   weighted reward functions (lit_grpo.rollout.rewards)
           [dynamic sampling: drop groups without learning signal (zero_std_groups), draw more, up to
            max_rollouts_per_step]
           group_advantages(rewards, scale)     (lit_grpo.rollout.advantages; "batch" spans every rank), or under
                                                normalize_then_sum normalize_then_sum_advantages (spans every rank)
      -> RolloutBatch                           (lit_grpo.batch)
      -> GRPOModule.training_step               the update

Everything the builder needs comes in as an argument, once: the policy and tokenizer (from the module that owns
them), the sampling config, the reward functions, its settings grouped by idea (``lit_grpo.rollout.config``:
advantages, scoring, training steps, validation) and the world (size, and how to gather across ranks). It knows
nothing about Lightning. The slot cache's memory decisions (``micro_group_size: auto``, ``keep_kv_cache: auto``)
are its ``SlotMemory``'s (lit_grpo.rollout.slot_memory).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from lit_grpo.rollout.advantages import (group_advantages, normalize_then_sum, normalize_then_sum_advantages,
                                         zero_std_groups)
from lit_grpo.batch import RolloutBatch, accuracy_sums, pad_left, pad_right, scored_rewards
from lit_grpo.rollout.config import AdvantageConfig, ScoringConfig, TrainingConfig, ValidationConfig
from lit_grpo.rollout.prompts import PromptExample, answer_text, check_as_text, check_messages
from lit_grpo.rollout.reward_log import RewardLogs, step_metrics as logged_metrics
from lit_grpo.rollout.rewards import (TrainerState, WeightedReward, check_prompt_form, correctness_reward, own_copy,
                                     reward_arguments, score_rewards)
from lit_grpo.rollout.slot_memory import KVBudget, SlotMemory, check_max_prompt_length, checked_kv_budget
from lit_grpo.rollout.tools import ToolBox, ToolRollout, check_without_partial_rollouts
from lit_grpo.runtime.distributed import RolloutWeights
from lit_grpo.runtime.models import eval_mode
from lit_grpo.runtime.stop_signal import STOP_SIGNAL
from lit_grpo.runtime.validation import (
    SEED_MAX,
    check_bool,
    check_int,
    check_int_in_range,
    check_state_keys,
    check_text,
    integer_within,
    real_within,
    shown_setting,
)
from lit_grpo.sampling import GroupProgress, RolloutEngine, SampleProgress, SamplingConfig
from lit_grpo.sampling.engine import check_engine_state
from lit_grpo.sampling.carry import plan_partial_rollout
from lit_grpo.sampling.random_streams import rank_seed
from lit_grpo.sampling.stats import merge_stats


#: Added to ``sampling.seed`` for sampled validation, so that its draws never repeat a training rollout's.
VAL_SEED_OFFSET = 1_000_003


def val_seed(seed: int) -> int:
    """Sampled validation's seed: ``seed + VAL_SEED_OFFSET``, wrapped into the seeds' range ``[0, SEED_MAX]`` (the
    random streams read 32 bits of it), so that a training seed near the top of the range is a valid one too."""
    return (seed + VAL_SEED_OFFSET) % (SEED_MAX + 1)


@dataclass(frozen=True)
class Prompt:
    """One prompt as the builder sees it: its index among the dataset's examples, the source example and its token
    ids."""

    index: int
    example: PromptExample
    ids: list[int]


@dataclass(frozen=True)
class _Carry:
    """What the builder attaches to a group it may carry: its prompt, and the steps it has been carried so far."""

    prompt: Prompt
    steps: int = 0


@dataclass
class _ScoredRollout:
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
    logs: RewardLogs                      # what the reward calls logged (log_metric, log_extra)
    tool_rollout: ToolRollout | None = None  # tool rounds (data.tools): tool_mask, calls, failures


class RolloutBuilder:
    """Turns prompts into ``RolloutBatch`` es with the current policy.

    Args:
        policy: the model being trained (``tokenizer``: its tokenizer).
        sampling: the training rollouts' settings; ``micro_group_size="auto"`` is resolved against
            ``max_prompt_length`` on first use.
        reward_funcs: weighted reward functions (``lit_grpo.rollout.rewards.build_reward_funcs``).
        advantage: how rewards become advantages (``scale_rewards``, ``multi_objective_aggregation``; the module's
            objective).
        scoring: the reward whose values are correctness (``RolloutBatch.accuracy``; resolved against
            ``reward_funcs`` by ``correctness_reward``) and what a raising reward function does.
        training: how a training step gathers its B groups: dynamic sampling, and partial rollouts
            (``over_provision``, ``max_staleness``; see ``TrainingConfig``).
        validation: greedy validation rollouts (one completion per prompt), ``val_batch_size`` prompts at a time;
            with ``val_num_samples`` k > 1 also k completions per held-out prompt at ``val_temperature``
            (``RolloutBatch.sampled_accuracy``, for mean@k and pass@k). Their random streams use their own seed
            (``val_seed``: ``sampling.seed + VAL_SEED_OFFSET``), keyed by the prompt's index in the dataset, and
            restart at every validation, so a prompt's k draws depend on the seed and that index only (not on the
            batch or the rank it falls in): the same policy gets the same draws in any run, a resumed one included,
            and the training engine's state is never touched.
        world_size: ranks; ``all_gather(tensor) -> [world_size, *tensor.shape]`` is needed when it is > 1 and
            the advantages' statistics span the batch (``scale_rewards="batch"`` or "normalize_then_sum").
        rank: this process's rank among them. The training engine's streams are keyed by the rollout and the
            group's place in it, the same on every rank, so each rank gets its own seed
            (``random_streams.rank_seed``): otherwise group p of every rank would draw the same numbers.
        all_gather: a gather across ranks, lent by the trainer (``use_world``; see ``world_size``).
        precision_context: a context manager factory the rollouts run in (the trainer's autocast), or None.
        measured_update_peak: the device's peak in the last update, read from its owner (``use_world``), for
            ``keep_kv_cache: auto`` (``slot_memory``).
        max_prompt_length: the longest training prompt, for ``micro_group_size="auto"``.
        rollout_weights: what the engines run on (default: ``policy`` itself); under FSDP2 the policy's gathered
            copy or its shards in lockstep (lit_grpo.runtime.distributed). A training step's rollouts (all of
            them, dynamic sampling's too) run in one ``active()`` scope, a validation batch's in one, and what
            gathers across ranks (the batch reward scale) runs after it: every rank enters and leaves the scope
            together whatever its rollouts' lengths.
        tools: EXPERIMENTAL tool calling (``lit_grpo.rollout.tools``): every rollout, validation's too, runs the
            tool calls that end a turn and decodes on; not with partial rollouts (over_provision > 1).
        conversational: the reward functions get TRL's conversational form (``reward_arguments``), in every
            rollout: the prompt set's form, ``prompts.is_conversational`` of all its rows, which must be True where
            any row is chat messages (a chat prompt given to a builder with False is refused before it is
            generated, ``rewards.check_prompt_form``).
    """

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, sampling: SamplingConfig,
                 reward_funcs: Sequence[WeightedReward], *, advantage: AdvantageConfig = AdvantageConfig(),
                 scoring: ScoringConfig = ScoringConfig(), training: TrainingConfig = TrainingConfig(),
                 validation: ValidationConfig = ValidationConfig(),
                 world_size: int = 1, rank: int = 0, all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 precision_context: Callable[[], Any] | None = None, max_prompt_length: int = 0,
                 rollout_weights: RolloutWeights | None = None,
                 measured_update_peak: Callable[[], int | None] | None = None, tools: ToolBox | None = None,
                 conversational: bool = False):
        # a world_size below 1 ran as one process, and a rank >= world_size seeds streams no rank of the world has
        world_size = check_int("world_size", world_size, 1)
        rank = check_int_in_range("rank", rank, 0, world_size - 1)
        if world_size > 1 and all_gather is None:
            if advantage.multi_objective_aggregation == "normalize_then_sum":
                raise ValueError(f"multi_objective_aggregation='normalize_then_sum' over world_size={world_size} "
                                 "ranks needs all_gather")
            if advantage.scale_rewards == "batch":
                raise ValueError(f"scale_rewards='batch' over world_size={world_size} ranks needs all_gather")
        if tools is not None:
            check_without_partial_rollouts(training.over_provision)
        self.tools = tools
        #: the reward functions' form, the prompt set's: one for the run, whatever rows a batch holds
        self.conversational = check_bool("conversational", conversational)
        check_max_prompt_length(sampling, max_prompt_length)
        self.policy, self.tokenizer, self.sampling, self.reward_funcs = policy, tokenizer, sampling, list(reward_funcs)
        self.advantage, self.training, self.validation = advantage, training, validation
        # the name resolved once against these reward functions (the first of accuracy and math where unnamed)
        self.scoring = replace(scoring, accuracy_reward=correctness_reward(self.reward_funcs, scoring.accuracy_reward))
        self.world_size, self.rank = world_size, rank
        self.use_world(all_gather, precision_context, measured_update_peak)
        self.weights = rollout_weights or RolloutWeights(policy)
        self._in_scope = False  # inside rollout_scope(): a nested one reuses it
        #: the slot cache's memory decisions: ``micro_group_size: auto`` and ``keep_kv_cache: auto``. A rollout
        #: runs at most ``training.groups_per_rollout`` groups at once: a step's first, with partial rollouts, runs
        #: carried and fresh groups up to that
        self.slot_memory = SlotMemory(policy, sampling, self.weights, groups_per_rollout=training.groups_per_rollout,
                                      max_prompt_length=max_prompt_length)
        self.carried: list[GroupProgress] = []  # unfinished groups of the last step, continued by the next
        #: training groups no reward function raised on, over every rank, until the first (checkpointed)
        self._groups_scored = 0
        self._engine: RolloutEngine | None = None
        self._val_engine: RolloutEngine | None = None
        self._val_sampled_engine: RolloutEngine | None = None
        self._pending_engine_state: dict | None = None
        #: The training progress the reward functions get (``trainer_state``); the data module lends its own.
        self.trainer_state: Callable[[], TrainerState] = TrainerState

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
        return self.training.partial or bool(self.carried)

    # ------------------------------------------------------------------------------------------ engines
    @property
    def resolved_micro_group_size(self) -> int | None:
        """g of the training engine: ``sampling.micro_group_size``, with ``"auto"`` resolved once by ``slot_memory``
        (its ``slot_budget`` says how); it prices the carried groups' KV and the rollouts' precision."""
        return self.slot_memory.micro_group_size(self.partial_rollouts, self.precision_context)

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
            config = SamplingConfig(group_size=1, micro_group_size=self.validation.val_batch_size,
                                    strategy="continuous", max_new_tokens=self._val_max_new_tokens, temperature=0.0,
                                    stop_strings=self.sampling.stop_strings, seed=self.sampling.seed,
                                    **self._step_options())
            self._val_engine = self._new_engine(config)
        return self._val_engine

    @property
    def val_sampled_engine(self) -> RolloutEngine:
        """``val_num_samples`` completions per held-out prompt at ``val_temperature`` (the training top_p /
        top_k / min_p / repetition_penalty), on ``val_batch_size`` continuous slots, with the validation seed."""
        if self._val_sampled_engine is None:
            validation = self.validation
            config = SamplingConfig(group_size=validation.val_num_samples, micro_group_size=validation.val_batch_size,
                                    strategy="continuous", max_new_tokens=self._val_max_new_tokens,
                                    temperature=validation.val_temperature, top_p=self.sampling.top_p,
                                    top_k=self.sampling.top_k, min_p=self.sampling.min_p,
                                    repetition_penalty=self.sampling.repetition_penalty,
                                    stop_strings=self.sampling.stop_strings, seed=val_seed(self.sampling.seed),
                                    **self._step_options())
            self._val_sampled_engine = self._new_engine(config)
        return self._val_sampled_engine

    @property
    def _val_max_new_tokens(self) -> int:
        """Validation's length cap (``ValidationConfig.length_cap``)."""
        return self.validation.length_cap(self.sampling.max_new_tokens)

    def _step_options(self) -> dict[str, Any]:
        """How the training engine runs its decode step (graphs, compiler, kernels): validation's engines run theirs
        the same way, whatever they sample."""
        return {key: getattr(self.sampling, key) for key in ("cuda_graph", "compile", "cpu_linear", "decode_attention")}

    def _new_engine(self, config: SamplingConfig) -> RolloutEngine:
        """An engine on the rollout weights; with tools it also stops a sample at the template's end of turn
        (``ToolBox.stop_token_ids``), checked with the EOS ids on every strategy's path."""
        model = self.weights.module
        stops = None if self.tools is None else self.tools.stop_token_ids(model)
        return RolloutEngine(model, self.tokenizer, config, eos_token_ids=stops)

    def state_dict(self) -> dict:
        """The training engine's state (rollout counter, the scheduler's state) and the carried groups, for exact
        resume (plain Python values: a checkpoint loads them without unpickling classes)."""
        state = self._engine.state_dict() if self._engine is not None else dict(self._pending_engine_state or {})
        state["carried"] = [_carried_state(group) for group in self.carried]
        state["groups_scored"] = self._groups_scored
        state.update(self.slot_memory.state_dict())
        return state

    def load_state_dict(self, state: dict, examples: Sequence[PromptExample] | None = None) -> None:
        """Take back ``state_dict``'s state, checked whole before any of it is taken (``checked_builder_state``; the
        engine's state by the engine, or where it is not built yet on a scratch scheduler of the strategy:
        ``check_engine_state``), so that a corrupt or foreign one, refused naming the bad key or value, leaves the
        builder as it was. ``examples``: the prompt set the carried groups' indices point into (``Prompt.index``); a
        carried group whose prompt is the one there gets its gold answer from it, as the row holds it
        (``_source_answer``)."""
        checked = checked_builder_state(state, examples, self.sampling, self.tools is not None)
        # the engine's part is taken last: only the engine's own checks may fail after this
        if not checked.engine:  # a state from before the engine was built: the next rollout builds it afresh
            self._engine, self._pending_engine_state = None, None
        elif self._engine is not None:
            self._engine.load_state_dict(checked.engine)  # checked whole before it takes any of it
        else:
            check_engine_state(checked.engine, self.sampling)
            self._pending_engine_state = checked.engine
        self.carried, self._groups_scored = checked.carried, checked.groups_scored
        self.slot_memory.resume_kv_budget(checked.kv_budget)

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
        """The module to generate with, inside ``rollout_scope()``, with no grad, in eval mode (each module's mode
        restored afterwards) and the precision context. Reward functions run outside it."""
        # each module back in its own mode: policy.train(True) would turn on a part its owner keeps in eval
        with self.rollout_scope(), eval_mode(self.policy), torch.no_grad(), self.precision_context():
            yield self.weights.module

    def release(self) -> None:
        """Free every engine's slot cache and graphs, and the rollout weights' copy (the end of fit: the policy may
        move, and a kept graph would read where its weights were)."""
        for engine in (self._engine, self._val_engine, self._val_sampled_engine):
            if engine is not None:
                engine.release()
        self.weights.release()

    # ------------------------------------------------------------------------------------------ batches
    def build_train(self, draw: Callable[[int], list[Prompt]]) -> RolloutBatch:
        """One training step's batch of ``prompts_per_step`` groups; ``draw(count)`` gives the next prompts.

        Roll out (a partial rollout where one is on, then dynamic sampling's extra rounds while groups with learning
        signal are short), choose B groups, assemble them, decide whether the slot cache stays through the update,
        and add the step's metrics. Under several ranks a stop abandons the rollouts where they are, on each rank it
        reaches (from its own signal, or another rank's relayed), and every rank raises it once the ranks have met
        after them (``_abandonable_rollouts``)."""
        engine, step = self.engine, self.training
        num_prompts = step.prompts_per_step
        self.slot_memory.measure_last_update(self.measured_update_peak())
        partial = self.partial_rollouts
        with self.rollout_scope(keep=self.sampling.keep_kv_cache is not False), self._abandonable_rollouts():
            rollouts = [self._partial_rollout(engine, draw) if partial else self._rollout(engine, draw(num_prompts))]
            kept = self._kept_groups(rollouts)
            while step.dynamic_sampling and len(kept) < num_prompts and len(rollouts) < step.max_rollouts_per_step:
                rollouts.append(self._rollout(engine, draw(num_prompts - len(kept))))
                kept = self._kept_groups(rollouts)
        chosen = _fill_groups(kept, _all_groups(rollouts), num_prompts)
        batch = self._assemble(rollouts, chosen, engine, train=True)
        self._settle_slot_cache(engine, batch)
        batch.offpolicy_tokens = sum(rollouts[r].offpolicy_tokens[p] for r, p in chosen)  # the groups trained on
        batch.metrics.update(self._train_metrics(rollouts, batch, engine, partial))
        self._check_some_group_scored(rollouts)
        batch.generated_accuracy = self._generated_accuracy(rollouts)
        return batch

    def _abandonable_rollouts(self) -> contextlib.AbstractContextManager:
        """Under several ranks, a training step's rollouts as code a stop may abandon on each rank alone, the ranks
        meeting after them in one gather of a flag (``StopSignal.abandonable_together``): the first collective of
        the step after its rollouts, on every rank. Not where the rollout weights run collectives inside their
        scope (FSDP2's lockstep: every forward), nor without a gather; one process: its caller's
        (``RolloutDataModule``) abandons the whole build."""
        if self.world_size == 1 or self.all_gather is None or not self.weights.decodes_alone:
            return contextlib.nullcontext()
        return STOP_SIGNAL.abandonable_together(self._any_rank)

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a collective: every rank calls it)."""
        return bool(self.all_gather(torch.tensor([float(flag)])).max() > 0)

    def _settle_slot_cache(self, engine: RolloutEngine, batch: RolloutBatch) -> None:
        """Keep the training engine's slot cache (and the rollout weights' copy) through the coming update, or free
        them where the update needs that memory more (``SlotMemory.keep_through_update``)."""
        width = batch.prompt_ids.shape[1] + batch.completion_ids.shape[1]
        cache_kept = self.slot_memory.keep_through_update(engine, width, self.precision_context)
        if not cache_kept:
            engine.release()
            self.weights.release()  # no graph reads them any more
        self.slot_memory.expect_update(engine, width, cache_kept)

    def _train_metrics(self, rollouts: list[_ScoredRollout], batch: RolloutBatch, engine: RolloutEngine,
                       partial: bool) -> dict[str, float]:
        """The training step's own metrics (``rollout/*`` of the builder, ``tools/*``, ``reward/skipped_groups``
        and what the reward calls logged); it reads ``batch.offpolicy_tokens``, set before."""
        metrics = {"rollout/rollouts_per_step": float(len(rollouts))}
        if partial:
            metrics["rollout/carried_samples"] = float(sum(not s.done for g in self.carried for s in g.samples))
            tokens = max(int(batch.drawn_mask().sum()), 1)
            metrics["rollout/offpolicy_tokens_frac"] = batch.offpolicy_tokens / tokens
        if self.tools is not None:
            metrics.update(tool_metrics(rollouts, engine.group_size))
        metrics["reward/skipped_groups"] = float(sum(int(rollout.skipped.sum()) for rollout in rollouts))
        metrics.update(logged_metrics([rollout.logs for rollout in rollouts]))
        if engine.micro_group_size is not None:
            metrics["rollout/slots"] = float(engine.micro_group_size)
        return metrics

    def _generated_accuracy(self, rollouts: list[_ScoredRollout]) -> torch.Tensor:
        """``[4]`` ``accuracy_sums`` over every group the step generated, the dropped ones too; unscored completions
        and skipped groups left out (zeros where there is none)."""
        total = torch.zeros(4, dtype=torch.float64)
        for rollout in rollouts:
            accuracy = rollout.components.get(self.scoring.accuracy_reward)
            scored = ~rollout.skipped
            rewards = self._scored(rollout.rewards, rollout.components)
            total = total + accuracy_sums(None if accuracy is None else accuracy[scored], rewards[scored])
        return total

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
            greedy = self._rollout(engine, prompts)
            if self.sampling.keep_kv_cache is not True:  # validation's engines are kept only when asked
                engine.release()
            sampled = None
            if self.validation.val_num_samples > 1:
                sampled_engine = self.val_sampled_engine
                sampled_engine.rollout_index = 0  # every validation draws from the same streams (docstring)
                sampled = self._rollout(sampled_engine, prompts, streams=[p.index for p in prompts])
                if self.sampling.keep_kv_cache is not True:
                    sampled_engine.release()
        batch = self._assemble([greedy], [(0, p) for p in range(len(prompts))], engine, train=False)
        if sampled is not None:
            batch.sampled_accuracy = sampled.components.get(self.scoring.accuracy_reward)
        # what the reward calls of this batch logged, the greedy's and the sampled's apart (GRPOModule's
        # val/reward/<name> and val/reward_at_k/<name>, as val/reward and val/mean_at_k are)
        batch.metrics.update(logged_metrics([greedy.logs]))
        if sampled is not None:
            batch.metrics.update(logged_metrics([sampled.logs], prefix="reward_at_k"))
        return batch

    # ------------------------------------------------------------------------------------------ steps
    def _partial_rollout(self, engine: RolloutEngine, draw: Callable[[int], list[Prompt]]) -> _ScoredRollout:
        """The carried groups first, then fresh ones up to ``ceil(over_provision x B)``; stops once B groups are
        complete and carries the others, one step staler."""
        B, carried, step = self.training.prompts_per_step, self.carried, self.training
        since = engine.rollout_index
        wanted, finish = plan_partial_rollout([g.tag.steps for g in carried], B, step.over_provision,
                                              step.max_staleness)
        fresh = draw(wanted) if wanted else []
        # a checkpoint's carried prompts too: the form is checked before any completion costs anything (_rollout)
        check_prompt_form([g.tag.prompt.example for g in carried] + [p.example for p in fresh], self.conversational)
        with self.generation_mode():
            # carried groups may fill the rollout alone (a checkpoint of a run with more over-provision or more
            # groups per step): no fresh group then, and new_groups refuses an empty list
            fresh_groups = engine.new_groups([p.ids for p in fresh], tags=[_Carry(p) for p in fresh]) if fresh else []
            groups = carried + fresh_groups
            result = engine.generate_groups(groups, complete=B, finish=finish)
        self.carried = [replace(g, tag=replace(g.tag, steps=g.tag.steps + 1)) for g in result.carried]
        return self._score(engine, [tag.prompt for tag in result.tags], result, since)

    def _rollout(self, engine: RolloutEngine, prompts: list[Prompt],
                 streams: list[int] | None = None) -> _ScoredRollout:
        """Generate G completions per prompt (``streams``: their random streams' keys, ``RolloutEngine.generate``)
        and score them."""
        since, tool_rollout = engine.rollout_index, None
        # the form the reward functions get, checked before the completions cost anything (RolloutBuilder made
        # directly, with another form than its prompts')
        check_prompt_form([p.example for p in prompts], self.conversational)
        with self.generation_mode():
            if self.tools is None:
                result = engine.generate([p.ids for p in prompts], streams=streams)
            else:  # generate's groups, kept: their samples that call a tool decode on in them
                groups = engine.new_groups([p.ids for p in prompts], streams=streams)
                result = engine.generate_groups(groups)
                tool_rollout = self.tools.run_rounds(engine, groups, result, [p.example for p in prompts])
                result = replace(result, completion_ids=tool_rollout.completion_ids, logprobs=tool_rollout.logprobs,
                                 truncated=tool_rollout.truncated, versions=tool_rollout.versions,
                                 stats=merge_stats(tool_rollout.stats, same_samples=True))
        return self._score(engine, prompts, result, since, tool_rollout)

    def _score(self, engine: RolloutEngine, prompts: list[Prompt], result, since: int,
               tool_rollout: ToolRollout | None = None) -> _ScoredRollout:
        """Score ``result``, a rollout whose first engine call had index ``since`` (tokens of earlier ones are
        off-policy; tool rounds run further calls under the same weights)."""
        G = engine.group_size
        examples = [p.example for p in prompts]
        texts = [[self.tokenizer.decode(ids, skip_special_tokens=True) for ids in group]
                 for group in result.completion_ids]
        columns = _reward_columns(examples, result, G, engine.max_new_tokens)
        conversations = None if tool_rollout is None else tool_rollout.messages
        reward_prompts, reward_completions = reward_arguments(examples, texts, conversations,
                                                              conversational=self.conversational)
        scores = score_rewards(self.reward_funcs, reward_prompts, reward_completions, columns, group_size=G,
                               on_error=self.scoring.on_reward_error, trainer_state=self.trainer_state())
        skipped = torch.zeros(len(examples), dtype=torch.bool)
        skipped[scores.skipped_groups] = True
        offpolicy = [sum(v < since for sample in group for v in sample) for group in result.versions]
        return _ScoredRollout(prompts=prompts, completion_ids=result.completion_ids, logprobs=result.logprobs,
                              truncated=result.truncated, texts=texts, rewards=scores.total.view(len(examples), G),
                              components={k: v.view(len(examples), G) for k, v in scores.components.items()},
                              skipped=skipped, stats=result.stats, offpolicy_tokens=offpolicy, logs=scores.logs,
                              tool_rollout=tool_rollout)

    def _check_some_group_scored(self, rollouts: list[_ScoredRollout]) -> None:
        """``on_reward_error: skip_group`` skips the groups a reward function raised on. Where it has raised on
        every group of the run so far, on every rank, the function is broken, not the rows: stop rather than train
        on nothing. Until a group is scored the ranks add up their counts (a collective each step), so all decide
        alike; the count is checkpointed, so a resumed run goes on skipping."""
        if self._groups_scored:
            return
        scored = torch.tensor(float(sum(int((~rollout.skipped).sum()) for rollout in rollouts)))
        # "raise" skips no group, so every rank has scored some: only skip_group needs the ranks' sum
        if self.scoring.on_reward_error == "skip_group" and self.world_size > 1 and self.all_gather is not None:
            scored = self.all_gather(scored).sum()
        self._groups_scored = int(scored)
        if not self._groups_scored:
            raise RuntimeError("data.on_reward_error=skip_group: a reward function has raised on every group of "
                               "this run so far, so nothing would be trained (its errors are in the warnings "
                               "above): fix it, or set data.on_reward_error: raise to stop at its first error with "
                               "a traceback")

    def _kept_groups(self, rollouts: list[_ScoredRollout]) -> list[tuple[int, int]]:
        if not self.training.dynamic_sampling:
            return _all_groups(rollouts)
        signal = [~(self._zero_std(rollout.rewards, rollout.components) | rollout.skipped) for rollout in rollouts]
        return [(r, p) for r, kept in enumerate(signal) for p in range(len(kept)) if bool(kept[p])]

    def _zero_std(self, rewards: torch.Tensor, components: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[b]`` bool: the groups without learning signal under ``multi_objective_aggregation`` (``[b, G]``
        totals, ``{name: [b, G]}`` each function's values)."""
        if self.advantage.multi_objective_aggregation == "normalize_then_sum":
            return zero_std_groups(self._stacked(components)[0])
        return zero_std_groups(self._scored(rewards, components))

    def _scored(self, rewards: torch.Tensor, components: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[b, G]`` the totals with NaN where every reward function returned None: such a completion is left out
        of its group's statistics (its total of 0.0 is no reward it earned) and gets advantage 0."""
        return scored_rewards(rewards, {reward.name: components[reward.name] for reward in self.reward_funcs})

    def _stacked(self, components: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[b, G, K]`` the reward functions' values in their order, and their ``[K]`` weights."""
        values = torch.stack([components[reward.name] for reward in self.reward_funcs], dim=-1)
        return values, torch.tensor([reward.weight for reward in self.reward_funcs], dtype=torch.float32)

    def _assemble(self, rollouts: list[_ScoredRollout], chosen: list[tuple[int, int]], engine: RolloutEngine,
                  train: bool) -> RolloutBatch:
        """The batch of the ``chosen`` ``(rollout, group)`` groups of ``rollouts``, B of them in this order, padded
        into tensors; advantages for training (zeros for validation). The step's counts (``num_groups_generated``,
        ``num_groups_zero_std``, ``stats``) cover every group generated, chosen or not."""
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        pick = lambda name: [getattr(rollouts[r], name)[p] for r, p in chosen]  # noqa: E731
        B, G = len(chosen), engine.group_size
        rewards = torch.stack(pick("rewards"))
        components = {name: torch.stack([rollouts[r].components[name][p] for r, p in chosen])
                      for name in rollouts[0].components}
        ids, mask, logprobs, tool_mask = self._padded_completions(rollouts, chosen, pad, B, G)
        drawn = mask if tool_mask is None else mask * tool_mask
        prompts = pick("prompts")
        prompt_ids, prompt_mask = pad_left([p.ids for p in prompts], pad)
        zero_std = torch.cat([self._zero_std(rollout.rewards, rollout.components) for rollout in rollouts])
        skipped = torch.stack(pick("skipped"))
        extras = {column: [rollouts[r].logs.group_extra(column, p, G) for r, p in chosen]
                  for column in dict.fromkeys(c for rollout in rollouts for c in rollout.logs.extras)}
        return RolloutBatch(
            stats=merge_stats([rollout.stats for rollout in rollouts]),
            prompts=[p.example.prompt for p in prompts],
            completions=pick("texts"),
            rewards=rewards,
            completion_lengths=drawn.sum(dim=2),
            truncated=torch.tensor(pick("truncated"), dtype=torch.bool).view(B, G),
            advantages=self._advantages(rewards, components, skipped) if train else torch.zeros_like(rewards),
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=ids,
            completion_mask=mask,
            sampling_logprobs=logprobs,
            reward_components=components,
            reward_extras=extras,
            accuracy=components.get(self.scoring.accuracy_reward),
            columns={"answer": [p.example.answer for p in prompts], "entry": [p.example.entry for p in prompts]},
            indices=[p.index for p in prompts],
            max_new_tokens=engine.max_new_tokens,
            temperature=engine.temperature,
            pad_token_id=pad,
            num_groups_generated=zero_std.shape[0],
            num_groups_zero_std=int(zero_std.sum()) if G > 1 else zero_std.shape[0],
            split="train" if train else "val",
            skipped=skipped,
            tool_mask=tool_mask,
        )

    def _padded_completions(self, rollouts: list[_ScoredRollout], chosen: list[tuple[int, int]], pad: int, B: int,
                            G: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The ``chosen`` groups' completions right-padded to the longest: ``[B, G, T]`` token ids (``pad``), mask,
        float32 sampling log-probs (0.0) and, with tools, the tool mask (1 on drawn tokens)."""
        flat_ids = [ids for r, p in chosen for ids in rollouts[r].completion_ids[p]]
        ids, mask = pad_right(flat_ids, pad, max((len(ids) for ids in flat_ids), default=1))
        logprobs, _ = pad_right([lp for r, p in chosen for lp in rollouts[r].logprobs[p]], 0.0, ids.shape[1],
                                dtype=torch.float32)
        tool_mask = None
        if self.tools is not None:  # padded with 1 as TRL's: completion_mask leaves the padding out
            tool_masks = [m for r, p in chosen for m in rollouts[r].tool_rollout.tool_mask[p]]
            tool_mask, _ = pad_right(tool_masks, 1, ids.shape[1])
            tool_mask = tool_mask.view(B, G, -1)
        return ids.view(B, G, -1), mask.view(B, G, -1), logprobs.view(B, G, -1), tool_mask

    def _advantages(self, rewards: torch.Tensor, components: dict[str, torch.Tensor],
                    skipped: torch.Tensor) -> torch.Tensor:
        """``[B, G]`` advantages from the ``[B, G]`` totals or the ``{name: [B, G]}`` functions' values; skipped
        groups get 0 and are left out of the batch statistics.

        ``scale_rewards="batch"`` over several ranks: the standard deviation spans every rank's kept rewards,
        gathered with ``all_gather`` (every rank has the same ``[B, G]`` shape), so all ranks scale alike; under
        "normalize_then_sum" the mean and standard deviation of the summed normalized rewards span them alike.
        """
        if self.advantage.multi_objective_aggregation == "normalize_then_sum":
            return self._normalize_then_sum_advantages(components, skipped)
        advantages = torch.zeros_like(rewards, dtype=torch.float32)
        rewards = self._scored(rewards, components)
        batch_rewards = None
        scale = self.advantage.scale_rewards
        if scale == "batch" and self.world_size > 1:
            gathered = self.all_gather(rewards)                            # [W, B, G]
            kept = self.all_gather(skipped.logical_not())                  # [W, B]
            batch_rewards = gathered.reshape(-1, rewards.shape[1])[kept.reshape(-1).bool()].cpu()
        keep = ~skipped
        if bool(keep.any()):
            advantages[keep] = group_advantages(rewards[keep], scale, batch_rewards=batch_rewards)
        return advantages

    def _normalize_then_sum_advantages(self, components: dict[str, torch.Tensor],
                                       skipped: torch.Tensor) -> torch.Tensor:
        """``_advantages`` under "normalize_then_sum": each group's functions normalized on its own rank, their
        weighted sums normalized over every rank's kept groups."""
        values, weights = self._stacked(components)                        # [B, G, K], [K]
        advantages = torch.zeros(values.shape[:2], dtype=torch.float32)
        keep = ~skipped
        batch_sums = None
        if self.world_size > 1:  # every rank gathers, kept groups or not; NaN (a skipped group) is left out
            sums = normalize_then_sum(values, weights).masked_fill(skipped[:, None], float("nan"))
            batch_sums = self.all_gather(sums).reshape(-1, values.shape[1]).cpu()
        if bool(keep.any()):
            advantages[keep] = normalize_then_sum_advantages(values[keep], weights, batch_sums=batch_sums).float()
        return advantages


def tool_metrics(rollouts: list[_ScoredRollout], group_size: int) -> dict[str, float]:
    """``tools/call_frequency`` (tool calls per completion generated this step) and ``tools/failure_frequency``
    (failed calls per call, 0.0 without calls), TRL's; with the calls as the latter's weight over ranks (the
    former's is the groups generated, ``weight/groups_generated``: the ranks' counts differ with dynamic sampling)."""
    calls = sum(rollout.tool_rollout.calls for rollout in rollouts)
    failures = sum(rollout.tool_rollout.failures for rollout in rollouts)
    completions = sum(len(rollout.prompts) for rollout in rollouts) * group_size
    return {"tools/call_frequency": calls / max(completions, 1),
            "tools/failure_frequency": failures / calls if calls else 0.0, "weight/tool_calls": float(calls)}


def _reward_columns(examples: Sequence[PromptExample], result: Any, group_size: int,
                    max_new_tokens: int) -> dict[str, list[Any]]:
    """The per-completion columns the reward functions get (``lit_grpo.rollout.rewards``), ``N = b x G`` entries
    each, from ``b`` prompt ``examples`` and the rollout's ``result`` (``[b][G]`` completions)."""
    # each completion gets copies of its own, as TRL's rows are: a reward function that changes one changes
    # neither the prompt set, the rollout's tokens, nor another completion's. Copied as each function's
    # arguments are (own_copy: plain data rebuilt, what deepcopy refuses passed as it is)
    def repeat(per_prompt: list[Any]) -> list[Any]:
        return [own_copy(value) for value in per_prompt for _ in range(group_size)]

    columns = {
        "answer": repeat([e.answer for e in examples]),
        "entry": repeat([e.entry for e in examples]),
        "completion_ids": [list(ids) for group in result.completion_ids for ids in group],
        "completion_length": [len(ids) for group in result.completion_ids for ids in group],
        "truncated": [t for group in result.truncated for t in group],
        "max_new_tokens": [max_new_tokens] * (len(examples) * group_size),
    }
    # every field of the row but "prompt", whose value the prompts argument holds (TRL drops it alike)
    for key in sorted({k for e in examples for k in e.entry} - set(columns) - {"prompt"}):
        columns[key] = repeat([e.entry.get(key) for e in examples])
    return columns


def _carried_state(group: GroupProgress) -> dict:
    prompt = group.tag.prompt
    # the messages too: a chat prompt's reward calls get them (reward_arguments), after a resume as before
    return {"prompt": {"index": prompt.index, "ids": list(prompt.ids), "prompt": prompt.example.prompt,
                       "answer": prompt.example.answer, "entry": prompt.example.entry,
                       "messages": prompt.example.messages},
            "steps": group.tag.steps, "stream": list(group.stream), "forced_lengths": group.forced_lengths,
            "samples": [{"tokens": s.tokens, "logprobs": s.logprobs, "versions": s.versions, "done": s.done}
                        for s in group.samples]}


#: The keys of a rollout builder's state: the engine's, the carried groups, the count of groups scored and the KV
#: budget read from the device; each may be absent (a state from before the engine was built is empty).
_STATE_KEYS = ("rollout_index", "scheduler", "carried", "groups_scored", "kv_budget")


class CheckedBuilderState(NamedTuple):
    """A rollout builder's state (``RolloutBuilder.state_dict``'s) checked by ``checked_builder_state``, as the
    builder takes it: the engine's part still the engine's to check."""

    carried: list[GroupProgress]
    groups_scored: int
    kv_budget: KVBudget | None
    engine: dict  # empty: a state from before the engine was built


def checked_builder_state(state: Any, examples: Sequence[PromptExample] | None, sampling: SamplingConfig,
                          tool_calling: bool) -> CheckedBuilderState:
    """``state`` checked for a builder of ``sampling``, calling tools or not (``tool_calling``; ``examples``: the
    prompt set its carried groups point into), the engine's part apart, else a ValueError naming the bad key or
    value."""
    check_state_keys("a rollout builder state", state, _STATE_KEYS, optional=_STATE_KEYS)
    state = dict(state)
    carried = state.pop("carried", [])
    if not isinstance(carried, (list, tuple)):
        raise ValueError(f"{shown_setting('builder state carried', carried, 80)} must be a list of carried groups")
    if carried and tool_calling:  # they would finish without tool rounds, in a rollout of their own
        raise ValueError(f"the checkpoint carries {len(carried)} unfinished group(s) of partial rollouts "
                         "(over_provision > 1), and tool calling (data.tools) does not run with partial "
                         "rollouts: resume it without data.tools, or start from a checkpoint that carries none")
    groups = [_carried_group(entry, examples, f"builder state carried[{index}]", sampling.group_size)
              for index, entry in enumerate(carried)]
    # a checkpoint without it: a run that trained
    groups_scored = check_int("builder state groups_scored", state.pop("groups_scored", 1), 0)
    budget = checked_kv_budget(state.pop("kv_budget", None))
    return CheckedBuilderState(groups, groups_scored, budget, state)


def check_builder_state(state: Any, examples: Sequence[PromptExample] | None, sampling: SamplingConfig,
                        tool_calling: bool) -> None:
    """Refuse ``state`` as ``RolloutBuilder.load_state_dict`` of a builder not built yet would, without one: for
    the data module, which keeps a state until it builds its builder, checked now and not at the first rollout
    (``tool_calling``: whether that builder will call tools, known from the settings before their tokenizer)."""
    engine = checked_builder_state(state, examples, sampling, tool_calling).engine
    if engine:
        check_engine_state(engine, sampling)


def _carried_group(state: Any, examples: Sequence[PromptExample] | None = None, name: str = "carried group",
                   group_size: int | None = None) -> GroupProgress:
    """A carried group from ``_carried_state``'s ``state`` (``name``: where it is in the checkpoint's state), checked
    before any of it is used, else a ValueError naming the bad key or value; ``examples``: the prompt set its index
    points into; ``group_size``: the samples it must hold (None: any number)."""
    check_state_keys(name, state, ("prompt", "steps", "stream", "forced_lengths", "samples"))
    p = state["prompt"]
    check_state_keys(f"{name}.prompt", p, ("index", "ids", "prompt", "answer", "entry", "messages"), ("messages",))
    index = check_int(f"{name}.prompt.index", p["index"], 0)
    ids = _token_ids(f"{name}.prompt.ids", p["ids"], "a non-empty list of token ids (integers >= 0)", empty=False)
    stream = _token_ids(f"{name}.stream", state["stream"], "(rollout index, prompt index), two integers >= 0")
    if len(stream) != 2:
        raise ValueError(f"{shown_setting(f'{name}.stream', state['stream'], 80)} is not allowed; it must be "
                         "(rollout index, prompt index), two integers >= 0")
    samples = state["samples"]
    if not isinstance(samples, (list, tuple)):
        raise ValueError(f"{shown_setting(f'{name}.samples', samples, 80)} must be a list of the group's samples")
    if group_size is not None and len(samples) != group_size:
        raise ValueError(f"{name}.samples holds {len(samples)} samples; a group of this run holds "
                         f"group_size={group_size}")
    forced, allowed = state["forced_lengths"], f"None or {len(samples)} lengths, one per sample (integers >= 0)"
    if forced is not None:
        forced = _token_ids(f"{name}.forced_lengths", forced, allowed)
        if len(forced) != len(samples):
            raise ValueError(f"{shown_setting(f'{name}.forced_lengths', forced, 80)} is not allowed; it must be "
                             f"{allowed}")
    example = _carried_example(f"{name}.prompt", p)
    example = replace(example, answer=_source_answer(example, index, examples))
    prompt = Prompt(index, example, ids)
    progress = [_carried_sample(f"{name}.samples[{k}]", sample) for k, sample in enumerate(samples)]
    return GroupProgress(prompt.ids, progress, tuple(stream), forced,
                         _Carry(prompt, check_int(f"{name}.steps", state["steps"], 0)))


def _carried_example(name: str, state: Mapping) -> PromptExample:
    """The prompt of a carried group's state ``name`` (``_carried_state``'s ``prompt``), each field checked as a prompt
    set's row holds it, else a ValueError naming the bad key and what is allowed: taken unchecked, a bad one failed
    at the first reward call or prompt-set comparison, far from the checkpoint. The answer may be any value Python
    turns into text (``check_as_text``: the prompt set's comparison takes it as text)."""
    prompt = check_text(f"{name}.prompt", state["prompt"])
    entry = state["entry"]
    if not isinstance(entry, Mapping) or not all(isinstance(key, str) for key in entry):
        raise ValueError(f"{shown_setting(f'{name}.entry', entry)} is not allowed; it must be the prompt's source "
                         "row: a mapping of its fields by name (string keys)")
    messages = state.get("messages")  # a state saved without them: None
    if messages is not None:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"{shown_setting(f'{name}.messages', messages)} is not allowed; it must be None (a "
                             "single user message) or a non-empty list of chat messages ([{'role': ..., 'content': "
                             "...}, ...] ending with a user turn)")
        messages = check_messages(messages, f"{name}.messages")
    example = PromptExample(prompt, state["answer"], dict(entry), messages)
    check_as_text(example, name)
    return example


def _carried_sample(name: str, state: Any) -> SampleProgress:
    """A carried sample from its state (``_carried_state``'s), checked: one log-prob and one rollout index (the
    version it was drawn in) per token, else a ValueError naming the bad key or value."""
    check_state_keys(name, state, ("tokens", "logprobs", "versions", "done"))
    tokens = _token_ids(f"{name}.tokens", state["tokens"], "a list of token ids (integers >= 0)")
    versions = _token_ids(f"{name}.versions", state["versions"], "a list of rollout indices (integers >= 0)")
    logprobs = state["logprobs"]
    numbers = [real_within(x, finite=False) for x in logprobs] if isinstance(logprobs, (list, tuple)) else [None]
    if None in numbers:  # -inf is a number here; nan is not
        raise ValueError(f"{shown_setting(f'{name}.logprobs', logprobs, 80)} is not allowed; it must be a list of "
                         "numbers (the sampler's log-probabilities)")
    if not len(tokens) == len(numbers) == len(versions):
        raise ValueError(f"{name} holds {len(tokens)} tokens, {len(numbers)} logprobs and {len(versions)} versions; "
                         "a sample holds one of each per token")
    return SampleProgress(tokens, numbers, versions, check_bool(f"{name}.done", state["done"]))


def _token_ids(name: str, values: Any, allowed: str, empty: bool = True) -> list[int]:
    """``values`` as plain ints if it is a list of integers >= 0 (non-empty unless ``empty``), else a ValueError
    naming it and what is ``allowed``."""
    numbers = [integer_within(x, 0) for x in values] if isinstance(values, (list, tuple)) else [None]
    if None in numbers or not (numbers or empty):
        raise ValueError(f"{shown_setting(name, values, 80)} is not allowed; it must be {allowed}")
    return numbers


def _source_answer(saved: PromptExample, index: int, examples: Sequence[PromptExample] | None) -> Any:
    """A carried group's gold answer as its row holds it: a checkpoint written before answers kept the row's own
    type holds it as text (3 as "3"), which a TRL reward comparing ints would score 0, so the prompt set's example
    at ``index`` gives it where it is the same prompt (text, messages, answer as text); else ``saved``'s as it is
    (no prompt set given, or another one, which the sampler's fingerprint refuses)."""
    if examples is None or not 0 <= index < len(examples):
        return saved.answer
    source = examples[index]
    same = (source.prompt == saved.prompt and source.messages == saved.messages
            and answer_text(source.answer) == answer_text(saved.answer))
    return source.answer if same else saved.answer


def _all_groups(rollouts: list[_ScoredRollout]) -> list[tuple[int, int]]:
    """Every group of ``rollouts`` as ``(rollout, group)`` keys, in order."""
    return [(r, p) for r, rollout in enumerate(rollouts) for p in range(len(rollout.prompts))]


def _fill_groups(kept: list[tuple[int, int]], generated: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """The first ``count`` of ``kept``, filled up to ``count`` with the ``generated`` groups not kept (dynamic
    sampling's dropped ones, which get zero advantage, in generation order), so that every batch has B groups. The
    fillers are spread evenly among the kept groups: a run of them would make whole mini-batches
    (``model.num_mini_batches``) without learning signal, optimizer steps that only AdamW's momentum moves."""
    chosen = kept[:count]
    taken = set(chosen)
    fillers = [key for key in generated if key not in taken][:count - len(chosen)]
    total = len(chosen) + len(fillers)
    # positions floor((i + 1/2) x total / fillers): at least 1 apart, so distinct
    spread = {int((2 * i + 1) * total // (2 * len(fillers))) for i in range(len(fillers))}
    kept_in_order, fillers_in_order = iter(chosen), iter(fillers)
    return [next(fillers_in_order if position in spread else kept_in_order) for position in range(total)]
