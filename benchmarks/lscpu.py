"""Which CPU a benchmark result holds for: `lscpu`'s model name and flags, for every result JSON.

The same code is fastest on different kernels on an AVX2-only CPU and on one with AVX512-BF16 or
AMX, so a number without the CPU it was taken on cannot be compared with another.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

# The flags that decide which GEMM kernels a CPU runs well, listed first in a result.
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def _lscpu_fields() -> dict[str, str]:
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        out = subprocess.run(
            ["lscpu", "--json"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
        return {
            row["field"].rstrip(":"): str(row.get("data", ""))
            for row in json.loads(out).get("lscpu", [])
        }
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):  # no lscpu: the kernel's view
        text = Path("/proc/cpuinfo").read_text()
        for key, name in (("model name", "Model name"), ("flags", "Flags")):
            found = re.search(rf"^{key}\s*:\s*(.+)$", text, re.M)
            if found:
                fields[name] = found.group(1).strip()
    return fields


def lscpu() -> dict[str, Any]:
    """`{"model": ..., "key_flags": [...], "flags": [...], "cpus": n, "platform": ...}`."""
    fields = _lscpu_fields()
    flags = fields.get("Flags", "").split()
    return {
        "model": fields.get("Model name") or platform.processor() or platform.machine(),
        "key_flags": [f for f in KEY_FLAGS if f in flags],
        "flags": flags,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
