"""Rollout time under FSDP2 against ddp, on 2 CPU processes (gloo), where the ranks' rollouts differ in length.

    python -m tools.bench_fsdp_rollout --model smollm2 --json runs/fsdp_rollout.json

Each of 2 processes holds the same model three ways, in this process and interleaved (so ratios come from one
run): ``ddp`` (the whole model on every rank, as under ddp: no collective in a rollout), ``gathered`` and
``lockstep`` (the model sharded with FSDP2's ``fully_shard``; lit_grpo.runtime.distributed). Rank r forces its
samples to end after ``--lengths`` tokens (the r-th value), so one rank finishes first, as with real EOS. A rollout's
time is the slowest rank's (the step waits for it), from entering the rollout scope (the gather, for "gathered")
to leaving it. Prints one row per mode: the median over ``--repeats`` and its ratio to ddp's; ``--json`` writes
{"config": {...}, "runs": [{"mode", "wall_s" (median), "wall_s_all", "ratio_to_ddp"}]}.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch

from tools import harness

MODES = ("ddp", "gathered", "lockstep")


def _rank(rank: int, args: argparse.Namespace, port: int, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_grpo.runtime.distributed import (GatheredWeights, LockstepWeights, RolloutWeights, meta_replica,
                                              shard_decoder_layers)
    from lit_grpo.sampling import RolloutEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(args.threads)
    try:
        plain, tokenizer = harness.load_policy(args.model)
        sharded, _ = harness.load_policy(args.model)
        skeleton = meta_replica(sharded)
        shard_decoder_layers(sharded, init_device_mesh("cpu", (2,)))
        dtype = next(plain.parameters()).dtype
        weights = {"ddp": RolloutWeights(plain), "gathered": GatheredWeights(sharded, skeleton, dtype),
                   "lockstep": LockstepWeights(sharded)}
        prompts = harness.task_prompts(tokenizer, "synthetic", args.prompts, seed=rank)
        lengths = [[args.lengths[rank]] * args.group_size for _ in prompts]
        engines = {mode: RolloutEngine(w.module, tokenizer, group_size=args.group_size,
                                       micro_group_size=args.micro_group_size, strategy="continuous",
                                       max_new_tokens=max(args.lengths), seed=0) for mode, w in weights.items()}
        times: dict[str, list[float]] = {mode: [] for mode in args.modes}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for mode in args.modes:
                dist.barrier()
                started = time.perf_counter()
                with torch.no_grad(), weights[mode].active():
                    engines[mode].generate(prompts, lengths=lengths)
                elapsed = torch.tensor([time.perf_counter() - started])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step waits for the slowest rank
                if repeat:
                    times[mode].append(float(elapsed))
        if rank == 0:
            results.put(times)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), harness.free_port()
    workers = [context.Process(target=_rank, args=(rank, args, port, results)) for rank in (0, 1)]
    for worker in workers:
        worker.start()
    times = results.get(timeout=args.timeout)
    for worker in workers:
        worker.join(timeout=60)
    base = harness.median(times.get("ddp", []))
    runs = [{"mode": mode, "wall_s": harness.median(values), "wall_s_all": values,
             "ratio_to_ddp": harness.median(values) / base if base else None} for mode, values in times.items()]
    return {"config": harness.config_record(args), "runs": runs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_model_argument(parser, "tiny")
    parser.add_argument("--modes", type=harness.comma_names(MODES), default=list(MODES))
    parser.add_argument("--lengths", type=harness.comma_numbers(1), default=[8, 32],
                        help="forced completion length on rank 0 and rank 1 (default 8,32)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per rank")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--micro-group-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before giving up on the ranks")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if len(args.lengths) != 2:
        parser.error(f"--lengths {args.lengths}: give two lengths, rank 0's and rank 1's")
    for name in ("prompts", "group_size", "micro_group_size", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: use an integer >= 1")
    args.model = harness.resolve_model(args.model)
    report = run(args)
    for record in report["runs"]:
        ratio = record["ratio_to_ddp"]
        print(f"{record['mode']:>9}  {record['wall_s']:.3f} s  x{ratio:.2f} of ddp" if ratio else
              f"{record['mode']:>9}  {record['wall_s']:.3f} s")
    harness.write_json(args.json, report)


if __name__ == "__main__":
    main()
