#!/usr/bin/env bash
# Run on the dev machine (with access to PyPI): download the wheels the GPU image lacks, for CPython
# 3.12 on manylinux x86-64, into .whl/ (ignored by git), for launch/gpu_check.sh to install into a
# private target folder there. The image (Python 3.12, torch 2.11, CUDA 13) has the rest of the
# project's dependencies (accelerate, pandas, pyarrow, matplotlib, transformers, safetensors,
# tokenizers, scipy, scikit-learn, tensorboard, pytest, hypothesis); what it lacks:
#   jiwer (+ rapidfuzz): WER/CER of the speech tasks (without it they are skipped);
#   torchao: the FP8 training path (without it the FP8 tests skip);
# lm-eval and datasets are left out: their dependency trees include packages with no wheels, and the
# project reads its data files without datasets and skips lm-eval tasks without lm-eval.
# Usage: bash launch/gpu_wheels.sh [--dry-run]   (prints what it would fetch, fetching nothing)
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(jiwer==4.0.0 rapidfuzz==3.14.6 torchao==0.18.0)
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl)
for p in "${platforms[@]}"; do args+=(--platform "$p"); done
if [ "${1:-}" = "--dry-run" ]; then
  echo "python3 -m pip download ${args[*]} ${wheels[*]}"
  exit 0
fi
mkdir -p .whl
python3 -m pip download --quiet "${args[@]}" "${wheels[@]}"
ls -l .whl
du -sh .whl
