"""One GRPO run's settings for ``tools.compare_trl``, and what each system is given from them.

:func:`build_spec` makes the spec: the demo's settings (``configs/demo.yaml``: model, dtype, task and its prompts,
system prompt, reward, DAPO loss and its epsilons, beta, reward scaling and aggregation, learning rate, AdamW's
betas and weight decay, the learning rate's warm-up, gradient clipping, micro-batch, gradient checkpointing,
temperature) with a shape's prompts per step B, group size G and new tokens put in. From it :func:`lit_config`
writes the ``lit-grpo fit`` config and :func:`trl_config` the keyword arguments of TRL's ``GRPOConfig``;
:func:`trl_other_settings` says in words what the TRL side is given besides (the model object, the optimizer,
the reward, the prompts). Every value either side trains with comes from the spec, set explicitly on both, so a
default that differs between the two systems cannot slip in.

One optimizer step per GRPO step on both sides: lit_grpo's update takes the B x G rows in micro-batches of
``train_micro_batch_size`` and steps once; TRL gets ``per_device_train_batch_size`` = that micro-batch and
``gradient_accumulation_steps`` = ``steps_per_generation`` = B x G / micro-batch, so it generates the B x G
completions at once and steps once (with generation and steps aligned TRL computes no old log-probs either).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import yaml

from tools import harness

DEMO_CONFIG = harness.ROOT / "configs" / "demo.yaml"
#: The shapes ``--shape`` takes: cells of (prompts per step B, group size G, new tokens), their default timed steps and
#: ``untimed_steps`` (the warm-up steps before them; default 1), and what a shape holds fixed: ``rows`` (the update's
#: micro-batch and lit_grpo's slots; default the demo's, capped at B x G) and ``gradient_checkpointing`` (both systems';
#: default the demo's). The G sweep varies G alone: at G 8 one prompt gives 8 rows, so every G gets 8-row micro-batches
#: and 8 slots, and a change of peak with G is the group's, not a larger micro-batch's.
SHAPES: dict[str, dict[str, Any]] = {
    "demo": {"cells": [(None, None, None)], "steps": 8},  # None: the demo's own B, G and tokens
    "4x32x64": {"cells": [(4, 32, 64)], "steps": 8},
    "gsweep": {"cells": [(1, 8, 32), (1, 32, 32), (1, 64, 32), (1, 128, 32)], "steps": 1, "rows": 8},
    # the G sweep of a GPU (with --device cuda --precision bf16-mixed --model random:qwen3-1.7b): tokens where a
    # step's KV cache is a real share of its memory
    "gpu_gsweep": {"cells": [(1, 8, 512), (1, 32, 512), (1, 64, 512)], "steps": 1, "rows": 8},
    # where the KV cache decides a step's memory: 4,096 new tokens, G 256 first (the point of the project; random
    # weights run every sample to the cap), with --lit-slots auto; checkpointed, as the GPU recipe is: an 8-row
    # micro-batch of 4K-token rows keeps more activations for its backward than an H200 holds. One step, no
    # warm-up: a step takes minutes, and its peak is the figure (its time counts the graph captures, in capture_s)
    "gpu_long": {"cells": [(1, 256, 4096), (1, 32, 4096), (1, 64, 4096), (1, 128, 4096)], "steps": 1,
                 "untimed_steps": 0, "rows": 8, "gradient_checkpointing": True},
}
PRECISIONS = ("32-true", "bf16-mixed")
DEVICES = ("cpu", "cuda")
#: lit_grpo's slots: the shape's fixed count (or the demo's g), one per sample, or ``micro_group_size: auto`` (from
#: the device's free memory on a GPU); or a positive integer, the same count at every G (capped at B x G).
LIT_SLOTS = ("fixed", "all", "auto")
#: TRL's generation paths: ``model.generate`` on the padded batch, or transformers' continuous batching.
TRL_GENERATION = ("generate", "continuous_batching")
#: The timing harness' callback in the lit_grpo run (tools/compare_trl_runs.py).
STEP_RECORDER = "tools.compare_trl_runs.StepRecorder"
#: lit_grpo's AdamW betas when a config sets none (GRPOModule's default); both sides get them explicitly.
DEFAULT_BETAS = (0.9, 0.99)


def demo_settings(path: Path | str = DEMO_CONFIG) -> dict[str, Any]:
    """The demo config as a dict."""
    return yaml.safe_load(Path(path).read_text())


def cells(shape: str, demo: dict[str, Any]) -> list[dict[str, int]]:
    """The (B, G, new tokens) cells of ``shape``, the demo's values where the shape leaves them to the demo."""
    sampling = demo["data"]["sampling"]
    out = []
    for prompts, group, tokens in SHAPES[shape]["cells"]:
        cell = {"prompts_per_step": prompts or demo["data"]["prompts_per_step"],
                "group_size": group or sampling["group_size"],
                "max_new_tokens": tokens or sampling["max_new_tokens"]}
        cell.update({key: SHAPES[shape][key] for key in ("rows", "gradient_checkpointing") if key in SHAPES[shape]})
        out.append(cell)
    return out


def is_lit_slots(value: Any) -> bool:
    """Whether ``value`` is a ``lit_slots``: one of ``LIT_SLOTS`` or a count of slots (an integer >= 1)."""
    return value in LIT_SLOTS or isinstance(value, int) and not isinstance(value, bool) and value >= 1


def build_spec(demo: dict[str, Any], cell: dict[str, int], *, model: str | None = None, device: str = "cpu",
               precision: str | None = None, threads: int = 2, seed: int = 0, steps: int = 8,
               untimed_steps: int = 1, trl_generation: str = "generate",
               lit_slots: str | int = "fixed") -> dict[str, Any]:
    """The settings of one run (either system): the demo's, with ``cell``'s B, G and new tokens, ``steps`` timed
    GRPO steps after ``untimed_steps`` warm-up ones, and the given model (default the demo's), device, precision
    (default the demo's), threads and seed. ``lit_slots``: lit_grpo's slots, "fixed" (the shape's rows, else the
    demo's g), "all" (one per sample, B x G: every sample decodes at once, as TRL's ``generate``), "auto"
    (``micro_group_size: auto``: as many as the GPU's free memory holds) or a count (at most B x G): a step's
    memory then stays what that count holds, whatever G."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: use one of {DEVICES}")
    if trl_generation not in TRL_GENERATION:
        raise ValueError(f"trl_generation {trl_generation!r}: use one of {TRL_GENERATION}")
    if not is_lit_slots(lit_slots):
        raise ValueError(f"lit_slots {lit_slots!r}: use one of {LIT_SLOTS} or a count of slots (an integer >= 1)")
    if isinstance(untimed_steps, bool) or not isinstance(untimed_steps, int) or untimed_steps < 0:
        raise ValueError(f"untimed_steps {untimed_steps!r}: use an integer >= 0")
    counted = lit_slots not in LIT_SLOTS
    precision = precision or demo["trainer"].get("precision", "32-true")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {PRECISIONS}")
    m, d = demo["model"], demo["data"]
    sampling = d["sampling"]
    cell = dict(cell)
    fixed_rows = cell.pop("rows", None)
    checkpointing = cell.pop("gradient_checkpointing", m.get("gradient_checkpointing", False))
    rows = cell["prompts_per_step"] * cell["group_size"]
    if fixed_rows is not None and (fixed_rows < 1 or rows % fixed_rows):
        raise ValueError(f"rows {fixed_rows}: the fixed micro-batch must be a positive divisor of B x G = {rows}")
    loss = {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.28, "beta": 0.0,
            "importance_sampling_level": "token", **m.get("loss", {})}
    return {
        "model": harness.resolve_model(model) if model else m["model"],
        "dtype": m.get("dtype", "float32"),
        "precision": precision,
        "device": device,
        "threads": threads,
        "seed": seed,
        "steps": untimed_steps + steps,
        "untimed_steps": untimed_steps,
        **cell,
        "temperature": sampling.get("temperature", 1.0),
        "top_p": sampling.get("top_p", 1.0),
        "top_k": sampling.get("top_k", 0),
        "min_p": sampling.get("min_p", 0.0),
        # a divisor of B x G, so TRL's accumulation covers the rows exactly
        "train_micro_batch_size": fixed_rows or math.gcd(m.get("train_micro_batch_size", 8), rows),
        "loss": loss,
        "scale_rewards": m.get("scale_rewards", "group"),
        "multi_objective_aggregation": m.get("multi_objective_aggregation", "sum_then_normalize"),
        "num_iterations": m.get("num_iterations", 1),
        "mask_truncated_completions": m.get("mask_truncated_completions", False),
        "lr": m["lr"],
        "betas": list(m.get("betas", DEFAULT_BETAS)),
        "weight_decay": m.get("weight_decay", 0.0),
        "lr_warmup_steps": m.get("warmup_steps", 0),
        "lr_schedule": m.get("lr_schedule", "constant"),
        "min_lr_ratio": m.get("min_lr_ratio", 0.0),
        "max_grad_norm": m.get("max_grad_norm", 1.0),
        "gradient_checkpointing": checkpointing,
        "data": {key: copy.deepcopy(d[key]) for key in ("task", "task_config", "size", "data_seed", "val_size",
                                                         "system_prompt", "reward_funcs") if key in d},
        "lit": {"strategy": sampling.get("strategy", "infinite"),
                "micro_group_size": min(lit_slots, rows) if counted else rows if lit_slots == "all"
                else "auto" if lit_slots == "auto" else fixed_rows or min(sampling.get("micro_group_size", 8), rows)},
        "trl": {"generation": trl_generation},
    }


def lit_config(spec: dict[str, Any], records_path: Path | str) -> dict[str, Any]:
    """The ``lit-grpo fit`` config of ``spec``: no validation, checkpoint, logger or progress bar, and the
    ``StepRecorder`` callback writing the step records to ``records_path``."""
    return {
        "seed_everything": spec["seed"],
        "torch_num_threads": spec["threads"],
        "trainer": {
            "accelerator": "gpu" if spec["device"] == "cuda" else "cpu",
            "devices": 1,
            "precision": spec["precision"],
            "max_steps": spec["steps"] * spec["num_iterations"],  # optimizer steps
            "log_every_n_steps": 1,
            "num_sanity_val_steps": 0,
            "limit_val_batches": 0,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": False,
            "callbacks": [{"class_path": STEP_RECORDER, "init_args": {"out": str(records_path)}}],
        },
        "model": {
            "model": spec["model"],
            "dtype": spec["dtype"],
            "loss": dict(spec["loss"]),
            "scale_rewards": spec["scale_rewards"],
            "multi_objective_aggregation": spec["multi_objective_aggregation"],
            "num_iterations": spec["num_iterations"],
            "mask_truncated_completions": spec["mask_truncated_completions"],
            "train_micro_batch_size": spec["train_micro_batch_size"],
            "gradient_checkpointing": spec["gradient_checkpointing"],
            "lr": spec["lr"],
            "betas": list(spec["betas"]),
            "weight_decay": spec["weight_decay"],
            "warmup_steps": spec["lr_warmup_steps"],
            "lr_schedule": spec["lr_schedule"],
            "min_lr_ratio": spec["min_lr_ratio"],
            "max_grad_norm": spec["max_grad_norm"],
        },
        "data": {
            **copy.deepcopy(spec["data"]),
            "prompts_per_step": spec["prompts_per_step"],
            "sampling": {"group_size": spec["group_size"], "micro_group_size": spec["lit"]["micro_group_size"],
                         "strategy": spec["lit"]["strategy"], "max_new_tokens": spec["max_new_tokens"],
                         "temperature": spec["temperature"], "top_p": spec["top_p"], "top_k": spec["top_k"],
                         "min_p": spec["min_p"], "seed": spec["seed"]},
            "dynamic_sampling": False,
            "steps_per_epoch": max(spec["steps"], 1000),
        },
    }


def trl_config(spec: dict[str, Any], output_dir: Path | str) -> dict[str, Any]:
    """The keyword arguments of TRL's ``GRPOConfig`` for ``spec`` (every field the comparison sets)."""
    rows = spec["prompts_per_step"] * spec["group_size"]
    micro = spec["train_micro_batch_size"]
    loss = spec["loss"]
    return {
        "output_dir": str(output_dir),
        "max_steps": spec["steps"],
        "seed": spec["seed"],
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": rows // micro,  # steps_per_generation defaults to it: one step per rollout
        "num_generations": spec["group_size"],
        "max_completion_length": spec["max_new_tokens"],
        "temperature": spec["temperature"],
        "top_p": spec["top_p"],
        "top_k": spec["top_k"],
        "min_p": spec["min_p"] or None,  # TRL's "off"
        "loss_type": loss["loss_type"],
        "epsilon": loss["epsilon_low"],
        "epsilon_high": loss["epsilon_high"],
        "beta": loss["beta"],
        "importance_sampling_level": loss["importance_sampling_level"],
        "scale_rewards": spec["scale_rewards"],
        "multi_objective_aggregation": spec["multi_objective_aggregation"],
        "num_iterations": spec["num_iterations"],
        "mask_truncated_completions": spec["mask_truncated_completions"],
        "reward_weights": [float(reward.get("weight", 1.0)) if isinstance(reward, dict) else 1.0
                           for reward in spec["data"].get("reward_funcs") or ["accuracy"]],
        # the optimizer and its schedule are passed in (trl_other_settings); these say the same for the record
        "learning_rate": spec["lr"],
        "adam_beta1": spec["betas"][0],
        "adam_beta2": spec["betas"][1],
        "weight_decay": spec["weight_decay"],
        "max_grad_norm": spec["max_grad_norm"],
        "gradient_checkpointing": spec["gradient_checkpointing"],
        "bf16": spec["precision"] == "bf16-mixed",
        "fp16": False,
        "use_cpu": spec["device"] == "cpu",
        "use_transformers_continuous_batching": spec["trl"]["generation"] == "continuous_batching",
        "shuffle_dataset": False,  # the dataset is lit_grpo's prompts in the order lit_grpo draws them
        "remove_unused_columns": False,
        "dataloader_num_workers": 0,
        "logging_steps": 1,
        "log_completions": False,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
    }


def trl_other_settings(spec: dict[str, Any]) -> dict[str, str]:
    """What TRL's side is given besides ``GRPOConfig``, in words (the JSON record's ``trl_settings.other``)."""
    warmup = spec["lr_warmup_steps"]
    return {
        "model": f"the model object lit_grpo's load_model_and_tokenizer({spec['model']!r}, dtype={spec['dtype']!r}) "
                 "returns: the same weights, loaded the same way",
        "processing_class": "that loader's tokenizer (pad token = EOS, left padding)",
        "train_dataset": f"{spec['steps'] * spec['prompts_per_step']} rows: the prompts lit_grpo's RolloutDataModule "
                         "draws for these steps (same task, data_seed, split and sampling seed), in its order, each "
                         "[system prompt, user message] rendered by TRL through the same chat template",
        "reward_funcs": "lit_grpo's own reward functions (build_reward_funcs of the same specs), called with TRL's "
                        "completions' text and the rows' answer and reasoning-gym entry",
        "optimizers": f"torch.optim.AdamW(lr={spec['lr']}, betas={tuple(spec['betas'])}, "
                      f"weight_decay={spec['weight_decay']} but on biases and norm weights, as the Trainer's, fused "
                      "where the weights are on a GPU) with LambdaLR "
                      f"of lit_grpo's lr_factor (warm-up {warmup} steps, then {spec['lr_schedule']} to "
                      f"{spec['min_lr_ratio']} of the rate): lit_grpo's optimizer and schedule",
        "trainer": "a GRPOTrainer subclass that times _generate_and_score_completions and _generate around "
                   "super() (TRL's code does all the work), plus a TrainerCallback marking step ends",
        "threads": f"torch.set_num_threads({spec['threads']}), OMP_NUM_THREADS={spec['threads']}",
    }
