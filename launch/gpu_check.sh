#!/usr/bin/env bash
# The GPU checks of the training stack, in one run (issue 26): the CUDA tests (the model, its fast
# paths, KV cache and generation on the GPU against the CPU; one training step and RL on the GPU
# against the CPU; FSDP2 + expert parallelism over NCCL when there are >= 2 GPUs; FP8 against bf16
# where the GPU has it) and the GPU benchmarks (MoE expert paths, a training step's MFU in bf16, with
# activation checkpointing and with FP8, decoding).
# Every step has a time limit, so that a hung NCCL collective cannot hold the machine: under 10
# minutes in all at worst, about 5 on one H100.
# Usage: bash launch/gpu_check.sh [OUT_DIR]   (JSON and logs go to OUT_DIR, default ./gpu_check)
set -u
out="${1:-gpu_check}"
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
timeout -k 10 100 python -m pytest -q -p no:cacheprovider tests/model/test_cuda.py > "$out/tests_model.log" 2>&1
echo "tests model rc=$?" | tee -a "$out/summary.txt"
timeout -k 10 240 python -m pytest -q -p no:cacheprovider tests/train/pretrain/parallel/test_cuda.py \
    tests/train/pretrain/parallel/test_fp8.py > "$out/tests.log" 2>&1
echo "tests rc=$?" | tee -a "$out/summary.txt"
# bench moe at 64k tokens: at its CPU default (2048) a GPU layer is launch-bound, not GEMM-bound.
timeout -k 10 60 ernie5 bench moe --device cuda --tokens 65536 --json > "$out/bench_moe.json" 2> "$out/bench_moe.err"
echo "bench moe rc=$?" | tee -a "$out/summary.txt"
timeout -k 10 60 ernie5 bench train --device cuda --json > "$out/bench_train.json" 2> "$out/bench_train.err"
echo "bench train rc=$?" | tee -a "$out/summary.txt"
timeout -k 10 60 ernie5 bench decode --device cuda --json > "$out/bench_decode.json" 2> "$out/bench_decode.err"
echo "bench decode rc=$?" | tee -a "$out/summary.txt"
timeout -k 10 40 ernie5 bench train --device cuda --activation-checkpoint --json > "$out/bench_train_ac.json" \
    2> "$out/bench_train_ac.err"
echo "bench train --activation-checkpoint rc=$?" | tee -a "$out/summary.txt"
timeout -k 10 40 ernie5 bench train --device cuda --fp8 --json > "$out/bench_train_fp8.json" 2> "$out/bench_train_fp8.err"
echo "bench train --fp8 rc=$?" | tee -a "$out/summary.txt"
