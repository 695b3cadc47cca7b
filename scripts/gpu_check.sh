#!/usr/bin/env bash
# GPU check v3: the one prepared run for a lent GPU (H100/H200), offline, at most 8 minutes.
# 1. correctness: every @gpu check in tests/gpu/ (Triton kernels vs twins, fused-group LoRA,
#    paged attention, CUDA-graph decode equals eager and survives adapter churn, mixtures);
# 2. routed-LoRA kernels: per shape, device time in a captured CUDA graph (`graph_device_us`,
#    L2-rotated inputs) and eager wall time per call (`eager_wall_us`); HBM fraction from the
#    graph figure only; per-token vs 4 per-sequence passes at 2,048 tokens d=4,096;
# 3. paged decode attention vs contiguous SDPA / bmm;
# 4. engine decode step, SmolLM2, Qwen2.5-1.5B and Llama-3-8B widths (8 layers), b=1/32/128,
#    graphs and eager: base, 4 adapters, learned top-2, vocab route, a step with an adapter load;
#    step/forward p50/p99 between CUDA events, tok/s, bytes per step, share of the HBM roofline.
# Random weights are made on the device; Triton's and Inductor's caches live in build/gpu_cache
# (gitignored), so a second run on the same machine skips the JIT. Needs torch and triton (+
# pydantic, safetensors, the engine's imports); no network, no pytest.
#   scripts/gpu_check.sh [OUT_DIR]     (default benchmarks/results; on a lent machine pass
#                                      "$OUT", the folder whose files come back)
#   QUICK=1 scripts/gpu_check.sh       reduced kernel grid
#   DRY_RUN=1 scripts/gpu_check.sh     on a CPU: every entry point parses --help, then the kernel
#                                      and decode-step benchmarks' --dry-run into a temp dir
#   MOLORA_GIT_COMMIT=<sha>            the commit every JSON names (the device copy has no .git)
# Writes OUT_DIR/gpu_checks.json, kernels_cuda.json, paged_attention_cuda.json,
# decode_step_cuda.json and gpu_check_summary.json.
# Each step has its own `timeout` and stops itself earlier (--max-seconds), keeping what it
# measured: import 60 s, checks 120 s, kernels 100 s, paged attention 35 s, decode steps 150 s:
# 465 s at worst, about 6 minutes in a typical run. The end-to-end `serve run
# serve_config.gpu.yaml` client is not run here: that config needs S3, Ray and the prepared
# SmolLM2 weights, none of which the offline device has.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${1:-benchmarks/results}"
if [[ -x .venv/bin/python ]]; then PY="${PYTHON:-.venv/bin/python}"; else PY="${PYTHON:-python3}"; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$ROOT/build/gpu_cache/triton}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$ROOT/build/gpu_cache/inductor}"
unset TRITON_INTERPRET MOLORA_KERNEL_BACKEND

if [[ "${DRY_RUN:-0}" == "1" ]]; then
    for entry in "-m tests.gpu.run_checks" "-m benchmarks.kernels" "-m benchmarks.paged_attention" "-m benchmarks.decode_step"; do
        # shellcheck disable=SC2086
        "$PY" $entry --help >/dev/null || { echo "entry point failed: $entry"; exit 1; }
    done
    echo "dry run: every entry point parses --help"
    dry="$(mktemp -d)"
    timeout 120 "$PY" -m benchmarks.kernels --device cpu --dry-run --out "$dry/kernels_cpu.json" >/dev/null || { echo "kernels dry run failed"; exit 1; }
    timeout 120 "$PY" -m benchmarks.decode_step --device cpu --dry-run --out "$dry/decode_step_cpu.json" >/dev/null || { echo "decode_step dry run failed"; exit 1; }
    echo "dry run: kernels and decode_step ran their GPU code path on the CPU ($dry)"
    exit 0
fi

mkdir -p "$OUT" "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR"
timeout 60 "$PY" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)' || exit 2

start=$(date +%s)
timeout 120 "$PY" -m tests.gpu.run_checks --out "$OUT/gpu_checks.json"
checks_rc=$?

bench_args=(--device cuda --max-seconds 80 --out "$OUT/kernels_cuda.json")
if [[ "${QUICK:-0}" == "1" ]]; then bench_args+=(--quick); fi
timeout 100 "$PY" -m benchmarks.kernels "${bench_args[@]}"
bench_rc=$?

# Paged decode attention (Triton) vs contiguous-cache SDPA / bmm, with achieved K/V bandwidth.
paged_args=(--device cuda --max-seconds 25 --out "$OUT/paged_attention_cuda.json")
if [[ "${QUICK:-0}" == "1" ]]; then paged_args+=(--quick); fi
timeout 35 "$PY" -m benchmarks.paged_attention "${paged_args[@]}"
paged_rc=$?
[[ $bench_rc -eq 0 ]] && bench_rc=$paged_rc

# Engine level: every shape, batch, mode and case; cases past --max-seconds are skipped rows.
timeout 150 "$PY" -m benchmarks.decode_step --device cuda --shape smollm2 --shape qwen2.5-1.5b --shape llama3-8b --layers 8 --batch 1,32,128 --steps 20 --max-seconds 130 --out "$OUT/decode_step_cuda.json"
step_rc=$?
[[ $bench_rc -eq 0 ]] && bench_rc=$step_rc

elapsed=$(( $(date +%s) - start ))
"$PY" - "$OUT" "$checks_rc" "$bench_rc" "$elapsed" <<'PYEOF'
import json, sys
from pathlib import Path
out, checks_rc, bench_rc, elapsed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def read(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else {}

step = read("decode_step_cuda.json")
summary = {
    "checks_rc": checks_rc,
    "bench_rc": bench_rc,
    "seconds": elapsed,
    "checks": read("gpu_checks.json").get("counts"),
    "targets": read("kernels_cuda.json").get("targets"),
    "paged_attention": read("paged_attention_cuda.json").get("summary"),
    "decode_step": step.get("targets"),
    "decode_step_skipped": sum(1 for r in step.get("rows", []) if r.get("skipped")),
}
(out / "gpu_check_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
PYEOF
[[ $checks_rc -eq 0 && $bench_rc -eq 0 ]]
