"""val/accuracy of a config with and without the GAIN-RL angle curriculum, over several seeds: bench_fit's preset.

    python -m tools.bench_curriculum --config configs/demo.yaml --seeds 0,1,2 --curricula none,angle \
        --json runs/curriculum.json

Each (curriculum, seed) is one ``tools.bench_fit`` run with the variant ``--data.curriculum C``: its own process,
``--seed_everything S --data.sampling.seed S`` (the data split, ``data.data_seed``, stays fixed, so every run is
validated on the same held-out prompts); everything else, the number of steps included, is the config's.

Records: "curriculum", "seed", "val_accuracy" (the last validation), "val_accuracy_curve" ([[step, value], ...]
of every validation), "train_reward_mean" (mean of reward/mean over the run), "curriculum_mu" (the last
curriculum/mu, angle runs only), "wall_s"; the summary has, per curriculum, the mean and std of each over the seeds
("val_accuracy_mean", "val_accuracy_std", "runs", ...). There is no target: the figures are reported as they come.

Extra arguments after ``--`` go to every ``lit-grpo fit`` (e.g. ``-- --trainer.max_steps 10``).
"""

from __future__ import annotations

import statistics

from tools import harness
from tools.bench_fit import Scalars, measure, parse_args

CURRICULA = ("none", "angle")


def curriculum_record(curriculum: str, seed: int, args: list[str], scalars: Scalars, wall_s: float) -> dict:
    """One run's record (module docstring); SystemExit when the run never validated."""
    curve = scalars.get("val/accuracy")
    if not curve:
        raise SystemExit(f"curriculum={curriculum} seed={seed}: the run logged no val/accuracy; the config must "
                         "validate at least once (trainer.val_check_interval / check_val_every_n_epoch)")
    rewards = [value for _, value, _ in scalars.get("reward/mean", [])]
    record = {"curriculum": curriculum, "seed": seed, "val_accuracy": curve[-1][1],
              "val_accuracy_curve": [[step, value] for step, value, _ in curve],
              "train_reward_mean": statistics.fmean(rewards) if rewards else None, "wall_s": wall_s}
    if scalars.get("curriculum/mu"):
        record["curriculum_mu"] = scalars["curriculum/mu"][-1][1]
    return record


def main(argv: list[str] | None = None) -> dict:
    args, extra, seeds = parse_args(argv, __doc__, "0,1,2", "runs/curriculum", lambda parser: parser.add_argument(
        "--curricula", default="none,angle", type=harness.comma_names(CURRICULA),
        help=f"comma list of {','.join(CURRICULA)}"))
    curricula = args.curricula
    variants = {c: ["--data.curriculum", c] for c in curricula}
    config = {"config": str(args.config), "seeds": seeds, "curricula": curricula, "extra": extra}
    return measure(args, seeds, variants, extra, curriculum_record, config, by="curriculum")


if __name__ == "__main__":
    main()
