"""How long torch's threads wait for a core, against how much longer a step takes: the evidence behind
``lit_grpo.runtime.threads.CORE_WAIT_SHARE`` (docs/benchmarks.md, "Threads").

    python -m tools.bench_core_wait --seconds 300 --window 60 --json runs/core_wait.json

A decode-like workload (SmolLM2-135M's shapes: 30 layers of two linears over 16 rows, a 256-row product every tenth
step), run in chunks of ``--steps`` steps, one thread and several in turn (``--threads``, odd rounds in reverse
order), each chunk read before and after with ``thread_times``: its ms a step and its threads' share of time waiting
for a core (``busiest_threads``, as the fit summary reads it). ``--competing-processes N`` busy-looping processes
run in every other ``--window`` seconds, as another job would; other load on the machine comes as it comes, so each
chunk is compared with the one-thread chunk of its round. Prints one JSON line a chunk; the report holds every
chunk, and for each thread count and window kind the medians of ms a step and share and the largest share.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from lit_grpo.runtime.threads import busiest_threads, thread_times
from tools import harness


def decode_like(steps: int, weights: tuple[torch.Tensor, ...]) -> None:
    up, down, rows, prefill = weights
    for step in range(steps):
        for _ in range(30):
            torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(rows, up)), down)
        if step % 10 == 0:
            torch.nn.functional.linear(prefill, up)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300.0, help="how long to run")
    parser.add_argument("--window", type=float, default=60.0, help="seconds with, then without, the competitors")
    parser.add_argument("--competing-processes", type=int, default=1, help="busy processes in every other window")
    parser.add_argument("--threads", default="1,2", type=harness.comma_numbers(1),
                        help="comma-separated torch thread counts, the first the baseline, e.g. 1,2")
    parser.add_argument("--steps", type=int, default=30, help="decode-like steps a chunk")
    parser.add_argument("--json", type=str)
    args = parser.parse_args(argv)
    for name in ("seconds", "window"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name}={getattr(args, name)} must be > 0")
    if args.competing_processes < 0 or args.steps < 1:
        parser.error(f"--competing-processes={args.competing_processes} must be >= 0 and --steps={args.steps} >= 1")
    if thread_times() is None:
        raise SystemExit("this system keeps no per-thread scheduler statistics (/proc/self/task/*/schedstat)")
    generator = torch.Generator().manual_seed(0)
    weights = tuple(torch.randn(*shape, generator=generator) for shape in ((1536, 576), (576, 1536), (16, 576),
                                                                           (256, 576)))
    torch.set_num_threads(max(args.threads))
    decode_like(args.steps, weights)  # warm the thread pool and the kernels
    # each competitor spins until this process is gone (a killed benchmark leaves none behind)
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    chunks, competitors, start, round_ = [], [], time.perf_counter(), 0
    try:
        while time.perf_counter() - start < args.seconds:
            busy = int((time.perf_counter() - start) // args.window) % 2 == 1
            if busy and not competitors:
                competitors = [subprocess.Popen([sys.executable, "-c", spin])
                               for _ in range(args.competing_processes)]
            elif not busy and competitors:
                for competitor in competitors:
                    competitor.kill()
                    competitor.wait()
                competitors = []
            for threads in args.threads if round_ % 2 == 0 else args.threads[::-1]:
                torch.set_num_threads(threads)
                before, began = thread_times(), time.perf_counter()
                decode_like(args.steps, weights)
                wall = time.perf_counter() - began
                running, waiting = busiest_threads(thread_times().since(before), threads)
                chunk = {"round": round_, "threads": threads, "competitors": len(competitors),
                         "ms_a_step": round(1000 * wall / args.steps, 2), "running_s": round(running, 3),
                         "waiting_s": round(waiting, 3), "share": round(waiting / max(running + waiting, 1e-9), 4)}
                print(json.dumps(chunk), flush=True)
                chunks.append(chunk)
            round_ += 1
    finally:
        for competitor in competitors:
            competitor.kill()
            competitor.wait()
    summary = []
    for threads in args.threads:
        for competing in sorted({c["competitors"] for c in chunks}):
            mine = [c for c in chunks if c["threads"] == threads and c["competitors"] == competing]
            if mine:
                summary.append({"threads": threads, "competitors": competing, "chunks": len(mine),
                                "ms_a_step": harness.median(c["ms_a_step"] for c in mine),
                                "share": harness.median(c["share"] for c in mine),
                                "max_share": max(c["share"] for c in mine)})
    for row in summary:
        print(json.dumps(row))
    report = {"config": harness.config_record(args), "summary": summary, "chunks": chunks}
    harness.write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
