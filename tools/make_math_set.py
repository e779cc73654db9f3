"""Write the worked example's math set: small seeded problems whose gold answers are written as a math grader
expects them (LaTeX fractions, decimals, integers with thousands separators), for ``configs/math_example.yaml``.

    python -m tools.make_math_set                       # tools/data/math_example.parquet, 300 rows, seed 0
    python -m tools.make_math_set --rows 200 --seed 1 --out my_set.parquet

Columns: ``problem`` (the question), ``solution`` (the gold answer) and ``kind`` (which generator made it; it
reaches the reward functions as a column, like any other). Several kinds have answers with more than one right
form, which is what the ``math`` reward's verifier is for: ``\\frac{7}{2}`` is also 3.5, 50% of 8 is 4 or 4.0.
The same seed writes the same rows.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "math_example.parquet"
#: Fewer than the distinct problems the generators can make (~480), so drawing them stays quick.
MAX_ROWS = 400


def latex(value: Fraction) -> str:
    """``Fraction(7, 2) -> '\\frac{7}{2}'``, ``Fraction(-3, 4) -> '-\\frac{3}{4}'``, whole numbers as integers."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def add_fractions(rng: random.Random) -> tuple[str, str]:
    b = rng.choice([2, 3, 4, 5, 6, 8])
    a, c = rng.randint(1, b - 1), rng.randint(1, b - 1)
    return f"What is {a}/{b} + {c}/{b}?", latex(Fraction(a, b) + Fraction(c, b))


def half_of(rng: random.Random) -> tuple[str, str]:
    n = rng.randrange(1, 100, 2)
    return f"What is half of {n}?", latex(Fraction(n, 2))


def percent_of(rng: random.Random) -> tuple[str, str]:
    p = rng.choice([10, 20, 25, 50])
    n = rng.choice([4, 8, 12, 20, 40, 60, 80, 100])
    return f"What is {p}% of {n}?", latex(Fraction(p * n, 100))


def as_decimal(rng: random.Random) -> tuple[str, str]:
    b = rng.choice([2, 4, 5, 8, 10, 20])
    a = rng.randint(1, b - 1)
    return f"Write {a}/{b} as a decimal.", f"{a / b:g}"


def add_small(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"What is {a} + {b}?", str(a + b)


def subtract_small(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"What is {a} - {b}?", str(a - b)


def add_thousands(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 9) * 1000, rng.randint(1, 9) * 100
    return f"What is {a:,} + {b}?", f"{a + b:,}"


KINDS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "add_fractions": add_fractions, "half_of": half_of, "percent_of": percent_of, "as_decimal": as_decimal,
    "add_small": add_small, "subtract_small": subtract_small, "add_thousands": add_thousands,
}


def make_rows(rows: int, seed: int) -> list[dict[str, str]]:
    """``rows`` distinct problems (so no held-out prompt repeats a training one), the kinds in turn, numbers
    drawn from ``random.Random(seed)``."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows={rows} must be in [1, {MAX_ROWS}] (the generators hold about that many distinct "
                         "problems)")
    rng = random.Random(seed)
    names = list(KINDS)
    out, seen, turn = [], set(), 0
    while len(out) < rows:
        kind = names[turn % len(names)]
        turn += 1
        problem, solution = KINDS[kind](rng)
        if problem not in seen:
            seen.add(problem)
            out.append({"problem": problem, "solution": solution, "kind": kind})
    return out


def write_parquet(rows: list[dict[str, str]], out: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out, compression="zstd")
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    path = write_parquet(make_rows(args.rows, args.seed), args.out)
    print(f"wrote {args.rows} problems to {path} ({path.stat().st_size} bytes)")
    return path


if __name__ == "__main__":
    main()
