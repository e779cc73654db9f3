"""Whole ``lit-grpo fit`` runs of one config in variants and seeds: time per step, rollout time, val/accuracy.

    python -m tools.bench_fit --config configs/demo.yaml --seeds 0,1,2 \
        --variant "default=" --variant "partial=--data.over_provision 2.0" --json runs/demo_partial.json

A variant is ``NAME=ARGS``: extra ``lit-grpo fit`` arguments (split like a shell line; empty for the config as it
is). Each (seed, variant) is one run in its own process with ``--seed_everything S --data.sampling.seed S``, seed
by seed so that back-to-back runs of one seed compare on the same machine state; the data split
(``data.data_seed``) stays fixed, so every run is validated on the same held-out prompts. Figures are read back
from the run's TensorBoard events.

Records: "variant", "seed", "args", "wall_s" (the whole process), "step_s" (median time between consecutive
training steps, from the wall time of their ``train/loss`` events, so validations and start-up are left out),
"rollout_s" (median ``rollout/wall_s``, the engine's time), "update_s" (``step_s - rollout_s``: rewards, the
update and the optimizer step), "val_accuracy" (the last validation; None where the run does not validate),
"val_accuracy_curve", "reward_mean" (mean of ``reward/mean`` over the run), "steps", and the median of every
``--scalars`` key. The summary has, per variant, the mean and sample std of each over the seeds. There is no
target: the figures are reported as they come.

Extra arguments after ``--`` go to every run (e.g. ``-- --trainer.max_steps 10``). Presets of variants with their
own records are tools built on :func:`run_variants` (``python -m tools.bench_curriculum``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tools import harness

#: A run's scalars as read back: ``{tag: [(step, value, wall_time), ...]}``.
Scalars = dict[str, list[tuple[int, float, float]]]


def read_scalars(log_dir: Path) -> Scalars:
    """Every scalar of the run's TensorBoard events: ``{tag: [(step, value, wall_time), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value, event.wall_time) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def run_fit(args: list[str], run_dir: Path, name: str) -> tuple[Scalars, float]:
    """``lit-grpo fit ARGS`` logging under ``run_dir`` (emptied first; the run's output goes to ``fit.log``
    there); returns its scalars and wall seconds."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    command = harness.lit_grpo_command() + ["fit", *args, "--trainer.default_root_dir", str(run_dir)]
    start = time.perf_counter()
    process = subprocess.run(command, capture_output=True, text=True, env=harness.repo_env(PYTHONUNBUFFERED="1"))
    wall_s = time.perf_counter() - start
    (run_dir / "fit.log").write_text(process.stdout + process.stderr)  # the run's own summary is in there
    if process.returncode != 0:
        raise SystemExit(f"{name} failed ({shlex.join(command)}):\n{process.stderr[-4000:]}")
    log_dirs = sorted((run_dir / "lightning_logs").glob("version_*"))
    if not log_dirs:
        raise SystemExit(f"{name}: no TensorBoard logs under {run_dir}")
    return read_scalars(log_dirs[-1]), wall_s


def run_record(scalars: Scalars, wall_s: float, extra_keys: list[str]) -> dict:
    """A run's figures (see the module docstring) from its scalars."""
    losses = sorted(scalars.get("train/loss", []))
    gaps = [b[2] - a[2] for a, b in zip(losses, losses[1:]) if b[0] == a[0] + 1]
    step_s = harness.median(gaps)
    rollout_s = harness.median([value for _, value, _ in scalars.get("rollout/wall_s", [])])
    curve = [[step, value] for step, value, _ in scalars.get("val/accuracy", [])]
    rewards = [value for _, value, _ in scalars.get("reward/mean", [])]
    record = {"wall_s": wall_s, "steps": len(losses), "step_s": step_s, "rollout_s": rollout_s,
              "update_s": step_s - rollout_s if step_s is not None and rollout_s is not None else None,
              "val_accuracy": curve[-1][1] if curve else None, "val_accuracy_curve": curve,
              "reward_mean": statistics.fmean(rewards) if rewards else None}
    for key in extra_keys:
        record[key] = harness.median([value for _, value, _ in scalars.get(key, [])])
    return record


def summarize(runs: list[dict], by: str = "variant") -> dict[str, dict[str, float]]:
    """Per value of ``by`` (the variant): mean and sample std over the seeds of every numeric figure."""
    summary: dict[str, dict[str, float]] = {}
    for variant in dict.fromkeys(run[by] for run in runs):
        mine = [run for run in runs if run[by] == variant]
        stats: dict[str, float] = {"runs": len(mine)}
        for key, value in mine[0].items():
            values = [run[key] for run in mine if isinstance(run.get(key), (int, float))]
            if key in ("seed", "steps") or not values or isinstance(value, bool):
                continue
            stats[f"{key}_mean"] = statistics.fmean(values)
            stats[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        summary[variant] = stats
    return summary


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, args = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant {text!r} must be NAME=ARGS (ARGS may be empty: 'default=')")
    return name, shlex.split(args)


def split_extra(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """(the tool's own arguments, those after ``--`` that go to every ``lit-grpo fit``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    return argv[:argv.index("--")], argv[argv.index("--") + 1:]


def run_variants(config: Path, seeds: list[int], variants: dict[str, list[str]], root: Path, extra: list[str],
                 record: Callable[[str, int, list[str], Scalars, float], dict]) -> Iterator[dict]:
    """Every (seed, variant) as one ``lit-grpo fit`` (module docstring), seed by seed; yields each run's record,
    ``record(variant, seed, variant args, scalars, wall_s)``, as it comes (and prints it to stderr)."""
    for seed in seeds:  # seed-major, so a partial report already pairs the variants
        for name, variant_args in variants.items():
            run_args = ["--config", str(config), "--seed_everything", str(seed), "--data.sampling.seed", str(seed),
                        *variant_args, *extra]
            scalars, wall_s = run_fit(run_args, root / f"{name}_seed{seed}", f"{name} seed={seed}")
            run = record(name, seed, variant_args, scalars, wall_s)
            print(json.dumps(run), file=sys.stderr, flush=True)
            yield run


def measure(args: argparse.Namespace, seeds: list[int], variants: dict[str, list[str]], extra: list[str],
            record: Callable[[str, int, list[str], Scalars, float], dict], config: dict, by: str) -> dict:
    """:func:`run_variants` of ``args.config`` under ``args.root``; the report ``{"config", "runs", "summary"}``
    (summarised per ``by``) is written to ``args.json`` after every run, so a stopped benchmark keeps what it
    measured, and its summary printed at the end."""
    runs: list[dict] = []
    for run in run_variants(args.config, seeds, variants, args.root, extra, record):
        runs.append(run)
        report = {"config": config, "runs": runs, "summary": summarize(runs, by)}
        harness.write_json(args.json, report)
    for line in summary_lines(runs, report["summary"], by):
        print(line)
    return report


def summary_lines(runs: list[dict], summary: dict[str, dict[str, float]], by: str = "variant") -> list[str]:
    """A line per variant of ``summary`` (:func:`summarize` of ``runs``): each figure's mean, with its sample std
    where more than one run measured it (a figure of one run has none: shown alone, not as "+- 0.000")."""
    lines = []
    for name, stats in summary.items():
        mine = [run for run in runs if run[by] == name]

        def spread(figure: str) -> str:
            measured = sum(isinstance(run.get(figure), (int, float)) for run in mine)
            return f" +- {stats[figure + '_std']:.3f}" if measured > 1 else ""

        lines.append(f"{name}: " + ", ".join(f"{key[:-5]} {value:.3f}{spread(key[:-5])}"
                                             for key, value in stats.items() if key.endswith("_mean")))
    return lines


def parse_args(argv: list[str] | None, description: str, seeds: str, root: str,
               own_arguments: Callable[[argparse.ArgumentParser], None],
               ) -> tuple[argparse.Namespace, list[str], list[int]]:
    """(arguments, those after ``--`` for every run, the seeds): ``--config``, ``--seeds``, ``--root``, ``--json``
    and the tool's ``own_arguments``."""
    argv, extra = split_extra(argv)
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/demo.yaml"))
    parser.add_argument("--seeds", default=seeds, type=harness.comma_numbers(0), help="comma list of seeds")
    own_arguments(parser)
    parser.add_argument("--root", type=Path, default=Path(root), help="where the runs' logs go")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not args.config.is_file():
        raise SystemExit(f"--config {args.config} does not exist")
    return args, extra, args.seeds


def _own_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variant", action="append", default=[], help="NAME=ARGS; repeat for each variant")
    parser.add_argument("--scalars", default="", help="comma list of further logged keys to report medians of")


def main(argv: list[str] | None = None) -> dict:
    args, extra, seeds = parse_args(argv, __doc__, "0", "runs/fit", _own_arguments)
    variants = dict(parse_variant(text) for text in (args.variant or ["default="]))
    keys = [key for key in args.scalars.split(",") if key]

    def record(name: str, seed: int, variant_args: list[str], scalars: Scalars, wall_s: float) -> dict:
        return {"variant": name, "seed": seed, "args": shlex.join(variant_args), **run_record(scalars, wall_s, keys)}

    config = {"config": str(args.config), "seeds": seeds, "variants": {k: shlex.join(v) for k, v in variants.items()},
              "extra": extra}
    return measure(args, seeds, variants, extra, record, config, by="variant")


if __name__ == "__main__":
    main()
