#!/usr/bin/env bash
# Build the multimodal digits artefacts: the `draw` and `read` adapters (trained apart, on the
# train split of scikit-learn's digits), their publication in the default store, and the quality
# table + digit grid (benchmarks/results/multimodal_quality.json, multimodal_digits.png).
# These are the exact commands and seeds of the committed artefacts. On the 2-core CPU
# development machine (one thread per training run, both in parallel, shared with other work):
# draw 17 min, read 11 min (wall, in parallel, 1 thread each, sharing the 2 cores with other jobs;
# about half that on 2 free cores), the evaluation ~10 min. A GPU takes well under a
# minute for each (DEVICE=cuda THREADS=).
# Usage: bash benchmarks/build_multimodal.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-${MOLORA_HOME:-$HOME/.cache/molora}/train/mm}
STORE=deployments/default_store
VERSION=${VERSION:-v1}  # versions are immutable: a rebuild publishes a new one
SEED=0
DEVICE=${DEVICE:-auto}
THREADS=${THREADS:-1}
PY=${PY:-.venv/bin/python}
MOLORA="$PY -m deployments.cli"
BASE_CONFIG=${BASE_CONFIG:-$HOME/.cache/molora/models/smollm2-135m-instruct}
mkdir -p "$WORK"

# 1. Two adapters, trained apart (in parallel, THREADS threads each). `draw` learns the image
#    codes (text -> image), `read` the text (image -> text); see molora_runtime/multimodal/digits.py.
$MOLORA train adapter --domain draw --output "$WORK/draw" --rank 8 --alpha 16 --first-layer 16 \
  --steps 64 --batch-size 8 --lr 5e-3 --seed $SEED --device "$DEVICE" ${THREADS:+--threads $THREADS} \
  --checkpoint-every 16 > "$WORK/draw.log" 2>&1 &
$MOLORA train adapter --domain read --output "$WORK/read" --rank 8 --alpha 16 --first-layer 16 \
  --steps 40 --batch-size 8 --lr 1e-2 --seed $SEED --device "$DEVICE" ${THREADS:+--threads $THREADS} \
  --checkpoint-every 20 > "$WORK/read.log" 2>&1 &
wait

# 2. Publish (bf16 safetensors, checksummed manifests, base identity recorded).
for a in draw read; do
  $MOLORA adapters push "$WORK/$a" --name "$a" --version $VERSION --store $STORE \
    --base-config "$BASE_CONFIG" --no-progress \
    --description "SmolLM2-135M-Instruct LoRA r8 '$a' for 8x8 digit image codes (seed $SEED)"
done

# 3. The quality table, speed ratio and digit grid.
$PY -m benchmarks.multimodal_quality --adapter draw="$WORK/draw" --adapter read="$WORK/read"
