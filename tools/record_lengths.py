"""Record completion lengths of a real rollout, for machine-independent replay by bench_rollout.py --lengths.

    python tools/record_lengths.py --model smollm2 --task gsm_symbolic --prompts 8 --group-size 32 \
        --max-new-tokens 1024 --out tools/data/smollm2_gsm_symbolic_lengths.json

Samples with lit_grpo's engine ("continuous", temperature 1.0, top_p 1.0, the seed given), prompts formatted
with the model's chat template exactly as bench_rollout.py does. The file holds {"lengths": [[L of sample k of
prompt p, ...] per prompt p], "truncated": [[bool, ...]], "meta": {how it was recorded}}.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import transformers

from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.sampling import RolloutEngine
from tools.bench_rollout import MODELS, task_prompts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", default="gsm_symbolic")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--micro-group-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(MODELS.get(args.model, args.model))
    prompts = task_prompts(tokenizer, args.task, args.prompts, args.seed)
    engine = RolloutEngine(model, tokenizer, group_size=args.group_size, micro_group_size=args.micro_group_size,
                           strategy="continuous", max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    result = engine.generate(prompts)
    meta = {"model": MODELS.get(args.model, args.model), "task": args.task, "task_seed": args.seed,
            "prompts": args.prompts, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "top_p": 1.0, "engine_seed": args.seed, "strategy": "continuous",
            "prompt_lengths": [len(p) for p in prompts], "seconds": round(time.perf_counter() - start, 1),
            "torch": torch.__version__, "transformers": transformers.__version__, "machine": platform.machine(),
            "command": "python tools/record_lengths.py " + " ".join(argv or __import__("sys").argv[1:])}
    record = {"lengths": [[len(c) for c in group] for group in result.completion_ids],
              "truncated": result.truncated, "meta": meta}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record))
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
