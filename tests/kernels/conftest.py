"""Kernel tests run the Triton kernels on CPU through the interpreter.

`TRITON_INTERPRET` is read when a kernel is decorated, i.e. when `kernels.triton_*` is first
imported; `kernels` itself never imports triton, so setting it here (before any test module of
this directory is imported) is early enough even if another directory imported triton first.

The repo root goes first on sys.path: `tests/conftest.py` puts `tests/` there, where this
directory would otherwise be found as a namespace package named `kernels`, shadowing the real
one (a project-wide `pythonpath = ["."]` in the pytest settings is the lasting fix).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
if getattr(sys.modules.get("kernels"), "__file__", "") is None:  # namespace shadow imported
    del sys.modules["kernels"]
