"""Scheduler matrix: decode steps of "infinite" against "continuous" over length sets x shapes x schedulers.

    python -m tools.bench_scheduler_matrix --json runs/matrix.json --markdown runs/matrix.md   # the whole matrix
    python -m tools.bench_scheduler_matrix --from-json runs/matrix.json --check                # judge it again

Every cell is one ``tools.bench_rollout`` run (its ``main``, in this process) on the tiny model with replayed
lengths (``--lengths``): "continuous", "infinite" with its default scheduler ("none": least attained service, no
predictor) and with the paper's length-aware method per predictor, after ``--warmup-rollouts`` rollouts of the same
replay (so the default's gate and the online predictor have learned; every infinite engine gets them). Decode steps
depend only on the lengths and the scheduler, so the figures hold on any machine. Sets (files from
``python -m tools.make_length_sets``):
"paper" is the recorded SmolLM2 gsm_symbolic set at its own shape (B 1, G 32, 1024 tokens) and resampled with
replacement (seeded) into the other shapes; "lognormal", "bimodal", "uniform" are synthetic, 256-token cap;
"gsm_base", "gsm_trained", "demo_base", "demo_trained" are the real token recordings (``RECORDED_SETS``), their first
B prompts and G samples (a shape they cannot serve is skipped). On the tiny model the token-conditioned predictors
see features unrelated to these lengths: what they gain on real features is ``tools.study_predictors``'s to say;
here the cells show that no predictor's schedule loses to continuous.

Per cell it reports the simple bound max(ceil(sum L / g), max L) (``lower_bound_steps``), the makespan lower bound
of running whole samples on g slots (``makespan_lower_bound``) and the best plan the FPTAS finds
(``best_plan_steps``: the optimum lies between the two). ``--check`` exits 1 naming every cell that misses a
target (:data:`TARGETS`). ``--quick`` runs one warm-up rollout and the paper set at its own shape only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from lit_grpo.scheduling.length_aware import fptas_partition, makespan_lower_bound
from tools import bench_rollout, harness
from tools.make_length_sets import OUT_DIR
from tools.recordings import read_recording

TOKENS_DIR = harness.ROOT / "tools" / "data" / "tokens"

SETS = ("paper", "lognormal", "bimodal", "uniform", "gsm_base", "gsm_trained", "demo_base", "demo_trained")
#: The real token recordings (tools/data/tokens/, tools.record_lengths --tokens): a shape takes their first B
#: prompts and first G samples.
RECORDED_SETS = {name: TOKENS_DIR / f"smollm2_{task}_{model}.json.gz"
                 for name, task, model in (("gsm_base", "gsm_symbolic", "base"),
                                           ("gsm_trained", "gsm_symbolic", "trained"),
                                           ("demo_base", "demo_task", "base"),
                                           ("demo_trained", "demo_task", "trained"))}
SHAPES = ((1, 32, 8), (4, 16, 8), (8, 16, 32))
#: "none" is the default scheduler; the others run the length-aware method with that predictor.
PREDICTORS = ("none", "oracle", "online", "noisy:0.25", "noisy:0.5", "noisy:1.0")
SPREADS = (0.25, 0.5, 1.0)  # the noise curve; spread 0 is the oracle
TARGETS = {
    "default": "infinite (the default scheduler) <= 1.00 x continuous",
    "learned": "infinite/online <= 1.00 x continuous",
    "oracle": "infinite/oracle <= 1.02 x the makespan lower bound",
    "noisy": "infinite/noisy:S <= 1.00 x continuous at every S",
    "noisy_gain": "infinite/noisy:0.25 keeps >= half of the oracle's gain over continuous",
}


def lengths_file(set_name: str, prompts: int, group: int, directory: Path = OUT_DIR) -> Path:
    """The replay file of a set at (B, G): a token recording, or a generated set (the measured B prompts and the
    warm-ups' after them; the paper set at its own shape holds the recorded prompt itself)."""
    if set_name in RECORDED_SETS:
        return RECORDED_SETS[set_name]
    path = directory / f"{set_name}_b{prompts}_g{group}.json"
    if not path.exists():
        raise SystemExit(f"no length set {path}; write it with python -m tools.make_length_sets --shapes "
                         f"{prompts}x{group} --out {directory}")
    return path


def run_cell(set_name: str, shape: tuple[int, int, int], args) -> list[dict]:
    """One bench_rollout run of a (set, shape): a record per infinite (predictor, refill), with its references."""
    prompts, group, slots = shape
    path = lengths_file(set_name, prompts, group, args.lengths_dir)
    replay = read_recording(path)
    if prompts > len(replay["lengths"]) or group > len(replay["lengths"][0]):
        print(f"cell {set_name} B{prompts} G{group}: skipped, the recording holds {len(replay['lengths'])} prompts x "
              f"{len(replay['lengths'][0])} samples", file=sys.stderr)
        return []
    flat = [n for row in replay["lengths"][:prompts] for n in row[:group]]
    argv = ["--model", "tiny", "--task", "synthetic", "--lengths", str(path), "--prompts", str(prompts),
            "--group-size", str(group), "--micro-group-size", str(slots),
            "--max-new-tokens", str(replay["meta"]["max_new_tokens"]), "--strategies", "continuous,infinite",
            "--predictors", ",".join(args.predictors), "--warmup-rollouts", str(args.warmup_rollouts),
            "--repeats", "1", "--seed", str(args.seed), "--threads", str(args.threads)]
    if args.refills:
        argv += ["--refills", args.refills]
    with contextlib.redirect_stdout(sys.stderr):  # bench_rollout's own table; stdout keeps the matrix's
        runs = bench_rollout.main(argv)["runs"]
    continuous = next(run["decode_steps"] for run in runs if run["strategy"] == "continuous")
    bound = makespan_lower_bound(flat, slots)
    best_plan = fptas_partition(flat, slots).makespan
    cells = []
    for run in (r for r in runs if r["strategy"] == "infinite"):
        steps = run["decode_steps"]
        cells.append(dict(set=set_name, prompts=prompts, group_size=group, slots=slots, predictor=run["predictor"],
                          refill=run["refill"], decode_steps=steps, continuous_steps=continuous,
                          lower_bound_steps=run["lower_bound_steps"], makespan_lower_bound=bound,
                          best_plan_steps=best_plan, ratio_to_continuous=steps / continuous,
                          ratio_to_bound=steps / bound, ratio_to_best_plan=steps / best_plan))
    return cells


def misses(cells: list[dict]) -> list[str]:
    """Every (cell, target) that fails, as a readable line."""
    out = []
    for cell in cells:
        name, ratio = cell["predictor"], cell["ratio_to_continuous"]
        where = f"{cell['set']} B{cell['prompts']} G{cell['group_size']} g{cell['slots']} {name},{cell['refill']}"
        if name in ("none", "online") and ratio > 1.0:
            target = TARGETS["default" if name == "none" else "learned"]
            out.append(f"{where}: {ratio:.3f} x continuous ({target})")
        if name == "oracle" and cell["ratio_to_bound"] > 1.02:
            out.append(f"{where}: {cell['ratio_to_bound']:.3f} x bound ({TARGETS['oracle']})")
        if name.startswith("noisy") and ratio > 1.0:
            out.append(f"{where}: {ratio:.3f} x continuous ({TARGETS['noisy']})")
        if name == "noisy:0.25":
            kept = gain_kept(cell, cells)
            if kept is not None and kept < 0.5:
                out.append(f"{where}: keeps {kept:.2f} of the oracle's gain ({TARGETS['noisy_gain']})")
    return out


def gain_kept(cell: dict, cells: list[dict]) -> float | None:
    """Share of the oracle's gain over continuous that ``cell`` keeps; None when the oracle gains nothing."""
    oracle = _sibling(cell, cells, "oracle")
    if oracle is None:
        return None
    return harness.oracle_gain_kept(cell["decode_steps"], oracle["decode_steps"], cell["continuous_steps"])


def _sibling(cell: dict, cells: list[dict], predictor: str) -> dict | None:
    same = ("set", "prompts", "group_size", "slots", "refill")
    return next((c for c in cells if c["predictor"] == predictor and all(c[k] == cell[k] for k in same)), None)


def _rows(cells: list[dict]) -> dict[tuple, dict[str, dict]]:
    """``{(set, B, G, g, refill): {predictor: cell}}`` in run order."""
    rows: dict[tuple, dict[str, dict]] = {}
    for cell in cells:
        key = (cell["set"], cell["prompts"], cell["group_size"], cell["slots"], cell["refill"])
        rows.setdefault(key, {})[cell["predictor"]] = cell
    return rows


def matrix_table(cells: list[dict]) -> str:
    """Decode steps per (set, shape, refill): references, continuous, and infinite per predictor (x continuous)."""
    predictors = list(dict.fromkeys(c["predictor"] for c in cells))
    head = ["set", "B", "G", "g", "refill", "bound", "best plan", "continuous"] + [_column(p) for p in predictors]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (set_name, prompts, group, slots, refill), by_predictor in _rows(cells).items():
        first = next(iter(by_predictor.values()))
        row = [set_name, prompts, group, slots, refill, first["makespan_lower_bound"], first["best_plan_steps"],
               first["continuous_steps"]]
        row += [f"{c['decode_steps']} ({c['ratio_to_continuous']:.3f})" if (c := by_predictor.get(p)) else "-"
                for p in predictors]
        lines.append("| " + " | ".join(str(_integral(v)) for v in row) + " |")
    return "\n".join(lines)


def _column(predictor: str) -> str:
    return "default" if predictor == "none" else f"length-aware {predictor}"


def noise_table(cells: list[dict]) -> str:
    """infinite / continuous decode steps against the noisy oracle's spread (0 = the oracle), per set and shape."""
    spreads = [0.0] + [s for s in SPREADS if any(c["predictor"] == f"noisy:{s}" for c in cells)]
    head = ["set", "B", "G", "g", "refill"] + [f"S = {s:g}" for s in spreads]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, by_predictor in _rows(cells).items():
        values = [by_predictor.get("oracle" if s == 0 else f"noisy:{s}") for s in spreads]
        row = list(key) + [f"{c['ratio_to_continuous']:.3f}" if c else "-" for c in values]
        lines.append("| " + " | ".join(map(str, row)) + " |")
    return "\n".join(lines)


def _integral(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def markdown(cells: list[dict], config: dict) -> str:
    found = misses(cells)
    verdict = "every target met" if not found else f"{len(found)} targets missed:\n" + "\n".join(
        f"- {line}" for line in found)
    return (f"Decode steps (x continuous), warm-up rollouts {config['warmup_rollouts']}, seed {config['seed']}:\n\n"
            f"{matrix_table(cells)}\n\ninfinite / continuous against the noisy oracle's spread S:\n\n"
            f"{noise_table(cells)}\n\n{verdict}\n")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default=",".join(SETS), type=harness.comma_names(SETS),
                        help=f"comma list of {','.join(SETS)}")
    parser.add_argument("--shapes", default=",".join(f"{b}x{g}x{s}" for b, g, s in SHAPES),
                        help="comma list of BxGxg (B, G must have a length set; see python -m tools.make_length_sets)")
    parser.add_argument("--predictors", default=",".join(PREDICTORS),
                        type=harness.comma_checked(bench_rollout._check_predictor),
                        help="none (the default scheduler) and the length-aware method's predictors (bench_rollout's)")
    parser.add_argument("--refills", default="", help="infinite's refill policies, passed to bench_rollout "
                                                      "(default: the scheduler's own)")
    parser.add_argument("--lengths-dir", type=Path, default=OUT_DIR,
                        help="where the generated sets are (python -m tools.make_length_sets --out; default: its own)")
    parser.add_argument("--warmup-rollouts", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one warm-up rollout; the paper set at B1 G32 g8 only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared machine)")
    parser.add_argument("--json", type=Path, help="write every cell here")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    parser.add_argument("--from-json", type=Path, help="judge and print a saved matrix instead of running one")
    parser.add_argument("--check", action="store_true", help="exit 1 naming the cells that miss a target")
    args = parser.parse_args(argv)
    args.shapes = [_shape(item, parser) for item in args.shapes.split(",") if item]
    if args.warmup_rollouts < 0:
        parser.error(f"--warmup-rollouts={args.warmup_rollouts} must be >= 0")
    if args.quick:
        args.warmup_rollouts, args.sets, args.shapes = 1, ["paper"], [(1, 32, 8)]
    return args


def _shape(item: str, parser) -> tuple[int, int, int]:
    parts = item.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        parser.error(f"--shapes item {item!r} must be BxGxg with integers >= 1, e.g. 4x16x8")
    return tuple(map(int, parts))


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.from_json:
        report = json.loads(args.from_json.read_text())
    else:
        start, cells = time.perf_counter(), []
        for set_name in args.sets:
            for shape in args.shapes:
                cell_start = time.perf_counter()
                cells += run_cell(set_name, shape, args)
                print(f"cell {set_name} B{shape[0]} G{shape[1]} g{shape[2]} done in "
                      f"{time.perf_counter() - cell_start:.0f} s", file=sys.stderr, flush=True)
        config = harness.config_record(args)
        report = {"config": config, "cells": cells, "wall_s": time.perf_counter() - start}
    report["misses"] = misses(report["cells"])
    text = markdown(report["cells"], report["config"])
    print(text)
    harness.write_json(args.json, report, indent=1)
    harness.write_text(args.markdown, text)
    if args.check and report["misses"]:
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    main()
