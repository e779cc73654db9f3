"""val/accuracy of the demo run with and without the GAIN-RL angle curriculum, over several seeds.

    python tools/bench_curriculum.py --config configs/demo.yaml --seeds 0,1,2 --curricula none,angle \
        --json runs/curriculum.json

Each (curriculum, seed) is one ``lit-grpo fit`` in its own process with ``--seed_everything S --data.seed S
--data.curriculum C`` (so the rollouts' random streams and the prompt draws both change with the seed; the data
split, ``data.data_seed``, stays fixed, so every run is validated on the same held-out prompts). Everything else,
including the number of steps, is the config's. The figures are read back from the run's TensorBoard events.

Records: "curriculum", "seed", "val_accuracy" (the last validation), "val_accuracy_curve" ([[step, value], ...]
of every validation), "train_reward_mean" (mean of reward/mean over the run), "curriculum_mu" (the last
curriculum/mu, angle runs only), "wall_s"; the summary has mean and std of the final val/accuracy per curriculum.
There is no target: the figures are reported as they come.

Extra arguments after ``--`` go to every ``lit-grpo fit`` (e.g. ``-- --trainer.max_steps 10``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CURRICULA = ("none", "angle")


def lit_grpo_command() -> list[str]:
    exe = shutil.which("lit-grpo")
    return [exe] if exe else [sys.executable, "-m", "lit_grpo.cli"]


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run's TensorBoard events: ``{tag: [(step, value), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def run_one(config: Path, curriculum: str, seed: int, root: Path, extra: list[str]) -> dict:
    """One ``lit-grpo fit`` of ``config`` with this curriculum and seed; returns its record."""
    run_dir = root / f"{curriculum}_seed{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    command = lit_grpo_command() + ["fit", "--config", str(config), "--seed_everything", str(seed),
                                    "--data.seed", str(seed), "--data.curriculum", curriculum,
                                    "--trainer.default_root_dir", str(run_dir), *extra]
    start = time.perf_counter()
    process = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall_s = time.perf_counter() - start
    if process.returncode != 0:
        raise SystemExit(f"curriculum={curriculum} seed={seed} failed ({' '.join(command)}):\n"
                         f"{process.stderr[-4000:]}")
    log_dirs = sorted((run_dir / "lightning_logs").glob("version_*"))
    if not log_dirs:
        raise SystemExit(f"curriculum={curriculum} seed={seed}: no TensorBoard logs under {run_dir}")
    scalars = read_scalars(log_dirs[-1])
    curve = scalars.get("val/accuracy")
    if not curve:
        raise SystemExit(f"curriculum={curriculum} seed={seed}: the run logged no val/accuracy; the config must "
                         "validate at least once (trainer.val_check_interval / check_val_every_n_epoch)")
    rewards = [value for _, value in scalars.get("reward/mean", [])]
    record = {"curriculum": curriculum, "seed": seed, "val_accuracy": curve[-1][1],
              "val_accuracy_curve": [[step, value] for step, value in curve],
              "train_reward_mean": statistics.fmean(rewards) if rewards else None, "wall_s": wall_s}
    if scalars.get("curriculum/mu"):
        record["curriculum_mu"] = scalars["curriculum/mu"][-1][1]
    return record


def summarize(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Mean and (sample) std of the final val/accuracy per curriculum."""
    summary = {}
    for curriculum in dict.fromkeys(run["curriculum"] for run in runs):
        values = [run["val_accuracy"] for run in runs if run["curriculum"] == curriculum]
        summary[curriculum] = {"val_accuracy_mean": statistics.fmean(values),
                               "val_accuracy_std": statistics.stdev(values) if len(values) > 1 else 0.0,
                               "runs": len(values)}
    return summary


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/demo.yaml"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--curricula", default="none,angle")
    parser.add_argument("--root", type=Path, default=Path("runs/curriculum"), help="where the runs' logs go")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not args.config.is_file():
        raise SystemExit(f"--config {args.config} does not exist")
    curricula = args.curricula.split(",")
    unknown = [c for c in curricula if c not in CURRICULA]
    if unknown:
        raise SystemExit(f"--curricula {args.curricula!r}: {unknown} not known; use a comma list of {list(CURRICULA)}")
    seeds = [int(s) for s in args.seeds.split(",")]

    runs = []
    for seed in seeds:  # seed-major, so a partial JSON already pairs the curricula
        for curriculum in curricula:
            record = run_one(args.config, curriculum, seed, args.root, extra)
            runs.append(record)
            print(f"curriculum={curriculum:5s} seed={seed} val/accuracy={record['val_accuracy']:.3f} "
                  f"curve={record['val_accuracy_curve']} wall={record['wall_s']:.0f}s", file=sys.stderr, flush=True)
            report = {"config": {"config": str(args.config), "seeds": seeds, "curricula": curricula, "extra": extra},
                      "runs": runs, "summary": summarize(runs)}
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(report, indent=2))
    for curriculum, stats in report["summary"].items():
        print(f"{curriculum}: val/accuracy {stats['val_accuracy_mean']:.3f} +- {stats['val_accuracy_std']:.3f} "
              f"over {stats['runs']} seeds")
    return report


if __name__ == "__main__":
    main()
