"""lit_grpo's loss against TRL's own ``GRPOTrainer._compute_loss`` on the same per-token log-probs.

    python -m tools.compare_trl_loss [--dtype float64] [--tolerance 1e-5] [--json OUT]

Needs ``trl`` (checked with 1.16.0) importable; the library and its tests never import it. For every loss_type
(grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo; each also with ``off_policy_mask_threshold`` and with
``top_entropy_quantile``, the clip losses also with ``delta``) x importance_sampling_level (token, sequence) x KL
setting (beta 0; beta > 0 without / with kl_bias_correction) x sampler correction (none, and TRL's four modes each
with two pairs of bounds) and several micro-batch shapes, both sides get the same random ``logps`` (a leaf), old,
reference and sampling log-probs, token entropies (float32, as the update's, on a grid of eighths so that ties sit
at the quantile; random on padding too), advantages and masks (one completion without any active token). TRL's
``_compute_loss`` runs on a stand-in trainer whose per-token forward returns that leaf and those entropies, so only
the loss arithmetic is TRL's (its high-entropy mask is its own ``get_high_entropy_mask``, over one process); its
sampler weights come from running the importance-sampling block of TRL's own ``_generate_and_score_completions``
source on those tensors, and the ``sampling/*`` scalars from the block that logs them.

The advantages are compared too, under ``multi_objective_aggregation: normalize_then_sum`` (GDPO) and under
``sum_then_normalize`` with each ``scale_rewards``: TRL's advantage block of ``_generate_and_score_completions``,
run from its source on reward tables with None values (NaN), an unscorable completion, a constant function and a
function with a single value in a group, against ``normalize_then_sum_advantages`` on the same values and weights,
or ``group_advantages`` on their weighted sums (NaN where unscorable, as ``RolloutBuilder`` hands them over).

Each case is compared twice: one micro-batch per optimizer step, and the rows split into two micro-batches
(TRL: ``gradient_accumulation_steps = steps_per_generation = 2``; lit_grpo: ``micro_batch_weight``), summing the
losses and accumulating the gradients. A row reports the largest absolute difference over shapes and splits of
the loss, of its gradient w.r.t. ``logps``, of the sampler weights and sampling/* scalars (where a correction is
on), and of the loss's logged scalars in one micro-batch (``train/clip_ratio_low`` / ``high`` against TRL's
``clip_ratio/low_mean`` / ``high_mean``, or cispo's ``cispo_clip_ratio``, ``train/kl``, and vespo's
``train/phi_seq_mean`` against ``vespo/phi_seq_mean``; over several micro-batches TRL averages their shares,
lit_grpo takes the share of their sums). At the sequence level TRL's
shares count every completion, lit_grpo's those with a loss token (a completion the loss leaves out is no peer of
a clipped one), so TRL's are compared scaled by completions / completions with a loss token. Exits 1 if any
exceeds ``--tolerance``.

The module path is compared apart, for every loss_type (also with ``off_policy_mask_threshold`` and with
``top_entropy_quantile``) x level x beta (0, 0.04) x sampler correction (none, token_truncate, sequence_mask) x ``mask_truncated_completions`` (off, on):
completions with tool results inside (a tool mask) and some truncated, their token ids ending on EOS exactly where
not. TRL's loss masks come from running its ``mask_truncated_completions`` block of
``_generate_and_score_completions`` from its source (the flag read from the ids), ``num_items_in_batch`` is the
loss tokens of every process, its sampler weights are computed on those masks, and its stand-in trainer has
``num_processes`` ranks; ours are ``GRPOModule._loss_mask`` and ``_total_active_tokens`` (summed over the ranks,
as the strategy's reduce does) with ``micro_batch_weight``'s world size. Each shape is run as (ranks, micro-batches
per rank) in ``RANK_SPLITS`` where its rows split evenly, every rank's gradient averaged as ddp does; a row reports
the loss (the ranks' mean) and its gradient w.r.t. ``logps``. Under several ranks ``top_entropy_quantile``'s quantile
spans every rank's micro-batch of the same index on both sides: TRL's ``get_high_entropy_mask`` pads and gathers
across its processes (a stand-in accelerator that knows every process's entropies of that micro-batch), lit_grpo's
ranks run as threads whose all_gather meets in each micro-batch.

The entropy bonus (``entropy_coef``) is compared apart, for every loss_type x level x ``top_entropy_quantile`` (1
and 0.3) and shape, in one and in two micro-batches (beta 0, no sampler correction): the entropies are a leaf with
a gradient on both sides (in ``--dtype``), and a row reports the loss, its gradient w.r.t. ``logps`` and w.r.t. the
entropies. Static: ``entropy_coef`` 0.05. Adaptive (``use_adaptive_entropy``, a target above and one below the
entropies): two optimizer steps on one stand-in TRL trainer and one ``EntropyControl``, the first without the bonus
(no entropy measured yet), the second gated by the first's; the row also reports the coefficient and the last
entropy after each step (TRL's ``entropy_coef`` and ``_last_world_entropy``) and the logged ``entropy_coef``.

The float32 head (``cast_lm_head_to_fp32``) is compared on a model: tiny-llama, untied and tied, as a bfloat16 model
and in float32 under bf16 autocast (bf16-mixed). TRL's side casts its head with the ``_cast_lm_head_to_fp32`` block
of ``GRPOTrainer.__init__``, run from its source, and scores tokens with its fused head (``add_fused_lm_head``); ours
with ``cast_lm_head_to_fp32`` and ``completion_logps``. A row reports the log-probs and their gradient w.r.t. the
head's (float32) weight; both compute in float32 whatever ``--dtype``.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import math
import sys
import textwrap
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from types import MethodType, SimpleNamespace

import torch

from lit_grpo.rollout.advantages import group_advantages, normalize_then_sum_advantages
from lit_grpo.rollout.metrics import loggable
from lit_grpo.runtime.head_precision import cast_lm_head_to_fp32
from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.update.entropy_bonus import EntropyControl, bonus_tokens, bonus_weight, entropy_bonus, entropy_stats
from lit_grpo.update.logprobs import completion_logps
from lit_grpo.update.loss_config import LossConfig
from lit_grpo.update.loss_config import CLIP_LOSSES
from lit_grpo.update.policy_losses import make_loss
from lit_grpo.update.sampler_correction import CorrectionStats, SamplerCorrection
from tools import harness

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
#: Each loss as it is, the clip losses with INTELLECT-2's ``delta`` too (on wider ratios, ``DELTA_SPREAD``, so that
#: some negative-advantage ratios pass it at both levels) and every loss with the off-policy sequence mask and with
#: the high-entropy token mask.
DELTA, DELTA_SPREAD, OPSM, TOP_ENTROPY = 1.35, 2.5, 0.05, 0.3
VARIANTS = (tuple((loss_type, {}) for loss_type in LOSS_TYPES)
            + tuple((loss_type, {"delta": DELTA}) for loss_type in CLIP_LOSSES)
            + tuple((loss_type, {"off_policy_mask_threshold": OPSM}) for loss_type in LOSS_TYPES)
            + tuple((loss_type, {"top_entropy_quantile": TOP_ENTROPY}) for loss_type in LOSS_TYPES))
LEVELS = ("token", "sequence")
KL_SETTINGS = ((0.0, False), (0.04, False), (0.04, True))  # (beta, kl_bias_correction)
IS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SHAPES = ((4, 7), (6, 12), (8, 3))  # (N completions, T tokens)
EPS_LOW, EPS_HIGH, CISPO_EPS_HIGH, MAX_LEN = 0.2, 0.28, 5.0, 16
BOUNDS = ((0.5, 2.0), (None, 3.0))  # (clip_min, clip_max): both bounds, and TRL's defaults
LOSS_METRICS = ("clip_ratio_low", "clip_ratio_high", "kl", "phi_seq_mean")
#: The loss scalars that are shares of what the clip acts on (the others are means over tokens or completions).
CLIP_SHARES = ("clip_ratio_low", "clip_ratio_high")
#: The short name of each variant's option in the printed table.
OPTION_LABELS = {"delta": "delta", "off_policy_mask_threshold": "opsm", "top_entropy_quantile": "entropy"}
#: What a row compares (``max_abs_diff_<kind>``): the loss, its gradient, the sampler weights, sampling/*, train/*.
KINDS = ("loss", "grad", "weights", "metrics", "loss_metrics")


def make_inputs(n: int, t: int, seed: int, dtype: torch.dtype, spread: float = 1.0) -> dict[str, torch.Tensor]:
    """Random tensors of ``n`` completions of ``t`` tokens; ``spread`` widens the ratios to the old log-probs."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    logps = -rand(n, t) * 3
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    lengths[1] = 0  # a completion without any active token
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    return {
        "logps": logps.to(dtype),
        "old": (logps + (rand(n, t) - 0.5) * 0.8 * spread).to(dtype),  # ratios on both sides of the clip range
        "ref": (logps + (rand(n, t) - 0.5) * 0.6).to(dtype),
        "sampling": (logps + (rand(n, t) - 0.5) * 1.6).to(dtype),  # sampler ratios on both sides of the bounds
        "advantages": ((rand(n) - 0.5) * 3).to(dtype),
        "mask": mask,
        # float32 whatever ``dtype``, as the update's; eighths up to 3 nats, so ties are common
        "entropy": torch.randint(1, 25, (n, t), generator=g).float() / 8,
    }


# ------------------------------------------------------------------------------------------------ TRL's side
def trl_block(source: str, start: str, end: str) -> str:
    """The dedented lines of ``source`` from the one containing ``start`` up to the one containing ``end``."""
    lines = source.splitlines()
    first = next(i for i, line in enumerate(lines) if start in line)
    last = next(i for i in range(first + 1, len(lines)) if end in lines[i])
    return textwrap.dedent("\n".join(lines[first:last]))


def trl_sources():
    from trl import GRPOTrainer
    from trl.trainer import utils as trl_utils

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    # the block right after this comment computes the ratio (an earlier `if` with the same test guards old_logps)
    first = source.index("Compute the importance sampling ratio when using vLLM")
    weights = trl_block(source[first:], "if self.use_vllm and self.vllm_importance_sampling_correction:",
                        "Compute the per-token log probabilities for the reference model")
    logged = source.index("delta = torch.abs(old_per_token_logps - sampling_per_token_logps)")
    start = source.rindex("\n", 0, source.rindex("if self.use_vllm", 0, logged)) + 1
    metrics = trl_block(source[start:], "if self.use_vllm", "output = {")
    return GRPOTrainer, weights, metrics, trl_utils


def trl_advantage_source() -> str:
    """TRL's advantages from ``rewards_per_func`` (``[N, K]``, NaN for None), both aggregations, unscorable rows
    zeroed."""
    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    return trl_block(source, "unscorable_mask = torch.isnan(rewards_per_func)", "Slice to keep only the local part")


class _Accelerator:
    num_processes = 1
    gather = staticmethod(lambda x: x.reshape(-1) if x.dim() == 0 else x)
    pad_across_processes = staticmethod(lambda x, dim=0, pad_index=0: x)
    reduce = staticmethod(lambda x, reduction="sum": x)


class _Processes:
    """TRL's accelerator on process ``rank`` of ``len(every)``, in one micro-batch index: ``pad_across_processes``
    pads to the longest of ``every`` (each process's 1-D tensor there, in rank order) and a ``gather`` of what it
    padded returns every process's, padded alike, in rank order; any other gather (logged scalars) is one
    process's."""

    def __init__(self, every: list[torch.Tensor], rank: int):
        self.num_processes, self.every, self.rank = len(every), every, rank
        self._padded: list[torch.Tensor] = []
        self.reduce = _Accelerator.reduce

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        longest = max(len(t) for t in self.every)
        self._padded = [torch.cat([t, t.new_full((longest - len(t),), pad_index)]) for t in self.every]
        self._padded[self.rank] = torch.cat([tensor, tensor.new_full((longest - len(tensor),), pad_index)])
        return self._padded[self.rank]

    def gather(self, tensor):
        if self._padded and tensor is self._padded[self.rank]:
            return torch.cat(self._padded)
        return _Accelerator.gather(tensor)


def run_ranks(world: int, work):
    """``[work(rank, all_gather) for each rank]``, the ranks as threads when ``world`` > 1, their ``all_gather``
    (``tensor -> [world, *shape]``, rank by rank) meeting at a barrier as a collective does; one rank: ``work(0,
    None)``, as the module passes no gather to a single process."""
    if world == 1:
        return [work(0, None)]
    barrier, slots = threading.Barrier(world, timeout=120), [None] * world

    def gather_of(rank):
        def gather(tensor):
            slots[rank] = tensor.clone()
            barrier.wait()
            out = torch.stack(slots)
            barrier.wait()  # every rank has read the slots before any writes the next
            return out
        return gather

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(lambda rank: work(rank, gather_of(rank)), range(world)))


def trl_trainer(loss_type, level, beta, kl_bias_correction, is_mode, accumulation, logps_leaf, eps_high,
                bounds=BOUNDS[0], delta=None, off_policy_mask_threshold=None, top_entropy_quantile=1.0, entropy=None):
    """A stand-in with exactly the attributes ``GRPOTrainer._compute_loss`` reads; its forward returns
    ``logps_leaf`` and ``entropy``."""
    from trl import GRPOTrainer
    args = SimpleNamespace(use_bias_correction_kl=kl_bias_correction, delta=delta, sapo_temperature_pos=1.0,
                           sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                           vespo_lambda_neg=2.0, steps_per_generation=accumulation)
    fake = SimpleNamespace(
        args=args, loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_low=EPS_LOW,
        epsilon_high=eps_high, top_entropy_quantile=top_entropy_quantile,
        off_policy_mask_threshold=off_policy_mask_threshold,
        use_vllm=is_mode != "none", vllm_importance_sampling_correction=is_mode != "none",
        vllm_importance_sampling_mode=is_mode, vllm_importance_sampling_clip_min=bounds[0],
        vllm_importance_sampling_clip_max=bounds[1], max_completion_length=MAX_LEN,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation, accelerator=_Accelerator(), aux_loss_enabled=False,
        _entropy_bonus_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps_leaf, entropy, None),
        get_gamma_weights=GRPOTrainer.get_gamma_weights,  # vespo's weight and the off-policy mask: static methods
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
    )
    # the high-entropy mask reads self.accelerator (its gather over processes): a method of the stand-in
    fake.get_high_entropy_mask = MethodType(GRPOTrainer.get_high_entropy_mask, fake)
    return fake


def trl_weights_and_metrics(trl, inputs, is_mode, bounds):
    _, weights_src, metrics_src, utils = trl
    fake = trl_trainer("grpo", "token", 0.0, False, is_mode, 1, None, EPS_HIGH, bounds)
    scope = {"self": fake, "torch": torch, "math": math, "completion_mask": inputs["mask"], "tool_mask": None,
             "old_per_token_logps": inputs["old"], "sampling_per_token_logps": inputs["sampling"], "mode": "train",
             "device": inputs["old"].device, "nanmin": utils.nanmin, "nanmax": utils.nanmax}
    exec(compile(weights_src, "trl:importance_sampling", "exec"), scope)
    exec(compile(metrics_src, "trl:sampling_metrics", "exec"), scope)
    metrics = {k: v[0] for k, v in fake._metrics["train"].items()}
    return scope["vllm_importance_sampling_ratio"], metrics


def trl_loss(trl, case, inputs, rows_list, weights):
    loss_type, extra, level, beta, kl_bc, is_mode = case
    leaf = inputs["logps"].clone().requires_grad_(True)
    total = 0.0
    eps_high = CISPO_EPS_HIGH if loss_type == "cispo" else EPS_HIGH
    for rows in rows_list:
        part = leaf[rows]
        fake = trl_trainer(loss_type, level, beta, kl_bc, is_mode, len(rows_list), part, eps_high,
                           entropy=inputs["entropy"][rows], **extra)
        n, t = part.shape
        micro = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
                 "completion_ids": torch.zeros(n, t, dtype=torch.long), "completion_mask": inputs["mask"][rows],
                 "advantages": inputs["advantages"][rows], "old_per_token_logps": inputs["old"][rows],
                 "num_items_in_batch": inputs["mask"].sum()}
        if beta:
            micro["ref_per_token_logps"] = inputs["ref"][rows]
        if weights is not None:
            micro["importance_sampling_ratio"] = weights[rows]
        if "off_policy_mask_threshold" in extra:
            micro["sampling_per_token_logps"] = inputs["sampling"][rows]
        loss = trl[0]._compute_loss(fake, None, micro)
        loss.backward()
        total = total + loss.detach()
    return total, leaf.grad, trl_loss_metrics(fake._metrics["train"], level, inputs["mask"][rows])


def trl_loss_metrics(logged: dict, level: str, mask: torch.Tensor) -> dict[str, float]:
    """TRL's logged loss scalars of its last micro-batch under lit_grpo's names; at the sequence level its shares
    over every completion made shares over those with a loss token (the module docstring)."""
    names = {"clip_ratio/low_mean": "clip_ratio_low", "clip_ratio/high_mean": "clip_ratio_high",
             "cispo_clip_ratio": "clip_ratio_high", "kl": "kl", "vespo/phi_seq_mean": "phi_seq_mean"}
    scale = mask.shape[0] / max(int((mask.sum(dim=1) > 0).sum()), 1) if level == "sequence" else 1.0
    return {ours: values[-1] * (scale if ours in CLIP_SHARES else 1.0) for theirs, ours in names.items()
            if (values := logged.get(theirs))}


# ------------------------------------------------------------------------------------------------ ours
def our_loss(case, inputs, rows_list, weights):
    loss_type, extra, level, beta, kl_bc, _ = case
    eps_high = CISPO_EPS_HIGH if loss_type == "cispo" else EPS_HIGH
    loss_fn = make_loss(loss_type, epsilon_low=EPS_LOW, epsilon_high=eps_high, beta=beta,
                        importance_sampling_level=level, kl_bias_correction=kl_bc, **extra)
    leaf = inputs["logps"].clone().requires_grad_(True)
    total, n = 0.0, leaf.shape[0]
    for rows in rows_list:
        loss = loss_fn(leaf[rows], inputs["old"][rows], inputs["advantages"][rows], inputs["mask"][rows],
                       inputs["ref"][rows] if beta else None, MAX_LEN, inputs["mask"].sum(),
                       None if weights is None else weights[rows], inputs["sampling"][rows], inputs["entropy"][rows])
        loss = loss * loss_fn.micro_batch_weight(len(rows), n, len(rows_list))
        loss.backward()
        total = total + loss.detach()
    rows = rows_list[-1]
    logged = loss_fn.metrics(leaf[rows].detach(), inputs["old"][rows], inputs["advantages"][rows],
                             inputs["mask"][rows], inputs["ref"][rows] if beta else None,
                             None if weights is None else weights[rows])
    return total, leaf.grad, {key: float(value) for key, value in logged.items() if key in LOSS_METRICS}


def our_weights_and_metrics(inputs, is_mode, bounds):
    correction = SamplerCorrection(is_mode, *bounds)
    weights = correction.weights(inputs["old"], inputs["sampling"], inputs["mask"])
    stats = CorrectionStats()
    stats.update(inputs["old"], inputs["sampling"], inputs["mask"], weights)
    return weights, loggable(stats.as_metrics())  # the logged scalars, not their weights over ranks


#: (B groups, G completions, K reward functions) of the advantage comparison.
REWARD_SHAPES = ((4, 4, 3), (6, 8, 2), (3, 6, 4))


def make_rewards(b: int, g: int, k: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, g, k]`` reward values on a grid of quarters, NaN for None, and ``[k]`` weights of both signs."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 5, (b, g, k), generator=gen).double() / 4
    values[0, :, 0] = 0.5                                          # a function constant in a group
    values[torch.rand(b, g, k, generator=gen) < 0.3] = math.nan     # None
    values[1, 0] = math.nan                                        # an unscorable completion
    values[-1, 1:, -1] = math.nan                                  # a function with a single value in a group
    weights = torch.rand(k, generator=gen, dtype=torch.float64) * 2 - 0.5
    return values.to(dtype), weights.to(dtype)


#: (multi_objective_aggregation, scale_rewards) of the advantage comparison; normalize_then_sum ignores the scale.
AGGREGATIONS = (("normalize_then_sum", "group"), ("sum_then_normalize", "group"), ("sum_then_normalize", "batch"),
                ("sum_then_normalize", "none"))


def compare_advantages(dtype: torch.dtype) -> dict[str, float]:
    """The largest ``|ours - TRL|`` of the advantages over ``REWARD_SHAPES``, by ``"aggregation/scale"``."""
    from trl.trainer import utils as trl_utils

    source = compile(trl_advantage_source(), "trl:advantages", "exec")
    worst = {}
    for aggregation, scale in AGGREGATIONS:
        key = aggregation if aggregation == "normalize_then_sum" else f"{aggregation}/{scale}"
        worst[key] = 0.0
        for seed, (b, g, k) in enumerate(REWARD_SHAPES):
            values, weights = make_rewards(b, g, k, seed, dtype)
            fake = SimpleNamespace(multi_objective_aggregation=aggregation, reward_weights=weights,
                                   reward_funcs=[None] * k, scale_rewards=scale)
            scope = {"self": fake, "torch": torch, "rewards_per_func": values.reshape(b * g, k),
                     "num_generations": g, "device": values.device, "nanstd": trl_utils.nanstd}
            exec(source, scope)
            if aggregation == "normalize_then_sum":
                ours = normalize_then_sum_advantages(values, weights)
            else:
                totals = (values * weights).nansum(dim=-1).masked_fill(values.isnan().all(dim=-1), math.nan)
                ours = group_advantages(totals.to(dtype), scale).to(dtype)
            worst[key] = max(worst[key], float((ours.reshape(b * g) - scope["advantages"]).abs().max()))
    return worst


# ------------------------------------------------------------------------------------------------ module path
#: (ranks, micro-batches per rank) of the module-path comparison; a shape takes those its rows split into evenly
#: (TRL's micro-batches are always equal).
RANK_SPLITS = ((1, 1), (1, 2), (2, 1), (2, 2))
MODULE_IS_MODES = ("none", "token_truncate", "sequence_mask")
EOS, PAD = 2, 0


def make_module_inputs(n: int, t: int, seed: int, dtype: torch.dtype) -> dict:
    """``make_inputs`` plus a tool mask (tool results inside some completions: 0) and truncation flags, with each
    completion's token ids ending on EOS exactly where it is not truncated (TRL reads the flag from the ids)."""
    inputs = make_inputs(n, t, seed, dtype)
    g = torch.Generator().manual_seed(1000 + seed)
    tool = torch.ones(n, t, dtype=torch.long)
    tool[torch.rand(n, t, generator=g) < 0.2] = 0
    lengths = inputs["mask"].sum(dim=1).tolist()
    truncated = torch.rand(n, generator=g) < 0.4
    truncated[1] = False  # the completion without an active token ends on nothing
    ids = [[5] * (length - 1) + [5 if cut else EOS] for length, cut in zip(lengths, truncated.tolist()) if length]
    ids.insert(1, [PAD])
    return {**inputs, "tool": tool, "truncated": truncated, "ids": ids}


def trl_loss_masks(inputs: dict, rows: torch.Tensor, mask_truncated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's ``completion_mask`` and ``tool_mask`` of one process's ``rows``: the ``mask_truncated_completions`` block
    of ``_generate_and_score_completions``, run from its source."""
    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    block = trl_block(source, "if self.mask_truncated_completions:", "loss_mask = completion_mask if tool_mask")
    fake = SimpleNamespace(mask_truncated_completions=mask_truncated, eos_token_ids=[EOS],
                           _tokenizer=SimpleNamespace(pad_token_id=PAD))
    scope = {"self": fake, "torch": torch, "device": inputs["mask"].device, "completion_mask": inputs["mask"][rows],
             "tool_mask": inputs["tool"][rows], "completion_ids_list": [inputs["ids"][r] for r in rows.tolist()]}
    exec(compile(block, "trl:mask_truncated_completions", "exec"), scope)
    return scope["completion_mask"], scope["tool_mask"]


def trl_module_loss(trl, case, inputs, split, mask_truncated):
    """TRL over ``ranks`` processes of ``micro`` micro-batches each: every process's loss on its rows (its
    masks from ``trl_loss_masks``, ``num_items_in_batch`` the loss tokens of every process), the gradients averaged
    over the processes as ddp does; returns the mean loss and that gradient."""
    loss_type, extra, level, beta, kl_bc, is_mode = case
    ranks, micro = split
    n = inputs["mask"].shape[0]
    leaf = inputs["logps"].clone().requires_grad_(True)
    eps_high = CISPO_EPS_HIGH if loss_type == "cispo" else EPS_HIGH
    per_rank = list(torch.arange(n).chunk(ranks))
    masks = [trl_loss_masks(inputs, rows, mask_truncated) for rows in per_rank]
    num_items = sum((completion * tool).sum() for completion, tool in masks)  # gathered over the processes
    parts = list(torch.arange(n // ranks).chunk(micro))  # every process's micro-batches, alike
    # each process's loss tokens' entropies in each micro-batch, as get_high_entropy_mask takes them
    active = [[inputs["entropy"][rows_of_rank[part]][(completion[part] * tool[part]).bool()].float()
               for rows_of_rank, (completion, tool) in zip(per_rank, masks)] for part in parts]
    total = 0.0
    for rank, (rows_of_rank, (completion_mask, tool_mask)) in enumerate(zip(per_rank, masks)):
        weights = None
        if is_mode != "none":
            masked = {**inputs, "mask": torch.zeros_like(inputs["mask"]), "old": inputs["old"].clone()}
            masked["mask"][rows_of_rank] = completion_mask * tool_mask
            weights = trl_weights_and_metrics(trl, masked, is_mode, BOUNDS[0])[0][rows_of_rank]
        for index, part in enumerate(parts):
            rows = rows_of_rank[part]
            fake = trl_trainer(loss_type, level, beta, kl_bc, is_mode, micro, leaf[rows], eps_high,
                               entropy=inputs["entropy"][rows], **extra)
            fake.accelerator = _Processes(active[index], rank)
            t = leaf.shape[1]
            batch = {"prompt_ids": torch.zeros(len(rows), 1, dtype=torch.long),
                     "prompt_mask": torch.ones(len(rows), 1, dtype=torch.long),
                     "completion_ids": torch.zeros(len(rows), t, dtype=torch.long),
                     "completion_mask": completion_mask[part], "tool_mask": tool_mask[part],
                     "advantages": inputs["advantages"][rows], "old_per_token_logps": inputs["old"][rows],
                     "sampling_per_token_logps": inputs["sampling"][rows], "num_items_in_batch": num_items}
            if beta:
                batch["ref_per_token_logps"] = inputs["ref"][rows]
            if weights is not None:
                batch["importance_sampling_ratio"] = weights[part]
            loss = trl[0]._compute_loss(fake, None, batch) / ranks  # ddp averages the processes' gradients
            loss.backward()
            total = total + loss.detach()
    return total, leaf.grad


def our_module_loss(case, inputs, split, mask_truncated):
    """lit_grpo as ``GRPOModule._update`` runs on each rank: its ``_loss_mask`` and ``_total_active_tokens`` (summed
    over the ranks, as the strategy's reduce does), the sampler correction on that mask, the loss times its
    ``micro_batch_weight``, under several ranks with their all_gather (the ranks as threads, ``run_ranks``); the
    gradients averaged over the ranks."""
    from lit_grpo.update.module import GRPOModule

    loss_type, extra, level, beta, kl_bc, is_mode = case
    ranks, micro = split
    n = inputs["mask"].shape[0]
    eps_high = CISPO_EPS_HIGH if loss_type == "cispo" else EPS_HIGH
    loss_fn = make_loss(loss_type, epsilon_low=EPS_LOW, epsilon_high=eps_high, beta=beta,
                        importance_sampling_level=level, kl_bias_correction=kl_bc, **extra)
    module = SimpleNamespace(hparams=SimpleNamespace(mask_truncated_completions=mask_truncated), _trainer=None)
    module._loss_mask = MethodType(GRPOModule._loss_mask, module)
    drawn = inputs["mask"] * inputs["tool"]
    chunks_of = [[(rows, {"drawn_mask": drawn[rows], "truncated": inputs["truncated"][rows]})
                  for rows in rows_of_rank.chunk(micro)] for rows_of_rank in torch.arange(n).chunk(ranks)]
    total_active = sum(GRPOModule._total_active_tokens(module, chunks) for chunks in chunks_of)
    correction = SamplerCorrection(is_mode, *BOUNDS[0]) if is_mode != "none" else None

    def rank_work(rank, all_gather):
        chunks = chunks_of[rank]
        leaf = inputs["logps"].clone().requires_grad_(True)  # each rank's own: its rows' gradient
        total, rank_rows = 0.0, sum(len(rows) for rows, _ in chunks)
        for rows, batch in chunks:
            mask = module._loss_mask(batch)
            weights = correction.weights(inputs["old"][rows], inputs["sampling"][rows], mask) if correction else None
            loss = loss_fn(leaf[rows], inputs["old"][rows], inputs["advantages"][rows], mask,
                           inputs["ref"][rows] if beta else None, MAX_LEN,
                           total_active if loss_fn.needs_step_tokens else None, weights, inputs["sampling"][rows],
                           inputs["entropy"][rows], all_gather=all_gather)
            loss = loss * loss_fn.micro_batch_weight(len(rows), rank_rows, len(chunks), ranks) / ranks
            loss.backward()
            total = total + loss.detach()
        return total, leaf.grad

    done = run_ranks(ranks, rank_work)
    return sum(total for total, _ in done), sum(grad for _, grad in done)


def compare_module_path(dtype: torch.dtype) -> list[dict]:
    """The module path's rows (module docstring): per loss_type (and with the off-policy mask) x level x beta x
    sampler correction x ``mask_truncated_completions``, the largest ``|ours - TRL|`` of the loss and its gradient
    over the shapes and the even ``RANK_SPLITS``."""
    trl = trl_sources()
    records = []
    variants = tuple((loss_type, {}) for loss_type in LOSS_TYPES) + tuple(
        (loss_type, {"off_policy_mask_threshold": OPSM}) for loss_type in LOSS_TYPES) + tuple(
        (loss_type, {"top_entropy_quantile": TOP_ENTROPY}) for loss_type in LOSS_TYPES)
    for (loss_type, extra), level, beta, is_mode, truncated in itertools.product(
            variants, LEVELS, (0.0, 0.04), MODULE_IS_MODES, (False, True)):
        case = (loss_type, extra, level, beta, False, is_mode)
        worst = {"loss": 0.0, "grad": 0.0}
        for seed, (n, t) in enumerate(SHAPES):
            inputs = make_module_inputs(n, t, seed, dtype)
            for split in RANK_SPLITS:
                if n % (split[0] * split[1]):
                    continue
                want, want_grad = trl_module_loss(trl, case, inputs, split, truncated)
                got, got_grad = our_module_loss(case, inputs, split, truncated)
                worst["loss"] = max(worst["loss"], float((got - want).abs()))
                worst["grad"] = max(worst["grad"], float((got_grad - want_grad).abs().max()))
        records.append({"loss_type": loss_type, **extra, "importance_sampling_level": level, "beta": beta,
                        "importance_sampling_mode": is_mode, "mask_truncated_completions": truncated,
                        **{f"max_abs_diff_{k}": v for k, v in worst.items()}})
    return records


def print_module_path(records: list[dict], tolerance: float) -> int:
    """Print the module path's summary and any row over ``tolerance``; returns how many are over."""
    bad = [r for r in records if max(r["max_abs_diff_loss"], r["max_abs_diff_grad"]) > tolerance]
    largest = {kind: max(r[f"max_abs_diff_{kind}"] for r in records) for kind in ("loss", "grad")}
    for r in bad:
        print("module path MISMATCH: " + ", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"module path (GRPOModule's loss mask and dapo normalizer, mask_truncated_completions off / on, tool "
          f"masks; (ranks, micro-batches) in {RANK_SPLITS}, gradients averaged over ranks): {len(records)} "
          f"combinations, {len(bad)} over {tolerance:g}; largest: loss {largest['loss']:.1e}, grad "
          f"{largest['grad']:.1e}")
    return len(bad)


# ------------------------------------------------------------------------------------------------ entropy bonus
ENTROPY_COEF, ENTROPY_DELTA = 0.05, 0.02
#: (name, adaptive target): the static coefficient; the adaptive control with a target above every entropy (the
#: second step applies the raised coefficient) and one below them (it applies none, the coefficient falls)
ENTROPY_CONTROLS = (("static", None), ("adaptive_high", 10.0), ("adaptive_low", 0.5))
ENTROPY_KINDS = ("loss", "grad", "grad_entropy", "coef", "world_entropy")


class _SyncAccelerator(_Accelerator):
    """The stand-in's accelerator with ``sync_gradients``: True in a step's last micro-batch only."""
    sync_gradients = True


def _entropy_settings(target: float | None) -> dict:
    if target is None:
        return {"entropy_coef": ENTROPY_COEF}
    return {"entropy_coef": ENTROPY_COEF, "use_adaptive_entropy": True, "entropy_coef_delta": ENTROPY_DELTA,
            "entropy_target": target, "entropy_coef_min": 0.0, "entropy_coef_max": 1.0}


def trl_entropy_steps(loss_type, level, top, settings, inputs, rows_list, steps):
    """TRL's ``_compute_loss`` over ``steps`` optimizer steps of ``rows_list`` micro-batches on one stand-in: each
    step's loss, gradients (logps, entropies), coefficient and last entropy after it, and logged entropy_coef."""
    from trl import GRPOTrainer

    eps_high = CISPO_EPS_HIGH if loss_type == "cispo" else EPS_HIGH
    fake = trl_trainer(loss_type, level, 0.0, False, "none", len(rows_list), None, eps_high,
                       top_entropy_quantile=top)
    fake.accelerator = _SyncAccelerator()
    defaults = LossConfig()
    for name in ("entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max"):
        setattr(fake.args, name, settings.get(name, getattr(defaults, name)))
    fake.entropy_coef, fake.use_adaptive_entropy = settings["entropy_coef"], settings.get("use_adaptive_entropy", False)
    fake._entropy_bonus_enabled, fake._last_world_entropy, fake._entropy_window_stats = True, math.inf, None
    out = []
    for _ in range(steps):
        leaf = inputs["logps"].clone().requires_grad_(True)
        entropy = inputs["entropy"].to(leaf.dtype).clone().requires_grad_(True)
        total = 0.0
        for index, rows in enumerate(rows_list):
            fake.accelerator.sync_gradients = index == len(rows_list) - 1
            fake._get_per_token_logps_and_entropies = lambda *a, _r=rows, **k: (leaf[_r], entropy[_r], None)
            n, t = len(rows), leaf.shape[1]
            micro = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long),
                     "prompt_mask": torch.ones(n, 1, dtype=torch.long),
                     "completion_ids": torch.zeros(n, t, dtype=torch.long), "completion_mask": inputs["mask"][rows],
                     "advantages": inputs["advantages"][rows], "old_per_token_logps": inputs["old"][rows],
                     "num_items_in_batch": inputs["mask"].sum()}
            loss = GRPOTrainer._compute_loss(fake, None, micro)
            loss.backward()
            total = total + loss.detach()
        logged = fake._metrics["train"]["entropy_coef"][-1]
        out.append((total, leaf.grad, entropy.grad, fake.entropy_coef, fake._last_world_entropy, logged))
    return out


def our_entropy_steps(loss_type, level, top, settings, inputs, rows_list, steps):
    """lit_grpo's loss and entropy bonus as ``GRPOModule._update`` adds them, over ``steps`` optimizer steps of one
    ``EntropyControl``: the same records as ``trl_entropy_steps`` (the logged coefficient: the control's after the
    step)."""
    eps_high = CISPO_EPS_HIGH if loss_type == "cispo" else EPS_HIGH
    config = LossConfig(loss_type=loss_type, epsilon_low=EPS_LOW, epsilon_high=eps_high,
                        importance_sampling_level=level, top_entropy_quantile=top, **settings)
    loss_fn, control = make_loss(config), EntropyControl(config)
    out, n = [], inputs["logps"].shape[0]
    for _ in range(steps):
        leaf = inputs["logps"].clone().requires_grad_(True)
        entropy = inputs["entropy"].to(leaf.dtype).clone().requires_grad_(True)
        coef, totals, total = control.applied(), torch.zeros(2, dtype=torch.float64), 0.0
        for rows in rows_list:
            mask = inputs["mask"][rows]
            loss = loss_fn(leaf[rows], inputs["old"][rows], inputs["advantages"][rows], mask, None, MAX_LEN,
                           inputs["mask"].sum(), None, inputs["sampling"][rows], entropy[rows].detach())
            loss = loss * loss_fn.micro_batch_weight(len(rows), n, len(rows_list))
            tokens = bonus_tokens(entropy[rows].detach(), mask, top)
            if coef:
                loss = loss - coef * (entropy_bonus(entropy[rows], tokens) * bonus_weight(len(rows_list)))
            totals = totals + entropy_stats(entropy[rows], tokens)
            loss.backward()
            total = total + loss.detach()
        control.end_step(*totals.tolist())
        grad_entropy = entropy.grad if entropy.grad is not None else torch.zeros_like(entropy)
        out.append((total, leaf.grad, grad_entropy, control.coef, control.last_world_entropy, control.coef))
    return out


def compare_entropy_bonus(dtype: torch.dtype) -> list[dict]:
    """The entropy bonus's rows (module docstring): the largest ``|ours - TRL|`` of each of ``ENTROPY_KINDS``."""
    records = []
    for loss_type, level, top, (control, target) in itertools.product(LOSS_TYPES, LEVELS, (1.0, TOP_ENTROPY),
                                                                       ENTROPY_CONTROLS):
        settings, steps = _entropy_settings(target), 1 if target is None else 2
        worst = dict.fromkeys(ENTROPY_KINDS, 0.0)
        for seed, (n, t) in enumerate(SHAPES):
            inputs = make_inputs(n, t, seed, dtype)
            for rows_list in ([torch.arange(n)], list(torch.arange(n).chunk(2))):
                theirs = trl_entropy_steps(loss_type, level, top, settings, inputs, rows_list, steps)
                ours = our_entropy_steps(loss_type, level, top, settings, inputs, rows_list, steps)
                for got, want in zip(ours, theirs):
                    worst["loss"] = max(worst["loss"], float((got[0] - want[0]).abs()))
                    worst["grad"] = max(worst["grad"], float((got[1] - want[1]).abs().max()))
                    worst["grad_entropy"] = max(worst["grad_entropy"], float((got[2] - want[2]).abs().max()))
                    worst["coef"] = max(worst["coef"], abs(got[3] - want[3]), abs(got[5] - want[5]))
                    if got[4] != want[4]:  # both inf without the adaptive control
                        worst["world_entropy"] = max(worst["world_entropy"], abs(got[4] - want[4]))
        records.append({"loss_type": loss_type, "importance_sampling_level": level, "top_entropy_quantile": top,
                        "entropy_control": control, **{f"max_abs_diff_{k}": v for k, v in worst.items()}})
    return records


# ------------------------------------------------------------------------------------------------ float32 head
HEAD_PRECISIONS, HEAD_TEMPERATURE = ("bf16-model", "bf16-mixed"), 0.7


def trl_cast_lm_head():
    """TRL's ``_cast_lm_head_to_fp32(model)``: its block of ``GRPOTrainer.__init__``, run from the source."""
    from trl.trainer import grpo_trainer

    source = inspect.getsource(grpo_trainer.GRPOTrainer.__init__)
    block = textwrap.dedent(trl_block(source, "def _cast_lm_head_to_fp32", "_cast_lm_head_to_fp32(model)"))
    namespace = dict(vars(grpo_trainer))
    exec(block, namespace)
    return namespace["_cast_lm_head_to_fp32"]


def head_model(precision: str, tied: bool) -> torch.nn.Module:
    """tiny-llama in bfloat16 (bf16-model) or float32 (bf16-mixed), its head tied to its embedding when ``tied``."""
    model, _ = load_model_and_tokenizer("tiny-llama", "bfloat16" if precision == "bf16-model" else None)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
        model.config.tie_word_embeddings = True  # what TRL reads to keep the embedding's output in the model's dtype
    return model.train()


def head_logps(model: torch.nn.Module, inputs: dict, precision: str, trl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, T]`` completion log-probs (TRL's: 0 on the prompt, not on the completions' padding) under bf16 autocast
    for bf16-mixed, and their weighted sum's gradient w.r.t. the head's weight."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=precision == "bf16-mixed"):
        if trl:
            labels = inputs["input_ids"].masked_fill(~inputs["label_mask"], -100)
            out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                        fused_lm_head=True)
            logps = out.log_probs[:, -inputs["completion_ids"].shape[1]:]
        else:
            logps, _ = completion_logps(model, inputs, HEAD_TEMPERATURE)
    (logps * inputs["weights"]).sum().backward()
    return logps.detach().double(), model.lm_head.weight.grad.double()


def compare_lm_head() -> list[dict]:
    """Ours against TRL's with ``cast_lm_head_to_fp32``, per precision and tie (module docstring)."""
    from trl.trainer.utils import add_fused_lm_head

    records = []
    for precision, tied in itertools.product(HEAD_PRECISIONS, (False, True)):
        ours, theirs = head_model(precision, tied), head_model(precision, tied)
        cast_lm_head_to_fp32(ours)
        trl_cast_lm_head()(theirs)
        add_fused_lm_head(theirs, temperature=HEAD_TEMPERATURE, cast_lm_head_to_fp32=True)
        worst = {"logps": 0.0, "head_grad": 0.0}
        for seed, (n, t) in enumerate(SHAPES):
            g = torch.Generator().manual_seed(seed)
            prompt = torch.randint(3, ours.config.vocab_size, (n, 5), generator=g)
            completion = torch.randint(3, ours.config.vocab_size, (n, t), generator=g)
            mask = torch.ones(n, t, dtype=torch.long)
            mask[0, t // 2:] = 0  # one completion ends early (right padding)
            ids = torch.cat([prompt, completion], 1)
            attention = torch.cat([torch.ones_like(prompt), mask], 1)
            inputs = {"input_ids": ids, "attention_mask": attention, "completion_ids": completion,
                      "completion_mask": mask, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
                      "label_mask": torch.cat([torch.zeros_like(prompt), mask], 1).bool(),
                      "weights": torch.rand(n, t, generator=g) * mask}
            got, got_grad = head_logps(ours, inputs, precision, trl=False)
            want, want_grad = head_logps(theirs, inputs, precision, trl=True)
            worst["logps"] = max(worst["logps"], float((got - want * mask).abs().max()))
            worst["head_grad"] = max(worst["head_grad"], float((got_grad - want_grad).abs().max()))
        records.append({"precision": precision, "tied": tied, **{f"max_abs_diff_{k}": v for k, v in worst.items()}})
    return records


# ------------------------------------------------------------------------------------------------ main
def compare(dtype: torch.dtype) -> list[dict]:
    trl = trl_sources()
    records = []
    for case in itertools.product(VARIANTS, LEVELS, KL_SETTINGS, IS_MODES):
        (loss_type, extra), level, (beta, kl_bc), is_mode = case
        case = (loss_type, extra, level, beta, kl_bc, is_mode)
        worst = dict.fromkeys(KINDS, 0.0)
        for (seed, (n, t)), bounds in itertools.product(enumerate(SHAPES), BOUNDS if is_mode != "none" else [None]):
            inputs = make_inputs(n, t, seed, dtype, DELTA_SPREAD if "delta" in extra else 1.0)
            ours_w, ours_m = our_weights_and_metrics(inputs, is_mode, bounds) if bounds else (None, {})
            trl_w, trl_m = trl_weights_and_metrics(trl, inputs, is_mode, bounds) if bounds else (None, {})
            if is_mode != "none":
                worst["weights"] = max(worst["weights"], float((ours_w - trl_w).abs().max()))
                if set(ours_m) != set(trl_m):
                    raise SystemExit(f"sampling/* keys differ: ours {sorted(ours_m)}, TRL {sorted(trl_m)}")
                worst["metrics"] = max(worst["metrics"], max(abs(ours_m[k] - trl_m[k]) for k in trl_m))
            for rows_list in ([torch.arange(n)], list(torch.arange(n).chunk(2))):
                want, want_grad, want_logged = trl_loss(trl, case, inputs, rows_list, trl_w)
                got, got_grad, got_logged = our_loss(case, inputs, rows_list, ours_w)
                worst["loss"] = max(worst["loss"], float((got - want).abs()))
                worst["grad"] = max(worst["grad"], float((got_grad - want_grad).abs().max()))
                if len(rows_list) == 1:  # one micro-batch: TRL's mean of shares is the share of sums
                    # a variant TRL logs no clip share of (sapo) clips nothing in lit_grpo: 0
                    want_logged = {key: want_logged.get(key, 0.0) for key in got_logged}
                    worst["loss_metrics"] = max(worst["loss_metrics"],
                                                max(abs(got_logged[k] - want_logged[k]) for k in got_logged))
        records.append({"loss_type": loss_type, **extra, "importance_sampling_level": level, "beta": beta,
                        "kl_bias_correction": kl_bc, "importance_sampling_mode": is_mode,
                        **{f"max_abs_diff_{k}": v for k, v in worst.items()}})
    return records


def print_entropy_bonus(records: list[dict], tolerance: float) -> int:
    """Print the entropy bonus's rows; returns how many exceed ``tolerance``."""
    print(f"entropy bonus (entropy_coef {ENTROPY_COEF}; adaptive: delta {ENTROPY_DELTA}, 2 optimizer steps, target "
          f"above / below the entropies); max |ours - TRL| over shapes {SHAPES} and 1 or 2 micro-batches")
    print(f"{'loss_type':8} {'level':8} {'top':>4} {'control':13} " + " ".join(f"{k:>13}" for k in ENTROPY_KINDS))
    bad = 0
    for r in records:
        diffs = [r[f"max_abs_diff_{k}"] for k in ENTROPY_KINDS]
        flag = any(d > tolerance for d in diffs)
        bad += flag
        print(f"{r['loss_type']:8} {r['importance_sampling_level']:8} {r['top_entropy_quantile']:4} "
              f"{r['entropy_control']:13} " + " ".join(f"{d:13.1e}" for d in diffs) + ("  MISMATCH" if flag else ""))
    overall = {k: max(r[f"max_abs_diff_{k}"] for r in records) for k in ENTROPY_KINDS}
    print(f"entropy bonus: {len(records)} combinations, {bad} over {tolerance:g}; largest: "
          + ", ".join(f"{k} {v:.1e}" for k, v in overall.items()))
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--json", default=None, help="write the records here")
    args = parser.parse_args(argv)
    import trl

    records = compare(getattr(torch, args.dtype))
    header = f"{'loss_type':8} {'option':11} {'level':8} {'beta':>5} {'kl_bc':5} {'is_mode':17} {'loss':>9} " \
             f"{'grad':>9} {'weights':>9} {'sampling/*':>10} {'train/*':>9}"
    print(f"TRL {trl.__version__}, torch {torch.__version__}, {args.dtype}; max |ours - TRL| over shapes {SHAPES}, "
          f"1 or 2 micro-batches and (clip_min, clip_max) in {BOUNDS}")
    print(header)
    bad = 0
    for r in records:
        diffs = [r[f"max_abs_diff_{k}"] for k in KINDS]
        flag = any(d > args.tolerance for d in diffs)
        bad += flag
        option = next((f"{label} {r[key]}" for key, label in OPTION_LABELS.items() if key in r), "-")
        print(f"{r['loss_type']:8} {option:11} {r['importance_sampling_level']:8} {r['beta']:5} "
              f"{str(r['kl_bias_correction']):5} "
              f"{r['importance_sampling_mode']:17} " + " ".join(f"{d:9.1e}" for d in diffs[:3])
              + f" {diffs[3]:10.1e} {diffs[4]:9.1e}" + ("  MISMATCH" if flag else ""))
    overall = {k: max(r[f"max_abs_diff_{k}"] for r in records) for k in KINDS}
    print(f"{len(records)} combinations, {bad} over {args.tolerance:g}; largest: "
          + ", ".join(f"{k} {v:.1e}" for k, v in overall.items()))
    advantages = compare_advantages(getattr(torch, args.dtype))
    for key, diff in advantages.items():
        bad += diff > args.tolerance
        print(f"advantages, {key}, (B, G, K) in {REWARD_SHAPES}: max |ours - TRL| {diff:.1e}"
              + ("  MISMATCH" if diff > args.tolerance else ""))
    module_path = compare_module_path(getattr(torch, args.dtype))
    bad += print_module_path(module_path, args.tolerance)
    entropy = compare_entropy_bonus(getattr(torch, args.dtype))
    bad += print_entropy_bonus(entropy, args.tolerance)
    head = compare_lm_head()
    for r in head:
        diffs = (r["max_abs_diff_logps"], r["max_abs_diff_head_grad"])
        flag = any(d > args.tolerance for d in diffs)
        bad += flag
        print(f"cast_lm_head_to_fp32, {r['precision']}, {'tied' if r['tied'] else 'untied'}: max |ours - TRL| "
              f"log-probs {diffs[0]:.1e}, head gradient {diffs[1]:.1e}" + ("  MISMATCH" if flag else ""))
    harness.write_json(args.json, {"trl": trl.__version__, "dtype": args.dtype, "records": records,
                                   "max_abs_diff_advantages": advantages, "module_path": module_path,
                                   "entropy_bonus": entropy,
                                   "cast_lm_head_to_fp32": head}, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
