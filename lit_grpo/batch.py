"""``RolloutBatch``: one training step's scored completions, what one ``GRPOModule.training_step`` consumes.

Shapes: ``B`` prompts, ``G`` completions per prompt, ``P`` padded prompt length, ``T`` padded completion length.
Completion ``k`` of prompt ``p`` is row ``p * G + k`` once flattened (the same flat index as the engine's slot
timeline).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_grpo.sampling.stats import RolloutStats


@dataclass
class RolloutBatch:
    """One training step's ``B`` prompts x ``G`` completions (from one or more rollouts), scored, with advantages.

    Attributes:
        stats: the engine's ``RolloutStats`` (merged over the step's rollouts when dynamic sampling drew more prompts).
        prompts: ``[B]`` the prompt texts as the reward functions saw them (the question, before the chat template).
        completions: ``[B][G]`` decoded completion texts (special tokens dropped).
        rewards: ``[B, G]`` float, the weighted total reward.
        completion_lengths: ``[B, G]`` long, completion tokens the policy drew (EOS included when produced; a tool's
            appended result not counted, as TRL's).
        truncated: ``[B, G]`` bool, hit ``max_new_tokens`` without EOS or a stop string.
        advantages: ``[B, G]`` float, from ``group_advantages``.
        prompt_ids: ``[B, P]`` long, chat-templated prompt tokens, LEFT-padded with ``pad_token_id``.
        prompt_mask: ``[B, P]`` long, 1 on real prompt tokens.
        completion_ids: ``[B, G, T]`` long, RIGHT-padded with ``pad_token_id``.
        completion_mask: ``[B, G, T]`` long, 1 on real completion tokens.
        sampling_logprobs: ``[B, G, T]`` float, log-probs of the sampled tokens under the sampling policy (0 on pad).
        reward_components: ``{name: [B, G]}`` each reward function's raw values (NaN where it said None).
        accuracy: ``[B, G]`` correctness of each completion (the values of the reward named ``accuracy_reward``,
            NaN where it had no opinion), or None when no reward function measures correctness.
        reward_extras: ``{column: [B][G]}`` what the reward functions logged per completion with ``log_extra``
            (None where a completion got no value; ``lit_grpo.rollout.reward_log``).
        columns: ``{name: [B] list}`` per-prompt extra data (``answer``, ``entry``, JSONL fields...).
        indices: ``[B]`` each prompt's index in the train (or val) prompt list.
        metrics: extra scalars the data side wants logged (``curriculum/mu``, ``rollout/rollouts_per_step`` ...).
        max_new_tokens: the rollout's length cap (dr_grpo's normalizer, the overlong penalty's cap).
        temperature: the sampling temperature (the update divides logits by it, as the sampler did; 0 = greedy).
        pad_token_id: the padding id used in the id tensors.
        num_groups_generated: groups sampled for this step (more than ``B`` with dynamic sampling).
        num_groups_zero_std: of those, groups without learning signal: whose rewards were all equal (under
            ``multi_objective_aggregation="normalize_then_sum"``: whose every reward function's values were).
        offpolicy_tokens: completion tokens sampled by weights older than this step's (groups carried from an
            earlier step by partial rollouts); the sampler correction's "auto" mode corrects a batch with any.
        split: ``"train"`` or ``"val"``.
        skipped: ``[B]`` bool, groups skipped because a reward function raised (``on_reward_error="skip_group"``):
            zero advantages and no loss tokens. None means none skipped.
        tool_mask: ``[B, G, T]`` long, 1 on tokens the policy drew, 0 on tool results appended to the completion
            (EXPERIMENTAL ``data.tools``; TRL's name), which get no loss, KL, entropy or sampler correction; None
            without tools (every completion token drawn).
        sampled_accuracy: ``[B, k]`` validation only (``val_num_samples`` k > 1): correctness of k sampled
            completions per held-out prompt (NaN where the reward had no opinion), beside the greedy ``accuracy``.
        generated_accuracy: ``[4]`` ``accuracy_sums`` over every group generated for this step but the skipped
            ones, dynamic sampling's dropped groups included (the curriculum's feedback, which the kept groups
            alone would bias towards one half); None: the batch's own groups'.
    """

    stats: RolloutStats
    prompts: list[str]
    completions: list[list[str]]
    rewards: torch.Tensor
    completion_lengths: torch.Tensor
    truncated: torch.Tensor
    advantages: torch.Tensor
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    sampling_logprobs: torch.Tensor
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)
    reward_extras: dict[str, list[list[Any]]] = field(default_factory=dict)
    columns: dict[str, list[Any]] = field(default_factory=dict)
    indices: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    max_new_tokens: int = 0
    temperature: float = 1.0
    pad_token_id: int = 0
    num_groups_generated: int = 0
    num_groups_zero_std: int = 0
    offpolicy_tokens: int = 0
    split: str = "train"
    skipped: torch.Tensor | None = None
    tool_mask: torch.Tensor | None = None
    accuracy: torch.Tensor | None = None
    sampled_accuracy: torch.Tensor | None = None
    generated_accuracy: torch.Tensor | None = None

    def accuracy_sums(self) -> torch.Tensor:
        """``generated_accuracy``, else ``accuracy_sums`` of this batch's groups (their scored completions)."""
        if self.generated_accuracy is not None:
            return self.generated_accuracy
        return accuracy_sums(self.accuracy, scored_rewards(self.rewards, self.reward_components))

    # ------------------------------------------------------------------------------------------ sizes
    @property
    def num_prompts(self) -> int:
        """``B``."""
        return self.rewards.shape[0]

    @property
    def group_size(self) -> int:
        """``G``."""
        return self.rewards.shape[1]

    @property
    def num_completions(self) -> int:
        """``N = B x G``."""
        return self.rewards.numel()

    def __len__(self) -> int:
        return self.num_completions

    # ------------------------------------------------------------------------------------------ device
    def to(self, device: torch.device | str, **kwargs: Any) -> RolloutBatch:
        """A copy with every tensor on ``device`` (Lightning's batch transfer calls this)."""
        def move(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value.to(device, **kwargs)
            if isinstance(value, dict):
                return {k: move(v) for k, v in value.items()}
            return value

        return dataclasses.replace(self, **{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if f.name not in ("stats", "prompts", "completions", "columns",
                                                              "indices", "metrics")})

    # ------------------------------------------------------------------------------------------ flat views
    def flat_completion_ids(self) -> torch.Tensor:
        """``[N, T]``."""
        return self.completion_ids.flatten(0, 1)

    def flat_completion_mask(self) -> torch.Tensor:
        """``[N, T]``."""
        return self.completion_mask.flatten(0, 1)

    def drawn_mask(self) -> torch.Tensor:
        """``[B, G, T]`` 1 on the completion tokens the policy drew: ``completion_mask`` without tool results."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    def flat_advantages(self) -> torch.Tensor:
        """``[N]``."""
        return self.advantages.flatten()

    @functools.cached_property
    def _host_lengths(self) -> tuple[list[int], list[int]]:
        """Each prompt's real tokens (``B``) and each completion row's (``N``), on the host: read once per batch
        (one device-to-host copy), so that cutting the step's micro-batches waits on the device not once each."""
        lengths = torch.cat([self.prompt_mask.sum(dim=1), self.flat_completion_mask().sum(dim=1)]).tolist()
        return lengths[:self.num_prompts], lengths[self.num_prompts:]

    def micro_batch(self, rows: Sequence[int] | torch.Tensor) -> dict[str, Any]:
        """Model inputs for some flat completion rows, trimmed to the longest prompt / completion among them.

        Returns a dict with ``input_ids``, ``attention_mask``, ``position_ids``: ``[m, P' + T']``, the prompt
        left-padded and the completion right-padded, positions counting real tokens only (so padding never shifts
        them); ``completion_ids``, ``completion_mask``, ``sampling_logprobs``, ``drawn_mask`` (``drawn_mask()``'s
        rows: the tokens a loss may weigh): ``[m, T']``; ``advantages``:
        ``[m]``; ``truncated``: ``[m]``; ``skipped``: ``[m]`` bool (the row's group was skipped); and what the
        host knows without asking the device: ``prompt_length`` ``P'``, ``shortest_prompt`` (the fewest real
        prompt tokens of a row), ``num_tokens`` (real completion tokens in all) and ``prompt_groups``
        (``[u]`` the first row of each of the ``u`` prompts, ``[m]`` each row's prompt among them:
        ``lit_grpo.update.shared_prefix.prompt_groups``'s answer, by prompt index rather than content).
        ``rows`` given as a list or range cost no synchronisation; a tensor of rows is read to the host first.
        """
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        prompt_lengths, completion_lengths = self._host_lengths
        prompts = [row // self.group_size for row in rows]
        keep_p = max(prompt_lengths[p] for p in prompts)
        num_tokens = sum(completion_lengths[row] for row in rows)
        keep_t = max(max(completion_lengths[row] for row in rows), 1)
        order = list(dict.fromkeys(prompts))  # the distinct prompts, in order of their first row
        group = [order.index(p) for p in prompts]
        first = [prompts.index(p) for p in order]
        # one host-to-device copy for every index, without a wait: a pageable source is staged at once
        host = torch.tensor([*rows, *prompts, *first, *group], dtype=torch.long)
        index, prompt_rows, first, group = host.to(self.rewards.device, non_blocking=True).split(
            [len(rows), len(rows), len(order), len(rows)])
        prompt_ids = self.prompt_ids[prompt_rows][:, self.prompt_ids.shape[1] - keep_p:]
        prompt_mask = self.prompt_mask[prompt_rows][:, self.prompt_mask.shape[1] - keep_p:]
        completion_mask = self.flat_completion_mask()[index][:, :keep_t]
        completion_ids = self.flat_completion_ids()[index][:, :keep_t]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        return {
            "input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "drawn_mask": (completion_mask if self.tool_mask is None
                           else completion_mask * self.tool_mask.flatten(0, 1)[index][:, :keep_t]),
            "sampling_logprobs": self.sampling_logprobs.flatten(0, 1)[index][:, :keep_t],
            "advantages": self.flat_advantages()[index],
            "truncated": self.truncated.flatten()[index],
            "skipped": (self.skipped[prompt_rows] if self.skipped is not None
                        else torch.zeros(len(rows), dtype=torch.bool, device=index.device)),
            "prompt_length": keep_p,
            "shortest_prompt": min(prompt_lengths[p] for p in prompts),
            "num_tokens": num_tokens,
            "prompt_groups": (first, group),
        }


# ---------------------------------------------------------------------------------------------- helpers
def pad_left(sequences: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, max_len]`` ids and mask, sequences aligned to the right."""
    width = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq):] = 1
    return ids, mask


def pad_right(sequences: list[list[Any]], pad: Any, width: int | None = None,
              dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, width]`` values and mask, sequences aligned to the left (``width`` >= 1 so empty rollouts work)."""
    width = max(width or 0, max((len(s) for s in sequences), default=0), 1)
    values = torch.full((len(sequences), width), pad, dtype=dtype)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            values[i, : len(seq)] = torch.tensor(seq, dtype=dtype)
            mask[i, : len(seq)] = 1
    return values, mask


def scored_rewards(rewards: torch.Tensor, components: dict[str, torch.Tensor]) -> torch.Tensor:
    """``rewards`` ``[B, G]`` as float with NaN where every reward function said None (``components``: ``{name:
    [B, G]}``, NaN there): such a completion's total of 0.0 is no reward it earned. No components: ``rewards``."""
    rewards = rewards.float()
    if not components:
        return rewards
    unscored = torch.stack([value.isnan() for value in components.values()], dim=-1).all(dim=-1)
    return rewards.masked_fill(unscored, float("nan"))


def accuracy_sums(accuracy: torch.Tensor | None, rewards: torch.Tensor) -> torch.Tensor:
    """``[4]`` float64: ``accuracy`` summed and counted over the completions that have one (NaN: no opinion), and
    ``rewards`` summed and counted over the scored ones (NaN: unscored, ``scored_rewards``), so that a completion
    no function judged does not count as a reward of 0; sums of several ranks add up (``RolloutDataModule``'s
    curriculum feedback)."""
    present = torch.zeros(0) if accuracy is None else accuracy[~torch.isnan(accuracy)].double()
    rewarded = rewards[~torch.isnan(rewards)].double()
    return torch.tensor([float(present.sum()), present.numel(), float(rewarded.sum()), rewarded.numel()],
                        dtype=torch.float64)
