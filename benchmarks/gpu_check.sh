#!/usr/bin/env bash
# The GPU check: the real Trainer step (benchmarks/gpu_check.py) for transformer_big in bf16 at ZeRO-0, -2
# and -3, on one GPU and then on every local GPU (with the scaling efficiency), on WMT-shaped batches of a
# generated corpus. One table row each: tokens/s per GPU, model TFLOP/s, MFU, peak memory. Installs nothing.
#   bash benchmarks/gpu_check.sh [gpu_check.py options, e.g. --steps 50 --max-tokens 8192 --profile DIR]
# PAIRS (default 200000) and VOCAB (default 32000) size the generated corpus and its sentencepiece model.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
deepspeed=${DEEPSPEED:-deepspeed}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log="$work/log"
"$python" benchmarks/synthetic_corpus.py --out "$work/raw" --pairs "${PAIRS:-200000}"
"$python" -m dsmt.cli prepare --train "$work/raw/train" --valid "$work/raw/valid" --out "$work/data" \
    --vocab-size "${VOCAB:-32000}" >"$log" 2>&1 || { tail -n 20 "$log" >&2; exit 1; }
gpus=$("$python" -c "import torch; print(max(torch.cuda.device_count(), 1))")
echo "| GPU | GPUs | model | ds_config | precision | tokens per GPU batch | src+tgt tokens/s per GPU | model TFLOP/s per GPU | MFU | peak memory | scaling efficiency |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for n in $(printf '%s\n' 1 "$gpus" | uniq); do
    for stage in zero0 zero2 zero3; do
        extra=(--result "$work/$stage-$n.json")
        [ "$n" -gt 1 ] && extra+=(--baseline "$work/$stage-1.json")
        if ! "$deepspeed" --num_gpus "$n" --master_port $((29500 + RANDOM % 1000)) benchmarks/gpu_check.py \
                --data "$work/data" --deepspeed_config "ds_configs/$stage.json" "${extra[@]}" "$@" >"$log" 2>&1; then
            tail -n 20 "$log" >&2
            exit 1
        fi
        grep '^|' "$log"
    done
done
