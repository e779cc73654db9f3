"""Slots that fit a KV budget for a Gemma 3 1B-shaped config, with every layer priced at every column (no ring)
and as ``micro_group_size: auto`` prices a sliding layer's ring of its window (``kv_row_bytes``), for continuous
sampling and for the default strategy, whose park share is priced as its budget counts parked tails: at their KV, a
ring layer's at most its window (``park_fraction x kv_row_bytes(max_new_tokens)``).

Pure arithmetic on the config (no weights, no device): ``python -m tools.ring_slots`` prints the markdown table of
docs/engine.md's sliding-window paragraph.
"""

from __future__ import annotations

import math

from transformers import Gemma3TextConfig

from lit_grpo.sampling.memory_budget import (auto_micro_group_size, kv_bytes_per_token, kv_prefill_bytes,
                                             kv_row_bytes, kv_slot_bytes)
from lit_grpo.scheduling.config import InfiniteSchedulerConfig

#: Gemma 3 1B's shape: 26 layers (every sixth full attention), one key/value head of 256, window 512.
GEMMA3_1B = dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=256, sliding_window=512, vocab_size=262144)
PROMPT_TOKENS, PROMPTS, GROUP_SIZE, DTYPE = 256, 8, 512, "bfloat16"
ROWS = [(1024, 8), (4096, 8), (4096, 20), (8192, 8)]  # (max_new_tokens, budget in GiB)


def every_column_slots(config, budget: int, new_tokens: int, park_fraction: float) -> tuple[int, int]:
    """(slot bytes, slots) with every layer holding every position of a slot and a prefix, and the park share
    (``park_fraction`` of the slot's generation KV, as ``auto_micro_group_size`` prices it)."""
    per_token = kv_bytes_per_token(config, DTYPE)
    slot = per_token * (PROMPT_TOKENS + new_tokens) + math.ceil(per_token * new_tokens * park_fraction)
    held = PROMPTS * per_token * PROMPT_TOKENS + kv_prefill_bytes(config, DTYPE, PROMPT_TOKENS, PROMPTS, new_tokens)
    return slot, (budget - held) // slot


def main() -> None:
    config = Gemma3TextConfig(**GEMMA3_1B)
    mib = 2**20
    # the default strategy ("infinite") parks preempted samples within its park budget, counted in KV
    _, park = InfiniteSchedulerConfig().parked_kv_bounds(max(new_tokens for new_tokens, _ in ROWS))
    print("| strategy | max_new_tokens | KV budget | slot, every column | slot, ring | slots, every column "
          "| slots, ring | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for strategy, park_fraction in (("continuous", 0.0), (f"infinite (park budget {park:g})", park)):
        for new_tokens, gib in ROWS:
            budget = gib * 2**30
            old_slot, old = every_column_slots(config, budget, new_tokens, park_fraction)
            slot = (kv_slot_bytes(config, DTYPE, PROMPT_TOKENS, new_tokens)
                    + math.ceil(park_fraction * kv_row_bytes(config, DTYPE, new_tokens)))
            slots = auto_micro_group_size(config, DTYPE, budget, PROMPT_TOKENS, new_tokens, GROUP_SIZE, PROMPTS,
                                          park_fraction=park_fraction)
            print(f"| {strategy} | {new_tokens} | {gib} GiB | {old_slot / mib:.1f} MiB | {slot / mib:.1f} MiB | "
                  f"{old} | {slots} | {slots / old:.1f}x |")


if __name__ == "__main__":
    main()
