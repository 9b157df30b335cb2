#!/usr/bin/env bash
# The GPU checks of the training stack, in one run (issue 26): the CUDA tests (one GPU against the
# CPU, FSDP2 + expert parallelism over NCCL when there are >= 2 GPUs, FP8 against bf16 where the
# GPU has it) and the GPU benchmarks (MoE expert paths, a training step's MFU, decoding).
# Usage: bash launch/gpu_check.sh [OUT_DIR]   (JSON and logs go to OUT_DIR, default ./gpu_check)
set -u
out="${1:-gpu_check}"
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
python -m pytest -q -p no:cacheprovider tests/train/parallel/test_cuda.py tests/train/parallel/test_fp8.py \
    > "$out/tests.log" 2>&1
echo "tests rc=$?" | tee -a "$out/summary.txt"
for what in moe train decode; do
    ernie5 bench "$what" --device cuda --json > "$out/bench_$what.json" 2> "$out/bench_$what.err"
    echo "bench $what rc=$?" | tee -a "$out/summary.txt"
done
ernie5 bench train --device cuda --activation-checkpoint --json > "$out/bench_train_ac.json" 2> "$out/bench_train_ac.err"
echo "bench train --activation-checkpoint rc=$?" | tee -a "$out/summary.txt"
