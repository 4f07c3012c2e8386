#!/usr/bin/env bash
# One NVIDIA GPU (H100/H200), a few minutes, installs nothing: transformer_big in bf16 at ZeRO-0 and
# ZeRO-2 on synthetic token batches; one table row each (tokens/s, TFLOP/s, MFU, peak memory).
#   bash benchmarks/gpu_check.sh [--steps 200 --batch 256 --length 64 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
echo "| GPU | model | ds_config | precision | batch (sentences × tokens) | src+tgt tokens/s | model TFLOP/s | MFU | peak memory |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for stage in zero0 zero2; do
    if ! deepspeed --num_gpus 1 --master_port $((29500 + RANDOM % 1000)) benchmarks/gpu_check.py \
            --deepspeed_config "ds_configs/$stage.json" "$@" >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        exit 1
    fi
    grep '^|' "$log"
done
