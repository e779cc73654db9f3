#!/usr/bin/env bash
# Everything the rollout engine promises on a GPU, checked by one command on a CUDA machine (an H100 or H200 for
# the stated limits), offline: random-weight models of real architectures stand in for hub weights.
#
#   bash tools/gpu_check.sh [OUT_DIR]          (default: $OUT when set, else runs/gpu_check)
#
# 1. installs lit_grpo over the machine's own torch, transformers and lightning (no dependencies, no index);
# 2. the CUDA tests (graph replay equals the eager step, per-bucket graphs, one synchronisation per decode step,
#    bf16 schedule invariance, greedy parity with generate, the decode attention kernels against a float64
#    reference; the update: fused AdamW, a few waits on the device a step, the policy on the GPU after fit) and the
#    capturability tests;
# 3. python -m tools.gpu_targets: its four measurements (one repeat each) and one verdict per target line;
# 4. python -m tools.bench_grpo_memory: one whole GRPO step (bf16, G 8 and 64, g 8, infinite and full) for its peak
#    memory and its rollout's wall time (figures, no verdict);
# 5. python -m tools.bench_cast_weights: a bf16-mixed rollout's decode step with autocast's per-step casts against
#    the weights cast once (float32 master weights, G 32 on 32 slots, 512 tokens; figures and the samples' equality).
# Each part's output is written under OUT_DIR (device.txt, tests.txt, targets.txt, gpu_targets.json,
# gpu_targets.tgz, grpo_memory.json, cast_weights.json, and benchmarks.txt, what the two benchmarks print; each
# .txt as it is printed, so a kill without SIGTERM first keeps what a part had said): eight files, as many as a
# machine hands back
# (gpu_targets' four measurements, gpu_targets/NAME.json, are packed into gpu_targets.tgz once it ends, and stay
# loose where it is stopped midway: `python -m tools.gpu_targets --from-dir` judges them again). The exit status
# is not 0 when a test failed, a target was missed or a step broke. The whole script takes longer than 10 minutes:
# where one command may not, run its parts in separate commands on the same machine (the tests, then gpu_targets
# --only ..., then the two benchmarks).
set -uo pipefail
DIR="${1:-${OUT:-}}"
[ -z "$DIR" ] || DIR="$(realpath -m "$DIR")"  # a given folder is relative to where the command was typed
cd "$(dirname "$0")/.."
DIR="${DIR:-$PWD/runs/gpu_check}"               # the default, inside the repository
mkdir -p "$DIR"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
    | tee "$DIR/device.txt" || exit 1
# -o addopts=-ra: one process (the image may lack pytest-xdist, and the CUDA tests share one device); a test still
# running after 240 s has every thread's stack written to tests.txt, so a hang that runs into the command's time
# limit leaves where it hung
python3 -m pytest -q -p no:cacheprovider -o addopts=-ra -o faulthandler_timeout=240 tests/test_cuda_graph.py \
    tests/test_decode_step.py tests/test_decode_attention.py tests/test_cuda_update.py 2>&1 | tee "$DIR/tests.txt"
tests=${PIPESTATUS[0]}
PYTHONUNBUFFERED=1 python3 -m tools.gpu_targets --repeats 1 --json "$DIR/gpu_targets.json" 2>&1 | tee "$DIR/targets.txt"
targets=${PIPESTATUS[0]}
if [ -d "$DIR/gpu_targets" ]; then
    tar czf "$DIR/gpu_targets.tgz" -C "$DIR" gpu_targets && rm -r "$DIR/gpu_targets"
fi
PYTHONUNBUFFERED=1 python3 -m tools.bench_grpo_memory --model random:qwen3-1.7b --dtype bfloat16 --group-sizes 8,64 \
    --micro-group-size 8 --train-micro-batch-size 8 --strategies infinite,full --json "$DIR/grpo_memory.json" 2>&1 \
    | tee "$DIR/benchmarks.txt"
memory=${PIPESTATUS[0]}
PYTHONUNBUFFERED=1 python3 -m tools.bench_cast_weights --model random:qwen3-1.7b --device cuda --prompts 1 \
    --group-size 32 --max-new-tokens 512 --repeats 2 --json "$DIR/cast_weights.json" 2>&1 | tee -a "$DIR/benchmarks.txt"
cast=${PIPESTATUS[0]}
exit $(( tests || targets || memory || cast ))
