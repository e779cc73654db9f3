"""Record a real rollout: completion lengths, and with ``--tokens`` every token id, for replay and study.

    python -m tools.record_lengths --model smollm2 --task gsm_symbolic --prompts 32 --group-size 16 \
        --max-new-tokens 256 --tokens --out tools/data/tokens/smollm2_gsm_symbolic.json.gz

    python -m tools.record_lengths --model lightning_logs/version_0/checkpoints/last.ckpt \
        --config configs/demo.yaml --prompts 32 --group-size 16 --tokens --out runs/demo_trained.json.gz

Samples with lit_grpo's engine ("continuous", temperature 1.0, top_p 1.0, the seed given), prompts formatted with
the model's chat template as training does. ``--config`` takes the task, its settings, the system prompt and the
token cap of a ``lit-grpo fit`` config (``data.task``, ``data.task_config``, ``data.system_prompt``,
``data.sampling.max_new_tokens``); ``--model`` also takes a training checkpoint (``.ckpt``). The file format is
``tools/recordings.py``'s: lengths and truncation flags, and with ``--tokens`` the prompt and completion ids
(``.gz``: compressed), with ``meta`` saying how it was made. ``--lengths`` replays take either kind,
``--tokens`` replays and ``tools.study_predictors`` a token recording.
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
import yaml

from lit_grpo.sampling import RolloutEngine
from tools import harness
from tools.recordings import write_recording


def task_settings(args: argparse.Namespace) -> dict:
    """The task, its settings, the system prompt and the cap: ``--config``'s, a flag given explicitly winning."""
    settings = {"task": "gsm_symbolic", "task_config": None, "system_prompt": None, "max_new_tokens": 1024}
    if args.config:
        data = (yaml.safe_load(args.config.read_text()) or {}).get("data") or {}
        if "task" not in data:
            raise SystemExit(f"--config {args.config}: it has no data.task (a reasoning-gym task) to record")
        settings.update(task=data["task"], task_config=data.get("task_config"),
                        system_prompt=data.get("system_prompt"),
                        max_new_tokens=(data.get("sampling") or {}).get("max_new_tokens", 1024))
    settings.update({key: getattr(args, key) for key in ("task", "system_prompt", "max_new_tokens")
                     if getattr(args, key) is not None})
    return settings


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_model_argument(parser, default="smollm2", help_extra=" | a training checkpoint (.ckpt)")
    parser.add_argument("--config", type=Path, help="a lit-grpo fit config: its task, task settings, system "
                                                    "prompt and token cap")
    parser.add_argument("--task", help="reasoning-gym task (default gsm_symbolic, or the config's)")
    parser.add_argument("--system-prompt", help="(default: none, or the config's)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--micro-group-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, help="(default 1024, or the config's)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="of the prompts and of the engine's sampling")
    parser.add_argument("--tokens", action="store_true", help="keep every prompt and completion token id")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    settings = task_settings(args)

    model, tokenizer = harness.load_policy(args.model)
    prompts = harness.task_prompts(tokenizer, settings["task"], args.prompts, args.seed, settings["task_config"],
                                   settings["system_prompt"])
    engine = RolloutEngine(model, tokenizer, group_size=args.group_size, micro_group_size=args.micro_group_size,
                           strategy="continuous", max_new_tokens=settings["max_new_tokens"],
                           temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    result = engine.generate(prompts)
    meta = {"model": args.model if args.model.endswith(".ckpt") else harness.resolve_model(args.model),
            **settings, "task_seed": args.seed, "prompts": args.prompts, "group_size": args.group_size,
            "temperature": args.temperature, "top_p": 1.0, "engine_seed": args.seed, "strategy": "continuous",
            "eos_token_ids": list(engine.eos_token_ids), "prompt_lengths": [len(p) for p in prompts],
            "seconds": round(time.perf_counter() - start, 1), "torch": torch.__version__,
            "transformers": transformers.__version__, "machine": platform.machine(),
            "command": "python -m tools.record_lengths " + " ".join(argv or sys.argv[1:])}
    record = {"meta": meta, "lengths": [[len(c) for c in group] for group in result.completion_ids],
              "truncated": result.truncated}
    if args.tokens:
        record["prompt_ids"] = [list(map(int, p)) for p in prompts]
        record["completion_ids"] = [[list(map(int, c)) for c in group] for group in result.completion_ids]
    write_recording(args.out, record)
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
