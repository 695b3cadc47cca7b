#!/usr/bin/env bash
# Rebuild the embedded default store (deployments/default_store) from scratch: the four domain
# adapters, the learned composition over them, then the quality table. These are the exact
# commands (and seeds) that produced the committed store; on CPU with 2 free cores the whole
# script takes about 50 minutes, on a GPU a few minutes (pass DEVICE=cuda THREADS=).
# Usage: bash scripts/build_default_store.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
# Cards record commands with the home folder as `~`, so the default keeps them machine-free.
WORK=${1:-${MOLORA_HOME:-$HOME/.cache/molora}/train}
STORE=deployments/default_store
VERSION=${VERSION:-v2}  # versions are immutable: a rebuild publishes a new one
SEED=0
DEVICE=${DEVICE:-auto}
THREADS=${THREADS:-1}
MOLORA=".venv/bin/python -m deployments.ops.cli"
DOMAINS=(arithmetic sorting counting reversal)
mkdir -p "$WORK/adapters"

# 1. One LoRA per domain, trained independently (in parallel: each uses THREADS threads).
declare -A STEPS=([arithmetic]=200 [sorting]=250 [counting]=120 [reversal]=200)
for d in "${DOMAINS[@]}"; do
  $MOLORA train adapter --domain "$d" --output "$WORK/adapters/$d" --rank 16 --alpha 32 \
    --first-layer 8 --steps "${STEPS[$d]}" --batch-size 8 --lr 3e-3 --seed $SEED --device "$DEVICE" \
    ${THREADS:+--threads $THREADS} --checkpoint-every 20 > "$WORK/adapters/$d.log" 2>&1 &
done
wait

# 2. The router: only the per-layer gates train, on mixed + single-domain prompts.
ARGS=()
for d in "${DOMAINS[@]}"; do ARGS+=(--adapter "$d@$VERSION=$WORK/adapters/$d"); done
# It runs alone, so it takes every core (torch's default thread count).
$MOLORA train router "${ARGS[@]}" --output "$WORK/molora" --top-k 2 --steps 200 --batch-size 8 \
  --lr 2e-2 --balance-weight 0.01 --route-supervision 1.0 --seed $SEED --device "$DEVICE" \
  --checkpoint-every 25

# 3. Publish (bf16 safetensors, checksummed manifests).
for d in "${DOMAINS[@]}"; do
  $MOLORA adapters push "$WORK/adapters/$d" --name "$d" --version $VERSION --store $STORE \
    --description "SmolLM2-135M-Instruct LoRA r16 for reasoning-gym $d (seed $SEED)" --no-progress
done
$MOLORA compositions push "$WORK/molora" --name molora --version $VERSION --store $STORE \
  --description "learned top-2 router over ${DOMAINS[*]} (seed $SEED)" --no-progress

# 4. The quality table, JSON and gate plot (benchmarks/results/).
.venv/bin/python -m benchmarks.quality --store $STORE
