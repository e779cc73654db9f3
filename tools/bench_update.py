"""Update time per step with and without the shared prefix, on each linear kernel, and the thread count's effect on
update and rollout.

    python -m tools.bench_update --case demo --repeats 5 --json runs/update_demo.json
    python -m tools.bench_update --case demo --modes shared --threads 2 --cpu-linear torch,onednn --json runs/k.json
    python -m tools.bench_update --case long --repeats 3 --json runs/update_long.json
    python -m tools.bench_update --case demo --modes shared --threads 1,2 --rollout --json runs/threads.json

``demo``: configs/demo.yaml's module and data as the demo builds them (SmolLM2-135M-Instruct, 4 chat prompts x
G 8, up to 24 new tokens); one rollout by the demo's own engine makes the batch that every update is timed on.
``long``: SmolLM2 (``--model``) with ``--prompt-tokens`` (512) token prompts, G ``--group-size`` (16) and
``--completion-tokens`` (64) token completions, token ids and rewards drawn at random (the update's cost does not
depend on them); the module's defaults (gradient checkpointing, 8 rows per micro-batch) unless
``--train-micro-batch-size`` / ``--no-gradient-checkpointing`` say otherwise; ``--device cuda --dtype bfloat16``
runs it on a GPU (where ``shared_prefix: auto``'s break-even is measured: lit_grpo.update.shared_prefix).

An update is ``GRPOModule.grpo_step`` on the batch: log-probs, loss, backward, gradient clipping and the AdamW
step. ``--cpu-linear`` lists the kernels of its linears (``GRPOModule``'s ``cpu_linear``; default: "auto"); with
more than one, each timing's key ends in ``/cpu_linear=K`` and the report adds the onednn / torch ratio. After one
untimed warm-up per setting, each repeat times every (threads, kernel, mode) once, interleaved in one process, so a
busy machine slows all of them alike; the report gives medians and the shared / unshared ratio per thread count.
``--rollout`` also times one rollout (the demo's ``build_train_batch``) per thread count and repeat.
``--competing-processes N`` runs N busy-looping processes (one core each) throughout, as another job would.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import get_args

import torch

from lit_grpo.runtime.validation import available_cores
from lit_grpo.sampling.cpu_linear import UpdateLinear
from tools import harness
from tools.roofline import device_name


def demo_setup():
    """(module, datamodule) of configs/demo.yaml, the policy loaded and handed to the data side."""
    from lit_grpo.cli import build_cli

    cli = build_cli(["--config", str(harness.ROOT / "configs" / "demo.yaml"), "--trainer.logger", "false"], run=False)
    module, data = cli.model, cli.datamodule
    module.configure_model()
    data.attach(module.policy, module.tokenizer, scale_rewards=module.hparams.scale_rewards)
    data.setup("fit")
    return module, data


def long_prompt_batch(args, vocab_size: int, pad_id: int):
    """One prompt of ``args.prompt_tokens`` random ids x G completions of ``args.completion_tokens``, random rewards."""
    from lit_grpo.rollout.advantages import group_advantages
    from lit_grpo.batch import RolloutBatch
    from lit_grpo.sampling.stats import RolloutStats

    g = torch.Generator().manual_seed(args.seed)
    B, G, P, T = args.prompts, args.group_size, args.prompt_tokens, args.completion_tokens
    rewards = torch.rand(B, G, generator=g)
    return RolloutBatch(
        stats=RolloutStats(), prompts=[""] * B, completions=[[""] * G for _ in range(B)], rewards=rewards,
        completion_lengths=torch.full((B, G), T), truncated=torch.zeros(B, G, dtype=torch.bool),
        advantages=group_advantages(rewards, "group"),
        prompt_ids=torch.randint(3, vocab_size, (B, P), generator=g), prompt_mask=torch.ones(B, P, dtype=torch.long),
        completion_ids=torch.randint(3, vocab_size, (B, G, T), generator=g),
        completion_mask=torch.ones(B, G, T, dtype=torch.long),
        sampling_logprobs=-torch.rand(B, G, T, generator=g), max_new_tokens=T, pad_token_id=pad_id)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=("demo", "long"), default="demo")
    parser.add_argument("--modes", default="shared,unshared", type=harness.comma_names(("shared", "unshared")),
                        help="comma-separated: shared, unshared")
    parser.add_argument("--threads", default="1", type=harness.comma_numbers(1),
                        help="comma-separated torch thread counts, e.g. 1,2")
    parser.add_argument("--cpu-linear", default="auto", type=harness.comma_names(get_args(UpdateLinear)),
                        help=f"comma-separated update kernels: {', '.join(get_args(UpdateLinear))}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rollout", action="store_true", help="also time a rollout per thread count (demo only)")
    parser.add_argument("--competing-processes", type=int, default=0,
                        help="busy processes (one core each) running beside the timed ones, as on a shared machine")
    harness.add_model_argument(parser, default="smollm2", help_extra=" (long: the policy)")
    parser.add_argument("--prompts", type=int, default=1, help="long: B")
    parser.add_argument("--group-size", type=int, default=16, help="long: G")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="long: prompt length")
    parser.add_argument("--completion-tokens", type=int, default=64, help="long: completion length")
    parser.add_argument("--train-micro-batch-size", type=int, default=8, help="long: rows per micro-batch")
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="long: GRPOModule(gradient_checkpointing=...)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="long: where the update runs")
    parser.add_argument("--dtype", default="float32", help="long: the policy's weights (bfloat16 on a GPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be >= 1")
    if args.rollout and args.case != "demo":
        parser.error("--rollout times the demo's rollout: use it with --case demo")
    if args.case == "demo" and (args.device, args.dtype) != ("cpu", "float32"):
        parser.error("--device and --dtype set the long case's policy: the demo's is its config's")
    if args.competing_processes < 0:
        parser.error(f"--competing-processes={args.competing_processes} must be >= 0")
    # Each competitor spins until this process is gone (a killed benchmark leaves none behind).
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    competitors = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(args.competing_processes)]
    try:
        return run(args)
    finally:
        for competitor in competitors:
            competitor.kill()
            competitor.wait()


def run(args: argparse.Namespace) -> dict:
    """Build the batch, time every (threads, kernel, mode) ``args.repeats`` times interleaved, report (see the
    docstring)."""
    from lit_grpo.update.module import GRPOModule

    modes, threads, kernels = args.modes, args.threads, args.cpu_linear
    torch.set_num_threads(threads[0])
    data = None
    if args.case == "demo":
        module, data = demo_setup()
        batch = data.build_train_batch()
    else:
        module = GRPOModule(model=harness.resolve_model(args.model), dtype=args.dtype,
                            train_micro_batch_size=args.train_micro_batch_size,
                            gradient_checkpointing=args.gradient_checkpointing)
        with torch.device(args.device):
            module.configure_model()
        module.to(args.device)  # the policy is there already; the module's device follows (as a Trainer's does)
        batch = long_prompt_batch(args, module.policy.config.vocab_size, module.tokenizer.pad_token_id)
        batch = batch.to(args.device)
    if "shared" in modes and not module.uses_shared_prefix:
        raise SystemExit("the policy cannot use a shared prefix here (see the warning above)")
    optimizer = module.configure_optimizers()["optimizer"]
    distinct_prompt_tokens = int(batch.prompt_mask.sum())
    completion_tokens = int(batch.completion_mask.sum())

    def update(mode: str, kernel: str) -> float:
        module.uses_shared_prefix = mode == "shared"
        module.hparams.cpu_linear = kernel
        start = time.perf_counter()
        module.grpo_step(batch, optimizer)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def key(mode: str, n: int, kernel: str) -> str:
        return f"update/{mode}/threads={n}" + (f"/cpu_linear={kernel}" if len(kernels) > 1 else "")

    timings: dict[str, list[float]] = {}
    for n in threads:  # warm-up: AdamW's state, allocator pools, the engine's cache
        torch.set_num_threads(n)
        for kernel in kernels:
            for mode in modes:
                update(mode, kernel)
    for repeat in range(args.repeats):
        for n in threads:
            torch.set_num_threads(n)
            # Odd repeats run the kernels and the modes in reverse order: what the update before leaves in caches
            # and the allocator favours none of them over the repeats.
            for kernel in (kernels if repeat % 2 == 0 else kernels[::-1]):
                for mode in (modes if repeat % 2 == 0 else modes[::-1]):
                    timings.setdefault(key(mode, n, kernel), []).append(update(mode, kernel))
            if args.rollout:
                start = time.perf_counter()
                data.build_train_batch()
                timings.setdefault(f"rollout/threads={n}", []).append(time.perf_counter() - start)
        print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in timings.items()),
              file=sys.stderr, flush=True)
    medians = {key: harness.median(values) for key, values in timings.items()}
    ratios = {f"shared/unshared/threads={n}" + (f"/cpu_linear={k}" if len(kernels) > 1 else ""):
              medians[key("shared", n, k)] / medians[key("unshared", n, k)]
              for n in threads for k in kernels if len(modes) == 2}
    if {"onednn", "torch"} <= set(kernels):
        ratios.update({f"onednn/torch/{mode}/threads={n}": medians[key(mode, n, "onednn")] /
                       medians[key(mode, n, "torch")] for n in threads for mode in modes})
    settings = harness.config_record(args, model=harness.resolve_model(args.model))
    if args.case == "demo":  # the demo's data and module decide these, not the long case's options
        for key in ("model", "prompts", "group_size", "prompt_tokens", "completion_tokens", "train_micro_batch_size",
                    "gradient_checkpointing"):
            settings.pop(key)
    report = {"config": {**settings, "cpu": device_name(torch.device("cpu")),
                         "device_name": device_name(torch.device(args.device)),
                         "available_cores": available_cores(),
                         "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
              "batch": {"num_prompts": batch.num_prompts, "group_size": batch.group_size,
                        "distinct_prompt_tokens": distinct_prompt_tokens, "completion_tokens": completion_tokens,
                        "train_micro_batch_size": module.hparams.train_micro_batch_size,
                        "gradient_checkpointing": module.hparams.gradient_checkpointing},
              "seconds": timings, "medians_s": medians, "ratios": ratios}
    for key, value in {**medians, **ratios}.items():
        print(f"{key:32s} {value:8.3f}")
    harness.write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
