"""The box a benchmark ran on: CPU model and flags decide the GEMM path, so every result records them."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

# The flags that pick a CPU path (AVX2 panel GEMM, bf16 in hardware); runs differing here differ cell for cell.
KEY_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _cpu_fields() -> tuple[str | None, list[str]]:
    """(model name, flags) from `lscpu`, else from /proc/cpuinfo; (None, []) where neither exists."""
    text = ""
    if shutil.which("lscpu"):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False)
        text = out.stdout
    model = re.search(r"^Model name:\s*(.+)$", text, re.M)
    flags = re.search(r"^Flags:\s*(.+)$", text, re.M)
    if (model is None or flags is None) and Path("/proc/cpuinfo").is_file():
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = model or re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
        flags = flags or re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
    return (model.group(1).strip() if model else None, flags.group(1).split() if flags else [])


def machine_info() -> dict[str, Any]:
    """CPU model name, all its flags, the deciding ones, core count, platform and Python."""
    model, flags = _cpu_fields()
    return {
        "cpu": model,
        "isa": [f for f in KEY_FLAGS if f in flags],
        "flags": flags,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
