"""The rollout engine's GPU targets, measured and judged by one command.

    python -m tools.gpu_targets --json runs/gpu_targets.json            # on an H100 or H200, offline
    python -m tools.gpu_targets --from-dir runs/gpu_targets              # judge saved measurements again

Runs the four ``tools.bench_rollout`` measurements the targets are stated on, each in this process with every
strategy interleaved (so ratios come from one process), with a real architecture and random weights
(``random:qwen3-1.7b`` in bfloat16 by default: no hub, no reasoning-gym):

=========  ==================================================================================================
paper      ``--preset paper`` (B 1, G 32, g 8, 1024 tokens) with the recorded SmolLM2 lengths replayed: full,
           micro, continuous, infinite with the oracle predictor, warmed by one rollout of the next recorded
           prompt (its gate follows predictions once it has seen them gain, as in training)
cap512     B 1, G 32, g 8, 512 tokens, nothing replayed: full, continuous, infinite (its default scheduler),
           hf_generate; random weights almost never sample EOS, so every row runs to the cap (judged too)
step       B 1, G 32, g 8, 128 tokens: full, continuous, hf_generate, hf_generate_chunked, hf_generate_batch
g_equals_G B 1, G 8, g 8, 128 tokens: full, infinite (with a slot for every sample, the scheduler must cost
           nothing: within 2% of full's tokens/s over the same steps)
=========  ==================================================================================================

then judges every target line and prints one row per line: the measured value, the limit, pass or FAIL. Memory is
``peak_memory_bytes - weights_bytes`` (the CUDA allocator's peak over the weights). Tokens per second include the graph
capture each engine run pays, as training pays it once per rollout where the slot cache is released (``keep_kv_cache``);
``ms_per_step`` leaves it out. The decode-step target is judged against the instance's certified lower bound
(``makespan_lower_bound``), which the optimum is at least. A verdict that judges ms per decode step also shows that
run's roofline (``floor_ms_per_step``, ``roofline_ratio`` and ``decode_roofline_ratio``, the step's own time against the
floor; see tools/roofline.py): how far the step is from this machine's floor; measurements saved before a field existed
show n/a there. The roofline is shown, not judged. The command exits with 1 when a target is missed. On a CPU it runs
too (slowly), but its verdicts mean nothing: the limits are stated for a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lit_grpo.scheduling.length_aware.grouping import makespan_lower_bound
from tools import bench_rollout, harness

#: The recorded SmolLM2 lengths (``tools/data/smollm2_gsm_symbolic_lengths.json``) and a warm-up rollout's after them.
LENGTHS = harness.ROOT / "tools" / "data" / "synthetic" / "paper_b1_g32.json"


def measurements(model: str, dtype: str, repeats: int) -> dict[str, list[str]]:
    """``tools.bench_rollout`` arguments of each measurement the targets need."""
    common = ["--model", model, "--dtype", dtype, "--repeats", str(repeats), "--task", "synthetic"]
    rows = ["--prompts", "1", "--group-size", "32", "--micro-group-size", "8"]
    return {
        "paper": common + ["--preset", "paper", "--lengths", str(LENGTHS), "--predictors", "oracle",
                           "--warmup-rollouts", "1", "--strategies", "full,micro,continuous,infinite"],
        "cap512": common + rows + ["--max-new-tokens", "512", "--strategies", "full,continuous,infinite,hf_generate"],
        "step": common + rows + ["--max-new-tokens", "128", "--strategies",
                                 "full,continuous,hf_generate,hf_generate_chunked,hf_generate_batch"],
        "g_equals_G": common + ["--prompts", "1", "--group-size", "8", "--micro-group-size", "8",
                                "--max-new-tokens", "128", "--strategies", "full,infinite"],
    }


@dataclass(frozen=True)
class Target:
    """One target line: ``value(report)`` compared with ``limit`` by ``kind`` ("<=" or ">="); ``strategies`` are
    the runs it reads; ``roofline``, the run whose decode-step floor and ratio its verdict shows (targets on ms per
    step)."""

    name: str
    measurement: str
    strategies: tuple[str, ...]
    value: Callable[[dict], float]
    kind: str
    limit: float
    roofline: str | None = None


def _run(report: dict, strategy: str) -> dict:
    runs = [run for run in report["runs"] if run["strategy"] == strategy]
    if len(runs) != 1:
        raise ValueError(f"the report has {len(runs)} runs of {strategy!r}; expected one "
                         f"(strategies: {[run['strategy'] for run in report['runs']]})")
    return runs[0]


def _over_weights(report: dict, strategy: str) -> float:
    return _run(report, strategy)["peak_memory_bytes"] - report["config"]["weights_bytes"]


def memory_ratio(measurement: str, strategy: str, baseline: str, limit: float) -> Target:
    """Peak memory over the weights, ``strategy``'s over ``baseline``'s, at most ``limit``."""
    return Target(f"{measurement}: {strategy} memory / {baseline}", measurement, (strategy, baseline),
                  lambda r: _over_weights(r, strategy) / _over_weights(r, baseline), "<=", limit)


def speed_ratio(measurement: str, strategy: str, baseline: str, limit: float) -> Target:
    """Tokens per second, ``strategy``'s over ``baseline``'s, at least ``limit``."""
    return Target(f"{measurement}: {strategy} tokens/s / {baseline}", measurement, (strategy, baseline),
                  lambda r: _run(r, strategy)["tokens_per_s"] / _run(r, baseline)["tokens_per_s"], ">=", limit)


def _steps_over_optimum(report: dict) -> float:
    """infinite's decode steps over a certified lower bound of the replayed instance's optimal makespan."""
    config = report["config"]
    path = Path(config["lengths"])
    if not path.exists():  # judged on another machine than the one that measured: the repository's copy
        path = LENGTHS.parent / path.name
    recorded = json.loads(path.read_text())["lengths"]
    lengths = [min(n, config["max_new_tokens"]) for row in recorded[: config["prompts"]]
               for n in row[: config["group_size"]]]
    return _run(report, "infinite")["decode_steps"] / makespan_lower_bound(lengths, config["micro_group_size"])


TARGETS = (
    memory_ratio("paper", "continuous", "full", 0.75),
    memory_ratio("paper", "infinite", "full", 0.75),
    Target("paper: infinite decode steps / optimum", "paper", ("infinite",), _steps_over_optimum, "<=", 1.02),
    speed_ratio("paper", "infinite", "micro", 1.25),
    memory_ratio("cap512", "continuous", "hf_generate", 0.35),
    memory_ratio("cap512", "infinite", "hf_generate", 0.35),
    Target("step: continuous ms per decode step (g 8)", "step", ("continuous",),
           lambda r: _run(r, "continuous")["ms_per_step"], "<=", 6.0, roofline="continuous"),
    speed_ratio("step", "continuous", "hf_generate_chunked", 2.0),
    speed_ratio("step", "continuous", "hf_generate_batch", 1.0),
    speed_ratio("step", "full", "hf_generate", 1.5),
    # "No more than full": two runs of the same work, so the limit leaves the 2% two equal medians may differ by.
    speed_ratio("g_equals_G", "infinite", "full", 0.98),
)


def judge(reports: dict[str, dict]) -> list[dict]:
    """One verdict per target whose measurement is in ``reports``: ``{"target", "value", "kind", "limit",
    "passed", "device"}``, for a target on ms per step also ``"floor_ms_per_step"``, ``"roofline_ratio"`` and
    ``"decode_roofline_ratio"`` (None when the measurement predates them), and a note (and a failed verdict) where
    a run broke its target's premise: cap512's rows must all run to the cap."""
    verdicts = []
    for target in TARGETS:
        if target.measurement not in reports:
            continue
        report = reports[target.measurement]
        value = target.value(report)
        passed = value <= target.limit if target.kind == "<=" else value >= target.limit
        verdict = dict(target=target.name, value=value, kind=target.kind, limit=target.limit, passed=passed,
                       device=report["config"]["device"])
        if target.roofline is not None:
            run = _run(report, target.roofline)
            verdict["floor_ms_per_step"] = run.get("floor_ms_per_step")
            verdict["roofline_ratio"] = run.get("roofline_ratio")
            verdict["decode_roofline_ratio"] = run.get("decode_roofline_ratio")
        if target.measurement == "cap512":
            config = report["config"]
            expected = config["prompts"] * config["group_size"] * config["max_new_tokens"]
            short = {name: _run(report, name)["generated_tokens"] for name in target.strategies
                     if _run(report, name)["generated_tokens"] != expected}
            if short:
                verdict["note"] = f"not every row ran to the cap ({expected} tokens expected): {short}"
                verdict["passed"] = False
        verdicts.append(verdict)
    return verdicts


def print_verdicts(verdicts: list[dict]) -> None:
    print(f"{'target':52s}{'value':>10s}   limit    verdict   device")
    for v in verdicts:
        word = "pass" if v["passed"] else "FAIL"
        print(f"{v['target']:52s}{v['value']:10.3f}   {v['kind']} {v['limit']:<5g}  {word:8s}  {v['device']}"
              + _roofline_text(v) + (f"  ({v['note']})" if "note" in v else ""))


def _roofline_text(verdict: dict) -> str:
    """A verdict's roofline as printed: "floor F ms, ratio R, step alone S", n/a for what is unknown; empty for
    targets that do not judge ms per step."""
    if "floor_ms_per_step" not in verdict:
        return ""
    floor, ratio, alone = (verdict["floor_ms_per_step"], verdict["roofline_ratio"],
                           verdict["decode_roofline_ratio"])
    return (f"  (floor {'n/a' if floor is None else f'{floor:.3f}'} ms, "
            f"ratio {'n/a' if ratio is None else f'{ratio:.2f}'}, "
            f"step alone {'n/a' if alone is None else f'{alone:.2f}'})")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:qwen3-1.7b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", help="comma list of measurements to run or read (default: paper, cap512, "
                                       "step, g_equals_G)")
    parser.add_argument("--from-dir", type=Path, help="judge the <measurement>.json files saved there; run nothing")
    parser.add_argument("--json", type=Path, help="write the verdicts here, and each measurement beside it")
    args = parser.parse_args(argv)
    plan = measurements(args.model, args.dtype, args.repeats)
    names = args.only.split(",") if args.only else list(plan)
    unknown = sorted(set(names) - set(plan))
    if unknown:
        parser.error(f"--only {unknown}: choose from {list(plan)}")
    reports = {}
    for name in names:
        if args.from_dir:
            reports[name] = json.loads((args.from_dir / f"{name}.json").read_text())
            continue
        out = [] if args.json is None else ["--json", str(args.json.with_suffix("") / f"{name}.json")]
        print(f"gpu_targets: {name}: python -m tools.bench_rollout {' '.join(plan[name] + out)}", file=sys.stderr,
              flush=True)
        reports[name] = bench_rollout.main(plan[name] + out)
        _free_device_memory()
    verdicts = judge(reports)
    print_verdicts(verdicts)
    harness.write_json(args.json, {"verdicts": verdicts})
    return verdicts


def _free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(0 if all(verdict["passed"] for verdict in main()) else 1)  # a missed target fails the command
