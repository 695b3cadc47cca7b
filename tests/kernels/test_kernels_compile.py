"""The Triton kernels compile for sm_90 (H100/H200) on this GPU-less machine.

Runs compile_kernels.py in a subprocess, because this test process has TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None, reason="no NVIDIA backend"
)
def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_kernels", "90", "bf16,fp32"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "compiled 28 kernel variants" in run.stdout
