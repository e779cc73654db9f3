"""Seeded replay files (``--lengths`` format) for the scheduler matrix: synthetic families and the paper set resampled.

    python -m tools.make_length_sets            # (re)writes tools/data/synthetic/*.json, byte-identical per seed
    python -m tools.make_length_sets --check    # exits 1, naming the files, if any differs from what it would write

Each file is ``{"lengths": [[L of sample k of prompt p] per prompt p], "meta": {...}}`` (lengths count the EOS,
1 <= L <= meta.max_new_tokens). Prompts differ in difficulty: every prompt draws its own scale, so a per-prompt
predictor (the online predictor's prompt model) has signal, while the G samples of a prompt stay exchangeable. The
first B prompts are the measured instance; ``WARMUP_ROLLOUTS`` x B more follow, drawn from the same family by a
random stream of their own (so the instance is the same whatever their number), for the warm-up rollouts: a
scheduler is never measured on lengths it learned from. Families:

- lognormal: median x prompt scale x exp(N(0, sigma^2)), capped; about an eighth of the samples hit the cap.
- bimodal: a short mode and a long mode (part of it at the cap); each prompt has its own share of long samples.
- uniform: uniform on [1, prompt's top], the top drawn per prompt between 30% and 100% of the cap.
- paper: the recorded SmolLM2 gsm_symbolic lengths (one prompt, G = 32) resampled with replacement into B x G for the
  other shapes (at B 1, G 32 the recorded prompt itself is the instance); one recorded prompt, so its resampled
  prompts share one distribution (no per-prompt signal).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

from tools import harness

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "tools" / "data" / "synthetic"
PAPER_FILE = ROOT / "tools" / "data" / "smollm2_gsm_symbolic_lengths.json"
#: (B, G) of the matrix's shapes; g is the benchmark's choice, not the file's.
SHAPES = ((1, 32), (4, 16), (8, 16))
#: Warm-up rollouts a file holds prompts for, after the measured B (the scheduler matrix runs 3).
WARMUP_ROLLOUTS = 3
DEFAULT_CAP = 256


def lognormal_lengths(rng: random.Random, prompts: int, group: int, cap: int) -> list[list[int]]:
    median, prompt_sigma, sigma = 0.35 * cap, 0.5, 0.8
    rows = []
    for _ in range(prompts):
        scale = median * math.exp(rng.gauss(0.0, prompt_sigma))
        rows.append([_clamp(scale * math.exp(rng.gauss(0.0, sigma)), cap) for _ in range(group)])
    return rows


def bimodal_lengths(rng: random.Random, prompts: int, group: int, cap: int) -> list[list[int]]:
    rows = []
    for _ in range(prompts):
        long_share, scale = rng.uniform(0.2, 0.5), math.exp(rng.gauss(0.0, 0.2))
        row = []
        for _ in range(group):
            median, sigma = (0.8 * cap, 0.25) if rng.random() < long_share else (0.08 * cap, 0.4)
            row.append(_clamp(median * scale * math.exp(rng.gauss(0.0, sigma)), cap))
        rows.append(row)
    return rows


def uniform_lengths(rng: random.Random, prompts: int, group: int, cap: int) -> list[list[int]]:
    rows = []
    for _ in range(prompts):
        top = rng.uniform(0.3, 1.0) * cap
        rows.append([_clamp(rng.uniform(1.0, top), cap) for _ in range(group)])
    return rows


def paper_lengths(rng: random.Random, prompts: int, group: int, cap: int) -> list[list[int]]:
    recorded = json.loads(PAPER_FILE.read_text())["lengths"][0]
    return [[min(rng.choice(recorded), cap) for _ in range(group)] for _ in range(prompts)]


FAMILIES = {"lognormal": lognormal_lengths, "bimodal": bimodal_lengths, "uniform": uniform_lengths,
            "paper": paper_lengths}
#: The paper family keeps its recorded cap; (1, 32) is the recorded file itself, not a resample.
PAPER_CAP = 1024


def _clamp(value: float, cap: int) -> int:
    return max(1, min(cap, round(value)))


def length_set(family: str, prompts: int, group: int, cap: int, seed: int) -> dict:
    """The replay file's content for one family and shape (a pure function of its arguments)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown length family {family!r}; allowed: {', '.join(FAMILIES)}")
    for name, value in (("prompts", prompts), ("group_size", group), ("cap", cap)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    key = f"{family}:{prompts}:{group}:{cap}:{seed}"
    if family == "paper" and (prompts, group, cap) == (1, 32, PAPER_CAP):
        lengths = json.loads(PAPER_FILE.read_text())["lengths"][:1]  # the recorded instance itself
    else:
        lengths = FAMILIES[family](random.Random(key), prompts, group, cap)
    flat = [n for row in lengths for n in row]  # the measured instance's
    lengths += FAMILIES[family](random.Random(f"{key}:warm-up"), WARMUP_ROLLOUTS * prompts, group, cap)
    meta = {"family": family, "prompts": prompts, "warmup_prompts": WARMUP_ROLLOUTS * prompts, "group_size": group,
            "max_new_tokens": cap, "seed": seed,
            "capped_share": round(sum(n == cap for n in flat) / len(flat), 4),
            "mean_length": round(sum(flat) / len(flat), 2),
            "source": f"python -m tools.make_length_sets (family {family}, seed {seed})"}
    if family == "paper":
        meta["resampled_from"] = str(PAPER_FILE.relative_to(ROOT))
    return {"lengths": lengths, "meta": meta}


def render(content: dict) -> str:
    """JSON with one prompt's lengths per line: small, diffable, and the same bytes for the same content."""
    rows = ",\n".join("    " + json.dumps(row) for row in content["lengths"])
    return f'{{\n  "lengths": [\n{rows}\n  ],\n  "meta": {json.dumps(content["meta"], sort_keys=True)}\n}}\n'


def file_name(family: str, prompts: int, group: int) -> str:
    return f"{family}_b{prompts}_g{group}.json"


def planned_files(families, shapes, cap: int, seed: int) -> dict[str, str]:
    """``{file name: text}`` of every set."""
    planned = {}
    for family in families:
        for prompts, group in shapes:
            family_cap = PAPER_CAP if family == "paper" else cap
            planned[file_name(family, prompts, group)] = render(length_set(family, prompts, group, family_cap, seed))
    return planned


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--shapes item {item!r} must be BxG with B, G integers >= 1, e.g. 4x16")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES), type=harness.comma_names(list(FAMILIES)),
                        help=f"comma list of {','.join(FAMILIES)}")
    parser.add_argument("--shapes", default=",".join(f"{b}x{g}" for b, g in SHAPES), help="comma list of BxG")
    parser.add_argument("--cap", type=int, default=DEFAULT_CAP, help="max_new_tokens of the synthetic families")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs or is missing")
    args = parser.parse_args(argv)
    families = args.families
    if args.cap < 1:
        parser.error(f"--cap={args.cap} must be >= 1")
    planned = planned_files(families, parse_shapes(args.shapes), args.cap, args.seed)
    if args.check:
        stale = [name for name, text in planned.items()
                 if not (args.out / name).exists() or (args.out / name).read_text() != text]
        if stale:
            print(f"differ from what make_length_sets writes: {stale}", file=sys.stderr)
            return 1
        print(f"{len(planned)} files up to date in {args.out}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in planned.items():
        (args.out / name).write_text(text)
    print(f"wrote {len(planned)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
