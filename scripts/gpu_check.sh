#!/usr/bin/env bash
# GPU checks for the routed-LoRA and paged-attention kernels (and any other @gpu check in
# tests/gpu/), then the kernel benchmarks. Needs one NVIDIA GPU, torch and triton; no network, no
# pytest.
#   scripts/gpu_check.sh [OUT_DIR]     (default benchmarks/results)
#   QUICK=1 scripts/gpu_check.sh       reduced benchmark grid
# Writes OUT_DIR/gpu_checks.json, OUT_DIR/kernels_cuda.json, OUT_DIR/paged_attention_cuda.json,
# OUT_DIR/decode_step_cuda.json and OUT_DIR/gpu_check_summary.json.
# Time: checks capped at 150 s, routed-LoRA kernel benchmark at 200 s and paged-attention
# benchmark at 40 s (both stop their grids early and keep what they measured), engine decode-step
# benchmark at 90 s: 8 minutes in the worst case.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${1:-benchmarks/results}"
mkdir -p "$OUT"
if [[ -x .venv/bin/python ]]; then PY="${PYTHON:-.venv/bin/python}"; else PY="${PYTHON:-python3}"; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET MOLORA_KERNEL_BACKEND

"$PY" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)' || exit 2

start=$(date +%s)
timeout 150 "$PY" -m tests.gpu.run_checks --out "$OUT/gpu_checks.json"
checks_rc=$?

bench_args=(--device cuda --max-seconds 170 --out "$OUT/kernels_cuda.json")
if [[ "${QUICK:-0}" == "1" ]]; then bench_args+=(--quick); fi
timeout 200 "$PY" benchmarks/kernels.py "${bench_args[@]}"
bench_rc=$?

# Paged decode attention (Triton) vs contiguous-cache SDPA / bmm, with achieved K/V bandwidth.
paged_args=(--device cuda --max-seconds 30 --out "$OUT/paged_attention_cuda.json")
if [[ "${QUICK:-0}" == "1" ]]; then paged_args+=(--quick); fi
timeout 40 "$PY" -m benchmarks.paged_attention "${paged_args[@]}"
paged_rc=$?
[[ $bench_rc -eq 0 ]] && bench_rc=$paged_rc

# Engine level: decode-step p50/p99 with CUDA graphs vs eager, steady vs adapter churn.
timeout 90 "$PY" -m benchmarks.decode_step --device cuda --batch 32 --steps 30 --out "$OUT/decode_step_cuda.json"
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
(out / "gpu_check_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
PYEOF
[[ $checks_rc -eq 0 && $bench_rc -eq 0 ]]
