#!/usr/bin/env bash
# Build the multimodal digits artefacts: the image codebook, the `draw` and `read` adapters
# (trained apart, on the train split of scikit-learn's digits), their publication in the default
# store, and the quality table + digit grid (benchmarks/results/multimodal_quality.json,
# multimodal_digits.png). These are the exact commands and seeds of the committed artefacts.
# Published: draw@v2 (this script's first revision), read@v3 and read@v4 (issue 19: read@v2
# collapsed to a constant digit; v3 = per-example loss on a read-heavy mixture, v4 = v3 trained
# as the `digits` route serves it). Measured on the shared 2-core CPU box (one thread per run,
# user+sys from /usr/bin/time -v, others' jobs running at higher priority):
#   draw@v2  120 steps x 8: 8.9 CPU-minutes (nice 19; 27.7 min wall under contention)
#   read@v3  400 steps x 8: 23.5 CPU-minutes (nice 5; 31.6 min wall)
#   read@v4  200 steps x 8 from read@v3: 13.1 CPU-minutes (nice 5; 25.6 min wall)
# read@v4's published description says "seed 0" (the loop below writes $SEED for every adapter);
# it was trained with --seed 1 on top of read@v3 (seed 0). Published versions are immutable, so
# its manifest keeps that text.
# Not published: the draw@v3 attempt (DRAW_V3=1, step 1c; issue 19), 22.6 CPU-minutes in all:
#   stage a  150 steps x 8 from draw@v2: 11.1 CPU-minutes (nice 19; 15.9 min wall)
#   stage b  160 of 260 steps x 8 from stage a: 11.3 CPU-minutes (nice 19; 24.1 min wall,
#            ~5 of them paused while checkpoints were judged)
# A GPU takes well under a minute for each (DEVICE=cuda THREADS=).
# Usage: bash benchmarks/build_multimodal.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-${MOLORA_HOME:-$HOME/.cache/molora}/train/mm4}
STORE=deployments/default_store
# versions are immutable: a rebuild publishes new ones (v1: branch only; read@v2 was the first read)
DRAW_VERSION=${DRAW_VERSION:-v2}
READ_VERSION=${READ_VERSION:-v4}
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
# 1b. read@v4: read@v3 continued the way the `digits` route serves it: draw@v2's LoRA (frozen)
#     at the image-code positions, read's elsewhere (read@v3 read 65% alone, 17.5% routed), with
#     5% draw prompts so read opens an image with BOI when asked to draw (v3 never did).
$MOLORA train adapter --domain read --output "$WORK/read_routed" --steps 200 --lr 1e-3 \
  --rank 16 --alpha 32 --first-layer 8 --batch-size 8 --seed 1 --device $DEVICE \
  --loss-per-example --mixture read=0.8,draw=0.05,mixed=0.15 \
  --init-from "$WORK/read" --image-adapter "$WORK/draw" \
  ${THREADS:+--threads $THREADS} --checkpoint-every 25 > "$WORK/read_routed.log" 2>&1

# 1c. (DRAW_V3=1; not published) draw@v3 attempt. draw@v2 draws the mean digit: teacher-forced on
#     60 eval draws its loss is the same with the wrong digit asked (23.72 vs 23.81 nats per
#     image), because a drawing's first codes already tell the digit, so only the first few
#     predictions need the prompt. --code-dropout replaces that share of the answer's *input*
#     codes by random codes (labels kept), so the asked digit pays at every code; --text-adapter
#     (read@v4, frozen) serves the text positions on --routed-fraction of the steps, as the
#     `digits` route does, the other steps train draw alone; 80% pure draws, loss per example.
#     Stage b was stopped at its step-160 checkpoint (the box's deadline) and --stop-at 160 wrote
#     the adapter there (on the 260-step cosine schedule). Right-vs-wrong-digit gap: 0.09 nats
#     after stage a, 1.04 at b's step 120, 1.77 at 160 (the digit starts to count), but judged on
#     80 sampled eval draws (seed 0, T=0.7) it drew 16.2% alone / 12.5% through the route, vs
#     draw@v2's 5.0% / 15.0%, so draw@v2 stays in the `digits` route. The committed run used the
#     published draw@v2 and read@v4 files (same sha256 as $WORK/draw and $WORK/read_routed).
if [ "${DRAW_V3:-0}" = 1 ]; then
  V3="--rank 16 --alpha 32 --first-layer 8 --batch-size 8 --lr 3e-3 --device $DEVICE
    --loss-per-example --mixture draw=0.8,mixed=0.2 --text-adapter $WORK/read_routed"
  $MOLORA train adapter --domain draw --output "$WORK/draw_v3a" --steps 150 --seed 2 $V3 \
    --code-dropout 0.5 --routed-fraction 0.5 --init-from "$WORK/draw" \
    ${THREADS:+--threads $THREADS} --checkpoint-every 25 > "$WORK/draw_v3a.log" 2>&1
  # the run itself went without --stop-at, was killed after its step-160 checkpoint, and was
  # rerun with it (resumed there, trained nothing, wrote the adapter): the same weights as this
  $MOLORA train adapter --domain draw --output "$WORK/draw_v3" --steps 260 --stop-at 160 \
    --seed 3 $V3 --code-dropout 0.65 --routed-fraction 0.6 --init-from "$WORK/draw_v3a" \
    ${THREADS:+--threads $THREADS} --checkpoint-every 40 > "$WORK/draw_v3.log" 2>&1
fi

# 2. Publish (bf16 safetensors, checksummed manifests, base identity recorded).
for triple in "draw $DRAW_VERSION draw" "read v3 read" "read $READ_VERSION read_routed"; do
  read -r a version folder <<< "$triple"
  if [ -d "$STORE/adapters/$a/$version" ]; then continue; fi  # published already (immutable)
  $MOLORA adapters push "$WORK/$folder" --name "$a" --version "$version" --store $STORE \
    --base-config "$BASE_CONFIG" --no-progress \
    --description "SmolLM2-135M-Instruct LoRA r16 '$a' for 8x8 digit image codes (seed $SEED)"
done

# 3. The quality table, speed ratio and digit grid.
# The committed run used reduced counts (the shared box was busy) on the published adapters
# (default store: draw@v2, read@v4): 7.2 min wall there.
$PY -m benchmarks.multimodal_quality --draw-per-digit 3 --read 50 --mixed 30 \
  --timing-prompts 8 --timing-rounds 2
