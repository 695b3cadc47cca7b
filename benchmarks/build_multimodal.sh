#!/usr/bin/env bash
# Build the multimodal digits artefacts: the image codebook, the `draw` and `read` adapters
# (trained apart, on the train split of scikit-learn's digits), their publication in the default
# store, and the quality table + digit grid (benchmarks/results/multimodal_quality.json,
# multimodal_digits.png). These are the exact commands and seeds of the committed artefacts.
# Measured on the shared 2-core CPU box (nice 19, one thread per run, both runs in parallel):
#   draw  120 steps x 8: 8.9 CPU-minutes (user+sys; 27.7 min wall under contention)
#   read  150 steps x 8: 10.3 CPU-minutes (29.5 min wall); 19.2 CPU-minutes in all
# A GPU takes well under a minute for each (DEVICE=cuda THREADS=).
# Usage: bash benchmarks/build_multimodal.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-${MOLORA_HOME:-$HOME/.cache/molora}/train/mm2}
STORE=deployments/default_store
VERSION=${VERSION:-v2}  # versions are immutable: a rebuild publishes a new one (v1: branch only)
SEED=0
DEVICE=${DEVICE:-cpu}  # the committed run: cpu
THREADS=${THREADS:-1}
PY=${PY:-.venv/bin/python}
MOLORA="$PY -m deployments.cli"
BASE_CONFIG=${BASE_CONFIG:-$HOME/.cache/molora/models/smollm2-135m-instruct}
mkdir -p "$WORK"

# 0. The codebook: k-means (17 codes) on the train split's 2x2 patches, seeded; the committed
#    molora_runtime/multimodal/codebook.json is this output (a test checks it).
$PY -m molora_runtime.multimodal.codebook

# 1. Two adapters, trained apart (in parallel, THREADS threads each). `draw` learns the image
#    codes (text -> image), `read` the text (image -> text); see molora_runtime/multimodal/digits.py.
#    LoRA r16 on all 7 projections of layers 8..29, lr 3e-3 (10 warm-up steps, cosine to 10%).
COMMON="--rank 16 --alpha 32 --first-layer 8 --batch-size 8 --lr 3e-3 --seed $SEED --device $DEVICE"
$MOLORA train adapter --domain draw --output "$WORK/draw" --steps 120 $COMMON \
  ${THREADS:+--threads $THREADS} --checkpoint-every 20 > "$WORK/draw.log" 2>&1 &
$MOLORA train adapter --domain read --output "$WORK/read" --steps 150 $COMMON \
  ${THREADS:+--threads $THREADS} --checkpoint-every 25 > "$WORK/read.log" 2>&1 &
wait

# 2. Publish (bf16 safetensors, checksummed manifests, base identity recorded).
for a in draw read; do
  $MOLORA adapters push "$WORK/$a" --name "$a" --version $VERSION --store $STORE \
    --base-config "$BASE_CONFIG" --no-progress \
    --description "SmolLM2-135M-Instruct LoRA r16 '$a' for 8x8 digit image codes (seed $SEED)"
done

# 3. The quality table, speed ratio and digit grid.
# The committed run used reduced counts (the shared box was saturated): ~35 min wall there.
$PY -m benchmarks.multimodal_quality --adapter draw="$WORK/draw" --adapter read="$WORK/read" \
  --draw-per-digit 3 --read 60 --mixed 30 --timing-prompts 16 --timing-rounds 1
