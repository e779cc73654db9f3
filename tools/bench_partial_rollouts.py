"""Partial rollouts, replayed: decode steps per training step with and without over-provisioning.

    python tools/bench_partial_rollouts.py --lengths tools/data/smollm2_gsm_symbolic_lengths.json --prompts 4 \
        --group-size 16 --micro-group-size 64 --steps 20 --over-provision 1.0,1.5,2.0 --json runs/partial.json

Each training step needs ``--prompts`` (B) complete groups of ``--group-size`` (G). Every fresh sample's completion
length is drawn from the file's recorded lengths (all of them pooled, with ``--seed``) and replayed in the engine
(EOS forced at that step; ``--max-new-tokens`` caps them as training would), so the decode-step figures depend
only on the lengths, the slots and the carry policy, not on the machine or the model; ``--model smollm2`` gives
real wall times for the same work with and without. With ``over_provision`` r a step runs up to ``ceil(r x B)`` groups, the carried ones first, stops once B
are complete and carries the rest, exactly as training does (``lit_grpo.sampling.carry.plan_partial_rollout``);
r = 1.0 is the plain rollout. Every setting replays the same sequence of fresh groups.

JSON: {"config": {...}, "runs": [{"over_provision", "micro_group_size", "max_staleness", "decode_steps_per_step"
(median over steps), "decode_steps_total", "carried_samples" (mean unfinished samples carried out of a step),
"observed_max_staleness" (steps the oldest returned group was carried), "offpolicy_tokens_frac", "wall_s_per_step"
(median), "steps"}]}.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.sampling import GroupProgress, RolloutEngine
from lit_grpo.sampling.carry import plan_partial_rollout

MODELS = {"tiny": "tiny-llama", "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=Path, required=True, help='JSON {"lengths": [[L, ...], ...]}: the pool')
    parser.add_argument("--model", default="tiny", help="tiny | smollm2 | a path or random:NAME")
    parser.add_argument("--prompts", type=int, default=4, help="B, complete groups per training step")
    parser.add_argument("--group-size", type=int, default=16, help="G")
    parser.add_argument("--micro-group-size", default="64", help="g, slots; comma list to compare several")
    parser.add_argument("--strategy", default="continuous", choices=["continuous", "infinite", "full"])
    parser.add_argument("--steps", type=int, default=20, help="training steps replayed")
    parser.add_argument("--over-provision", default="1.0,2.0", help="comma list of r >= 1.0")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="the length cap (default: the longest recorded length); longer lengths end at it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.over_provision = [float(r) for r in args.over_provision.split(",") if r]
    args.micro_group_size = [int(g) for g in args.micro_group_size.split(",") if g]
    for name, values in (("--over-provision", args.over_provision), ("--micro-group-size", args.micro_group_size)):
        if not values or min(values) < (1.0 if name == "--over-provision" else 1):
            parser.error(f"{name}={values} needs values >= 1")
    if args.steps < 1 or args.prompts < 1 or args.group_size < 1:
        parser.error("--steps, --prompts and --group-size must be >= 1")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return args


def fresh_lengths(pool: list[int], num_groups: int, group_size: int, seed: int) -> list[list[int]]:
    """``[num_groups][group_size]`` lengths drawn with replacement from ``pool``, the same for every setting."""
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(group_size)] for _ in range(num_groups)]


def replay(engine: RolloutEngine, prompt: list[int], lengths: list[list[int]], steps: int, num_groups: int,
           over_provision: float, max_staleness: int) -> dict:
    """Run ``steps`` training steps' rollouts; returns the run's record."""
    carried: list[GroupProgress] = []
    next_group, decode_steps, walls, carried_samples, staleness_seen, offpolicy, tokens = 0, [], [], [], 0, 0, 0
    for _ in range(steps):
        fresh, finish = plan_partial_rollout([g.tag for g in carried], num_groups, over_provision, max_staleness)
        new = engine.new_groups([prompt] * fresh, lengths[next_group:next_group + fresh], tags=[0] * fresh)
        next_group += fresh
        start = time.perf_counter()
        result = engine.generate_groups(carried + new, complete=num_groups, finish=finish)
        walls.append(time.perf_counter() - start)
        decode_steps.append(result.stats.decode_steps)
        staleness_seen = max([staleness_seen, *result.tags])
        current = engine.rollout_index - 1
        offpolicy += sum(v < current for group in result.versions for s in group for v in s)
        tokens += sum(len(s) for group in result.versions for s in group)
        carried = [GroupProgress(g.prompt_ids, g.samples, g.stream, g.forced_lengths, g.tag + 1)
                   for g in result.carried]
        carried_samples.append(sum(not s.done for g in carried for s in g.samples))
    return {"over_provision": over_provision, "micro_group_size": engine.micro_group_size,
            "max_staleness": max_staleness, "decode_steps_per_step": statistics.median(decode_steps),
            "decode_steps_total": sum(decode_steps), "carried_samples": statistics.mean(carried_samples),
            "observed_max_staleness": staleness_seen, "offpolicy_tokens_frac": offpolicy / max(tokens, 1),
            "wall_s_per_step": statistics.median(walls), "steps": steps}


def main(argv=None) -> dict:
    args = parse_args(argv)
    pool = [int(n) for row in json.loads(args.lengths.read_text())["lengths"] for n in row]
    model, tokenizer = load_model_and_tokenizer(MODELS.get(args.model, args.model))
    model.eval()
    max_new_tokens = max(pool) if args.max_new_tokens is None else args.max_new_tokens
    pool = [min(n, max_new_tokens) for n in pool]  # a sample reaching the cap ends there, as in training
    # Enough fresh groups for any setting: every step draws at most ceil(r x B) of them.
    lengths = fresh_lengths(pool, args.steps * math.ceil(max(args.over_provision) * args.prompts), args.group_size,
                            args.seed)
    prompt = tokenizer("What is 12 + 30? Think step by step.")["input_ids"]
    runs = []
    for g in args.micro_group_size:
        for r in args.over_provision:
            engine = RolloutEngine(model, tokenizer, group_size=args.group_size, micro_group_size=g,
                                   strategy=args.strategy, max_new_tokens=max_new_tokens, seed=args.seed)
            with torch.inference_mode():
                runs.append(replay(engine, prompt, lengths, args.steps, args.prompts, r, args.max_staleness))
            print(json.dumps(runs[-1]), file=sys.stderr)
    report = {"config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                         "max_new_tokens": max_new_tokens}, "runs": runs}
    print(f"{'g':>4} {'r':>5} {'steps/step':>11} {'carried':>8} {'staleness':>9} {'offpolicy':>9}")
    for run in runs:
        print(f"{run['micro_group_size']:>4} {run['over_provision']:>5} {run['decode_steps_per_step']:>11} "
              f"{run['carried_samples']:>8.1f} {run['observed_max_staleness']:>9} {run['offpolicy_tokens_frac']:>9.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
