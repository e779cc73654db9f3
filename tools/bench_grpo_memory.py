"""Peak memory of one whole GRPO step (rollout + update) against the group size G.

    python -m tools.bench_grpo_memory --model smollm2 --group-sizes 8,16,32,64 --micro-group-size 8 \
        --train-micro-batch-size 8 --strategies infinite,full --json runs/grpo_memory.json

Each (strategy, G) runs in a fresh subprocess, so one run's freed-but-cached memory cannot hide the next run's
peak. In it the policy is loaded first; then a Lightning Trainer runs exactly one training step: the rollout of
B prompts x G samples with the given strategy, rewards, advantages, and the micro-batched update with its AdamW
step, measured by ``lit_grpo.callbacks.PeakMemoryMonitor`` (on Linux CPU the kernel's RSS high-water mark, reset
at each phase: the subprocess is its own and only reader, so each phase's peak is exact; on CUDA the allocator's
peak, reset at each phase). Records: "strategy", "group_size", "peak_bytes" (the whole
step's: ``memory/step_peak_bytes``), its phases' "rollout_peak_bytes", "update_peak_bytes" (every micro-batch's
forward and backward, clipping and the optimizer step) and "optimizer_peak_bytes" (the AdamW step alone), as the
monitor logs them, "method" (its tracker), "repeat" (``--repeats N`` runs each cell N times, interleaved), plus
"baseline_bytes" (memory held just before the step: weights, tokenizer, libraries), "peak_kv_bytes" (the engine's
own KV peak), "decode_steps" and "rollout_wall_s" (the rollout's own), "step_s", and the settings the worker really
ran with ("gradient_checkpointing", "malloc_mmap_threshold"). Gradient checkpointing follows GRPOModule's default
(on); ``--no-gradient-checkpointing`` measures the update holding every activation of a micro-batch. The update
shares each prompt's forward among its completions as the module does by default (``--no-shared-prefix``: one
forward per completion); records carry "shared_prefix". The report's "median_bytes" holds, per strategy, key and
G, the median over the repeats, and "peak_ratio_largest_to_smallest_G" is taken from those medians.

On Linux CPU the peak is the process's resident memory, so it includes what glibc's malloc keeps after tensors are
freed. By default glibc raises its mmap threshold as large blocks are freed, after which freed activations stay in
its heap and the next micro-batch's allocations do not always fit the holes, so the peak drifts up with each
micro-batch. ``--malloc-mmap-threshold 262144`` pins the threshold (glibc's ``MALLOC_MMAP_THRESHOLD_``), so every
block over 256 KiB is returned to the system when freed; the cost is page faults on reallocation (measured in the
README). GPU runs measure the CUDA allocator's peak and are unaffected. On a GPU without hub access, ``--model
random:qwen3-1.7b --dtype bfloat16`` (optionally ``--lora``) builds that architecture with random weights and
``--task synthetic`` (the default for random models) writes the prompts locally, so no download is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl

from lit_grpo.runtime.models import checkpointed_layers
from lit_grpo.sampling import STRATEGIES
from tools import harness

#: LoRA settings of ``--lora`` (the attention and MLP projections of Llama / Qwen blocks).
LORA = {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]}


#: The peaks a record carries: the whole step's and its phases'.
PHASE_KEYS = ("peak_bytes", "rollout_peak_bytes", "update_peak_bytes", "optimizer_peak_bytes")
#: The PeakMemoryMonitor key (under ``memory/``) of each.
MONITOR_KEYS = {"peak_bytes": "step_peak_bytes", "rollout_peak_bytes": "rollout_peak_bytes",
                "update_peak_bytes": "update_peak_bytes", "optimizer_peak_bytes": "optimizer_peak_bytes"}


def _cpu_method() -> str:
    """"hwm" (exact per-phase peaks, reset in this process only) where the kernel allows the reset, else "auto"."""
    from lit_grpo.runtime.memory import hwm_reset_problem

    return "hwm" if hwm_reset_problem() is None else "auto"


def median_by_group_size(runs: list[dict], strategy: str, key: str) -> dict[int, float]:
    """``{G: median of key}`` over a strategy's repeats."""
    sizes = sorted({r["group_size"] for r in runs if r["strategy"] == strategy})
    return {g: harness.median(r[key] for r in runs if r["strategy"] == strategy and r["group_size"] == g)
            for g in sizes}


def measure_one_step(args) -> dict:
    """Run one GRPO step in this process and return its memory record."""
    import torch

    from lit_grpo.callbacks import PeakMemoryMonitor
    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.runtime.memory import read_statm_rss
    from lit_grpo.sampling import SamplingConfig
    from lit_grpo.update.module import GRPOModule

    pl.seed_everything(args.seed, verbose=False)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    module = GRPOModule(model=harness.resolve_model(args.model), train_micro_batch_size=args.train_micro_batch_size,
                        lr=1e-6, loss={"loss_type": "dapo"}, gradient_checkpointing=args.gradient_checkpointing,
                        dtype=args.dtype, peft_config=LORA if args.lora else None,
                        shared_prefix=args.shared_prefix)
    source = (dict(prompts=[{"prompt": e.prompt, "answer": e.answer}
                            for e in harness.task_examples(args.task, 64, args.seed)])
              if args.task == harness.SYNTHETIC else dict(task=args.task, size=64))
    sampling = SamplingConfig(group_size=args.group_size, micro_group_size=args.micro_group_size,
                              strategy=args.strategy, max_new_tokens=args.max_new_tokens, seed=args.seed)
    data = RolloutDataModule(**source, val_size=1, prompts_per_step=args.prompts, sampling=sampling,
                             reward_funcs=["accuracy"])
    module.configure_model()  # load weights before the measured region
    with torch.no_grad():  # read every weight once: lazily mapped checkpoint pages count in the baseline, not the step
        for parameter in module.policy.parameters():
            parameter.sum()
    monitor = PeakMemoryMonitor(cpu_method=_cpu_method(), sample_interval_s=0.002)
    rollout = RolloutFigures()
    trainer = pl.Trainer(accelerator=accelerator, devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=[monitor, rollout])
    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    if device.type == "cuda":
        module.policy.to(device)
        torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else read_statm_rss()
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    step_s = time.perf_counter() - start
    if monitor.method is None:
        raise SystemExit("cannot measure peak memory here: PeakMemoryMonitor found no tracker (see its warning)")
    peaks = {key: monitor.max_logged[f"memory/{MONITOR_KEYS[key]}"] for key in PHASE_KEYS}
    return {"strategy": args.strategy, "group_size": args.group_size, **peaks,
            "baseline_bytes": baseline, "step_s": step_s, "method": monitor.method, "dtype": args.dtype,
            "lora": args.lora, "weights_bytes": harness.weights_bytes(module.policy),
            "gradient_checkpointing": bool(checkpointed_layers(module.policy)),
            "shared_prefix": module.uses_shared_prefix,
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"), **rollout.figures}


class RolloutFigures(pl.Callback):
    """The step's rollout figures, from its batch's ``RolloutStats``."""

    def __init__(self) -> None:
        self.figures: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = batch.stats
        self.figures = {"peak_kv_bytes": stats.peak_kv_bytes, "generated_tokens": stats.generated_tokens,
                        "decode_steps": stats.decode_steps, "rollout_wall_s": stats.wall_s}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_model_argument(parser, default="smollm2")
    parser.add_argument("--dtype", default=None, help="weights dtype, e.g. bfloat16 (default: the checkpoint's)")
    parser.add_argument("--lora", action="store_true", help=f"train LoRA adapters ({LORA}) instead of all weights")
    parser.add_argument("--group-sizes", default="8,16,32,64", type=harness.comma_numbers(1),
                        help="comma list of G")
    parser.add_argument("--strategies", default="infinite,full", type=harness.comma_names(STRATEGIES),
                        help=f"comma list of {','.join(STRATEGIES)}")
    parser.add_argument("--micro-group-size", type=int, default=8)
    parser.add_argument("--train-micro-batch-size", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=1, help="B, prompts per step")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--task", help="reasoning-gym task or 'synthetic' (default: basic_arithmetic; synthetic "
                                       "for random:NAME models)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="GRPOModule(gradient_checkpointing=...); on by default, as in the module")
    parser.add_argument("--shared-prefix", action=argparse.BooleanOptionalAction, default=True,
                        help="GRPOModule(shared_prefix=...); on by default, as in the module")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="run the steps with glibc's MALLOC_MMAP_THRESHOLD_=BYTES (Linux CPU; see the README)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh processes per (strategy, G); the summary takes the median peak")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)  # worker mode: one measurement, printed as JSON
    parser.add_argument("--group-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.task = harness.default_task(args.model, args.task)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.strategy:
        print("RESULT " + json.dumps(measure_one_step(args)), flush=True)
        return {}

    runs = []
    cells = [(g, s, r) for r in range(args.repeats) for g in args.group_sizes
             for s in args.strategies]  # repeats interleaved: a drifting machine affects all cells
    for group_size, strategy, repeat in cells:
        command = harness.tool_command(
            "bench_grpo_memory", "--strategy", strategy, "--group-size", str(group_size), "--model", args.model,
            "--micro-group-size", str(args.micro_group_size), "--train-micro-batch-size",
            str(args.train_micro_batch_size), "--prompts", str(args.prompts), "--max-new-tokens",
            str(args.max_new_tokens), "--task", args.task, "--seed", str(args.seed))
        command += (["--dtype", args.dtype] if args.dtype else []) + (["--lora"] if args.lora else [])
        command.append("--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing")
        command.append("--shared-prefix" if args.shared_prefix else "--no-shared-prefix")
        env = harness.repo_env(**({} if args.malloc_mmap_threshold is None else
                                  {"MALLOC_MMAP_THRESHOLD_": str(args.malloc_mmap_threshold)}))
        out = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            raise SystemExit(f"{strategy} G={group_size} failed:\n{out.stderr[-3000:]}")
        record = {**json.loads(lines[-1][len("RESULT "):]), "repeat": repeat}
        runs.append(record)
        print(f"{strategy:10s} G={group_size:3d} peak={record['peak_bytes'] / 2**20:8.1f} MiB "
              f"baseline={record['baseline_bytes'] / 2**20:8.1f} MiB kv={record['peak_kv_bytes'] / 2**20:7.1f} MiB "
              f"update={record['update_peak_bytes'] / 2**20:8.1f} MiB "
              f"rollout={record['rollout_wall_s']:.1f}s step={record['step_s']:.1f}s", file=sys.stderr, flush=True)
    ratios, medians = {}, {}
    for strategy in args.strategies:
        by_size = {key: median_by_group_size(runs, strategy, key) for key in PHASE_KEYS}
        medians[strategy] = {key: {str(g): v for g, v in values.items()} for key, values in by_size.items()}
        peaks = by_size["peak_bytes"]
        ratios[strategy] = peaks[max(peaks)] / peaks[min(peaks)]
        print(f"{strategy}: peak(G={max(peaks)}) / peak(G={min(peaks)}) = {ratios[strategy]:.3f}")
    report = {"config": harness.config_record(args), "runs": runs, "median_bytes": medians,
              "peak_ratio_largest_to_smallest_G": ratios}
    harness.write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
