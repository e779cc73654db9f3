"""The scalars that describe one training step's batch: ``reward/*`` and ``completions/*`` (one definition, used by
``GRPOModule`` and by ``lit_grpo.callbacks.CompletionLogger``), and how every logged key becomes the whole step's
under several processes (``RANK_REDUCTIONS``: one gather of every rank's values, then a sum, mean, min or max per
key, the same on every rank)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from lit_grpo.rollout.reward_log import LOGGED_REWARD_PREFIXES
from lit_grpo.runtime.validation import shown_keys, shown_value
from lit_grpo.scheduling.base import DECISION_NAMES


def completion_length_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """``completions/{mean,min,max}_length`` and ``completions/clipped_ratio``.

    Args:
        lengths: completion tokens of every sample, any shape (e.g. ``[B, G]`` or flat ``[N]``), not empty.
        truncated: same shape, True where a completion was cut by ``max_new_tokens`` (no EOS).
    """
    return on_host(_completion_length_values(lengths, truncated))


def reward_metrics(rewards: torch.Tensor, reward_components: dict[str, torch.Tensor], num_groups_zero_std: int,
                   num_groups_generated: int) -> dict[str, float]:
    """``reward/{mean, std, frac_zero_std, <fn_name>/mean}`` of one batch, and the weights of its ratio keys
    (``RATIO_WEIGHTS``).

    Args:
        rewards: ``[B, G]`` weighted total rewards.
        reward_components: ``{fn_name: [B, G]}`` each function's raw values (NaN where it returned None).
        num_groups_zero_std, num_groups_generated: groups without learning signal (``RolloutBatch``'s) / all
            groups sampled for this step (dynamic sampling's dropped groups included).
    """
    return _without_absent(on_host(_reward_values(rewards, reward_components, num_groups_zero_std,
                                                  num_groups_generated)))


def rollout_metrics(batch: Any) -> dict[str, float]:
    """reward/ and completions/ scalars of a ``RolloutBatch``, plus what the data side put in ``batch.metrics``
    (curriculum/*, rollout/rollouts_per_step, ...), and the weights of their ratio keys (``RATIO_WEIGHTS``); the
    batch's tensors are read to the host once."""
    values = _reward_values(batch.rewards, batch.reward_components, batch.num_groups_zero_std,
                            batch.num_groups_generated)
    values.update(_completion_length_values(batch.completion_lengths, batch.truncated))
    values.update({key: float(value) for key, value in batch.metrics.items()})
    values["weight/completion_tokens"] = batch.drawn_mask().sum()
    return _without_absent(on_host(values))


def on_host(values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """``values`` with every scalar tensor among them read to the host in one copy (one wait on the device)."""
    keys = [key for key, value in values.items() if isinstance(value, torch.Tensor)]
    read = torch.stack([values[key].detach().double() for key in keys]).tolist() if keys else []
    return {**values, **dict(zip(keys, read))}


def _completion_length_values(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, torch.Tensor]:
    lengths = lengths.detach().double()
    return {"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(), "completions/clipped_ratio": truncated.detach().double().mean()}


def _reward_values(rewards: torch.Tensor, reward_components: dict[str, torch.Tensor], num_groups_zero_std: int,
                   num_groups_generated: int) -> dict[str, torch.Tensor | float]:
    """``reward_metrics``' values before the read; a function's mean whose weight is 0 (no value present) is left
    out after it (``_without_absent``)."""
    rewards = rewards.float()
    out: dict[str, torch.Tensor | float] = {
        "reward/mean": rewards.mean(),
        # mean over groups of the group's reward std: the spread GRPO learns from (TRL 1.16's reward_std is the
        # whole batch's std, which counts the spread between groups too)
        "reward/std": rewards.std(dim=1).mean() if rewards.shape[1] > 1 else 0.0,
        "reward/frac_zero_std": num_groups_zero_std / max(num_groups_generated, 1),
        "weight/groups_generated": float(num_groups_generated),
    }
    for name, values in reward_components.items():
        present = ~torch.isnan(values)
        out[f"reward/{name}/mean"] = values.double().nan_to_num().sum() / present.sum().clamp(min=1)
        out[ratio_weight(f"reward/{name}/mean")] = present.sum()
    return out


def _without_absent(metrics: dict[str, float]) -> dict[str, float]:
    """Leaves out each reward function's mean (and its weight) that no value of the batch was present for."""
    absent = {key for key in metrics if key.startswith("reward/") and metrics.get(ratio_weight(key)) == 0}
    dropped = absent | {ratio_weight(key) for key in absent}
    return {key: value for key, value in metrics.items() if key not in dropped}


# ---------------------------------------------------------------------------------------------------------------
# Several processes: every logged key as the whole step's
# ---------------------------------------------------------------------------------------------------------------

#: GRPOModule's keys (``training_step``), in the order every rank gathers them; ``reward/<fn_name>/mean`` follow.
#: Rules: "mean" over ranks (every rank holds B x G rows, so the ranks' row means average to the step's; a token
#: mean such as train/entropy becomes the mean of the ranks' token means), "sum" for counts, "min" / "max" for
#: extremes, and "skew" for rollout/rank_skew (its value on a rank is that rank's rollout seconds; reduced, the
#: slowest rank's over the mean).
STEP_REDUCTIONS: dict[str, str] = {
    "train/loss": "mean",  # each rank's own rows' loss, or its share x the world size (GRPOModule's docstring)
    "train/kl": "mean",
    "train/clip_ratio_low": "mean",
    "train/clip_ratio_high": "mean",
    "train/entropy": "mean",
    "train/grad_norm": "mean",  # the same on every rank: the norm of the reduced gradients
    "train/lr": "mean",
    "train/entropy_coef": "mean",  # the same on every rank (one control, fed the step's entropy over ranks)
    "train/phi_seq_mean": "mean",
    "sampling/sampling_logp_difference/mean": "mean",
    "sampling/sampling_logp_difference/max": "max",
    "sampling/importance_sampling_ratio/min": "min",
    "sampling/importance_sampling_ratio/mean": "mean",
    "sampling/importance_sampling_ratio/max": "max",
    "reward/mean": "mean",
    "reward/std": "mean",  # a mean over groups; every rank holds B groups
    "reward/frac_zero_std": "mean",  # weighted by the groups each rank generated (RATIO_WEIGHTS)
    "reward/skipped_groups": "sum",
    "completions/mean_length": "mean",
    "completions/min_length": "min",
    "completions/max_length": "max",
    "completions/clipped_ratio": "mean",
    "rollout/rollouts_per_step": "max",  # the rank that needed most rounds sets the step's
    "rollout/carried_samples": "sum",
    "rollout/offpolicy_tokens_frac": "mean",
    "data/prompts_unused": "max",  # counted for the whole step, the same on every rank
    "rollout/slots": "max",
    "curriculum/mu": "mean",  # the same on every rank (one data-steering state)
    "curriculum/mean_angle": "mean",
    "rollout/rank_skew": "skew",
    "tools/call_frequency": "mean",  # calls per completion generated, weighted by each rank's (RATIO_WEIGHTS)
    "tools/failure_frequency": "mean",  # of the calls, weighted by each rank's (RATIO_WEIGHTS)
}

#: RolloutProfiler's keys (``rollout/<RolloutStats field>``): the step waits for its slowest rank, so times, decode
#: steps and per-step or per-token costs are the slowest rank's (max); token and sample counts add up; throughput
#: is every rank's tokens over the slowest rank's time (``DERIVED``; the sum of the ranks' where those keys are not
#: logged); the KV peaks are per process (max); ``preempting`` is the share of ranks (of their rounds) that
#: preempted (mean); the scheduling decisions of each ``action_reason`` add up.
ROLLOUT_REDUCTIONS: dict[str, str] = {
    "rollout/decode_steps": "max",
    "rollout/lower_bound_steps": "max",
    "rollout/slot_utilization": "mean",
    "rollout/prefill_tokens": "sum",
    "rollout/generated_tokens": "sum",
    "rollout/tokens_per_s": "sum",
    "rollout/wall_s": "max",
    "rollout/ms_per_step": "max",
    "rollout/decode_ms_per_step": "max",
    "rollout/prefill_ms_per_token": "max",
    "rollout/floor_ms_per_step": "max",
    "rollout/roofline_ratio": "max",  # where ms_per_step and the floor are logged, their ratio (DERIVED)
    "rollout/capture_s": "max",
    "rollout/peak_kv_bytes": "max",
    "rollout/length_pred_kendall_tau": "mean",
    "rollout/length_pred_smape": "mean",
    "rollout/parked_samples": "sum",
    "rollout/parked_kv_bytes": "max",
    "rollout/preempting": "mean",
    **{f"rollout/decisions/{name}": "sum" for name in DECISION_NAMES},
}

#: How every logged key becomes the whole step's under several processes: the one table (``rank_reduction``).
RANK_REDUCTIONS: dict[str, str] = {**STEP_REDUCTIONS, **ROLLOUT_REDUCTIONS}

#: Keys whose whole-step value is a ratio of two reduced keys, where both are logged: ``key: (numerator,
#: denominator)``. The ranks generate at once and the step waits for the slowest, so its throughput is all tokens
#: over the slowest rank's time (a sum of the ranks' own rates would count a fast rank's rate for the whole step);
#: likewise the step's distance from its floor is the slowest rank's step over the largest floor.
DERIVED: dict[str, tuple[str, str]] = {"rollout/tokens_per_s": ("rollout/generated_tokens", "rollout/wall_s"),
                                       "rollout/roofline_ratio": ("rollout/ms_per_step", "rollout/floor_ms_per_step")}

#: Keys named at run time, as ``(prefix, suffix, rule)``: each reward function's mean and what reward functions log
#: (``log_metric``; sampled validation's under ``reward_at_k/``), and PeakMemoryMonitor's ``memory/*`` (peaks of one
#: process, and what a phase added to it: the largest rank's).
RANK_REDUCTION_FAMILIES: tuple[tuple[str, str, str], ...] = (
    *((f"{prefix}/", "", "mean") for prefix in LOGGED_REWARD_PREFIXES), ("memory/", "", "max"))

#: Keys whose whole-step value is a ratio of two sums (a share of groups or tokens, a mean over tokens), whose
#: denominator differs between ranks: a rank reports that denominator beside the value, under its weight key
#: (``weight/...``: gathered with the values, never logged), and a "mean" becomes sum(value x weight) /
#: sum(weight) over the ranks, the ratio of the sums one process holding every rank's rows would log. Each
#: ``reward/<fn_name>/mean`` is weighted by its present (not None) values, under ``weight/reward/<fn_name>/mean``;
#: each ``reward/<name>`` a reward function logs, by the values logged, under ``weight/reward/<name>``.
RATIO_WEIGHTS: dict[str, str] = {
    "reward/frac_zero_std": "weight/groups_generated",
    "rollout/offpolicy_tokens_frac": "weight/completion_tokens",
    "train/clip_ratio_low": "weight/clip_units",
    "train/clip_ratio_high": "weight/clip_units",
    "train/kl": "weight/loss_tokens",
    "train/phi_seq_mean": "weight/completions",
    "train/entropy": "weight/completion_tokens",
    "sampling/sampling_logp_difference/mean": "weight/sampling_logp_tokens",
    "sampling/importance_sampling_ratio/mean": "weight/importance_sampling_ratios",
    "rollout/slot_utilization": "weight/slot_steps",
    "tools/call_frequency": "weight/groups_generated",  # G completions a group on every rank
    "tools/failure_frequency": "weight/tool_calls",
}
WEIGHT_PREFIX = "weight/"


def ratio_weight(key: str) -> str | None:
    """The weight key of a ratio ``key`` (``RATIO_WEIGHTS``), or None for a key that is not a ratio."""
    if key in RATIO_WEIGHTS:
        return RATIO_WEIGHTS[key]
    if key.startswith(tuple(f"{prefix}/" for prefix in LOGGED_REWARD_PREFIXES)) and key not in RANK_REDUCTIONS:
        return WEIGHT_PREFIX + key  # a function's mean, or what one logged
    return None


def with_weights(keys: Sequence[str]) -> list[str]:
    """``keys`` and, after them, the weight keys of the ratios among them (each once), in one order."""
    weights = [ratio_weight(key) for key in keys]
    return [*keys, *dict.fromkeys(weight for weight in weights if weight is not None)]


def loggable(values: Mapping[str, float | None]) -> dict[str, float | None]:
    """``values`` without the weights of its ratio keys (``RATIO_WEIGHTS``), which are never logged."""
    return {key: value for key, value in values.items() if not key.startswith(WEIGHT_PREFIX)}


def rank_reduction(key: str) -> str:
    """The rule that makes ``key`` the whole step's over ranks: "mean", "sum", "min", "max" or "skew" ("sum" for a
    ratio's weight, a count)."""
    if not isinstance(key, str):
        raise ValueError(f"logged key {shown_value(key)} ({type(key).__name__}) is not a string: a logged key is the "
                         "name a logger shows (reward/<name>, ...)")
    if key in RANK_REDUCTIONS:
        return RANK_REDUCTIONS[key]
    if key.startswith(WEIGHT_PREFIX):
        return "sum"
    for prefix, suffix, rule in RANK_REDUCTION_FAMILIES:
        if key.startswith(prefix) and key.endswith(suffix):
            return rule
    raise ValueError(f"logged key {shown_value(key)} has no rule for reducing it over ranks; add one to "
                     "lit_grpo.rollout.metrics.RANK_REDUCTIONS")


def _skew(values: list[float]) -> float:
    """The largest of ``values`` over their mean (1.0 when all are 0: nothing to wait for)."""
    mean = math.fsum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


_RULES: dict[str, Callable[[list[float]], float]] = {
    "mean": lambda values: math.fsum(values) / len(values),
    "sum": math.fsum,
    "min": min,
    "max": max,
    "skew": _skew,
}


def step_metric_keys(reward_names: Iterable[str], logged: Iterable[str] = ()) -> list[str]:
    """Every key a GRPOModule training step may log, in one order on every rank: ``STEP_REDUCTIONS``' keys, then
    ``reward/<name>/mean`` for each reward function (the same functions on every rank), then the ``logged`` keys
    (what reward functions logged on any rank, ``logged_reward_keys``), then the ratios' weights."""
    return with_weights([*STEP_REDUCTIONS, *(f"reward/{name}/mean" for name in reward_names), *logged])


def logged_reward_keys(metrics: Iterable[str], reward_names: Iterable[str]) -> list[str]:
    """The keys among ``metrics`` that reward functions logged (``reward/<name>``, ``log_metric``): those that
    ``step_metric_keys(reward_names)`` does not name, sorted."""
    fixed = set(step_metric_keys(reward_names))
    return sorted(key for key in metrics if key not in fixed and key.startswith("reward/"))


def gather_over_ranks(values: Mapping[str, float | None], keys: Sequence[str],
                      all_gather: Callable[[torch.Tensor], torch.Tensor]) -> list[dict[str, float]]:
    """Every rank's ``values``, by one collective: a ``[2, K]`` float64 tensor (the values in ``keys``' order, and
    1.0 where this rank has the key; a None value is absent) through ``all_gather`` (``[2, K]`` ->
    ``[world, 2, K]``). Every rank must call it at the same point with the same ``keys``, which is why a key of
    ``values`` outside ``keys`` is an error rather than left out. Returns one dict per rank, its present keys."""
    unknown = [key for key in values if key not in keys]
    if unknown:
        raise ValueError(f"logged keys {shown_keys(unknown)} are not among the {len(keys)} keys gathered over "
                         "ranks, so they cannot be reduced; list them with their rule in lit_grpo.rollout.metrics "
                         "(STEP_REDUCTIONS for a training step's keys)")
    local = torch.zeros(2, len(keys), dtype=torch.float64)
    for index, key in enumerate(keys):
        value = values.get(key)
        if value is not None:
            local[0, index], local[1, index] = float(value), 1.0
    gathered = all_gather(local).detach().to("cpu", torch.float64).reshape(-1, 2, len(keys))
    return [{key: float(rank[0, i]) for i, key in enumerate(keys) if rank[1, i] > 0} for rank in gathered]


def reduce_over_ranks(per_rank: Sequence[Mapping[str, float]], keys: Sequence[str]) -> dict[str, float]:
    """The whole step's value of each of ``keys`` from every rank's values (``per_rank[r][key]``), by
    ``rank_reduction(key)``'s rule over the ranks that have it, a ratio's "mean" weighted by its weight where every
    such rank reports one (``RATIO_WEIGHTS``); a key no rank has is left out, and so are the weights. In ``keys``'
    order, and the same on every rank (it reads the same gathered values)."""
    if not per_rank:
        raise ValueError("reduce_over_ranks needs the values of at least one rank, got none")
    out = {}
    for key in keys:
        if not isinstance(key, str):
            rank_reduction(key)  # refuses it, naming it
        if key.startswith(WEIGHT_PREFIX):
            continue
        ranks = [values for values in per_rank if values.get(key) is not None]
        if not ranks:
            continue
        weight = ratio_weight(key)
        weights = [values.get(weight) for values in ranks] if weight is not None else [None]
        if rank_reduction(key) == "mean" and None not in weights and math.fsum(weights) > 0:
            out[key] = math.fsum(v[key] * w for v, w in zip(ranks, weights)) / math.fsum(weights)
        else:
            out[key] = _RULES[rank_reduction(key)]([float(values[key]) for values in ranks])
    for key, (numerator, denominator) in DERIVED.items():
        if key in out and numerator in out and out.get(denominator, 0.0) > 0:
            out[key] = out[numerator] / out[denominator]
    return out


def whole_step_metrics(values: Mapping[str, float | None], keys: Sequence[str],
                       all_gather: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
    """``values`` of this rank as the whole step's (one collective; ``gather_over_ranks``, ``reduce_over_ranks``)."""
    return reduce_over_ranks(gather_over_ranks(values, keys, all_gather), keys)
