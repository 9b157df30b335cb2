#!/usr/bin/env bash
# The GPU check, in one run on a bare GPU machine (issue 42): the CUDA tests (the model, its fast paths,
# KV cache and generation against the CPU; a training step, RL and FSDP2 + expert parallelism over
# NCCL; FP8 against bf16 where the GPU has it; a sweep on the GPU against the same sweep on the CPU)
# and the GPU benchmarks, each beside its bound measured on the same GPU: grouped-GEMM TFLOP/s against
# a dense bf16 matmul, training MFU at a shape that fills the GPU, decode tokens/s against the HBM
# bound, and forward parity with the CPU.
#
# Runs from the source tree (no install): the wheels the GPU image lacks (launch/gpu_wheels.sh
# downloads them into .whl/ on a machine with network) go into a private target folder on
# PYTHONPATH. No C++ is built (ERNIE5_KERNELS=off: the fused CPU kernels are not what is checked).
# Every step has a cap (timeout -k 5), so a hung NCCL collective cannot hold the machine; the caps
# sum to 7 minutes or less (--dry-run prints them). It ends with one verdict line
#   GPU CHECK PASS|FAIL: n passed, m failed, k skipped
# and OUT_DIR/summary.json (every test's outcome, every benchmark's figures beside its goal); exit 0
# only if nothing failed and something passed. No GPU visible: one line on stderr, exit 2.
#
# Usage: bash launch/gpu_check.sh [--dry-run] [OUT_DIR]   (default OUT_DIR: ./gpu_check)
set -u
cd "$(dirname "$0")/.."
repo=$(pwd)
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out="${1:-gpu_check}"
py=${PYTHON:-python3}
site=${ERNIE5_GPU_SITE:-/tmp/ernie5-gpu-site}

# name|cap seconds|command (run with bash -c from the repository root)
steps=(
  "gpu|10|$py -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'"
  "install|30|$py launch/gpu_summary.py install --wheels .whl --target $site"
  "tests_model|90|$py -m pytest -q -p no:cacheprovider --junitxml=$out/junit_tests_model.xml tests/model/test_cuda.py tests/runtime/test_distributed.py"
  "tests_train|120|$py -m pytest -q -p no:cacheprovider --junitxml=$out/junit_tests_train.xml tests/train/pretrain/parallel/test_cuda.py tests/train/pretrain/parallel/test_fp8.py"
  "tests_eval|60|$py -m pytest -q -p no:cacheprovider --junitxml=$out/junit_tests_eval.xml tests/evals/test_cuda.py tests/evals/test_sweep_device.py"
  "bench_parity|15|$py -m jobs.cli bench parity --device cuda --json"
  "bench_gemm|20|$py -m jobs.cli bench gemm --device cuda --shape gpu --json"
  "bench_train|40|$py -m jobs.cli bench train --device cuda --shape gpu_fill --batch-size 8 --seq-len 2048 --repeats 3 --json"
  "bench_decode|25|$py -m jobs.cli bench decode --device cuda --shape gpu_fill --repeats 2 --new-tokens 32 --json"
  "summary|5|$py launch/gpu_summary.py verdict $out"
)

if [ $dry = 1 ]; then
  total=0
  for s in "${steps[@]}"; do
    IFS='|' read -r name cap cmd <<<"$s"
    printf '%-13s cap %3ss  %s\n' "$name" "$cap" "$cmd"
    total=$((total + cap))
  done
  echo "total cap ${total}s"
  exit 0
fi

if ! $py -c 'import torch' 2>/dev/null; then
  echo "gpu_check: $py cannot import torch (set PYTHON to the interpreter that has it)" >&2
  exit 2
fi
if ! timeout -k 5 10 $py -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null; then
  echo "gpu_check: no CUDA GPU is visible to $py (torch.cuda.is_available() is False); run it on a GPU machine" >&2
  exit 2
fi
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 ERNIE5_KERNELS=off
export PYTHONPATH="$repo:$site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
: > "$out/steps.tsv"
for s in "${steps[@]:1}"; do
  IFS='|' read -r name cap cmd <<<"$s"
  if [ "$name" = summary ]; then
    timeout -k 5 "$cap" bash -c "$cmd"
    exit $?
  fi
  t0=$EPOCHREALTIME
  timeout -k 5 "$cap" bash -c "$cmd" > "$out/$name.out" 2> "$out/$name.err"
  rc=$?
  t1=$EPOCHREALTIME
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$cap" "$t0" "$t1" >> "$out/steps.tsv"
  echo "gpu_check: $name rc=$rc (cap ${cap}s)"
done
