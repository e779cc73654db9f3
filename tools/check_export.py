"""Round trip of ``lit-grpo export``: greedy completions of the exported directory under plain ``transformers``
equal lit_grpo's greedy completions of the same policy, token for token.

    python -m tools.check_export --model HuggingFaceTB/SmolLM2-135M-Instruct --out /tmp/smollm2-export
    python -m tools.check_export --model tiny-llama --lora --out /tmp/tiny-lora-export
    python -m tools.check_export --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt --out /tmp/trained \
        --dataset tools/data/math_example.parquet --prompt-column problem \
        --system-prompt "Give only the final answer."           # a trained run, on its own held-out prompts

The policy is the model with a seeded perturbation of its weights (so a directory that silently held the base
weights would fail), exported with :func:`lit_grpo.export.export_policy` in float32; or, with ``--ckpt_path``, a
training checkpoint exported as ``lit-grpo export`` does, compared on ``--dataset``'s held-out prompts (the
split ``RolloutDataModule`` makes with ``--val-size`` and ``--data-seed``; the example's: 32 and 0).
lit_grpo's side is the rollout engine at temperature 0, one prompt at a time; the other side is
``generate(do_sample=False)`` in a fresh Python process that imports transformers only (checked: lit_grpo is not in
its ``sys.modules``).
Prints one JSON line: {"model", "lora", "prompts", "identical", "export_s", "dir_bytes", "weights_bytes"}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tools import harness

#: Prompts none of the training sets hold (held out by construction).
HELD_OUT = ["What is 17 + 25? Give the final answer in <answer></answer> tags.",
            "Simplify the fraction 6/8.", "Name a prime number larger than 40."]

_GENERATE = r"""
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
out, max_new_tokens = sys.argv[1], int(sys.argv[2])
prompts = json.loads(sys.stdin.read())
model = AutoModelForCausalLM.from_pretrained(out).eval()
tokenizer = AutoTokenizer.from_pretrained(out)
completions = []
for ids in prompts:
    import torch
    with torch.no_grad():
        generated = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=max_new_tokens)
    completions.append(generated[0, len(ids):].tolist())
templated = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                          tokenize=False)
print(json.dumps({"completions": completions, "lit_grpo_imported": any(m.startswith("lit_grpo") for m in sys.modules),
                  "templated": templated, "eos": model.generation_config.eos_token_id}))
"""


def perturb(model: torch.nn.Module, seed: int = 0, scale: float = 0.02) -> torch.nn.Module:
    """Add seeded noise to every trainable floating parameter (in place): stands in for training."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad and param.is_floating_point():
                param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale)
    return model


def engine_greedy(policy: torch.nn.Module, tokenizer, prompt_ids: Sequence[Sequence[int]],
                  max_new_tokens: int) -> list[list[int]]:
    """lit_grpo's greedy completions, as validation draws them (temperature 0, one sample per prompt)."""
    from lit_grpo.sampling import RolloutEngine

    engine = RolloutEngine(policy.eval(), tokenizer, group_size=1, micro_group_size=1, strategy="continuous",
                           max_new_tokens=max_new_tokens, temperature=0.0, seed=0)
    with torch.no_grad():
        result = engine.generate([list(ids) for ids in prompt_ids])
    return [group[0] for group in result.completion_ids]


def transformers_greedy(out: str | Path, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> dict:
    """``generate(do_sample=False)`` on the exported directory, in a fresh process that imports transformers only."""
    proc = subprocess.run([sys.executable, "-c", _GENERATE, str(out), str(max_new_tokens)],
                          input=json.dumps([list(ids) for ids in prompt_ids]), capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"loading {out} with transformers failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def prompt_ids_for(tokenizer, prompts: Sequence[str] = HELD_OUT) -> list[list[int]]:
    from lit_grpo.rollout.prompts import render_prompt

    return [render_prompt(tokenizer, p) for p in prompts]


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_model_argument(parser, default="tiny-llama")
    parser.add_argument("--lora", action="store_true", help="wrap the model with a LoRA adapter (merged on export)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ckpt_path", default=None, help="a training checkpoint instead of --model")
    parser.add_argument("--dataset", default=None, help="prompts from this local dataset (data.dataset)")
    parser.add_argument("--prompt-column", default=None)
    parser.add_argument("--val-size", type=int, default=32)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--system-prompt", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lit_grpo.export import export_policy, policy_from_checkpoint
    from lit_grpo.runtime.models import load_model_and_tokenizer, with_lora

    if args.ckpt_path:
        model, tokenizer, hp = policy_from_checkpoint(args.ckpt_path)
        args.model, args.lora = hp["model"], bool(hp.get("peft_config"))
    else:
        model, tokenizer = load_model_and_tokenizer(harness.resolve_model(args.model), "float32")
        if args.lora:
            model = with_lora(model, {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})
        perturb(model, scale=0.02 if not args.lora else 0.05)
    prompts = HELD_OUT
    if args.dataset:
        from lit_grpo.rollout.hf_dataset import dataset_prompts
        from lit_grpo.rollout.prompts import split_examples

        examples = dataset_prompts(args.dataset, args.prompt_column)
        _, held_out = split_examples(examples, args.val_size, args.data_seed)
        prompts = [examples[i].prompt for i in held_out]
    from lit_grpo.rollout.prompts import render_prompt

    ids = [render_prompt(tokenizer, p, args.system_prompt) for p in prompts]
    started = time.perf_counter()
    result = export_policy(model, tokenizer, args.out, dtype="float32", overwrite=True)
    export_s = time.perf_counter() - started
    ours = engine_greedy(model, tokenizer, ids, args.max_new_tokens)
    theirs = transformers_greedy(args.out, ids, args.max_new_tokens)
    weights = sum(f.stat().st_size for f in Path(args.out).glob("*.safetensors"))
    record = {"model": args.model, "lora": args.lora, "prompts": len(ids),
              "identical": ours == theirs["completions"] and not theirs["lit_grpo_imported"],
              "export_s": round(export_s, 2), "dir_bytes": result.bytes, "weights_bytes": weights,
              "tokens": [len(c) for c in ours],
              "ended_with_eos": sum(bool(c) and c[-1] in theirs["eos"] for c in ours)}
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
