"""Where a rollout's time goes: torch's profiler over one rollout of the engine, after untimed warm-ups.

    python -m tools.profile_rollout --model smollm2 --prompts 4 --group-size 16 --micro-group-size 16 \
        --max-new-tokens 48 --strategy continuous                      # the demo's rollout, on a CPU
    python -m tools.profile_rollout --model random:qwen3-1.7b --dtype bfloat16 --prompts 1 --group-size 32 \
        --micro-group-size 8 --max-new-tokens 128 --strategy continuous --compile   # on a GPU

Prints the ``--rows`` operators (CPU) or kernels (CUDA) that took the most self time, then one summary line:
decode steps, wall ms per step (timed rollouts, outside the profiler), and on CUDA the kernels launched per decode
step and the device's busy ms per step (the sum of kernel times; the rest of the step the GPU waits on the host).
``--json`` writes the summary and the table; ``--trace`` a Chrome trace of the profiled rollout.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lit_grpo.sampling import RolloutEngine
from tools import harness
from tools.roofline import device_name


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_model_argument(parser, default="smollm2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--micro-group-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--strategy", default="continuous", choices=("full", "micro", "continuous", "infinite"))
    parser.add_argument("--task", default="synthetic")
    parser.add_argument("--compile", action="store_true", help="data.sampling.compile: torch.compile the step")
    parser.add_argument("--no-graph", action="store_true", help="cuda_graph=False: the eager step on CUDA")
    parser.add_argument("--repeats", type=int, default=3, help="timed rollouts (median ms per step)")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--trace", type=Path)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = harness.load_policy(args.model, args.dtype, args.device)
    prompts = harness.task_prompts(tokenizer, args.task, args.prompts, 0)
    engine = RolloutEngine(model, tokenizer, group_size=args.group_size, micro_group_size=args.micro_group_size,
                           strategy=args.strategy, max_new_tokens=args.max_new_tokens, keep_kv_cache=True,
                           compile=args.compile, cuda_graph=False if args.no_graph else None)
    cuda = model.device.type == "cuda"
    started = time.perf_counter()
    engine.generate(prompts)  # builds the step: capture and compilation happen here
    first_s = time.perf_counter() - started
    timings = []
    for _ in range(args.repeats):
        engine.rollout_index = 0
        result = engine.generate(prompts)
        timings.append(1000 * result.stats.wall_s / result.stats.decode_steps)
    engine.rollout_index = 0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        result = engine.generate(prompts)
        if cuda:
            torch.cuda.synchronize()
    steps = result.stats.decode_steps
    events = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = events.table(sort_by=sort, row_limit=args.rows, max_name_column_width=70)
    print(table)
    summary = {"model": harness.resolve_model(args.model), "device": device_name(model.device),
               "dtype": str(model.dtype).removeprefix("torch."), "strategy": args.strategy,
               "slots": engine.num_slots(len(prompts)), "decode_steps": steps, "compile": args.compile,
               "cuda_graph": engine._step.graph is not None, "first_rollout_s": first_s,
               "ms_per_step": harness.median(timings)}
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        summary["kernels_per_step"] = len(kernels) / steps
        summary["device_busy_ms_per_step"] = sum(e.device_time for e in kernels) / 1000 / steps
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    harness.write_json(args.json, {"summary": summary, "table": table})
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    return summary


if __name__ == "__main__":
    main()
