"""The rollout builder's settings, grouped by idea, each group checked once where it is made.

``RolloutDataModule`` takes these settings flat (the YAML keys ``data.prompts_per_step``, ``data.val_batch_size``,
...), builds the groups once and hands them to its ``RolloutBuilder``, which reads them there: no setting is copied
from one owner to another. The field names are the user's keys, so a refusal names what the user wrote.

- ``TrainingConfig``: how a training step gathers its B groups (dynamic sampling, partial rollouts).
- ``ValidationConfig``: the held-out prompts' rollouts.
- ``AdvantageConfig``: how rewards become advantages; the module's objective, handed over by ``GRPOModule``.
- ``ScoringConfig``: how the reward functions' results are read (correctness, a raising function).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lit_grpo.rollout.advantages import AGGREGATIONS, SCALES
from lit_grpo.rollout.rewards import ON_ERROR
from lit_grpo.runtime.validation import check_bool, check_choice, check_field, check_int, check_real
from lit_grpo.sampling.config import MIN_TEMPERATURE


@dataclass(frozen=True)
class TrainingConfig:
    """How a training step gathers its groups.

    Attributes:
        prompts_per_step: B, groups per training batch (per rank).
        dynamic_sampling: drop groups without learning signal (all-equal rewards; see
            ``AdvantageConfig.multi_objective_aggregation``) and sample more, at most ``max_rollouts_per_step``
            rollouts (engine calls) per step; dropped groups fill the batch if still short (zero advantages).
        max_rollouts_per_step: see ``dynamic_sampling``.
        over_provision: partial rollouts (1.0: off): each step's first rollout runs up to ``ceil(over_provision x B)``
            groups, carried ones first, stops once B are complete and carries every unfinished group (its samples'
            tokens so far, continued next step under the new weights). Nothing is dropped.
        max_staleness: steps a group may be carried; one carried that long must complete in the next rollout
            (the stalest B at most, as only B groups fit a batch).
    """

    prompts_per_step: int = 1
    dynamic_sampling: bool = False
    max_rollouts_per_step: int = 4
    over_provision: float = 1.0
    max_staleness: int = 2

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "max_rollouts_per_step"):
            check_field(self, name, check_int, 1)
        check_bool("dynamic_sampling", self.dynamic_sampling)  # "false" would be truthy: dynamic sampling on
        try:
            check_field(self, "over_provision", check_real, low=1)
        except ValueError as error:
            raise ValueError(f"{error} (1.0: no partial rollouts)") from None
        check_field(self, "max_staleness", check_int, 1, hint="steps a group may be carried")

    @property
    def partial(self) -> bool:
        """Whether partial rollouts are on (``over_provision > 1``)."""
        return self.over_provision > 1

    @property
    def groups_per_rollout(self) -> int:
        """The most groups a rollout runs at once: ``ceil(over_provision x B)``, a step's first with partial
        rollouts (carried and fresh groups), else B."""
        return math.ceil(self.over_provision * self.prompts_per_step)


@dataclass(frozen=True)
class ValidationConfig:
    """The held-out prompts' rollouts.

    Attributes:
        val_batch_size: greedy validation rollouts (one completion per prompt, the policy's argmax, no repetition
            penalty) of this many prompts at a time, ``val_max_new_tokens`` long (None: the sampling cap).
        val_max_new_tokens: see ``val_batch_size``.
        val_num_samples: k > 1 also draws k completions per held-out prompt at ``val_temperature``
            (``RolloutBatch.sampled_accuracy``, for mean@k and pass@k); 1 validates greedily only.
        val_temperature: see ``val_num_samples``.
    """

    val_batch_size: int = 32
    val_max_new_tokens: int | None = None
    val_num_samples: int = 1
    val_temperature: float = 1.0

    def __post_init__(self) -> None:
        for name in ("val_batch_size", "val_num_samples"):
            check_field(self, name, check_int, 1)
        check_field(self, "val_max_new_tokens", check_int, 1, none="null in YAML: the sampling cap")
        check_field(self, "val_temperature", check_real, low=MIN_TEMPERATURE)

    def length_cap(self, sampling_cap: int) -> int:
        """Validation's length cap: ``val_max_new_tokens``, else the training rollouts' (``sampling_cap``)."""
        return self.val_max_new_tokens or sampling_cap


@dataclass(frozen=True)
class AdvantageConfig:
    """How the reward functions' values become advantages: part of the module's objective (``GRPOModule``'s
    settings of the same names, handed to the data side by ``RolloutDataModule.attach``).

    Attributes:
        scale_rewards: advantage scaling, "group" | "batch" | "none".
        multi_objective_aggregation: "sum_then_normalize" scales the functions' weighted sum by ``scale_rewards``;
            "normalize_then_sum" (GDPO) normalizes each function within its group, sums them with their weights
            and normalizes that sum over the batch (every rank's). It also says which groups dynamic sampling drops
            as without signal, and counts in ``num_groups_zero_std``: under "normalize_then_sum" those in which
            every function's values are equal (``zero_std_groups``), whatever their totals do.
    """

    scale_rewards: str = "group"
    multi_objective_aggregation: str = "sum_then_normalize"

    def __post_init__(self) -> None:
        check_choice("scale_rewards", self.scale_rewards, SCALES)
        check_choice("multi_objective_aggregation", self.multi_objective_aggregation, AGGREGATIONS)


@dataclass(frozen=True)
class ScoringConfig:
    """How the reward functions' results are read.

    Attributes:
        accuracy_reward: the reward whose values are correctness (``RolloutBatch.accuracy``); None: the first of
            ``accuracy`` and ``math`` among the reward functions, else none (``rewards.correctness_reward``, which
            checks a name against the functions).
        on_reward_error: "raise" (stop, naming the function and the prompt) or "skip_group" (the group is scored 0
            and trained on not at all).
    """

    accuracy_reward: str | None = None
    on_reward_error: str = "raise"

    def __post_init__(self) -> None:
        check_choice("on_reward_error", self.on_reward_error, ON_ERROR)
