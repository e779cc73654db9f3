#!/usr/bin/env bash
# tools.compare_trl's GPU cells, by one command on a CUDA machine, offline: lit_grpo against TRL's GRPOTrainer at
# G 8 / 32 / 64 with 512 new tokens (--shape gpu_gsweep), random:qwen3-1.7b with float32 master weights under
# bf16-mixed, 8-row micro-batches and 8 slots at every G.
#
#   bash tools/gpu_compare_trl.sh WHEEL_DIR [OUT_DIR] [ORDER] [FLAG ...]   (ORDER: --order's value, default lit,trl;
#   FLAGs go to tools.compare_trl, e.g. --lit-slots all: lit_grpo with one slot per sample)
#
# WHEEL_DIR holds what a CUDA image with torch, transformers, lightning, accelerate, pandas and pyarrow lacks (TRL,
# jsonargparse, LightningCLI's parser, reasoning-gym and their needs), made by `bash tools/gpu_wheels.sh` where pip
# reaches an index (into .whl/, for the GPU machine's Python). reasoning-gym imports pycosat, a C extension built on
# the machine, for its zebra puzzles, which the demo's task never uses: where it cannot be built, a stand-in that
# raises when called takes its place, and the script says so.
#
# 1. installs the wheels into a private folder put first on PYTHONPATH, and lit_grpo (editable, no dependencies);
# 2. python -m tools.compare_trl --shape gpu_gsweep (or the shape a FLAG names, e.g. --shape gpu_long) with
#    --trl-python python3 (one environment for both sides), each run stopped after RUN_TIMEOUT_S seconds (default
#    480) and recorded as a timeout with the steps it finished.
# OUT_DIR (default $OUT when set, else runs/gpu_compare_trl) gets NAME.json, NAME.md and NAME.runs.tgz
# (compare_trl's --out-dir; NAME is the shape, then _slots-N for a --lit-slots N other than fixed, _gA-B for
# --group-sizes A,B and _lit or _trl for an ORDER of one system: gpu_gsweep_g32-64_lit), so calls one after the other
# into one OUT_DIR (other G, other slots, the two sides) keep each other's files. NAME.runs.tgz holds the runs'
# configs, records and logs, and device.txt, the GPU this call ran on. live.log, one for all calls, is the run in
# flight's output as it is written (a SIGKILL, which nothing can trap, keeps it); a run's output goes into its call's
# NAME.runs.tgz once it ends, so the next call may start the file anew. The first three are written anew after every
# run, and once more on SIGTERM (a command's time limit: the run in flight is then recorded as "stopped", with the
# steps it finished and its log), so a command killed by `timeout` keeps every run it finished and what the last one
# left. The script exits with compare_trl's status, its files written first: 1 where a run failed (not a timeout or
# out of memory, which are recorded outcomes), 143 on a SIGTERM. The script passes a SIGTERM it gets on to
# compare_trl and waits for it. TRL's three runs took about 100 s each on an H200 (start-up included); where one
# command may not run 10 minutes, run the two sides in two commands on the same machine (ORDER lit, then trl).
set -uo pipefail
WHEELS="$(realpath "${1:?usage: bash tools/gpu_compare_trl.sh WHEEL_DIR [OUT_DIR] [ORDER] [FLAG ...]}")"
DIR="${2:-${OUT:-}}"
[ -z "$DIR" ] || DIR="$(realpath -m "$DIR")"
ORDER="${3:-lit,trl}"
shift $(( $# < 3 ? $# : 3 ))
cd "$(dirname "$0")/.."
DIR="${DIR:-$PWD/runs/gpu_compare_trl}"
mkdir -p "$DIR"
SITE="$(mktemp -d)"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl || exit 1
if ls "$WHEELS"/pycosat-*.tar.gz >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" "$WHEELS"/pycosat-*.tar.gz \
        || { echo "pycosat could not be built: a stand-in that raises takes its place"
             printf 'def solve(*args, **kwargs):\n    raise RuntimeError("pycosat was not built here")\n\nitersolve = solve\n' \
                 > "$SITE/pycosat.py"; }
fi
mkdir -p "$SITE/runs"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
# into compare_trl's work dir, so into this call's NAME.runs.tgz
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
    | tee "$SITE/runs/device.txt" || exit 1
# the FLAGs come last: a --shape among them replaces gpu_gsweep (argparse keeps the last). In the background, so that
# a SIGTERM to this script is passed on at once (bash runs a trap only once its foreground command has ended).
python3 -m tools.compare_trl --trl-python python3 --shape gpu_gsweep --model random:qwen3-1.7b --device cuda \
    --precision bf16-mixed --threads 4 --order "$ORDER" --timeout-s "${RUN_TIMEOUT_S:-480}" \
    --work-dir "$SITE/runs" --out-dir "$DIR" "$@" &
compare=$!
trap 'kill -TERM "$compare" 2>/dev/null' TERM INT
wait "$compare"
status=$?
while kill -0 "$compare" 2>/dev/null; do  # a trapped signal ended the wait, not compare_trl: it is saving
    wait "$compare"
    status=$?
done
exit $status
