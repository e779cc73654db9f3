"""Record completion lengths of a real rollout, for machine-independent replay by ``tools.bench_rollout --lengths``.

    python -m tools.record_lengths --model smollm2 --task gsm_symbolic --prompts 8 --group-size 32 \
        --max-new-tokens 1024 --out tools/data/smollm2_gsm_symbolic_lengths.json

Samples with lit_grpo's engine ("continuous", temperature 1.0, top_p 1.0, the seed given), prompts formatted
with the model's chat template exactly as tools.bench_rollout does (``tools.harness.task_prompts``). The file holds {"lengths": [[L of sample k of
prompt p, ...] per prompt p], "truncated": [[bool, ...]], "meta": {how it was recorded}}.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

from lit_grpo.sampling import RolloutEngine
from tools import harness


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_model_argument(parser, default="smollm2")
    parser.add_argument("--task", default="gsm_symbolic")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--micro-group-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    model, tokenizer = harness.load_policy(args.model)
    prompts = harness.task_prompts(tokenizer, args.task, args.prompts, args.seed)
    engine = RolloutEngine(model, tokenizer, group_size=args.group_size, micro_group_size=args.micro_group_size,
                           strategy="continuous", max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    result = engine.generate(prompts)
    meta = {"model": harness.resolve_model(args.model), "task": args.task, "task_seed": args.seed,
            "prompts": args.prompts, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "top_p": 1.0, "engine_seed": args.seed, "strategy": "continuous",
            "prompt_lengths": [len(p) for p in prompts], "seconds": round(time.perf_counter() - start, 1),
            "torch": torch.__version__, "transformers": transformers.__version__, "machine": platform.machine(),
            "command": "python -m tools.record_lengths " + " ".join(argv or sys.argv[1:])}
    record = {"lengths": [[len(c) for c in group] for group in result.completion_ids],
              "truncated": result.truncated, "meta": meta}
    harness.write_text(args.out, json.dumps(record))
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
