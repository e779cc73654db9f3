"""Partial rollouts, replayed: decode steps per training step with and without over-provisioning.

    python -m tools.bench_partial_rollouts --lengths tools/data/smollm2_gsm_symbolic_lengths.json --prompts 4 \
        --group-size 16 --micro-group-size 64 --steps 20 --over-provision 1.0,1.5,2.0 --json runs/partial.json

Each training step needs ``--prompts`` (B) complete groups of ``--group-size`` (G). Every fresh sample's completion
length is drawn from the file's recorded lengths (all of them pooled, with ``--seed``) and replayed in the engine
(EOS forced at that step; ``--max-new-tokens`` caps them as training would), so the decode-step figures depend
only on the lengths, the slots and the carry policy, not on the machine or the model; ``--model smollm2`` gives
real wall times for the same work with and without. Each step is ``lit_grpo.rollout.builder.RolloutBuilder``'s own
``build_train``, as in training: with ``over_provision`` r it runs up to ``ceil(r x B)`` groups, the carried ones
first, stops once B are complete and carries the rest; r = 1.0 is the plain rollout. Every setting replays the
same sequence of fresh groups (the engine takes each fresh group's lengths from it, in order).

JSON: {"config": {...}, "runs": [{"over_provision", "micro_group_size", "max_staleness", "decode_steps_per_step"
(median over steps), "decode_steps_total", "carried_samples" (mean unfinished samples carried out of a step),
"observed_max_staleness" (steps the oldest returned group was carried), "offpolicy_tokens_frac" (of every
completion token trained on), "wall_s_per_step" (median ``build_train`` time: the rollout and its scoring),
"steps"}]}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from lit_grpo.rollout.builder import Prompt, RolloutBuilder
from lit_grpo.rollout.config import TrainingConfig
from lit_grpo.rollout.prompts import PromptExample
from lit_grpo.rollout.rewards import build_reward_funcs
from lit_grpo.sampling import RolloutEngine, SamplingConfig
from tools import harness

#: The one prompt every group answers (the lengths are replayed, so its text does not matter).
PROMPT, ANSWER = "What is 12 + 30? Think step by step.", "42"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=Path, required=True, help='JSON {"lengths": [[L, ...], ...]}: the pool')
    harness.add_model_argument(parser, default="tiny")
    parser.add_argument("--prompts", type=int, default=4, help="B, complete groups per training step")
    parser.add_argument("--group-size", type=int, default=16, help="G")
    parser.add_argument("--micro-group-size", default="64", type=harness.comma_numbers(1),
                        help="g, slots; comma list to compare several")
    parser.add_argument("--strategy", default="continuous", choices=["continuous", "infinite", "full"])
    parser.add_argument("--steps", type=int, default=20, help="training steps replayed")
    parser.add_argument("--over-provision", default="1.0,2.0", type=harness.comma_numbers(1.0, float),
                        help="comma list of r >= 1.0")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="the length cap (default: the longest recorded length); longer lengths end at it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.prompts < 1 or args.group_size < 1:
        parser.error("--steps, --prompts and --group-size must be >= 1")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return args


def fresh_lengths(pool: list[int], num_groups: int, group_size: int, seed: int) -> list[list[int]]:
    """``[num_groups][group_size]`` lengths drawn with replacement from ``pool``, the same for every setting."""
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(group_size)] for _ in range(num_groups)]


class ReplayEngine(RolloutEngine):
    """The engine with every fresh group's completion lengths forced, taken in order from ``lengths``."""

    def __init__(self, *args, lengths: Iterator[list[int]], **kwargs):
        super().__init__(*args, **kwargs)
        self.lengths = lengths

    def new_groups(self, prompts, lengths=None, tags=None):
        if lengths is None:
            lengths = [next(self.lengths) for _ in prompts]
        return super().new_groups(prompts, lengths, tags)


class ReplayBuilder(RolloutBuilder):
    """The builder whose training engine replays ``lengths``."""

    def __init__(self, *args, lengths: list[list[int]], **kwargs):
        super().__init__(*args, **kwargs)
        self.lengths = iter(lengths)

    def _new_engine(self, config: SamplingConfig) -> RolloutEngine:
        return ReplayEngine(self.policy, self.tokenizer, config, lengths=self.lengths)


def replay(builder: RolloutBuilder, prompt_ids: list[int], steps: int) -> dict:
    """Run ``steps`` training steps' ``build_train``; returns the run's record."""
    counter = itertools.count()
    example = PromptExample(PROMPT, ANSWER)
    draw = lambda count: [Prompt(next(counter), example, prompt_ids) for _ in range(count)]  # noqa: E731
    decode_steps, walls, carried_samples, staleness_seen, offpolicy, tokens = [], [], [], 0, 0.0, 0
    for _ in range(steps):
        carried = {group.tag.prompt.index: group.tag.steps for group in builder.carried}
        start = time.perf_counter()
        batch = builder.build_train(draw)
        walls.append(time.perf_counter() - start)
        decode_steps.append(batch.stats.decode_steps)
        staleness_seen = max([staleness_seen, *(carried.get(index, 0) for index in batch.indices)])
        step_tokens = int(batch.completion_mask.sum())
        offpolicy += batch.metrics.get("rollout/offpolicy_tokens_frac", 0.0) * step_tokens
        tokens += step_tokens
        carried_samples.append(batch.metrics.get("rollout/carried_samples", 0.0))
    return {"over_provision": builder.training.over_provision, "micro_group_size": builder.resolved_micro_group_size,
            "max_staleness": builder.training.max_staleness, "decode_steps_per_step": harness.median(decode_steps),
            "decode_steps_total": sum(decode_steps), "carried_samples": sum(carried_samples) / steps,
            "observed_max_staleness": staleness_seen, "offpolicy_tokens_frac": offpolicy / max(tokens, 1),
            "wall_s_per_step": harness.median(walls), "steps": steps}


def main(argv=None) -> dict:
    args = parse_args(argv)
    pool = [int(n) for row in json.loads(args.lengths.read_text())["lengths"] for n in row]
    model, tokenizer = harness.load_policy(args.model)
    max_new_tokens = max(pool) if args.max_new_tokens is None else args.max_new_tokens
    pool = [min(n, max_new_tokens) for n in pool]  # a sample reaching the cap ends there, as in training
    # Enough fresh groups for any setting: every step draws at most ceil(r x B) of them.
    lengths = fresh_lengths(pool, args.steps * math.ceil(max(args.over_provision) * args.prompts), args.group_size,
                            args.seed)
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    runs = []
    for g in args.micro_group_size:
        for r in args.over_provision:
            sampling = SamplingConfig(group_size=args.group_size, micro_group_size=g, strategy=args.strategy,
                                      max_new_tokens=max_new_tokens, seed=args.seed)
            builder = ReplayBuilder(model, tokenizer, sampling, build_reward_funcs(["accuracy"]),
                                    training=TrainingConfig(prompts_per_step=args.prompts, over_provision=r,
                                                            max_staleness=args.max_staleness), lengths=lengths)
            with torch.inference_mode():
                runs.append(replay(builder, prompt_ids, args.steps))
            print(json.dumps(runs[-1]), file=sys.stderr)
    report = {"config": harness.config_record(args, max_new_tokens=max_new_tokens), "runs": runs}
    print(f"{'g':>4} {'r':>5} {'steps/step':>11} {'carried':>8} {'staleness':>9} {'offpolicy':>9}")
    for run in runs:
        print(f"{run['micro_group_size']:>4} {run['over_provision']:>5} {run['decode_steps_per_step']:>11} "
              f"{run['carried_samples']:>8.1f} {run['observed_max_staleness']:>9} {run['offpolicy_tokens_frac']:>9.3f}")
    harness.write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
