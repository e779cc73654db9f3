"""``RolloutDataModule``: prompts, samplers, loaders and the stream position; one ``RolloutBatch`` per step.

Prompt -> builder -> batch -> module: this module draws prompts (uniformly or with the GAIN-RL curriculum) and
hands them to a :class:`~lit_grpo.rollout.builder.RolloutBuilder`, which generates, scores and assembles the batch
that ``GRPOModule.training_step`` consumes. The policy, its tokenizer and the advantage scaling belong to the
module, which hands them over once through :meth:`RolloutDataModule.attach` (``GRPOModule`` does it when fit or
validate starts; without a trainer call ``attach`` yourself).

Why the rollout is built in ``on_before_batch_transfer`` and not in the dataset's iterator: Lightning prefetches
one batch ahead, so an iterator that generated there would sample step k+1 with the policy from before step k's
update and move the curriculum one step early. Built in the hook that runs right before ``training_step``, every
rollout is strictly on-policy and a checkpoint's data state is exactly "the steps trained so far", which exact
resume needs. The loaders therefore yield ``RolloutRequest`` tokens only; validation requests get greedy rollouts.

Distributed (ddp): every rank builds the same sampler and draws ``prompts_per_step x world_size`` indices per
step, keeping its own slice, so ranks get different prompts and groups never split across ranks; what no rank took
goes back to the sampler at the end of the step (``_StepDraw``), counted in ``data/prompts_unused``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.trainer.states import TrainerFn

from lit_grpo.batch import RolloutBatch
from lit_grpo.datamodules.angle_score import angle_concentration
from lit_grpo.datamodules.curriculum import Curriculum, build_prompt_sampler, check_curriculum_settings
from lit_grpo.rollout.prompts import (PromptExample, chat_turns, check_chat_template_kwargs,
                                     check_prompt_shaping, check_prompt_source, check_val_size,
                                     fingerprint_without_message_keys, is_conversational, load_prompts,
                                     other_message_keys, prompt_set_fingerprint, render_prompt, split_examples)
from lit_grpo.datamodules.random_state import check_rng_states, get_rng_states, set_rng_states
from lit_grpo.datamodules.requests import RequestStream, RolloutRequest
from lit_grpo.rollout.rewards import (OnRewardError, TrainerState, build_reward_funcs, check_gold_answers,
                                      check_reward_columns, check_row_fields, correctness_reward, saved_reward_specs)
from lit_grpo.rollout.builder import Prompt, RolloutBuilder, check_builder_state
from lit_grpo.rollout.config import AdvantageConfig, ScoringConfig, TrainingConfig, ValidationConfig
from lit_grpo.rollout.slot_memory import SlotMemory, check_slot_budget
from lit_grpo.rollout.tools import ToolBox, checked_tools
from lit_grpo.runtime.distributed import RolloutWeights, strategy_all_gather
from lit_grpo.runtime.known_warnings import ignore_warning
from lit_grpo.sampling import SamplingConfig
from lit_grpo.scheduling.least_attained import PREEMPT_TOKENS
from lit_grpo.runtime.checkpoints import PlainHyperparameters, SettingsDiffer
from lit_grpo.runtime.stop_signal import STOP_SIGNAL
from lit_grpo.runtime.validation import (
    ConfigError,
    check_bool,
    check_int,
    check_state_keys,
    config_errors,
    integer_within,
    plain_yaml_values,
    settings_from,
    shown_setting,
    shown_value,
)


#: Columns that hold gold answers under other trainers' names (TRL's accuracy_reward reads ``solution``, verl's
#: data ``ground_truth``): named in the refusal of prompts without an answer, which ``answer`` alone gives.
GOLD_COLUMNS = ("solution", "ground_truth")
#: The sampler state's entry holding ``prompt_set_fingerprint`` of the training prompts it drew from.
TRAIN_PROMPTS_KEY = "train_prompts"
#: The keys of a data state (``RolloutDataModule.state_dict``); each may be absent (older checkpoints, one rank's).
_STATE_KEYS = ("steps_built", "rng", "rng_by_rank", "in_flight", "sampler", "engine", "engine_by_rank")


@contextlib.contextmanager
def _settings_differences_said() -> Iterator[None]:
    """A checkpoint of another run's settings (a ``SettingsDiffer``) refused as a setting of ``--ckpt_path``: a
    ``ConfigError`` caused by it, which the CLI says may be another experiment's run; other errors as they are."""
    try:
        yield
    except SettingsDiffer as error:
        raise ConfigError(f"--ckpt_path: {error}") from error


def curriculum_accuracy(sums: torch.Tensor) -> float | None:
    """The curriculum's feedback for a step from ``RolloutBatch.accuracy_sums`` (one rank's, or every rank's added
    up): the share of correct completions where any has a correctness, else the mean reward of the completions
    some reward function scored, clamped to [0, 1]; None where no completion was scored (every function returned
    None, or every group was skipped): a step with no information, which the curriculum skips."""
    correct, judged, reward, rewarded = sums.tolist()
    if judged <= 0 and rewarded <= 0:
        return None
    accuracy = correct / judged if judged > 0 else reward / rewarded
    return min(max(accuracy, 0.0), 1.0)


def _quiet_loader_flattening() -> None:
    """Lightning flattens the loaders a fit gets with a helper that builds torch's deprecated ``LeafSpec`` (torch >=
    2.9), a warning on every fit that neither lit_grpo nor the user can act on: ignored for that message from that
    Lightning module only, so that the deprecation stays visible in the user's own code."""
    ignore_warning(r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning,
                   r"lightning\.pytorch\.utilities\._pytree")


def _position_limit(policy: torch.nn.Module) -> int | None:
    """The policy's ``max_position_embeddings`` (its text decoder's), None where its config has none."""
    config = policy.config.get_text_config(decoder=True) if hasattr(policy, "config") else None
    return getattr(config, "max_position_embeddings", None)


def _training_sampling(sampling: SamplingConfig | Mapping[str, Any]) -> SamplingConfig:
    """``sampling`` (a config or a dict of its fields) as a :class:`SamplingConfig` fit for training rollouts:
    G >= 2, sampled rather than greedy, and no length predictor that reads the true lengths."""
    # Training's bound on G, checked before the config's own (>= 1): a lone completion has nothing to compare to.
    if isinstance(sampling, Mapping):
        check_int("sampling.group_size", sampling.get("group_size", SamplingConfig.group_size), 2)
    sampling = settings_from("sampling", sampling, SamplingConfig)
    check_int("sampling.group_size", sampling.group_size, 2)
    if sampling.temperature == 0 or sampling.top_k == 1:
        setting = "temperature=0" if sampling.temperature == 0 else "top_k=1"
        raise ValueError(f"sampling.{setting} makes training rollouts greedy: the group_size={sampling.group_size} "
                         "completions of a prompt would be identical, so every advantage is 0 and nothing is "
                         "learned; sample (temperature > 0, e.g. 1.0, and top_k 0 or > 1)")
    length_aware = sampling.scheduler.length_aware if sampling.strategy == "infinite" else None
    predictor = getattr(length_aware, "predictor", None)
    if isinstance(predictor, str) and predictor.partition(":")[0] in ("oracle", "noisy"):
        raise ValueError(f"{shown_setting('sampling.scheduler.length_aware.predictor', predictor)} reads the true "
                         "lengths, which only a replay of known lengths has (tools.bench_rollout --lengths), never a "
                         "training rollout: use 'online'")
    return sampling


def _warn_unused_sampling_options(sampling: SamplingConfig, stacklevel: int) -> None:
    """Warn of ``sampling`` options its strategy or ``micro_group_size`` ignores: named, never dropped in silence."""
    if ignored := sampling.ignored_scheduler_options():
        warnings.warn(f"sampling.scheduler options {ignored} apply to strategy 'infinite' only; strategy "
                      f"{sampling.strategy!r} ignores them", stacklevel=stacklevel)
    g = sampling.micro_group_size
    if sampling.strategy == "full" and g is not None:
        warnings.warn(f"sampling.micro_group_size={g!r} is ignored by strategy 'full', which decodes every "
                      "sample at once; use 'continuous' or 'infinite' for g slots", stacklevel=stacklevel)
    if sampling.kv_budget_bytes is not None and g != "auto":
        warnings.warn(f"sampling.kv_budget_bytes={sampling.kv_budget_bytes} is the budget of micro_group_size "
                      f"'auto' only; micro_group_size={g!r} ignores it", stacklevel=stacklevel)
    if sampling.strategy == "micro" and isinstance(g, int) and g > sampling.group_size:
        warnings.warn(f"sampling.micro_group_size={g} is more than group_size={sampling.group_size}: strategy "
                      "'micro' runs one prompt's samples at a time, so it uses group_size slots", stacklevel=stacklevel)


def _warn_inactive_settings(given: Mapping[str, Any], stacklevel: int) -> None:
    """Warn of ``RolloutDataModule`` settings (``given``, by argument name) that act only beside another one, where
    that one is off and they differ from their defaults: named, never dropped in silence (a bad value is refused
    before this, not also called ignored)."""
    defaults = inspect.signature(RolloutDataModule.__init__).parameters
    for name, needs in (
            ("max_rollouts_per_step", None if given["dynamic_sampling"] else "dynamic_sampling"),
            ("max_staleness", None if given["over_provision"] > 1 else "over_provision > 1"),
            ("val_temperature", None if given["val_num_samples"] > 1 else "val_num_samples > 1"),
            ("max_tool_calling_iterations", None if given["tools"] else "tools")):
        if needs is not None and given[name] != defaults[name].default:
            warnings.warn(f"{name}={given[name]!r} applies with {needs} only; it is ignored", stacklevel=stacklevel)
    if given["task"] is None:  # a config that switches its source away from a task often keeps the task's settings
        for name in ("task_config", "size"):
            if given[name] != defaults[name].default:
                warnings.warn(f"data.{name}={given[name]!r} applies to data.task only; this run's prompts come from "
                              f"another source, so it is ignored (remove it, or give its default "
                              f"{defaults[name].default!r})", stacklevel=stacklevel)


def _warn_preemption_off(sampling: SamplingConfig, stacklevel: int) -> None:
    """Warn where a set ``preempt_tokens`` is not below the length cap, so it never preempts (the default's
    quantum may exceed a short cap unasked: no warning for it)."""
    preempt = sampling.scheduler.preempt_tokens
    if sampling.strategy == "infinite" and preempt and preempt >= sampling.max_new_tokens and \
            preempt != PREEMPT_TOKENS:
        warnings.warn(f"sampling.scheduler.preempt_tokens={preempt} is not below max_new_tokens="
                      f"{sampling.max_new_tokens}, so no sample is ever preempted: set it below the cap, or 0 "
                      "for plain continuous sampling", stacklevel=stacklevel)


def _rank_states(name: str, states: Any, what: str) -> list[Any]:
    """``states``, a checkpoint's list of each saving rank's ``what``, as a list, else a ValueError naming it:
    iterated as it was, an int failed with a bare TypeError and a mapping was read as its keys."""
    if not isinstance(states, (list, tuple)):
        raise ValueError(f"{shown_setting(name, states, 80)} is not allowed; it must be a list of the saving ranks' "
                         f"{what}")
    return list(states)


def _builder_state(name: str, state: Any, whose: str = "a") -> dict[str, Any]:
    """``state``, an engine's state in a checkpoint, as a dict if it is a mapping, else a ValueError naming it
    (``whose``: ``"a"``, or ``"a rank's"``): dict() took a list of pairs, and failed bare on anything else."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{shown_setting(name, state, 80)} is not allowed; it must be {whose} rollout builder state "
                         "(a mapping)")
    return dict(state)


class _StepDraw:
    """One training step's prompts under several ranks: global draws of ``prompts_per_step x world_size`` prompts
    (the same on every rank, as every rank's sampler is in the same state), this rank keeping its own
    ``prompts_per_step`` slice of each and handing them out in order as the rollout asks for them.

    Ranks may ask for different numbers of prompts in a step (dynamic sampling's extra rounds, partial rollouts'
    fresh groups), so without a collective in the rollout they may make different numbers of global draws. At the
    end of the step ``finish``, given every rank's draws and prompts taken, makes the draws this rank is short of,
    so every rank's sampler is in the same state, and gives the prompts no rank took back to the sampler (the same
    ones on every rank), which hands them out first next: every prompt drawn is trained on, filtered, or drawn
    again."""

    def __init__(self, sampler: Any, prompts_per_step: int, world: int, rank: int, in_flight: Sequence[int] = ()):
        self.sampler, self.share, self.world, self.rank = sampler, prompts_per_step, world, rank
        self.in_flight = set(in_flight)  # positions of the groups carried on any rank, never drawn again while so
        self.drawn: list[list[int]] = []  # the step's global draws
        self.ready: list[int] = []  # this rank's positions drawn and not yet handed out
        self.taken: list[int] = []  # this rank's positions handed out this step

    @property
    def draws(self) -> int:
        """Global draws made this step."""
        return len(self.drawn)

    def take(self, count: int) -> list[int]:
        while len(self.ready) < count:
            drawn = self._global_draw()
            self.ready.extend(drawn[self.rank * self.share:(self.rank + 1) * self.share])
        out, self.ready = self.ready[:count], self.ready[count:]
        self.taken.extend(out)
        return out

    def finish(self, draws: Sequence[int], taken: Sequence[int]) -> list[int]:
        """End the step: ``draws[r]`` and ``taken[r]`` are rank r's global draws and positions taken. Returns the
        positions given back to the sampler: of each draw, each rank's slice past what that rank took."""
        while self.draws < max(draws):
            self._global_draw()
        unused = []
        for index, drawn in enumerate(self.drawn):
            for rank, count in enumerate(taken):
                used = min(max(count - index * self.share, 0), self.share)
                unused.extend(drawn[rank * self.share + used:(rank + 1) * self.share])
        self.sampler.give_back(unused)
        return unused

    def _global_draw(self) -> list[int]:
        """The next global draw, avoiding the step's earlier ones and the prompts in flight: no prompt twice in a step,
        nor beside its own carried group, where there are enough."""
        earlier = {prompt for draw in self.drawn for prompt in draw}
        self.drawn.append(self.sampler.draw(self.share * self.world, avoid=earlier | self.in_flight))
        return self.drawn[-1]


class RolloutDataModule(PlainHyperparameters, LightningDataModule):
    """Streams GRPO rollouts built with the current policy.

    Prompt source (exactly one): ``task`` (a reasoning-gym task, ``size`` entries, ``data_seed``, ``task_config``),
    ``jsonl_path`` (``prompt`` or ``question``: the user message or chat messages, as ``dataset`` takes them;
    optional ``answer`` and any other fields), ``prompts`` (strings or ``{prompt, answer}`` dicts, alike) or
    ``dataset`` (a local parquet / JSON / JSONL / CSV / Arrow file, a folder of them or a ``save_to_disk`` folder;
    in Python also a ``datasets.Dataset``), read with ``prompt_column``, ``answer_column`` and ``split``
    (``lit_grpo.rollout.hf_dataset``; needs ``pip install 'lit-grpo[data]'``).
    ``system_prompt`` (the system message; None, null, for none: an empty text is refused, as it could also mean an
    empty system turn) and ``prompt_template`` (``"...{prompt}..."``: only ``{prompt}`` is replaced, other braces
    such as ``\\boxed{}`` stay as written) shape the messages before the chat template; ``chat_template_kwargs``
    are more variables for the chat template (TRL's setting; e.g. ``{enable_thinking: false}`` for Qwen3), each one
    it must read; ``apply_chat_template: false`` tokenizes a string prompt as the text it is (TRL's standard
    format; a chat-format prompt always goes through the template). ``val_size``: held-out
    prompts (a count or fraction of the distinct prompts; a repeated prompt is held out whole).

    Args:
        reward_funcs: reward specs (``lit_grpo.rollout.rewards.build_reward_funcs``, default ``["accuracy"]``);
            ``accuracy_reward`` names the one whose value is correctness (val/accuracy, curriculum feedback); unset,
            the first of ``accuracy`` and ``math`` among them, else none (no val/accuracy).
        prompts_per_step: B, groups per training step (per rank).
        sampling: the rollout engine's settings, a :class:`~lit_grpo.sampling.SamplingConfig` (or a dict of its
            fields; YAML ``data.sampling:``), documented and checked there: G (>= 2 for training), g (or "auto"
            with ``kv_budget_bytes``), strategy, the length cap, temperature / top_p / top_k / min_p /
            repetition_penalty, the seed of the random streams, ``scheduler`` (the "infinite" strategy's options),
            CUDA graphs, and whether the KV cache stays allocated between steps.
        dynamic_sampling: drop groups whose rewards are all equal and draw more prompts, at most
            ``max_rollouts_per_step`` rollouts (engine calls) per step; dropped groups fill the batch if still short
            (zero advantages).
        max_rollouts_per_step: see ``dynamic_sampling``.
        over_provision: partial rollouts (1.0: off): a step's first rollout runs up to ``ceil(over_provision x B)``
            groups, stops once B are complete and carries the unfinished ones into the next step (at most
            ``max_staleness`` steps); see :class:`~lit_grpo.rollout.builder.RolloutBuilder`. Their tokens from older
            weights are corrected by ``GRPOModule``'s sampler correction ("auto").
        steps_per_epoch: default ``ceil(train prompts / (B x world_size))``.
        val_batch_size: greedy validation rollouts (the policy's argmax, no repetition penalty),
            ``val_max_new_tokens`` long (default: the sampling cap).
        val_num_samples: ``k > 1`` also draws k samples per held-out prompt at ``val_temperature`` (on an
            engine of their own, seeded apart from training's streams, with training's filters and repetition
            penalty) for ``val/mean_at_k`` and ``val/pass_at_k``; 1 (default) validates greedily only.
        curriculum: "none" (uniform, epoch-style shuffling) or "angle" (GAIN-RL); ``curriculum_kwargs`` go to the
            sampler; ``score_batch_size``: prompts per prefill when scoring angle concentration.
        on_reward_error: "raise" (stop, naming the function and the prompt) or "skip_group" (the group is scored 0
            and trained on not at all; counted in ``reward/skipped_groups``).
        tools: EXPERIMENTAL, TRL's ``tools``: functions (callables or ``"package.module:function"`` names, each
            with type hints and a docstring for its JSON schema) shown to the model through the chat template's
            ``tools=``; a turn that ends with a call to one runs it and decodes on after its result, which gets no
            loss (``lit_grpo.rollout.tools``). Logs ``tools/call_frequency`` and ``tools/failure_frequency``.
        max_tool_calling_iterations: tool rounds per completion (TRL's setting); None: no count, the rounds end
            when no turn calls a tool or the completion reaches ``sampling.max_new_tokens``.
    """

    #: Declares that this data module's training batches are lit_grpo rollouts (``RolloutBatch``): under several
    #: processes the callbacks that report rollouts (``FitSummary``, ``RolloutProfiler``, ``CompletionLogger``)
    #: gather each step's figures over ranks only where the trainer's datamodule declares it, the same on every
    #: rank. A data module of your own that yields rollouts sets it too.
    yields_rollouts: ClassVar[bool] = True

    def __init__(
        self,
        task: str | None = None,
        task_config: dict[str, Any] | None = None,
        size: int = 1000,
        jsonl_path: str | None = None,
        prompts: list[Any] | None = None,
        dataset: str | None = None,
        prompt_column: str | None = None,
        answer_column: str | None = None,
        split: str = "train",
        data_seed: int = 0,
        val_size: int | float = 64,
        system_prompt: str | None = None,
        prompt_template: str = "{prompt}",
        chat_template_kwargs: dict[str, Any] | None = None,
        apply_chat_template: bool = True,
        reward_funcs: list[Any] | None = None,
        accuracy_reward: str | None = None,
        prompts_per_step: int = 4,
        sampling: SamplingConfig = SamplingConfig(),
        dynamic_sampling: bool = False,
        max_rollouts_per_step: int = 4,
        over_provision: float = 1.0,
        max_staleness: int = 2,
        steps_per_epoch: int | None = None,
        val_batch_size: int = 32,
        val_max_new_tokens: int | None = None,
        val_num_samples: int = 1,
        val_temperature: float = 1.0,
        curriculum: Curriculum = "none",
        curriculum_kwargs: dict[str, Any] | None = None,
        score_batch_size: int = 8,
        on_reward_error: OnRewardError = "raise",
        tools: list[Any] | None = None,
        max_tool_calling_iterations: int | None = None,
    ):
        super().__init__()
        # The settings checked first, each by its owner, before anything is stored or loaded (the reward
        # functions as they are built, below)
        #: The engine's settings (G, g, strategy, length cap, temperature, seed, scheduler, ...), checked once.
        self.sampling = sampling = _training_sampling(sampling)
        _warn_unused_sampling_options(sampling, stacklevel=3)
        #: How a training step gathers its groups, and the held-out prompts' rollouts: built (and checked) once
        #: here, read by the builder (``_require_builder``) as they are
        self.training = TrainingConfig(prompts_per_step, dynamic_sampling, max_rollouts_per_step, over_provision,
                                       max_staleness)
        self.validation = ValidationConfig(val_batch_size, val_max_new_tokens, val_num_samples, val_temperature)
        scoring = ScoringConfig(accuracy_reward, on_reward_error)
        training, validation = self.training, self.validation
        if steps_per_epoch is not None:
            steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch, 1)
        size, data_seed = check_prompt_source(size, data_seed, dataset, task_config, jsonl_path, prompt_column,
                                              answer_column, split)
        val_size = check_val_size(val_size)
        check_prompt_shaping(system_prompt, prompt_template, chat_template_kwargs)
        check_bool("apply_chat_template", apply_chat_template)
        if not apply_chat_template and tools is not None:
            raise ValueError("apply_chat_template=False tokenizes string prompts as plain text, but tools are shown "
                             "to the model and their turns rendered through the chat template; drop one of the two")
        score_batch_size = check_curriculum_settings(curriculum, curriculum_kwargs, score_batch_size)
        self.tools, max_tool_calling_iterations = checked_tools(tools, max_tool_calling_iterations,
                                                                training.over_provision)
        _warn_inactive_settings(dict(
            task=task, task_config=task_config, size=size, dynamic_sampling=dynamic_sampling,
            max_rollouts_per_step=training.max_rollouts_per_step, over_provision=training.over_provision,
            max_staleness=training.max_staleness, val_num_samples=validation.val_num_samples,
            val_temperature=validation.val_temperature, tools=self.tools,
            max_tool_calling_iterations=max_tool_calling_iterations), stacklevel=3)
        _warn_preemption_off(sampling, stacklevel=3)
        sampling = dataclasses.asdict(sampling)  # saved as a dict of its fields
        self.save_hyperparameters(ignore=["prompts", "dataset", "tools", "reward_funcs"])
        # a reward function by its name, an object by its class (plain_yaml_values): Lightning deep-copies what it
        # saves, and a reward object that holds a lock (an API client) cannot be copied, one with a model is copied
        # in a config's spelling where one builds the same reward again (saved_reward_specs)
        self.set_hparam("reward_funcs", plain_yaml_values(saved_reward_specs(reward_funcs)))
        # a tool by its name, which a checkpoint stores as plain text
        self.set_hparam("tools",
                        [f"{t.__module__}:{t.__qualname__}" for t in self.tools] if tools is not None else None)
        if dataset is not None:  # a path as given; a Dataset object only described, never pickled into checkpoints
            from lit_grpo.rollout.hf_dataset import describe_source

            self.set_hparam("dataset", describe_source(dataset))
        self.task, self.task_config, self.size, self.jsonl_path = task, task_config, size, jsonl_path
        self.inline_prompts = prompts
        self.dataset, self.prompt_column, self.answer_column, self.split = dataset, prompt_column, answer_column, split
        self.data_seed, self.val_size = data_seed, val_size
        self.system_prompt, self.prompt_template = system_prompt, prompt_template
        self.chat_template_kwargs = dict(chat_template_kwargs) if chat_template_kwargs is not None else None
        self.apply_chat_template = apply_chat_template
        with config_errors("data.reward_funcs"):
            self.reward_funcs = build_reward_funcs(reward_funcs)
        #: the correctness reward resolved against the reward functions, and what a raising one does
        self.scoring = dataclasses.replace(scoring,
                                           accuracy_reward=correctness_reward(self.reward_funcs, accuracy_reward))
        self.steps_per_epoch = steps_per_epoch
        self.curriculum, self.curriculum_kwargs = curriculum, dict(curriculum_kwargs or {})
        self.score_batch_size = score_batch_size
        self.max_tool_calling_iterations = max_tool_calling_iterations

        self.examples: list[PromptExample] | None = None
        #: ``prompt_set_fingerprint`` of the training prompts, taken once when they are split (``setup``)
        self._train_fingerprint = ""
        self.train_indices: list[int] = []
        self.val_indices: list[int] = []
        self.train_prompt_ids: list[list[int]] = []
        self.val_prompt_ids: list[list[int]] = []
        self.sampler = None
        self.builder: RolloutBuilder | None = None
        self._handover: dict[str, Any] | None = None  # what attach() was given
        self._toolbox: ToolBox | None = None  # data.tools rendered for the handed-over tokenizer
        self._pending_state: dict[str, Any] = {}  # the engine's state, kept until the builder is built
        #: a data state loaded before setup (this rank's parts, ``_own_data_state``), kept whole until setup has built
        #: the sampler that checks its part, so that a refused sampler state leaves nothing taken
        self._state_for_setup: dict[str, Any] | None = None
        self.steps_built = 0  # training rollouts built so far (the position in the prompt stream)
        self._step_drawn: set[int] = set()  # one process: the prompts this step has drawn so far
        #: several ranks: the positions of the groups every rank carried out of the last step (``_finish_step``)
        self._in_flight: list[int] = []
        self._train_position: dict[int, int] = {}  # a training prompt's position from its example index
        self._slot_budget_said = False  # micro_group_size: auto's budget is said once in the log
        self._cache_keeping_said = None  # and keep_kv_cache: auto's decision, when it changes

    # ------------------------------------------------------------------------------------------ hand-over
    def _check_fits_the_policy(self, policy: torch.nn.Module, device: torch.device) -> None:
        """Settings only the policy can judge, judged before its first rollout: a CUDA graph off CUDA, and a
        length cap beyond the model's positions."""
        if self.sampling.cuda_graph and device.type != "cuda":
            raise ConfigError(f"data.sampling.cuda_graph=True needs a CUDA model; this one is on {device}: leave it "
                              "null (captured where CUDA is) or false")
        limit = _position_limit(policy)
        for name, cap in (("sampling.max_new_tokens", self.sampling.max_new_tokens),
                          ("val_max_new_tokens", self.validation.val_max_new_tokens)):
            if limit is not None and cap is not None and cap >= limit:
                raise ConfigError(f"data.{name}={cap} leaves no room for a prompt within the model's "
                                  f"max_position_embeddings={limit}: use at most {limit - 1} less the longest prompt")

    def attach(self, policy: torch.nn.Module, tokenizer: Any, scale_rewards: str = "group", world_size: int = 1,
               all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
               precision_context: Callable[[], Any] | None = None,
               rollout_weights: RolloutWeights | None = None,
               measured_update_peak: Callable[[], int | None] | None = None,
               multi_objective_aggregation: str = "sum_then_normalize") -> None:
        """Take what the module owns: the policy, its tokenizer, the advantage scaling and the reward functions'
        aggregation (``multi_objective_aggregation``; both part of the objective), the world (ranks, a gather
        across them, the trainer's precision context), what rollouts run on
        (``rollout_weights``, default the policy itself; under FSDP2 its gathered copy or its shards in
        lockstep) and the device's peak during its last update (``measured_update_peak``, for ``keep_kv_cache:
        auto``). Called once per fit or validate by ``GRPOModule``; call it yourself without a trainer."""
        stage = getattr(getattr(getattr(self, "trainer", None), "state", None), "fn", None)
        device = next(policy.parameters()).device
        if stage in (None, TrainerFn.FITTING):  # validation alone sizes no training slots
            check_slot_budget(self.sampling, device)  # now, not at the first rollout
        self._check_fits_the_policy(policy, device)
        given = self._handover
        advantage = AdvantageConfig(scale_rewards, multi_objective_aggregation)
        world = dict(all_gather=all_gather, precision_context=precision_context,
                     measured_update_peak=measured_update_peak)
        if given is not None and given["policy"] is policy and given["tokenizer"] is tokenizer and (
                given["advantage"], given["world_size"]) == (advantage, world_size) and (
                rollout_weights is None or given["rollout_weights"] is rollout_weights):
            # the same hand-over again (every validation run repeats it), perhaps from another trainer, whose
            # precision and gather the builder takes on: its engines and caches stay
            given.update(world)
            if self.builder is not None:
                self.builder.use_world(**world)
            return
        if self.builder is not None:  # a new policy object: a new builder, continuing the engine's state
            self._pending_state["engine"] = self.builder.state_dict()
        self._handover = dict(policy=policy, tokenizer=tokenizer, advantage=advantage, world_size=world_size,
                              rollout_weights=rollout_weights, **world)
        self.builder = None
        self._render_prompts()

    def teardown(self, stage: str) -> None:
        """The end of fit or validate: every engine's slot cache and graphs and the rollout weights' copy are freed
        (the policy may move afterwards, and a kept graph would read where its weights were)."""
        if self.builder is not None:
            self.builder.release()

    def _require_builder(self) -> RolloutBuilder:
        if self._handover is None:
            raise RuntimeError("RolloutDataModule has no policy: GRPOModule attaches it when fit or validate starts; "
                               "without a trainer call attach(policy, tokenizer)")
        if self.examples is None:
            raise RuntimeError("RolloutDataModule.setup() must run before building rollouts")
        if self.builder is None:
            given = self._handover
            self.builder = RolloutBuilder(
                given["policy"], given["tokenizer"], self.sampling, self.reward_funcs, advantage=given["advantage"],
                scoring=self.scoring, training=self.training, validation=self.validation,
                world_size=given["world_size"], rank=self._world()[1], all_gather=given["all_gather"],
                precision_context=given["precision_context"], rollout_weights=given["rollout_weights"],
                measured_update_peak=given["measured_update_peak"], tools=self._toolbox,
                max_prompt_length=max((len(ids) for ids in self.train_prompt_ids), default=0),
                conversational=is_conversational(self.examples))
            self.builder.trainer_state = self._trainer_state
            if "engine" in self._pending_state:
                self.builder.load_state_dict(self._pending_state.pop("engine"), self.examples)
        return self.builder

    def _trainer_state(self) -> TrainerState:
        """The training progress the reward functions see (``trainer_state``): the trainer's optimizer steps and
        their bound (from ``max_epochs`` where ``max_steps`` is unset, as TRL's), and the epochs of prompts drawn."""
        trainer = getattr(self, "trainer", None)
        epoch = self.steps_built / self.num_train_steps_per_epoch()
        if trainer is None:
            return TrainerState(self.steps_built, -1, epoch)
        max_steps = trainer.max_steps
        if max_steps < 0 and trainer.max_epochs is not None and trainer.max_epochs > 0:
            # each training step takes num_iterations x num_mini_batches optimizer steps (the module's settings)
            per_step = getattr(trainer.lightning_module, "optimizer_steps_per_training_step", 1)
            max_steps = trainer.max_epochs * self.num_train_steps_per_epoch() * per_step
        return TrainerState(trainer.global_step, max_steps, epoch)

    @property
    def engine(self):
        """The training rollout engine."""
        return self._require_builder().engine

    @property
    def resolved_micro_group_size(self) -> int | None:
        """The g the training engine uses (``sampling.micro_group_size`` with ``"auto"`` resolved)."""
        return self._require_builder().resolved_micro_group_size

    # ------------------------------------------------------------------------------------------ data
    def setup(self, stage: str | None = None) -> None:
        """Load and split the prompts and build the prompt sampler (once); render them once a tokenizer is here."""
        if self.examples is None:
            self._load_prompts()
        if stage == "validate" and not self.val_indices:  # Lightning would warn of an empty loader and end, exit 0
            raise ConfigError(f"{shown_setting('data.val_size', self.val_size)} holds out no prompts, so there is "
                              "nothing to validate: set it to a count >= 1 or a fraction in (0, 1)")

    def _load_prompts(self) -> None:
        """The prompts loaded and split, checked against the world size, the sampler built, and rendered."""
        with config_errors("data", inspect.signature(type(self)).parameters):
            examples = load_prompts(self.task, self.size, self.data_seed, self.task_config, self.jsonl_path,
                                    self.inline_prompts, self.dataset, self.prompt_column, self.answer_column,
                                    self.split)
            check_gold_answers(self.reward_funcs, examples, self._answer_source(examples))
            check_row_fields(examples, self._prompt_source())
            check_reward_columns(self.reward_funcs, examples, self._prompt_source())
            self.train_indices, self.val_indices = split_examples(examples, self.val_size, self.data_seed)
        self.examples = examples
        self._train_position = {index: position for position, index in enumerate(self.train_indices)}
        self._train_fingerprint = prompt_set_fingerprint([examples[i] for i in self.train_indices])
        kept_out = len(examples) - len(self.train_indices) - len(self.val_indices)
        if kept_out:
            rank_zero_info(f"lit_grpo: {kept_out} of {len(examples)} prompt rows repeat one of the "
                           f"{len(self.val_indices)} held-out prompts: validated once, never trained on")
        world, _ = self._world()
        step = self.training
        if step.prompts_per_step * world > len(self.train_indices):
            raise ConfigError(f"data.prompts_per_step={step.prompts_per_step} x world_size={world} exceeds the "
                              f"{len(self.train_indices)} training prompts")
        first_rollout = step.groups_per_rollout  # a partial rollout's groups
        if first_rollout * world > len(self.train_indices):
            raise ConfigError(f"data.over_provision={step.over_provision} runs ceil({step.over_provision} x "
                              f"prompts_per_step={step.prompts_per_step}) = {first_rollout} groups a rollout, x "
                              f"world_size={world} more than the {len(self.train_indices)} training prompts: lower "
                              "over_provision")
        if 0 < len(self.val_indices) < world:  # a rank with no held-out prompt would log no val/* at all
            raise ConfigError(f"{shown_setting('val_size', self.val_size)} gives {len(self.val_indices)} held-out "
                              f"prompts, fewer than world_size={world}: use at least one per rank, or 0 for no "
                              "validation")
        with config_errors("data.curriculum_kwargs"):
            self.sampler = build_prompt_sampler(self.curriculum, len(self.train_indices), self.sampling.seed,
                                                **self.curriculum_kwargs)
        if self._state_for_setup is not None:  # refused, it is dropped whole: nothing of it was taken
            state, self._state_for_setup = self._state_for_setup, None
            self._take_own_data_state(state)
        self._render_prompts()

    def _prompt_source(self) -> str:
        """The setting the prompts come from, as a user sets it (for ``check_row_fields``' message)."""
        if self.jsonl_path is not None:
            return f"data.jsonl_path={self.jsonl_path!r}"
        if self.dataset is not None:
            return f"data.dataset={self.hparams['dataset']!r}"
        return "data.prompts" if self.inline_prompts is not None else f"data.task={self.task!r}"

    def _answer_source(self, examples: Sequence[PromptExample]) -> str:
        """Where the prompts' gold answers come from, as a user sets it (for ``check_gold_answers``' message)."""
        columns = sorted(examples[0].entry) if examples and isinstance(examples[0].entry, Mapping) else []
        gold = [column for column in GOLD_COLUMNS if column in columns]
        if not gold and "reward_model" in columns and isinstance(examples[0].entry["reward_model"], Mapping) and \
                "ground_truth" in examples[0].entry["reward_model"]:  # verl's layout
            gold = ["reward_model.ground_truth"]
        if self.jsonl_path is not None:
            hint = (f"; its rows' {gold[0]!r} is read as the answer with data.dataset={self.jsonl_path!r} and "
                    f"data.answer_column: {gold[0]}" if gold else "")
            return f"data.jsonl_path={self.jsonl_path!r}: each row's 'answer' field{hint}"
        if self.dataset is not None:
            hint = f"; for its {gold[0]!r} set data.answer_column: {gold[0]}" if gold else ""
            return f"data.dataset: data.answer_column={self.answer_column!r}; its columns: {columns}{hint}"
        return "data.prompts: {prompt, answer} entries" if self.inline_prompts is not None else f"task={self.task!r}"

    def _render_prompts(self) -> None:
        if self.examples is None or self._handover is None:
            return
        tokenizer = self._handover["tokenizer"]
        try:
            check_chat_template_kwargs(tokenizer, self.chat_template_kwargs)
        except ValueError as error:  # the tokenizer's template is known only now: a setting's error all the same
            raise ConfigError(f"data.{error}") from None
        if self.tools:
            said = self._toolbox is not None and self._toolbox.swapped_template is not None
            with config_errors("data.tools"):
                self._toolbox = ToolBox(self.tools, tokenizer, self.max_tool_calling_iterations,
                                        self.chat_template_kwargs, self.system_prompt, self.prompt_template)
            model = self._toolbox.swapped_template
            if model is not None and not said:  # prompts are rendered again at each hand-over: said once
                rank_zero_info(f"lit_grpo: data.tools: the tokenizer's chat template is {model}'s stock one, which "
                               "drops part of an assistant turn once messages follow it, so tool messages cannot be "
                               "appended to a completion: tool turns are rendered with a prefix-preserving version "
                               "of it (prompts render the same; the tokenizer and its export keep the stock one)")
        schemas = self._toolbox.schemas if self._toolbox is not None else None

        def render(i: int) -> list[int]:
            history, user_turn = chat_turns(self.examples[i])
            return render_prompt(tokenizer, self.examples[i].prompt, self.system_prompt, self.prompt_template,
                                 history, self.chat_template_kwargs, tools=schemas, user_turn=user_turn,
                                 chat_template=self.apply_chat_template or bool(self.examples[i].messages))

        self.train_prompt_ids = [render(i) for i in self.train_indices]
        self.val_prompt_ids = [render(i) for i in self.val_indices]
        self._check_prompt_lengths(self._handover["policy"])

    def _check_prompt_lengths(self, policy: torch.nn.Module) -> None:
        """Refuse prompts that, with their length cap, run past the model's positions: named by row at the hand-over,
        where the engine would refuse one only at the step that first draws it, as a prompt of that step's batch."""
        limit = _position_limit(policy)
        if limit is None:
            return
        train_cap = self.sampling.max_new_tokens
        val_setting = "val_max_new_tokens" if self.validation.val_max_new_tokens else "sampling.max_new_tokens"
        caps = (("sampling.max_new_tokens", train_cap), (val_setting, self.validation.length_cap(train_cap)))
        over = [(index, len(prompt), setting, cap)
                for (setting, cap), indices, ids in zip(caps, (self.train_indices, self.val_indices),
                                                        (self.train_prompt_ids, self.val_prompt_ids))
                for index, prompt in zip(indices, ids) if len(prompt) + cap > limit]
        if over:
            index, tokens, setting, cap = min(over)
            raise ConfigError(f"{self._prompt_source()} row {index}: the prompt is {tokens} tokens as the model "
                              f"reads it (templates applied); with data.{setting}={cap} that exceeds the model's "
                              f"max_position_embeddings={limit} ({len(over)} of {len(self.examples)} rows): shorten "
                              "or drop those rows, or lower the length cap")

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def num_train_steps_per_epoch(self) -> int:
        world, _ = self._world()
        return self.steps_per_epoch or max(1, math.ceil(len(self.train_indices) /
                                                        (self.training.prompts_per_step * world)))

    def train_dataloader(self) -> RequestStream:
        _quiet_loader_flattening()
        return RequestStream("train", self.num_train_steps_per_epoch())

    def val_dataloader(self) -> RequestStream:
        _quiet_loader_flattening()
        if not self.val_indices:
            # No validation, on purpose: Lightning's warning of an empty loader is not shown. It names the loader's
            # type, so an empty loader of the user's own (a list) still warns.
            ignore_warning(r"Total length of `RequestStream` across ranks is zero\.", UserWarning,
                           r"lightning\.pytorch\.utilities\.data")
            return RequestStream("val", 0, [])
        return RequestStream("val", len(chunks := self._val_chunks()), chunks)

    def _val_chunks(self) -> list[list[int]]:
        """This rank's held-out positions in ``val_batch_size`` chunks: every prompt on one rank, and as many
        chunks on every rank (a rank short of prompts gets an empty last one), since each validation batch's
        rollout is a collective under FSDP2."""
        world, rank = self._world()
        positions = list(range(len(self.val_indices)))[rank::world]
        size = self.validation.val_batch_size
        count = math.ceil(math.ceil(len(self.val_indices) / world) / size)
        return [positions[i * size:(i + 1) * size] for i in range(count)]

    # ------------------------------------------------------------------------------------------ rollouts
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, RolloutRequest):
            return self.build_val_batch(batch.indices) if batch.split == "val" else self.build_train_batch()
        return batch

    def build_train_batch(self) -> RolloutBatch:
        """One training step's batch: draw prompts, generate with the current policy, score, advantages.

        All or nothing: when the build fails or is interrupted (a stop signal abandons the build of a single
        process, or under several the rollout of any rank, which every rank then drops, its own finished one too:
        ``RolloutBuilder.build_train``, ``lit_grpo.runtime.stop_signal``), the stream is rolled back to where the
        step started, so a checkpoint saved then holds the last completed step and a resume redoes this one
        exactly, its prompts drawn again."""
        builder = self._require_builder()
        start = copy.deepcopy(self._local_state())
        try:
            with STOP_SIGNAL.abandonable(enabled=self._world()[0] == 1):
                return self._build_train_batch(builder)
        except BaseException:
            # this rank's own engine state goes straight back: a checkpoint's rank bookkeeping
            # (``_own_engine_state``) would read it as one rank's and, under several, refuse its carried groups
            self.load_state_dict({key: value for key, value in start.items() if key != "engine"})
            builder.load_state_dict(start["engine"], self.examples)
            raise

    def _build_train_batch(self, builder: RolloutBuilder) -> RolloutBatch:
        epoch = self.trainer.current_epoch if getattr(self, "trainer", None) is not None else 0
        world, rank = self._world()
        if self.sampler.needs_scores(epoch):
            self.sampler.set_scores(self._angle_scores(builder), epoch)
        if world > 1:
            self._step_draw = _StepDraw(self.sampler, self.training.prompts_per_step, world, rank, self._in_flight)
        self._step_drawn = set()
        batch = builder.build_train(self._draw)
        self._say_memory_decisions(builder.slot_memory)
        if world > 1:
            accuracy, mean_angle, unused = self._finish_step(batch)
            self.sampler.update(accuracy, mean_angle)
            batch.metrics["data/prompts_unused"] = float(unused)
        else:
            self.sampler.update(curriculum_accuracy(batch.accuracy_sums()))
        batch.metrics.update(self.sampler.metrics())
        self.steps_built += 1
        return batch

    def _say_memory_decisions(self, memory: SlotMemory) -> None:
        """Log ``micro_group_size: auto``'s slot budget once, and ``keep_kv_cache: auto``'s decision when it
        changes."""
        if memory.slot_budget is not None and not self._slot_budget_said:
            self._slot_budget_said = True
            rank_zero_info(f"lit_grpo: {memory.slot_budget.describe()}")
        keeping, said = memory.cache_keeping, self._cache_keeping_said
        if keeping is not None and (said is None or said.kept != keeping.kept):
            self._cache_keeping_said = keeping
            rank_zero_info(f"lit_grpo: {keeping.describe()}")

    def _angle_scores(self, builder: RolloutBuilder) -> torch.Tensor:
        """``[N]`` angle concentration of every training prompt. Several ranks: each scores its contiguous share
        (``ceil(N / world)`` prompts, one prefill each) and one all_gather gives every rank all of them, in one
        order (the same tensor on every rank)."""
        world, rank = self._world()
        share = math.ceil(len(self.train_prompt_ids) / world)
        mine = self.train_prompt_ids[rank * share:(rank + 1) * share]
        with builder.generation_mode() as model:
            scores = angle_concentration(model, builder.tokenizer, mine, self.score_batch_size)
        if world == 1:
            return scores
        padded = torch.zeros(share, dtype=torch.float64)  # the last ranks' shares may be short
        padded[:len(mine)] = scores.double()
        return self._all_gather(padded).flatten()[:len(self.train_prompt_ids)].float()

    def build_val_batch(self, positions: Sequence[int]) -> RolloutBatch | None:
        """Greedy completions (one per prompt) of some held-out prompts, scored (and k sampled ones with
        ``val_num_samples`` k > 1); None for an empty chunk (a rank short of held-out prompts).

        A stop signal abandons it at once (one process; several agree after each batch, ``RunCheckpoint``): a
        validation changes nothing of the training state, so there is nothing to roll back."""
        builder = self._require_builder()
        with STOP_SIGNAL.abandonable(enabled=self._world()[0] == 1):
            return builder.build_val([self._prompt("val", i) for i in positions])

    def _draw(self, count: int) -> list[Prompt]:
        """The next ``count`` training prompts of this rank.

        One process: ``sampler.draw(count)``, avoiding the step's earlier draws (dynamic sampling's extra rounds
        would draw again the prompts it just filtered) and the prompts of the carried groups (partial rollouts: a
        prompt in flight drawn again would run twice at once and could be trained on twice in one batch). Several
        ranks: this rank's slices of the step's global draws (``_StepDraw``, which avoids what every rank carries).
        No collective runs here, as ranks may ask for different counts or none: ``_finish_step`` settles the step's
        draws at its end."""
        world, rank = self._world()
        if world == 1:
            drawn = self.sampler.draw(count, avoid=self._step_drawn | set(self._carried_positions()))
            self._step_drawn.update(drawn)
            return [self._prompt("train", i) for i in drawn]
        step = getattr(self, "_step_draw", None)
        if step is None or step.sampler is not self.sampler:
            step = self._step_draw = _StepDraw(self.sampler, self.training.prompts_per_step, world, rank,
                                               self._in_flight)
        return [self._prompt("train", i) for i in step.take(count)]

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[world_size, *tensor.shape]`` on the CPU: every rank's ``tensor``, rank by rank (the strategy's
        all_gather, as handed over by ``attach``; else the trainer's strategy). A collective: every rank calls it."""
        gather = (self._handover or {}).get("all_gather") or strategy_all_gather(self.trainer.strategy)
        return gather(tensor).cpu()

    def _carried_positions(self) -> list[int]:
        """The training positions of this rank's carried groups (partial rollouts), in the builder's order."""
        carried = self.builder.carried if self.builder is not None else []
        return [self._train_position[group.tag.prompt.index] for group in carried]

    def _finish_step(self, batch: RolloutBatch) -> tuple[float | None, float | None, int]:
        """The end of a step under several ranks (one all_gather of a few numbers, and a second of the carried
        groups' positions where some rank carries one): the curriculum's feedback for the whole step, the same on
        every rank, i.e. ``curriculum_accuracy`` over every rank's completions and the mean raw angle score of every
        prompt the ranks took (None for a sampler without scores); the step's draws settled
        (``_StepDraw.finish``): every rank's sampler at the same state, the prompts drawn and not taken given back
        to it, their count returned third; and ``_in_flight``, what every rank carries into the next step."""
        step = self._step_draw
        scores = getattr(self.sampler, "scores", None)
        angles = scores[step.taken].double() if scores is not None and step.taken else torch.zeros(0)
        carried = self._carried_positions()
        counts = [float(angles.sum()), angles.numel(), step.draws, len(step.taken), len(carried)]
        # [world, 9]: each rank's accuracy_sums (4), then its angle sum, angle count, draws, prompts taken, carried
        gathered = self._all_gather(torch.cat([batch.accuracy_sums(), torch.tensor(counts, dtype=torch.float64)]))
        accuracy_sums, (angle_sum, angle_count) = gathered[:, :4].sum(dim=0), gathered[:, 4:6].sum(dim=0).tolist()
        draws, taken, carried_counts = gathered[:, 6:9].round().long().T.tolist()
        unused = step.finish(draws, taken)
        self._in_flight = self._gather_positions(carried, max(carried_counts))
        self._step_draw = None
        mean_angle = angle_sum / angle_count if angle_count > 0 else None
        return curriculum_accuracy(accuracy_sums), mean_angle, len(unused)

    def _gather_positions(self, positions: list[int], most: int) -> list[int]:
        """Every rank's ``positions`` together, sorted; ``most``: the longest list of any rank (every rank's same
        value, so every rank joins the gather or none does). Padded with -1 to ``most``, as a gather needs one
        shape."""
        if most == 0:
            return []
        padded = torch.full((most,), -1, dtype=torch.long)
        padded[:len(positions)] = torch.tensor(positions, dtype=torch.long)
        gathered = self._all_gather(padded).flatten().tolist()
        return sorted({position for position in gathered if position >= 0})

    def _prompt(self, split: str, position: int) -> Prompt:
        indices, ids = (self.train_indices, self.train_prompt_ids) if split == "train" else (
            self.val_indices, self.val_prompt_ids)
        return Prompt(index=indices[position], example=self.examples[indices[position]], ids=ids[position])

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What exact resume needs from the data side: steps built, the prompt sampler / curriculum, and each rank's
        own global random states (``rng``: this rank's; several ranks: ``rng_by_rank``, since each rank's update
        draws its own dropout masks) and engine state (its rollout counter, which keys its random streams, its
        scheduler's state and its carried partial-rollout groups): gathered, one per rank (one collective, which
        every rank joins), and each rank takes its own back."""
        state = self._local_state()
        world, _ = self._world()
        if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            by_rank: list[Any] = [None] * world
            torch.distributed.all_gather_object(by_rank, {"rng": state["rng"], "engine": state.pop("engine", None)})
            state["rng_by_rank"] = [entry["rng"] for entry in by_rank]
            if by_rank[0]["engine"] is not None:  # every rank has built its engine, or none has
                state["engine_by_rank"] = [entry["engine"] for entry in by_rank]
        return state

    def _local_state(self) -> dict[str, Any]:
        """This rank's state, as ``state_dict`` without the gather of the ranks' engine states."""
        state: dict[str, Any] = {"steps_built": self.steps_built, "rng": get_rng_states(),
                                 "in_flight": list(self._in_flight), **self._pending_state,
                                 **(self._state_for_setup or {})}  # loaded before setup, not taken yet
        if self.sampler is not None:
            state["sampler"] = {**self.sampler.state_dict(), TRAIN_PROMPTS_KEY: self._train_fingerprint}
        if self.builder is not None:
            state["engine"] = self.builder.state_dict()
        return state

    def _checked_sampler_state(self, state: Any) -> tuple[dict, bool]:
        """The sampler's own part of a data state's ``sampler`` (the sampler's state and the hash of the training
        prompts it drew from), checked by the sampler, taking none of it, and whether those prompts hash as this
        run's did before a chat turn kept its keys beyond role and content (``_check_hashed_without_message_keys``).
        A checkpoint of another curriculum or prompt set is refused as a setting (a ``ConfigError`` caused by a
        ``SettingsDiffer``, which the CLI says may be another experiment's run); a corrupt one is a ValueError
        naming the bad key or value."""
        if not isinstance(state, Mapping):
            raise ValueError(f"data state sampler={shown_value(state, 80)} is not allowed; it must be a prompt "
                             "sampler's state (a mapping)")
        own = dict(state)
        saved = own.pop(TRAIN_PROMPTS_KEY, None)  # None: a checkpoint from before the prompts were hashed
        if saved is not None and not isinstance(saved, str):
            raise ValueError(f"sampler state {TRAIN_PROMPTS_KEY}={shown_value(saved, 80)} is not allowed; it must be "
                             "the hash of the training prompts (a string)")
        with _settings_differences_said():
            self.sampler.check_state_dict(own)
            rehashed = saved is not None and saved != self._train_fingerprint
            if rehashed:
                self._check_hashed_without_message_keys(saved)
        return own, rehashed

    def _take_sampler_state(self, own: dict, rehashed: bool) -> None:
        """Take what ``_checked_sampler_state`` checked; ``rehashed``: said in a warning."""
        self.sampler.load_state_dict(own)
        if rehashed:
            train = [self.examples[i] for i in self.train_indices]
            warnings.warn(f"the checkpoint's training prompts are this run's but for their chat messages' keys beyond "
                          f"role and content ({other_message_keys(train)}), which its run dropped: it resumes, and "
                          "these prompts now render with them", stacklevel=3)

    def _check_hashed_without_message_keys(self, saved: str) -> None:
        """Pass where ``saved``, the checkpoint's hash of its training prompts, is this run's as it was taken before
        a chat turn kept its keys beyond role and content (same prompts, same order, same split: it resumes, its
        prompts now rendered with those keys), else refuse it as another prompt set."""
        train = [self.examples[i] for i in self.train_indices]
        if saved != fingerprint_without_message_keys(train):
            raise SettingsDiffer("the checkpoint drew from another set of training prompts than this run's (as many, "
                                 "but others or in another order: another data source, task_config, size, data_seed "
                                 "or val_size): its place in that set means nothing in this one, and this run's "
                                 "held-out prompts could be trained on; resume with its data settings, or start a new "
                                 "run from its weights (lit-grpo export, then model.model: the export)")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue the prompt stream of a checkpoint (works before or after ``setup`` and ``attach``). A run that
        only evaluates it takes none of the training stream: it may hold out other prompts than the fit did. All or
        nothing: every part is checked before any owner takes its own (its keys, the counts, this rank's random
        states tried on scratch generators, the sampler's and the engine's states by their owners), so a corrupt or
        foreign one is refused naming the bad key or value and leaves the data module as it was. Before ``setup``
        (a Python caller's order; Lightning sets up first) the state is checked but for the sampler's part, which
        only the sampler setup builds can check, and kept whole: setup checks that part and takes all of it, or
        refuses all of it."""
        if not self._fitting():
            return
        state = self._own_data_state(state_dict)
        if self.sampler is None:  # kept whole; a second load replaces the parts it holds, as taking them would
            self._state_for_setup = {**(self._state_for_setup or {}), **state}
        else:
            self._take_own_data_state(state)

    def _own_data_state(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's parts of a data state, as ``_local_state`` holds them (``steps_built``, ``in_flight``, and
        where given ``rng``, ``engine`` and ``sampler``), each checked but the sampler's, else a ValueError naming
        the bad key or value. The engine's part is checked against the tool settings, known before ``attach``
        renders the tools."""
        check_state_keys("a RolloutDataModule state", state_dict, _STATE_KEYS, optional=_STATE_KEYS)
        steps_built = check_int("data state steps_built", state_dict.get("steps_built", 0), 0)
        # a checkpoint from before the ranks' carried groups were gathered: none known until its first step ends
        in_flight = state_dict.get("in_flight", [])
        positions = [integer_within(p, 0) for p in in_flight] if isinstance(in_flight, (list, tuple)) else [None]
        if None in positions:
            raise ValueError(f"{shown_setting('data state in_flight', in_flight, 80)} is not allowed; it must be a "
                             "list of prompt positions (integers >= 0)")
        state: dict[str, Any] = {"steps_built": steps_built, "in_flight": positions}
        rng = self._own_rng_states(state_dict)
        if rng is not None:
            check_rng_states("data state " + ("rng" if rng is state_dict.get("rng")
                                              else f"rng_by_rank[{self._world()[1]}]"), rng)
            state["rng"] = rng
        engine = self._own_engine_state(state_dict)
        if engine is not None:
            if self.builder is None:  # kept for the builder: checked now, not at its first rollout
                check_builder_state(engine, self.examples, self.sampling, bool(self.tools))
            state["engine"] = engine
        if "sampler" in state_dict:
            state["sampler"] = state_dict["sampler"]
        return state

    def _take_own_data_state(self, state: dict[str, Any]) -> None:
        """Take ``_own_data_state``'s ``state`` once its sampler's part is checked too (a set-up data module)."""
        sampler = self._checked_sampler_state(state["sampler"]) if "sampler" in state else None
        # the last check: the builder checks its state whole before it takes any of it; nothing below can fail
        if "engine" in state and self.builder is not None:
            self.builder.load_state_dict(state["engine"], self.examples)
        elif "engine" in state:
            self._pending_state["engine"] = state["engine"]
        if sampler is not None:
            self._take_sampler_state(*sampler)
        self.steps_built, self._in_flight = state["steps_built"], state["in_flight"]
        if "rng" in state:
            set_rng_states(state["rng"])

    def _fitting(self) -> bool:
        """Whether this datamodule serves a fit (also when no trainer is attached: a Python caller's stream)."""
        return getattr(getattr(getattr(self, "trainer", None), "state", None), "fn", "fit") == "fit"

    def _own_rng_states(self, state_dict: Mapping[str, Any]) -> dict[str, Any] | None:
        """This rank's global random states in a checkpoint: its own where every rank's were saved by as many ranks,
        else the saving rank's (``rng``; saved by another number of ranks, or before every rank's were kept)."""
        by_rank = state_dict.get("rng_by_rank")
        if by_rank is not None:
            by_rank = _rank_states("data state rng_by_rank", by_rank, "random states")
        world, rank = self._world()
        if by_rank is not None and len(by_rank) == world:
            return by_rank[rank]
        return state_dict.get("rng")

    def _own_engine_state(self, state_dict: Mapping[str, Any]) -> dict[str, Any] | None:
        """This rank's engine state in a checkpoint saved by one rank or by several. Saved by another number of
        ranks than this fit has: rank 0's state for every rank, unless some rank carried partial rollouts, which
        cannot be dealt out again (an error)."""
        engine = state_dict.get("engine")
        if engine is not None:
            engine = _builder_state("data state engine", engine)
        if "engine_by_rank" in state_dict:
            states = _rank_states("data state engine_by_rank", state_dict["engine_by_rank"],
                                  "rollout builder states (mappings)")
            by_rank = [_builder_state(f"data state engine_by_rank[{index}]", state, "a rank's")
                       for index, state in enumerate(states)]
        elif engine is not None and "carried_by_rank" in engine:  # every rank's carried groups in rank 0's engine state
            shared = {key: value for key, value in engine.items() if key != "carried_by_rank"}
            by_rank = [{**shared, "carried": carried} for carried in _rank_states(
                "data state engine.carried_by_rank", engine["carried_by_rank"], "carried groups")]
        elif engine is not None:
            by_rank = [engine]  # saved by one process
        else:
            return None
        world, rank = self._world()
        if len(by_rank) != world:
            if any(state.get("carried") for state in by_rank):
                raise ValueError(f"the checkpoint carries partial rollouts of {len(by_rank)} rank(s); resume it "
                                 f"with as many ranks (this run has {world})")
            return by_rank[0]
        return by_rank[rank]
