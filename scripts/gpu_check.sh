#!/usr/bin/env bash
# GPU check v2: the routed-LoRA, fused-group LoRA and paged-attention kernels vs their twins
# (compiled, eager and in CUDA graphs; every @gpu check in tests/gpu/, incl. graph replay under
# adapter churn), then the benchmarks: routed-LoRA kernels (achieved HBM bandwidth of the decode
# kernel, per-token vs 4 per-sequence passes at 2,048 tokens d=4,096), paged attention, and the
# engine decode step (CUDA graphs vs eager p50/p99 and tok/s, 4 adapters and learned top-2 vs base,
# churn) on a SmolLM2-shaped and a randomly initialised Llama-3-8B-shaped model (2 layers), and
# the mixtures on the GPU (gate telemetry without host syncs, rank pools in graphs). Needs one
# NVIDIA GPU, torch and triton (+ pydantic, safetensors for the engine parts); no network, no pytest.
#   scripts/gpu_check.sh [OUT_DIR]     (default benchmarks/results)
#   QUICK=1 scripts/gpu_check.sh       reduced benchmark grid
#   DRY_RUN=1 scripts/gpu_check.sh     every Python entry point with --help only (runs on CPU)
# Writes OUT_DIR/gpu_checks.json, kernels_cuda.json, paged_attention_cuda.json,
# decode_step_cuda.json and gpu_check_summary.json.
# Time caps: checks 150 s, kernel benchmark 150 s (target shapes first), paged attention 40 s,
# decode steps 150 s (each keeps what it measured): 8.2 minutes at worst.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${1:-benchmarks/results}"
mkdir -p "$OUT"
if [[ -x .venv/bin/python ]]; then PY="${PYTHON:-.venv/bin/python}"; else PY="${PYTHON:-python3}"; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET MOLORA_KERNEL_BACKEND

if [[ "${DRY_RUN:-0}" == "1" ]]; then
    for entry in "-m tests.gpu.run_checks" "-m benchmarks.kernels" "-m benchmarks.paged_attention" "-m benchmarks.decode_step"; do
        # shellcheck disable=SC2086
        "$PY" $entry --help >/dev/null || { echo "entry point failed: $entry"; exit 1; }
    done
    echo "dry run: every entry point parses --help"
    exit 0
fi

"$PY" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)' || exit 2

start=$(date +%s)
timeout 150 "$PY" -m tests.gpu.run_checks --out "$OUT/gpu_checks.json"
checks_rc=$?

bench_args=(--device cuda --max-seconds 130 --out "$OUT/kernels_cuda.json")
if [[ "${QUICK:-0}" == "1" ]]; then bench_args+=(--quick); fi
timeout 150 "$PY" -m benchmarks.kernels "${bench_args[@]}"
bench_rc=$?

# Paged decode attention (Triton) vs contiguous-cache SDPA / bmm, with achieved K/V bandwidth.
paged_args=(--device cuda --max-seconds 30 --out "$OUT/paged_attention_cuda.json")
if [[ "${QUICK:-0}" == "1" ]]; then paged_args+=(--quick); fi
timeout 40 "$PY" -m benchmarks.paged_attention "${paged_args[@]}"
paged_rc=$?
[[ $bench_rc -eq 0 ]] && bench_rc=$paged_rc

# Engine level: decode-step p50/p99 and tok/s with CUDA graphs vs eager (base, 4 adapters, learned
# top-2, churn) on the SmolLM2 shape and 2 layers of the Llama-3-8B shape, at batch 32 and 128.
timeout 150 "$PY" -m benchmarks.decode_step --device cuda --shape smollm2 --shape llama3-8b:2 --batch 32,128 --steps 20 --out "$OUT/decode_step_cuda.json"
step_rc=$?
[[ $bench_rc -eq 0 ]] && bench_rc=$step_rc

elapsed=$(( $(date +%s) - start ))
"$PY" - "$OUT" "$checks_rc" "$bench_rc" "$elapsed" <<'PYEOF'
import json, sys
from pathlib import Path
out, checks_rc, bench_rc, elapsed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
bench = out / "kernels_cuda.json"
paged = out / "paged_attention_cuda.json"
summary = {
    "checks_rc": checks_rc,
    "bench_rc": bench_rc,
    "seconds": elapsed,
    "checks": json.loads((out / "gpu_checks.json").read_text())["counts"] if (out / "gpu_checks.json").exists() else None,
    "targets": json.loads(bench.read_text()).get("targets") if bench.exists() else None,
    "paged_attention": json.loads(paged.read_text()).get("summary") if paged.exists() else None,
}
step = out / "decode_step_cuda.json"
summary["decode_step"] = json.loads(step.read_text()).get("targets") if step.exists() else None
(out / "gpu_check_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
PYEOF
[[ $checks_rc -eq 0 && $bench_rc -eq 0 ]]
