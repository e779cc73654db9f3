"""``GRPOModule``: the policy and the GRPO update, as a LightningModule. Lightning runs the loops.

Prompt -> builder -> batch -> module: one ``training_step`` consumes one ``RolloutBatch`` (B prompts x G
completions, built by ``RolloutDataModule``'s ``RolloutBuilder`` with the current policy right before the step) and
makes ``num_iterations x num_mini_batches`` optimizer steps on it:

1. The ``B`` groups are cut in order into ``num_mini_batches`` mini-batches of whole groups (``B`` divisible by it,
   else refused when a fit starts, naming both), each an optimizer step; each mini-batch's ``B / num_mini_batches
   x G`` completion rows into micro-batches of ``train_micro_batch_size`` rows (none spans two mini-batches).
   Advantages are the rollout's, computed over the whole batch's groups before the cut.
2. Normalizers that span an optimizer step are computed first, each mini-batch's own: dapo's active-token count
   (summed over ranks), the entropy bonus's micro-batch count (over ranks). The loss types' micro-batch weights
   (``micro_batch_weight``) take the mini-batch's rows and micro-batches; the high-entropy quantile is each
   micro-batch's, as with one mini-batch.
3. If ``num_iterations > 1`` or ``num_mini_batches > 1``: old log-probs, once, with no grad, before the first
   optimizer step, of every mini-batch that is not trained before the first (with one iteration and one
   mini-batch the rollout's policy IS the current one, so ``old_logps = logps.detach()``; likewise the first
   mini-batch of a single pass): every optimizer step after the first is off-policy, its ratio to the rollout's
   policy. If ``loss.beta > 0``: reference log-probs, once, with no grad (the frozen reference model, or the
   policy with its LoRA adapter disabled).
4. Per iteration (a pass over every mini-batch in order, PPO's and verl's order), per mini-batch: for each of its
   micro-batches, forward log-probs (``lit_grpo.update.logprobs.completion_logps``, which never holds the whole
   ``[m, T, vocab]`` logits), the sampler correction's weights (old against sampling log-probs; "auto": on for a
   batch with samples from older weights), the loss object ``self.loss_fn`` (built once from ``loss``, a
   ``LossConfig``) x its ``micro_batch_weight`` (the weighted micro-batch losses add up to the whole optimizer
   step's loss, so the gradients equal one big batch's), ``manual_backward`` (under ddp without gradient sync but
   in the mini-batch's last micro-batch: below); then the losses' finiteness check, over every rank, and
   ``optimizer.step``, inside which (``on_before_optimizer_step``, after a 16-mixed loss scaler has unscaled the
   gradients) the gradient norm is taken once (logged, checked finite, and the clipping's); the learning rate's
   step. With a
   ``reference_sync``, after each optimizer step whose count (``trainer.global_step``) is a multiple of its
   ``every_n_steps``, the frozen reference moves toward the policy (lit_grpo.update.reference_sync). Under a
   Trainer the gradients are then freed, so the next rollout does not hold them.

A non-finite loss or gradient norm raises ``NonFiniteStepError`` (a ``FloatingPointError``) before any optimizer step
of that iteration, so the weights are never corrupted; under 16-mixed a non-finite norm is the loss scaler's
overflow, whose step the scaler skips (the logged norm shows it), and the learning-rate schedule with it.

Manual optimization: Lightning forbids ``Trainer(gradient_clip_val=...)`` with manual optimization, so clipping is
this module's ``max_grad_norm`` (``clip_grads_with_norm_`` by the norm already taken, on the gradients the precision
plugin has unscaled). Likewise ``accumulate_grad_batches`` must stay 1: the micro-batching above IS the
accumulation. ``trainer.global_step`` counts optimizer steps, i.e. training steps x ``num_iterations`` x
``num_mini_batches`` (``optimizer_steps_per_training_step``; ``max_steps``, the learning-rate schedule and
``reference_sync.every_n_steps`` count the same).

Logged (``self.log``, on step): train/{loss, kl (loss.beta > 0 only: there is no reference otherwise), clip_ratio_low,
clip_ratio_high (shares of loss tokens; under GSPO of completions with a loss token, as TRL), entropy (mean over
all completion tokens: under mask_truncated_completions TRL's leaves the truncated out), grad_norm (before
clipping), lr, entropy_coef (with the entropy bonus on, ``loss.entropy_coef`` != 0 or ``loss.use_adaptive_entropy``:
the coefficient after each optimizer step, the next one's, as TRL's ``entropy_coef``), phi_seq_mean (loss_type vespo
only: the mean over completions of vespo's weight, TRL's ``vespo/phi_seq_mean``); each the mean over the step's
``num_iterations x num_mini_batches`` optimizer steps};
reward/{mean, std (mean over groups of the within-group std; TRL 1.16's reward_std is the batch's), frac_zero_std
(share of the step's generated groups without learning signal, whose rewards were all equal (under
normalize_then_sum: whose every reward function's values were), dropped ones included), <fn_name>/mean (None
values excluded), <name> (what reward functions log with ``log_metric``: the mean of the step's values)};
completions/{mean_length, min_length, max_length, clipped_ratio}; sampling/{sampling_logp_difference/{mean,
max}, importance_sampling_ratio/{min, mean, max} (with a correction on)} (lit_grpo.update.sampler_correction);
what the data side put in ``batch.metrics`` (curriculum/{mu, mean_angle}, reward/skipped_groups,
rollout/{rollouts_per_step, slots}, with partial rollouts rollout/{carried_samples, offpolicy_tokens_frac}, with
tools tools/{call_frequency, failure_frequency}, and under several processes data/prompts_unused: prompts drawn this
step that no rank took; the uniform sampler hands them out first next, the curriculum's draws are independent
anyway). Validation:
val/{accuracy, reward} (per prompt, greedy), and with ``data.val_num_samples`` k > 1 val/{mean_at_k, pass_at_k} (k
samples per held-out prompt at ``data.val_temperature``), and what validation's reward calls log with
``log_metric``, the mean of their values: val/reward/<name> (the greedy completions' calls) and, with sampled
validation, val/reward_at_k/<name> (the sampled ones'): lit_grpo.update.held_out. Under several processes
every key is the whole step's, the same on every rank (below).

Distributed: under ddp (``--trainer.strategy ddp --trainer.devices N``; gloo on CPU) each rank trains on its own
B groups (RolloutDataModule draws different prompts per rank, whole groups), dapo's normalizer is the active tokens
of every micro-batch of the optimizer step's mini-batch on every rank (``strategy.reduce``, once a training step for
every mini-batch), and the loss is multiplied by the world size because ddp averages the ranks' gradients: the
update equals one process holding all ranks' rows (tests/test_ddp.py; each optimizer step: every rank's mini-batch
of that index). Every micro-batch but a mini-batch's last runs its backward without gradient sync (Lightning's
``strategy.block_backward_sync()``, the wrapped model's ``no_sync``), so ddp all-reduces once per optimizer step,
with the same gradients up to summation order (FSDP2 is left to its own per-backward reduce-scatter).
Logged keys are the whole step's, the same on every rank: ``training_step`` gathers every rank's values in one
collective (a ``[2, K]`` float64 tensor over K keys listed in one order on every rank; a key absent on a rank is
left out of its reduction) and reduces each key by its rule in ``lit_grpo.rollout.metrics.RANK_REDUCTIONS``: means
(reward/mean, completions/mean_length and clipped_ratio, train/loss: every rank holds B x G rows), ratios of sums
for the shares and token means whose denominators differ between ranks (reward/frac_zero_std and
reward/<fn_name>/mean, train/entropy, kl and clip ratios, sampling/*/mean, rollout/offpolicy_tokens_frac: each
rank's value weighted by its groups, tokens or present values, ``RATIO_WEIGHTS``, as one process holding every
rank's rows would log them), sums (reward/skipped_groups, rollout/carried_samples), min or max
(completions/min_length and max_length, sampling/*/min and max, rollout/rollouts_per_step), and
``rollout/rank_skew``, the slowest rank's rollout seconds over their mean (several processes only). ``train/loss``:
each rank's value is its own rows' loss (dapo, cispo and vespo, normalized by the optimizer step's tokens on
every rank: its share times the world size); every rank holds as many rows, so their mean is the step's loss.
val/*: torchmetrics means, synced over the ranks when computed (every rank's held-out prompts, each counted once).
The lit_grpo callbacks reduce their keys (rollout/*, memory/*) by the same table.
``fsdp: true`` with ``ModelParallelStrategy`` shards the policy with FSDP2 (configs/fsdp_gpu.yaml); gradients are
averaged the same way. A non-finite loss, or gradient norm, raises on every rank at once, naming the ranks whose loss
was not finite (one gather of a flag per optimizer step; the norm is the same on every rank after the reduction),
before any optimizer step: the job fails as a whole, the weights stay as they were.

The model is loaded in ``configure_model`` (idempotent; Lightning calls it before the optimizers are built, and
under FSDP inside the sharding context); the tokenizer in ``__init__``, because the DataModule's ``setup`` (which
renders prompts) runs before ``configure_model``. Outside a Trainer call ``module.configure_model()`` yourself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple, get_args

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from lit_grpo.batch import RolloutBatch
from lit_grpo.rollout.advantages import AGGREGATIONS, SCALES, Aggregation, Scale
from lit_grpo.rollout.metrics import (WEIGHT_PREFIX, loggable, logged_reward_keys, rollout_metrics,
                                      step_metric_keys, whole_step_metrics)
from lit_grpo.rollout.rewards import reward_changes
from lit_grpo.runtime.distributed import (FSDP_ROLLOUTS, CastWeights, GatheredWeights, LockstepWeights,
                                          RaisedOnEveryRank, RolloutWeights, cast_names, data_parallel_mesh,
                                          gradient_norm, is_fsdp_sharded, meta_replica, reads_weights_outside_linear,
                                          shard_decoder_layers, strategy_all_gather, union_over_ranks)
from lit_grpo.runtime.checkpoints import (PlainHyperparameters, check_loaded_settings, check_settings_before_load,
                                         check_sharded_param_groups, check_weight_shapes, exception_save_hazard,
                                         forget_settings_checked, plain_saved_hyperparameters)
from lit_grpo.runtime.head_precision import cast_lm_head_to_fp32, check_float32_head
from lit_grpo.runtime.memory import release_freed_host_memory
from lit_grpo.runtime.models import (DEFAULT_MODEL, disable_dropout, enable_activation_checkpointing,
                                     load_model_and_tokenizer, load_tokenizer, lora_config, model_text, resolve_dtype,
                                     with_lora)
from lit_grpo.runtime.validation import (ConfigError, check_bool, check_choice, check_int, check_real,
                                         config_errors, real_within, settings_from, shown_setting, shown_value)
from lit_grpo.sampling.cpu_linear import UpdateLinear, onednn_linears, resolve_update_linear
from lit_grpo.update.entropy_bonus import EntropyControl, bonus_tokens, bonus_weight, entropy_bonus, entropy_stats
from lit_grpo.update.held_out import HeldOutMetrics, ValidationLogs
from lit_grpo.update.logprobs import completion_logps, shares_prefix
from lit_grpo.update.loss_config import LossConfig
from lit_grpo.update.lr_schedule import (WARMUP_STEPS_COUNT, LrSchedule, global_steps_to_run, is_share, lr_lambda,
                                        warmup_steps_count)
from lit_grpo.update.metrics import StepMetrics
from lit_grpo.update.policy_losses import PolicyLoss, make_loss
from lit_grpo.update.reference_sync import ReferenceSync, mix_parameters
from lit_grpo.update.resume_settings import unread_settings
from lit_grpo.update.sampler_correction import CorrectionStats, SamplerCorrection
from lit_grpo.update.shared_prefix import SHARED_PREFIX_MODES, shared_prefix_usable
from lit_grpo.update.surrogates import high_entropy_mask

#: The checkpoint's key for the adaptive entropy control's state (``EntropyControl.state_dict``).
ENTROPY_CONTROL_KEY = "entropy_control"
#: One micro-batch of a step: its rows of the batch and their model inputs (``RolloutBatch.micro_batch``).
MicroBatch = tuple[range, dict[str, Any]]


class NonFiniteStepError(RaisedOnEveryRank, FloatingPointError):
    """A non-finite loss or gradient norm, found before the optimizer step, on every rank at once."""


class OptimizerSettings(NamedTuple):
    """``GRPOModule``'s checked numbers of AdamW, its learning-rate schedule and clipping: plain ints and floats (a
    numpy scalar's too), which a checkpoint's hyperparameters keep."""

    lr: float
    weight_decay: float
    warmup_steps: int
    min_lr_ratio: float
    max_grad_norm: float | None


def _check_optimizer_settings(lr: float, weight_decay: float, betas: Sequence[float], warmup_steps: int,
                              lr_schedule: LrSchedule, min_lr_ratio: float, max_grad_norm: float | None,
                              stacklevel: int) -> OptimizerSettings:
    """Check ``GRPOModule``'s AdamW, learning-rate schedule and clipping settings (its docstring says each);
    warn where ``min_lr_ratio`` is set for a schedule that never decays to it."""
    # transformers 5's warmup_steps below 1 is a share of the steps (TRL's warmup_ratio): say what the count is
    warmup_steps = check_int("warmup_steps", warmup_steps, 0, WARMUP_STEPS_COUNT if is_share(warmup_steps) else "")
    check_choice("lr_schedule", lr_schedule, get_args(LrSchedule))
    min_lr_ratio = check_real("min_lr_ratio", min_lr_ratio, low=0, high=1)
    if min_lr_ratio and lr_schedule == "constant":
        warnings.warn(f"{shown_setting('min_lr_ratio', min_lr_ratio)} is the floor of a decaying lr_schedule; with "
                      "'constant' it is ignored", stacklevel=stacklevel)
    lr = check_real("lr", lr, low=0, low_open=True)
    weight_decay = check_real("weight_decay", weight_decay, low=0)
    pair = isinstance(betas, Sequence) and not isinstance(betas, (str, bytes))
    if not pair or len(betas) != 2 or any(real_within(b, 0, 1, high_open=True) is None for b in betas):
        raise ValueError(f"{shown_setting('betas', list(betas) if pair else betas)} must be two numbers in [0, 1) "
                         "(AdamW's decay rates of its moments, e.g. [0.9, 0.99])")
    if max_grad_norm is not None:  # None: no clipping
        max_grad_norm = check_real("max_grad_norm", max_grad_norm, low=0)
    return OptimizerSettings(lr, weight_decay, warmup_steps, min_lr_ratio, max_grad_norm)


def _checked_reference_sync(reference_sync: ReferenceSync | dict | None, loss: LossConfig,
                            peft_config: dict[str, Any] | None) -> ReferenceSync | None:
    """``reference_sync`` as a :class:`ReferenceSync` (None: the reference stays the initial weights), refused
    where there is no reference of its own to move: no KL term (``loss.beta`` 0), or LoRA's adapter-off policy."""
    if reference_sync is None:
        return None
    sync = settings_from("reference_sync", reference_sync, ReferenceSync)
    if loss.beta == 0:
        raise ValueError("reference_sync needs loss.beta > 0: with beta 0 there is no reference model to sync "
                         "(no KL penalty); set loss.beta (e.g. 0.04) or reference_sync: null")
    if peft_config:
        raise ValueError("reference_sync does not apply with peft_config (LoRA): the reference is the policy with "
                         "its adapter disabled, no weights of its own to move; set reference_sync: null or train "
                         "all weights (peft_config: null)")
    return sync


class GRPOModule(PlainHyperparameters, LightningModule):
    """GRPO policy optimization (module docstring).

    Args:
        model: hub id or path ("HuggingFaceTB/SmolLM2-135M-Instruct" works offline; "tiny-llama", "tiny-qwen2",
            "tiny-gemma3"); a ``pathlib.Path`` is its text, the setting saved and compared on a resume.
        dtype: weights dtype ("float32", "bfloat16", ...); None keeps the checkpoint's. For mixed precision keep
            float32 weights and set ``trainer.precision: bf16-mixed``.
        peft_config: LoRA settings for ``peft.LoraConfig`` (e.g. ``{r: 16, lora_alpha: 32, target_modules:
            [q_proj, v_proj]}``); None trains all weights. With LoRA and loss.beta > 0 the reference is the policy with
            the adapter disabled (no second model).
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass (default, as in
            TRL): the update then holds one micro-batch's layer inputs instead of all its activations, so its
            peak stays below the optimizer step's and does not grow with G; costs one more forward pass per
            micro-batch. Turn it off when memory is plentiful (configs/demo.yaml).
        disable_dropout: set every dropout of the policy and the reference to 0 (TRL's ``disable_dropout``; with
            LoRA its adapter's ``lora_dropout`` too): the rollout samples without dropout (eval mode), so with
            dropout on the update's log-probs are those of another, randomly thinned model. Off (default): the model
            trains with the dropout its config sets (0 in most current decoders).
        cast_lm_head_to_fp32: the output head of the policy and the reference computes its logits in float32 from
            float32 weights (TRL's ``cast_lm_head_to_fp32``, the ScaleRL recipe; lit_grpo.runtime.head_precision):
            in the update's log-probs, the reference's, the rollouts and validation, under every precision (float32
            weights under bf16-mixed, ``dtype: bfloat16``), so the sampler's log-probs and the trainer's are both
            float32 logits' of the same weights. An input embedding tied to the head shares its float32 weight and
            hands the layers its output in the model's dtype. Not with a LoRA adapter on the head, nor with fsdp
            (FSDP2 gathers the head with the root's other weights in one dtype). Off (default): the head computes
            in the model's dtype, or the autocast one.
        shared_prefix: each distinct prompt of a micro-batch goes forward and backward once, its completions
            attending to its keys and values (lit_grpo.update.shared_prefix; the same values up to float rounding):
            "auto" (default) in a micro-batch where that spares the unshared forward enough positions to pay for the
            model's second pass (``shared_prefix_pays``: the spared positions times a layer's parameters, against
            the pass's cost on the device), True in every micro-batch with a repeated prompt, False never. Where
            the model cannot, the update runs one forward per completion (``configure_model`` warns why under
            True; ``uses_shared_prefix`` says which).
        loss: the loss variant and its settings, a :class:`~lit_grpo.update.loss_config.LossConfig` (or a dict of its
            fields; YAML ``model.loss:``): loss_type, epsilon_low / epsilon_high, beta (k3 KL weight; > 0 loads a
            frozen reference model), importance_sampling_level, kl_bias_correction, sapo temperatures, vespo shapes,
            the masks ``off_policy_mask_threshold`` and ``top_entropy_quantile`` (its quantile: each micro-batch's,
            with every rank's micro-batch of the same index, as TRL's), the entropy bonus ``entropy_coef`` and its
            adaptive control (``use_adaptive_entropy``, ``entropy_coef_min`` / ``_max`` / ``_delta``,
            ``entropy_target``; lit_grpo.update.entropy_bonus: each micro-batch's mean token entropy x ``world size /
            micro-batches of every rank``, the control fed the step's entropy over every rank in the step's one
            gather, its state saved in checkpoints).
        reference_sync: a :class:`~lit_grpo.update.reference_sync.ReferenceSync` (or a dict; YAML
            ``model.reference_sync: {every_n_steps: 64, mixup_alpha: 0.6}``): every ``every_n_steps`` optimizer steps
            the reference moves toward the policy, ``ref <- (1 - mixup_alpha) ref + mixup_alpha policy`` (TRL's
            ``sync_ref_model``); needs ``loss.beta > 0`` and no LoRA. None (default): the reference stays the
            initial weights.
        sampler_correction: a :class:`~lit_grpo.update.sampler_correction.SamplerCorrection` (or a dict; YAML
            ``model.sampler_correction:``): mode (auto | none | token_truncate | token_mask | sequence_truncate |
            sequence_mask), clip_min, clip_max. "auto" (default) corrects a batch that carries samples from older
            weights (``data.over_provision > 1``) and leaves the others alone.
        scale_rewards: group | batch | none (lit_grpo.rollout.advantages; handed to the data side in
            ``_hand_over_to_data``).
        multi_objective_aggregation: how several reward functions make one advantage (TRL's setting, handed over
            alike): "sum_then_normalize" (default) scales their weighted sum by ``scale_rewards``;
            "normalize_then_sum" (GDPO, arXiv 2601.05242) normalizes each function's values within the group
            (``(r - mean) / (std + 1e-4)``, None values left out), sums them with their weights and normalizes the
            sum over the whole batch, every rank's, ``scale_rewards`` playing no part. With one function the two
            differ too (the group's std, then the batch's). Under either, a completion every function returned None
            for is left out of the statistics and gets advantage 0, as in TRL.
            Under "normalize_then_sum" a group without signal (dynamic sampling drops it; ``reward/frac_zero_std``)
            is one in which every function's values are equal.
        num_iterations: passes over each training step's batch (mu in the GRPO paper; verl's ``ppo_epochs``),
            each pass ``num_mini_batches`` optimizer steps.
        num_mini_batches: optimizer steps per pass: the step's ``B`` groups (on each rank) cut in order into this
            many mini-batches of whole groups, ``B`` divisible by it (verl's ``train_batch_size /
            ppo_mini_batch_size``; TRL's ``steps_per_generation / gradient_accumulation_steps``). Every step after
            the first is off-policy: its ratio is to the log-probs from before the first (module docstring).
        mask_truncated_completions: truncated completions contribute no loss tokens (their rewards still count in
            their group's advantages).
        train_micro_batch_size: completions per forward/backward; update memory depends on it, not on G.
        lr: AdamW (with ``weight_decay``, not on biases and normalization weights, as transformers' Trainer:
            ``weight_decay_groups``; ``betas``); ``warmup_steps``: linear warmup over that many optimizer steps
            (a whole number written as a float, ``10.0``, is that count, as transformers' TrainingArguments take it);
            then ``lr_schedule`` (lit_grpo.update.lr_schedule): "constant" (default), or "linear" or "cosine", a
            decay to ``min_lr_ratio`` x ``lr`` (0 by default) at ``trainer.max_steps``.
        max_grad_norm: clip the gradient norm to this (None or 0: no clipping; the norm is logged anyway).
        fsdp: shard the policy (and the reference) with FSDP2 (``torch.distributed.fsdp.fully_shard``, each
            decoder layer and then the whole model) over the strategy's device mesh in ``configure_model``. Needs
            ``trainer.strategy: lightning.pytorch.strategies.ModelParallelStrategy`` (GPU; configs/fsdp_gpu.yaml).
            Under ``trainer.precision: bf16-mixed`` (or 16-mixed) the weights are gathered in that dtype for
            forward and backward (FSDP2's ``MixedPrecisionPolicy``), gradients reduced in float32.
        fsdp_rollout: how rollouts run a sharded policy (lit_grpo.runtime.distributed): "gathered" gathers the
            full weights once per rollout into an unsharded copy in the rollout's dtype and decodes on it as on one
            device (CUDA graphs, the compiled step; its memory shows in ``memory/rollout_peak_bytes``);
            "lockstep" decodes on the shards, every rank stepping until all are done (a collective per layer per
            step: slower, for weights that do not fit one device whole); "auto" (default) gathers where the
            full weights take at most half the device's free memory on every rank, else lockstep.
        cpu_linear: the kernel of the update's linear layers on a CPU, forward and backward (auto | onednn | torch):
            "auto" is oneDNN for a float32 policy that is not FSDP-sharded, on a CPU that is not Intel's (where
            MKL, torch's kernel, is the faster one; lit_grpo.sampling.cpu_linear).
        move_to_cpu_after_fit: let Lightning move the policy and the optimizer's state to the CPU when ``fit``
            ends (its strategies' default). Off: both stay on their device (``on_train_end``), sparing the host a
            copy of the weights and both AdamW moments, several times the model's size.
    """

    def __init__(
        self,
        model: str | os.PathLike = DEFAULT_MODEL,
        dtype: str | None = None,
        peft_config: dict[str, Any] | None = None,
        gradient_checkpointing: bool = True,
        disable_dropout: bool = False,
        cast_lm_head_to_fp32: bool = False,
        shared_prefix: bool | str = "auto",
        loss: LossConfig = LossConfig(),
        reference_sync: ReferenceSync | None = None,
        sampler_correction: SamplerCorrection = SamplerCorrection(),
        scale_rewards: Scale = "group",
        multi_objective_aggregation: Aggregation = "sum_then_normalize",
        num_iterations: int = 1,
        num_mini_batches: int = 1,
        mask_truncated_completions: bool = False,
        train_micro_batch_size: int = 8,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        warmup_steps: int = 0,
        lr_schedule: LrSchedule = "constant",
        min_lr_ratio: float = 0.0,
        max_grad_norm: float | None = 1.0,
        fsdp: bool = False,
        fsdp_rollout: str = "auto",
        cpu_linear: UpdateLinear = "auto",
        move_to_cpu_after_fit: bool = False,
    ):
        super().__init__()
        model = model_text(model)  # before save_hyperparameters: a Path is saved, and a resume compares it, as text
        for name, value in (("gradient_checkpointing", gradient_checkpointing), ("disable_dropout", disable_dropout),
                            ("cast_lm_head_to_fp32", cast_lm_head_to_fp32),
                            ("mask_truncated_completions", mask_truncated_completions), ("fsdp", fsdp),
                            ("move_to_cpu_after_fit", move_to_cpu_after_fit)):
            check_bool(name, value)  # a string such as "false" would be truthy: the switch would be on
        if cast_lm_head_to_fp32 and fsdp:
            raise ValueError("cast_lm_head_to_fp32=True is not supported with fsdp=True: FSDP2 gathers the output "
                             "head's weight with the root's other weights, in bfloat16 under bf16-mixed, so the head "
                             "would not compute from float32 weights; set one of them to false")
        check_choice("scale_rewards", scale_rewards, SCALES)
        check_choice("multi_objective_aggregation", multi_objective_aggregation, AGGREGATIONS)
        check_choice("cpu_linear", cpu_linear, get_args(UpdateLinear))
        check_choice("fsdp_rollout", fsdp_rollout, FSDP_ROLLOUTS)
        if fsdp_rollout != "auto" and not fsdp:
            warnings.warn(f"fsdp_rollout={fsdp_rollout!r} applies with fsdp only; it is ignored", stacklevel=2)
        if not isinstance(shared_prefix, (bool, str)):  # 1 and 0 equal True and False, which check_choice takes
            raise ValueError(f"{shown_setting('shared_prefix', shared_prefix)} is not known; use one of "
                             f"{list(SHARED_PREFIX_MODES)}")
        check_choice("shared_prefix", shared_prefix, SHARED_PREFIX_MODES)
        num_iterations = check_int("num_iterations", num_iterations, 1)
        num_mini_batches = check_int("num_mini_batches", num_mini_batches, 1)
        train_micro_batch_size = check_int("train_micro_batch_size", train_micro_batch_size, 1)
        resolve_dtype(dtype)  # a dtype no policy runs in is named now, not when the model loads
        warmup_steps = warmup_steps_count(warmup_steps)  # before save_hyperparameters: 10.0 is saved as the count 10
        lr, weight_decay, warmup_steps, min_lr_ratio, max_grad_norm = _check_optimizer_settings(
            lr, weight_decay, betas, warmup_steps, lr_schedule, min_lr_ratio, max_grad_norm, stacklevel=3)
        if peft_config is not None:  # checked here, before a model loads ({}, 0 or '' too: not taken as None)
            with config_errors("model.peft_config"):
                lora_config(peft_config)
        loss_config = settings_from("loss", loss, LossConfig)
        sync = _checked_reference_sync(reference_sync, loss_config, peft_config)
        correction = settings_from("sampler_correction", sampler_correction, SamplerCorrection)
        if ignored := correction.ignored_settings():  # here, once: for_batch rebuilds the object every batch
            warnings.warn(f"sampler_correction settings {ignored} have no effect with mode='none'; they are "
                          "ignored", stacklevel=2)
        # saved as dicts of their fields (PlainHyperparameters: numpy numbers as plain ones); the update reads the
        # typed objects
        loss, sampler_correction = (dataclasses.asdict(group) for group in (loss_config, correction))
        reference_sync = dataclasses.asdict(sync) if sync is not None else None
        self.save_hyperparameters()
        self.automatic_optimization = False
        #: The loss object, built once from ``loss`` (lit_grpo.update.policy_losses).
        self.loss_fn: PolicyLoss = make_loss(loss_config)
        #: The entropy bonus's coefficient, moved after each optimizer step under ``loss.use_adaptive_entropy``
        #: (lit_grpo.update.entropy_bonus); saved in checkpoints.
        self.entropy_control = EntropyControl(loss_config)
        self.sampler_correction = correction
        self.reference_sync = sync
        #: Whether the reference holds the initial weights, which configure_model reloads: False once mixed, or
        #: loaded from a checkpoint that held it (a synced one; ``saves_reference``).
        self._reference_is_initial = True
        #: The optimizer steps grpo_step took with a plain optimizer, whose steps no Trainer counts (``_steps_taken``).
        self._plain_optimizer_steps = 0
        self.tokenizer = load_tokenizer(model)
        self.policy: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        #: What rollouts run on (``rollout_weights()``); a plain object, so its replica is no submodule of this one.
        self._rollout_weights: RolloutWeights | None = None
        self._gathered: GatheredWeights | None = None  # under fsdp: the replica, its structure taken before sharding
        #: Whether the update shares prompts (True, "auto" or False): ``shared_prefix`` where the loaded policy can
        #: (``configure_model``).
        self.uses_shared_prefix = shared_prefix
        self.held_out = HeldOutMetrics()
        #: what reward functions log (``log_metric``) in a validation's calls (``val/reward/<name>``, the greedy
        #: completions', and ``val/reward_at_k/<name>``, the sampled ones')
        self.validation_logs = ValidationLogs()
        #: The last optimizer step's gradient norm and update iteration (``_check_and_clip_gradients``).
        self._grad_norm, self._iteration = math.nan, 0
        #: During the strategy's teardown at the end of fit (``on_train_end``): ``cpu()`` moves nothing.
        self._in_teardown = False
        #: The CUDA allocator's peak in the last update (``measured_update_peak``); None elsewhere.
        self._update_peak_bytes: int | None = None

    # ------------------------------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Load the policy (+ LoRA) and, when ``loss.beta > 0`` without LoRA, the frozen reference. Idempotent."""
        if self.policy is not None:
            return
        hp = self.hparams
        if self.device_mesh is not None and not hp.fsdp:
            raise ConfigError("trainer.strategy is ModelParallelStrategy but model.fsdp is false: the policy would "
                              "train unsharded and its gradients would never be averaged over the ranks; set "
                              "model.fsdp: true (or use the ddp strategy)")
        with config_errors("model", self.hparams.keys()):
            policy = self._load_model()
        if hp.gradient_checkpointing:
            enable_activation_checkpointing(policy)
        if hp.peft_config:
            with config_errors("model.peft_config"):  # e.g. target_modules the model has none of
                policy = with_lora(policy, hp.peft_config)
                if hp.cast_lm_head_to_fp32:
                    check_float32_head(policy)
        if hp.disable_dropout:  # after LoRA, whose adapter brings a dropout of its own
            disable_dropout(policy)
        # before sharding: the check may run the model (drops_cache_under_checkpointing), each rank its whole copy
        usable = hp.shared_prefix and shared_prefix_usable(policy, warn=hp.shared_prefix is True)
        self.uses_shared_prefix = hp.shared_prefix if usable else False
        if hp.fsdp:
            skeleton = meta_replica(policy) if hp.fsdp_rollout != "lockstep" else None
            self._fully_shard(policy)
            if skeleton is not None:
                self._gathered = GatheredWeights(policy, skeleton, self._mixed_precision_dtype())
        self.policy = policy.train()  # loaded in eval mode, as from_pretrained gives it; Lightning warns about those
        if self.loss_fn.config.beta > 0 and not hp.peft_config:
            ref = self._load_model()
            ref.requires_grad_(False)
            if hp.disable_dropout:
                disable_dropout(ref)
            if hp.fsdp:
                self._fully_shard(ref)
            # left in train mode, as the policy, for Lightning's check at the start of fit, which warns about every
            # module in eval mode; _reference() puts it in eval mode for each use
            self.ref_model = ref.train()

    def _load_model(self) -> torch.nn.Module:
        """The policy's (or the reference's) initial weights, with a float32 head under ``cast_lm_head_to_fp32``
        (cast before LoRA wraps it: peft's copies of the head, ``modules_to_save``, are then float32 heads too)."""
        model, _ = load_model_and_tokenizer(self.hparams.model, self.hparams.dtype)
        return cast_lm_head_to_fp32(model) if self.hparams.cast_lm_head_to_fp32 else model

    def _fully_shard(self, model: torch.nn.Module) -> None:
        if self.device_mesh is None:
            raise ConfigError("fsdp=True needs a device mesh: use trainer.strategy "
                              "lightning.pytorch.strategies.ModelParallelStrategy (see configs/fsdp_gpu.yaml)")
        ranks, world = data_parallel_mesh(self.device_mesh).size(), self.trainer.world_size
        if ranks != world:  # the other dimension would hold unsynchronised replicas: lit_grpo has no tensor parallelism
            raise ConfigError(f"fsdp=True shards over the data-parallel dimension, which spans {ranks} of the "
                              f"{world} ranks: set ModelParallelStrategy's data_parallel_size to {world} (or 'auto' "
                              "under lit-grpo) and tensor_parallel_size to 1")
        shard_decoder_layers(model, self.device_mesh, self._mixed_precision_dtype())

    def _mixed_precision_dtype(self) -> torch.dtype | None:
        """The trainer's autocast dtype under mixed precision ("bf16-mixed", "16-mixed"), else None."""
        precision = str(self.trainer.precision) if self._trainer is not None else ""
        return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)

    def rollout_weights(self) -> RolloutWeights:
        """What rollouts run on: the policy (under mixed precision with its linear weights cast once per rollout,
        ``CastWeights``), or under fsdp its gathered copy or its shards in lockstep (``fsdp_rollout``); built once,
        after the strategy has placed the policy."""
        if self._rollout_weights is not None:
            return self._rollout_weights
        policy = self._require_policy()
        if not is_fsdp_sharded(policy):
            self._rollout_weights = self._cast_weights(policy) or RolloutWeights(policy)
        elif self._gathered is not None and (self.hparams.fsdp_rollout == "gathered"
                                             or self._gathered_fit_everywhere()):
            self._rollout_weights = self._gathered
        else:
            group = data_parallel_mesh(self.device_mesh).get_group() if self.device_mesh is not None else None
            self._rollout_weights = LockstepWeights(policy, group)
        return self._rollout_weights

    def _cast_weights(self, policy: torch.nn.Module) -> CastWeights | None:
        """Under mixed precision, the policy with its linear weights cast once per rollout, where there is something
        to cast, the rollout computes with it what the trainer computes (no DoRA) and the copies fit the device's
        free memory; else None (autocast casts the weights at every step). Each rank decides alone: both kinds run
        no collective and sample the same bits."""
        dtype = self._mixed_precision_dtype()
        if dtype is None or not cast_names(policy, dtype) or reads_weights_outside_linear(policy):
            return None
        weights = CastWeights(policy, dtype)
        return weights if weights.fits() else None

    def _gathered_fit_everywhere(self) -> bool:
        """Whether the gathered weights fit on every rank ("auto"): one rank's no makes every rank's lockstep,
        since the two kinds run different collectives."""
        fits = self._gathered.fits()
        if _world_size(self._trainer) > 1:
            fits = self.trainer.strategy.reduce_boolean_decision(fits, all=True)
        return bool(fits)

    def _require_policy(self) -> torch.nn.Module:
        if self.policy is None:
            raise RuntimeError("GRPOModule.policy is not loaded; Lightning calls configure_model() in fit/validate, "
                               "call it yourself outside a Trainer")
        return self.policy

    @contextlib.contextmanager
    def _reference(self):
        """The reference model: the frozen copy, or the policy with its LoRA adapter disabled."""
        if self.ref_model is not None:
            self.ref_model.eval()
            yield self.ref_model
        else:
            with self.policy.disable_adapter():
                yield self.policy

    def saves_reference(self) -> bool:
        """Whether this run's checkpoints hold the reference model's weights. A reference that stays the initial
        weights is reloaded by configure_model, so it is not stored twice; it is stored under FSDP
        (ModelParallelStrategy loads every key of the module's state before on_load_checkpoint could fill the
        reference's in, so a checkpoint without them cannot be resumed), with a ``reference_sync`` (it moves), and
        once it is not the initial weights (a synced reference resumed without the sync stays where it was)."""
        return bool(self.hparams.fsdp) or (self.ref_model is not None and (
            self.reference_sync is not None or not self._reference_is_initial))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        plain_saved_hyperparameters(checkpoint)
        if not self.saves_reference():
            _drop_reference(checkpoint)
        if self.entropy_control.adaptive:  # its coefficient and last entropy: a resume goes on from them
            checkpoint[ENTROPY_CONTROL_KEY] = self.entropy_control.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # first, before any of it is taken: a script's trainer.fit(ckpt_path=...) is refused as lit-grpo fit's is
        # (a fit under FSDP2, whose strategy took the weights already, was compared before that: _check_sharded_resume)
        check_loaded_settings(checkpoint, self, self._trainer, unread=unread_settings, reward_changes=reward_changes)
        if "state_dict" in checkpoint:  # a sharded one's weights are loaded by the strategy, which checks them
            path = self.trainer.ckpt_path if self._trainer is not None else None
            # the tensors by name, not state_dict(), whose hooks under FSDP2 run collectives
            weights = {**dict(self.named_parameters()), **dict(self.named_buffers())}
            with config_errors("--ckpt_path"):  # before load_state_dict's traceback, naming the file
                check_weight_shapes(path, checkpoint["state_dict"], weights)
        if checkpoint.get("optimizer_states"):  # loaded after this hook (FSDP2's before: _check_sharded_resume)
            policy, (state,) = self._require_policy(), checkpoint["optimizer_states"]
            built = weight_decay_groups(policy, self.hparams.weight_decay)
            if len(state["param_groups"]) != len(built):  # one group: weight_decay 0, or saved before the groups
                saved = weight_decay_groups(policy, 0.0 if len(built) > 1 else 1.0)
                with config_errors("--ckpt_path"):
                    checkpoint["optimizer_states"] = [regrouped(state, saved, built)]
                for schedule in checkpoint["lr_schedulers"]:  # every group has the same schedule
                    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
                        schedule[key] = schedule[key][:1] * len(built)
        # a checkpoint without the control's state (its run had no adaptive control) leaves it at its start
        if self.entropy_control.adaptive and ENTROPY_CONTROL_KEY in checkpoint:
            self.entropy_control.load_state_dict(checkpoint[ENTROPY_CONTROL_KEY])
        # a checkpoint that holds the reference restores it (a synced one); one without it: the initial weights
        if self.ref_model is None:  # a run without one (beta 0: lit-grpo validate) drops a synced run's reference
            _drop_reference(checkpoint)
            return
        state = checkpoint.setdefault("state_dict", {})
        if any(key.startswith("ref_model.") for key in state):
            self._reference_is_initial = False
        for key, value in self.ref_model.state_dict().items():
            state.setdefault(f"ref_model.{key}", value)

    # ------------------------------------------------------------------------------------------ end of fit
    def on_train_end(self) -> None:
        """Unless ``move_to_cpu_after_fit``: the strategy's teardown, which runs next, moves this module and the
        optimizers' state to the CPU; both stay on their device instead. The teardown is wrapped for its one
        call: while it runs the optimizers are out of its sight and ``cpu`` moves nothing; after it (callbacks'
        ``on_fit_end`` included) everything is as before. Strategies that move nothing (FSDP2's) are unaffected."""
        if self.hparams.move_to_cpu_after_fit:
            return
        strategy = self.trainer.strategy
        strategy.__dict__.pop("teardown", None)  # a wrapper a failed fit left behind
        teardown = strategy.teardown

        def teardown_keeping_state() -> None:
            del strategy.teardown  # once: the class's own from now on
            optimizers, strategy.optimizers = strategy.optimizers, []
            self._in_teardown = True
            try:
                teardown()
            finally:
                strategy.optimizers, self._in_teardown = optimizers, False

        strategy.teardown = teardown_keeping_state

    def cpu(self) -> GRPOModule:
        if self._in_teardown:  # inside the strategy's teardown at the end of fit (on_train_end)
            return self
        return super().cpu()

    # ------------------------------------------------------------------------------------------ data hand-over
    @property
    def optimizer_steps_per_training_step(self) -> int:
        """The optimizer steps each training step takes: ``num_iterations x num_mini_batches`` (what
        ``trainer.global_step`` and ``max_steps`` count)."""
        return self.hparams.num_iterations * self.hparams.num_mini_batches

    def on_fit_start(self) -> None:
        # before the first rollout: mini-batches of whole groups need a count of them that divides the step's
        groups = getattr(getattr(self.trainer.datamodule, "training", None), "prompts_per_step", None)
        if isinstance(groups, int):
            self._check_mini_batches(groups, ConfigError)
        self._warn_of_max_steps_inside_a_training_step()
        self._check_validation_interval()
        self._hand_over_to_data()
        # here, where both lit-grpo's fits and a script's Trainer pass, on every rank; shown once, by rank 0
        hazard = exception_save_hazard(self.trainer.callbacks, self.trainer.world_size)
        if hazard is not None:
            rank_zero_warn(hazard)
        self._check_sharded_resume()

    def _check_sharded_resume(self) -> None:
        """Have the strategy's next load in this fit, where the strategy loads the weights and optimizer itself
        (FSDP2's ``ModelParallelStrategy``: a folder of shards, or a whole file), first compare the checkpoint's
        settings with this run's (``check_settings_before_load``: a script's ``trainer.fit(ckpt_path=...)`` refused
        before any weight is taken, as ``lit-grpo fit`` refuses it; marked, so ``on_load_checkpoint`` does not compare
        it again), then refuse a folder whose optimizer has other param groups than this run's
        (``check_sharded_param_groups``): it loads into the groups as built, before ``on_load_checkpoint`` could
        regroup it. Such a strategy restores after ``on_fit_start``, and no hook is told the path before
        (``trainer.ckpt_path`` is set as the load starts), so the load is wrapped for one call, as ``on_train_end``
        wraps the teardown. A fit that loads nothing leaves the wrapper behind (no hook of this module runs at the
        end of a failed fit): it holds the module weakly, and checks only while it is the strategy's, so that it
        neither keeps a module fitted before alive nor checks the next module's load against this one's settings."""
        strategy = self.trainer.strategy
        strategy.__dict__.pop("load_checkpoint", None)  # a wrapper an earlier fit left uncalled
        if not strategy.restore_checkpoint_after_setup:  # read before setup: on_load_checkpoint compares it first
            return
        load, owner = strategy.load_checkpoint, weakref.ref(self)

        def load_checking_first(checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            del strategy.load_checkpoint  # once: the class's own from now on
            module = owner()
            if (module is None or strategy.lightning_module is not module
                    or module.trainer.state.fn != TrainerFn.FITTING):
                return load(checkpoint_path, *args, **kwargs)
            check_settings_before_load(checkpoint_path, module, module.trainer, unread=unread_settings,
                                       reward_changes=reward_changes,
                                       weights_only=kwargs.get("weights_only", args[0] if args else None))
            try:
                if os.path.isdir(checkpoint_path):
                    with config_errors("--ckpt_path"):
                        check_sharded_param_groups(checkpoint_path, len(module.optimizers().optimizer.param_groups),
                                                   module.hparams.weight_decay)
                return load(checkpoint_path, *args, **kwargs)
            except BaseException:
                forget_settings_checked(module)  # no on_load_checkpoint follows: a later load is compared
                raise

        strategy.load_checkpoint = load_checking_first

    def _warn_of_max_steps_inside_a_training_step(self) -> None:
        """Lightning stops after the training step that reaches ``max_steps``: one that is not a multiple of a
        training step's optimizer steps runs past it, a count verl's rollouts and TRL's steps make easy to miss."""
        max_steps, per_training_step = self.trainer.max_steps, self.optimizer_steps_per_training_step
        if max_steps > 0 and max_steps % per_training_step:
            training_steps = global_steps_to_run(max_steps, per_training_step) // per_training_step
            hp = self.hparams
            rank_zero_warn(f"{shown_setting('trainer.max_steps', max_steps)} is not a multiple of a training step's "
                           f"optimizer steps, {shown_value(per_training_step)} (model.num_iterations "
                           f"{shown_value(hp.num_iterations)} x model.num_mini_batches "
                           f"{shown_value(hp.num_mini_batches)}): the fit runs {shown_value(training_steps)} training "
                           f"steps, to global_step {shown_value(training_steps * per_training_step)}, where its "
                           "learning-rate schedule ends")

    def _check_validation_interval(self) -> None:
        """Refuse, naming the keys, an interval of training steps past the epoch while validation counts within each
        epoch (verl's test_freq, TRL's eval_steps, ported as val_check_interval): Lightning refuses it later, in its
        own words and with a traceback."""
        trainer = self.trainer
        interval, every_n_epochs = trainer.val_check_interval, trainer.check_val_every_n_epoch
        epoch_steps = getattr(trainer.datamodule, "num_train_steps_per_epoch", None)
        if (not isinstance(interval, int) or every_n_epochs is None or trainer.limit_train_batches != 1.0
                or epoch_steps is None):
            return
        steps = epoch_steps()
        if interval > steps:
            raise ConfigError(f"trainer.val_check_interval={interval} is more than an epoch's {steps} training steps "
                              f"(data.steps_per_epoch) while trainer.check_val_every_n_epoch={every_n_epochs} counts "
                              "it within each epoch: set trainer.check_val_every_n_epoch: null to validate every "
                              f"{interval} training steps of the run, or val_check_interval <= {steps}")

    def on_validation_start(self) -> None:
        self._hand_over_to_data()

    def _hand_over_to_data(self) -> None:
        """The one place the data side receives what this module owns: the policy, its tokenizer, the advantage
        scaling and the reward functions' aggregation (part of the objective) and the world (ranks, a gather across
        them, the precision context)."""
        attach = getattr(self.trainer.datamodule, "attach", None)
        if attach is None:  # plain dataloaders: nothing to hand over
            return
        strategy = self.trainer.strategy
        attach(self._require_policy(), self.tokenizer, scale_rewards=self.hparams.scale_rewards,
               multi_objective_aggregation=self.hparams.multi_objective_aggregation,
               world_size=self.trainer.world_size,
               all_gather=strategy_all_gather(strategy),
               precision_context=self.trainer.precision_plugin.forward_context,
               rollout_weights=self.rollout_weights(), measured_update_peak=self.measured_update_peak)

    # ------------------------------------------------------------------------------------------ optimizer
    def configure_optimizers(self):
        hp = self.hparams
        policy = self._require_policy()
        groups = weight_decay_groups(policy, hp.weight_decay)
        params = [p for group in groups for p in group["params"]]
        if not params:
            raise ValueError("the policy has no trainable parameters")
        scaled = self._trainer is not None and getattr(self.trainer.precision_plugin, "scaler", None) is not None
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas),
                                      fused=fused_adamw(params, loss_scaled=scaled) or None)
        max_steps = (global_steps_to_run(self.trainer.max_steps, self.optimizer_steps_per_training_step)
                     if self._trainer is not None else None)
        schedule = lr_lambda(hp.lr_schedule, hp.warmup_steps, max_steps, hp.min_lr_ratio)
        # a constant schedule's (a decay's was refused); a warm-up of 1 step is at the full rate already
        if max_steps is not None and 0 < max_steps <= hp.warmup_steps and hp.warmup_steps > 1:
            rounded = (f" ({max_steps} optimizer steps, rounded up to whole training steps)"
                       if max_steps != self.trainer.max_steps else "")
            rank_zero_warn(f"model.warmup_steps={hp.warmup_steps} is not below trainer.max_steps="
                           f"{self.trainer.max_steps}{rounded}: the whole run is warm-up, its rate rising to "
                           f"{max_steps / hp.warmup_steps:g} x model.lr at its last step; lower model.warmup_steps")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        """The optimizer takes this run's settings: a resumed run has the checkpoint's param groups back, whose
        rate, betas and weight decay are the saved run's, the rate at the saved run's schedule, and whose kernel
        (fused or not) is the saved run's device's. The group without decay (``weight_decay_groups``) stays at 0."""
        hp = self.hparams
        scheduler, optimizer = self.lr_schedulers(), self.optimizers().optimizer
        groups = weight_decay_groups(self._require_policy(), hp.weight_decay)
        scheduler.base_lrs = [hp.lr] * len(optimizer.param_groups)
        for group, wanted, factor in zip(optimizer.param_groups, groups, scheduler.lr_lambdas):
            group.update(initial_lr=hp.lr, lr=hp.lr * factor(scheduler.last_epoch), betas=tuple(hp.betas),
                         weight_decay=wanted["weight_decay"])
        _match_fused(optimizer)

    # ------------------------------------------------------------------------------------------ log-probs
    def _micro_batches(self, batch: RolloutBatch, mini_batches: int = 1) -> list[MicroBatch]:
        """The step's micro-batches of ``train_micro_batch_size`` consecutive rows, each with its model inputs
        (``RolloutBatch.micro_batch``), cut once per step and without waiting on the device; none spans two of
        ``mini_batches`` equal runs of rows (``_mini_batches``)."""
        size, total = self.hparams.train_micro_batch_size, batch.num_completions
        span = total // mini_batches
        micro_batches = [(rows, batch.micro_batch(rows))
                         for first in range(0, total, span)
                         for rows in (range(start, min(start + size, first + span))
                                      for start in range(first, first + span, size))]
        if self.uses_shared_prefix == "auto":
            self._decide_sharing(micro_batches)
        return micro_batches

    def _mini_batches(self, batch: RolloutBatch) -> list[list[MicroBatch]]:
        """The step's ``num_mini_batches`` mini-batches, in order, each its whole groups' micro-batches."""
        count = self.hparams.num_mini_batches
        self._check_mini_batches(batch.num_prompts, ValueError)
        span = batch.num_completions // count
        minis: list[list[MicroBatch]] = [[] for _ in range(count)]
        for rows, micro in self._micro_batches(batch, count):
            minis[rows[0] // span].append((rows, micro))
        return minis

    def _check_mini_batches(self, groups: int, error: type[ValueError]) -> None:
        """Raise ``error`` where ``num_mini_batches`` does not divide ``groups``, the step's groups on each rank."""
        count = self.hparams.num_mini_batches
        if groups % count:
            divisors = [d for d in range(1, groups + 1) if groups % d == 0]
            raise error(f"{shown_setting('model.num_mini_batches', count)} must divide the step's groups on each "
                        f"rank, data.prompts_per_step={groups}: each mini-batch holds whole groups, as many in each; "
                        f"use one of {divisors}")

    def _decide_sharing(self, micro_batches: list[MicroBatch]) -> None:
        """``shared_prefix: auto`` decided for each micro-batch (``logprobs.shares_prefix``, from its own prompt
        length) into its ``"shared_prefix"`` key, the same on every rank under FSDP2: a shared forward runs the
        sharded layers twice, each run gathering their weights, so ranks deciding apart would wait on each other's
        gathers. One max over the ranks a step; their micro-batches repeat prompts alike (equal B, G and rows)."""
        policy = self._require_policy()
        shares = [shares_prefix(policy, micro, "auto") for _, micro in micro_batches]
        if is_fsdp_sharded(policy) and _world_size(self._trainer) > 1:
            votes = torch.tensor(shares, dtype=torch.float32, device=self.device)
            shares = [bool(vote) for vote in self.trainer.strategy.reduce(votes, reduce_op="max").tolist()]
        for (_, micro), share in zip(micro_batches, shares):
            micro["shared_prefix"] = share

    def _loss_mask(self, micro: dict[str, Any]) -> torch.Tensor:
        """``[m, T']`` the tokens of a micro-batch that carry loss: drawn by the policy, in a row that is neither
        truncated under ``mask_truncated_completions`` nor of a skipped group."""
        mask = micro["drawn_mask"]  # a tool's result (data.tools) is no token the policy chose: no loss
        if self.hparams.mask_truncated_completions:
            mask = mask * (~micro["truncated"]).unsqueeze(1).to(mask.dtype)
        skipped = micro.get("skipped")
        if skipped is not None:  # reward errors (on_reward_error="skip_group"): no loss
            mask = mask * (~skipped).unsqueeze(1).to(mask.dtype)
        return mask

    @torch.no_grad()
    def _frozen_logps(self, model: torch.nn.Module, batch: RolloutBatch,
                      micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """``model``'s ``[m, T']`` log-probs of each micro-batch, without a graph (the old policy's, the
        reference's)."""
        return [self._logps(model, micro, batch.temperature)[0] for _, micro in micro_batches]

    def _logps(self, model: torch.nn.Module, micro: dict[str, Any], temperature: float, entropy_grad: bool = False):
        """``[m, T']`` log-probs and entropies (with ``entropy_grad`` differentiable: the entropy bonus); the logits
        are never materialized whole (lit_grpo.update.logprobs). Under fsdp the output head runs on the root's
        gathered weights, which FSDP2 keeps until the backward."""
        return completion_logps(model, micro, temperature, entropy_grad=entropy_grad,
                                shared_prefix=micro.get("shared_prefix", self.uses_shared_prefix))

    def _micro_batches_over_ranks(self, mini_batches: list[list[MicroBatch]]) -> list[int]:
        """Each mini-batch's micro-batches summed over every rank (the entropy bonus's weight in its optimizer
        step): one reduction a training step, which every rank runs (the loss settings are every rank's)."""
        counts = [len(micro_batches) for micro_batches in mini_batches]
        if _world_size(self._trainer) > 1:
            totals = torch.tensor(counts, dtype=torch.float32, device=self.device)
            counts = [int(c) for c in self.trainer.strategy.reduce(totals, reduce_op="sum").tolist()]
        return counts

    def _total_active_tokens(self, micro_batches: list[MicroBatch]) -> float:
        """The active loss tokens of one optimizer step's ``micro_batches`` (dapo's normalizer), summed over every
        rank (``_active_tokens_per_mini_batch`` for each of a step's mini-batches)."""
        return self._active_tokens_per_mini_batch([micro_batches])[0]

    def _active_tokens_per_mini_batch(self, mini_batches: list[list[MicroBatch]]) -> list[float]:
        """Each mini-batch's active loss tokens (dapo's normalizer of its optimizer step), summed over its
        micro-batches and every rank: read to the host once per training step, so that no micro-batch's loss waits
        on the device for it."""
        totals = torch.stack([torch.stack([self._loss_mask(micro).sum() for _, micro in micro_batches]).sum()
                              for micro_batches in mini_batches]).float()
        if _world_size(self._trainer) > 1:
            totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        return totals.tolist()

    # ------------------------------------------------------------------------------------------ training
    def training_step(self, batch: RolloutBatch, batch_idx: int = 0) -> torch.Tensor:
        optimizer = self.optimizers()
        self._update_peak_bytes = None
        metrics = self.grpo_step(batch, optimizer, self.lr_schedulers())
        optimizer.zero_grad(set_to_none=True)  # the next rollout needs their memory; the next update starts anew
        self._read_update_peak()
        loss = torch.tensor(metrics["train/loss"])  # this rank's value (module docstring: its mean over ranks)
        if self.trainer.world_size > 1:
            # the whole step's figures, the same on every rank: one gather of every rank's values, then each key's
            # rule (lit_grpo.rollout.metrics.RANK_REDUCTIONS, ratios by RATIO_WEIGHTS); rank_skew goes in as this
            # rank's rollout seconds
            strategy = self.trainer.strategy
            # what reward functions logged (log_metric) may differ between ranks: their names are gathered first
            logged = union_over_ranks(logged_reward_keys(batch.metrics, batch.reward_components))
            metrics = whole_step_metrics({**metrics, "rollout/rank_skew": batch.stats.wall_s},
                                         step_metric_keys(batch.reward_components, logged),
                                         strategy_all_gather(strategy))
        self.log_dict(loggable(metrics), on_step=True, on_epoch=False, batch_size=batch.num_prompts)
        return loss

    def _read_update_peak(self) -> None:
        """Fold the CUDA allocator's peak into this update's, before each optimizer step and at the end: what a
        reset inside the step (``PeakMemoryMonitor``'s, before the optimizer step) would hide is read first."""
        if self.device.type == "cuda":
            self._update_peak_bytes = max(self._update_peak_bytes or 0, torch.cuda.max_memory_allocated(self.device))

    def measured_update_peak(self) -> int | None:
        """The CUDA allocator's peak in the last update: at least that update's own (the allocator's since its last
        reset, read before each optimizer step and at the end; ``PeakMemoryMonitor`` resets it as the update starts
        and before the optimizer step). None before one, or off CUDA.
        The data side reads it for ``keep_kv_cache: auto`` (``rollout.slot_memory.CacheKeeping``)."""
        return self._update_peak_bytes

    def grpo_step(self, batch: RolloutBatch, optimizer: torch.optim.Optimizer,
                  scheduler: Any | None = None) -> dict[str, float]:
        """The whole update on one step's batch (``num_iterations`` passes over its ``num_mini_batches``
        mini-batches, an optimizer step each); returns the scalars to log (each the mean over those optimizer
        steps), and under ``weight/`` the weights of its ratios over ranks (``lit_grpo.rollout.metrics.loggable``
        drops them).

        Works with or without a Trainer (without one: plain ``backward``, the norm and the clipping before the step).
        """
        hp = self.hparams
        if batch.group_size < 2:
            raise ValueError(f"group_size={batch.group_size}: GRPO training needs >= 2 completions per prompt (a lone "
                             "completion has no group to be compared with, so its advantage is always 0)")
        policy = self._require_policy()
        kernel = resolve_update_linear(hp.cpu_linear, policy, is_fsdp_sharded(policy))
        with onednn_linears(policy, kernel):
            mini_batches = self._mini_batches(batch)
            loss_fn = self.loss_fn
            total_active = (self._active_tokens_per_mini_batch(mini_batches) if loss_fn.needs_step_tokens
                            else [None] * len(mini_batches))
            bonus_batches = (self._micro_batches_over_ranks(mini_batches) if self.entropy_control.enabled
                             else [len(micro_batches) for micro_batches in mini_batches])
            # the old policy's log-probs, all taken before the first optimizer step; a mini-batch whose first
            # forward comes before any step (the first, in a single pass) takes its own forward's instead
            old_logps: list[list[torch.Tensor] | None] = [
                self._frozen_logps(policy, batch, micro_batches) if hp.num_iterations > 1 or index > 0 else None
                for index, micro_batches in enumerate(mini_batches)]
            ref_logps: list[list[torch.Tensor] | None] = [None] * len(mini_batches)
            beta = loss_fn.config.beta
            if beta > 0:
                with self._reference() as reference:
                    ref_logps = [self._frozen_logps(reference, batch, micro_batches) for micro_batches in mini_batches]

            sums: dict[str, float] = {}
            correction = self.sampler_correction.for_batch(batch.offpolicy_tokens > 0)
            correction_stats = CorrectionStats()
            optimizer_steps = hp.num_iterations * len(mini_batches)
            # PPO's order, as verl's and TRL's: each pass (iteration) runs over every mini-batch in turn
            for iteration in range(hp.num_iterations):
                for index, micro_batches in enumerate(mini_batches):
                    step_metrics = self._update(batch, micro_batches, optimizer, old_logps[index], ref_logps[index],
                                                total_active[index], iteration, correction, correction_stats,
                                                bonus_batches[index])
                    # the rate this optimizer step used: read before the scheduler moves it on (so warm-up shows)
                    step_metrics["lr"] = optimizer.param_groups[0]["lr"]
                    self._sync_reference_when_due(optimizer)
                    for key, value in step_metrics.items():
                        sums[key] = sums.get(key, 0.0) + value / optimizer_steps
                    # a loss scaler's overflow skipped the optimizer step (its norm is not finite; any other
                    # raised): the schedule counts the steps taken
                    if scheduler is not None and math.isfinite(self._grad_norm):
                        scheduler.step()
        logged = {k if k.startswith(WEIGHT_PREFIX) else f"train/{k}": v for k, v in sums.items()
                  if k != "kl" or beta > 0}
        logged.update(correction_stats.as_metrics())
        logged.update(rollout_metrics(batch))
        return logged

    def _update(self, batch: RolloutBatch, micro_batches: list[MicroBatch], optimizer: torch.optim.Optimizer,
                old_logps: list[torch.Tensor] | None, ref_logps: list[torch.Tensor] | None,
                total_active: float | None, iteration: int, correction: SamplerCorrection,
                correction_stats: CorrectionStats, bonus_batches: int | None = None) -> dict[str, float]:
        """One optimizer step over ``micro_batches``, one mini-batch's (``_mini_batches``; the whole batch's with
        one): each one's forward, loss and backward, then ``_end_step``; returns the step's metrics (the sampler
        correction's, resolved for this batch, go to ``correction_stats`` in the first iteration). ``old_logps``:
        each micro-batch's old log-probs (None: its forward's own, the weights have not moved since the rollout);
        ``total_active``: dapo's normalizer, the mini-batch's active tokens over every rank; ``bonus_batches``: the
        optimizer step's micro-batches on every rank (the entropy bonus's weight; None: this rank's)."""
        loss_fn = self.loss_fn
        optimizer.zero_grad(set_to_none=True)
        step = StepMetrics()
        step_rows = sum(len(rows) for rows, _ in micro_batches)  # the loss types' weights: this optimizer step's rows
        world = _world_size(self._trainer)
        control = self.entropy_control
        # the previous step's coefficient for every micro-batch of this one; where it is 0 (the adaptive control's
        # gate closed) the entropy needs no gradient, and the forward stays the lean one
        coef = control.applied() if control.enabled else 0.0
        weight_of_bonus = bonus_weight(bonus_batches or len(micro_batches), world) if coef else 0.0
        # the high-entropy quantile over every rank's micro-batch of this index, as TRL's: the ranks' rows are
        # B x G each, so they run as many micro-batches and meet in each one's gathers
        quantile = loss_fn.config.top_entropy_quantile
        spans_ranks = world > 1 and quantile < 1
        gather = strategy_all_gather(self.trainer.strategy) if spans_ranks else None
        # every rank's bound on a micro-batch's entropies, alike on every rank (rows x the rollout's length cap),
        # so each mask's ranks meet in one gather, without asking one another for their widths first
        capacity = self.hparams.train_micro_batch_size * batch.max_new_tokens if batch.max_new_tokens > 0 else None
        for index, (rows, micro) in enumerate(micro_batches):
            logps, entropy = self._logps(self.policy, micro, batch.temperature, entropy_grad=coef != 0)
            mask = self._loss_mask(micro)
            # with one iteration the weights have not moved since the rollout: this forward's log-probs are the old
            old = old_logps[index] if old_logps is not None else logps.detach()
            ref = ref_logps[index] if ref_logps is not None else None
            weights = correction.weights(old, micro["sampling_logprobs"], mask)
            if iteration == 0:
                correction_stats.update(old, micro["sampling_logprobs"], mask, weights)
            # one high-entropy mask for the policy term and the bonus: under several ranks each take is a gather
            kept = high_entropy_mask(entropy, mask, quantile, gather, capacity) if quantile < 1 else None
            loss = loss_fn(logps, old, micro["advantages"], mask, ref, batch.max_new_tokens, total_active, weights,
                           micro["sampling_logprobs"], entropy, all_gather=gather, entropy_mask=kept)
            loss = loss * loss_fn.micro_batch_weight(len(rows), step_rows, len(micro_batches), world)
            if control.enabled:
                tokens = bonus_tokens(entropy.detach(), mask, quantile, gather, entropy_mask=kept)
                if coef:
                    loss = loss - coef * (entropy_bonus(entropy, tokens) * weight_of_bonus)
                if control.adaptive:
                    step.add_entropy_stats(entropy_stats(entropy, tokens))
            # a non-finite loss still goes backward (the ranks' collectives stay paired); _end_step finds it
            self._backward(loss, last=index == len(micro_batches) - 1)
            step.add(loss, loss_fn.metrics(logps.detach(), old, micro["advantages"], mask, ref, weights),
                     entropy.detach(), micro["drawn_mask"])
            del logps, entropy, loss
        return self._end_step(step, micro_batches, optimizer, iteration)

    def _end_step(self, step: StepMetrics, micro_batches: list[MicroBatch], optimizer,
                  iteration: int) -> dict[str, float]:
        """After every micro-batch's backward: the losses' finiteness check on every rank, the optimizer step (the
        gradient norm and clipping before it) and the adaptive entropy control's move; returns the step's metrics."""
        control = self.entropy_control
        # the step's one read of its values: the device runs ahead of the host through every micro-batch
        nonfinite = next((f"the micro-batch of rows {rows[0]}..{rows[-1]} has loss {value}"
                          for (rows, _), value in zip(micro_batches, step.read()) if not math.isfinite(value)), None)
        # one gather a step, on every rank: which ranks' losses were not finite, and the adaptive control's entropy
        ranks, entropy_totals = self._gather_step_end(nonfinite, step.entropy_totals() if control.adaptive else [])
        self._raise_on_nonfinite_loss(nonfinite, optimizer, iteration, ranks)
        if self.device.type == "cpu":  # the freed activations leave the heap before AdamW's state joins it
            release_freed_host_memory()
        self._iteration = iteration
        if not isinstance(optimizer, LightningOptimizer):  # a plain optimizer: Lightning's hook will not run
            self._grad_norm = self._check_and_clip_gradients(optimizer)
        # a Trainer's optimizer checks and clips in on_before_optimizer_step, inside step(), on unscaled gradients
        self._read_update_peak()
        optimizer.step()
        if not isinstance(optimizer, LightningOptimizer):  # a Trainer's steps are counted by Lightning
            self._plain_optimizer_steps += 1
        metrics = step.result(self._grad_norm)
        if control.enabled:
            if control.adaptive:
                control.end_step(*entropy_totals)
            metrics["entropy_coef"] = control.coef  # the next step's, as TRL logs it
        return metrics

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of one micro-batch's ``loss``; ``last``: the optimizer step's last micro-batch.

        Under a Trainer, ddp all-reduces the gradients once per optimizer step, in the last micro-batch's backward;
        the others accumulate locally (no_sync). A no-op for one process and for FSDP2, whose own hooks
        reduce-scatter each backward's gradients (skipping that would hold unsharded gradients)."""
        if self._trainer is None:
            loss.backward()
            return
        strategy = self.trainer.strategy
        blocks_sync = isinstance(strategy, ParallelStrategy)
        with contextlib.nullcontext() if last or not blocks_sync else strategy.block_backward_sync():
            self.manual_backward(loss)

    def _sync_reference_when_due(self, optimizer: torch.optim.Optimizer) -> None:
        """After an optimizer step: mix the policy into the reference where the steps taken are a multiple of
        ``reference_sync.every_n_steps`` (lit_grpo.update.reference_sync). Checked after every optimizer step, so
        with several a training step (``num_iterations``, ``num_mini_batches``) no multiple is passed over."""
        if self.reference_sync is None:
            return
        if self.reference_sync.due(self._steps_taken(optimizer)):
            mix_parameters(self.ref_model, self._require_policy(), self.reference_sync.mixup_alpha)
            self._reference_is_initial = False

    def _steps_taken(self, optimizer: torch.optim.Optimizer) -> int:
        """The optimizer steps taken so far, the one just taken included: ``trainer.global_step`` for a Trainer's
        optimizer (Lightning counts each step as it ends; a resumed run goes on from the checkpoint's); for a plain
        one (``grpo_step`` called without a Trainer's optimizer) the steps grpo_step took with one since this
        module was built."""
        if isinstance(optimizer, LightningOptimizer):
            return self.trainer.global_step
        return self._plain_optimizer_steps

    def _gather_step_end(self, nonfinite: str | None, totals: list[float]) -> tuple[list[int], list[float]]:
        """The ranks whose loss was not finite, and ``totals`` summed over the ranks: one gather of a flag and the
        totals under several processes (every rank calls it once per optimizer step, with as many totals), none
        in one. ``nonfinite``: this rank's finding (``_raise_on_nonfinite_loss``)."""
        if _world_size(self._trainer) == 1:
            return ([0] if nonfinite is not None else []), list(totals)
        mine = torch.tensor([float(nonfinite is not None), *totals], dtype=torch.float64)
        gathered = strategy_all_gather(self.trainer.strategy)(mine).reshape(-1, len(totals) + 1).cpu()
        return torch.nonzero(gathered[:, 0]).flatten().tolist(), gathered[:, 1:].sum(dim=0).tolist()

    def _raise_on_nonfinite_loss(self, nonfinite: str | None, optimizer: torch.optim.Optimizer,
                                 iteration: int, ranks: list[int]) -> None:
        """Raise, before the optimizer step, where any rank's loss was not finite: on every rank (``ranks``, found by
        ``_gather_step_end``), so no rank steps or waits alone. ``nonfinite``: this rank's finding."""
        if not ranks:
            return
        optimizer.zero_grad(set_to_none=True)
        where = f"on rank {', '.join(map(str, ranks))} " if _world_size(self._trainer) > 1 else ""
        here = f": {nonfinite}" if nonfinite is not None else " (this rank's losses were finite)"
        raise NonFiniteStepError(
            f"non-finite GRPO loss {where}at global step {self.global_step}, iteration {iteration}{here}; this "
            "optimizer step was not taken: the weights are the last step's. Check the rewards/advantages, lower lr, "
            "or use float32/bf16-mixed.")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Lightning calls it inside optimizer.step(), after a 16-mixed GradScaler has unscaled the gradients (before
        # that they are the loss-scaled ones) and before the update: the norm, the check and clipping see true ones.
        self._grad_norm = self._check_and_clip_gradients(optimizer)

    def _check_and_clip_gradients(self, optimizer: torch.optim.Optimizer) -> float:
        """The gradients' total norm, after raising where it is not finite (except under a loss scaler, whose step
        is skipped and its scale lowered: an fp16 overflow is routine there) and clipping to ``max_grad_norm``."""
        grad_norm = gradient_norm(self.policy.parameters())
        if not math.isfinite(grad_norm):
            scaler = getattr(self.trainer.precision_plugin, "scaler", None) if self._trainer is not None else None
            if scaler is not None:
                return grad_norm
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteStepError(f"non-finite gradient norm ({grad_norm}) at global step {self.global_step}, "
                                     f"iteration {self._iteration}; this optimizer step was not taken: the weights "
                                     "are the last step's.")
        max_norm = self.hparams.max_grad_norm
        if max_norm:  # by the norm just taken: clip_grad_norm_ would read every gradient again for it
            torch.nn.utils.clip_grads_with_norm_([p for p in self.policy.parameters() if p.grad is not None],
                                                 max_norm, torch.tensor(grad_norm))
        return grad_norm

    # ------------------------------------------------------------------------------------------ validation
    def validation_step(self, batch: RolloutBatch, batch_idx: int = 0) -> None:
        """Greedy completions of held-out prompts (built by the DataModule): val/accuracy and val/reward; with
        sampled validation also val/mean_at_k and val/pass_at_k (lit_grpo.update.held_out). ``None``: a rank
        short of held-out prompts (an empty chunk; see ``RolloutDataModule.val_dataloader``)."""
        if batch is None:
            return
        for key, metric in self.held_out.update(batch).items():
            self.log(key, metric, on_step=False, on_epoch=True, batch_size=batch.num_prompts)
        self.validation_logs.add(batch.metrics)

    def on_validation_epoch_start(self) -> None:
        self.validation_logs.reset()  # a validation that stopped midway left its values

    def on_validation_epoch_end(self) -> None:
        """``val/reward/<name>`` and ``val/reward_at_k/<name>``: what reward functions logged in this validation's
        greedy and sampled calls (``ValidationLogs``), over every rank's (a gather every rank joins, a rank short of
        held-out prompts too)."""
        gather = strategy_all_gather(self.trainer.strategy) if _world_size(self._trainer) > 1 else None
        for key, value in self.validation_logs.compute(gather).items():
            # already the same on every rank: Lightning's mean over ranks keeps it (and it warns without one)
            self.log(key, value, on_step=False, on_epoch=True, sync_dist=True)


def fused_adamw(params: list[torch.Tensor], loss_scaled: bool = False) -> bool:
    """Whether AdamW updates ``params`` fused (one kernel for all of them, its step count on the device): where they
    all live on a GPU, and no loss scaler (16-mixed) scales the gradients: Lightning leaves a fused optimizer to
    unscale them inside its step, after the gradient norm and clipping here have read them. On a CPU torch's default
    (foreach) is as fast, so it stays."""
    return (not loss_scaled and bool(params)
            and all(p.device.type == "cuda" and p.is_floating_point() for p in params))


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's param groups of ``model``'s trainable parameters, split as transformers' Trainer splits them
    (``Trainer.get_decay_parameter_names``, TRL's too): ``weight_decay`` on the rest, none on the parameters of
    ``nn.LayerNorm`` modules and those whose name says bias or norm (RMSNorm weights: ``layernorm``, ``rmsnorm``,
    a ``norm`` or ``*_norm`` part). In that order, an empty group left out (a LoRA adapter has no bias). Names are
    the module's own: an FSDP2-sharded model keeps them. ``weight_decay`` 0: one group of them all, in the model's
    order (nothing decays either way), as a checkpoint saved without the groups holds them."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not weight_decay:
        return [{"params": [p for _, p in named], "weight_decay": weight_decay}]
    from transformers import Trainer  # slow to import: only where its rule is needed

    # the Trainer's rule itself: a method that reads only the model, in every transformers version that has it
    decays = set(Trainer.get_decay_parameter_names(None, model))
    groups = [{"params": [p for name, p in named if name in decays], "weight_decay": weight_decay},
              {"params": [p for name, p in named if name not in decays], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def regrouped(state: dict[str, Any], saved: list[dict[str, Any]], built: list[dict[str, Any]]) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` from param groups ``saved`` for ``built``'s, the same parameters grouped
    otherwise: each keeps its saved number, so its state (AdamW's moments) follows it; the settings are group 0's.

    Raises:
        ValueError: ``saved``'s groups are not the state's (other sizes: another run's trainable weights).
    """
    sizes, saved_sizes = ([len(group["params"]) for group in groups] for groups in (state["param_groups"], saved))
    if sizes != saved_sizes:
        raise ValueError(f"an optimizer state of param groups of {sizes} parameters cannot be regrouped: this model's "
                         f"weights, grouped as it was saved, make groups of {saved_sizes}")
    number = {id(p): n for numbers, group in zip(state["param_groups"], saved)
              for n, p in zip(numbers["params"], group["params"])}
    settings = {key: value for key, value in state["param_groups"][0].items() if key != "params"}
    return {**state, "param_groups": [{**settings, "params": [number[id(p)] for p in group["params"]]}
                                      for group in built]}


def _match_fused(optimizer: torch.optim.Optimizer) -> None:
    """Give each param group back the optimizer's own ``fused`` setting (``fused_adamw``'s choice for this run's
    device) where a checkpoint saved on another device brought its own, with its step counts where that kernel
    keeps them: on the parameters' device (fused) or on the CPU (foreach), as ``Optimizer.load_state_dict`` places
    them for the group's setting."""
    fused = optimizer.defaults.get("fused")
    for group in optimizer.param_groups:
        if group.get("fused") == fused:
            continue
        group["fused"] = fused
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if "step" in state:
                state["step"] = (state["step"].to(device=param.device, dtype=torch.float32) if fused
                                 else state["step"].to("cpu"))


def _world_size(trainer: Any | None) -> int:
    """The processes training together: the trainer's world size, 1 for a module used outside a Trainer (its
    ``_trainer`` is None; ``self.trainer`` would raise)."""
    return trainer.world_size if trainer is not None else 1


def _drop_reference(checkpoint: dict[str, Any]) -> None:
    """Remove the reference model's weights (``ref_model.*``) from ``checkpoint``'s state, if it has any."""
    state = checkpoint.get("state_dict", {})
    for key in [k for k in state if k.startswith("ref_model.")]:
        del state[key]
