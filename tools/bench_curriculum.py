"""val/accuracy of the demo run with and without the GAIN-RL angle curriculum, over several seeds.

    python tools/bench_curriculum.py --config configs/demo.yaml --seeds 0,1,2 --curricula none,angle \
        --json runs/curriculum.json

Each (curriculum, seed) is one ``lit-grpo fit`` in its own process with ``--seed_everything S --data.sampling.seed S
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
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `tools` importable
    sys.path.insert(0, str(ROOT))

from tools.bench_fit import run_fit, split_extra  # noqa: E402

CURRICULA = ("none", "angle")


def run_one(config: Path, curriculum: str, seed: int, root: Path, extra: list[str]) -> dict:
    """One ``lit-grpo fit`` of ``config`` with this curriculum and seed; returns its record."""
    name = f"curriculum={curriculum} seed={seed}"
    scalars, wall_s = run_fit(["--config", str(config), "--seed_everything", str(seed), "--data.sampling.seed",
                               str(seed), "--data.curriculum", curriculum, *extra],
                              root / f"{curriculum}_seed{seed}", name)
    curve = scalars.get("val/accuracy")
    if not curve:
        raise SystemExit(f"{name}: the run logged no val/accuracy; the config must validate at least once "
                         "(trainer.val_check_interval / check_val_every_n_epoch)")
    rewards = [value for _, value, _ in scalars.get("reward/mean", [])]
    record = {"curriculum": curriculum, "seed": seed, "val_accuracy": curve[-1][1],
              "val_accuracy_curve": [[step, value] for step, value, _ in curve],
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
    argv, extra = split_extra(argv)
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
