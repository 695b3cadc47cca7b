#!/usr/bin/env bash
# Build the multimodal digits artefacts: the image codebook, the `draw` and `read` adapters
# (trained apart, on the train split of scikit-learn's digits), their publication in the default
# store, and the quality table + digit grid (benchmarks/results/multimodal_quality.json,
# docs/figures/multimodal_digits.png). These are the exact commands and seeds of the committed artefacts.
# The default store keeps the versions the `digits` route serves (draw@v3, read@v5); the
# intermediate adapters (draw@v2, read@v3, read@v4) are trained here on the way and published only
# with PUBLISH_INTERMEDIATE=1, for comparisons. Training notes and timings: benchmarks/HISTORY.md.
# A GPU takes well under a minute for each (DEVICE=cuda THREADS=).
# Usage: bash scripts/build_multimodal.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-${MOLORA_HOME:-$HOME/.cache/molora}/train/mm4}
STORE=deployments/default_store
SEED=0
DEVICE=${DEVICE:-cpu}  # the committed run: cpu
THREADS=${THREADS:-1}
PY=${PY:-.venv/bin/python}
MOLORA="$PY -m deployments.ops.cli"
BASE_CONFIG=${BASE_CONFIG:-$HOME/.cache/molora/models/smollm2-135m-instruct}
mkdir -p "$WORK"

# 0. The codebook: k-means (17 codes) on the train split's 2x2 patches, seeded; the committed
#    molora_runtime/multimodal/codebook.json is this output (a test checks it).
$PY -m molora_runtime.multimodal.codebook_fit

# 1. Two adapters, trained apart (in parallel, THREADS threads each). `draw` learns the image
#    codes (text -> image), `read` the text (image -> text); see molora_runtime/multimodal/digits.py.
#    LoRA r16 on all 7 projections of layers 8..29 (10 warm-up steps, cosine to 10%).
#    draw: lr 3e-3, the default 50/50 draw/mixed mixture, loss averaged over tokens.
#    read: lr 1e-3 (3e-3 collapsed to a constant digit), 85% pure reads, loss per example (a
#    read's digit then weighs as much as a mixed example's sentence).
COMMON="--rank 16 --alpha 32 --first-layer 8 --batch-size 8 --seed $SEED --device $DEVICE"
$MOLORA train adapter --domain draw --output "$WORK/draw" --steps 120 --lr 3e-3 $COMMON \
  ${THREADS:+--threads $THREADS} --checkpoint-every 20 > "$WORK/draw.log" 2>&1 &
$MOLORA train adapter --domain read --output "$WORK/read" --steps 400 --lr 1e-3 $COMMON \
  --loss-per-example --mixture read=0.85,mixed=0.15 \
  ${THREADS:+--threads $THREADS} --checkpoint-every 25 > "$WORK/read.log" 2>&1 &
wait
# 1b. read@v4: read@v3 continued the way the `digits` route serves it (draw@v2's LoRA frozen at
#     the image-code positions) with 5% draw prompts, so read opens an image when asked to draw.
$MOLORA train adapter --domain read --output "$WORK/read_routed" --steps 200 --lr 1e-3 \
  --rank 16 --alpha 32 --first-layer 8 --batch-size 8 --seed 1 --device $DEVICE \
  --loss-per-example --mixture read=0.8,draw=0.05,mixed=0.15 \
  --init-from "$WORK/read" --image-adapter "$WORK/draw" \
  ${THREADS:+--threads $THREADS} --checkpoint-every 25 > "$WORK/read_routed.log" 2>&1

# 1c. draw@v3: draw@v2 continued with its input image codes corrupted (--code-dropout, so the asked
#     digit pays at every code) and read@v4 frozen at the text positions on 80% of the steps.
V3="--rank 16 --alpha 32 --first-layer 8 --batch-size 8 --lr 3e-3 --device $DEVICE
  --loss-per-example --mixture draw=0.8,mixed=0.2 --text-adapter $WORK/read_routed
  --routed-fraction 0.8"
$MOLORA train adapter --domain draw --output "$WORK/draw_v3" --steps 300 --seed 3 $V3 \
  --code-dropout 0.65 --init-from "$WORK/draw" \
  ${THREADS:+--threads $THREADS} --checkpoint-every 50 > "$WORK/draw_v3.log" 2>&1
$MOLORA train adapter --domain draw --output "$WORK/draw_v3c" --steps 240 --seed 4 $V3 \
  --code-dropout 0.95 --init-from "$WORK/draw_v3" \
  ${THREADS:+--threads $THREADS} --checkpoint-every 40 > "$WORK/draw_v3c.log" 2>&1

# 1d. read@v5: read@v4 trained on with draw@v3 frozen at the image positions, as the route serves it.
RV5="--rank 16 --alpha 32 --first-layer 8 --batch-size 8 --lr 1e-3 --device $DEVICE
  --loss-per-example --mixture read=0.8,draw=0.05,mixed=0.15 --image-adapter $WORK/draw_v3c"
$MOLORA train adapter --domain read --output "$WORK/read_v5" --steps 60 --seed 5 $RV5 \
  --init-from "$WORK/read_routed" ${THREADS:+--threads $THREADS} --checkpoint-every 20 \
  > "$WORK/read_v5.log" 2>&1
$MOLORA train adapter --domain read --output "$WORK/read_v5b" --steps 100 --seed 6 $RV5 \
  --init-from "$WORK/read_v5" ${THREADS:+--threads $THREADS} --checkpoint-every 25 \
  > "$WORK/read_v5b.log" 2>&1

# 2. Publish (bf16 safetensors, checksummed manifests, base identity recorded); intermediates on request.
if [ "${PUBLISH_INTERMEDIATE:-0}" = "1" ]; then INTERMEDIATE=("draw v2 draw" "read v3 read" "read v4 read_routed"); else INTERMEDIATE=(); fi
for triple in "${INTERMEDIATE[@]}"; do
  read -r a version folder <<< "$triple"
  if [ -d "$STORE/adapters/$a/$version" ]; then continue; fi  # published already (immutable)
  $MOLORA adapters push "$WORK/$folder" --name "$a" --version "$version" --store $STORE \
    --base-config "$BASE_CONFIG" --no-progress \
    --description "SmolLM2-135M-Instruct LoRA r16 '$a' for 8x8 digit image codes (seed $SEED)"
done
if [ ! -d "$STORE/adapters/draw/v3" ]; then
  $MOLORA adapters push "$WORK/draw_v3c" --name draw --version v3 --store $STORE \
    --base-config "$BASE_CONFIG" --no-progress --description "SmolLM2-135M-Instruct LoRA r16 \
'draw' for 8x8 digit image codes (17-code VQ; from draw@v2: 300 steps seed 3 code-dropout 0.65, \
then 240 steps seed 4 code-dropout 0.95, 80% routed with read@v4)"
fi
if [ ! -d "$STORE/adapters/read/v5" ]; then
  $MOLORA adapters push "$WORK/read_v5b" --name read --version v5 --store $STORE \
    --base-config "$BASE_CONFIG" --no-progress --description "SmolLM2-135M-Instruct LoRA r16 \
'read' for 8x8 digit image codes (17-code VQ; from read@v4: 60 steps seed 5, then 100 steps seed \
6, draw@v3 frozen at the image positions)"
fi
# serve_config.yaml's `digits` route: image-code range -> draw@v3, text -> read@v5

# 3. The quality table, speed ratio and digit grid over the default store (draw@v3, read@v5).
$PY -m benchmarks.multimodal_quality --draw-per-digit 10 --read 100 --mixed 40 \
  --timing-prompts 16 --timing-rounds 3
