"""Decode steps under mixed precision: autocast's casts at every step against ``CastWeights`` (cast once a rollout).

    python -m tools.bench_cast_weights --model smollm2 --group-size 8 --max-new-tokens 64 --repeats 3
    python -m tools.bench_cast_weights --model random:qwen3-1.7b --device cuda --group-size 32 \
        --max-new-tokens 512 --compile auto --json runs/cast_weights.json       # a GPU, offline

The float32 policy's rollout under autocast (``--autocast``, bfloat16 by default) as a bf16-mixed fit runs it,
once on the policy itself (``per_step_casts``) and once on its ``CastWeights`` replica (``cast_once``), alternating
in one process (ABBA: odd repeats in reverse order) on the same prompts and seed. Per run: ``decode_ms_per_step``
(``RolloutStats.decode_ms_per_step``: the decode steps alone), ``tokens_per_s``, ``wall_s``; the JSON holds every
run and the medians, ``decode_ratio`` (cast_once / per_step_casts, medians) and ``samples_equal`` (every run's
completions and log-probs equal the first's: the same bfloat16 weights). ``config`` names the device and
``cast_bytes`` (the copies' size).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from tools import harness
from tools.roofline import device_name

RUNS = ("per_step_casts", "cast_once")
FIGURES = ("decode_ms_per_step", "tokens_per_s", "wall_s")


def _rollout(model, tokenizer, prompts, args, device_type: str, dtype: torch.dtype):
    from lit_grpo.sampling import RolloutEngine

    engine = RolloutEngine(model, tokenizer, group_size=args.group_size, micro_group_size=args.micro_group_size,
                           strategy="continuous", max_new_tokens=args.max_new_tokens, seed=args.seed,
                           compile=args.compile)
    # autocast as Lightning's bf16-mixed enters it: no weight-cast cache
    with torch.no_grad(), torch.autocast(device_type, dtype=dtype, cache_enabled=False):
        return engine.generate(prompts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lit_grpo.runtime.distributed import CastWeights, cast_names

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_model_argument(parser, "smollm2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--autocast", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--prompts", type=int, default=2, help="B, prompts per rollout")
    parser.add_argument("--group-size", type=int, default=8, help="G")
    parser.add_argument("--micro-group-size", type=int, help="g, concurrent slots (default G: one slot a sample)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--compile", default="false", choices=["false", "true", "auto"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (each run: one rollout per kind)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be >= 1")
    args.compile = {"false": False, "true": True}.get(args.compile, args.compile)
    args.micro_group_size = args.micro_group_size or args.group_size

    dtype = getattr(torch, args.autocast)
    policy, tokenizer = harness.load_policy(args.model, "float32", args.device)
    if not cast_names(policy, dtype):
        parser.error(f"--model {args.model}: no linear weight to cast to {args.autocast}")
    weights = CastWeights(policy, dtype)
    prompts = harness.task_prompts(tokenizer, harness.default_task(args.model, None), args.prompts, args.seed)
    device = torch.device(args.device)

    def run(kind: str):
        if kind == "per_step_casts":
            return _rollout(policy, tokenizer, prompts, args, device.type, dtype)
        with weights.active() as replica:
            return _rollout(replica, tokenizer, prompts, args, device.type, dtype)

    for kind in RUNS:  # warm-up: compilation, graph capture, allocator
        run(kind)
    runs: dict[str, list[dict]] = {kind: [] for kind in RUNS}
    first, equal = None, True
    for repeat in range(args.repeats):
        for kind in RUNS if repeat % 2 == 0 else reversed(RUNS):
            result = run(kind)
            samples = (result.completion_ids, result.logprobs)
            first = first or samples
            equal = equal and samples == first
            runs[kind].append({"decode_ms_per_step": result.stats.decode_ms_per_step,
                               "tokens_per_s": result.stats.tokens_per_s, "wall_s": result.stats.wall_s,
                               "decode_steps": result.stats.decode_steps})
    medians = {kind: harness.median_record(runs[kind], FIGURES) for kind in RUNS}
    report = {
        "config": harness.config_record(args, device_name=device_name(device), cast_bytes=weights.cast_bytes(),
                                        weights_bytes=harness.weights_bytes(policy)),
        "runs": runs, **medians,
        "decode_ratio": medians["cast_once"]["decode_ms_per_step"] / medians["per_step_casts"]["decode_ms_per_step"],
        "samples_equal": equal,
    }
    print(f"{report['config']['device_name']}, {args.model}, G {args.group_size} on {args.micro_group_size} slots, "
          f"{args.max_new_tokens} tokens, autocast {args.autocast}: decode "
          f"{medians['per_step_casts']['decode_ms_per_step']:.2f} ms a step with per-step casts, "
          f"{medians['cast_once']['decode_ms_per_step']:.2f} ms cast once ({report['decode_ratio']:.2f} x); "
          f"samples equal: {equal}")
    harness.write_json(args.json, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
